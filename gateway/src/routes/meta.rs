//! `/healthz` and `/openapi.json`: no token needed.

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
