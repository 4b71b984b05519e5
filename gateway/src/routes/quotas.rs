//! Admin routes for quotas: one by one, and a project's whole set.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use meter::{ProjectId, QuotaId, QuotaSpec};

use crate::auth::AdminAuth;
use crate::dto::errors::ErrorBody;
use crate::dto::quotas::{
    DryRunParams, ListQuotasParams, PlanView, QuotaBody, QuotaDocumentBody, QuotaList, QuotaPatchBody, QuotaView,
};
use crate::dto::{Body, Params, path_id};
use crate::error::ApiResult;
use crate::service::admin_api;
use crate::service::quotas::{self, Document, Edit};
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/quotas", tag = "admin", security(("admin_token" = [])),
    request_body = QuotaBody,
    responses(
        (status = 201, description = "The quota", body = QuotaView),
        (status = 400, description = "INVALID_REQUEST naming the field", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "window: current is only valid for storage_bytes; calls needs a window", "meta": {"field": "window"}}})),
        (status = 409, description = "QUOTA_CONFLICT: a quota with the same identity exists", body = ErrorBody,
         example = json!({"error": {"code": "QUOTA_CONFLICT", "message": "a quota with the same project, scope, scope_ref, metric, window and meter_type exists", "meta": {}}})),
    ))]
pub async fn create_quota(
    _: AdminAuth,
    State(s): State<AppState>,
    Body(body): Body<QuotaBody>,
) -> ApiResult<(StatusCode, Json<QuotaView>)> {
    let quota = quotas::create(&s, QuotaSpec::try_from(body)?, &admin_api()).await?;
    Ok((StatusCode::CREATED, Json(QuotaView { inert: Some(false), ..QuotaView::from(&quota) })))
}

#[utoipa::path(get, path = "/v1/quotas", tag = "admin", security(("admin_token" = [])),
    params(ListQuotasParams),
    responses(
        (status = 200, description = "The project's quotas (current_usage is null in a list)", body = QuotaList,
         example = json!({"data": [], "next": null})),
        (status = 400, description = "INVALID_REQUEST: no project_id", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "project_id: is required", "meta": {"field": "project_id"}}})),
    ))]
pub async fn list_quotas(
    _: AdminAuth,
    State(s): State<AppState>,
    Params(params): Params<ListQuotasParams>,
) -> ApiResult<Json<QuotaList>> {
    let listed = quotas::list(&s, &ProjectId::try_from(params)?).await?;
    Ok(Json(QuotaList::from(listed.as_slice())))
}

#[utoipa::path(get, path = "/v1/quotas/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The quota")),
    responses(
        (status = 200, description = "The quota with current_usage (durable + settled + reserved)", body = QuotaView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "quota quota_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_quota(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<QuotaView>> {
    let id = path_id("quota", id, QuotaId::parse)?;
    Ok(Json(QuotaView::from(quotas::get(&s, &id).await?)))
}

#[utoipa::path(patch, path = "/v1/quotas/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The quota")),
    request_body = QuotaPatchBody,
    responses(
        (status = 200, description = "The quota", body = QuotaView),
        (status = 400, description = "INVALID_REQUEST: an immutable field was changed, or a bad limit or mode", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "window: is immutable; replace the quota to change it", "meta": {"field": "window"}}})),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "quota quota_nope does not exist", "meta": {}}})),
    ))]
pub async fn patch_quota(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<QuotaPatchBody>,
) -> ApiResult<Json<QuotaView>> {
    let id = path_id("quota", id, QuotaId::parse)?;
    let listed = quotas::edit(&s, &id, Edit::try_from(body)?).await?;
    Ok(Json(QuotaView::from(&listed)))
}

#[utoipa::path(delete, path = "/v1/quotas/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The quota")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "quota quota_nope does not exist", "meta": {}}})),
    ))]
pub async fn delete_quota(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = path_id("quota", id, QuotaId::parse)?;
    quotas::delete(&s, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(put, path = "/v1/projects/{id}/quotas", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The project"), DryRunParams),
    request_body = QuotaDocumentBody,
    responses(
        (status = 200, description = "What changed: created, updated, deleted, unchanged and each change", body = PlanView),
        (status = 400, description = "INVALID_REQUEST naming the entry and field (quotas[2].window); nothing changed", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "quotas[0].window: is immutable: the stored quota has day, the entry rolling_1h", "meta": {"field": "quotas[0].window"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn put_project_quotas(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Params(params): Params<DryRunParams>,
    Body(body): Body<QuotaDocumentBody>,
) -> ApiResult<Json<PlanView>> {
    let dry_run = params.dry_run()?;
    let project = path_id("project", id, ProjectId::parse)?;
    let plan = quotas::apply_document(&s, &project, Document::try_from(body)?, dry_run).await?;
    Ok(Json(PlanView::of(&plan, dry_run)))
}
