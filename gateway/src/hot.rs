//! The hot path: `POST /v1/check` and `POST /v1/events`.
//!
//! A check is one view round trip (plus, once after the view was lost, a
//! seed from the store). Its request event is published to the log after the
//! answer, off the caller's latency. Events are settled into the view *before*
//! they are published, so the projector's fold always finds the pending delta
//! it must drop, and they are acknowledged only after the broker acknowledged
//! every one of them.

use std::collections::{BTreeMap, HashSet};
use std::str::FromStr;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use meter::{
    ApiKey, ApiKeyId, Breach, BreachKind, Caller, CheckInput, CheckOutcome, EventId, EventKind, Grants, Hold,
    MeterType, Outcome, PortError, ProjectId, ReservationId, Role, RoleId, Settlement, TokenUsage, UnpricedException,
    UnpricedRow, UsageFact, Verdict,
};
use serde_json::{Value, json};
use tracing::warn;

use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::fields;
use crate::state::{AppState, ViewDownPolicy, new_audit_id, new_id};

fn remaining_headers(v: &Verdict, headers: &mut HeaderMap) {
    let mut set = |name: &'static str, value: String| {
        if let Ok(h) = HeaderValue::from_str(&value) {
            headers.insert(name, h);
        }
    };
    if let Some(c) = v.remaining_calls {
        set("x-quota-remaining-calls", c.to_string());
    }
    if let Some(r) = v.remaining_rows {
        set("x-quota-remaining-rows", r.to_string());
    }
    if let Some(t) = v.reset {
        set("x-quota-reset", t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    }
}

/// The caller a check names.
async fn caller(s: &AppState, obj: &serde_json::Map<String, Value>) -> ApiResult<ApiKey> {
    let secret = fields::opt_str(obj, "", "api_key")?;
    let id = fields::opt_id(obj, "", "api_key_id")?;
    let key = match (secret, id) {
        (Some(_), Some(_)) => return Err(ApiError::invalid("api_key", "give api_key or api_key_id, not both")),
        (Some(secret), None) => s.key_by_secret(&secret).await?,
        (None, Some(id)) => match ApiKeyId::parse(id) {
            Ok(k) => s.key_by_id(&k).await?,
            Err(_) => None,
        },
        (None, None) => return Err(ApiError::invalid("api_key", "api_key or api_key_id is required")),
    };
    key.ok_or_else(|| ApiError::unauthenticated("unknown api key").with_meta(json!({ "field": "api_key" })))
}

/// An admitted check: the reservation to settle, the caller, and the
/// headers every answer to a caller with a quota carries.
#[derive(Debug, Clone)]
pub struct Admission {
    pub reservation: ReservationId,
    pub key: ApiKey,
    /// The limits that apply: the key's grants narrowed by its role's.
    pub limits: Grants,
    pub headers: HeaderMap,
    /// True when the view was unreachable and policy let the call through.
    pub degraded: bool,
    /// An administrator's or break-glass caller: nothing was checked or
    /// counted, and the call must not be recorded.
    pub exempt: bool,
}

/// Who a check is for.
#[derive(Debug, Clone)]
pub enum Subject {
    Key(ApiKey),
    /// A signed-in user, named by the gateway (`user:<subject>`).
    User {
        project: ProjectId,
        user: String,
    },
}

/// What a check granted, whoever asked.
#[derive(Debug, Clone)]
pub struct Granted {
    pub reservation: ReservationId,
    pub headers: HeaderMap,
    pub degraded: bool,
    pub exempt: bool,
}

/// Runs one check for an API key (with its role, if it has one).
pub async fn admit(
    s: &AppState,
    key: ApiKey,
    agent: Option<String>,
    actor: Option<String>,
    storage_delta: Option<i64>,
) -> ApiResult<Admission> {
    let role = match &key.role_id {
        Some(r) => s.role_by_id(r).await?,
        None => None,
    };
    let limits = meter::role::effective_grants(&key.grants, role.as_ref());
    let g = admit_subject(s, Subject::Key(key.clone()), role, agent, actor, storage_delta).await?;
    Ok(Admission {
        reservation: g.reservation,
        key,
        limits,
        headers: g.headers,
        degraded: g.degraded,
        exempt: g.exempt,
    })
}

