//! Errors of `gturbo serve`, written in the shape of the API the request came in on:
//! OpenAI's `{"error": {"message", "type", "param", "code"}}` and Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`, with the status each API uses.

use axum::http::StatusCode;
use axum::response::Response;

/// Which API's shape an error is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    OpenAi,
    Anthropic,
}

/// What went wrong, as both APIs classify it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Malformed or out-of-range input (400).
    Invalid,
    /// The prompt does not fit the model's context (400).
    Context,
    /// No or a wrong API key (401).
    Auth,
    /// An unknown model or path (404).
    NotFound,
    /// A body over the size bound (413).
    TooLarge,
    /// The queue is full (429).
    Busy,
    /// The server failed (500).
    Server,
}

/// An error answer: its kind and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub kind: Kind,
    pub message: String,
    /// The request field at fault, when one is (OpenAI's `param`).
    pub param: Option<&'static str>,
}

impl ApiError {
    fn new(kind: Kind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            param: None,
        }
    }
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::Invalid, message)
    }
    /// An out-of-range or wrongly typed field.
    pub fn field(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param),
            ..ApiError::new(Kind::Invalid, message)
        }
    }
    pub fn context(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::Context, message)
    }
    pub fn auth(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::Auth, message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::NotFound, message)
    }
    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::TooLarge, message)
    }
    pub fn busy(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::Busy, message)
    }
    pub fn server(message: impl Into<String>) -> ApiError {
        ApiError::new(Kind::Server, message)
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            Kind::Invalid | Kind::Context => StatusCode::BAD_REQUEST,
            Kind::Auth => StatusCode::UNAUTHORIZED,
            Kind::NotFound => StatusCode::NOT_FOUND,
            Kind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Kind::Busy => StatusCode::TOO_MANY_REQUESTS,
            Kind::Server => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error document in `api`'s shape.
    pub fn body(&self, api: Api) -> serde_json::Value {
        match api {
            Api::OpenAi => {
                let (ty, code) = match self.kind {
                    Kind::Invalid => ("invalid_request_error", None),
                    Kind::Context => ("invalid_request_error", Some("context_length_exceeded")),
                    Kind::Auth => ("authentication_error", Some("invalid_api_key")),
                    Kind::NotFound => ("invalid_request_error", Some("model_not_found")),
                    Kind::TooLarge => ("invalid_request_error", Some("request_too_large")),
                    Kind::Busy => ("rate_limit_error", Some("rate_limit_exceeded")),
                    Kind::Server => ("server_error", None),
                };
                serde_json::json!({"error": {
                    "message": self.message, "type": ty, "param": self.param, "code": code,
                }})
            }
            Api::Anthropic => {
                let ty = match self.kind {
                    Kind::Invalid | Kind::Context => "invalid_request_error",
                    Kind::Auth => "authentication_error",
                    Kind::NotFound => "not_found_error",
                    Kind::TooLarge => "request_too_large",
                    Kind::Busy => "rate_limit_error",
                    Kind::Server => "api_error",
                };
                serde_json::json!({"type": "error", "error": {"type": ty, "message": self.message}})
            }
        }
    }

    /// The HTTP answer in `api`'s shape.
    pub fn response(&self, api: Api) -> Response {
        super::json_response(self.status(), &self.body(api))
    }
}
