//! `POST /v1/permits/{id}/renew` and `DELETE /v1/permits/{id}`, for gateways
//! (the gateway token, or the admin token).

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use meter::PermitId;

use crate::auth::GatewayAuth;
use crate::dto::check::PermitView;
use crate::dto::errors::ErrorBody;
use crate::dto::path_id;
use crate::error::ApiResult;
use crate::service::permits;
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/permits/{id}/renew", tag = "hot path", security(("gateway_token" = [])),
    params(("id" = String, Path, description = "The permit a check took")),
    responses(
        (status = 200, description = "Renewed: its lease now ends its lease length from now", body = PermitView),
        (status = 404, description = "NOT_FOUND: released, lapsed or never taken; check again", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "permit pmt_0197a3c7 does not exist", "meta": {}}})),
    ))]
pub async fn renew(_: GatewayAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<PermitView>> {
    let id = path_id("permit", id, PermitId::parse)?;
    Ok(Json(PermitView::from(&permits::renew(&s, &id).await?)))
}

#[utoipa::path(delete, path = "/v1/permits/{id}", tag = "hot path", security(("gateway_token" = [])),
    params(("id" = String, Path, description = "The permit a check took")),
    responses(
        (status = 204, description = "Released: its slot is free"),
        (status = 404, description = "NOT_FOUND: released before, lapsed or never taken", body = ErrorBody,
         example = json!({"error": {"code": "NOT_FOUND", "message": "permit pmt_0197a3c7 does not exist", "meta": {}}})),
    ))]
pub async fn release(_: GatewayAuth, State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = path_id("permit", id, PermitId::parse)?;
    permits::release(&s, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
