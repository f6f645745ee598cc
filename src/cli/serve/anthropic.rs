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
use super::worker::{Event, Finish, Params};
use super::{AppState, fresh_seed, json_response, parse_body, sse_response, start, tokenize};
use crate::runtime::text::ChatMessage;

/// A content block (only text blocks are read).
#[derive(Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
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
        let text = text_of(&m.content, &format!("messages[{i}].content"))?;
        out.push(ChatMessage::new(m.role.clone(), text));
    }
    Ok(out)
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
    let params = params(&req, fresh_seed(&state))?;
    let prompt = tokenize(&state, msgs, true).await?;
    let mut started = start(&state, prompt, params).await?;
    let id = state.id("msg_");
    let model = state.model_name().to_string();
    let (prompt_tokens, cached) = (started.prompt_tokens, started.cached);
    if !req.stream {
        let mut text = String::new();
        loop {
            match started.events.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done { tokens, finish }) => {
                    let (reason, seq) = stop_reason(&finish);
                    let doc = json!({
                        "id": id, "type": "message", "role": "assistant", "model": model,
                        "content": [{"type": "text", "text": text}],
                        "stop_reason": reason, "stop_sequence": seq,
                        "usage": usage(prompt_tokens, cached, tokens),
                    });
                    return Ok(json_response(StatusCode::OK, &doc));
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
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": usage(prompt_tokens, cached, 0),
        }}),
    ) + &event(
        "content_block_start",
        &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    );
    let stream = futures_util::stream::unfold(
        (Some(head), started.events, false),
        move |(pending, mut events, over)| async move {
            if let Some(p) = pending {
                return Some((p, (None, events, over)));
            }
            if over {
                return None;
            }
            let out = match events.recv().await {
                Some(Event::Text(t)) => event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": t}}),
                ),
                Some(Event::Done { tokens, finish }) => {
                    let (reason, seq) = stop_reason(&finish);
                    let out = event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": 0}),
                    ) + &event(
                        "message_delta",
                        &json!({"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": seq},
                                "usage": usage(prompt_tokens, cached, tokens)}),
                    ) + &event("message_stop", &json!({"type": "message_stop"}));
                    return Some((out, (None, events, true)));
                }
                Some(Event::Failed(e)) => {
                    return Some((
                        event("error", &e.body(Api::Anthropic)),
                        (None, events, true),
                    ));
                }
                Some(Event::Started { .. }) | None => return None,
            };
            Some((out, (None, events, false)))
        },
    );
    Ok(sse_response(stream))
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
        let prompt = tokenize(&state, msgs, false).await?;
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
