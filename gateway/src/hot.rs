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
    ApiKey, ApiKeyId, CheckOutcome, EventId, EventKind, Hold, Outcome, PortError, ProjectId, ReservationId,
    Settlement, UsageFact, Verdict,
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
    pub headers: HeaderMap,
    /// True when the view was unreachable and policy let the call through.
    pub degraded: bool,
}

/// Runs one check for a known caller: one view round trip, the verdict, and
/// the request event published in the background. A refusal is the
/// documented error (429 with `Retry-After`, or 503 by the view-down policy).
pub async fn admit(s: &AppState, key: ApiKey, agent: Option<String>, actor: Option<String>) -> ApiResult<Admission> {
    let cfg = s
        .project_config(&key.project_id)
        .await?
        .ok_or_else(|| ApiError::unauthenticated("the api key's project no longer exists"))?;
    let now = s.clock.now();
    let plan = meter::plan_check(&cfg.quotas, cfg.project.timezone, &key.id, actor.as_deref(), now);
    let hold = Hold {
        reservation: ReservationId::parse(new_id("res")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        request_event: EventId::parse(new_id("req")).map_err(|e| ApiError::invalid("id", e.to_string()))?,
        lease_until: now + chrono::Duration::from_std(s.settings.lease).unwrap_or(chrono::Duration::seconds(60)),
    };
    let outcome = if plan.limits.is_empty() {
        Some(CheckOutcome { admitted: true, used: Vec::new() })
    } else {
        match run_check(s, &key.project_id, &plan, &hold, now).await {
            Ok(o) => Some(o),
            Err(e) => {
                warn!(error = %e, "view unreachable during check");
                metrics::counter!("tollgate_view_unavailable_total", "policy" => match s.settings.view_down {
                    ViewDownPolicy::Allow => "allow",
                    ViewDownPolicy::Deny => "deny",
                })
                .increment(1);
                if s.settings.view_down == ViewDownPolicy::Deny {
                    return Err(ApiError::unavailable("VIEW_UNAVAILABLE", "quota view unreachable; the check is refused by policy"));
                }
                None
            }
        }
    };
    publish_request(s, &key, agent, actor, &hold, now);
    let Some(outcome) = outcome else {
        return Ok(Admission { reservation: hold.reservation, key, headers: HeaderMap::new(), degraded: true });
    };
    let verdict = meter::decide(&cfg.quotas, &plan, &outcome, now);
    if !verdict.monitor_breaches.is_empty() {
        record_monitor_breaches(s, &cfg.quotas, &plan, &outcome, now);
    }
    let mut headers = HeaderMap::new();
    remaining_headers(&verdict, &mut headers);
    match &verdict.breach {
        None => Ok(Admission { reservation: hold.reservation, key, headers, degraded: false }),
        Some(b) => {
            metrics::counter!("tollgate_check_refusals_total", "metric" => b.metric.as_str()).increment(1);
            let subject = match &b.scope_ref {
                Some(r) => format!("{} {r}", b.scope),
                None if b.scope == meter::Scope::Project => format!("project {}", key.project_id),
                None => format!("{} (all)", b.scope),
            };
            let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "QUOTA_EXCEEDED", format!("Quota exceeded for {subject}."))
                .with_meta(json!({
                    "quota_id": b.quota_id, "metric": b.metric.as_str(), "limit": b.limit,
                    "window": b.window.as_str(), "resets_at": b.resets_at,
                }));
            e.headers = headers;
            if let Some(secs) = b.retry_after_secs {
                e = e.header("retry-after", &secs.to_string());
            }
            Err(e)
        }
    }
}

#[utoipa::path(post, path = "/v1/check", tag = "hot path",
    responses((status = 200, description = "Admitted: a reservation to settle with the call's event"),
              (status = 429, description = "QUOTA_EXCEEDED, with Retry-After"),
              (status = 400, description = "INVALID_REQUEST naming the field")))]
