//! OpenAI's chat completions API: `GET /v1/models`, `POST /v1/chat/completions`
//! (plain and streamed as `data:` chunks ending with `data: [DONE]`).

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::{Api, ApiError};
use super::tools::{Piece, ToolCall, ToolParser};
use super::worker::{Event, Finish, Params};
use super::{
    AppState, DEFAULT_MAX_TOKENS, fresh_seed, json_response, parse_body, sse_response, start,
    tokenize,
};
use crate::runtime::text::ChatMessage;

/// Most stop strings a request may give (OpenAI's own bound).
const MAX_STOPS: usize = 4;

/// A message's content: a string or a list of parts (only text parts are read).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// An assistant's earlier call: `arguments` is JSON text.
#[derive(Debug, Deserialize)]
pub struct CallFunction {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

#[derive(Debug, Deserialize)]
pub struct Call {
    pub id: Option<String>,
    pub function: CallFunction,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's calls.
    pub tool_calls: Option<Vec<Call>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

/// A tool: `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields of a chat completion request this server reads (others are ignored).
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<Value>,
}

/// The tools for the template (none when `tool_choice` is `"none"`); a choice the
/// server cannot honour (forcing a call) is refused.
pub(super) fn tools(req: &ChatRequest) -> Result<Vec<Value>, ApiError> {
    match req.tool_choice.as_ref() {
        None => {}
        Some(Value::String(c)) if c == "auto" => {}
        Some(Value::String(c)) if c == "none" => return Ok(Vec::new()),
        Some(other) => {
            return Err(ApiError::field(
                "tool_choice",
                format!(
                    "tool_choice {other} is not supported: only \"auto\" and \"none\" (this server cannot force a call)"
                ),
            ));
        }
    }
    let mut out = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        if t.kind != "function" || !t.function.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::field(
                "tools",
                format!(
                    "tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                ),
            ));
        }
        out.push(json!({"type": "function", "function": t.function}));
    }
    Ok(out)
}

/// The request's messages as the template reads them.
pub(super) fn messages(req: &ChatRequest) -> Result<Vec<ChatMessage>, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::field("messages", "messages must not be empty"));
    }
    req.messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                "tool" => "tool",
                other => {
                    return Err(ApiError::field(
                        "messages",
                        format!("messages[{i}].role {other:?} is not supported (system, developer, user, assistant, tool)"),
                    ));
                }
            };
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::field(
                                    "messages",
                                    format!("messages[{i}].content[{j}]: only text parts are supported, not {kind:?}"),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            let mut msg = ChatMessage::new(role, text);
            if role == "assistant" {
                // The template reads the arguments as an object where they are one.
                msg.tool_calls = m.tool_calls.iter().flatten().map(|c| {
                    let args = serde_json::from_str::<Value>(&c.function.arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| Value::String(c.function.arguments.clone()));
                    let mut v = json!({"type": "function",
                        "function": {"name": c.function.name, "arguments": args}});
                    if let Some(id) = &c.id {
                        v["id"] = Value::String(id.clone());
                    }
                    v
                }).collect();
            }
            if role == "tool" {
                msg.tool_call_id = m.tool_call_id.clone();
            }
            Ok(msg)
        })
        .collect()
}

/// The sampling parameters, range-checked as OpenAI checks them.
/// The sampling parameters (`seed` when the request gives none), range-checked.
pub(super) fn params(req: &ChatRequest, seed: u64) -> Result<Params, ApiError> {
    let max = match (req.max_completion_tokens, req.max_tokens) {
        (Some(m), _) | (None, Some(m)) => {
            if m < 1 {
                return Err(ApiError::field(
                    "max_tokens",
                    format!("max_tokens must be at least 1, not {m}"),
                ));
            }
            usize::try_from(m).unwrap_or(usize::MAX)
        }
        (None, None) => DEFAULT_MAX_TOKENS,
    };
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::field(
            "temperature",
            format!("temperature must be in [0, 2], not {temperature}"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::field(
            "top_p",
            format!("top_p must be in (0, 1], not {top_p}"),
        ));
    }
    if let Some(n) = req.n
        && n != 1
    {
        return Err(ApiError::field(
            "n",
            format!("only n = 1 is supported, not {n}"),
        ));
    }
    let stop = match &req.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::field(
            "stop",
            format!("at most {MAX_STOPS} stop strings, not {}", stop.len()),
        ));
    }
    Ok(Params {
        max_tokens: max,
        temperature: temperature as f32,
        top_p: (top_p < 1.0).then_some(top_p as f32),
        top_k: None,
        seed: req.seed.map_or(seed, |s| s as u64),
        stop,
    })
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Eos | Finish::Stop(_) => "stop",
        Finish::Length => "length",
    }
}

fn usage(prompt: usize, cached: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// `GET /v1/models`.
pub async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = state.authorize(&headers) {
        return e.response(Api::OpenAi);
    }
    let data: Vec<Value> = state
        .names
        .iter()
        .take(1)
        .map(
            |n| json!({"id": n, "object": "model", "created": state.created, "owned_by": "gturbo"}),
        )
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match chat_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.response(Api::OpenAi),
    }
}

