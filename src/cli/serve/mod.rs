//! `gturbo serve`: OpenAI's chat completions and Anthropic's Messages API over one
//! install, with prefix reuse from whole-state snapshots.
//!
//! Threads: axum on the CLI's tokio runtime takes the requests; one worker thread owns
//! the model (a model borrows its install and backend and is not `Send`) and runs one
//! job at a time from a bounded queue (full: 429). Each job streams its events back on
//! a channel; a client that goes away drops the receiver, and the worker stops at the
//! next token.

mod anthropic;
mod cache;
mod disk;
mod error;
mod openai;
mod tools;
mod worker;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use clap::Args;
use tokio::sync::mpsc::UnboundedReceiver;

use super::Failure;
use super::run::{ModelArgs, with_model};
use crate::runtime::text::{ChatMessage, TextCodec};
use error::{Api, ApiError};
use worker::{Event, Job, Params};

/// Jobs that may wait for the worker beyond the one it runs; more get 429.
pub const DEFAULT_QUEUE: usize = 16;
/// Bytes of session snapshots kept for prefix reuse (`--cache-bytes`).
pub const DEFAULT_CACHE_BYTES: u64 = 2 << 30;
/// Largest request body read; a larger one gets 413. Far above any prompt that fits
/// a context window of a million tokens of text.
pub const MAX_BODY_BYTES: usize = 32 << 20;
/// Tokens an OpenAI request may generate when it sets no `max_tokens` (the context
/// still ends it first).
pub const DEFAULT_MAX_TOKENS: usize = 4096;
/// Earlier turns of a conversation searched for snapshot boundaries (each costs a
/// template render and a tokenization).
const MAX_BOUNDARY_TURNS: usize = 64;

/// Flags of `gturbo serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The `.gturbo` directory.
    pub dir: PathBuf,
    /// The address to listen on; any but loopback requires an API key.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// The port (0: a free one, printed on the first line of stdout).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The key every request must carry, as `Authorization: Bearer KEY` or
    /// `x-api-key: KEY`.
    #[arg(long, env = crate::env::GTURBO_API_KEY, hide_env_values = true)]
    pub api_key: Option<String>,
    /// Another model name requests may use (repeatable); the install's model id and
    /// its directory name are always accepted.
    #[arg(long = "alias")]
    pub aliases: Vec<String>,
    /// Requests that may wait while one is generated; more are refused with 429.
    #[arg(long, default_value_t = DEFAULT_QUEUE as u64,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub queue: u64,
    /// Bytes of session snapshots kept for prefix reuse (least recently used evicted
    /// first; 0 turns reuse off).
    #[arg(long, default_value_t = DEFAULT_CACHE_BYTES)]
    pub cache_bytes: u64,
    /// Keep the snapshots in this directory too, so that a restarted server reuses
    /// them (checked on start: a damaged or foreign file is reported and deleted);
    /// `--cache-bytes` bounds the files as well.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// What every handler reads.
struct Shared {
    codec: Arc<TextCodec>,
    /// The tool-call format the template teaches (or the appendix does).
    tool_format: &'static tools::ToolFormat,
    jobs: SyncSender<Job>,
    /// Names a request may give; the first is the one reported.
    names: Vec<String>,
    api_key: Option<String>,
    /// Unix seconds the server started (`created` of the model list).
    created: u64,
    ids: AtomicU64,
}

type AppState = Arc<Shared>;

impl Shared {
    fn model_name(&self) -> &str {
        &self.names[0]
    }

    /// `Err` (404) unless `name` is a name of the served model.
    fn check_model(&self, name: &str) -> Result<(), ApiError> {
        if self.names.iter().any(|n| n == name) {
            return Ok(());
        }
        Err(ApiError::not_found(format!(
            "model {name:?} is not served here (this server serves {:?})",
            self.model_name()
        )))
    }

