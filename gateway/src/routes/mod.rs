//! The HTTP API: the route table, the router built from it, and the
//! OpenAPI document (`/openapi.json`) that describes every route.
//!
//! A handler is extract → convert → one service call → map: the auth
//! extractor ([`AdminAuth`](crate::auth::AdminAuth) or
//! [`GatewayAuth`](crate::auth::GatewayAuth)) first, the body or query
//! read into its DTO, the DTO turned into a domain value with `TryFrom`, one
//! call into [`service`](crate::service), and the result turned into a
//! response body (an error into `ApiError`). Handler modules do not import
//! each other: what they share lives in `dto` and `service`.
//!
//! Every route is one line of the table below; the router is
//! built from it and nothing else, so a test can hold the document to it.

mod export_schedules;
mod exports;
mod hot;
mod meta;
mod permits;
mod prices;
mod quotas;
mod reports;
mod tenants;
mod webhooks;

use std::sync::LazyLock;

use axum::Router;
use axum::http::Method;
use axum::routing::{MethodFilter, MethodRouter, on};
use serde_json::json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::dto;
use crate::state::AppState;

/// One route: its method, its path (axum's syntax, which is OpenAPI's) and its handler.
struct Route {
    method: Method,
    path: &'static str,
    handler: MethodRouter<AppState>,
}

macro_rules! table {
    ($($method:ident $path:literal => $handler:path,)*) => {
        /// Every route of the API.
        fn table() -> Vec<Route> {
            vec![$(Route { method: Method::$method, path: $path, handler: on(MethodFilter::$method, $handler) },)*]
        }
    };
}

table! {
    GET "/healthz" => meta::healthz,
    GET "/openapi.json" => meta::openapi,
    GET "/metrics" => meta::metrics,
    POST "/v1/check" => hot::check,
    POST "/v1/events" => hot::events,
    POST "/v1/permits/{id}/renew" => permits::renew,
    DELETE "/v1/permits/{id}" => permits::release,
    POST "/v1/projects" => tenants::create_project,
    GET "/v1/projects/{id}" => tenants::get_project,
    POST "/v1/projects/{id}/api-keys" => tenants::create_api_key,
    GET "/v1/api-keys/{id}" => tenants::get_api_key,
    PUT "/v1/api-keys/{id}/grants" => tenants::put_grants,
    DELETE "/v1/api-keys/{id}" => tenants::delete_api_key,
    POST "/v1/projects/{id}/roles" => tenants::create_role,
    GET "/v1/roles/{id}" => tenants::get_role,
    POST "/v1/quotas" => quotas::create_quota,
    GET "/v1/quotas" => quotas::list_quotas,
    GET "/v1/quotas/{id}" => quotas::get_quota,
    PATCH "/v1/quotas/{id}" => quotas::patch_quota,
    DELETE "/v1/quotas/{id}" => quotas::delete_quota,
    PUT "/v1/projects/{id}/quotas" => quotas::put_project_quotas,
    PUT "/v1/prices" => prices::put_prices,
    GET "/v1/prices" => prices::get_prices,
    GET "/v1/exceptions" => prices::exceptions,
    GET "/v1/usage" => reports::usage,
    GET "/v1/audit" => reports::audit,
    POST "/v1/exports" => exports::create_export,
    GET "/v1/exports/{id}" => exports::get_export,
    GET "/v1/exports/{id}/file" => exports::export_file,
    POST "/v1/export-schedules" => export_schedules::create_schedule,
    GET "/v1/export-schedules" => export_schedules::list_schedules,
    GET "/v1/export-schedules/{id}" => export_schedules::get_schedule,
    PATCH "/v1/export-schedules/{id}" => export_schedules::patch_schedule,
    DELETE "/v1/export-schedules/{id}" => export_schedules::delete_schedule,
    POST "/v1/export-schedules/{id}/run" => export_schedules::run_schedule,
    POST "/v1/projects/{id}/webhooks" => webhooks::create_webhook,
    GET "/v1/projects/{id}/webhooks" => webhooks::list_webhooks,
    GET "/v1/webhooks/{id}" => webhooks::get_webhook,
    PATCH "/v1/webhooks/{id}" => webhooks::patch_webhook,
    DELETE "/v1/webhooks/{id}" => webhooks::delete_webhook,
    POST "/v1/webhooks/{id}/rotate-secret" => webhooks::rotate_secret,
    GET "/v1/webhooks/{id}/deliveries" => webhooks::deliveries,
    POST "/v1/webhooks/{id}/deliveries/{message_id}/resend" => webhooks::resend,
    POST "/v1/webhooks/{id}/recover" => webhooks::recover,
    POST "/v1/webhooks/{id}/test" => webhooks::test,
}

/// The method and path of every route the router serves.
pub fn routes() -> Vec<(Method, &'static str)> {
    table().into_iter().map(|r| (r.method, r.path)).collect()
}

