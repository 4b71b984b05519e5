//! Quotas: one by one, or a project's whole set declaratively.
//!
//! Every change is a [`QuotaPlan`] carried out with its audit entries in one
//! transaction, and forgets the project's cached configuration so this
//! instance's next check sees it (others within their cache TTL). A quota's
//! identity (project, scope, scope_ref, metric, window, meter_type) is
//! unique and immutable; only its limit and mode change. A quota whose
//! `scope_ref` names a deleted key is *inert*: it can match nothing any
//! more, and stays visible and deletable.
//!
//! [`apply`] makes a project's quotas match a desired set (`PUT
//! /v1/projects/{id}/quotas` and `tollgate apply -f quotas.yaml`), all of it
//! or nothing; it needs only the stores and a clock, so the CLI runs it
//! without a view or a log.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use meter::apply::DesiredQuota;
use meter::{
    ApiKey, ApiKeyId, Clock, CounterKey, Dimension, Metric, Mode, PortError, Principal, Project, ProjectId, Quota,
    QuotaId, QuotaPatch, QuotaPlan, QuotaSpec, Scope, Totals, window_at,
};

use super::{Error, Result, admin_api, now_micros};
use crate::state::{AppState, Stores, new_audit_id, new_quota_id};

/// A quota, and whether it is inert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub quota: Quota,
    pub inert: bool,
}

/// A quota's count in its current window: what a check compares, durable +
/// settled + reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentUsage {
    pub window_key: String,
    /// In the metric's unit (picodollars for `cost_usd`).
    pub count: u64,
    pub resets_at: Option<DateTime<Utc>>,
}

/// A quota with its current usage (`None` when it has no single counter:
/// inert, or one budget per actor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detail {
    pub quota: Quota,
    pub inert: bool,
    pub current_usage: Option<CurrentUsage>,
}

/// A quota's limit as the caller wrote it; its unit depends on the metric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitInput {
    /// A whole number (dollars for `cost_usd`).
    Whole(i64),
    /// A decimal, as written (`cost_usd` only).
    Decimal(String),
}

impl LimitInput {
    /// As `meter`'s drafts take it: (whole, decimal).
    pub fn parts(&self) -> (Option<i64>, Option<&str>) {
        match self {
            LimitInput::Whole(n) => (Some(*n), None),
            LimitInput::Decimal(d) => (None, Some(d)),
        }
    }
}

/// A change to a stored quota: its limit and mode, and any identity field
/// restated (which must be restated at its current value).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Edit {
    /// Identity fields the caller restated, in [`meter::quota::IMMUTABLE_FIELDS`]
    /// order, with the value given (`None`: null).
    pub restated: Vec<(&'static str, Option<String>)>,
    pub limit: Option<LimitInput>,
    pub mode: Option<Mode>,
}

/// A declarative document: the project it names, if it names one, and its entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Document {
    pub project_id: Option<String>,
    pub quotas: Vec<DesiredQuota>,
}

/// Carries out a plan with its audit entry, in one transaction.
async fn change(s: &AppState, plan: &QuotaPlan, at: DateTime<Utc>, by: &Principal) -> Result<(), PortError> {
    let audit = plan.audit(by, at, &mut new_audit_id);
    s.stores.quotas.apply_quotas(plan, &audit).await?;
    s.invalidate_project(&plan.project_id);
    Ok(())
}

/// Checks that a new `api_key` quota names a live key of its project.
async fn check_key_ref(stores: &Stores, spec: &QuotaSpec, field: &str) -> Result<()> {
    if let (Scope::ApiKey, Some(r)) = (spec.scope, &spec.scope_ref) {
        let key = match ApiKeyId::parse(r.clone()) {
            Ok(k) => stores.tenants.api_key(&k).await?,
            Err(_) => None,
        };
        if key.is_none_or(|k| k.project_id != spec.project_id) {
            return Err(Error::invalid(field, format!("no api key {r} in project {}", spec.project_id)));
        }
    }
    Ok(())
}

