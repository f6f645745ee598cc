//! Anthropic's Messages API: `POST /v1/messages` (plain and streamed as
//! `message_start` … `content_block_delta` … `message_delta`, `message_stop` events)
//! and `POST /v1/messages/count_tokens`.
//!
//! Usage counts as Anthropic counts it: `input_tokens` are the prompt tokens run
//! now, `cache_read_input_tokens` those restored from a snapshot (their sum is the
//! prompt), `cache_creation_input_tokens` 0 (keeping a snapshot costs the client
//! nothing).

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::{Api, ApiError};
use super::tools::{Piece, ToolCall, ToolParser};
use super::worker::{Event, Finish, Params};
use super::{AppState, fresh_seed, json_response, parse_body, sse_response, start, tokenize};
use crate::runtime::text::ChatMessage;

/// A content block: text, tool_use (an assistant's call), tool_result (its answer);
/// thinking blocks are skipped; anything else is refused.
#[derive(Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    /// tool_use: the call's id, the tool's name, its input object.
    pub id: Option<String>,
    pub name: Option<String>,
    pub input: Option<Value>,
    /// tool_result: the call answered, and what it returned.
    pub tool_use_id: Option<String>,
    pub content: Option<Content>,
    #[serde(default)]
    pub is_error: bool,
}

/// A tool: `name`, `description`, `input_schema`.
#[derive(Debug, Deserialize)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Option<Value>,
}

/// Content: a string or a list of blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// The fields of a Messages request this server reads (others are ignored).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub system: Option<Content>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<Value>,
}

/// The tools for the template, as OpenAI-style function schemas (none with
/// `tool_choice` `none`); forcing a call is refused.
pub(super) fn tools(
    defs: Option<&Vec<Tool>>,
    choice: Option<&Value>,
) -> Result<Vec<Value>, ApiError> {
    match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None | Some("auto") => {}
        Some("none") => return Ok(Vec::new()),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "tool_choice: type {other:?} is not supported: only \"auto\" and \"none\" (this server cannot force a call)"
            )));
        }
    }
    Ok(defs
        .into_iter()
        .flatten()
        .map(|t| {
            let schema = t
                .input_schema
                .clone()
                .unwrap_or_else(|| json!({"type": "object"}));
            let mut f = json!({"name": t.name, "parameters": schema});
            if let Some(d) = &t.description {
                f["description"] = Value::String(d.clone());
            }
            json!({"type": "function", "function": f})
        })
        .collect())
}

/// The text of `content`; `what` names it in errors.
fn text_of(content: &Content, what: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.kind.as_str(), &b.text) {
                    ("text", Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(format!(
                            "{what}[{j}]: only text blocks are supported, not {kind:?}"
                        )));
                    }
                }
            }
            Ok(text)
        }
    }
}

/// The conversation as the template reads it: the system prompt first.
pub(super) fn conversation(
    system: Option<&Content>,
    msgs: &[Message],
) -> Result<Vec<ChatMessage>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid("messages: must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len() + 1);
    if let Some(s) = system {
        out.push(ChatMessage::new("system", text_of(s, "system")?));
    }
    for (i, m) in msgs.iter().enumerate() {
        if !matches!(m.role.as_str(), "user" | "assistant") {
            return Err(ApiError::invalid(format!(
                "messages[{i}].role: {:?} is not user or assistant",
                m.role
            )));
        }
        let what = format!("messages[{i}].content");
        match &m.content {
            Content::Text(t) => out.push(ChatMessage::new(m.role.clone(), t.clone())),
            Content::Blocks(blocks) => turn(&m.role, blocks, &what, &mut out)?,
        }
    }
    Ok(out)
}

