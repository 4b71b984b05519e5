//! The error body every route answers with: `{"error":{"code","message","meta"}}`.

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use meter::{FieldError, PortError};
use serde_json::{Value, json};

/// A refusal or failure, ready to be sent.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub meta: Value,
    /// Boxed: most errors carry none, and a small error keeps every
    /// `Result` on the request path small.
    pub headers: Box<HeaderMap>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into(), meta: json!({}), headers: Box::default() }
    }
    pub fn with_meta(mut self, meta: Value) -> Self {
        self.meta = meta;
        self
    }
    /// 400 `INVALID_REQUEST` naming the offending field.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        let field = field.into();
        let message = message.into();
        ApiError::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", format!("{field}: {message}"))
            .with_meta(json!({ "field": field }))
    }
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", message)
    }
    pub fn not_found(what: &str, id: &str) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", format!("{what} {id} does not exist"))
    }
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
    }
    pub fn header(mut self, name: &'static str, value: &str) -> Self {
        if let Ok(v) = HeaderValue::from_str(value) {
            self.headers.insert(name, v);
        }
        self
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError::invalid(e.field, e.message)
    }
}

impl From<PortError> for ApiError {
    fn from(e: PortError) -> Self {
        match e {
            PortError::Conflict(m) => ApiError::new(StatusCode::CONFLICT, "CONFLICT", m),
            PortError::Transient(m) | PortError::Fenced(m) => {
                tracing::warn!(error = %m, "backend unavailable");
                ApiError::unavailable("UNAVAILABLE", "a backend is unavailable; retry")
            }
            PortError::Permanent(m) => {
                tracing::error!(error = %m, "backend failure");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", "internal error")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "code": self.code, "message": self.message, "meta": self.meta } });
        let mut res = (self.status, axum::Json(body)).into_response();
        res.headers_mut().extend(*self.headers);
        res
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
