//! Admin routes: projects, API keys and quotas.

use std::str::FromStr;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use chrono_tz::Tz;
use meter::{
    ApiKey, ApiKeyId, Counter, CounterKey, Dimension, Grants, Metric, Mode, Project, ProjectId, Quota, QuotaDraft,
    QuotaId, QuotaPatch, Scope, WindowKind, window_at,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::fields;
use crate::state::{AppState, hash_secret, new_id, random_token};

fn project_json(p: &Project) -> Value {
    json!({ "id": p.id, "name": p.name, "timezone": p.timezone.name(), "created_at": p.created_at })
}

#[utoipa::path(post, path = "/v1/projects", tag = "admin",
    responses((status = 201, description = "The project"), (status = 400, description = "INVALID_REQUEST")))]
pub async fn create_project(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::admin(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["name", "timezone"])?;
    let name = fields::req_str(&obj, "", "name")?;
    if name.trim().is_empty() || name.len() > 200 {
        return Err(ApiError::invalid("name", "must be 1–200 characters"));
    }
    let timezone = match fields::opt_str(&obj, "", "timezone")? {
        None => Tz::UTC,
        Some(t) => Tz::from_str(&t).map_err(|_| ApiError::invalid("timezone", format!("{t:?} is not an IANA time zone")))?,
    };
    let project = Project {
        id: ProjectId::parse(new_id("proj")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        name,
        timezone,
        created_at: s.clock.now(),
    };
    s.store.create_project(&project).await?;
    Ok((StatusCode::CREATED, Json(project_json(&project))))
}

#[utoipa::path(get, path = "/v1/projects/{id}", tag = "admin", responses((status = 200, description = "The project")))]
pub async fn get_project(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let pid = ProjectId::parse(id.clone()).map_err(|_| ApiError::not_found("project", &id))?;
    let p = s.store.project(&pid).await?.ok_or_else(|| ApiError::not_found("project", &id))?;
    Ok(Json(project_json(&p)))
}

fn parse_grants(v: Option<&Value>) -> ApiResult<Grants> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(Grants::default()) };
    let Value::Object(o) = v else { return Err(ApiError::invalid("grants", "must be an object")) };
    fields::only(o, "grants.", &["max_concurrent", "query_timeout", "max_rows"])?;
    let max_concurrent = fields::opt_count(o, "grants.", "max_concurrent")?;
    if let Some(c) = max_concurrent {
        if !(1..=1000).contains(&c) {
            return Err(ApiError::invalid("grants.max_concurrent", "must be between 1 and 1000"));
        }
    }
    let query_timeout = fields::opt_count(o, "grants.", "query_timeout")?;
    let max_rows = fields::opt_count(o, "grants.", "max_rows")?;
    for (f, v) in [("query_timeout", query_timeout), ("max_rows", max_rows)] {
        if v == Some(0) {
            return Err(ApiError::invalid(format!("grants.{f}"), "must be greater than 0"));
        }
    }
    Ok(Grants { max_concurrent: max_concurrent.map(|c| c as u32), query_timeout, max_rows })
}

#[utoipa::path(post, path = "/v1/projects/{id}/api-keys", tag = "admin",
    responses((status = 201, description = "The key, with its secret shown this once")))]
pub async fn create_api_key(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::admin(&s, &headers)?;
    let pid = ProjectId::parse(id.clone()).map_err(|_| ApiError::not_found("project", &id))?;
    s.store.project(&pid).await?.ok_or_else(|| ApiError::not_found("project", &id))?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["name", "grants", "role_id"])?;
    let name = fields::req_str(&obj, "", "name")?;
    if name.trim().is_empty() || name.len() > 200 {
        return Err(ApiError::invalid("name", "must be 1–200 characters"));
    }
    if fields::opt_str(&obj, "", "role_id")?.is_some() {
        return Err(ApiError::invalid("role_id", "roles are not available in this release"));
    }
    let grants = parse_grants(obj.get("grants"))?;
    let secret = format!("tg_{}", random_token(40));
    let key = ApiKey {
        id: ApiKeyId::parse(new_id("key")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        project_id: pid,
        name,
        prefix: secret[..10].to_owned(),
        grants,
        created_at: s.clock.now(),
    };
    s.store.create_api_key(&key, &hash_secret(&secret)).await?;
    let mut body = key_json(&key);
    body["secret"] = json!(secret);
    Ok((StatusCode::CREATED, Json(body)))
}

fn key_json(k: &ApiKey) -> Value {
    json!({
        "id": k.id, "project_id": k.project_id, "name": k.name, "prefix": k.prefix,
        "grants": k.grants, "created_at": k.created_at,
    })
}

#[utoipa::path(get, path = "/v1/api-keys/{id}", tag = "admin",
    responses((status = 200, description = "The key with effective limits and usage this period")))]