/// One turn's blocks as template messages: a user turn's tool results each a `tool`
/// message (first, as the API orders them), then its text; an assistant turn's text
/// with its calls.
fn turn(
    role: &str,
    blocks: &[Block],
    what: &str,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut results = 0;
    for (j, b) in blocks.iter().enumerate() {
        match (b.kind.as_str(), role) {
            ("text", _) => text.push_str(b.text.as_deref().unwrap_or_default()),
            ("thinking" | "redacted_thinking", "assistant") => {}
            ("tool_use", "assistant") => {
                let (Some(id), Some(name)) = (&b.id, &b.name) else {
                    return Err(ApiError::invalid(format!(
                        "{what}[{j}]: a tool_use block needs id and name"
                    )));
                };
                let input = b
                    .input
                    .clone()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({}));
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input}}));
            }
            ("tool_result", "user") => {
                let mut result = match &b.content {
                    None => String::new(),
                    Some(c) => text_of(c, &format!("{what}[{j}].content"))?,
                };
                if b.is_error {
                    result = format!("Error: {result}");
                }
                let mut msg = ChatMessage::new("tool", result);
                msg.tool_call_id = b.tool_use_id.clone();
                out.push(msg);
                results += 1;
            }
            (kind, _) => {
                return Err(ApiError::invalid(format!(
                    "{what}[{j}]: {kind:?} blocks are not supported in a {role} turn (text, tool_use from the assistant, tool_result from the user)"
                )));
            }
        }
    }
    if !text.is_empty() || !calls.is_empty() || role == "assistant" || results == 0 {
        let mut msg = ChatMessage::new(role, text);
        msg.tool_calls = calls;
        out.push(msg);
    }
    Ok(())
}

/// The sampling parameters (`seed`: Anthropic's API has none), range-checked.
pub(super) fn params(req: &MessagesRequest, seed: u64) -> Result<Params, ApiError> {
    let max = match req.max_tokens {
        None => return Err(ApiError::invalid("max_tokens: Field required")),
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(format!(
                "max_tokens: must be at least 1, not {m}"
            )));
        }
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
    };
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(ApiError::invalid(format!(
            "temperature: must be in [0, 1], not {temperature}"
        )));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!(
            "top_p: must be in (0, 1], not {top_p}"
        )));
    }
    let top_k = match req.top_k {
        None => None,
        Some(k) if k < 1 => {
            return Err(ApiError::invalid(format!(
                "top_k: must be at least 1, not {k}"
            )));
        }
        Some(k) => Some(usize::try_from(k).unwrap_or(usize::MAX)),
    };
    Ok(Params {
        max_tokens: max,
        temperature: temperature as f32,
        top_p: (top_p < 1.0).then_some(top_p as f32),
        top_k,
        seed,
        stop: req.stop_sequences.clone().unwrap_or_default(),
    })
}

fn stop_reason(f: &Finish) -> (&'static str, Value) {
    match f {
        Finish::Eos => ("end_turn", Value::Null),
        Finish::Length => ("max_tokens", Value::Null),
        Finish::Stop(s) => ("stop_sequence", Value::String(s.clone())),
    }
}

fn usage(prompt: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    })
}

/// One server-sent event of the Messages stream.
fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// `POST /v1/messages`.
async fn messages_inner(
    state: AppState,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    state.authorize(&headers)?;
    let req: MessagesRequest = parse_body(&headers, body).await?;
    state.check_model(&req.model)?;
    let msgs = conversation(req.system.as_ref(), &req.messages)?;
    let tool_defs = tools(req.tools.as_ref(), req.tool_choice.as_ref())?;
    let params = params(&req, fresh_seed(&state))?;
    let parser = (!tool_defs.is_empty()).then(|| ToolParser::new(state.tool_format));
    let prompt = tokenize(&state, msgs, tool_defs, true).await?;
    let mut started = start(&state, prompt, params).await?;
    let out = Out {
        id: state.id("msg_"),
        model: state.model_name().to_string(),
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
    let head = event(
        "message_start",
        &json!({"type": "message_start", "message": {
            "id": out.id, "type": "message", "role": "assistant", "model": out.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": usage(out.prompt_tokens, out.cached, 0),
        }}),
    );
    let mut st = EventStream {
        out,
        events: started.events,
        parser,
        blocks: 0,
        text_open: false,
        calls: 0,
        pending: None,
        over: false,
    };
    // A text block opens at once (clients show the answer as it comes).
    st.pending = Some(head + &st.open_text());
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        let next = st.next().await?;
        Some((next, st))
    });
    Ok(sse_response(stream))
}

/// What every part of one answer carries.
struct Out {
    id: String,
    model: String,
    prompt_tokens: usize,
    cached: usize,
}

impl Out {
    /// A `tool_use` block for the `n`th call of the answer.
    fn tool_use(&self, n: usize, c: &ToolCall) -> Value {
        json!({"type": "tool_use", "id": format!("toolu_{}_{n}", self.id.trim_start_matches("msg_")),
               "name": c.name, "input": c.arguments})
    }

