//! Admin routes: projects, API keys, quotas (one by one, or a project's
//! whole set declaratively) and the audit log.

use std::collections::HashMap;
use std::str::FromStr;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, SubsecRound, Utc};
use chrono_tz::Tz;
use meter::{
    ApiKey, ApiKeyId, AuditEntry, AuditId, Clock, CounterKey, Dimension, Grants, Metric, Mode, PortError, Principal,
    Project, ProjectId, Quota, QuotaDraft, QuotaPatch, QuotaPlan, RoleId, Scope, WindowKind, window_at,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::fields;
use crate::state::{AppState, hash_secret, new_audit_id, new_id, new_quota_id, random_token};

/// The time, at the store's precision (the microsecond), so what a route
/// answers is what a later read gives back.
pub fn now_micros(clock: &dyn Clock) -> DateTime<Utc> {
    clock.now().trunc_subsecs(6)
}

/// Who the admin API's changes are audited as.
pub fn api_principal() -> Principal {
    Principal::new("admin", "admin_token")
}

/// Carries out a one-quota plan with its audit entry, in one transaction.
async fn change_quotas(s: &AppState, plan: &QuotaPlan, at: DateTime<Utc>) -> Result<(), PortError> {
    let audit = plan.audit(&api_principal(), at, &mut new_audit_id);
    s.store.apply_quotas(plan, &audit).await?;
    s.invalidate_project(&plan.project_id);
    Ok(())
}

fn project_json(p: &Project) -> Value {
    json!({ "id": p.id, "name": p.name, "timezone": p.timezone.name(), "created_at": p.created_at })
}

#[utoipa::path(post, path = "/v1/projects", tag = "admin",
    responses((status = 201, description = "The project"), (status = 400, description = "INVALID_REQUEST")))]
pub async fn create_project(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::admin(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["name", "timezone"])?;
    let name = fields::req_str(&obj, "", "name")?;
    if name.trim().is_empty() || name.len() > 200 {
        return Err(ApiError::invalid("name", "must be 1–200 characters"));
    }
    let timezone = match fields::opt_str(&obj, "", "timezone")? {
        None => Tz::UTC,
        Some(t) => {
            Tz::from_str(&t).map_err(|_| ApiError::invalid("timezone", format!("{t:?} is not an IANA time zone")))?
        }
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
pub async fn get_project(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let pid = ProjectId::parse(id.clone()).map_err(|_| ApiError::not_found("project", &id))?;
    let p = s.store.project(&pid).await?.ok_or_else(|| ApiError::not_found("project", &id))?;
    Ok(Json(project_json(&p)))
}

pub fn parse_grants(v: Option<&Value>) -> ApiResult<Grants> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(Grants::default()) };
    let Value::Object(o) = v else { return Err(ApiError::invalid("grants", "must be an object")) };
    fields::only(o, "grants.", &["max_concurrent", "query_timeout", "max_rows"])?;
    let max_concurrent = fields::opt_count(o, "grants.", "max_concurrent")?;
    if let Some(c) = max_concurrent
        && !(1..=1000).contains(&c)
    {
        return Err(ApiError::invalid("grants.max_concurrent", "must be between 1 and 1000"));
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
    let role_id = match fields::opt_str(&obj, "", "role_id")? {
        None => None,
        Some(r) => {
            let rid = RoleId::parse(r.clone()).map_err(|e| ApiError::invalid("role_id", e.to_string()))?;
            match s.store.role(&rid).await? {
                Some(role) if role.project_id == pid => Some(rid),
                _ => return Err(ApiError::invalid("role_id", format!("no role {r} in project {pid}"))),
            }
        }
    };
    let grants = parse_grants(obj.get("grants"))?;
    let secret = format!("tg_{}", random_token(40));
    let key = ApiKey {
        id: ApiKeyId::parse(new_id("key")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        project_id: pid,
        name,
        prefix: secret[..10].to_owned(),
        grants,
        role_id,
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
        "grants": k.grants, "role_id": k.role_id, "created_at": k.created_at,
    })
}

#[utoipa::path(get, path = "/v1/api-keys/{id}", tag = "admin",
    responses((status = 200, description = "The key with effective limits and usage this period")))]
