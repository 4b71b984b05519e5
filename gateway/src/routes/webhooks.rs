//! Admin routes for webhooks: endpoints, secret rotation, the delivery log,
//! resend, recover and the test fire.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use meter::{MessageId, ProjectId, WebhookId};

use crate::auth::AdminAuth;
use crate::dto::errors::ErrorBody;
use crate::dto::webhooks::{
    DeliveriesParams, DeliveryPage, EndpointBody, EndpointList, EndpointPatchBody, EndpointView,
    EndpointWithSecretView, QueuedView, RecoverBody, RecoverView,
};
use crate::dto::{Body, Params, path_id};
use crate::error::ApiResult;
use crate::service::admin_api;
use crate::service::webhooks::{self, DeliveriesQuery, EndpointPatch, NewEndpoint};
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/projects/{id}/webhooks", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The project")),
    request_body = EndpointBody,
    responses(
        (status = 201, description = "The endpoint, with its signing secret shown this once", body = EndpointWithSecretView),
        (status = 400, description = "INVALID_REQUEST naming the field; nothing was created", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "url: must not be a private, loopback or link-local address (TOLLGATE_WEBHOOK_ALLOW_PRIVATE allows them)", "meta": {"field": "url"}}})),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn create_webhook(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<EndpointBody>,
) -> ApiResult<(StatusCode, Json<EndpointWithSecretView>)> {
    let project = path_id("project", id, ProjectId::parse)?;
    let made = webhooks::create(&s, &project, NewEndpoint::try_from(body)?, &admin_api()).await?;
    Ok((StatusCode::CREATED, Json(EndpointWithSecretView::from(&made))))
}

#[utoipa::path(get, path = "/v1/projects/{id}/webhooks", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The project")),
    responses(
        (status = 200, description = "The project's endpoints (without their secrets)", body = EndpointList),
        (status = 404, description = "NOT_FOUND: no such project", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "project proj_nope does not exist", "meta": {}}})),
    ))]
pub async fn list_webhooks(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<EndpointList>> {
    let project = path_id("project", id, ProjectId::parse)?;
    let list = webhooks::list(&s, &project).await?;
    Ok(Json(EndpointList { data: list.iter().map(EndpointView::from).collect() }))
}

#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint")),
    responses(
        (status = 200, description = "The endpoint (without its secret)", body = EndpointView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
    ))]
pub async fn get_webhook(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<EndpointView>> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    Ok(Json(EndpointView::from(&webhooks::get(&s, &id).await?)))
}

#[utoipa::path(patch, path = "/v1/webhooks/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint")),
    request_body = EndpointPatchBody,
    responses(
        (status = 200, description = "The endpoint as changed", body = EndpointView),
        (status = 400, description = "INVALID_REQUEST naming the field; nothing changed", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "event_types[0]: must be one of quota.exceeded, quota.nearly_used, export.completed, export.failed, webhook.test, quota.*, export.*, *", "meta": {"field": "event_types[0]"}}})),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
    ))]
pub async fn patch_webhook(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<EndpointPatchBody>,
) -> ApiResult<Json<EndpointView>> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    let changed = webhooks::patch(&s, &id, EndpointPatch::try_from(body)?, &admin_api()).await?;
    Ok(Json(EndpointView::from(&changed)))
}

#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint")),
    responses(
        (status = 204, description = "Deleted, with its pending deliveries"),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
    ))]
pub async fn delete_webhook(_: AdminAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    webhooks::delete(&s, &id, &admin_api()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/webhooks/{id}/rotate-secret", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint")),
    responses(
        (status = 200, description = "The new secret, shown this once; the old one signs beside it for 24 h", body = EndpointWithSecretView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
    ))]
pub async fn rotate_secret(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<EndpointWithSecretView>> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    Ok(Json(EndpointWithSecretView::from(&webhooks::rotate_secret(&s, &id, &admin_api()).await?)))
}

#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint"), DeliveriesParams),
    responses(
        (status = 200, description = "Messages in time order, each with its attempts, and the cursor of the next page", body = DeliveryPage),
        (status = 400, description = "INVALID_REQUEST naming the parameter", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "limit: must be between 1 and 100", "meta": {"field": "limit"}}})),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
        (status = 429, description = "too-many-heavy-requests: this caller already runs as many deliveries reads as it may at once (or the installation its permits); Retry-After: 1", body = ErrorBody,
         example = json!({"error": {"code": "too-many-heavy-requests", "message": "Too many heavy requests: deliveries allows 4 at once per caller.", "meta": {"endpoint": "deliveries", "limit": 4, "whose": "caller"}}})),
        (status = 503, description = "heavy-request-timed-out: the read did not answer within its time bound (TOLLGATE_HEAVY_TIMEOUT)", body = ErrorBody,
         example = json!({"error": {"code": "heavy-request-timed-out", "message": "deliveries did not answer within its time bound of 30000 ms", "meta": {}}})),
    ))]
pub async fn deliveries(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Params(p): Params<DeliveriesParams>,
) -> ApiResult<Json<DeliveryPage>> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    let page = webhooks::deliveries(&s, &id, &DeliveriesQuery::try_from(p)?).await?;
    Ok(Json(DeliveryPage::from(&page)))
}

#[utoipa::path(post, path = "/v1/webhooks/{id}/deliveries/{message_id}/resend", tag = "admin",
    security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint"), ("message_id" = String, Path, description = "The message")),
    responses(
        (status = 202, description = "Queued again, now, with a fresh schedule (also a message that was delivered)", body = QueuedView),
        (status = 404, description = "NOT_FOUND: no such endpoint, or it never got that message", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "message msg_nope does not exist", "meta": {}}})),
    ))]
pub async fn resend(
    _: AdminAuth,
    State(s): State<AppState>,
    Path((id, message)): Path<(String, String)>,
) -> ApiResult<(StatusCode, Json<QueuedView>)> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    let message = path_id("message", message, MessageId::parse)?;
    webhooks::resend(&s, &id, &message).await?;
    Ok((StatusCode::ACCEPTED, Json(QueuedView { message_id: message.to_string() })))
}

#[utoipa::path(post, path = "/v1/webhooks/{id}/recover", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint")),
    request_body = RecoverBody,
    responses(
        (status = 202, description = "How many finally failed deliveries were queued again", body = RecoverView),
        (status = 400, description = "INVALID_REQUEST naming the field", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "since: must be an RFC 3339 timestamp", "meta": {"field": "since"}}})),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
    ))]
pub async fn recover(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Body(body): Body<RecoverBody>,
) -> ApiResult<(StatusCode, Json<RecoverView>)> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    let (since, until) = <(_, _)>::try_from(body)?;
    let resent = webhooks::recover(&s, &id, since, until).await?;
    Ok((StatusCode::ACCEPTED, Json(RecoverView { resent })))
}

#[utoipa::path(post, path = "/v1/webhooks/{id}/test", tag = "admin", security(("admin_token" = [])),
    params(("id" = String, Path, description = "The endpoint")),
    responses(
        (status = 202, description = "A webhook.test message, marked as a test, queued for this endpoint", body = QueuedView),
        (status = 404, description = "NOT_FOUND", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "webhook wh_nope does not exist", "meta": {}}})),
    ))]
pub async fn test(
    _: AdminAuth,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<QueuedView>)> {
    let id = path_id("webhook", id, WebhookId::parse)?;
    let message = webhooks::test(&s, &id).await?;
    Ok((StatusCode::ACCEPTED, Json(QueuedView { message_id: message.to_string() })))
}