/// Creates a quota, audited as `by`. Its project must exist, and an
/// `api_key` quota's key must be a live key of it.
pub async fn create(s: &AppState, spec: QuotaSpec, by: &Principal) -> Result<Quota> {
    if s.stores.tenants.project(&spec.project_id).await?.is_none() {
        return Err(Error::invalid("project_id", format!("project {} does not exist", spec.project_id)));
    }
    check_key_ref(&s.stores, &spec, "scope_ref").await?;
    let now = now_micros(s.clock.as_ref());
    let quota = Quota { id: new_quota_id(), spec, created_at: now, updated_at: now };
    match change(s, &QuotaPlan::create(quota.clone()), now, by).await {
        Ok(()) => Ok(quota),
        Err(PortError::Conflict(_)) => Err(Error::QuotaConflict),
        Err(e) => Err(e.into()),
    }
}

/// A project's quotas (none if there is no such project).
pub async fn list(s: &AppState, project: &ProjectId) -> Result<Vec<Listed>> {
    let quotas = s.stores.quotas.quotas(project).await?;
    mark_inert(s, quotas, HashMap::new()).await
}

/// [`list`], knowing the project's live keys (as
/// [`super::provisioning::api_keys`] lists them): a quota on one of them
/// needs no lookup to tell it is not inert.
pub async fn list_knowing(s: &AppState, project: &ProjectId, live: &[ApiKey]) -> Result<Vec<Listed>> {
    let quotas = s.stores.quotas.quotas(project).await?;
    mark_inert(s, quotas, known_live(project, live)).await
}

/// The quotas of a live key's project that count its calls whatever agent
/// or actor makes them ([`applies_to_key`]), none of them inert.
pub async fn applying_to_key(s: &AppState, key: &ApiKey) -> Result<Vec<Listed>> {
    let mut quotas = s.stores.quotas.quotas(&key.project_id).await?;
    quotas.retain(|q| applies_to_key(q, &key.id));
    mark_inert(s, quotas, known_live(&key.project_id, std::slice::from_ref(key))).await
}

fn known_live(project: &ProjectId, live: &[ApiKey]) -> HashMap<String, bool> {
    live.iter().filter(|k| &k.project_id == project).map(|k| (k.id.to_string(), true)).collect()
}

async fn mark_inert(s: &AppState, quotas: Vec<Quota>, mut live_keys: HashMap<String, bool>) -> Result<Vec<Listed>> {
    let mut out = Vec::with_capacity(quotas.len());
    for quota in quotas {
        let inert = is_inert(s, &quota, &mut live_keys).await?;
        out.push(Listed { quota, inert });
    }
    Ok(out)
}

/// Whether a quota can no longer match anything: its `scope_ref` names an
/// API key that was deleted (a deleted key cannot authenticate). `live`
/// caches key lookups across a list.
async fn is_inert(s: &AppState, q: &Quota, live: &mut HashMap<String, bool>) -> Result<bool> {
    let (Scope::ApiKey, Some(r)) = (q.spec.scope, &q.spec.scope_ref) else { return Ok(false) };
    if let Some(alive) = live.get(r) {
        return Ok(!alive);
    }
    let alive = match ApiKeyId::parse(r.clone()) {
        Ok(k) => s.stores.tenants.api_key(&k).await?.is_some_and(|k| k.project_id == q.spec.project_id),
        Err(_) => false,
    };
    live.insert(r.clone(), alive);
    Ok(!alive)
}

async fn load(s: &AppState, id: &QuotaId) -> Result<Quota> {
    s.stores.quotas.quota(id).await?.ok_or_else(|| Error::not_found("quota", id.as_str()))
}

/// A quota with its current usage (404 if there is none).
pub async fn get(s: &AppState, id: &QuotaId) -> Result<Detail> {
    let quota = load(s, id).await?;
    let project = s
        .stores
        .tenants
        .project(&quota.spec.project_id)
        .await?
        .ok_or_else(|| Error::not_found("project", quota.spec.project_id.as_str()))?;
    let inert = is_inert(s, &quota, &mut HashMap::new()).await?;
    let current_usage = current_usage(s, &project, &quota, inert, s.clock.now()).await?;
    Ok(Detail { quota, inert, current_usage })
}