pub async fn get_api_key(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let kid = ApiKeyId::parse(id.clone()).map_err(|_| ApiError::not_found("api key", &id))?;
    let key = s.store.api_key(&kid).await?.ok_or_else(|| ApiError::not_found("api key", &id))?;
    let project = s
        .store
        .project(&key.project_id)
        .await?
        .ok_or_else(|| ApiError::not_found("project", key.project_id.as_str()))?;
    let now = s.clock.now();
    let role = match &key.role_id {
        Some(r) => s.store.role(r).await?,
        None => None,
    };
    // The period is the role quota's when the key has one, else the month.
    let period = role.as_ref().and_then(|r| r.quota).map_or(WindowKind::CalendarMonth, |q| q.per.window());
    let month = window_at(period, project.timezone, now);
    let counter =
        CounterKey { dimension: Dimension::ApiKey(kid.clone()), window: month.kind, window_key: month.key.clone() };
    let (u, reserved) = counter_count(&s, &project.id, &counter, now).await?;
    let (calls, rows) = (u.calls + reserved, u.rows);
    let effective = meter::role::effective_grants(&key.grants, role.as_ref());
    let mut body = key_json(&key);
    body["effective_limits"] = json!({
        "max_concurrent": effective.max_concurrent,
        "query_timeout": effective.query_timeout,
        "max_rows": effective.max_rows,
    });
    body["quota"] = match role.as_ref().and_then(|r| r.quota) {
        Some(q) => json!({ "calls": q.calls, "rows": q.rows, "per": q.per.as_str(), "from_role": key.role_id }),
        None => Value::Null,
    };
    body["usage_this_period"] = json!({
        "calls": calls, "rows": rows, "period_start": month.start, "resets_at": month.resets_at,
    });
    Ok(Json(body))
}

/// A counter's usage (durable + pending) and live reservations: from the
/// view, or from the store when the view holds nothing for the project.
async fn counter_count(
    s: &AppState,
    project: &ProjectId,
    key: &CounterKey,
    at: chrono::DateTime<chrono::Utc>,
) -> ApiResult<(meter::Totals, u64)> {
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

/// A quota as the API shows it.
pub fn quota_json(q: &Quota) -> Value {
    let sp = &q.spec;
    json!({
        "id": q.id, "project_id": sp.project_id, "scope": sp.scope.as_str(), "scope_ref": sp.scope_ref,
        "metric": sp.metric.as_str(), "window": sp.window.as_str(),
        "limit": meter::quota::limit_json(sp.metric, sp.limit), "mode": sp.mode.as_str(),
        "meter_type": sp.meter_type, "on_unpriced": sp.on_unpriced,
        "created_at": q.created_at, "updated_at": q.updated_at,
    })
}

const QUOTA_FIELDS: [&str; 9] =
    ["project_id", "scope", "scope_ref", "metric", "window", "limit", "mode", "meter_type", "on_unpriced"];

#[utoipa::path(post, path = "/v1/quotas", tag = "admin",
    responses((status = 201, description = "The quota"), (status = 400, description = "INVALID_REQUEST naming the field"),
              (status = 409, description = "QUOTA_CONFLICT")))]
pub async fn create_quota(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::admin(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &QUOTA_FIELDS)?;
    let (limit, limit_decimal) = fields::limit(&obj, "")?;
    let draft = QuotaDraft {
        project_id: fields::opt_str(&obj, "", "project_id")?,
        scope: fields::opt_str(&obj, "", "scope")?,
        scope_ref: fields::opt_str(&obj, "", "scope_ref")?,
        metric: fields::opt_str(&obj, "", "metric")?,
        window: fields::opt_str(&obj, "", "window")?,
        limit,
        limit_decimal,
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
    let now = now_micros(s.clock.as_ref());
    let quota = Quota { id: new_quota_id(), spec, created_at: now, updated_at: now };
    match change_quotas(&s, &QuotaPlan::create(quota.clone()), now).await {
        Ok(()) => {}
        Err(PortError::Conflict(_)) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "QUOTA_CONFLICT",
                "a quota with the same project, scope, scope_ref, metric, window and meter_type exists",
            ));
        }
        Err(e) => return Err(e.into()),
    }
    let mut body = quota_json(&quota);
    body["inert"] = json!(false);
    Ok((StatusCode::CREATED, Json(body)))
}

