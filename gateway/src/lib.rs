//! # gateway — Tollgate's HTTP service
//!
//! The hot path (`/v1/check`, `/v1/events`), the admin API (projects, API
//! keys, quotas, the declarative quota set, the audit log, prices and
//! exceptions, usage reports by model, actor, agent or key), `/healthz` and
//! `/openapi.json`. Handlers parse the body
//! field by field (a wrong field is a 400 naming it), call the rules in
//! `meter` and the ports in [`AppState`], and map the result.

pub mod admin;
pub mod apply;
pub mod auth;
pub mod embedded;
pub mod error;
pub mod fields;
pub mod hot;
pub mod layer;
pub mod pricing;
pub mod roles;
pub mod state;
pub mod usage;

use axum::Router;
use axum::routing::{get, post, put};
use utoipa::OpenApi;

pub use error::{ApiError, ApiResult};
pub use layer::TollgateLayer;
pub use state::{AppState, Settings, ViewDownPolicy};

#[derive(OpenApi)]
#[openapi(
    info(title = "Tollgate", description = "Usage metering and exact quota enforcement on an event log"),
    paths(
        hot::check,
        hot::events,
        admin::create_project,
        admin::get_project,
        admin::create_api_key,
        admin::get_api_key,
        admin::delete_api_key,
        admin::create_quota,
        admin::list_quotas,
        admin::get_quota,
        admin::patch_quota,
        admin::delete_quota,
        admin::put_project_quotas,
        admin::audit,
        pricing::put_prices,
        pricing::get_prices,
        pricing::exceptions,
        roles::create_role,
        roles::get_role,
        usage::usage,
    )
)]
pub struct ApiDoc;

async fn openapi() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(ApiDoc::openapi())
}

async fn healthz() -> &'static str {
    "ok"
}

/// The whole HTTP API over the given state.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/openapi.json", get(openapi))
        .route("/v1/check", post(hot::check))
        .route("/v1/events", post(hot::events))
        .route("/v1/projects", post(admin::create_project))
        .route("/v1/projects/{id}", get(admin::get_project))
        .route("/v1/projects/{id}/api-keys", post(admin::create_api_key))
        .route("/v1/projects/{id}/quotas", put(admin::put_project_quotas))
        .route("/v1/api-keys/{id}", get(admin::get_api_key).delete(admin::delete_api_key))
        .route("/v1/quotas", post(admin::create_quota).get(admin::list_quotas))
        .route("/v1/quotas/{id}", get(admin::get_quota).patch(admin::patch_quota).delete(admin::delete_quota))
        .route("/v1/audit", get(admin::audit))
        .route("/v1/prices", put(pricing::put_prices).get(pricing::get_prices))
        .route("/v1/exceptions", get(pricing::exceptions))
        .route("/v1/projects/{id}/roles", post(roles::create_role))
        .route("/v1/roles/{id}", get(roles::get_role))
        .route("/v1/usage", get(usage::usage))
        .with_state(state)
}