/// Runs one check: one view round trip, the verdict, and the request event
/// published in the background. A refusal is the documented error (429 with
/// `Retry-After`, 409 for storage and pricing blackouts, or 503 by the
/// view-down policy). An exempt role is admitted with nothing checked or counted.
pub async fn admit_subject(
    s: &AppState,
    subject: Subject,
    role: Option<Role>,
    agent: Option<String>,
    actor: Option<String>,
    storage_delta: Option<i64>,
) -> ApiResult<Granted> {
    let new_reservation = || ReservationId::parse(new_id("res")).map_err(|e| ApiError::invalid("id", e.to_string()));
    if role.as_ref().is_some_and(|r| r.exempt) {
        metrics::counter!("tollgate_exempt_checks_total").increment(1);
        return Ok(Granted {
            reservation: new_reservation()?,
            headers: HeaderMap::new(),
            degraded: false,
            exempt: true,
        });
    }
    let (project, caller) = match &subject {
        Subject::Key(k) => (
            k.project_id.clone(),
            Caller { api_key: Some(k.id.clone()), agent: agent.clone(), actor: actor.clone(), user: None },
        ),
        Subject::User { project, user } => (
            project.clone(),
            Caller { api_key: None, agent: agent.clone(), actor: actor.clone(), user: Some(user.clone()) },
        ),
    };
    let cfg = s
        .project_config(&project)
        .await?
        .ok_or_else(|| ApiError::unauthenticated("the caller's project no longer exists"))?;
    let quotas: std::sync::Arc<Vec<meter::Quota>> = match &role {
        Some(r) if r.quota.is_some() => {
            let mut q = (*cfg.quotas).clone();
            q.extend(meter::role::role_quotas(r, &caller));
            std::sync::Arc::new(q)
        }
        _ => cfg.quotas.clone(),
    };
    let now = s.clock.now();
    let input = CheckInput { caller, storage_delta };
    let plan = meter::plan_check(&quotas, cfg.project.timezone, &input, now);
    let hold = Hold {
        reservation: new_reservation()?,
        request_event: EventId::parse(new_id("req")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        lease_until: now + chrono::Duration::from_std(s.settings.lease).unwrap_or(chrono::Duration::seconds(60)),
    };
    let outcome = if plan.limits.is_empty() {
        Some(CheckOutcome { admitted: true, used: Vec::new() })
    } else {
        match run_check(s, &project, &plan, &hold, now).await {
            Ok(o) => Some(o),
            Err(e) => {
                warn!(error = %e, "view unreachable during check");
                metrics::counter!("tollgate_view_unavailable_total", "policy" => match s.settings.view_down {
                    ViewDownPolicy::Allow => "allow",
                    ViewDownPolicy::Deny => "deny",
                })
                .increment(1);
                if s.settings.view_down == ViewDownPolicy::Deny {
                    return Err(ApiError::unavailable(
                        "VIEW_UNAVAILABLE",
                        "quota view unreachable; the check is refused by policy",
                    ));
                }
                None
            }
        }
    };
    // Requests are key-authenticated traffic only: a signed-in user's check
    // is not a counted request.
    if let Subject::Key(key) = &subject {
        publish_request(s, key, agent, actor, &hold, now);
    }
    let Some(outcome) = outcome else {
        return Ok(Granted { reservation: hold.reservation, headers: HeaderMap::new(), degraded: true, exempt: false });
    };
    let verdict = meter::decide(&quotas, &plan, &outcome, now);
    if !verdict.monitor_breaches.is_empty() {
        record_monitor_breaches(s, &quotas, &plan, &outcome, now);
    }
    if !verdict.unpriced.is_empty() {
        file_exceptions(s, &project, &quotas, &verdict.unpriced, now);
    }
    let mut headers = HeaderMap::new();
    remaining_headers(&verdict, &mut headers);
    match &verdict.breach {
        None => Ok(Granted { reservation: hold.reservation, headers, degraded: false, exempt: false }),
        Some(b) => {
            metrics::counter!("tollgate_check_refusals_total", "metric" => b.metric.as_str()).increment(1);
            let mut e = refusal(s, &project, b).await;
            e.headers.extend(headers);
            Err(e)
        }
    }
}

/// The error body of a refusal (DESIGN §7 and the quotas reference).
async fn refusal(s: &AppState, project: &ProjectId, b: &Breach) -> ApiError {
    let subject = match &b.scope_ref {
        Some(r) => format!("{} {r}", b.scope),
        None if matches!(b.scope, meter::Scope::Project | meter::Scope::Agent) => format!("project {project}"),
        None => format!("{} (all)", b.scope),
    };
    let limit = meter::quota::limit_json(b.metric, b.limit);
    match b.kind {
        BreachKind::Exceeded => {
            let e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "QUOTA_EXCEEDED",
                format!("Quota exceeded for {subject}."),
            )
            .with_meta(json!({
                "quota_id": b.quota_id, "metric": b.metric.as_str(), "limit": limit,
                "window": b.window.as_str(), "resets_at": b.resets_at,
            }));
            match b.retry_after_secs {
                Some(secs) => e.header("retry-after", &secs.to_string()),
                None => e,
            }
        }
        BreachKind::Storage => ApiError::new(
            StatusCode::CONFLICT,
            "QUOTA_STORAGE_EXCEEDED",
            format!(
                "Storage quota {} exceeded: the project would store more than its {}-byte limit.",
                b.quota_id, b.limit
            ),
        )
        .with_meta(json!({
            "quota_id": b.quota_id, "metric": b.metric.as_str(), "limit": limit, "current_bytes": b.used,
        })),
        BreachKind::Unenforceable => {
            // Written to the store before their events were acknowledged,
            // so a blackout the view sees has its rows there.
            let rows = match s.store.unpriced_rows(project, &b.counter, meter::price::MAX_UNPRICED_ROWS).await {
                Ok(rows) => rows,
                Err(e) => {
                    warn!(error = %e, "unpriced rows unavailable for a QUOTA_UNENFORCEABLE body");
                    Vec::new()
                }
            };
            ApiError::new(
                StatusCode::CONFLICT,
                "QUOTA_UNENFORCEABLE",
                format!(
                    "Cost quota {} cannot be enforced: the current window metered usage but priced none of it.",
                    b.quota_id
                ),
            )
            .with_meta(json!({
                "quota_id": b.quota_id, "metric": b.metric.as_str(), "limit": limit, "window": b.window.as_str(),
                "unpriced_rows": rows.iter().map(price_key_json).collect::<Vec<_>>(),
            }))
        }
    }
}