/// A quota's count in its window at `at` — what a check compares, and what
/// [`get`] answers — or `None` when it has no single counter (inert, or one
/// budget per actor). `project` is the quota's.
pub async fn current_usage(
    s: &AppState,
    project: &Project,
    quota: &Quota,
    inert: bool,
    at: DateTime<Utc>,
) -> Result<Option<CurrentUsage>> {
    let sp = &quota.spec;
    let Some(d) = counter_dimension(quota, inert) else { return Ok(None) };
    let w = window_at(sp.window, project.timezone, at);
    let key = if sp.metric == Metric::StorageBytes {
        CounterKey::footprint()
    } else {
        CounterKey { dimension: d, window: w.kind, window_key: w.key.clone() }
    };
    let (t, reserved) = super::usage::live_count(s, &project.id, &key, at).await?;
    Ok(Some(CurrentUsage { window_key: w.key, count: metric_value(sp, &t, reserved), resets_at: w.resets_at }))
}

/// The one counter a quota reads, if it has one: not inert, and not one
/// budget per actor.
fn counter_dimension(q: &Quota, inert: bool) -> Option<Dimension> {
    match (q.spec.scope, &q.spec.scope_ref) {
        // A deleted key's quota counts nothing any more.
        _ if inert => None,
        (Scope::Project, _) | (Scope::Agent, None) => Some(Dimension::Project),
        (Scope::ApiKey, None) => Some(Dimension::AllApiKeys),
        (Scope::ApiKey, Some(r)) => ApiKeyId::parse(r.clone()).ok().map(Dimension::ApiKey),
        (Scope::Agent, Some(r)) => Some(Dimension::Agent(r.clone())),
        (Scope::Actor, Some(r)) => Some(Dimension::Actor(r.clone())),
        // One budget per actor: no single counter. (User scope is a role's, never stored.)
        (Scope::Actor, None) | (Scope::User, _) => None,
    }
}

/// What a quota compares of a counter's totals (and, for calls, its live
/// reservations), in the metric's unit.
fn metric_value(sp: &QuotaSpec, t: &Totals, reserved_calls: u64) -> u64 {
    match sp.metric {
        Metric::Requests => t.requests,
        Metric::Calls => t.calls + reserved_calls,
        Metric::Rows => t.rows,
        Metric::Tokens => t.tokens,
        Metric::CostUsd => t.cost(sp.meter()),
        Metric::StorageBytes => u64::try_from(t.storage.max(0)).unwrap_or(0),
    }
}

/// A quota's usage over its window at `at`, slice by slice
/// ([`super::usage::slices`]): what the projector has folded in each, in
/// the metric's unit (durable only; [`current_usage`] is the live count).
/// Empty for a quota with no single counter, on storage, or on a one-minute
/// window.
pub async fn series(
    s: &AppState,
    project: &Project,
    quota: &Quota,
    inert: bool,
    at: DateTime<Utc>,
) -> Result<Vec<(meter::Window, u64)>> {
    let sp = &quota.spec;
    let Some(d) = counter_dimension(quota, inert).filter(|_| sp.metric != Metric::StorageBytes) else {
        return Ok(Vec::new());
    };
    let slices = super::usage::slices(&window_at(sp.window, project.timezone, at), project.timezone, at);
    let totals = super::usage::durable_series(s, &project.id, &d, &slices).await?;
    Ok(slices.into_iter().zip(totals).map(|(w, t)| (w, metric_value(sp, &t, 0))).collect())
}

/// Whether a quota counts a key's calls whatever agent or actor makes
/// them: a project quota, or an `api_key` quota on this key or on all keys.
pub fn applies_to_key(q: &Quota, key: &ApiKeyId) -> bool {
    match (q.spec.scope, &q.spec.scope_ref) {
        (Scope::Project, _) | (Scope::ApiKey, None) => true,
        (Scope::ApiKey, Some(r)) => r == key.as_str(),
        _ => false,
    }
}

/// The current value of one of a quota's identity fields, as the API shows it.
fn identity_value(q: &Quota, field: &str) -> Option<String> {
    let sp = &q.spec;
    match field {
        "project_id" => Some(sp.project_id.to_string()),
        "scope" => Some(sp.scope.as_str().to_owned()),
        "scope_ref" => sp.scope_ref.clone(),
        "metric" => Some(sp.metric.as_str().to_owned()),
        "window" => Some(sp.window.as_str().to_owned()),
        "meter_type" => sp.meter_type.clone(),
        "on_unpriced" => sp.on_unpriced.map(|o| o.as_str().to_owned()),
        _ => None,
    }
}

