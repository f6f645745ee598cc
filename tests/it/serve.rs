//! `gturbo serve`: the OpenAI and Anthropic APIs over an install.
//!
//! - The official `openai` and `anthropic` Python clients (a venv from
//!   `scripts/venv.sh serve`, pinned in scripts/requirements/requirements-serve.txt)
//!   ask SmolLM2 the capital of France, plain and streamed, and a shared long system
//!   prompt is reused: `cached_tokens` / `cache_read_input_tokens` equal its length,
//!   and the answers equal an uncached server's at temperature 0. Skipped (never
//!   passed) without the venv or the snapshot, unless the run is strict.
//! - reqwest drives the error table and the API-key rule on a tiny qwen3 replica, and
//!   the queue bound and a client's disconnect on SmolLM2.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gturbo::runtime::text::{ChatMessage, TextCodec};
use gturbo_testkit::skip::require_or_skip;
use serde_json::{Value, json};

use crate::runtime::{qwen3_install, smollm2};
use crate::support::cli::gturbo;
use crate::support::temp_dir;

/// A running `gturbo serve`, killed on drop.
struct Server {
    child: Child,
    base: String,
    _log: tempfile::TempDir,
}

impl Server {
    /// `gturbo serve DIR --port 0 --backend cpu EXTRA…`, once it prints its address.
    fn start(dir: &Path, extra: &[&str]) -> Server {
        Server::try_start(dir, extra, &[]).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_start(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Result<Server, String> {
        let log = temp_dir();
        let err = std::fs::File::create(log.path().join("stderr")).unwrap();
        let mut cmd = gturbo();
        cmd.env_remove(gturbo::env::GTURBO_API_KEY);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .arg("serve")
            .arg(dir)
            .args(["--port", "0", "--backend", "cpu"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap();
        let mut line = String::new();
        let _ = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
        let stderr = || std::fs::read_to_string(log.path().join("stderr")).unwrap_or_default();
        let Some(base) = line.trim().strip_prefix("listening on ") else {
            let status = child.wait().unwrap();
            return Err(format!(
                "serve exited ({status}) printing {line:?}; stderr: {}",
                stderr()
            ));
        };
        Ok(Server {
            base: base.to_string(),
            child,
            _log: log,
        })
    }

    /// What it wrote on stderr so far.
    fn stderr(&self) -> String {
        std::fs::read_to_string(self._log.path().join("stderr")).unwrap_or_default()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A JSON body (the workspace's reqwest has no `json` feature).
trait BodyJson {
    fn body_json(self, v: &Value) -> Self;
}

impl BodyJson for reqwest::RequestBuilder {
    fn body_json(self, v: &Value) -> Self {
        self.header("content-type", "application/json")
            .body(v.to_string())
    }
}

/// A runtime for the reqwest client (with the crypto provider reqwest's
/// `rustls-no-provider` build needs before any client is made).
fn rt() -> tokio::runtime::Runtime {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Runtime::new().unwrap()
}

/// The answer to a request: its status and JSON body (`Null` if not JSON).
async fn send(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let body = r.bytes().await.unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

// ------------------------------------------------------------ Python SDK clients

/// The venv's `python3` with the openai and anthropic clients, made once per run.
fn sdk_python(test: &str) -> Option<&'static PathBuf> {
    static PY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let made = PY.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let o = Command::new("bash")
            .current_dir(root)
            .args([
                "-c",
                "source scripts/venv.sh serve >&2 && python3 -c 'import openai, anthropic' && command -v python3",
            ])
            .output()
            .map_err(|e| format!("cannot run bash: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "the serve venv (scripts/venv.sh serve: openai, anthropic) cannot be made: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
    });
    require_or_skip(test, made.as_ref().map_err(Clone::clone))
}

/// `scripts/peers/serve_sdk.py BASE MODEL MODE [SYSTEM]`'s JSON.
fn sdk(py: &Path, server: &Server, mode: &str, system: Option<&str>) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/serve_sdk.py");
    let mut c = Command::new(py);
    c.arg(script).args([&server.base, "smollm2", mode]);
    c.args(system);
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "serve_sdk.py {mode}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn sdk_clients_ask_smollm2_the_capital_of_france_plain_and_streamed() {
    const TEST: &str = "sdk_clients_ask_smollm2_the_capital_of_france_plain_and_streamed";
    let Some((_, _, bf16)) = smollm2(TEST) else {
        return;
    };
    let Some(py) = sdk_python(TEST) else {
        return;
    };
    let server = Server::start(bf16, &["--alias", "smollm2"]);
    let v = sdk(py, &server, "france", None);
    eprintln!("{v:#}");
    for way in ["openai", "openai_stream", "anthropic", "anthropic_stream"] {
        let text = v[way]["text"].as_str().unwrap();
        assert!(text.contains("Paris"), "{way} answered {text:?}");
    }
    assert_eq!(v["openai"]["text"], v["openai_stream"]["text"]);
    assert_eq!(v["anthropic"]["text"], v["openai"]["text"]);
    assert_eq!(v["openai"]["finish"], "stop");
    assert_eq!(v["anthropic"]["finish"], "end_turn");
    assert_eq!(v["openai_stream"]["finish"], "stop");
    assert_eq!(v["anthropic_stream"]["finish"], "end_turn");
    // The stream's events in the documented order, the usage in message_delta.
    let events: Vec<&str> = v["anthropic_stream"]["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .filter(|e| !matches!(*e, "text" | "content_block_delta"))
        .collect();
    assert_eq!(
        events,
        [
            "message_start",
            "content_block_start",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ],
        "{v}"
    );
    let a = &v["anthropic_stream"];
    assert_eq!(
        a["input_tokens"].as_u64().unwrap() + a["cache_read_input_tokens"].as_u64().unwrap(),
        v["openai"]["prompt_tokens"].as_u64().unwrap(),
        "new plus reused tokens are the prompt: {v}"
    );
    assert_eq!(a["cache_creation_input_tokens"], 0);
    assert_eq!(a["output_tokens"], v["openai"]["completion_tokens"]);
    assert_eq!(v["models"][0], "snapshot", "the install's model id");
}

/// The SDKs' tool-use shapes (tools, an earlier call, its result) are accepted and
/// answered, plain and streamed, through both APIs. SmolLM2's template has no tools:
/// they reach it in the system prompt; it answers in text from the result (a model
/// that calls is covered by the parser's tests in `src/cli/serve/tools.rs`).
#[test]
fn sdk_tool_use_conversations_are_accepted_and_answered() {
    const TEST: &str = "sdk_tool_use_conversations_are_accepted_and_answered";
    let Some((_, _, bf16)) = smollm2(TEST) else {
        return;
    };
    let Some(py) = sdk_python(TEST) else {
        return;
    };
    let server = Server::start(bf16, &["--alias", "smollm2"]);
    let v = sdk(py, &server, "tools", None);
    eprintln!("{v:#}");
    for way in ["openai", "openai_stream", "anthropic", "anthropic_stream"] {
        // At temperature 0 it answers from the tool's result.
        let text = v[way]["text"].as_str().unwrap_or_default();
        assert!(text.contains("Sunny, 21"), "{way}: {v}");
    }
    assert_eq!(v["openai"]["text"], v["openai_stream"]["text"]);
    assert_eq!(v["openai"]["finish"], v["openai_stream"]["finish"]);
    assert_eq!(v["anthropic"]["text"], v["anthropic_stream"]["text"]);
    assert_eq!(v["anthropic"]["finish"], v["anthropic_stream"]["finish"]);
    // The tools count as prompt tokens.
    assert!(v["count"].as_u64().unwrap() > 50, "{v}");
}

/// A system prompt long enough that reusing it is worth something.
fn long_system() -> String {
    let rule = "Answer in one short sentence, naming the city first and nothing else.";
    format!(
        "You are a geography tutor for a class of students. {}",
        [rule; 24].join(" ")
    )
}

#[test]
fn a_shared_system_prompt_is_reused_and_reported_with_the_uncached_answers() {
    const TEST: &str = "a_shared_system_prompt_is_reused_and_reported_with_the_uncached_answers";
    let Some((_, _, bf16)) = smollm2(TEST) else {
        return;
    };
    let Some(py) = sdk_python(TEST) else {
        return;
    };
    let system = long_system();
    // The shared prefix: the template's rendering of the system message alone.
    let codec = TextCodec::load(bf16).unwrap();
    let shared = codec
        .encode_chat(
            &codec
                .render_chat(&[ChatMessage::new("system", system.as_str())], false)
                .unwrap(),
        )
        .unwrap()
        .len() as u64;
    assert!(shared > 200, "{shared}");
    let cached = Server::start(bf16, &["--alias", "smollm2"]);
    let v = sdk(py, &cached, "shared", Some(&system));
    let uncached = Server::start(bf16, &["--alias", "smollm2", "--cache-bytes", "0"]);
    let u = sdk(py, &uncached, "second", Some(&system));
    eprintln!("cached server: {v:#}\nuncached server: {u:#}\nshared prefix {shared}");
    assert_eq!(v["openai France"]["cached_tokens"], 0, "{v}");
    assert!(
        v["openai France"]["text"]
            .as_str()
            .unwrap()
            .contains("Paris")
    );
    for city in ["Italy", "Spain"] {
        let (o, a) = (
            &v[format!("openai {city}")],
            &v[format!("anthropic {city}")],
        );
        assert_eq!(o["cached_tokens"], shared, "{city}: {v}");
        assert_eq!(a["cache_read_input_tokens"], shared, "{city}: {v}");
        assert_eq!(
            a["input_tokens"].as_u64().unwrap() + shared,
            o["prompt_tokens"].as_u64().unwrap(),
            "input_tokens counts only the new tokens"
        );
        // The same tokens as a server that reuses nothing.
        let (uo, ua) = (
            &u[format!("openai {city}")],
            &u[format!("anthropic {city}")],
        );
        assert_eq!(uo["cached_tokens"], 0);
        assert_eq!(ua["cache_read_input_tokens"], 0);
        assert_eq!(o["text"], uo["text"], "{city}");
        assert_eq!(a["text"], ua["text"], "{city}");
        assert_eq!(o["completion_tokens"], uo["completion_tokens"], "{city}");
    }
    assert!(
        v["anthropic France"]["text"]
            .as_str()
            .unwrap()
            .contains("Paris")
    );
}

// ------------------------------------------------------------ errors and auth (reqwest)

/// POST a chat completion to `addr` that declares `declared` bytes and sends 1 KiB of
/// them; the status and JSON body of the answer.
fn oversized_request(addr: &str, declared: usize) -> (u16, Value) {
    use std::io::{Read as _, Write as _};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer sekrit\r\n\
         Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    );
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(&[b' '; 1024]).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the JSON body is complete (the server may keep the connection).
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
        if answer.ends_with(b"}") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&answer).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// One row of the error table: what is wrong, the body and path, the status and the
/// error type expected.
type Case<'a> = (&'a str, (Option<Value>, &'a str), u16, &'a str);

/// Each hostile or wrong request, the status it gets and the error type in its API's
/// shape (OpenAI: `error.type`, Anthropic: `error.type` under `type: error`).
#[test]
fn bad_requests_get_each_apis_error_shape_and_status() {
    let tmp = temp_dir();
    let dir = qwen3_install(tmp.path(), 7);
    let server = Server::start(&dir, &["--alias", "tiny", "--api-key", "sekrit"]);
    let long = "word ".repeat(5000);
    let openai = |body: Value| (Some(body), "/v1/chat/completions");
    let anth = |body: Value| (Some(body), "/v1/messages");
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<Case> = vec![
        (
            "unknown model",
            openai(json!({"model": "gpt-4o", "messages": user})),
            404,
            "invalid_request_error",
        ),
        (
            "unknown model",
            anth(json!({"model": "claude", "max_tokens": 5, "messages": user})),
            404,
            "not_found_error",
        ),
        (
            "empty messages",
            openai(json!({"model": "tiny", "messages": []})),
            400,
            "invalid_request_error",
        ),
        (
            "empty messages",
            anth(json!({"model": "tiny", "max_tokens": 5, "messages": []})),
            400,
            "invalid_request_error",
        ),
        (
            "prompt past the context",
            openai(json!({"model": "tiny", "messages": [{"role": "user", "content": long}]})),
            400,
            "invalid_request_error",
        ),
        (
            "prompt past the context",
            anth(
                json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": long}]}),
            ),
            400,
            "invalid_request_error",
        ),
        (
            "system prompt past the context",
            openai(json!({"model": "tiny", "messages": [
                {"role": "system", "content": long}, {"role": "user", "content": "hi"}
            ]})),
            400,
            "invalid_request_error",
        ),
        (
            "temperature 3",
            openai(json!({"model": "tiny", "messages": user, "temperature": 3})),
            400,
            "invalid_request_error",
        ),
        (
            "temperature 1.5",
            anth(json!({"model": "tiny", "max_tokens": 5, "messages": user, "temperature": 1.5})),
            400,
            "invalid_request_error",
        ),
        (
            "top_p 0",
            openai(json!({"model": "tiny", "messages": user, "top_p": 0})),
            400,
            "invalid_request_error",
        ),
        (
            "max_tokens 0",
            openai(json!({"model": "tiny", "messages": user, "max_tokens": 0})),
            400,
            "invalid_request_error",
        ),
        (
            "max_tokens -5",
            anth(json!({"model": "tiny", "max_tokens": -5, "messages": user})),
            400,
            "invalid_request_error",
        ),
        (
            "no max_tokens",
            anth(json!({"model": "tiny", "messages": user})),
            400,
            "invalid_request_error",
        ),
        (
            "top_k 0",
            anth(json!({"model": "tiny", "max_tokens": 5, "messages": user, "top_k": 0})),
            400,
            "invalid_request_error",
        ),
        (
            "n 2",
            openai(json!({"model": "tiny", "messages": user, "n": 2})),
            400,
            "invalid_request_error",
        ),
        (
            "5 stop strings",
            openai(json!({"model": "tiny", "messages": user, "stop": ["a", "b", "c", "d", "e"]})),
            400,
            "invalid_request_error",
        ),
        (
            "tool_choice required",
            openai(json!({"model": "tiny", "messages": user, "tool_choice": "required"})),
            400,
            "invalid_request_error",
        ),
        (
            "a tool not a function",
            openai(json!({"model": "tiny", "messages": user, "tools": [{"type": "web"}]})),
            400,
            "invalid_request_error",
        ),
        (
            "tool_choice any",
            anth(
                json!({"model": "tiny", "max_tokens": 5, "messages": user, "tool_choice": {"type": "any"}}),
            ),
            400,
            "invalid_request_error",
        ),
        (
            "tool_use from the user",
            anth(
                json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
            ),
            400,
            "invalid_request_error",
        ),
        (
            "image part",
            openai(
                json!({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            ),
            400,
            "invalid_request_error",
        ),
        (
            "image block",
            anth(
                json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            ),
            400,
            "invalid_request_error",
        ),
        (
            "system role in messages",
            anth(
                json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
            ),
            400,
            "invalid_request_error",
        ),
        (
            "messages not a list",
            openai(json!({"model": "tiny", "messages": "hi"})),
            400,
            "invalid_request_error",
        ),
        (
            "model a number",
            anth(json!({"model": 5, "max_tokens": 5, "messages": user})),
            400,
            "invalid_request_error",
        ),
        (
            "huge max_tokens",
            openai(json!({"model": "tiny", "messages": user, "max_tokens": 1e300})),
            400,
            "invalid_request_error",
        ),
        (
            "unknown path",
            (Some(json!({})), "/v1/completions"),
            404,
            "invalid_request_error",
        ),
        (
            "unknown path",
            (Some(json!({})), "/v1/messages/batches"),
            404,
            "not_found_error",
        ),
    ];
    rt().block_on(async {
        let client = reqwest::Client::new();
        let post = |path: &str| client.post(server.url(path)).bearer_auth("sekrit");
        let mut table = Vec::new();
        for (what, (body, path), status, ty) in &cases {
            let req = post(path).header("content-type", "application/json");
            let req = match body {
                Some(b) => req.body(b.to_string()),
                None => req,
            };
            let (got, v) = send(req).await;
            let anthropic = path.starts_with("/v1/messages");
            let got_ty = if anthropic {
                assert_eq!(v["type"], "error", "{what}: {v}");
                v["error"]["type"].clone()
            } else {
                v["error"]["type"].clone()
            };
            table.push(format!(
                "{path} {what}: {got} {got_ty} ({})",
                v["error"]["message"]
            ));
            assert_eq!(
                (got, got_ty.as_str().unwrap_or("")),
                (*status, *ty),
                "{what} on {path}: {v}"
            );
        }
        // Malformed bodies, in both shapes.
        for (path, shape) in [
            ("/v1/chat/completions", "openai"),
            ("/v1/messages", "anthropic"),
        ] {
            for body in [&b"{\"model\":"[..], b"\xff\xfe\x00garbage", b""] {
                let (got, v) = send(post(path).body(body.to_vec())).await;
                assert_eq!(got, 400, "{path} {body:?}: {v}");
                // Anthropic's shape says `type: error` at the top; OpenAI's has none.
                let top = if shape == "anthropic" { "error" } else { "" };
                assert_eq!(v["type"].as_str().unwrap_or(""), top, "{v}");
                let ty = &v["error"]["type"];
                assert_eq!(ty, "invalid_request_error", "{v}");
                table.push(format!("{path} malformed {body:?}: {got} {ty}"));
            }
        }
        // A body that says it is over the bound: 413 before any of it is read (the
        // client sends 1 KiB of its 33 MiB and waits for the answer).
        let (got, v) = tokio::task::spawn_blocking({
            let addr = server.base.trim_start_matches("http://").to_string();
            move || oversized_request(&addr, 33 << 20)
        })
        .await
        .unwrap();
        assert_eq!(got, 413, "{v}");
        assert_eq!(v["error"]["code"], "request_too_large", "{v}");
        table.push(format!(
            "/v1/chat/completions 33 MiB body: {got} {}",
            v["error"]["type"]
        ));
        // The prompt-length error names the context.
        let (_, v) =
            send(post("/v1/chat/completions").body_json(
                &json!({"model": "tiny", "messages": [{"role": "user", "content": long}]}),
            ))
            .await;
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        // After all that the server still answers.
        let (got, v) = send(post("/v1/chat/completions").body_json(
            &json!({"model": "tiny", "messages": user, "max_tokens": 3, "temperature": 0}),
        ))
        .await;
        assert_eq!(got, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        let (got, v) = send(
            post("/v1/messages/count_tokens")
                .body_json(&json!({"model": "tiny", "messages": user})),
        )
        .await;
        assert_eq!(got, 200, "{v}");
        assert!(v["input_tokens"].as_u64().unwrap() > 2, "{v}");
        eprintln!("{}", table.join("\n"));
    });
}

#[test]
fn the_api_key_is_checked_on_every_request_and_required_beyond_loopback() {
    let tmp = temp_dir();
    let dir = qwen3_install(tmp.path(), 7);
    // Beyond loopback without a key: refused before listening.
    let o = gturbo()
        .env_remove(gturbo::env::GTURBO_API_KEY)
        .args(["serve"])
        .arg(&dir)
        .args(["--host", "0.0.0.0", "--port", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--api-key"),
        "{o:?}"
    );
    // With the key in the environment it listens.
    let wide = Server::try_start(
        &dir,
        &["--host", "0.0.0.0"],
        &[(gturbo::env::GTURBO_API_KEY, "k1")],
    )
    .unwrap();
    assert!(wide.base.starts_with("http://0.0.0.0:"), "{}", wide.base);
    drop(wide);
    let server = Server::try_start(&dir, &[], &[(gturbo::env::GTURBO_API_KEY, "k1")]).unwrap();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let models = || c.get(server.url("/v1/models"));
        let msgs = || {
            c.post(server.url("/v1/messages/count_tokens")).body(
                json!({"model": "q3.gturbo", "messages": [{"role": "user", "content": "hi"}]})
                    .to_string(),
            )
        };
        let (s, v) = send(models()).await;
        assert_eq!(
            (s, v["error"]["type"].as_str()),
            (401, Some("authentication_error")),
            "{v}"
        );
        let (s, _) = send(models().bearer_auth("wrong")).await;
        assert_eq!(s, 401);
        let (s, _) = send(models().bearer_auth("k1")).await;
        assert_eq!(s, 200);
        let (s, _) = send(models().header("x-api-key", "k1")).await;
        assert_eq!(s, 200);
        let (s, v) = send(msgs()).await;
        assert_eq!(s, 401);
        assert_eq!(
            (v["type"].as_str(), v["error"]["type"].as_str()),
            (Some("error"), Some("authentication_error")),
            "{v}"
        );
        let (s, v) = send(msgs().header("x-api-key", "k1")).await;
        assert_eq!(s, 200, "{v}");
        // The key is checked before anything else: a wrong path without it is 401.
        let (s, _) = send(c.post(server.url("/v1/messages")).header("x-api-key", "k2")).await;
        assert_eq!(s, 401);
    });
}

// ------------------------------------------------------------ queue and disconnects

/// Read the SSE body until `n` `data:` lines have arrived.
async fn read_events(r: &mut reqwest::Response, n: usize) -> String {
    let mut seen = String::new();
    while seen.matches("data:").count() < n {
        match r.chunk().await.unwrap() {
            Some(c) => seen.push_str(&String::from_utf8_lossy(&c)),
            None => break,
        }
    }
    seen
}

#[test]
fn a_full_queue_is_429_and_a_client_that_leaves_frees_the_worker() {
    const TEST: &str = "a_full_queue_is_429_and_a_client_that_leaves_frees_the_worker";
    let Some((_, _, bf16)) = smollm2(TEST) else {
        return;
    };
    let server = Server::start(bf16, &["--alias", "smollm2", "--queue", "1"]);
    rt().block_on(async {
        let c = reqwest::Client::new();
        let ask = |max: u32, stream: bool| {
            c.post(server.url("/v1/chat/completions"))
                .body_json(&json!({
                    "model": "smollm2", "max_tokens": max, "stream": stream, "temperature": 0,
                    "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                }))
        };
        // A long streamed answer occupies the worker.
        let mut long = ask(2000, true).send().await.unwrap();
        assert_eq!(long.status(), 200);
        let first = read_events(&mut long, 3).await;
        assert!(first.contains("chat.completion.chunk"), "{first}");
        // One more waits in the queue; the next is refused.
        let queued = tokio::spawn(ask(4, false).send());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (s, v) = send(ask(4, false)).await;
        assert_eq!(s, 429, "{v}");
        assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
        // The streaming client leaves: its generation stops and the queued one runs.
        let t = Instant::now();
        drop(long);
        let r = queued.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
        let waited = t.elapsed();
        eprintln!("the queued request finished {waited:?} after the stream was dropped");
        // 2,000 tokens take minutes on this build; 4 take seconds.
        assert!(waited < Duration::from_secs(60), "{waited:?}");
    });
}

// ------------------------------------------------------------ hybrid model, concurrency

/// Ask `questions` after `system` over both APIs at temperature 0: per question, the
/// OpenAI and Anthropic answers (text, tokens, reused tokens).
async fn ask_after_system(
    server: &Server,
    model: &str,
    system: &str,
    questions: &[&str],
) -> Vec<Value> {
    let c = reqwest::Client::new();
    let mut out = Vec::new();
    for q in questions {
        let (s, o) = send(c.post(server.url("/v1/chat/completions")).body_json(&json!({
            "model": model, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
        })))
        .await;
        assert_eq!(s, 200, "{o}");
        let (s, a) = send(c.post(server.url("/v1/messages")).body_json(&json!({
            "model": model, "max_tokens": 12, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": q}],
        })))
        .await;
        assert_eq!(s, 200, "{a}");
        out.push(json!({
            "openai": o["choices"][0]["message"]["content"],
            "openai_tokens": o["usage"]["completion_tokens"],
            "cached": o["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt": o["usage"]["prompt_tokens"],
            "anthropic": a["content"][0]["text"],
            "anthropic_tokens": a["usage"]["output_tokens"],
            "read": a["usage"]["cache_read_input_tokens"],
            "input": a["usage"]["input_tokens"],
        }));
    }
    out
}

/// Flash-Next (gated delta net state, indexed attention with pooled blocks, the PLE
/// n-gram history) cannot trim a cache back to a prefix; restoring a whole snapshot
/// gives the tokens an uncached server gives.
#[test]
fn a_hybrid_flash_next_replica_reuses_its_system_prompt_with_the_uncached_tokens() {
    let tmp = temp_dir();
    let snap = tmp.path().join("snap");
    gturbo_testkit::replica::write_flash_next(
        &snap,
        &gturbo_testkit::replica::FlashNextSpec::scaled(),
    )
    .unwrap();
    let dir = tmp.path().join("flash.gturbo");
    crate::support::cli::install("qwen38flashnext", &snap, &dir, &["--quant", "bf16"]);
    // Byte-level tokens: ~230 of system prompt, past the indexer's dense range (67), its
    // end not on a pooled block's edge (4).
    let system = format!("You are terse. {}", "Name the city first. ".repeat(10));
    let questions = [
        "Capital of France?",
        "Capital of Italy?",
        "Capital of Spain?",
    ];
    let cached = Server::start(&dir, &["--alias", "flash"]);
    let uncached = Server::start(&dir, &["--alias", "flash", "--cache-bytes", "0"]);
    rt().block_on(async {
        let v = ask_after_system(&cached, "flash", &system, &questions).await;
        let u = ask_after_system(&uncached, "flash", &system, &questions).await;
        eprintln!("cached: {v:#?}\nuncached: {u:#?}");
        assert_eq!(v[0]["cached"], 0);
        let shared = v[1]["cached"].as_u64().unwrap();
        assert!(shared > 200, "{v:?}");
        for (i, (c, n)) in v.iter().zip(&u).enumerate() {
            for k in [
                "openai",
                "openai_tokens",
                "anthropic",
                "anthropic_tokens",
                "prompt",
            ] {
                assert_eq!(c[k], n[k], "question {i} {k}");
            }
            assert_eq!(n["cached"], 0);
            assert_eq!(n["read"], 0);
            // Every request after the first restores the system prompt at least.
            if i > 0 {
                assert_eq!(c["cached"], shared, "{c}");
            }
            assert!(c["read"].as_u64().unwrap() >= shared || i == 0, "{c}");
            assert_eq!(
                c["read"].as_u64().unwrap() + c["input"].as_u64().unwrap(),
                c["prompt"].as_u64().unwrap()
            );
        }
    });
}

#[test]
fn eight_parallel_streaming_clients_all_get_paris() {
    const TEST: &str = "eight_parallel_streaming_clients_all_get_paris";
    let Some((_, _, bf16)) = smollm2(TEST) else {
        return;
    };
    let server = Server::start(bf16, &["--alias", "smollm2"]);
    rt().block_on(async {
        let c = reqwest::Client::new();
        let t = Instant::now();
        let clients: Vec<_> =
            (0..8)
                .map(|i| {
                    let req = c.post(server.url("/v1/chat/completions")).body_json(&json!({
                    "model": "smollm2", "max_tokens": 16, "temperature": 0, "stream": true,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "seed": i,
                }));
                    tokio::spawn(async move {
                        let mut r = req.send().await.unwrap();
                        assert_eq!(r.status(), 200);
                        let body = read_events(&mut r, usize::MAX).await;
                        assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
                        body.lines()
                            .filter_map(|l| l.strip_prefix("data: "))
                            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                            .filter_map(|v| {
                                v["choices"][0]["delta"]["content"]
                                    .as_str()
                                    .map(String::from)
                            })
                            .collect::<String>()
                    })
                })
                .collect();
        for (i, c) in clients.into_iter().enumerate() {
            let answer = c.await.unwrap();
            assert!(answer.contains("Paris"), "client {i}: {answer:?}");
        }
        eprintln!("8 streamed answers in {:?}", t.elapsed());
    });
}

/// The second turn of a conversation restores the state after the first turn's
/// answer (kept when the answer ended), so only the new turn is prefilled.
#[test]
fn the_next_turn_reuses_the_previous_turn_and_its_answer() {
    const TEST: &str = "the_next_turn_reuses_the_previous_turn_and_its_answer";
    let Some((_, _, bf16)) = smollm2(TEST) else {
        return;
    };
    let server = Server::start(bf16, &["--alias", "smollm2"]);
    rt().block_on(async {
        let c = reqwest::Client::new();
        let mut messages =
            vec![json!({"role": "user", "content": "What is the capital of France?"})];
        let (s, one) = send(
            c.post(server.url("/v1/chat/completions"))
                .body_json(&json!({
                    "model": "smollm2", "max_tokens": 30, "temperature": 0, "messages": messages,
                })),
        )
        .await;
        assert_eq!(s, 200, "{one}");
        assert_eq!(one["choices"][0]["finish_reason"], "stop", "{one}");
        messages
            .push(json!({"role": "assistant", "content": one["choices"][0]["message"]["content"]}));
        messages.push(json!({"role": "user", "content": "And of Italy?"}));
        let (s, two) = send(
            c.post(server.url("/v1/chat/completions"))
                .body_json(&json!({
                    "model": "smollm2", "max_tokens": 30, "temperature": 0, "messages": messages,
                })),
        )
        .await;
        assert_eq!(s, 200, "{two}");
        eprintln!("turn 1: {one}\nturn 2: {two}");
        // The first turn's prompt and its answer but the end-of-turn token, which the
        // state never ran.
        let u = &one["usage"];
        let reused =
            u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap() - 1;
        assert_eq!(
            two["usage"]["prompt_tokens_details"]["cached_tokens"], reused,
            "{two}"
        );
    });
}

/// What the snapshot cache's bound counts: a snapshot's bytes, exactly what its
/// caches hold, for the decoder (KV rows) and Flash-Next (fixed recurrent state plus
/// KV, raw indexer keys and pooled blocks).
#[test]
fn session_bytes_count_what_a_snapshot_holds() {
    use gturbo::runtime::kernels::Cpu;
    use gturbo::runtime::load::{self, LoadOptions};
    use gturbo::runtime::models;
    let tmp = temp_dir();
    let q3 = qwen3_install(tmp.path(), 7);
    let snap = tmp.path().join("snap-flash");
    gturbo_testkit::replica::write_flash_next(
        &snap,
        &gturbo_testkit::replica::FlashNextSpec::scaled(),
    )
    .unwrap();
    let flash = tmp.path().join("flash.gturbo");
    crate::support::cli::install("qwen38flashnext", &snap, &flash, &["--quant", "bf16"]);
    let cpu = Cpu::new(2);
    let bytes_after = |dir: &Path, lens: &[usize]| -> Vec<u64> {
        let install = load::open(dir, LoadOptions::default()).unwrap();
        let model = models::open(&install, &cpu).unwrap();
        let mut s = model.session();
        let mut out = vec![model.session_bytes(&s)];
        let ids: Vec<u32> = (0..lens[lens.len() - 1] as u32)
            .map(|i| 3 + i % 50)
            .collect();
        for &n in lens {
            let from = s.pos;
            model.forward(&mut s, &ids[from..n], false).unwrap();
            out.push(model.session_bytes(&model.snapshot(&s).unwrap()));
        }
        out
    };
    // The decoder: nothing before the first pass, then rows in proportion.
    let d = bytes_after(&q3, &[8, 16, 24]);
    assert_eq!(d[0], 0, "{d:?}");
    assert!(d[1] > 0 && d[2] == 2 * d[1] && d[3] == 3 * d[1], "{d:?}");
    // Flash-Next: a fixed part (conv and recurrent state) plus per-position rows; on
    // multiples of the pooling ratio (4) the growth is even.
    let f = bytes_after(&flash, &[8, 16, 24]);
    assert!(
        f[1] > 0 && f[2] - f[1] == f[3] - f[2] && f[2] - f[1] > 0,
        "{f:?}"
    );
    assert!(f[1] > f[2] - f[1], "the fixed state counts too: {f:?}");
    eprintln!("decoder snapshot bytes at 0/8/16/24 tokens: {d:?}; Flash-Next: {f:?}");
}

// ------------------------------------------------------------ --cache-dir

/// A session saved as host state and loaded back continues exactly as the original
/// (the same logits, bit for bit) on the decoder and on Flash-Next; state that does
/// not fit the model is refused, never trusted.
#[test]
fn an_exported_session_continues_as_the_original_and_bad_state_is_refused() {
    use gturbo::runtime::kernels::Cpu;
    use gturbo::runtime::load::{self, LoadOptions};
    use gturbo::runtime::models::{self, state::Part, state::SessionData};
    let tmp = temp_dir();
    let q3 = qwen3_install(tmp.path(), 7);
    let flash = flash_install(tmp.path());
    let cpu = Cpu::new(2);
    for dir in [&q3, &flash] {
        let install = load::open(dir, LoadOptions::default()).unwrap();
        let model = models::open(&install, &cpu).unwrap();
        let ids: Vec<u32> = (0..30u32).map(|i| 3 + i % 50).collect();
        let mut s = model.session();
        model.forward(&mut s, &ids[..21], false).unwrap();
        let data = model.export_session(&s).unwrap();
        let bytes = data.to_bytes();
        let back = SessionData::from_bytes(&bytes).unwrap();
        let mut r = model.import_session(&back).unwrap();
        assert_eq!(r.pos, 21);
        let want = model.forward(&mut s, &ids[21..], true).unwrap();
        let got = model.forward(&mut r, &ids[21..], true).unwrap();
        assert!(
            want == got,
            "{}: the restored session diverges",
            dir.display()
        );
        // An empty session round-trips too.
        let empty = model.export_session(&model.session()).unwrap();
        assert_eq!(model.import_session(&empty).unwrap().pos, 0);
        // A part short by one float, one part missing, one too many, another position.
        let mut short = back.clone();
        let Part::F32(v) = &mut short.parts[0] else {
            panic!("the first part is floats")
        };
        v.pop();
        let mut missing = back.clone();
        missing.parts.pop();
        let mut extra = back.clone();
        extra.parts.push(Part::F32(vec![0.0]));
        let moved = SessionData {
            pos: 20,
            ..back.clone()
        };
        for (what, bad) in [
            ("short", short),
            ("missing", missing),
            ("extra", extra),
            ("moved", moved),
        ] {
            let e = model
                .import_session(&bad)
                .err()
                .unwrap_or_else(|| panic!("{what} accepted"));
            assert!(e.to_string().contains("snapshot"), "{what}: {e}");
        }
    }
}

/// On the GPU too (llvmpipe here): a GPU session exported and imported continues with
/// the same logits, and a session the CPU exported continues on the GPU within the
/// GPU's tolerance of the CPU's continuation (the state is backend-independent).
#[test]
fn sessions_export_and_import_on_the_gpu_and_across_backends() {
    use gturbo::runtime::kernels::Cpu;
    use gturbo::runtime::load::{self, LoadOptions};
    use gturbo::runtime::models;
    const TEST: &str = "sessions_export_and_import_on_the_gpu_and_across_backends";
    let Some(gpu) = crate::gpu::gpu(TEST) else {
        return;
    };
    let tmp = temp_dir();
    let q3 = qwen3_install(tmp.path(), 7);
    let flash = flash_install(tmp.path());
    let cpu = Cpu::new(2);
    let ids: Vec<u32> = (0..30u32).map(|i| 3 + i % 50).collect();
    for dir in [&q3, &flash] {
        let install = load::open(dir, LoadOptions::default()).unwrap();
        let on_gpu = models::open(&install, &gpu).unwrap();
        let on_cpu = models::open(&install, &cpu).unwrap();
        let mut s = on_gpu.session();
        on_gpu.forward(&mut s, &ids[..21], false).unwrap();
        let data = on_gpu.export_session(&s).unwrap();
        let mut r = on_gpu.import_session(&data).unwrap();
        let want = on_gpu.forward(&mut s, &ids[21..], true).unwrap();
        let got = on_gpu.forward(&mut r, &ids[21..], true).unwrap();
        assert!(
            want == got,
            "{}: the restored GPU session diverges",
            dir.display()
        );
        // The CPU's state continued on the GPU.
        let mut c = on_cpu.session();
        on_cpu.forward(&mut c, &ids[..21], false).unwrap();
        let mut moved = on_gpu
            .import_session(&on_cpu.export_session(&c).unwrap())
            .unwrap();
        let cpu_logits = on_cpu.forward(&mut c, &ids[21..], true).unwrap();
        let gpu_logits = on_gpu.forward(&mut moved, &ids[21..], true).unwrap();
        let scale = cpu_logits.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        let diff = cpu_logits
            .iter()
            .zip(&gpu_logits)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
        assert!(
            diff <= crate::gpu::LOGIT_RTOL * scale,
            "{}: {diff} apart at scale {scale}",
            dir.display()
        );
    }
}

fn flash_install(root: &Path) -> PathBuf {
    let snap = root.join("snap-flash");
    gturbo_testkit::replica::write_flash_next(
        &snap,
        &gturbo_testkit::replica::FlashNextSpec::scaled(),
    )
    .unwrap();
    let dir = root.join("flash.gturbo");
    crate::support::cli::install("qwen38flashnext", &snap, &dir, &["--quant", "bf16"]);
    dir
}

/// The snapshot files in `dir`, sorted.
fn snap_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.extension().is_some_and(|x| x == "snap"));
    v.sort();
    v
}

/// Wait (a bounded while) until `dir` holds at least `n` snapshot files.
fn wait_for_snaps(dir: &Path, n: usize) -> Vec<PathBuf> {
    let start = Instant::now();
    loop {
        let v = snap_files(dir);
        if v.len() >= n || start.elapsed() > Duration::from_secs(30) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `--cache-dir` on the hybrid Flash-Next replica: a restarted server restores the
/// system prompt from disk on its first request with the uncached server's tokens;
/// another install's files in the same directory are left alone; a damaged file, and
/// one of another install under this install's name, are reported, deleted and not
/// used (the answer is still the uncached one).
#[test]
fn snapshots_in_a_cache_dir_survive_a_restart_and_bad_ones_are_ignored() {
    let tmp = temp_dir();
    let flash = flash_install(tmp.path());
    let q3 = qwen3_install(tmp.path(), 7);
    let cache = tmp.path().join("cache");
    let cache_arg = cache.to_str().unwrap();
    let system = format!("You are terse. {}", "Name the city first. ".repeat(10));
    let q = ["Capital of France?"];
    let flash_args = ["--alias", "flash", "--cache-dir", cache_arg];
    let rt = rt();
    let uncached = Server::start(&flash, &["--alias", "flash", "--cache-bytes", "0"]);
    let u = rt.block_on(ask_after_system(&uncached, "flash", &system, &q));
    drop(uncached);
    let same = |v: &Value| {
        for k in [
            "openai",
            "openai_tokens",
            "anthropic",
            "anthropic_tokens",
            "prompt",
        ] {
            assert_eq!(v[k], u[0][k], "{k}: {v} vs {}", u[0]);
        }
    };
    // A first server writes the system prompt's snapshot (and its answers').
    let first = Server::start(&flash, &flash_args);
    let v = rt.block_on(ask_after_system(&first, "flash", &system, &q));
    assert_eq!(v[0]["cached"], 0);
    // Its Anthropic request, the same prompt, restored the system prompt from memory.
    let in_memory = v[0]["read"].as_u64().unwrap();
    let written = wait_for_snaps(&cache, 2);
    drop(first);
    assert!(written.len() >= 2, "{written:?}");
    // A restarted one reuses it on its first request.
    let second = Server::start(&flash, &flash_args);
    let v = rt.block_on(ask_after_system(&second, "flash", &system, &q));
    eprintln!("restarted: {v:#?}");
    let shared = v[0]["cached"].as_u64().unwrap();
    assert!(
        shared > 200 && shared == in_memory,
        "{v:?}, {in_memory} from memory"
    );
    same(&v[0]);
    assert_eq!(
        v[0]["read"].as_u64().unwrap() + v[0]["input"].as_u64().unwrap(),
        v[0]["prompt"].as_u64().unwrap()
    );
    drop(second);
    // Another install on the same directory neither reads nor deletes these; its own
    // files carry its identity.
    let flash_files = wait_for_snaps(&cache, written.len());
    let other = Server::start(&q3, &["--alias", "tiny", "--cache-dir", cache_arg]);
    rt.block_on(ask_after_system(&other, "tiny", &system, &q));
    let all = wait_for_snaps(&cache, flash_files.len() + 1);
    assert!(!other.stderr().contains("warning"), "{}", other.stderr());
    drop(other);
    let q3_files: Vec<&PathBuf> = all.iter().filter(|f| !flash_files.contains(f)).collect();
    assert!(!q3_files.is_empty() && flash_files.iter().all(|f| f.exists()));
    // One file of this install's name holding another install's snapshot, the others
    // damaged: each reported, deleted and not used.
    for (i, f) in flash_files.iter().enumerate() {
        if i == 0 {
            std::fs::copy(q3_files[0], f).unwrap();
        } else {
            let mut b = std::fs::read(f).unwrap();
            let mid = b.len() / 2;
            b[mid] ^= 1;
            std::fs::write(f, b).unwrap();
        }
    }
    let third = Server::start(&flash, &flash_args);
    let v = rt.block_on(ask_after_system(&third, "flash", &system, &q));
    let err = third.stderr();
    eprintln!("after damage: {v:#?}\n{err}");
    assert_eq!(v[0]["cached"], 0);
    same(&v[0]);
    assert_eq!(
        err.matches("ignored and deleted").count(),
        flash_files.len(),
        "{err}"
    );
    assert!(
        err.contains("another install") && err.contains("digest"),
        "{err}"
    );
    assert!(q3_files.iter().all(|f| f.exists()));
}
