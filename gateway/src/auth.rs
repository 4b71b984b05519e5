//! Bearer tokens: one for admin routes, one for the hot path.

use axum::http::HeaderMap;

use crate::error::{ApiError, ApiResult};
use crate::state::{AppState, same_secret};

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")
}

pub fn admin(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if same_secret(t, &state.settings.admin_token) => Ok(()),
        Some(_) => Err(ApiError::unauthenticated("the bearer token is not the admin token")),
        None => Err(ApiError::unauthenticated("an admin bearer token is required")),
    }
}

pub fn gateway(state: &AppState, headers: &HeaderMap) -> ApiResult<()> {
    match bearer(headers) {
        Some(t) if same_secret(t, &state.settings.gateway_token) || same_secret(t, &state.settings.admin_token) => {
            Ok(())
        }
        Some(_) => Err(ApiError::unauthenticated("the bearer token is not the gateway token")),
        None => Err(ApiError::unauthenticated("a gateway bearer token is required")),
    }
}