    /// A fresh response id with `prefix`.
    fn id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}{:x}{n:06x}", self.created)
    }

    /// `Err` (401) unless the request carries the key (when one is set).
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else {
            return Ok(());
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        let given = [bearer, x_api_key];
        if given.iter().flatten().any(|g| same_secret(g, key)) {
            return Ok(());
        }
        Err(ApiError::auth(
            "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
        ))
    }
}

/// Equality that takes the same time wherever the strings differ (a key is a secret).
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// A JSON answer.
pub(crate) fn json_response(status: StatusCode, doc: &serde_json::Value) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(doc.to_string()))
        .unwrap_or_default()
}

/// A server-sent event stream over `chunks` (each one or more whole events).
fn sse_response(chunks: impl futures_util::Stream<Item = String> + Send + 'static) -> Response {
    use futures_util::StreamExt as _;
    let body = Body::from_stream(chunks.map(|c| Ok::<_, std::convert::Infallible>(Bytes::from(c))));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_default()
}

/// The body read (at most [`MAX_BODY_BYTES`]) and parsed as `T`. A body that says
/// it is larger is refused before a byte of it is read.
async fn parse_body<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared
        && n > MAX_BODY_BYTES as u64
    {
        return Err(ApiError::too_large(format!(
            "the request body has {n} bytes; at most {MAX_BODY_BYTES} are read"
        )));
    }
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            ApiError::too_large(format!(
                "the request body could not be read within {MAX_BODY_BYTES} bytes: {e}"
            ))
        })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid(format!(
            "the request body is not valid JSON for this endpoint: {e}"
        ))
    })
}

/// Every request parser of the server over untrusted `data` (the fuzz target
/// `serve_request`): each endpoint's body types, their conversion into a conversation
/// and sampling parameters, the error documents, and the stop-string matcher over
/// text cut from `data`. Whatever the input, a request or an error comes back; it
/// panics only where an invariant of the stop matcher breaks.
pub fn parse_untrusted(data: &[u8]) {
    let docs = |e: ApiError| {
        let _ = (
            e.body(Api::OpenAi).to_string(),
            e.body(Api::Anthropic).to_string(),
        );
        e.status()
    };
    if let Ok(req) = serde_json::from_slice::<openai::ChatRequest>(data) {
        let _ = openai::messages(&req).map_err(docs);
        let _ = openai::params(&req, 0).map_err(docs);
        let _ = openai::tools(&req).map_err(docs);
    }
    if let Ok(req) = serde_json::from_slice::<anthropic::MessagesRequest>(data) {
        let _ = anthropic::conversation(req.system.as_ref(), &req.messages).map_err(docs);
        let _ = anthropic::params(&req, 0).map_err(docs);
        let _ = anthropic::tools(req.tools.as_ref(), req.tool_choice.as_ref()).map_err(docs);
    }
    if let Ok(req) = serde_json::from_slice::<anthropic::CountRequest>(data) {
        let _ = anthropic::conversation(req.system.as_ref(), &req.messages).map_err(docs);
    }
    // A snapshot file, under the identity it claims.
    if let Some(id) = data
        .get(12..44)
        .and_then(|b| <disk::Identity>::try_from(b).ok())
    {
        let _ = disk::decode(&id, data);
    }
    // The tool-call parser over the same pieces.
    let mut tp = tools::ToolParser::new(&tools::FORMATS[0]);
    for piece in String::from_utf8_lossy(data).split('\u{1}') {
        let _ = tp.push(piece);
    }
    let _ = tp.finish();
    // The matcher: stops before the first NUL, pieces after it, split at 0x01.
    let text = String::from_utf8_lossy(data);
    let (stops, pieces) = text.split_once('\0').unwrap_or(("", &text));
    let stops: Vec<String> = stops.split('\u{1}').map(String::from).collect();
    let mut m = worker::StopMatcher::new(&stops);
    let (mut out, mut hit) = (String::new(), None);
    for piece in pieces.split('\u{1}') {
        let (t, h) = m.push(piece);
        out.push_str(&t);
        if h.is_some() {
            hit = h;
            break;
        }
    }
    let all: String = pieces.split('\u{1}').collect();
    match hit {
        // The answer is the text before the first stop string.
        Some(s) => {
            assert!(all.starts_with(&out) && all[out.len()..].starts_with(s.as_str()));
            assert!(
                stops
                    .iter()
                    .filter(|s| !s.is_empty())
                    .all(|s| !out.contains(s.as_str()))
            );
        }
        // Released and held text together are all of it.
        None => assert_eq!(out + &m.finish(), all),
    }
}