    /// The whole answer: text and `tool_use` blocks (when tools were given).
    fn whole(
        &self,
        text: String,
        parser: Option<ToolParser>,
        tokens: usize,
        finish: &Finish,
    ) -> Value {
        let pieces = match parser {
            None => vec![Piece::Text(text)],
            Some(mut p) => {
                let mut v = p.push(&text);
                v.extend(p.finish());
                v
            }
        };
        let mut content: Vec<Value> = Vec::new();
        let mut calls = 0;
        for piece in pieces {
            match piece {
                Piece::Text(t) => match content.last_mut() {
                    Some(b) if b["type"] == "text" => {
                        let joined = format!("{}{t}", b["text"].as_str().unwrap_or_default());
                        b["text"] = Value::String(joined);
                    }
                    _ => content.push(json!({"type": "text", "text": t})),
                },
                Piece::Call(c) => {
                    content.push(self.tool_use(calls, &c));
                    calls += 1;
                }
            }
        }
        if content.is_empty() {
            content.push(json!({"type": "text", "text": ""}));
        }
        let (reason, seq) = if calls > 0 {
            ("tool_use", Value::Null)
        } else {
            stop_reason(finish)
        };
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(self.prompt_tokens, self.cached, tokens),
        })
    }
}

/// The events of a streamed answer: text deltas in text blocks; each call a
/// `tool_use` block whose input comes in one `input_json_delta`; then
/// `message_delta` with the stop reason and the usage, and `message_stop`.
struct EventStream {
    out: Out,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    parser: Option<ToolParser>,
    /// Blocks opened so far (the next one's index).
    blocks: usize,
    text_open: bool,
    calls: usize,
    pending: Option<String>,
    over: bool,
}

impl EventStream {
    fn open_text(&mut self) -> String {
        self.text_open = true;
        self.blocks += 1;
        event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.blocks - 1,
                    "content_block": {"type": "text", "text": ""}}),
        )
    }

    fn close(&mut self) -> String {
        self.text_open = false;
        event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": self.blocks - 1}),
        )
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> String {
        let mut s = String::new();
        for p in pieces {
            match p {
                Piece::Text(t) => {
                    if !self.text_open {
                        s.push_str(&self.open_text());
                    }
                    s.push_str(&event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": self.blocks - 1,
                                "delta": {"type": "text_delta", "text": t}}),
                    ));
                }
                Piece::Call(c) => {
                    if self.text_open {
                        s.push_str(&self.close());
                    }
                    let mut block = self.out.tool_use(self.calls, &c);
                    self.calls += 1;
                    block["input"] = json!({});
                    let index = self.blocks;
                    self.blocks += 1;
                    s.push_str(&event(
                        "content_block_start",
                        &json!({"type": "content_block_start", "index": index, "content_block": block}),
                    ));
                    s.push_str(&event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta",
                                          "partial_json": c.arguments.to_string()}}),
                    ));
                    s.push_str(&event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": index}),
                    ));
                }
            }
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
                    None => self.pieces(vec![Piece::Text(t)]),
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
                    if self.text_open {
                        out.push_str(&self.close());
                    }
                    let (reason, seq) = if self.calls > 0 {
                        ("tool_use", Value::Null)
                    } else {
                        stop_reason(&finish)
                    };
                    let o = &self.out;
                    out.push_str(&event(
                        "message_delta",
                        &json!({"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": seq},
                                "usage": usage(o.prompt_tokens, o.cached, tokens)}),
                    ));
                    out.push_str(&event("message_stop", &json!({"type": "message_stop"})));
                    out
                }
                Some(Event::Failed(e)) => {
                    self.over = true;
                    event("error", &e.body(Api::Anthropic))
                }
                Some(Event::Started { .. }) | None => return None,
            };
            if !out.is_empty() {
                return Some(out);
            }
        }
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match messages_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.response(Api::Anthropic),
    }
}

#[derive(Debug, Deserialize)]
pub struct CountRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub system: Option<Content>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<Value>,
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as `/v1/messages` would
/// run them.
pub async fn count_tokens(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let counted = async {
        state.authorize(&headers)?;
        let req: CountRequest = parse_body(&headers, body).await?;
        state.check_model(&req.model)?;
        let msgs = conversation(req.system.as_ref(), &req.messages)?;
        let tool_defs = tools(req.tools.as_ref(), req.tool_choice.as_ref())?;
        let prompt = tokenize(&state, msgs, tool_defs, false).await?;
        Ok::<_, ApiError>(json_response(
            StatusCode::OK,
            &json!({"input_tokens": prompt.ids.len()}),
        ))
    };
    match counted.await {
        Ok(r) => r,
        Err(e) => e.response(Api::Anthropic),
    }
}
