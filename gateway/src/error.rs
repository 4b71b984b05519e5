//! The error body every route answers with: `{"error":{"code","message","meta"}}`,
//! and how a [`service::Error`] becomes one: its status, code, message,
//! `meta` and headers are the API's contract (DESIGN §7 and the quotas
//! reference), so they are decided here, once, for the HTTP routes and the
//! tower Layer alike.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use meter::{BreachKind, FieldError, PortError};

use crate::dto::errors::{
    ConcurrencyMeta, ErrorBody, ErrorDetail, ErrorMeta, ExceededMeta, FieldMeta, NoMeta, StorageMeta, UnenforceableMeta,
};
use crate::dto::prices::PriceKeyView;
use crate::dto::quotas::LimitView;
use crate::service::{self, Refusal, Remaining};

/// A refusal or failure, ready to be sent.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub meta: ErrorMeta,
    /// Boxed: most errors carry none, and a small error keeps every
    /// `Result` on the request path small.
    pub headers: Box<HeaderMap>,
    /// A refused check's explanation, when it asked for one.
    pub explain: Option<Box<Vec<crate::dto::check::ExplainedView>>>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            meta: ErrorMeta::None(NoMeta {}),
            headers: Box::default(),
            explain: None,
        }
    }
    pub fn with_meta(mut self, meta: ErrorMeta) -> Self {
        self.meta = meta;
        self
    }
    /// The field an `INVALID_REQUEST` (or a check's `UNAUTHENTICATED`) names.
    pub fn field(&self) -> Option<&str> {
        match &self.meta {
            ErrorMeta::Field(f) => Some(&f.field),
            _ => None,
        }
    }
    /// 400 `INVALID_REQUEST` naming the offending field.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        let field = field.into();
        let message = message.into();
        ApiError::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", format!("{field}: {message}"))
            .with_meta(ErrorMeta::Field(FieldMeta { field }))
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

const REMAINING_CALLS: HeaderName = HeaderName::from_static("x-quota-remaining-calls");
const REMAINING_ROWS: HeaderName = HeaderName::from_static("x-quota-remaining-rows");
const QUOTA_RESET: HeaderName = HeaderName::from_static("x-quota-reset");

/// Sets the `X-Quota-*` headers of an answer to a caller with quotas in
/// the answer's own `headers` (nothing is built to be copied over, and the
/// names are constants).
pub fn put_remaining(headers: &mut HeaderMap, r: &Remaining) {
    if let Some(c) = r.calls {
        headers.insert(REMAINING_CALLS, HeaderValue::from(c));
    }
    if let Some(rows) = r.rows {
        headers.insert(REMAINING_ROWS, HeaderValue::from(rows));
    }
    if let Some(t) = r.reset {
        let value = t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        // An RFC 3339 time is visible ASCII: a valid value, taken as it is.
        if let Ok(h) = HeaderValue::try_from(value) {
            headers.insert(QUOTA_RESET, h);
        }
    }
}

/// The error of a refused check (429 `QUOTA_EXCEEDED` with `Retry-After`,
/// 409 `QUOTA_STORAGE_EXCEEDED`, 409 `QUOTA_UNENFORCEABLE`), with the
/// `X-Quota-*` headers.
fn refusal(r: &Refusal) -> ApiError {
    let b = &r.breach;
    let subject = match &b.scope_ref {
        Some(s) => format!("{} {s}", b.scope),
        None if matches!(b.scope, meter::Scope::Project | meter::Scope::Agent) => format!("project {}", r.project),
        None => format!("{} (all)", b.scope),
    };
    let limit = LimitView::of(b.metric, b.limit);
    let (quota_id, metric) = (b.quota_id.to_string(), b.metric.as_str().to_owned());
    let e = match b.kind {
        BreachKind::Exceeded => {
            let e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "QUOTA_EXCEEDED",
                format!("Quota exceeded for {subject}."),
            )
            .with_meta(ErrorMeta::Exceeded(Box::new(ExceededMeta {
                quota_id,
                metric,
                limit,
                window: b.window.as_str().to_owned(),
                resets_at: b.resets_at,
            })));
            match b.retry_after_secs {
                Some(secs) => e.header("retry-after", &secs.to_string()),
                None => e,
            }
        }
        BreachKind::Storage => ApiError::new(
            StatusCode::CONFLICT,
            "QUOTA_STORAGE_EXCEEDED",
            format!(
                "Storage quota {} exceeded: the project would store more than its {}-byte limit.",
                b.quota_id, b.limit
            ),
        )
        .with_meta(ErrorMeta::Storage(Box::new(StorageMeta {
            quota_id,
            metric,
            limit,
            current_bytes: b.used,
        }))),
        BreachKind::Unenforceable => ApiError::new(
            StatusCode::CONFLICT,
            "QUOTA_UNENFORCEABLE",
            format!(
                "Cost quota {} cannot be enforced: the current window metered usage but priced none of it.",
                b.quota_id
            ),
        )
        .with_meta(ErrorMeta::Unenforceable(Box::new(UnenforceableMeta {
            quota_id,
            metric,
            limit,
            window: b.window.as_str().to_owned(),
            unpriced_rows: r.unpriced_rows.iter().map(PriceKeyView::from).collect(),
        }))),
    };
    let mut e = e;
    put_remaining(&mut e.headers, &r.remaining);
    e
}