#[derive(Deserialize)]
pub struct ListQuery {
    project_id: Option<String>,
}

#[utoipa::path(get, path = "/v1/quotas", tag = "admin", params(("project_id" = String, Query, description = "The project")),
    responses((status = 200, description = "The project's quotas")))]
pub async fn list_quotas(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let raw = q.project_id.ok_or_else(|| ApiError::invalid("project_id", "is required"))?;
    let pid = ProjectId::parse(raw).map_err(|e| ApiError::invalid("project_id", e.to_string()))?;
    let quotas = s.store.quotas(&pid).await?;
    let mut live_keys: HashMap<String, bool> = HashMap::new();
    let mut data = Vec::with_capacity(quotas.len());
    for q in &quotas {
        let mut v = quota_json(q);
        v["current_usage"] = Value::Null;
        v["inert"] = json!(is_inert(&s, q, &mut live_keys).await?);
        data.push(v);
    }
    Ok(Json(json!({ "data": data, "next": null })))
}

/// Whether a quota can no longer match anything: its `scope_ref` names an
/// API key that was deleted (a deleted key cannot authenticate). It stays
/// visible and deletable. `live` caches key lookups across a list.
async fn is_inert(s: &AppState, q: &Quota, live: &mut HashMap<String, bool>) -> ApiResult<bool> {
    let (Scope::ApiKey, Some(r)) = (q.spec.scope, &q.spec.scope_ref) else { return Ok(false) };
    if let Some(alive) = live.get(r) {
        return Ok(!alive);
    }
    let alive = match ApiKeyId::parse(r.clone()) {
        Ok(k) => s.store.api_key(&k).await?.is_some_and(|k| k.project_id == q.spec.project_id),
        Err(_) => false,
    };
    live.insert(r.clone(), alive);
    Ok(!alive)
}

async fn load_quota(s: &AppState, id: &str) -> ApiResult<Quota> {
    let qid = meter::QuotaId::parse(id.to_owned()).map_err(|_| ApiError::not_found("quota", id))?;
    s.store.quota(&qid).await?.ok_or_else(|| ApiError::not_found("quota", id))
}

#[utoipa::path(get, path = "/v1/quotas/{id}", tag = "admin",
    responses((status = 200, description = "The quota with current_usage (durable + settled + reserved)")))]
pub async fn get_quota(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let q = load_quota(&s, &id).await?;
    let project = s
        .store
        .project(&q.spec.project_id)
        .await?
        .ok_or_else(|| ApiError::not_found("project", q.spec.project_id.as_str()))?;
    let mut body = quota_json(&q);
    let inert = is_inert(&s, &q, &mut HashMap::new()).await?;
    body["inert"] = json!(inert);
    let dimension = match (q.spec.scope, &q.spec.scope_ref) {
        // A deleted key's quota counts nothing any more.
        _ if inert => None,
        (Scope::Project, _) | (Scope::Agent, None) => Some(Dimension::Project),
        (Scope::ApiKey, None) => Some(Dimension::AllApiKeys),
        (Scope::ApiKey, Some(r)) => ApiKeyId::parse(r.clone()).ok().map(Dimension::ApiKey),
        (Scope::Agent, Some(r)) => Some(Dimension::Agent(r.clone())),
        (Scope::Actor, Some(r)) => Some(Dimension::Actor(r.clone())),
        // One budget per actor: no single counter. (User scope is a role's, never stored.)
        (Scope::Actor, None) | (Scope::User, _) => None,
    };
    body["current_usage"] = match dimension {
        Some(d) => {
            let now = s.clock.now();
            let w = window_at(q.spec.window, project.timezone, now);
            let key = if q.spec.metric == Metric::StorageBytes {
                CounterKey::footprint()
            } else {
                CounterKey { dimension: d, window: w.kind, window_key: w.key.clone() }
            };
            let (t, reserved) = counter_count(&s, &project.id, &key, now).await?;
            let count = match q.spec.metric {
                Metric::Requests => json!(t.requests),
                Metric::Calls => json!(t.calls + reserved),
                Metric::Rows => json!(t.rows),
                Metric::Tokens => json!(t.tokens),
                Metric::CostUsd => meter::quota::limit_json(Metric::CostUsd, t.cost(q.spec.meter())),
                Metric::StorageBytes => json!(t.storage.max(0)),
            };
            json!({ "window_key": w.key, "count": count, "resets_at": w.resets_at })
        }
        _ => Value::Null,
    };
    Ok(Json(body))
}

