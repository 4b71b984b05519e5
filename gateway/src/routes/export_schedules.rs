//! Admin routes for export schedules: define one, list, read (with its
//! recent runs), change, delete, and run now.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;

use crate::auth::AdminAuth;
use crate::dto::errors::ErrorBody;
use crate::dto::export_schedules::{
    ScheduleBody, ScheduleDetailView, SchedulePage, ScheduleParams, SchedulePatchBody, ScheduleView,
};
use crate::dto::{Body, Params};
use crate::error::ApiResult;
use crate::service::admin_api;
use crate::service::export_schedules::{self, NewSchedule, SchedulePatch};
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/export-schedules", tag = "admin", security(("admin_token" = [])),
    request_body = ScheduleBody,
    responses(
        (status = 201, description = "The schedule, with when it first runs", body = ScheduleView),
        (status = 400, description = "INVALID_REQUEST naming the field; nothing was created", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "destination: must be a relative directory under the export directory: no leading `/`, no `..`, `.` or empty part", "meta": {"field": "destination"}}})),
        (status = 404, description = "NOT_FOUND: a project named does not exist", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn create_schedule(
    _: AdminAuth,
    State(s): State<AppState>,
    Body(body): Body<ScheduleBody>,
) -> ApiResult<(StatusCode, Json<ScheduleView>)> {
    let made = export_schedules::create(&s, NewSchedule::try_from(body)?, &admin_api()).await?;
    Ok((StatusCode::CREATED, Json(ScheduleView::from(&made))))
}

#[utoipa::path(get, path = "/v1/export-schedules", tag = "admin", security(("admin_token" = [])),
    params(ScheduleParams),
    responses(
        (status = 200, description = "Schedules by id, and the cursor of the next page", body = SchedulePage),
        (status = 400, description = "INVALID_REQUEST naming the parameter", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "limit: must be between 1 and 100", "meta": {"field": "limit"}}})),
    ))]
pub async fn list_schedules(
    _: AdminAuth,
    State(s): State<AppState>,
    Params(p): Params<ScheduleParams>,
) -> ApiResult<Json<SchedulePage>> {
    let (after, limit) = <(Option<String>, usize)>::try_from(p)?;
    let page = export_schedules::list(&s, after.as_deref(), limit).await?;
    Ok(Json(SchedulePage { data: page.items.iter().map(ScheduleView::from).collect(), next: page.next }))
}

#[utoipa::path(get, path = "/v1/export-schedules/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The schedule (`exs_…`)")),
    responses(
        (status = 200, description = "The schedule and its 10 newest runs", body = ScheduleDetailView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "export schedule exs_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_schedule(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<ScheduleDetailView>> {
    let detail = export_schedules::get(&s, &id).await?;
    Ok(Json(ScheduleDetailView::of(&detail, |r| super::exports::downloadable(&s, r))))
}

#[utoipa::path(patch, path = "/v1/export-schedules/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The schedule")),
    request_body = SchedulePatchBody,
    responses(
        (status = 200, description = "The schedule as changed (a new cadence, or enabling it, sets its next run)", body = ScheduleView),
        (status = 400, description = "INVALID_REQUEST naming the field; nothing changed", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "cadence: `weekly` is not one of hourly, daily, monthly", "meta": {"field": "cadence"}}})),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "export schedule exs_nope does not exist", "meta": {}}})),
    ))]
pub async fn patch_schedule(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<SchedulePatchBody>,
) -> ApiResult<Json<ScheduleView>> {
    let changed = export_schedules::update(&s, &id, SchedulePatch::try_from(body)?, &admin_api()).await?;
    Ok(Json(ScheduleView::from(&changed)))
}

#[utoipa::path(delete, path = "/v1/export-schedules/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The schedule")),
    responses(
        (status = 204, description = "Deleted; its runs stay (they count for their exports)"),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "export schedule exs_nope does not exist", "meta": {}}})),
    ))]
pub async fn delete_schedule(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    export_schedules::delete(&s, &id, &admin_api()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/export-schedules/{id}/run", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The schedule")),
    responses(
        (status = 202, description = "Due now: a notifier runs it at its next step, then it keeps its cadence", body = ScheduleView),
        (status = 400, description = "INVALID_REQUEST: the schedule is disabled", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "enabled: the schedule is disabled: enable it before running it", "meta": {"field": "enabled"}}})),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "export schedule exs_nope does not exist", "meta": {}}})),
    ))]
pub async fn run_schedule(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<ScheduleView>)> {
    let due = export_schedules::run_now(&s, &id, &admin_api()).await?;
    Ok((StatusCode::ACCEPTED, Json(ScheduleView::from(&due))))
}