impl From<service::Error> for ApiError {
    fn from(e: service::Error) -> Self {
        use service::Error as E;
        match e {
            E::Invalid(f) => ApiError::invalid(f.field, f.message),
            E::NotFound { what, id } => ApiError::not_found(what, &id),
            E::Unauthenticated { message, field } => {
                let e = ApiError::unauthenticated(message);
                match field {
                    Some(f) => e.with_meta(ErrorMeta::Field(FieldMeta { field: f.to_owned() })),
                    None => e,
                }
            }
            E::Refused(r) => refusal(&r),
            E::TooManyConcurrent { limit, whose, owner } => {
                let message = match &owner {
                    Some(id) => {
                        format!("Too many concurrent calls: {} {id} holds its {limit} permits.", whose.as_str())
                    }
                    None => format!("Too many concurrent calls: the installation holds its {limit} permits."),
                };
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "TOO_MANY_CONCURRENT", message)
                    .with_meta(ErrorMeta::Concurrency(Box::new(ConcurrencyMeta {
                        limit,
                        whose: whose.as_str().to_owned(),
                        id: owner,
                    })))
                    .header("retry-after", "1")
            }
            e @ E::ExportRunning { .. } => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too-many-heavy-requests", e.to_string())
                    .with_meta(ErrorMeta::Heavy(Box::new(crate::dto::errors::HeavyMeta {
                        endpoint: "exports".to_owned(),
                        limit: 1,
                        whose: "project".to_owned(),
                    })))
                    .header("retry-after", "1")
            }
            E::Explained { error, explain } => {
                let mut e = ApiError::from(*error);
                e.explain = Some(Box::new(crate::dto::check::explained(&explain)));
                e
            }
            e @ E::QuotaConflict => ApiError::new(StatusCode::CONFLICT, "QUOTA_CONFLICT", e.to_string()),
            E::Conflict(m) => ApiError::new(StatusCode::CONFLICT, "CONFLICT", m),
            e @ E::LogUnavailable => ApiError::unavailable("LOG_UNAVAILABLE", e.to_string()),
            e @ E::ViewUnavailable => ApiError::unavailable("VIEW_UNAVAILABLE", e.to_string()),
            E::Backend(PortError::Conflict(m)) => ApiError::new(StatusCode::CONFLICT, "CONFLICT", m),
            E::Backend(PortError::Transient(m) | PortError::Fenced(m)) => {
                tracing::warn!(error = %m, "backend unavailable");
                ApiError::unavailable("UNAVAILABLE", "a backend is unavailable; retry")
            }
            E::Backend(PortError::Permanent(m)) => {
                tracing::error!(error = %m, "backend failure");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", "internal error")
            }
        }
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        ApiError::invalid(e.field, e.message)
    }
}

impl From<PortError> for ApiError {
    fn from(e: PortError) -> Self {
        service::Error::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail { code: self.code.to_owned(), message: self.message, meta: self.meta },
            explain: self.explain.map(|e| *e),
        };
        let mut res = (self.status, axum::Json(body)).into_response();
        res.headers_mut().extend(*self.headers);
        res
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod remaining_tests {
    use chrono::TimeZone;

    use super::*;

    #[test]
    fn put_remaining_sets_each_header_it_has_a_value_for_and_no_other() {
        let mut headers = HeaderMap::new();
        headers.insert("x-quota-remaining-calls", HeaderValue::from_static("stale"));
        let reset = chrono::Utc.with_ymd_and_hms(2026, 12, 7, 0, 0, 0).single();
        put_remaining(&mut headers, &Remaining { calls: Some(41), rows: None, reset });
        assert_eq!(headers.get("x-quota-remaining-calls").and_then(|v| v.to_str().ok()), Some("41"));
        assert_eq!(headers.get("x-quota-reset").and_then(|v| v.to_str().ok()), Some("2026-12-07T00:00:00Z"));
        assert!(headers.get("x-quota-remaining-rows").is_none());
        assert_eq!(headers.len(), 2, "replaced, not appended");

        put_remaining(&mut headers, &Remaining { calls: None, rows: Some(0), reset: None });
        assert_eq!(headers.get("x-quota-remaining-rows").and_then(|v| v.to_str().ok()), Some("0"));
    }
}