#[utoipa::path(patch, path = "/v1/quotas/{id}", tag = "admin",
    responses((status = 200, description = "The quota"), (status = 400, description = "An immutable field was changed")))]
pub async fn patch_quota(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let q = load_quota(&s, &id).await?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &QUOTA_FIELDS)?;
    // Restating an immutable field at its current value is fine; changing it is not.
    let current = quota_json(&q);
    for f in meter::quota::IMMUTABLE_FIELDS {
        if let Some(v) = obj.get(f)
            && *v != current[f]
        {
            return Err(ApiError::invalid(f, "is immutable; replace the quota to change it"));
        }
    }
    let limit = match fields::limit(&obj, "")? {
        (None, None) => None,
        (whole, decimal) => Some(meter::quota::parse_limit(q.spec.metric, whole, decimal.as_deref())?),
    };
    let mode = match fields::opt_str(&obj, "", "mode")? {
        None => None,
        Some(m) => Some(Mode::from_str(&m).map_err(|_| ApiError::invalid("mode", "must be enforce or monitor"))?),
    };
    let patch = QuotaPatch { limit, mode };
    let now = now_micros(s.clock.as_ref());
    let plan = QuotaPlan::update(q, &patch, now);
    match change_quotas(&s, &plan, now).await {
        Ok(()) => {}
        // Deleted between our read and our write.
        Err(PortError::Conflict(_)) => return Err(ApiError::not_found("quota", &id)),
        Err(e) => return Err(e.into()),
    }
    let updated = plan.updates.first().map(|u| &u.after).ok_or_else(|| ApiError::not_found("quota", &id))?;
    let mut body = quota_json(updated);
    body["inert"] = json!(is_inert(&s, updated, &mut HashMap::new()).await?);
    Ok(Json(body))
}

#[utoipa::path(delete, path = "/v1/quotas/{id}", tag = "admin", responses((status = 204, description = "Deleted")))]
pub async fn delete_quota(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    auth::admin(&s, &headers)?;
    let q = load_quota(&s, &id).await?;
    let now = now_micros(s.clock.as_ref());
    match change_quotas(&s, &QuotaPlan::delete(q), now).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        // Deleted between our read and our write.
        Err(PortError::Conflict(_)) => Err(ApiError::not_found("quota", &id)),
        Err(e) => Err(e.into()),
    }
}

#[utoipa::path(delete, path = "/v1/api-keys/{id}", tag = "admin",
    responses((status = 204, description = "Deleted: the key no longer authenticates; quotas naming it go inert"),
              (status = 404, description = "NOT_FOUND (never existed, or already deleted)")))]
pub async fn delete_api_key(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    auth::admin(&s, &headers)?;
    let kid = ApiKeyId::parse(id.clone()).map_err(|_| ApiError::not_found("api key", &id))?;
    if !s.store.delete_api_key(&kid, now_micros(s.clock.as_ref())).await? {
        return Err(ApiError::not_found("api key", &id));
    }
    s.invalidate_key(&kid);
    Ok(StatusCode::NO_CONTENT)
}

/// Reads query parameters by name, refusing unknown ones.
fn query_params(raw: &HashMap<String, String>, allowed: &[&str]) -> ApiResult<()> {
    match raw.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(k.clone(), "is not a known parameter")),
        None => Ok(()),
    }
}

fn whole(raw: &HashMap<String, String>, name: &str) -> ApiResult<Option<u64>> {
    raw.get(name)
        .map(|v| v.parse::<u64>().map_err(|_| ApiError::invalid(name, format!("must be a whole number; got {v:?}"))))
        .transpose()
}

/// The most rows a page number may reach; past it, page by cursor.
pub const MAX_PAGED_ROWS: u64 = 10_000;
/// The largest page.
pub const MAX_PAGE: u64 = 1000;

fn audit_json(e: &AuditEntry) -> Value {
    json!({
        "id": e.id, "project_id": e.project_id, "action": e.action.as_str(),
        "principal_type": e.principal.as_ref().map(|p| p.kind.as_str()),
        "principal_id": e.principal.as_ref().map(|p| p.id.as_str()),
        "resource": e.resource, "detail": serde_json::to_value(&e.detail).unwrap_or(Value::Null),
        "created_at": e.created_at,
    })
}