async fn chat_inner(state: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    state.authorize(&headers)?;
    let req: ChatRequest = parse_body(&headers, body).await?;
    state.check_model(&req.model)?;
    let msgs = messages(&req)?;
    let tool_defs = tools(&req)?;
    let params = params(&req, fresh_seed(&state))?;
    let parser = (!tool_defs.is_empty()).then(|| ToolParser::new(state.tool_format));
    let prompt = tokenize(&state, msgs, tool_defs, true).await?;
    let mut started = start(&state, prompt, params).await?;
    let out = Out {
        id: state.id("chatcmpl-"),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: state.model_name().to_string(),
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        prompt_tokens: started.prompt_tokens,
        cached: started.cached,
    };
    if !req.stream {
        let mut text = String::new();
        loop {
            match started.events.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done { tokens, finish }) => {
                    return Ok(json_response(
                        StatusCode::OK,
                        &out.whole(text, parser, tokens, &finish),
                    ));
                }
                Some(Event::Failed(e)) => return Err(e),
                Some(Event::Started { .. }) | None => {
                    return Err(ApiError::server("the generation ended without an answer"));
                }
            }
        }
    }
    let first = out.chunk(json!({"role": "assistant", "content": ""}), None);
    let st = ChunkStream {
        out,
        events: started.events,
        parser,
        calls: 0,
        pending: Some(first),
        over: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        let next = st.next().await?;
        Some((next, st))
    });
    Ok(sse_response(stream))
}

/// What every part of one answer carries.
struct Out {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: usize,
    cached: usize,
}

impl Out {
    /// A call as OpenAI reports it (`arguments` as JSON text), the `n`th of the answer.
    fn call(&self, n: usize, c: &ToolCall) -> Value {
        json!({"id": format!("call_{}_{n}", self.id.trim_start_matches("chatcmpl-")),
               "type": "function",
               "function": {"name": c.name, "arguments": c.arguments.to_string()}})
    }

    /// The whole answer: its text split into content and calls when tools were given.
    fn whole(
        &self,
        text: String,
        parser: Option<ToolParser>,
        tokens: usize,
        finish: &Finish,
    ) -> Value {
        let (content, calls) = match parser {
            None => (text, Vec::new()),
            Some(mut p) => {
                let mut pieces = p.push(&text);
                pieces.extend(p.finish());
                let mut content = String::new();
                let mut calls = Vec::new();
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => content.push_str(&t),
                        Piece::Call(c) => calls.push(self.call(calls.len(), &c)),
                    }
                }
                (content, calls)
            }
        };
        let mut message = json!({"role": "assistant", "content": content});
        let reason = if calls.is_empty() {
            finish_reason(finish)
        } else {
            if content.trim().is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = Value::Array(calls);
            "tool_calls"
        };
        json!({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": reason}],
            "usage": usage(self.prompt_tokens, self.cached, tokens),
        })
    }

    /// One `data:` chunk.
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let mut doc = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if self.include_usage {
            doc["usage"] = Value::Null;
        }
        format!("data: {doc}\n\n")
    }
}

/// The chunks of a streamed answer: content deltas, each call whole in one
/// `delta.tool_calls` chunk, the finish, the usage when asked, `[DONE]`.
struct ChunkStream {
    out: Out,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    parser: Option<ToolParser>,
    /// Calls sent so far.
    calls: usize,
    pending: Option<String>,
    over: bool,
}

impl ChunkStream {
    fn pieces(&mut self, pieces: Vec<Piece>) -> String {
        let mut s = String::new();
        for p in pieces {
            s.push_str(&match p {
                Piece::Text(t) => self.out.chunk(json!({"content": t}), None),
                Piece::Call(c) => {
                    let mut call = self.out.call(self.calls, &c);
                    call["index"] = json!(self.calls);
                    self.calls += 1;
                    self.out.chunk(json!({"tool_calls": [call]}), None)
                }
            });
        }
        s
    }

    async fn next(&mut self) -> Option<String> {
        if let Some(p) = self.pending.take() {
            return Some(p);
        }
        loop {
            if self.over {
                return None;
            }
            let out = match self.events.recv().await {
                Some(Event::Text(t)) => match self.parser.as_mut() {
                    None => self.out.chunk(json!({"content": t}), None),
                    Some(p) => {
                        let pieces = p.push(&t);
                        self.pieces(pieces)
                    }
                },
                Some(Event::Done { tokens, finish }) => {
                    self.over = true;
                    let tail = self
                        .parser
                        .as_mut()
                        .map(ToolParser::finish)
                        .unwrap_or_default();
                    let mut out = self.pieces(tail);
                    let reason = if self.calls > 0 {
                        "tool_calls"
                    } else {
                        finish_reason(&finish)
                    };
                    out.push_str(&self.out.chunk(json!({}), Some(reason)));
                    if self.out.include_usage {
                        let o = &self.out;
                        let last = json!({
                            "id": o.id, "object": "chat.completion.chunk", "created": o.created,
                            "model": o.model, "choices": [],
                            "usage": usage(o.prompt_tokens, o.cached, tokens),
                        });
                        out.push_str(&format!("data: {last}\n\n"));
                    }
                    out.push_str("data: [DONE]\n\n");
                    out
                }
                Some(Event::Failed(e)) => {
                    self.over = true;
                    format!("data: {}\n\ndata: [DONE]\n\n", e.body(Api::OpenAi))
                }
                Some(Event::Started { .. }) | None => return None,
            };
            // Text held back by the parser gives no chunk yet: wait for more.
            if !out.is_empty() {
                return Some(out);
            }
        }
    }
}
