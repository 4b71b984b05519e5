//! Roles (ADR-0011): `POST /v1/projects/{id}/roles`, `GET /v1/roles/{id}`.
//!
//! A role carries grants and at most one quota (`{"calls", "rows", "per":
//! "day" | "month"}`); a key created with `role_id` takes both, and a
//! signed-in user the gateway names with `"user": "user:<subject>",
//! "role_id"` on `/v1/check` gets the role's quota as one counter of its
//! own. `"exempt": true` makes an administrators' (or break-glass) role whose
//! callers are never limited or counted.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use meter::{Per, ProjectId, Role, RoleId, RoleQuota};
use serde_json::{Value, json};

use crate::admin::parse_grants;
use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::fields;
use crate::state::{AppState, new_id};

pub fn role_json(r: &Role) -> Value {
    json!({
        "id": r.id, "project_id": r.project_id, "name": r.name, "grants": r.grants,
        "quota": r.quota.map(|q| json!({ "calls": q.calls, "rows": q.rows, "per": q.per.as_str() })),
        "exempt": r.exempt, "created_at": r.created_at,
    })
}

fn parse_quota(v: Option<&Value>) -> ApiResult<Option<RoleQuota>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let Value::Object(o) = v else { return Err(ApiError::invalid("quota", "must be an object")) };
    fields::only(o, "quota.", &["calls", "rows", "per"])?;
    let per = match fields::req_str(o, "quota.", "per")?.as_str() {
        "day" => Per::Day,
        "month" => Per::Month,
        _ => return Err(ApiError::invalid("quota.per", "must be day or month")),
    };
    let q = RoleQuota {
        calls: fields::opt_count(o, "quota.", "calls")?,
        rows: fields::opt_count(o, "quota.", "rows")?,
        per,
    };
    q.check()?;
    Ok(Some(q))
}

#[utoipa::path(post, path = "/v1/projects/{id}/roles", tag = "admin",
    responses((status = 201, description = "The role"), (status = 400, description = "INVALID_REQUEST naming the field")))]
pub async fn create_role(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::admin(&s, &headers)?;
    let pid = ProjectId::parse(id.clone()).map_err(|_| ApiError::not_found("project", &id))?;
    s.store.project(&pid).await?.ok_or_else(|| ApiError::not_found("project", &id))?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["name", "grants", "quota", "exempt"])?;
    let name = fields::req_str(&obj, "", "name")?;
    if name.trim().is_empty() || name.len() > 200 {
        return Err(ApiError::invalid("name", "must be 1–200 characters"));
    }
    let exempt = match obj.get("exempt") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("exempt", "must be true or false")),
    };
    let role = Role {
        id: RoleId::parse(new_id("role")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        project_id: pid,
        name,
        grants: parse_grants(obj.get("grants"))?,
        quota: parse_quota(obj.get("quota"))?,
        exempt,
        created_at: crate::admin::now_micros(s.clock.as_ref()),
    };
    s.store.create_role(&role).await?;
    Ok((StatusCode::CREATED, Json(role_json(&role))))
}

#[utoipa::path(get, path = "/v1/roles/{id}", tag = "admin", responses((status = 200, description = "The role")))]
pub async fn get_role(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let rid = RoleId::parse(id.clone()).map_err(|_| ApiError::not_found("role", &id))?;
    let role = s.store.role(&rid).await?.ok_or_else(|| ApiError::not_found("role", &id))?;
    Ok(Json(role_json(&role)))
}