#[utoipa::path(get, path = "/v1/audit", tag = "admin",
    params(("project_id" = String, Query, description = "The project"),
           ("after" = Option<String>, Query, description = "Cursor: the `next` of the previous page"),
           ("limit" = Option<u64>, Query, description = "Entries per page, 1–1000 (default 100)"),
           ("page" = Option<u64>, Query, description = "Page number from 1, only while page × limit ≤ 10,000; use `after` beyond")),
    responses((status = 200, description = "{data: [entries in time order], next: cursor or null}"),
              (status = 400, description = "INVALID_REQUEST naming the parameter")))]
pub async fn audit(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(raw): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    query_params(&raw, &["project_id", "after", "limit", "page"])?;
    let project = raw.get("project_id").ok_or_else(|| ApiError::invalid("project_id", "is required"))?;
    let pid = ProjectId::parse(project.clone()).map_err(|e| ApiError::invalid("project_id", e.to_string()))?;
    let limit = whole(&raw, "limit")?.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit", format!("must be between 1 and {MAX_PAGE}")));
    }
    let after = raw
        .get("after")
        .map(|a| AuditId::parse(a.clone()).map_err(|e| ApiError::invalid("after", e.to_string())))
        .transpose()?;
    let skip = match whole(&raw, "page")? {
        None => 0,
        Some(_) if after.is_some() => {
            return Err(ApiError::invalid("page", "cannot be combined with after; page by cursor with after alone"));
        }
        Some(0) => return Err(ApiError::invalid("page", "must be 1 or more")),
        Some(p) if p.saturating_mul(limit) > MAX_PAGED_ROWS => {
            return Err(ApiError::invalid(
                "page",
                "page × limit must stay within 10,000 rows; page by cursor instead: pass after=<the next of the previous page>",
            ));
        }
        Some(p) => (p - 1) * limit,
    };
    if s.store.project(&pid).await?.is_none() {
        return Err(ApiError::not_found("project", pid.as_str()));
    }
    // One more than a page, to know whether another follows.
    let want = usize::try_from(skip + limit + 1).unwrap_or(usize::MAX);
    let rows = s.store.audit(&pid, after.as_ref(), want).await?;
    let more = rows.len() == want;
    let (skip, limit) = (usize::try_from(skip).unwrap_or(usize::MAX), usize::try_from(limit).unwrap_or(usize::MAX));
    let page: Vec<AuditEntry> = rows.into_iter().skip(skip).take(limit).collect();
    let next = if more { page.last().map(|e| json!(e.id)) } else { None };
    Ok(Json(json!({ "data": page.iter().map(audit_json).collect::<Vec<_>>(), "next": next.unwrap_or(Value::Null) })))
}

#[utoipa::path(put, path = "/v1/projects/{id}/quotas", tag = "admin",
    params(("dry_run" = Option<bool>, Query, description = "Plan only; change nothing")),
    responses((status = 200, description = "What changed: created, updated, deleted, unchanged and each change"),
              (status = 400, description = "INVALID_REQUEST naming the entry and field (quotas[2].window); nothing changed"),
              (status = 404, description = "NOT_FOUND")))]
pub async fn put_project_quotas(
    State(s): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(raw): Query<HashMap<String, String>>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    query_params(&raw, &["dry_run"])?;
    let dry_run = match raw.get("dry_run").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return Err(ApiError::invalid("dry_run", "must be true or false")),
    };
    let pid = ProjectId::parse(id.clone()).map_err(|_| ApiError::not_found("project", &id))?;
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::invalid("body", format!("is not valid JSON: {e}")))?;
    let doc = crate::apply::parse_document(&value)?;
    if doc.project_id.as_ref().is_some_and(|p| p != pid.as_str()) {
        return Err(ApiError::invalid("project_id", "is not the project of the path"));
    }
    let plan =
        crate::apply::apply(s.store.as_ref(), s.clock.as_ref(), &pid, &doc.quotas, &api_principal(), dry_run).await?;
    if !dry_run && !plan.is_empty() {
        s.invalidate_project(&pid);
    }
    Ok(Json(crate::apply::plan_json(&plan, dry_run)))
}