pub async fn get_api_key(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let kid = ApiKeyId::parse(id.clone()).map_err(|_| ApiError::not_found("api key", &id))?;
    let key = s.store.api_key(&kid).await?.ok_or_else(|| ApiError::not_found("api key", &id))?;
    let project = s.store.project(&key.project_id).await?.ok_or_else(|| ApiError::not_found("project", key.project_id.as_str()))?;
    let now = s.clock.now();
    let month = window_at(WindowKind::CalendarMonth, project.timezone, now);
    let counter = CounterKey { dimension: Dimension::ApiKey(kid.clone()), window: month.kind, window_key: month.key.clone() };
    let (calls, rows) = match counter_count(&s, &project.id, &counter, now).await? {
        (u, reserved) => (u.calls + reserved, u.rows),
    };
    let mut body = key_json(&key);
    body["effective_limits"] = json!({
        "max_concurrent": key.grants.max_concurrent,
        "query_timeout": key.grants.query_timeout,
        "max_rows": key.grants.max_rows,
    });
    body["usage_this_period"] = json!({
        "calls": calls, "rows": rows, "period_start": month.start, "resets_at": month.resets_at,
    });
    Ok(Json(body))
}

/// A counter's usage (durable + pending) and live reservations: from the
/// view, or from the store when the view holds nothing for the project.
async fn counter_count(s: &AppState, project: &ProjectId, key: &CounterKey, at: chrono::DateTime<chrono::Utc>) -> ApiResult<(meter::Totals, u64)> {
    let mut usage = s.view.usage(project, key, at).await;
    if let Ok(None) = usage {
        // Not seeded (new, or the view was lost): seed it as a check would.
        let totals = s.store.open_totals(project, at).await?;
        if s.view.seed(project, &totals).await.is_ok() {
            usage = s.view.usage(project, key, at).await;
        }
    }
    if let Ok(Some(u)) = usage {
        let mut t = u.durable;
        t.add(u.pending);
        return Ok((t, u.reserved_calls));
    }
    let totals = s.store.totals(project, std::slice::from_ref(key)).await?;
    Ok((totals.into_iter().next().map(|(_, t)| t).unwrap_or_default(), 0))
}

fn quota_json(q: &Quota) -> Value {
    let sp = &q.spec;
    json!({
        "id": q.id, "project_id": sp.project_id, "scope": sp.scope.as_str(), "scope_ref": sp.scope_ref,
        "metric": sp.metric.as_str(), "window": sp.window.as_str(), "limit": sp.limit, "mode": sp.mode.as_str(),
        "meter_type": sp.meter_type, "on_unpriced": sp.on_unpriced,
        "created_at": q.created_at, "updated_at": q.updated_at,
    })
}

const QUOTA_FIELDS: [&str; 9] =
    ["project_id", "scope", "scope_ref", "metric", "window", "limit", "mode", "meter_type", "on_unpriced"];

fn limit_field(obj: &serde_json::Map<String, Value>) -> ApiResult<Option<i64>> {
    match obj.get("limit") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) => Ok(Some(v)),
            None => Err(ApiError::invalid("limit", "must be a whole number greater than 0")),
        },
        Some(_) => Err(ApiError::invalid("limit", "must be a number")),
    }
}

#[utoipa::path(post, path = "/v1/quotas", tag = "admin",
    responses((status = 201, description = "The quota"), (status = 400, description = "INVALID_REQUEST naming the field"),
              (status = 409, description = "QUOTA_CONFLICT")))]
pub async fn create_quota(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::admin(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &QUOTA_FIELDS)?;
    let draft = QuotaDraft {
        project_id: fields::opt_str(&obj, "", "project_id")?,
        scope: fields::opt_str(&obj, "", "scope")?,
        scope_ref: fields::opt_str(&obj, "", "scope_ref")?,
        metric: fields::opt_str(&obj, "", "metric")?,
        window: fields::opt_str(&obj, "", "window")?,
        limit: limit_field(&obj)?,
        mode: fields::opt_str(&obj, "", "mode")?,
        meter_type: fields::opt_str(&obj, "", "meter_type")?,
        on_unpriced: fields::opt_str(&obj, "", "on_unpriced")?,
    };
    let spec = meter::quota::validate(&draft)?;
    if s.store.project(&spec.project_id).await?.is_none() {
        return Err(ApiError::invalid("project_id", format!("project {} does not exist", spec.project_id)));
    }
    if let (Scope::ApiKey, Some(r)) = (spec.scope, &spec.scope_ref) {
        let key = match ApiKeyId::parse(r.clone()) {
            Ok(k) => s.store.api_key(&k).await?,
            Err(_) => None,
        };
        if key.is_none_or(|k| k.project_id != spec.project_id) {
            return Err(ApiError::invalid("scope_ref", format!("no api key {r} in project {}", spec.project_id)));
        }
    }
    let now = s.clock.now();
    let quota = Quota {
        id: QuotaId::parse(new_id("quota")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        spec,
        created_at: now,
        updated_at: now,
    };
    match s.store.create_quota(&quota).await {
        Ok(()) => {}
        Err(meter::PortError::Conflict(_)) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "QUOTA_CONFLICT",
                "a quota with the same project, scope, scope_ref, metric, window and meter_type exists",
            ));
        }
        Err(e) => return Err(e.into()),
    }
    s.invalidate_project(&quota.spec.project_id);
    Ok((StatusCode::CREATED, Json(quota_json(&quota))))
}

