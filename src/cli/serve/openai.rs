//! OpenAI's chat completions API: `GET /v1/models`, `POST /v1/chat/completions`
//! (plain and streamed as `data:` chunks ending with `data: [DONE]`).

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::{Api, ApiError};
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

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
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
                other => {
                    return Err(ApiError::field(
                        "messages",
                        format!("messages[{i}].role {other:?} is not supported (system, developer, user, assistant)"),
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
            Ok(ChatMessage::new(role, text))
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
    let params = params(&req, fresh_seed(&state))?;
    let prompt = tokenize(&state, msgs, true).await?;
    let mut started = start(&state, prompt, params).await?;
    let id = state.id("chatcmpl-");
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = state.model_name().to_string();
    if !req.stream {
        let mut text = String::new();
        loop {
            match started.events.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done { tokens, finish }) => {
                    let doc = json!({
                        "id": id, "object": "chat.completion", "created": created, "model": model,
                        "choices": [{
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": null,
                            "finish_reason": finish_reason(&finish),
                        }],
                        "usage": usage(started.prompt_tokens, started.cached, tokens),
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
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let chunk = move |delta: Value, finish: Option<&str>| -> String {
        let mut doc = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if include_usage {
            doc["usage"] = Value::Null;
        }
        format!("data: {doc}\n\n")
    };
    let first = chunk(json!({"role": "assistant", "content": ""}), None);
    let (prompt_tokens, cached) = (started.prompt_tokens, started.cached);
    let events = started.events;
    let stream = futures_util::stream::unfold(
        (Some(first), events, chunk, false),
        move |(pending, mut events, chunk, over)| async move {
            if let Some(p) = pending {
                return Some((p, (None, events, chunk, over)));
            }
            if over {
                return None;
            }
            let out = match events.recv().await {
                Some(Event::Text(t)) => chunk(json!({"content": t}), None),
                Some(Event::Done { tokens, finish }) => {
                    let mut out = chunk(json!({}), Some(finish_reason(&finish)));
                    if include_usage {
                        let mut last: Value =
                            serde_json::from_str(out.trim_start_matches("data: ").trim_end())
                                .unwrap_or_default();
                        last["choices"] = json!([]);
                        last["usage"] = usage(prompt_tokens, cached, tokens);
                        out.push_str(&format!("data: {last}\n\n"));
                    }
                    out.push_str("data: [DONE]\n\n");
                    return Some((out, (None, events, chunk, true)));
                }
                Some(Event::Failed(e)) => {
                    let out = format!("data: {}\n\ndata: [DONE]\n\n", e.body(Api::OpenAi));
                    return Some((out, (None, events, chunk, true)));
                }
                Some(Event::Started { .. }) | None => return None,
            };
            Some((out, (None, events, chunk, false)))
        },
    );
    Ok(sse_response(stream))
}
