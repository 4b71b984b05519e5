//! Admin routes that read what was folded: usage reports and the audit log.

use axum::Json;
use axum::extract::State;

use crate::auth::AdminAuth;
use crate::dto::Params;
use crate::dto::errors::ErrorBody;
use crate::dto::reports::{AuditPage, AuditParams, UsageParams, UsageReport};
use crate::error::ApiResult;
use crate::service::audit::{self, AuditQuery};
use crate::service::usage::{self, UsageQuery};
use crate::state::AppState;

#[utoipa::path(get, path = "/v1/usage", tag = "admin", security(("admin_token" = [])),
    params(UsageParams),
    responses(
        (status = 200, description = "Folded usage: for model, one row per (provider, model, component, meter_type, \
            embedding) with priced_quantity, unpriced_quantity and cost_usd; otherwise one row per actor_id, agent_id \
            or api_key_id with requests, calls, rows, tokens and cost_usd (all meters)", body = UsageReport),
        (status = 400, description = "INVALID_REQUEST naming the parameter", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "window: must be day or calendar_month; got \"current\"", "meta": {"field": "window"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
        (status = 429, description = "too-many-heavy-requests: this caller already runs as many usage reads as it may at once (or the installation its permits); Retry-After: 1", body = ErrorBody,
         example = json!({"error": {"code": "too-many-heavy-requests", "message": "Too many heavy requests: usage allows 4 at once per caller.", "meta": {"endpoint": "usage", "limit": 4, "whose": "caller"}}})),
        (status = 503, description = "heavy-request-timed-out: the read did not answer within its time bound (TOLLGATE_HEAVY_TIMEOUT)", body = ErrorBody,
         example = json!({"error": {"code": "heavy-request-timed-out", "message": "usage did not answer within its time bound of 30000 ms", "meta": {}}})),
    ))]
pub async fn usage(
    _: AdminAuth,
    State(s): State<AppState>,
    Params(p): Params<UsageParams>,
) -> ApiResult<Json<UsageReport>> {
    let report = usage::report(&s, UsageQuery::try_from(p)?).await?;
    Ok(Json(UsageReport::from(&report)))
}

#[utoipa::path(get, path = "/v1/audit", tag = "admin", security(("admin_token" = [])),
    params(AuditParams),
    responses(
        (status = 200, description = "Entries in time order (a project's, or with scope=installation the installation-wide ones, whose project_id is null), and the cursor of the next page", body = AuditPage),
        (status = 400, description = "INVALID_REQUEST naming the parameter (a project_id with scope=installation is refused as project_id)", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "page: page × limit must stay within 10,000 rows; page by cursor instead: pass after=<the next of the previous page>", "meta": {"field": "page"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
        (status = 429, description = "too-many-heavy-requests: this caller already runs as many audit reads as it may at once (or the installation its permits); Retry-After: 1", body = ErrorBody,
         example = json!({"error": {"code": "too-many-heavy-requests", "message": "Too many heavy requests: audit allows 4 at once per caller.", "meta": {"endpoint": "audit", "limit": 4, "whose": "caller"}}})),
        (status = 503, description = "heavy-request-timed-out: the read did not answer within its time bound (TOLLGATE_HEAVY_TIMEOUT)", body = ErrorBody,
         example = json!({"error": {"code": "heavy-request-timed-out", "message": "audit did not answer within its time bound of 30000 ms", "meta": {}}})),
    ))]
pub async fn audit(
    _: AdminAuth,
    State(s): State<AppState>,
    Params(p): Params<AuditParams>,
) -> ApiResult<Json<AuditPage>> {
    let page = audit::page(&s, &AuditQuery::try_from(p)?).await?;
    Ok(Json(AuditPage::from(&page)))
}
