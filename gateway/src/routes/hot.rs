//! The hot path: `POST /v1/check` and `POST /v1/events`, for gateways
//! (the gateway token, or the admin token).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::auth::GatewayAuth;
use crate::dto::Body;
use crate::dto::check::{CallLimits, CheckBody, CheckResponse, PermitView};
use crate::dto::errors::ErrorBody;
use crate::dto::events::{EventsAccepted, EventsBody, Reported};
use crate::error::{ApiResult, put_remaining};
use crate::service::admission::{self, CheckRequest, Checked};
use crate::service::recording;
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/check", tag = "hot path", security(("gateway_token" = [])),
    request_body = CheckBody,
    responses(
        (status = 200, description = "Admitted: a reservation to settle with the call's event", body = CheckResponse,
         headers(
            ("x-quota-remaining-calls" = u64, description = "Calls left under the tightest calls quota"),
            ("x-quota-remaining-rows" = u64, description = "Rows left under the tightest rows quota"),
            ("x-quota-reset" = String, description = "RFC 3339: when the tightest calls or rows quota resets"),
         )),
        (status = 400, description = "INVALID_REQUEST naming the field", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "role_id: a key's role is its own; role_id goes with user", "meta": {"field": "role_id"}}})),
        (status = 401, description = "UNAUTHENTICATED: not the gateway token, or an unknown api key", body = ErrorBody,
         example = json!({"error": {"code": "UNAUTHENTICATED", "message": "unknown api key", "meta": {"field": "api_key"}}})),
        (status = 409, description = "QUOTA_STORAGE_EXCEEDED, or QUOTA_UNENFORCEABLE over a pricing blackout; no Retry-After", body = ErrorBody,
         example = json!({"error": {"code": "QUOTA_STORAGE_EXCEEDED", "message": "Storage quota quota_0197a3c4 exceeded: the project would store more than its 1000-byte limit.",
                                    "meta": {"quota_id": "quota_0197a3c4", "metric": "storage_bytes", "limit": 1000, "current_bytes": 600}}})),
        (status = 429, description = "QUOTA_EXCEEDED, with Retry-After and the X-Quota-* headers; or \
            TOO_MANY_CONCURRENT (a check asking for a permit over `max_concurrent` or the installation's cap: \
            `Retry-After: 1`, meta `{\"limit\", \"whose\": \"api_key\"|\"role\"|\"installation\", \"id\"}`; nothing reserved, never queued)", body = ErrorBody,
         headers(
            ("retry-after" = u64, description = "Seconds until the window resets (1 for TOO_MANY_CONCURRENT)"),
            ("x-quota-remaining-calls" = u64, description = "Calls left under the tightest calls quota"),
            ("x-quota-remaining-rows" = u64, description = "Rows left under the tightest rows quota"),
            ("x-quota-reset" = String, description = "RFC 3339: when the tightest calls or rows quota resets"),
         ),
         example = json!({"error": {"code": "QUOTA_EXCEEDED", "message": "Quota exceeded for api_key key_0197a3c3.",
                                    "meta": {"quota_id": "quota_0197a3c4", "metric": "calls", "limit": 1000, "window": "day", "resets_at": "2026-07-08T00:00:00Z"}}})),
        (status = 503, description = "VIEW_UNAVAILABLE: the quota view is unreachable and policy refuses", body = ErrorBody,
         example = json!({"error": {"code": "VIEW_UNAVAILABLE", "message": "quota view unreachable; the check is refused by policy", "meta": {}}})),
    ))]
pub async fn check(_: GatewayAuth, State(s): State<AppState>, Body(body): Body<CheckBody>) -> ApiResult<Response> {
    let req = CheckRequest::try_from(body)?;
    Ok(match admission::check(&s, req).await? {
        Checked::Exempt => Json(CheckResponse::exempt()).into_response(),
        Checked::Admitted { reservation, bounds, remaining, degraded, permit, explain } => {
            let body = CheckResponse {
                allowed: true,
                exempt: None,
                reservation_id: Some(reservation.to_string()),
                permit: permit.as_ref().map(PermitView::from),
                limits: Some(CallLimits::from(bounds)),
                degraded: degraded.then_some(true),
                explain: explain.as_deref().map(crate::dto::check::explained),
            };
            let mut res = Json(body).into_response();
            put_remaining(res.headers_mut(), &remaining);
            res
        }
    })
}

#[utoipa::path(post, path = "/v1/events", tag = "hot path", security(("gateway_token" = [])),
    request_body = EventsBody,
    responses(
        (status = 202, description = "Every event is on the log (and the permits they name are released)", body = EventsAccepted),
        (status = 400, description = "INVALID_REQUEST naming the event and field; nothing was written", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "events[1].rows: must be a whole number ≥ 0", "meta": {"field": "events[1].rows"}}})),
        (status = 503, description = "LOG_UNAVAILABLE: the log did not acknowledge; nothing was acknowledged, retry with the same ids", body = ErrorBody,
         example = json!({"error": {"code": "LOG_UNAVAILABLE", "message": "the event log did not acknowledge the events; retry with the same ids", "meta": {}}})),
    ))]
pub async fn events(
    _: GatewayAuth,
    State(s): State<AppState>,
    Body(body): Body<EventsBody>,
) -> ApiResult<(StatusCode, Json<EventsAccepted>)> {
    let Reported { facts, permits } = Reported::try_from(body)?;
    let accepted = recording::settle(&s, facts, &permits).await?;
    Ok((StatusCode::ACCEPTED, Json(accepted.into())))
}