pub fn price_key_json(k: &meter::PriceKey) -> Value {
    json!({ "provider": k.provider, "model": k.model, "component": k.component.as_str() })
}

/// Files (or counts again) the `quota_unpriced` exception of each cost
/// quota whose window held unpriced AI usage, in the background.
fn file_exceptions(
    s: &AppState,
    project: &ProjectId,
    quotas: &[meter::Quota],
    found: &[meter::UnpricedFinding],
    now: DateTime<Utc>,
) {
    for f in found {
        let Some(q) = quotas.get(f.quota) else { continue };
        let s = s.clone();
        let (project, f, limit) = (project.clone(), f.clone(), q.spec.limit);
        tokio::spawn(async move {
            let rows = match s.store.unpriced_rows(&project, &f.counter, meter::price::MAX_UNPRICED_ROWS).await {
                Ok(rows) => rows,
                Err(e) => {
                    warn!(error = %e, "unpriced rows unavailable; exception filed without them");
                    Vec::new()
                }
            };
            let exception = UnpricedException {
                project_id: project,
                quota_id: f.quota_id.clone(),
                limit,
                window_key: f.counter.window_key.clone(),
                llm_events: f.llm_events,
                unpriced_events: f.unpriced_events,
                unpriced_rows: rows,
                occurrence_count: 1,
                first_seen: now,
                last_seen: now,
            };
            if let Err(e) = s.store.file_exception(&exception).await {
                warn!(error = %e, quota = %f.quota_id, "quota_unpriced exception not filed");
            }
        });
    }
}

#[utoipa::path(post, path = "/v1/check", tag = "hot path",
    responses((status = 200, description = "Admitted: a reservation to settle with the call's event"),
              (status = 429, description = "QUOTA_EXCEEDED, with Retry-After"),
              (status = 400, description = "INVALID_REQUEST naming the field")))]