/// The whole HTTP API over the given state.
pub fn app(state: AppState) -> Router {
    crate::telemetry::install();
    // Routes of one path merge into one method router.
    table()
        .into_iter()
        .fold(Router::new(), |router, r| {
            let handler = match heavy_endpoint(&r.method, r.path) {
                Some(name) => {
                    r.handler.layer(axum::middleware::from_fn_with_state((state.clone(), name), crate::heavy::guard))
                }
                None => r.handler,
            };
            router.route(r.path, handler)
        })
        // The console's pages: not API routes, so not in the table or the document.
        .merge(crate::console::router())
        .with_state(state)
}

/// The routes that are Tollgate's own heavy endpoints (see
/// [`crate::heavy`]), by the name a refusal gives them.
fn heavy_endpoint(method: &Method, path: &str) -> Option<&'static str> {
    match (method, path) {
        (&Method::GET, "/v1/audit") => Some("audit"),
        (&Method::GET, "/v1/usage") => Some("usage"),
        (&Method::GET, "/v1/webhooks/{id}/deliveries") => Some("deliveries"),
        _ => None,
    }
}

/// The OpenAPI document of the API.
#[derive(OpenApi)]
#[openapi(
    info(title = "Tollgate", description = "Usage metering and exact quota enforcement on an event log. \
        Errors are `{\"error\":{\"code\",\"message\",\"meta\"}}`; an `INVALID_REQUEST` names the field in \
        `meta.field` (`events[3].rows`). Admin routes take `Authorization: Bearer <admin token>`, the hot path \
        `Authorization: Bearer <gateway token>`."),
    paths(
        meta::healthz,
        meta::openapi,
        meta::metrics,
        hot::check,
        hot::events,
        permits::renew,
        permits::release,
        tenants::create_project,
        tenants::get_project,
        tenants::create_api_key,
        tenants::get_api_key,
        tenants::put_grants,
        tenants::delete_api_key,
        tenants::create_role,
        tenants::get_role,
        quotas::create_quota,
        quotas::list_quotas,
        quotas::get_quota,
        quotas::patch_quota,
        quotas::delete_quota,
        quotas::put_project_quotas,
        prices::put_prices,
        prices::get_prices,
        prices::exceptions,
        reports::usage,
        reports::audit,
        exports::create_export,
        exports::get_export,
        exports::export_file,
        export_schedules::create_schedule,
        export_schedules::list_schedules,
        export_schedules::get_schedule,
        export_schedules::patch_schedule,
        export_schedules::delete_schedule,
        export_schedules::run_schedule,
        webhooks::create_webhook,
        webhooks::list_webhooks,
        webhooks::get_webhook,
        webhooks::patch_webhook,
        webhooks::delete_webhook,
        webhooks::rotate_secret,
        webhooks::deliveries,
        webhooks::resend,
        webhooks::recover,
        webhooks::test,
    ),
    components(schemas(dto::errors::ErrorBody)),
    modifiers(&Security, &CommonErrors),
    tags(
        (name = "hot path", description = "Admission and metering, for gateways: the gateway token"),
        (name = "admin", description = "Projects, keys, roles, quotas, prices, reports, exports and webhooks: the admin token"),
        (name = "meta", description = "Liveness and this document"),
    )
)]
pub struct ApiDoc;

/// The document, built once.
pub(crate) static DOCUMENT: LazyLock<utoipa::openapi::OpenApi> = LazyLock::new(ApiDoc::openapi);

/// The two bearer tokens.
struct Security;

impl Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        for (name, what) in
            [("admin_token", "The admin token"), ("gateway_token", "The gateway token (or the admin token)")]
        {
            let scheme = HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some(what)).build();
            components.add_security_scheme(name, SecurityScheme::Http(scheme));
        }
    }
}

/// The errors any authenticated route can answer: 401 without the right
/// token, 503 while a backend is unavailable, 500 on a backend failure.
struct CommonErrors;

impl Modify for CommonErrors {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let error = |description: &str, example: serde_json::Value| {
            ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                        .example(Some(example))
                        .build(),
                )
                .build()
        };
        let common = [
            (
                "401",
                error(
                    "UNAUTHENTICATED: no bearer token, or not this route's",
                    json!({"error": {"code": "UNAUTHENTICATED", "message": "an admin bearer token is required", "meta": {}}}),
                ),
            ),
            (
                "503",
                error(
                    "UNAVAILABLE: a backend is unavailable; retry",
                    json!({"error": {"code": "UNAVAILABLE", "message": "a backend is unavailable; retry", "meta": {}}}),
                ),
            ),
            (
                "500",
                error(
                    "INTERNAL: a backend failed",
                    json!({"error": {"code": "INTERNAL", "message": "internal error", "meta": {}}}),
                ),
            ),
        ];
        for item in doc.paths.paths.values_mut() {
            for op in
                [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch].into_iter().flatten()
            {
                if op.security.as_ref().is_none_or(Vec::is_empty) {
                    continue;
                }
                for (status, response) in &common {
                    op.responses.responses.entry((*status).to_owned()).or_insert_with(|| response.clone().into());
                }
            }
        }
    }
}