/// Changes a quota's limit and mode (404 if there is none). Restating an
/// identity field at its current value is fine; changing it is refused.
pub async fn edit(s: &AppState, id: &QuotaId, edit: Edit) -> Result<Listed> {
    let q = load(s, id).await?;
    for (field, value) in &edit.restated {
        if *value != identity_value(&q, field) {
            return Err(Error::invalid(*field, "is immutable; replace the quota to change it"));
        }
    }
    let limit = match &edit.limit {
        None => None,
        Some(l) => {
            let (whole, decimal) = l.parts();
            Some(meter::quota::parse_limit(q.spec.metric, whole, decimal)?)
        }
    };
    let now = now_micros(s.clock.as_ref());
    let plan = QuotaPlan::update(q, &QuotaPatch { limit, mode: edit.mode }, now);
    match change(s, &plan, now, &admin_api()).await {
        Ok(()) => {}
        // Deleted between our read and our write.
        Err(PortError::Conflict(_)) => return Err(Error::not_found("quota", id.as_str())),
        Err(e) => return Err(e.into()),
    }
    let quota =
        plan.updates.into_iter().next().map(|u| u.after).ok_or_else(|| Error::not_found("quota", id.as_str()))?;
    let inert = is_inert(s, &quota, &mut HashMap::new()).await?;
    Ok(Listed { quota, inert })
}

/// Deletes a quota (404 if there is none).
pub async fn delete(s: &AppState, id: &QuotaId) -> Result<()> {
    let q = load(s, id).await?;
    let now = now_micros(s.clock.as_ref());
    match change(s, &QuotaPlan::delete(q), now, &admin_api()).await {
        Ok(()) => Ok(()),
        // Deleted between our read and our write.
        Err(PortError::Conflict(_)) => Err(Error::not_found("quota", id.as_str())),
        Err(e) => Err(e.into()),
    }
}

/// How many times a plan is made again after the stored set moved under it.
const ATTEMPTS: usize = 3;

/// Plans `desired` against the project's stored quotas and, unless
/// `dry_run`, carries the plan out with its audit entries (as `by`): all of
/// it or nothing. Returns the plan (what changed, or would change). A
/// refused entry is named by its index (`quotas[2].window`).
pub async fn apply(
    stores: &Stores,
    clock: &dyn Clock,
    project: &ProjectId,
    desired: &[DesiredQuota],
    by: &Principal,
    dry_run: bool,
) -> Result<QuotaPlan> {
    if stores.tenants.project(project).await?.is_none() {
        return Err(Error::not_found("project", project.as_str()));
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = stores.quotas.quotas(project).await?;
        let now = now_micros(clock);
        let plan = meter::apply::plan(project, desired, &current, now, &mut new_quota_id)?;
        // A new api_key quota must name a live key of the project, as on
        // POST /v1/quotas. (A stored one may name a deleted key: it is inert.)
        for c in &plan.creates {
            check_key_ref(stores, &c.quota.spec, &format!("quotas[{}].scope_ref", c.entry)).await?;
        }
        if dry_run || plan.is_empty() {
            return Ok(plan);
        }
        let audit = plan.audit(by, now, &mut new_audit_id);
        match stores.quotas.apply_quotas(&plan, &audit).await {
            Ok(()) => return Ok(plan),
            // Someone changed the project's quotas between our read and our
            // write: nothing was written; plan again from what is there now.
            Err(PortError::Fenced(_)) if attempt < ATTEMPTS => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// `PUT /v1/projects/{id}/quotas`: [`apply`] a document to the project of
/// the path (which the document, if it names one, must name), as the admin
/// API.
pub async fn apply_document(s: &AppState, project: &ProjectId, doc: Document, dry_run: bool) -> Result<QuotaPlan> {
    if doc.project_id.as_ref().is_some_and(|p| p != project.as_str()) {
        return Err(Error::invalid("project_id", "is not the project of the path"));
    }
    let plan = apply(&s.stores, s.clock.as_ref(), project, &doc.quotas, &admin_api(), dry_run).await?;
    if !dry_run && !plan.is_empty() {
        s.invalidate_project(project);
    }
    Ok(plan)
}