#[derive(Deserialize)]
pub struct ListQuery {
    project_id: Option<String>,
}

#[utoipa::path(get, path = "/v1/quotas", tag = "admin", params(("project_id" = String, Query, description = "The project")),
    responses((status = 200, description = "The project's quotas")))]
pub async fn list_quotas(State(s): State<AppState>, headers: HeaderMap, Query(q): Query<ListQuery>) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let raw = q.project_id.ok_or_else(|| ApiError::invalid("project_id", "is required"))?;
    let pid = ProjectId::parse(raw).map_err(|e| ApiError::invalid("project_id", e.to_string()))?;
    let quotas = s.store.quotas(&pid).await?;
    let data: Vec<Value> = quotas
        .iter()
        .map(|q| {
            let mut v = quota_json(q);
            v["current_usage"] = Value::Null;
            v
        })
        .collect();
    Ok(Json(json!({ "data": data, "next": null })))
}

async fn load_quota(s: &AppState, id: &str) -> ApiResult<Quota> {
    let qid = QuotaId::parse(id.to_owned()).map_err(|_| ApiError::not_found("quota", id))?;
    s.store.quota(&qid).await?.ok_or_else(|| ApiError::not_found("quota", id))
}

#[utoipa::path(get, path = "/v1/quotas/{id}", tag = "admin",
    responses((status = 200, description = "The quota with current_usage (durable + settled + reserved)")))]
pub async fn get_quota(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let q = load_quota(&s, &id).await?;
    let project = s.store.project(&q.spec.project_id).await?.ok_or_else(|| ApiError::not_found("project", q.spec.project_id.as_str()))?;
    let mut body = quota_json(&q);
    let dimension = match (q.spec.scope, &q.spec.scope_ref) {
        (Scope::Project, _) => Some(Dimension::Project),
        (Scope::ApiKey, None) => Some(Dimension::AllApiKeys),
        (Scope::ApiKey, Some(r)) => ApiKeyId::parse(r.clone()).ok().map(Dimension::ApiKey),
        (Scope::Actor, Some(r)) => Some(Dimension::Actor(r.clone())),
        // One budget per actor, or a metric this release does not meter: no single counter.
        _ => None,
    };
    body["current_usage"] = match dimension {
        Some(d) if q.spec.metric.is_metered() => {
            let now = s.clock.now();
            let w = window_at(q.spec.window, project.timezone, now);
            let counter = Counter {
                key: CounterKey { dimension: d, window: w.kind, window_key: w.key.clone() },
                resets_at: w.resets_at,
            };
            let (t, reserved) = counter_count(&s, &project.id, &counter.key, now).await?;
            let count = match q.spec.metric {
                Metric::Requests => t.requests,
                Metric::Calls => t.calls + reserved,
                _ => t.rows,
            };
            json!({ "window_key": w.key, "count": count, "resets_at": w.resets_at })
        }
        _ => Value::Null,
    };
    Ok(Json(body))
}

#[utoipa::path(patch, path = "/v1/quotas/{id}", tag = "admin",
    responses((status = 200, description = "The quota"), (status = 400, description = "An immutable field was changed")))]
pub async fn patch_quota(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>, body: Bytes) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let q = load_quota(&s, &id).await?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &QUOTA_FIELDS)?;
    // Restating an immutable field at its current value is fine; changing it is not.
    let current = quota_json(&q);
    for f in meter::quota::IMMUTABLE_FIELDS {
        if let Some(v) = obj.get(f) {
            if *v != current[f] {
                return Err(ApiError::invalid(f, "is immutable; replace the quota to change it"));
            }
        }
    }
    let limit = match limit_field(&obj)? {
        Some(l) if l <= 0 => return Err(ApiError::invalid("limit", "must be a whole number greater than 0")),
        l => l.map(|l| l as u64),
    };
    let mode = match fields::opt_str(&obj, "", "mode")? {
        None => None,
        Some(m) => Some(Mode::from_str(&m).map_err(|_| ApiError::invalid("mode", "must be enforce or monitor"))?),
    };
    let patch = QuotaPatch { limit, mode };
    let updated = s.store.update_quota(&q.id, &patch, s.clock.now()).await?.ok_or_else(|| ApiError::not_found("quota", &id))?;
    s.invalidate_project(&updated.spec.project_id);
    Ok(Json(quota_json(&updated)))
}

#[utoipa::path(delete, path = "/v1/quotas/{id}", tag = "admin", responses((status = 204, description = "Deleted")))]
pub async fn delete_quota(State(s): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> ApiResult<StatusCode> {
    auth::admin(&s, &headers)?;
    let q = load_quota(&s, &id).await?;
    s.store.delete_quota(&q.id).await?;
    s.invalidate_project(&q.spec.project_id);
    Ok(StatusCode::NO_CONTENT)
}
