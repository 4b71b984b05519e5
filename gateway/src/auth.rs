//! Bearer tokens: one for admin routes, one for the hot path, as
//! extractors. A handler that takes [`AdminAuth`] (or [`GatewayAuth`]) runs
//! only for a caller with the token; it is the first thing checked, before
//! the body is read. The admin token also opens the hot path.

use axum::extract::FromRequestParts;
use axum::http::HeaderMap;
use axum::http::request::Parts;

use crate::error::ApiError;
use crate::state::{AppState, same_secret};

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")
}

/// Whether the request carries the admin token.
pub fn is_admin(headers: &HeaderMap, s: &AppState) -> bool {
    bearer(headers).is_some_and(|t| same_secret(t, &s.settings.admin_token))
}

/// The caller presented the admin token.
#[derive(Debug, Clone, Copy)]
pub struct AdminAuth;

impl FromRequestParts<AppState> for AdminAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        match bearer(&parts.headers) {
            Some(t) if same_secret(t, &s.settings.admin_token) => Ok(AdminAuth),
            Some(_) => Err(ApiError::unauthenticated("the bearer token is not the admin token")),
            None => Err(ApiError::unauthenticated("an admin bearer token is required")),
        }
    }
}

/// The caller presented the gateway token (or the admin token).
#[derive(Debug, Clone, Copy)]
pub struct GatewayAuth;

impl FromRequestParts<AppState> for GatewayAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, s: &AppState) -> Result<Self, ApiError> {
        match bearer(&parts.headers) {
            Some(t) if same_secret(t, &s.settings.gateway_token) || same_secret(t, &s.settings.admin_token) => {
                Ok(GatewayAuth)
            }
            Some(_) => Err(ApiError::unauthenticated("the bearer token is not the gateway token")),
            None => Err(ApiError::unauthenticated("a gateway bearer token is required")),
        }
    }
}
