//! `/healthz`, `/openapi.json` and `/metrics`: no token needed (the metrics
//! carry no tenant's data: their labels are verdicts, policies and causes).

use axum::Json;

#[utoipa::path(get, path = "/healthz", tag = "meta",
    responses((status = 200, description = "The process is up", body = String, content_type = "text/plain", example = "ok")))]
pub async fn healthz() -> &'static str {
    "ok"
}

#[utoipa::path(get, path = "/openapi.json", tag = "meta",
    responses((status = 200, description = "This document (OpenAPI 3.1)", body = Object, content_type = "application/json",
               example = json!({"openapi": "3.1.0", "info": {"title": "Tollgate", "version": "0.1.0"}, "paths": {}}))))]
pub async fn openapi() -> Json<&'static utoipa::openapi::OpenApi> {
    Json(&super::DOCUMENT)
}

#[utoipa::path(get, path = "/metrics", tag = "meta",
    responses((status = 200, description = "Every counter and histogram of this process, in the Prometheus text format \
               (see `gateway::telemetry` for the list)", body = String, content_type = "text/plain; version=0.0.4",
               example = "# TYPE tollgate_checks_total counter\ntollgate_checks_total{verdict=\"admitted\"} 42\n")))]
pub async fn metrics() -> ([(axum::http::header::HeaderName, &'static str); 1], String) {
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::telemetry::render())
}