pub async fn check(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult<Response> {
    auth::gateway(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(
        &obj,
        "",
        &[
            "api_key",
            "api_key_id",
            "user",
            "role_id",
            "break_glass",
            "project_id",
            "agent_id",
            "actor_id",
            "storage_bytes_delta",
            "permit",
        ],
    )?;
    let agent = fields::opt_id(&obj, "", "agent_id")?;
    let actor = fields::opt_id(&obj, "", "actor_id")?;
    let storage_delta = match obj.get("storage_bytes_delta") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| ApiError::invalid("storage_bytes_delta", "must be a whole number"))?),
    };
    let break_glass = match obj.get("break_glass") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("break_glass", "must be true or false")),
    };
    let project_field = fields::opt_str(&obj, "", "project_id")?;
    // The break-glass caller is never limited or counted (ADR-0011).
    if break_glass {
        metrics::counter!("tollgate_exempt_checks_total").increment(1);
        return Ok(
            (StatusCode::OK, Json(json!({ "allowed": true, "exempt": true, "reservation_id": null }))).into_response()
        );
    }
    let (granted, limits) = if let Some(user) = fields::opt_str(&obj, "", "user")? {
        if obj.get("api_key").is_some_and(|v| !v.is_null()) || obj.get("api_key_id").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid("user", "give api_key, api_key_id or user, not several"));
        }
        meter::usage::check_user(&user).map_err(|m| ApiError::invalid("user", m))?;
        let role_raw = fields::opt_id(&obj, "", "role_id")?.ok_or_else(|| {
            ApiError::invalid("role_id", "a signed-in user is checked against its role: role_id is required")
        })?;
        let role = match RoleId::parse(role_raw.clone()) {
            Ok(r) => s.role_by_id(&r).await?,
            Err(_) => None,
        }
        .ok_or_else(|| ApiError::invalid("role_id", format!("no role {role_raw}")))?;
        if project_field.as_deref().is_some_and(|p| p != role.project_id.as_str()) {
            return Err(ApiError::invalid("project_id", "is not the role's project"));
        }
        let limits = role.grants.clone();
        let subject = Subject::User { project: role.project_id.clone(), user };
        (admit_subject(&s, subject, Some(role), agent, actor, storage_delta).await?, limits)
    } else {
        if obj.get("role_id").is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid("role_id", "a key's role is its own; role_id goes with user"));
        }
        let key = caller(&s, &obj).await?;
        if project_field.as_deref().is_some_and(|p| p != key.project_id.as_str()) {
            return Err(ApiError::invalid("project_id", "is not the api key's project"));
        }
        let a = admit(&s, key, agent, actor, storage_delta).await?;
        let limits = a.limits.clone();
        (Granted { reservation: a.reservation, headers: a.headers, degraded: a.degraded, exempt: a.exempt }, limits)
    };
    if granted.exempt {
        return Ok(
            (StatusCode::OK, Json(json!({ "allowed": true, "exempt": true, "reservation_id": null }))).into_response()
        );
    }
    let limits = json!({ "query_timeout": limits.query_timeout, "max_rows": limits.max_rows });
    let mut body = json!({ "allowed": true, "reservation_id": granted.reservation, "limits": limits });
    if granted.degraded {
        body["degraded"] = json!(true);
    }
    Ok((StatusCode::OK, granted.headers, Json(body)).into_response())
}

async fn run_check(
    s: &AppState,
    project: &ProjectId,
    plan: &meter::CheckPlan,
    hold: &Hold,
    now: DateTime<Utc>,
) -> Result<CheckOutcome, PortError> {
    if let Some(o) = s.view.check(project, plan, hold, now).await? {
        return Ok(o);
    }
    // The view holds nothing for this project (new, or Redis lost it): seed
    // it from the durable totals, then check again.
    let totals = s.store.open_totals(project, now).await?;
    s.view.seed(project, &totals).await?;
    s.view
        .check(project, plan, hold, now)
        .await?
        .ok_or_else(|| PortError::Transient("view not seeded after seeding".into()))
}