/// A rendered, tokenized conversation.
struct Prompt {
    ids: Vec<u32>,
    /// Prompt lengths where an earlier part of the conversation ends.
    boundaries: Vec<usize>,
}

/// Render `messages` with the install's template and tokenize them, off the async
/// threads; `boundaries` also finds where each earlier part of the conversation ends.
async fn tokenize(
    state: &AppState,
    messages: Vec<ChatMessage>,
    tool_defs: Vec<serde_json::Value>,
    boundaries: bool,
) -> Result<Prompt, ApiError> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let codec = &state.codec;
        let (messages, tool_defs) =
            tools::prepare(codec.chat_template_source(), messages, tool_defs);
        let bad = |e: crate::runtime::text::TextError| ApiError::invalid(e.to_string());
        let ids = codec
            .encode_chat(
                &codec
                    .render_chat_tools(&messages, &tool_defs, true)
                    .map_err(bad)?,
            )
            .map_err(bad)?;
        let mut cuts = Vec::new();
        if boundaries {
            let first = messages.len().saturating_sub(MAX_BOUNDARY_TURNS).max(1);
            for k in first..messages.len() {
                // A prefix that renders differently (a template that sees the whole
                // list) is no boundary: only a true prefix of the prompt is kept.
                let Ok(text) = codec.render_chat_tools(&messages[..k], &tool_defs, false) else {
                    continue;
                };
                let Ok(part) = codec.encode_chat(&text) else {
                    continue;
                };
                if !part.is_empty() && part.len() < ids.len() && ids.starts_with(&part) {
                    cuts.push(part.len());
                }
            }
            cuts.sort_unstable();
            cuts.dedup();
        }
        Ok(Prompt {
            ids,
            boundaries: cuts,
        })
    })
    .await
    .map_err(|e| ApiError::server(format!("the tokenizer task failed: {e}")))?
}

/// A job started: its prompt figures and the rest of its events.
struct Started {
    prompt_tokens: usize,
    cached: usize,
    events: UnboundedReceiver<Event>,
}

/// Queue `prompt` and wait until its prefill is done (so that a prompt the model
/// refuses is still an error status, not a broken stream).
async fn start(state: &AppState, prompt: Prompt, params: Params) -> Result<Started, ApiError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        prompt: prompt.ids,
        boundaries: prompt.boundaries,
        params,
        events: tx,
    };
    match state.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(ApiError::busy(
                "the server's queue is full; retry after a moment",
            ));
        }
        Err(TrySendError::Disconnected(_)) => {
            return Err(ApiError::server("the generation thread has stopped"));
        }
    }
    match rx.recv().await {
        Some(Event::Started {
            prompt_tokens,
            cached,
        }) => Ok(Started {
            prompt_tokens,
            cached,
            events: rx,
        }),
        Some(Event::Failed(e)) => Err(e),
        Some(other) => Err(ApiError::server(format!(
            "the generation thread answered {other:?} before starting"
        ))),
        None => Err(ApiError::server(
            "the generation thread dropped the request",
        )),
    }
}

/// A seed for a request that gives none: different per request, as the APIs promise.
fn fresh_seed(state: &AppState) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ state.ids.load(Ordering::Relaxed).rotate_left(32)
}

