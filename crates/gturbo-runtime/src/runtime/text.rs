//! Text in and out of an install: the tokenizer (`tokenizer/tokenizer.json` through the
//! tokenizers crate), the chat template (`tokenizer/tokenizer_config.json`, rendered with
//! minijinja the way transformers renders it), the stop tokens, and a streaming decoder
//! that never prints half a character.
//!
//! The tokenizer files come from the model repo and are untrusted: every file is a plain
//! file inside `<install>/tokenizer/` (no symlinks), sizes are bounded, parsing errors and
//! panics inside the tokenizers crate become [`TextError`]s naming the file and field.

use std::collections::BTreeSet;
use std::fs;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::format::tokenizer as tokenizer_bounds;

/// Folder of an install that holds the tokenizer files copied from the source repo.
pub const TOKENIZER_DIR: &str = "tokenizer";

/// Largest tokenizer file read (the biggest real `tokenizer.json` files are ~35 MB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// Most minijinja instructions one chat-template render may run (its "fuel"). A
/// one-turn prompt takes tens of steps (the test replicas' ChatML and Llama 3 templates:
/// 25 and 42, measured with `gturbo -v run --chat`); ten million leaves five orders of
/// magnitude of headroom and stops a hostile loop in about 1.5 s (three nested
/// `range(100000)` loops, 10^15 steps, measured the same way on a debug build).
pub const TEMPLATE_FUEL: u64 = 10_000_000;
/// Largest rendered chat prompt, in bytes: far beyond any context window, so only a
/// runaway template reaches it (a single `{{ "x" * 50000000 }}` would, at once).
pub const TEMPLATE_MAX_OUTPUT: usize = 16 << 20;

/// A writer that refuses to grow past `cap` bytes and remembers that it did.
struct CappedOutput {
    buf: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.cap {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output over its cap"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Why the text side of an install cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("{}: {why}", path.display())]
    File { path: PathBuf, why: String },
    #[error("{}: field `{field}`: {why}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        why: String,
    },
    #[error("{}: {why}", path.display())]
    Tokenizer { path: PathBuf, why: String },
    #[error("chat template ({}): {why}", path.display())]
    Template { path: PathBuf, why: String },
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// One message of a conversation, as chat templates read it (`role`, `content`, and
/// for tool use `tool_calls` and `tool_call_id`, as transformers passes them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (a template may refuse other roles).
    pub role: String,
    /// The message's text.
    pub content: String,
    /// An assistant's tool calls: `{"type": "function", "function": {"name",
    /// "arguments"}}` with the arguments an object.
    pub tool_calls: Vec<Value>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// The message as a template reads it.
    fn to_json(&self) -> Value {
        let mut m = serde_json::json!({"role": self.role, "content": self.content});
        if !self.tool_calls.is_empty() {
            m["tool_calls"] = Value::Array(self.tool_calls.clone());
        }
        if let Some(id) = &self.tool_call_id {
            m["tool_call_id"] = Value::String(id.clone());
        }
        m
    }
}

/// The tokenizer, chat template and stop tokens of one install.
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    tokenizer_path: PathBuf,
    /// The Jinja source and the file it came from, when the install has one.
    chat_template: Option<(String, PathBuf)>,
    /// Special-token strings the template may use (`bos_token`, `eos_token`, ...).
    special_strings: Vec<(&'static str, String)>,
    bos_id: Option<u32>,
    add_bos: bool,
    stop_ids: Vec<u32>,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec")
            .field("tokenizer", &self.tokenizer_path)
            .field("bos_id", &self.bos_id)
            .field("add_bos", &self.add_bos)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

/// Read a file of the tokenizer folder: a regular file (not a symlink that could point
/// outside the install), at most [`MAX_FILE_BYTES`]. `Ok(None)` when absent.
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, TextError> {
    read_optional_capped(path, MAX_FILE_BYTES)
}

/// [`read_optional`] with a cap of `max` bytes.
fn read_optional_capped(path: &Path, max: u64) -> Result<Option<Vec<u8>>, TextError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(TextError::File {
                path: path.into(),
                why: e.to_string(),
            });
        }
    };
    if !meta.file_type().is_file() {
        return Err(TextError::File {
            path: path.into(),
            why: "not a regular file (symlinks and folders are refused)".into(),
        });
    }
    if meta.len() > max {
        return Err(TextError::File {
            path: path.into(),
            why: format!("{} bytes, more than the {max} accepted", meta.len()),
        });
    }
    fs::read(path).map(Some).map_err(|e| TextError::File {
        path: path.into(),
        why: e.to_string(),
    })
}

