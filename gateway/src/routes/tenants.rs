//! Admin routes for tenants: projects, API keys and roles.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use meter::{ApiKeyId, ProjectId, RoleId};

use crate::auth::AdminAuth;
use crate::dto::errors::ErrorBody;
use crate::dto::tenants::{
    ApiKeyBody, IssuedKeyView, KeyDetailView, KeyGrantsBody, ProjectBody, ProjectView, RoleBody, RoleView,
};
use crate::dto::{Body, path_id};
use crate::error::ApiResult;
use crate::service::admin_api;
use crate::service::provisioning::{self, KeyGrants, NewApiKey, NewProject, NewRole};
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/projects", tag = "admin", security(("admin_token" = [])),
    request_body = ProjectBody,
    responses(
        (status = 201, description = "The project", body = ProjectView),
        (status = 400, description = "INVALID_REQUEST naming the field", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "timezone: \"Mars/Olympus\" is not an IANA time zone", "meta": {"field": "timezone"}}})),
    ))]
pub async fn create_project(
    _: AdminAuth,
    State(s): State<AppState>,
    Body(body): Body<ProjectBody>,
) -> ApiResult<(StatusCode, Json<ProjectView>)> {
    let project = provisioning::create_project(&s, NewProject::try_from(body)?).await?;
    Ok((StatusCode::CREATED, Json(ProjectView::from(&project))))
}

#[utoipa::path(get, path = "/v1/projects/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The project")),
    responses(
        (status = 200, description = "The project", body = ProjectView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_project(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<ProjectView>> {
    let id = path_id("project", id, ProjectId::parse)?;
    Ok(Json(ProjectView::from(&provisioning::project(&s, &id).await?)))
}

#[utoipa::path(post, path = "/v1/projects/{id}/api-keys", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The project")),
    request_body = ApiKeyBody,
    responses(
        (status = 201, description = "The key, with its secret shown this once", body = IssuedKeyView),
        (status = 400, description = "INVALID_REQUEST naming the field", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "grants.max_rows: must be greater than 0", "meta": {"field": "grants.max_rows"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn create_api_key(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<ApiKeyBody>,
) -> ApiResult<(StatusCode, Json<IssuedKeyView>)> {
    let project = path_id("project", id, ProjectId::parse)?;
    let issued = provisioning::create_api_key(&s, &project, NewApiKey::try_from(body)?, &admin_api()).await?;
    Ok((StatusCode::CREATED, Json(IssuedKeyView::from(&issued))))
}

#[utoipa::path(get, path = "/v1/api-keys/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The key")),
    responses(
        (status = 200, description = "The key with effective limits and usage this period", body = KeyDetailView),
        (status = 404, description = "NOT_FOUND (never existed, or deleted)", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "api key key_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_api_key(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<KeyDetailView>> {
    let id = path_id("api key", id, ApiKeyId::parse)?;
    Ok(Json(KeyDetailView::from(&provisioning::api_key(&s, &id).await?)))
}

#[utoipa::path(put, path = "/v1/api-keys/{id}/grants", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The key")),
    request_body = KeyGrantsBody,
    responses(
        (status = 200, description = "The key as it is now, with its effective limits; audited as keys:UpdateApiKey", body = KeyDetailView),
        (status = 400, description = "INVALID_REQUEST naming the field (a role of another project is `role_id`)", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "grants.max_concurrent: must be between 1 and 1000", "meta": {"field": "grants.max_concurrent"}}})),
        (status = 404, description = "NOT_FOUND (never existed, or deleted)", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "api key key_nope does not exist", "meta": {}}})),
    ))]
/// Replaces a key's grants and role. The gateway that answers runs its next
/// check under them at once; another gateway within its configuration TTL.
pub async fn put_grants(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<KeyGrantsBody>,
) -> ApiResult<Json<KeyDetailView>> {
    let id = path_id("api key", id, ApiKeyId::parse)?;
    let change = KeyGrants::try_from(body)?;
    Ok(Json(KeyDetailView::from(&provisioning::set_grants(&s, &id, change, &admin_api()).await?)))
}

#[utoipa::path(delete, path = "/v1/api-keys/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The key")),
    responses(
        (status = 204, description = "Deleted: the key no longer authenticates; quotas naming it go inert"),
        (status = 404, description = "NOT_FOUND (never existed, or already deleted)", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "api key key_nope does not exist", "meta": {}}})),
    ))]
pub async fn delete_api_key(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = path_id("api key", id, ApiKeyId::parse)?;
    provisioning::delete_api_key(&s, &id, &admin_api()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/projects/{id}/roles", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The project")),
    request_body = RoleBody,
    responses(
        (status = 201, description = "The role", body = RoleView),
        (status = 400, description = "INVALID_REQUEST naming the field", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "quota.per: must be day or month", "meta": {"field": "quota.per"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn create_role(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<RoleBody>,
) -> ApiResult<(StatusCode, Json<RoleView>)> {
    let project = path_id("project", id, ProjectId::parse)?;
    let role = provisioning::create_role(&s, &project, NewRole::try_from(body)?, &admin_api()).await?;
    Ok((StatusCode::CREATED, Json(RoleView::from(&role))))
}

#[utoipa::path(get, path = "/v1/roles/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The role")),
    responses(
        (status = 200, description = "The role", body = RoleView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "role role_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_role(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<RoleView>> {
    let id = path_id("role", id, RoleId::parse)?;
    Ok(Json(RoleView::from(&provisioning::role(&s, &id).await?)))
}
