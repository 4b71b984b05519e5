//! Admin routes for the price book and the `quota_unpriced` exceptions.

use axum::Json;
use axum::extract::State;

use crate::auth::AdminAuth;
use crate::dto::errors::ErrorBody;
use crate::dto::prices::{ExceptionList, ExceptionParams, PriceList, PriceParams, PricesBody};
use crate::dto::{Body, Params};
use crate::error::ApiResult;
use crate::service::admin_api;
use crate::service::pricing::{self, ExceptionsQuery, NewPrice, PriceFilter};
use crate::state::AppState;

#[utoipa::path(put, path = "/v1/prices", tag = "admin", security(("admin_token" = [])),
    request_body = PricesBody,
    responses(
        (status = 200, description = "The rows written (a row with the same key and effective_from is replaced); audited as one installation-wide entry, prices:PutPrices (GET /v1/audit?scope=installation)", body = PriceList),
        (status = 400, description = "INVALID_REQUEST naming the row and field; nothing was written", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "prices[0].component: must be one of input_tokens, output_tokens, cached_tokens", "meta": {"field": "prices[0].component"}}})),
    ))]
pub async fn put_prices(
    _: AdminAuth,
    State(s): State<AppState>,
    Body(body): Body<PricesBody>,
) -> ApiResult<Json<PriceList>> {
    let written = pricing::put(&s, Vec::<NewPrice>::try_from(body)?, &admin_api()).await?;
    Ok(Json(PriceList::from(written.as_slice())))
}

#[utoipa::path(get, path = "/v1/prices", tag = "admin", security(("admin_token" = [])),
    params(PriceParams),
    responses(
        (status = 200, description = "The price book, every row with its effective_from", body = PriceList),
        (status = 400, description = "INVALID_REQUEST naming the parameter", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "colour: is not a known parameter", "meta": {"field": "colour"}}})),
    ))]
pub async fn get_prices(
    _: AdminAuth,
    State(s): State<AppState>,
    Params(p): Params<PriceParams>,
) -> ApiResult<Json<PriceList>> {
    let rows = pricing::book(&s, &PriceFilter::from(p)).await?;
    Ok(Json(PriceList::from(rows.as_slice())))
}

#[utoipa::path(get, path = "/v1/exceptions", tag = "admin", security(("admin_token" = [])),
    params(ExceptionParams),
    responses(
        (status = 200, description = "The project's quota_unpriced exceptions, one per cost quota", body = ExceptionList),
        (status = 400, description = "INVALID_REQUEST naming the parameter", body = ErrorBody,
         example = json!({"error": {"code": "INVALID_REQUEST", "message": "limit: must be between 1 and 1000", "meta": {"field": "limit"}}})),
    ))]
pub async fn exceptions(
    _: AdminAuth,
    State(s): State<AppState>,
    Params(p): Params<ExceptionParams>,
) -> ApiResult<Json<ExceptionList>> {
    let page = pricing::exceptions(&s, &ExceptionsQuery::try_from(p)?).await?;
    Ok(Json(ExceptionList::from(&page)))
}