fn read_json(path: &Path) -> Result<Option<Value>, TextError> {
    match read_optional(path)? {
        None => Ok(None),
        Some(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TextError::File {
                path: path.into(),
                why: format!("not valid JSON: {e}"),
            }),
    }
}

/// A special token in tokenizer_config.json: a string, or an AddedToken object
/// (`{"content": "...", ...}`), or null.
fn token_string(cfg: &Value, field: &str, path: &Path) -> Result<Option<String>, TextError> {
    match cfg.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(TextError::Field {
                path: path.into(),
                field: format!("{field}.content"),
                why: "expected a string".into(),
            }),
        },
        Some(_) => Err(TextError::Field {
            path: path.into(),
            field: field.into(),
            why: "expected a string, an object with `content`, or null".into(),
        }),
    }
}

/// `eos_token_id` as configs write it: an integer or a list of integers.
fn id_list(v: Option<&Value>, field: &str, path: &Path) -> Result<Vec<u32>, TextError> {
    let bad = || TextError::Field {
        path: path.into(),
        field: field.into(),
        why: "expected a token id (0..2^32) or a list of them".into(),
    };
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// `tokenizer/tokenizer.json`, bounded and parsed.
fn read_tokenizer(dir: &Path) -> Result<(tokenizers::Tokenizer, PathBuf), TextError> {
    let tokenizer_path = dir.join(tokenizer_bounds::FILE_NAME);
    let bytes =
        read_optional_capped(&tokenizer_path, tokenizer_bounds::MAX_BYTES)?.ok_or_else(|| {
            TextError::File {
                path: tokenizer_path.clone(),
                why: "missing (the runtime needs a tokenizers-format tokenizer.json)".into(),
            }
        })?;
    // What loading it may cost is bounded before the tokenizers crate sees it: a
    // 10 MB pattern took 3.1 GiB and 16 s there.
    if let Err(e) = tokenizer_bounds::check_bounds(&bytes) {
        return Err(TextError::Field {
            path: tokenizer_path,
            field: e.field,
            why: e.detail,
        });
    }
    // The tokenizers crate is not written for hostile input; a panic while parsing
    // is turned into an error naming the file.
    let parsed = catch_unwind(AssertUnwindSafe(|| {
        tokenizers::Tokenizer::from_bytes(&bytes)
    }));
    match parsed {
        Ok(Ok(t)) => Ok((t, tokenizer_path)),
        Ok(Err(e)) => Err(TextError::Tokenizer {
            path: tokenizer_path,
            why: format!("not a valid tokenizer: {e}"),
        }),
        Err(_) => Err(TextError::Tokenizer {
            path: tokenizer_path,
            why: "the tokenizer library panicked while reading it".into(),
        }),
    }
}

/// `tokenizer_config.json` (an empty object when absent) and its `add_bos_token`.
fn read_tokenizer_config(cfg_path: &Path) -> Result<(Value, bool), TextError> {
    let cfg = read_json(cfg_path)?.unwrap_or(Value::Object(Default::default()));
    if !cfg.is_object() {
        return Err(TextError::File {
            path: cfg_path.to_path_buf(),
            why: "expected a JSON object".into(),
        });
    }
    let add_bos = match cfg.get("add_bos_token") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(TextError::Field {
                path: cfg_path.to_path_buf(),
                field: "add_bos_token".into(),
                why: "expected true or false".into(),
            });
        }
    };
    Ok((cfg, add_bos))
}

/// The id of the special token `field` names, when the config sets one.
fn special_id(
    tokenizer: &tokenizers::Tokenizer,
    special: Option<&str>,
    field: &str,
    cfg_path: &Path,
) -> Result<Option<u32>, TextError> {
    match special {
        None => Ok(None),
        Some(s) => Ok(Some(tokenizer.token_to_id(s).ok_or_else(|| {
            TextError::Field {
                path: cfg_path.to_path_buf(),
                field: field.into(),
                why: format!("{s:?} is not a token of tokenizer.json"),
            }
        })?)),
    }
}