async fn not_found(headers: HeaderMap, uri: axum::http::Uri) -> Response {
    let api = if uri.path().starts_with("/v1/messages") || headers.contains_key("anthropic-version")
    {
        Api::Anthropic
    } else {
        Api::OpenAi
    };
    ApiError::not_found(format!("no endpoint {}", uri.path())).response(api)
}

/// The routes over `state`.
fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .fallback(not_found)
        .with_state(state)
}

/// The snapshot directory `dir` of `install` served by `model`.
fn open_disk(
    dir: &std::path::Path,
    install: &crate::runtime::load::Install,
    model: &dyn crate::runtime::models::Model,
    cache_bytes: u64,
) -> Result<disk::DiskCache, Failure> {
    let path = install.dir.join(crate::format::manifest::FILE_NAME);
    let manifest =
        std::fs::read(&path).map_err(|e| Failure::usage(format!("{}: {e}", path.display())))?;
    let id = disk::identity(&manifest, &model.backend_name());
    disk::DiskCache::open(dir, id, cache_bytes).map_err(Failure::usage)
}

/// `gturbo serve`.
pub(super) async fn serve_cmd(args: ServeArgs) -> Result<(), Failure> {
    if !args.host.is_loopback() && args.api_key.as_deref().is_none_or(str::is_empty) {
        return Err(Failure::usage(format!(
            "--host {} listens beyond this machine: give --api-key KEY (or {})",
            args.host,
            crate::env::GTURBO_API_KEY
        )));
    }
    let codec = Arc::new(TextCodec::load(&args.dir).map_err(super::run::text_failure)?);
    if !codec.has_chat_template() {
        return Err(Failure::usage(format!(
            "{}: the install has no chat template, which the chat APIs need",
            args.dir.display()
        )));
    }
    let (jobs_tx, jobs_rx) = std::sync::mpsc::sync_channel::<Job>(args.queue as usize);
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<String, Failure>>();
    let worker_codec = codec.clone();
    let cache_bytes = args.cache_bytes;
    let cache_dir = args.cache_dir.clone();
    let dir = args.dir.clone();
    let model_args = args.model;
    let worker = std::thread::Builder::new()
        .name("gturbo-serve-worker".into())
        .spawn(move || {
            let mut ready = Some(ready_tx);
            let served = with_model(&model_args, &dir, |install, model, _quality| {
                let id = install.manifest.model_id.clone();
                let disk = match &cache_dir {
                    Some(d) => Some(open_disk(d, install, model, cache_bytes)?),
                    None => None,
                };
                let store = worker::Store::new(model, cache_bytes, disk);
                if let Some(r) = ready.take() {
                    let _ = r.send(Ok(id));
                }
                worker::run(model, &worker_codec, jobs_rx, store);
                Ok(())
            });
            if let (Err(f), Some(r)) = (served, ready.take()) {
                let _ = r.send(Err(f));
            }
        })
        .map_err(|e| Failure::usage(format!("cannot start the generation thread: {e}")))?;
    let model_id = match ready_rx.await {
        Ok(Ok(id)) => id,
        Ok(Err(f)) => return Err(f),
        Err(_) => {
            let _ = worker.join();
            return Err(Failure::usage(
                "the generation thread ended while loading the model",
            ));
        }
    };
    let mut names = vec![model_id];
    if let Some(d) = args.dir.file_name().and_then(|d| d.to_str()) {
        names.push(d.to_string());
    }
    names.extend(args.aliases);
    let state = Arc::new(Shared {
        tool_format: tools::format_for(codec.chat_template_source()),
        codec,
        jobs: jobs_tx,
        names,
        api_key: args.api_key.filter(|k| !k.is_empty()),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        ids: AtomicU64::new(0),
    });
    let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, args.port))
        .await
        .map_err(|e| {
            Failure::usage(format!("cannot listen on {}:{}: {e}", args.host, args.port))
        })?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::usage(format!("cannot read the listening address: {e}")))?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on http://{addr}");
        let _ = out.flush();
    }
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| Failure::usage(format!("the server failed: {e}")))
}