/// Writes the audit entry of each monitor breach, once per quota and window,
/// in the background: the answer never waits for it. The memo skips the
/// store for a breach this instance already wrote; the store's unique key
/// skips it across instances. A failed write is forgotten, so a later
/// check of the same window tries again.
fn record_monitor_breaches(
    s: &AppState,
    quotas: &[meter::Quota],
    plan: &meter::CheckPlan,
    outcome: &CheckOutcome,
    now: DateTime<Utc>,
) {
    for breach in meter::audit::monitor_breaches(quotas, plan, outcome) {
        if !s.breaches.first_sighting(&breach.quota_id, &breach.window_key) {
            continue;
        }
        let entry = breach.entry(new_audit_id(), now);
        let s = s.clone();
        tokio::spawn(async move {
            match s.store.record_audit(&entry).await {
                Ok(written) => {
                    if written {
                        metrics::counter!("tollgate_monitor_breaches_total").increment(1);
                    }
                }
                Err(e) => {
                    warn!(error = %e, quota = %breach.quota_id, "monitor breach not audited; retried on a later check");
                    s.breaches.forget(&breach.quota_id, &breach.window_key);
                }
            }
        });
    }
}

/// Publishes the check's request event in the background; if it never
/// reaches the log, its pending count is taken back.
fn publish_request(
    s: &AppState,
    key: &ApiKey,
    agent: Option<String>,
    actor: Option<String>,
    hold: &Hold,
    now: DateTime<Utc>,
) {
    let fact = UsageFact {
        api_key_id: Some(key.id.clone()),
        agent_id: agent,
        actor_id: actor,
        reservation_id: Some(hold.reservation.clone()),
        gateway: s.settings.instance.clone(),
        ..UsageFact::new(hold.request_event.clone(), key.project_id.clone(), EventKind::Request, now)
    };
    let s = s.clone();
    tokio::spawn(async move {
        if let Err(e) = s.log.publish(std::slice::from_ref(&fact)).await {
            warn!(error = %e, "request event not published");
            metrics::counter!("tollgate_request_events_lost_total").increment(1);
            let _ = s.view.unsettle(&fact.project_id, std::slice::from_ref(&fact.id)).await;
        }
    });
}

const EVENT_FIELDS: [&str; 14] = [
    "id",
    "type",
    "project_id",
    "api_key_id",
    "agent_id",
    "actor_id",
    "user",
    "occurred_at",
    "reservation_id",
    "outcome",
    "rows",
    "tokens",
    "storage_bytes",
    "meter_type",
];

const TOKEN_FIELDS: [&str; 7] = ["provider", "model", "input", "output", "cached", "reasoning", "embedding"];

/// `tokens`: a list of `{provider, model, input?, output?, cached?, reasoning?, embedding?}`.
fn parse_tokens(o: &serde_json::Map<String, Value>, p: &str) -> ApiResult<Vec<TokenUsage>> {
    let list = match o.get("tokens") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid(format!("{p}tokens"), "must be a list")),
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, t) in list.iter().enumerate() {
        let tp = format!("{p}tokens[{j}].");
        let Value::Object(t) = t else { return Err(ApiError::invalid(format!("{p}tokens[{j}]"), "must be an object")) };
        fields::only(t, &tp, &TOKEN_FIELDS)?;
        let embedding = match t.get("embedding") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid(format!("{tp}embedding"), "must be true or false")),
        };
        out.push(TokenUsage {
            provider: fields::req_str(t, &tp, "provider")?,
            model: fields::req_str(t, &tp, "model")?,
            input: fields::opt_count(t, &tp, "input")?.unwrap_or(0),
            output: fields::opt_count(t, &tp, "output")?.unwrap_or(0),
            cached: fields::opt_count(t, &tp, "cached")?.unwrap_or(0),
            reasoning: fields::opt_count(t, &tp, "reasoning")?.unwrap_or(0),
            embedding,
        });
    }
    Ok(out)
}

/// Most events one request may carry.
pub const MAX_EVENTS: usize = 5000;