/// Stop tokens: every EOS the generation config, the model config and the
/// tokenizer config name (instruct models often list several), without repeats.
fn stop_ids(
    dir: &Path,
    tokenizer: &tokenizers::Tokenizer,
    eos: Option<&str>,
    cfg_path: &Path,
) -> Result<Vec<u32>, TextError> {
    let mut stop_ids = Vec::new();
    for (file, field) in [
        ("generation_config.json", "eos_token_id"),
        ("config.json", "eos_token_id"),
    ] {
        let path = dir.join(file);
        if let Some(v) = read_json(&path)? {
            stop_ids.extend(id_list(v.get(field), field, &path)?);
        }
    }
    if let Some(id) = special_id(tokenizer, eos, "eos_token", cfg_path)? {
        stop_ids.push(id);
    }
    let mut seen = BTreeSet::new();
    stop_ids.retain(|id| seen.insert(*id));
    if stop_ids.is_empty() {
        return Err(TextError::Field {
            path: dir.join("generation_config.json"),
            field: "eos_token_id".into(),
            why: "no end-of-sequence token in generation_config.json, config.json or tokenizer_config.json".into(),
        });
    }
    Ok(stop_ids)
}

impl TextCodec {
    /// Load the text side of the install at `install_dir` (files under `tokenizer/`).
    pub fn load(install_dir: &Path) -> Result<TextCodec, TextError> {
        let dir = install_dir.join(TOKENIZER_DIR);
        let (tokenizer, tokenizer_path) = read_tokenizer(&dir)?;
        let cfg_path = dir.join("tokenizer_config.json");
        let (cfg, add_bos) = read_tokenizer_config(&cfg_path)?;
        let mut special_strings = Vec::new();
        for field in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(s) = token_string(&cfg, field, &cfg_path)? {
                special_strings.push((field, s));
            }
        }
        let special = |name: &str| {
            special_strings
                .iter()
                .find(|(f, _)| *f == name)
                .map(|(_, s)| s.as_str())
        };
        let bos_id = special_id(&tokenizer, special("bos_token"), "bos_token", &cfg_path)?;
        if add_bos && bos_id.is_none() {
            return Err(TextError::Field {
                path: cfg_path,
                field: "bos_token".into(),
                why: "add_bos_token is true but no bos_token is set".into(),
            });
        }
        let chat_template = Self::find_template(&dir, &cfg, &cfg_path)?;
        let stop_ids = stop_ids(&dir, &tokenizer, special("eos_token"), &cfg_path)?;
        Ok(TextCodec {
            tokenizer,
            tokenizer_path,
            chat_template,
            special_strings,
            bos_id,
            add_bos,
            stop_ids,
        })
    }

    /// The chat template: `chat_template` of tokenizer_config.json (a string, or a list
    /// of `{name, template}` where `default` is used), else `chat_template.jinja`.
    fn find_template(
        dir: &Path,
        cfg: &Value,
        cfg_path: &Path,
    ) -> Result<Option<(String, PathBuf)>, TextError> {
        let bad = |why: &str| TextError::Field {
            path: cfg_path.into(),
            field: "chat_template".into(),
            why: why.into(),
        };
        match cfg.get("chat_template") {
            Some(Value::String(s)) => return Ok(Some((s.clone(), cfg_path.into()))),
            Some(Value::Array(list)) => {
                for item in list {
                    if item.get("name").and_then(Value::as_str) == Some("default") {
                        let t = item
                            .get("template")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("the `default` entry has no string `template`"))?;
                        return Ok(Some((t.to_string(), cfg_path.into())));
                    }
                }
                return Err(bad("a list without a `default` template"));
            }
            None | Some(Value::Null) => {}
            Some(_) => return Err(bad("expected a string or a list of named templates")),
        }
        let jinja = dir.join("chat_template.jinja");
        match read_optional(&jinja)? {
            None => Ok(None),
            Some(bytes) => String::from_utf8(bytes)
                .map(|s| Some((s, jinja.clone())))
                .map_err(|_| TextError::File {
                    path: jinja,
                    why: "not UTF-8".into(),
                }),
        }
    }

    /// Token ids of a plain prompt, as transformers' `tokenizer(text)` gives them: the
    /// tokenizer's post-processor runs (some add BOS there), and BOS is put in front when
    /// tokenizer_config.json says `add_bos_token: true` and it is not there yet.
    /// Special-token strings in `text` become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let mut ids = self.encode_raw(text, true)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos_id)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Token ids of a prompt rendered by [`TextCodec::chat_prompt`]: the template already
    /// wrote every special token it wants, so nothing is added (as `apply_chat_template`
    /// tokenizes).
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, TextError> {
        self.encode_raw(rendered, false)
    }

    fn encode_raw(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TextError> {
        let enc = catch_unwind(AssertUnwindSafe(|| {
            self.tokenizer.encode(text, add_special)
        }))
        .map_err(|_| TextError::Encode("the tokenizer library panicked".into()))?
        .map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens kept unless `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        catch_unwind(AssertUnwindSafe(|| {
            self.tokenizer.decode(ids, skip_special)
        }))
        .map_err(|_| TextError::Encode("the tokenizer library panicked".into()))?
        .map_err(|e| TextError::Encode(e.to_string()))
    }

    /// Ids that end generation (EOS of the generation config, model config and
    /// tokenizer config, deduplicated, in that order).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The BOS id, when the tokenizer config names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether the install has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The prompt for one user turn, rendered with the install's chat template as
    /// transformers' `apply_chat_template(..., add_generation_prompt=True)` renders it.
    /// `system`: `None` leaves the template's default (many add their own system
    /// message), `Some("")` sends an explicitly empty system message.
    pub fn chat_prompt(&self, system: Option<&str>, user: &str) -> Result<String, TextError> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", user));
        self.render_chat(&messages, true)
    }

    /// `messages` rendered with the install's chat template as transformers'
    /// `apply_chat_template(messages, add_generation_prompt=...)` renders them (a
    /// server's multi-turn conversations; [`TextCodec::chat_prompt`] is one turn of it).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_chat_tools(messages, &[], add_generation_prompt)
    }

    /// The template's source, when the install has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_ref().map(|(s, _)| s.as_str())
    }

    /// [`TextCodec::render_chat`] with `tools` (JSON schemas, `{"type": "function",
    /// "function": {...}}`) in the template's `tools` variable (absent when empty, as
    /// transformers leaves it).
    pub fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let (source, path) = self
            .chat_template
            .as_ref()
            .ok_or_else(|| TextError::Field {
                path: self.tokenizer_path.with_file_name("tokenizer_config.json"),
                field: "chat_template".into(),
                why: "the install has no chat template (use a plain prompt)".into(),
            })?;
        let mut ctx = serde_json::Map::new();
        let messages = messages.iter().map(ChatMessage::to_json).collect();
        ctx.insert("messages".into(), Value::Array(messages));
        if !tools.is_empty() {
            ctx.insert("tools".into(), Value::Array(tools.to_vec()));
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        for (field, s) in &self.special_strings {
            ctx.insert((*field).into(), Value::String(s.clone()));
        }
        render_template(source, path, ctx)
    }

    /// Whether the tokenizer speaks OpenAI's harmony format (gpt-oss): it has the
    /// [`HARMONY_CHANNEL`] special token, so an answer comes in channels and only the
    /// final one is for the user ([`harmony_final`]).
    pub fn is_harmony(&self) -> bool {
        self.tokenizer.token_to_id(HARMONY_CHANNEL).is_some()
    }

    /// A decoder for a stream of generated ids.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            codec: self,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            skip_special,
        }
    }
}