pub async fn check(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult<Response> {
    auth::gateway(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["api_key", "api_key_id", "project_id", "agent_id", "actor_id", "storage_bytes_delta", "permit"])?;
    let agent = fields::opt_id(&obj, "", "agent_id")?;
    let actor = fields::opt_id(&obj, "", "actor_id")?;
    if obj.get("storage_bytes_delta").is_some_and(|v| !v.is_null() && !v.is_i64()) {
        return Err(ApiError::invalid("storage_bytes_delta", "must be a whole number"));
    }
    let key = caller(&s, &obj).await?;
    if let Some(p) = fields::opt_str(&obj, "", "project_id")? {
        if p != key.project_id.as_str() {
            return Err(ApiError::invalid("project_id", "is not the api key's project"));
        }
    }
    let a = admit(&s, key, agent, actor).await?;
    let limits = json!({ "query_timeout": a.key.grants.query_timeout, "max_rows": a.key.grants.max_rows });
    let mut body = json!({ "allowed": true, "reservation_id": a.reservation, "limits": limits });
    if a.degraded {
        body["degraded"] = json!(true);
    }
    Ok((StatusCode::OK, a.headers, Json(body)).into_response())
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
fn publish_request(s: &AppState, key: &ApiKey, agent: Option<String>, actor: Option<String>, hold: &Hold, now: DateTime<Utc>) {
    let fact = UsageFact {
        id: hold.request_event.clone(),
        project_id: key.project_id.clone(),
        api_key_id: Some(key.id.clone()),
        agent_id: agent,
        actor_id: actor,
        occurred_at: now,
        kind: EventKind::Request,
        outcome: Outcome::Success,
        rows: 0,
        reservation_id: Some(hold.reservation.clone()),
        gateway: s.settings.instance.clone(),
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

const EVENT_FIELDS: [&str; 13] = [
    "id", "type", "project_id", "api_key_id", "agent_id", "actor_id", "occurred_at", "reservation_id",
    "outcome", "rows", "tokens", "storage_bytes", "meter_type",
];

/// Most events one request may carry.
pub const MAX_EVENTS: usize = 5000;

async fn parse_event(s: &AppState, i: usize, v: &Value, now: DateTime<Utc>) -> ApiResult<UsageFact> {
    let p = format!("events[{i}].");
    let Value::Object(o) = v else { return Err(ApiError::invalid(format!("events[{i}]"), "must be an object")) };
    fields::only(o, &p, &EVENT_FIELDS)?;
    let id = EventId::parse(fields::req_str(o, &p, "id")?).map_err(|e| ApiError::invalid(format!("{p}id"), e.to_string()))?;
    let kind_raw = fields::req_str(o, &p, "type")?;
    let kind = EventKind::from_str(&kind_raw).map_err(|_| {
        ApiError::invalid(format!("{p}type"), "must be one of request, call, tokens, storage_delta, storage_snapshot, correction")
    })?;
    if !kind.is_folded() {
        return Err(ApiError::invalid(format!("{p}type"), format!("{kind} events are not metered by this release")));
    }
    for f in ["tokens", "storage_bytes", "meter_type"] {
        if o.get(f).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(format!("{p}{f}"), "is not metered by this release"));
        }
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
                _ => return Err(ApiError::invalid(format!("{p}api_key_id"), format!("no api key {kid} in project {project_id}"))),
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
        Some(x) => Outcome::from_str(&x).map_err(|_| ApiError::invalid(format!("{p}outcome"), "must be success or failure"))?,
    };
    let rows = fields::opt_count(o, &p, "rows")?.unwrap_or(0);
    let reservation_id = fields::opt_id(o, &p, "reservation_id")?
        .map(ReservationId::parse)
        .transpose()
        .map_err(|e| ApiError::invalid(format!("{p}reservation_id"), e.to_string()))?;
    let fact = UsageFact {
        id,
        project_id,
        api_key_id,
        agent_id: fields::opt_id(o, &p, "agent_id")?,
        actor_id: fields::opt_id(o, &p, "actor_id")?,
        occurred_at,
        kind,
        outcome,
        rows,
        reservation_id,
        gateway: s.settings.instance.clone(),
    };
    meter::usage::check_fact(&fact).map_err(|e| ApiError::invalid(format!("{p}{}", e.field), e.message))?;
    Ok(fact)
}

#[utoipa::path(post, path = "/v1/events", tag = "hot path",
    responses((status = 202, description = "Every event is on the log"),
              (status = 400, description = "INVALID_REQUEST naming the field; nothing was written")))]
pub async fn events(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult<(StatusCode, Json<Value>)> {
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
    // Settle into the view first, per project, so a fold never precedes it.
    let mut by_project: BTreeMap<ProjectId, Vec<Settlement>> = BTreeMap::new();
    for f in facts {
        let cfg = s.project_config(&f.project_id).await?;
        let tz = cfg.map(|c| c.project.timezone).unwrap_or(chrono_tz::Tz::UTC);
        let deltas = meter::usage::counters_for(f, tz)
            .into_iter()
            .filter(|(c, _)| c.resets_at.is_none_or(|r| r > now))
            .collect();
        by_project.entry(f.project_id.clone()).or_default().push(Settlement {
            event: f.id.clone(),
            reservation: f.reservation_id.clone(),
            deltas,
        });
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
        return Err(ApiError::unavailable("LOG_UNAVAILABLE", "the event log did not acknowledge the events; retry with the same ids"));
    }
    Ok(())
}