async fn parse_event(s: &AppState, i: usize, v: &Value, now: DateTime<Utc>) -> ApiResult<UsageFact> {
    let p = format!("events[{i}].");
    let Value::Object(o) = v else { return Err(ApiError::invalid(format!("events[{i}]"), "must be an object")) };
    fields::only(o, &p, &EVENT_FIELDS)?;
    let id = EventId::parse(fields::req_str(o, &p, "id")?)
        .map_err(|e| ApiError::invalid(format!("{p}id"), e.to_string()))?;
    let kind_raw = fields::req_str(o, &p, "type")?;
    let kind = EventKind::from_str(&kind_raw).map_err(|_| {
        ApiError::invalid(
            format!("{p}type"),
            "must be one of request, call, tokens, storage_delta, storage_snapshot, correction",
        )
    })?;
    if !kind.is_folded() {
        return Err(ApiError::invalid(format!("{p}type"), format!("{kind} events are not metered by this release")));
    }
    let project_id = ProjectId::parse(fields::req_str(o, &p, "project_id")?)
        .map_err(|e| ApiError::invalid(format!("{p}project_id"), e.to_string()))?;
    if s.project_config(&project_id).await?.is_none() {
        return Err(ApiError::invalid(format!("{p}project_id"), format!("project {project_id} does not exist")));
    }
    let api_key_id = match fields::opt_id(o, &p, "api_key_id")? {
        None => None,
        Some(k) => {
            let kid = ApiKeyId::parse(k).map_err(|e| ApiError::invalid(format!("{p}api_key_id"), e.to_string()))?;
            match s.key_by_id(&kid).await? {
                Some(key) if key.project_id == project_id => Some(kid),
                _ => {
                    return Err(ApiError::invalid(
                        format!("{p}api_key_id"),
                        format!("no api key {kid} in project {project_id}"),
                    ));
                }
            }
        }
    };
    let occurred_raw = fields::req_str(o, &p, "occurred_at")?;
    let occurred_at = DateTime::parse_from_rfc3339(&occurred_raw)
        .map_err(|_| ApiError::invalid(format!("{p}occurred_at"), "must be an RFC 3339 timestamp"))?
        .with_timezone(&Utc);
    meter::usage::check_fact_time(occurred_at, now, s.settings.horizon)
        .map_err(|e| ApiError::invalid(format!("{p}occurred_at"), e.message))?;
    let outcome = match fields::opt_str(o, &p, "outcome")? {
        None => Outcome::Success,
        Some(x) => {
            Outcome::from_str(&x).map_err(|_| ApiError::invalid(format!("{p}outcome"), "must be success or failure"))?
        }
    };
    let rows = fields::opt_count(o, &p, "rows")?.unwrap_or(0);
    let reservation_id = fields::opt_id(o, &p, "reservation_id")?
        .map(ReservationId::parse)
        .transpose()
        .map_err(|e| ApiError::invalid(format!("{p}reservation_id"), e.to_string()))?;
    let user_id = fields::opt_str(o, &p, "user")?;
    let storage_bytes = match o.get("storage_bytes") {
        None | Some(Value::Null) => None,
        Some(v) => {
            Some(v.as_i64().ok_or_else(|| ApiError::invalid(format!("{p}storage_bytes"), "must be a whole number"))?)
        }
    };
    let meter_type = match fields::opt_str(o, &p, "meter_type")? {
        None => None,
        Some(m) => Some(m.parse::<MeterType>().map_err(|_| {
            ApiError::invalid(
                format!("{p}meter_type"),
                "must be one of llm_tokens, compute_execution, api_request, storage",
            )
        })?),
    };
    let fact = UsageFact {
        id,
        project_id,
        api_key_id,
        agent_id: fields::opt_id(o, &p, "agent_id")?,
        actor_id: fields::opt_id(o, &p, "actor_id")?,
        user_id,
        occurred_at,
        kind,
        outcome,
        rows,
        tokens: parse_tokens(o, &p)?,
        storage_bytes,
        meter_type,
        reservation_id,
        gateway: s.settings.instance.clone(),
        // The receipt stamp: lateness is judged by it, on the log.
        received_at: Some(now),
        admitted: None,
        lease_until: None,
        held: Vec::new(),
        breaches: Vec::new(),
        corrects: None,
        void: false,
    };
    meter::usage::check_fact(&fact).map_err(|e| ApiError::invalid(format!("{p}{}", e.field), e.message))?;
    Ok(fact)
}