/// Turns generated ids, one at a time, into text as soon as it is complete: a token that
/// ends inside a multi-byte UTF-8 character (byte-level BPE, byte-fallback tokens) is
/// held back until the character is whole.
///
/// It decodes a window that starts one token before the new ones and emits the
/// difference, so decoders that treat the first token specially (a leading-space strip)
/// do not drop text at window boundaries.
pub struct StreamDecoder<'a> {
    codec: &'a TextCodec,
    ids: Vec<u32>,
    /// Start of the window: the last token already printed before `read`.
    prefix: usize,
    /// Ids before this index have been printed.
    read: usize,
    skip_special: bool,
}

impl StreamDecoder<'_> {
    /// Add one id; returns the text it completes (often empty while a character is partial).
    pub fn push(&mut self, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let before = self
            .codec
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let now = self
            .codec
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        // An incomplete character decodes to U+FFFD at the end: wait for more bytes.
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        match now.get(before.len()..) {
            Some(new) if now.starts_with(&before) => {
                let new = new.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                Ok(new)
            }
            _ => Ok(String::new()),
        }
    }

    /// The text still held back (an incomplete character at the end, as U+FFFD).
    pub fn finish(&mut self) -> Result<String, TextError> {
        let before = self
            .codec
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let now = self
            .codec
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(match now.get(before.len()..) {
            Some(rest) if now.starts_with(&before) => rest.to_string(),
            _ => String::new(),
        })
    }
}

/// Harmony's channel marker: `<|channel|>NAME<|message|>TEXT<|end|>`.
pub const HARMONY_CHANNEL: &str = "<|channel|>";
/// Harmony's marker between a channel's name and its text.
const HARMONY_MESSAGE: &str = "<|message|>";
/// What ends a harmony message: the end of a turn's message, of the answer, or a tool
/// call.
const HARMONY_ENDS: [&str; 3] = ["<|end|>", "<|return|>", "<|call|>"];