#[utoipa::path(post, path = "/v1/events", tag = "hot path",
    responses((status = 202, description = "Every event is on the log"),
              (status = 400, description = "INVALID_REQUEST naming the field; nothing was written")))]
pub async fn events(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    auth::gateway(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["events"])?;
    let Some(Value::Array(list)) = obj.get("events") else {
        return Err(ApiError::invalid("events", "must be an array"));
    };
    if list.is_empty() || list.len() > MAX_EVENTS {
        return Err(ApiError::invalid("events", format!("must hold 1 to {MAX_EVENTS} events")));
    }
    let now = s.clock.now();
    let mut facts = Vec::with_capacity(list.len());
    let mut seen = HashSet::new();
    let mut duplicates = 0usize;
    for (i, v) in list.iter().enumerate() {
        let fact = parse_event(&s, i, v, now).await?;
        if seen.insert((fact.project_id.clone(), fact.id.clone())) {
            facts.push(fact);
        } else {
            duplicates += 1;
        }
    }
    record(&s, &facts).await?;
    metrics::counter!("tollgate_events_accepted_total").increment(facts.len() as u64);
    Ok((StatusCode::ACCEPTED, Json(json!({ "accepted": facts.len(), "duplicates": duplicates }))))
}

/// Settles facts into the view, then publishes them; returns once the log
/// acknowledged every one (or takes the settlement back and fails).
pub async fn record(s: &AppState, facts: &[UsageFact]) -> ApiResult<()> {
    let now = s.clock.now();
    let book =
        if facts.iter().any(|f| f.kind == EventKind::Tokens) { s.price_book().await? } else { Default::default() };
    // Settle into the view first, per project, so a fold never precedes it.
    let mut by_project: BTreeMap<ProjectId, Vec<Settlement>> = BTreeMap::new();
    let mut unpriced: BTreeMap<ProjectId, Vec<UnpricedRow>> = BTreeMap::new();
    for f in facts {
        let Some(cfg) = s.project_config(&f.project_id).await? else {
            return Err(ApiError::invalid("project_id", format!("project {} does not exist", f.project_id)));
        };
        let counters = meter::usage::counters_for(f, cfg.project.timezone, &book);
        if f.kind == EventKind::Tokens {
            let rows = meter::usage::priced(f, &book).unpriced_rows;
            if !rows.is_empty() {
                let out = unpriced.entry(f.project_id.clone()).or_default();
                // A refusal and an exception read them on a quota's counter;
                // the fold records them on every counter.
                for (c, _) in counters.iter().filter(|(c, _)| cfg.watched.covers(&c.key)) {
                    out.extend(rows.iter().map(|k| UnpricedRow { counter: c.clone(), key: k.clone() }));
                }
            }
        }
        // Only where a check can read it; the fold brings every counter's
        // durable total (meter::Watched says why).
        let deltas = counters
            .into_iter()
            .filter(|(c, _)| c.resets_at.is_none_or(|r| r > now) && cfg.watched.covers(&c.key))
            .collect();
        by_project.entry(f.project_id.clone()).or_default().push(Settlement {
            event: f.id.clone(),
            reservation: f.reservation_id.clone(),
            deltas,
        });
    }
    // The unpriced rows go to the store before the events are acknowledged,
    // so a refusal over a blackout can name them at once.
    for (project, rows) in &unpriced {
        s.store.record_unpriced(project, rows).await?;
    }
    for (project, settlements) in &by_project {
        if let Err(e) = s.view.settle(project, settlements, now).await {
            // The log is the truth: the view catches up when the projector folds.
            warn!(error = %e, %project, "settle into view failed");
            metrics::counter!("tollgate_view_unavailable_total", "policy" => "settle").increment(1);
        }
    }
    if let Err(e) = s.log.publish(facts).await {
        warn!(error = %e, "publishing events failed; nothing acknowledged");
        for (project, settlements) in &by_project {
            let ids: Vec<EventId> = settlements.iter().map(|x| x.event.clone()).collect();
            let _ = s.view.unsettle(project, &ids).await;
        }
        return Err(ApiError::unavailable(
            "LOG_UNAVAILABLE",
            "the event log did not acknowledge the events; retry with the same ids",
        ));
    }
    Ok(())
}