/// The text of the last `final` channel in `decoded` (an answer decoded with its
/// special tokens), up to the message's end marker or the end of the text (a reply
/// cut by `--max-tokens`); `None` when the answer has no final channel yet (it was cut
/// while still in `analysis`).
pub fn harmony_final(decoded: &str) -> Option<&str> {
    let marker = format!("{HARMONY_CHANNEL}final");
    let at = decoded.rfind(&marker)? + marker.len();
    let rest = &decoded[at..];
    let body = &rest[rest.find(HARMONY_MESSAGE)? + HARMONY_MESSAGE.len()..];
    let end = HARMONY_ENDS
        .iter()
        .filter_map(|e| body.find(e))
        .min()
        .unwrap_or(body.len());
    Some(&body[..end])
}

/// Render the chat template `source` (read from `path`) over `ctx` as transformers
/// does (trim_blocks, lstrip_blocks, Python string methods, `raise_exception`), its
/// work and its output bounded: a template is untrusted code.
pub fn render_template(
    source: &str,
    path: &Path,
    ctx: serde_json::Map<String, Value>,
) -> Result<String, TextError> {
    let path = &path.to_path_buf();
    let terr = |e: minijinja::Error| TextError::Template {
        path: path.clone(),
        why: format!("{e:#}"),
    };
    let mut env = minijinja::Environment::new();
    // A template is untrusted code: bound its work and its output.
    env.set_fuel(Some(TEMPLATE_FUEL));
    // transformers compiles templates with trim_blocks and lstrip_blocks on.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // transformers' `tojson`: Python's `json.dumps` separators (", ", ": "), no HTML
    // escaping, non-ASCII kept (minijinja's own is compact and escapes `<`, `>`).
    env.add_filter(
        "tojson",
        |v: minijinja::Value,
         _kw: minijinja::value::Kwargs|
         -> Result<minijinja::Value, minijinja::Error> {
            let j = serde_json::to_value(&v).map_err(|e| {
                minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
            })?;
            let mut out = String::new();
            python_json(&j, &mut out);
            Ok(minijinja::Value::from_safe_string(out))
        },
    );
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<(), minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("the template raised: {msg}"),
            ))
        },
    );
    env.add_template("chat", source).map_err(terr)?;
    let tmpl = env.get_template("chat").map_err(terr)?;
    let mut out = CappedOutput {
        buf: Vec::new(),
        cap: TEMPLATE_MAX_OUTPUT,
        overflowed: false,
    };
    let rendered = tmpl.render_captured_to(minijinja::Value::from_serialize(&ctx), &mut out);
    match rendered {
        Ok(captured) => {
            if let Some((steps, _)) = captured.state().fuel_levels() {
                tracing::debug!(steps, "chat template rendered");
            }
            drop(captured);
            String::from_utf8(out.buf).map_err(|_| TextError::Template {
                path: path.clone(),
                why: "rendered text is not UTF-8".into(),
            })
        }
        Err(_) if out.overflowed => Err(TextError::Template {
            path: path.clone(),
            why: format!(
                "refused: the template's output passed {TEMPLATE_MAX_OUTPUT} bytes (a chat prompt is far smaller; the template runs away)"
            ),
        }),
        Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(TextError::Template {
            path: path.clone(),
            why: format!(
                "refused: the template ran {TEMPLATE_FUEL} steps without finishing (a one-turn chat prompt takes far fewer; the template does not terminate in reasonable time)"
            ),
        }),
        Err(e) => Err(terr(e)),
    }
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it (keys in the map's
/// order).
fn python_json(v: &Value, out: &mut String) {
    match v {
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_json(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(x, out);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod harmony_tests {
    use super::harmony_final;

    #[test]
    fn the_final_channel_is_kept_and_the_analysis_dropped() {
        let answer = "<|channel|>analysis<|message|>The user asks for 2+2. Easy.<|end|>\
                      <|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>";
        assert_eq!(harmony_final(answer), Some("2 + 2 = 4."));
        // A channel with a constraint after its name, and a reply cut mid-answer.
        let cut = "<|channel|>analysis<|message|>x<|end|><|start|>assistant\
                   <|channel|>final <|constrain|>json<|message|>{\"a\": 1";
        assert_eq!(harmony_final(cut), Some("{\"a\": 1"));
        // Still thinking when the budget ran out: no final channel.
        assert_eq!(
            harmony_final("<|channel|>analysis<|message|>Let me think"),
            None
        );
        assert_eq!(harmony_final("plain text"), None);
    }
}
