//! Admission: may this caller make this call now?
//!
//! A check is one view round trip (plus, once after the view was lost, a
//! seed from the ledger, which the [`SeedingView`](crate::seeding::SeedingView)
//! does). The verdict is `meter`'s; what follows from it runs in the
//! background, off the caller's latency: the check's request event is
//! published to the log (with the breaches it found, which the fold turns
//! into `quota.exceeded` notifications and a monitor breach's audit entry),
//! and unpriced usage under a cost quota files its exception. A refusal is
//! [`Error::Refused`] with the breach the verdict reports.
//!
//! Three kinds of caller: an API key ([`admit`], what the tower Layer
//! runs), a signed-in user checked against a role's quota, and the
//! break-glass caller; [`check`] is `/v1/check`, which names any of them.
//! An exempt role's callers and the break-glass caller are admitted with
//! nothing checked or counted.
//!
//! **Permits** (`"permit": true`, for a caller with `max_concurrent`): the
//! slot is taken first (the caller's pool and the installation's, in one
//! step of the [`Permits`](meter::Permits) port), then the quotas are
//! checked and the reservation made in the view. A full pool answers
//! [`Error::TooManyConcurrent`] before the view is asked, so a refused slot
//! reserves nothing, counts no request and logs no request event; a
//! refused reservation (or a view refusing by policy, or any error after
//! the slot was taken) releases the slot before the answer, so a refused
//! reservation leaves no slot taken: both or neither. (Were the release
//! itself to fail, the slot lapses with its lease.) A permit store that
//! cannot be reached fails the check (503 `UNAVAILABLE`): a permit asked
//! for is never granted uncounted.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use meter::permit::{OwnCap, Whose};
use meter::{
    ApiKey, ApiKeyId, Breach, BreachKind, Caller, CheckInput, CheckOutcome, CheckPlan, Claimed, EventKind, Explained,
    Grants, Hold, Log, LoggedBreach, Permit, PermitClaim, Pool, PortError, ProjectId, Quota, ReservationId, Role,
    RoleId, UnpricedException, UsageFact, Verdict,
};
use tracing::warn;

use super::{Error, Refusal, Result};
use crate::state::{AppState, ViewDownPolicy, new_event_id, new_permit_id, new_reservation_id};

/// What the caller's headers report of its quotas (`X-Quota-Remaining-Calls`,
/// `X-Quota-Remaining-Rows`, `X-Quota-Reset`), admitted or refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Remaining {
    pub calls: Option<u64>,
    pub rows: Option<u64>,
    /// When the tightest calls or rows quota resets.
    pub reset: Option<DateTime<Utc>>,
}

impl From<&Verdict> for Remaining {
    fn from(v: &Verdict) -> Self {
        Remaining { calls: v.remaining_calls, rows: v.remaining_rows, reset: v.reset }
    }
}

/// An admitted check of an API key: the reservation to settle, the caller,
/// and what its quotas have left.
#[derive(Debug, Clone)]
pub struct Admission {
    pub reservation: ReservationId,
    /// The caller's key, as the configuration cache holds it (shared, not copied).
    pub key: Arc<ApiKey>,
    /// The limits that apply: the key's grants narrowed by its role's.
    pub limits: Grants,
    /// The bounds the call runs under: the server's, narrowed by `limits`.
    pub bounds: meter::Bounds,
    pub remaining: Remaining,
    /// True when the view was unreachable and policy let the call through.
    pub degraded: bool,
    /// An administrator's or break-glass caller: nothing was checked or
    /// counted, and the call must not be recorded.
    pub exempt: bool,
    /// Every limit the check evaluated, when it asked to be explained.
    pub explain: Option<Vec<Explained>>,
}

/// How a `/v1/check` names its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Who {
    /// The break-glass caller: never limited or counted (ADR-0011).
    BreakGlass,
    /// An API key, by its secret or its id.
    Key(KeyRef),
    /// A signed-in user (`user:<subject>`), checked against a role's quota.
    User { user: String, role: RoleId },
}

/// An API key as a check names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRef {
    Secret(String),
    Id(ApiKeyId),
}

/// A `/v1/check`, its fields parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckRequest {
    pub who: Who,
    /// The project the caller says it is in, if it says: it must be the
    /// key's (or the role's).
    pub project: Option<String>,
    pub agent: Option<String>,
    pub actor: Option<String>,
    /// The bytes the call will add to (or, negative, remove from) storage.
    pub storage_delta: Option<i64>,
    /// Take a concurrency permit with the reservation (see the module doc).
    pub permit: bool,
    /// Answer every limit the check evaluated.
    pub explain: bool,
    /// What the call is expected to use, reserved on the matching quotas.
    pub estimate: EstimateAsk,
}

/// The estimate a check names (see [`meter::Estimate`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum EstimateAsk {
    #[default]
    None,
    /// Billable tokens and picodollars, as given.
    Amounts(meter::Estimate),
    /// Token counts per model: the tokens counted and the cost priced by
    /// the price book at the check, as a `tokens` event's would be.
    Models(Vec<meter::TokenUsage>),
}

impl EstimateAsk {
    /// The amounts to reserve, pricing a per-model estimate by the book as
    /// it is at `at`.
    async fn resolve(&self, s: &AppState, at: DateTime<Utc>) -> Result<meter::Estimate> {
        Ok(match self {
            EstimateAsk::None => meter::Estimate::default(),
            EstimateAsk::Amounts(e) => *e,
            EstimateAsk::Models(models) => {
                let book = s.price_book().await?;
                let priced = meter::price::price_tokens(models, meter::MeterType::LlmTokens, at, &book);
                meter::Estimate { tokens: priced.tokens, cost: u64::try_from(priced.cost.picos()).unwrap_or(0) }
            }
        })
    }
}

/// What a `/v1/check` granted.
// Made once per check and taken apart by its handler at once: boxing the
// common variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// Never limited or counted: nothing to settle.
    Exempt,
    Admitted {
        reservation: ReservationId,
        /// The bounds the call runs under: the server's, narrowed by the
        /// caller's grants.
        bounds: meter::Bounds,
        remaining: Remaining,
        degraded: bool,
        /// The permit taken, if the check asked for one and the caller has
        /// `max_concurrent`.
        permit: Option<Permit>,
        /// Every limit it evaluated, when it asked to be explained.
        explain: Option<Vec<Explained>>,
    },
}

/// Who a check counts against.
#[derive(Debug, Clone)]
enum Subject {
    Key(Arc<ApiKey>),
    User { project: ProjectId, user: String },
}

/// What a check granted, whoever asked.
#[derive(Debug)]
struct Granted {
    reservation: ReservationId,
    remaining: Remaining,
    degraded: bool,
    exempt: bool,
    permit: Option<Permit>,
    /// Every limit the check evaluated, when it asked to be explained.
    explain: Option<Vec<Explained>>,
    /// The request event, when the check's caller publishes it
    /// ([`Context::hold_request`]).
    request: Option<RequestEvent>,
}

/// The parts of a check that are neither the caller nor its quotas.
#[derive(Debug, Clone, Default)]
struct Context {
    agent: Option<String>,
    actor: Option<String>,
    storage_delta: Option<i64>,
    /// The permit to take, when the check asked for one and the caller has
    /// a cap.
    permit: Option<PermitAsk>,
    /// Answer every limit the check evaluated (see [`meter::explain`]).
    explain: bool,
    /// What the call is expected to use.
    estimate: EstimateAsk,
    /// Hand an admitted check's request event to the caller
    /// ([`RequestEvent`]) instead of publishing it at once.
    hold_request: bool,
}

/// A permit a check is to take: the caller's cap (whose it is, and its
/// owner's id for the refusal) and the lease.
#[derive(Debug, Clone)]
struct PermitAsk {
    cap: OwnCap,
    /// The key's or the role's id, as the refusal names it.
    owner: String,
    lease: std::time::Duration,
}

impl PermitAsk {
    /// The permit a check asks for, if it asks and the caller has a cap:
    /// `key` is the caller's key (`None` for a signed-in user), `limits`
    /// the effective grants (the lease follows their `query_timeout`).
    fn of(s: &AppState, asked: bool, key: Option<&ApiKey>, role: Option<&Role>, limits: &Grants) -> Option<Self> {
        if !asked {
            return None;
        }
        let cap = meter::permit::own_cap(key.map(|k| &k.grants), role)?;
        let owner = match (cap.whose, key, role) {
            (Whose::ApiKey, Some(k), _) => k.id.to_string(),
            (_, _, Some(r)) => r.id.to_string(),
            (_, Some(k), None) => k.id.to_string(),
            (_, None, None) => return None,
        };
        Some(PermitAsk { cap, owner, lease: meter::permit::lease(limits.query_timeout, s.settings.query_timeout) })
    }
}

/// `/v1/check`: identifies the caller, then runs its check.
pub async fn check(s: &AppState, req: CheckRequest) -> Result<Checked> {
    let mut ctx = Context {
        agent: req.agent,
        actor: req.actor,
        storage_delta: req.storage_delta,
        permit: None,
        explain: req.explain,
        estimate: req.estimate,
        hold_request: false,
    };
    match req.who {
        Who::BreakGlass => {
            metrics::counter!("tollgate_exempt_checks_total").increment(1);
            metrics::counter!("tollgate_checks_total", "verdict" => "exempt").increment(1);
            Ok(Checked::Exempt)
        }
        Who::User { user, role } => {
            let role =
                s.role_by_id(&role).await?.ok_or_else(|| Error::invalid("role_id", format!("no role {role}")))?;
            if req.project.as_deref().is_some_and(|p| p != role.project_id.as_str()) {
                return Err(Error::invalid("project_id", "is not the role's project"));
            }
            let limits = role.grants.clone();
            ctx.permit = PermitAsk::of(s, req.permit, None, Some(&role), &limits);
            let subject = Subject::User { project: role.project_id.clone(), user };
            let g = admit_subject(s, subject, Some(role), ctx).await?;
            Ok(checked(g, s.settings.bounds().narrowed(&limits)))
        }
        Who::Key(key) => {
            let key = match key {
                KeyRef::Secret(secret) => s.key_by_secret(&secret).await?,
                KeyRef::Id(id) => s.key_by_id(&id).await?,
            }
            .ok_or(Error::Unauthenticated { message: "unknown api key".into(), field: Some("api_key") })?;
            if req.project.as_deref().is_some_and(|p| p != key.project_id.as_str()) {
                return Err(Error::invalid("project_id", "is not the api key's project"));
            }
            let (a, permit, request) = admit_key(s, key, ctx, req.permit).await?;
            let g = Granted {
                reservation: a.reservation,
                remaining: a.remaining,
                degraded: a.degraded,
                exempt: a.exempt,
                permit,
                explain: a.explain,
                request,
            };
            Ok(checked(g, a.bounds))
        }
    }
}

fn checked(g: Granted, bounds: meter::Bounds) -> Checked {
    if g.exempt {
        return Checked::Exempt;
    }
    Checked::Admitted {
        reservation: g.reservation,
        bounds,
        remaining: g.remaining,
        degraded: g.degraded,
        permit: g.permit,
        explain: g.explain,
    }
}

/// Runs one check for an API key (with its role, if it has one).
pub async fn admit(
    s: &AppState,
    key: Arc<ApiKey>,
    agent: Option<String>,
    actor: Option<String>,
    storage_delta: Option<i64>,
) -> Result<Admission> {
    let ctx = Context {
        agent,
        actor,
        storage_delta,
        permit: None,
        explain: false,
        estimate: EstimateAsk::None,
        hold_request: false,
    };
    admit_key(s, key, ctx, false).await.map(|(a, _, _)| a)
}

/// [`admit`], also taking a permit when the key (or its role) has a
/// `max_concurrent` cap: both or neither; and handing an admitted check's
/// request event back to the caller to publish ([`RequestEvent`]). What
/// the tower Layer runs.
pub async fn admit_holding(
    s: &AppState,
    key: Arc<ApiKey>,
    actor: Option<String>,
    explain: bool,
) -> Result<(Admission, Option<Permit>, Option<RequestEvent>)> {
    let ctx = Context {
        agent: None,
        actor,
        storage_delta: None,
        permit: None,
        explain,
        estimate: EstimateAsk::None,
        hold_request: true,
    };
    admit_key(s, key, ctx, true).await
}

/// Runs one check for an API key (with its role), taking a permit if
/// `permit` asks for one and the key has a cap.
async fn admit_key(
    s: &AppState,
    key: Arc<ApiKey>,
    mut ctx: Context,
    permit: bool,
) -> Result<(Admission, Option<Permit>, Option<RequestEvent>)> {
    let role = match &key.role_id {
        Some(r) => s.role_by_id(r).await?,
        None => None,
    };
    let limits = meter::role::effective_grants(&key.grants, role.as_deref());
    ctx.permit = PermitAsk::of(s, permit, Some(&key), role.as_deref(), &limits);
    let g = admit_subject(s, Subject::Key(key.clone()), role, ctx).await?;
    let admission = Admission {
        reservation: g.reservation,
        key,
        bounds: s.settings.bounds().narrowed(&limits),
        limits,
        remaining: g.remaining,
        degraded: g.degraded,
        exempt: g.exempt,
        explain: g.explain,
    };
    Ok((admission, g.permit, g.request))
}

/// Runs one check: one view round trip, the verdict, and the request event
/// published in the background. A refusal is [`Error::Refused`], or
/// [`Error::ViewUnavailable`] by the view-down policy.
async fn admit_subject(s: &AppState, subject: Subject, role: Option<Arc<Role>>, ctx: Context) -> Result<Granted> {
    let started = std::time::Instant::now();
    let result = admit_subject_timed(s, subject, role, ctx).await;
    metrics::histogram!("tollgate_check_seconds").record(started.elapsed().as_secs_f64());
    let verdict = match &result {
        Ok(g) if g.exempt => "exempt",
        Ok(g) if g.degraded => "degraded",
        Ok(_) => "admitted",
        Err(Error::Refused(_) | Error::TooManyConcurrent { .. }) => "refused",
        Err(Error::ViewUnavailable) => "unavailable",
        Err(_) => "error",
    };
    metrics::counter!("tollgate_checks_total", "verdict" => verdict).increment(1);
    result
}

async fn admit_subject_timed(s: &AppState, subject: Subject, role: Option<Arc<Role>>, ctx: Context) -> Result<Granted> {
    if role.as_ref().is_some_and(|r| r.exempt) {
        metrics::counter!("tollgate_exempt_checks_total").increment(1);
        return Ok(Granted {
            reservation: new_reservation_id(),
            remaining: Remaining::default(),
            degraded: false,
            exempt: true,
            permit: None,
            explain: None,
            request: None,
        });
    }
    let (project, caller) = match &subject {
        Subject::Key(k) => (
            &k.project_id,
            Caller { api_key: Some(k.id.clone()), agent: ctx.agent.clone(), actor: ctx.actor.clone(), user: None },
        ),
        Subject::User { project, user } => (
            project,
            Caller { api_key: None, agent: ctx.agent.clone(), actor: ctx.actor.clone(), user: Some(user.clone()) },
        ),
    };
    let cfg = s
        .project_config(project)
        .await?
        .ok_or_else(|| Error::unauthenticated("the caller's project no longer exists"))?;
    // The project's quotas as the cache holds them (borrowed: no count of
    // a shared `Arc` per check), with a role's own quota added to a copy.
    let with_role: Option<Vec<Quota>> = match &role {
        Some(r) if r.quota.is_some() => {
            let mut q = (*cfg.quotas).clone();
            q.extend(meter::role::role_quotas(r, &caller));
            Some(q)
        }
        _ => None,
    };
    let quotas: &[Quota] = with_role.as_deref().unwrap_or(&cfg.quotas);
    let now = s.clock.now();
    let estimate = ctx.estimate.resolve(s, now).await?;
    // The slot first: a full pool refuses before anything is reserved or counted.
    let permit = match &ctx.permit {
        Some(ask) => Some(take_permit(s, project, &caller, ask, now).await?),
        None => None,
    };
    let input = CheckInput { caller, storage_delta: ctx.storage_delta, estimate };
    let plan = meter::plan_check(quotas, cfg.project.timezone, &input, now);
    // The caller goes on into the request event, not copied.
    let result = reserve(s, input.caller, quotas, project, &plan, &ctx, now).await;
    match (result, permit) {
        (Ok(g), permit) => Ok(Granted { permit, ..g }),
        (Err(e), Some(p)) => {
            // Both or neither: the reservation was refused, so the slot goes back.
            if let Err(re) = s.permits.release(&p.id, now).await {
                warn!(error = %re, permit = %p.id, "permit of a refused check not released; it lapses with its lease");
            }
            Err(e)
        }
        (Err(e), None) => Err(e),
    }
}

/// Takes the caller's slot and the installation's, or answers whose pool is full.
async fn take_permit(
    s: &AppState,
    project: &ProjectId,
    caller: &Caller,
    ask: &PermitAsk,
    now: DateTime<Utc>,
) -> Result<Permit> {
    let holder = meter::permit::holder(project, caller)
        .ok_or_else(|| Error::invalid("permit", "a permit needs an api key or a signed-in user"))?;
    let claim = PermitClaim {
        id: new_permit_id(),
        holder,
        cap: ask.cap.limit,
        installation_cap: s.settings.installation_permits,
        lease: ask.lease,
    };
    match s.permits.claim(&claim, now).await? {
        Claimed::Granted(p) => {
            metrics::counter!("tollgate_permits_granted_total").increment(1);
            Ok(p)
        }
        Claimed::Full(pool) => {
            let (limit, whose, owner) = match pool {
                Pool::Caller => (ask.cap.limit, ask.cap.whose, Some(ask.owner.clone())),
                Pool::Installation => (s.settings.installation_permits, Whose::Installation, None),
            };
            metrics::counter!("tollgate_permits_refused_total", "whose" => whose.as_str()).increment(1);
            Err(Error::TooManyConcurrent { limit, whose, owner })
        }
    }
}

/// The quotas' part of a check: the view's round trip, the verdict, and
/// what follows from it (the request event, monitor breaches, exceptions).
async fn reserve(
    s: &AppState,
    caller: Caller,
    quotas: &[Quota],
    project: &ProjectId,
    plan: &CheckPlan,
    ctx: &Context,
    now: DateTime<Utc>,
) -> Result<Granted> {
    let hold = Hold {
        reservation: new_reservation_id(),
        request_event: new_event_id("req"),
        lease_until: now + chrono::Duration::from_std(s.settings.lease).unwrap_or(chrono::Duration::seconds(60)),
    };
    let outcome = observe(s, project, plan, &hold, now).await?;
    let verdict = outcome.as_ref().map(|o| meter::decide(quotas, plan, o, now));
    // Every check's request event is on the log, so a view rebuilt from it
    // holds the check's reservation again. Requests are key-authenticated
    // traffic only: a signed-in user's (no api key) counts no request.
    let logged = logged_request(quotas, plan, outcome.as_ref(), verdict.as_ref(), &hold);
    let Caller { api_key: key, user, agent, actor } = caller;
    let asker = Asker { project: project.clone(), key, user, agent, actor };
    let fact = request_fact(s, asker, &hold, logged, now);
    let admitted = verdict.as_ref().is_none_or(|v| v.breach.is_none());
    let request = if ctx.hold_request && admitted {
        Some(RequestEvent { fact: Some(fact), log: s.log.clone() })
    } else {
        // A refused check's event goes at once: there is no call to wait for.
        send_request(&s.log, fact);
        None
    };
    let (Some(outcome), Some(verdict)) = (outcome, verdict) else {
        return Ok(Granted {
            reservation: hold.reservation,
            remaining: Remaining::default(),
            degraded: true,
            exempt: false,
            permit: None,
            // Nothing was evaluated: the view was not reached.
            explain: ctx.explain.then(Vec::new),
            request,
        });
    };
    let explain = ctx.explain.then(|| meter::explain(quotas, plan, &outcome, &verdict));
    if !verdict.monitor_breaches.is_empty() {
        // Audited (and notified) by the fold, from the request event's
        // breaches: one source for every gateway (DESIGN §2.11).
        let n = u64::try_from(verdict.monitor_breaches.len()).unwrap_or(u64::MAX);
        metrics::counter!("tollgate_monitor_breaches_total").increment(n);
    }
    if !verdict.unpriced.is_empty() {
        file_exceptions(s, project, quotas, &verdict.unpriced, now);
    }
    let remaining = Remaining::from(&verdict);
    match verdict.breach {
        None => Ok(Granted {
            reservation: hold.reservation,
            remaining,
            degraded: false,
            exempt: false,
            permit: None,
            explain,
            request,
        }),
        Some(breach) => {
            metrics::counter!("tollgate_check_refusals_total", "metric" => breach.metric.as_str()).increment(1);
            let refused = refusal(s, project.clone(), breach, remaining).await;
            Err(match explain {
                Some(explain) => Error::Explained { error: Box::new(refused), explain },
                None => refused,
            })
        }
    }
}

/// Runs the plan on the view: its outcome, or `None` when the view is
/// unreachable and policy admits the call uncounted (refused by the other
/// policy). A plan with no limits needs no view at all.
async fn observe(
    s: &AppState,
    project: &ProjectId,
    plan: &CheckPlan,
    hold: &Hold,
    now: DateTime<Utc>,
) -> Result<Option<CheckOutcome>> {
    use meter::View;
    if plan.limits.is_empty() {
        return Ok(Some(CheckOutcome::of(true, Vec::new())));
    }
    let observed = s
        .view
        .check(project, plan, hold, now)
        .await
        .and_then(|o| o.ok_or_else(|| PortError::Transient("view not seeded after seeding".into())));
    match observed {
        Ok(o) => Ok(Some(o)),
        Err(e) => {
            warn!(error = %e, "view unreachable during check");
            metrics::counter!("tollgate_view_unavailable_total", "policy" => match s.settings.view_down {
                ViewDownPolicy::Allow => "allow",
                ViewDownPolicy::Deny => "deny",
            })
            .increment(1);
            match s.settings.view_down {
                ViewDownPolicy::Deny => Err(Error::ViewUnavailable),
                ViewDownPolicy::Allow => Ok(None),
            }
        }
    }
}

/// The refusal of a breach. A pricing blackout names the unpriced rows,
/// which were written to the store before their events were acknowledged,
/// so a blackout the view sees has its rows there.
async fn refusal(s: &AppState, project: ProjectId, breach: Breach, remaining: Remaining) -> Error {
    let unpriced_rows = if breach.kind == BreachKind::Unenforceable {
        match s.stores.prices.unpriced_rows(&project, &breach.counter, meter::price::MAX_UNPRICED_ROWS).await {
            Ok(rows) => rows,
            Err(e) => {
                warn!(error = %e, "unpriced rows unavailable for a QUOTA_UNENFORCEABLE body");
                Vec::new()
            }
        }
    } else {
        Vec::new()
    };
    Error::Refused(Box::new(Refusal { project, breach, remaining, unpriced_rows }))
}

/// Files (or counts again) the `quota_unpriced` exception of each cost
/// quota whose window held unpriced AI usage, in the background.
fn file_exceptions(
    s: &AppState,
    project: &ProjectId,
    quotas: &[Quota],
    found: &[meter::UnpricedFinding],
    now: DateTime<Utc>,
) {
    for f in found {
        let Some(q) = quotas.get(f.quota) else { continue };
        let prices = s.stores.prices.clone();
        let (project, f, limit) = (project.clone(), f.clone(), q.spec.limit);
        tokio::spawn(async move {
            let rows = match prices.unpriced_rows(&project, &f.counter, meter::price::MAX_UNPRICED_ROWS).await {
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
            if let Err(e) = prices.file_exception(&exception).await {
                warn!(error = %e, quota = %f.quota_id, "quota_unpriced exception not filed");
            }
        });
    }
}

/// What a check's request event records of its outcome: whether it was
/// admitted, and if so its lease and the counters its reservation holds (so
/// a reseed of a lost view can hold it again from the log); and the quotas
/// it found over their limit. Admitted uncounted (the view down, policy
/// allow): admitted, holding nothing.
#[derive(Debug, Clone, Default)]
struct LoggedRequest {
    admitted: bool,
    lease_until: Option<DateTime<Utc>>,
    held: Vec<meter::Counter>,
    /// What the reservation holds on each of them besides one call.
    estimate: meter::Estimate,
    breaches: Vec<LoggedBreach>,
}

fn logged_request(
    quotas: &[Quota],
    plan: &CheckPlan,
    outcome: Option<&CheckOutcome>,
    verdict: Option<&Verdict>,
    hold: &Hold,
) -> LoggedRequest {
    let (Some(outcome), Some(verdict)) = (outcome, verdict) else {
        return LoggedRequest { admitted: true, ..LoggedRequest::default() };
    };
    let mut breaches = Vec::new();
    if let Some(b) = &verdict.breach {
        breaches.push(LoggedBreach {
            quota_id: b.quota_id.clone(),
            window_key: b.counter.window_key.clone(),
            limit: b.limit,
            observed: b.used,
            enforce: true,
        });
    }
    if !verdict.monitor_breaches.is_empty() {
        breaches.extend(meter::audit::monitor_breaches(quotas, plan, outcome).into_iter().map(|m| LoggedBreach {
            quota_id: m.quota_id,
            window_key: m.window_key,
            limit: m.limit,
            observed: m.observed_value,
            enforce: false,
        }));
    }
    // The view reserves exactly when the plan admits (meter and the script agree).
    let admitted = outcome.admitted && verdict.admitted();
    LoggedRequest {
        admitted,
        lease_until: admitted.then_some(hold.lease_until),
        held: if admitted {
            plan.reserved_counters().into_iter().filter_map(|i| plan.counters.get(i).cloned()).collect()
        } else {
            Vec::new()
        },
        estimate: if admitted { plan.estimate } else { meter::Estimate::default() },
        breaches,
    }
}

/// Who a request event is of.
struct Asker {
    project: ProjectId,
    key: Option<meter::ApiKeyId>,
    /// A signed-in user (`user:<subject>`), checked without a key.
    user: Option<String>,
    agent: Option<String>,
    actor: Option<String>,
}

/// The check's request event: the reservation it opened (with its lease and
/// the counters it holds) or its refusal, and the breaches it found.
fn request_fact(s: &AppState, asker: Asker, hold: &Hold, logged: LoggedRequest, now: DateTime<Utc>) -> UsageFact {
    UsageFact {
        api_key_id: asker.key,
        user_id: asker.user,
        agent_id: asker.agent,
        actor_id: asker.actor,
        reservation_id: Some(hold.reservation.clone()),
        gateway: s.settings.instance.clone(),
        received_at: Some(now),
        admitted: Some(logged.admitted),
        lease_until: logged.lease_until,
        held: logged.held,
        estimate: logged.estimate,
        breaches: logged.breaches,
        ..UsageFact::new(hold.request_event.clone(), asker.project, EventKind::Request, now)
    }
}

/// Publishes a check's request event in the background: handed to the
/// log's queue ([`meter::Log::queue`]), or published in a task of its own
/// by a log without one. It is never taken back: if the log does not
/// acknowledge it, it stays in the log's retry queue (and its request stays
/// counted in the view); only a full queue loses it from the log, counted
/// in `tollgate_request_events_unacknowledged_total` (with a log without a
/// queue, also a publish that was not acknowledged in time), and then its
/// pending count over-counts until the window ends.
fn send_request(log: &Arc<dyn Log>, fact: UsageFact) {
    // Handed to the log's queue where it has one (no task of our own).
    match log.queue(std::slice::from_ref(&fact)) {
        Some(Ok(())) => {}
        Some(Err(e)) => request_unacknowledged(&e),
        None => {
            let Ok(rt) = tokio::runtime::Handle::try_current() else {
                request_unacknowledged(&PortError::Transient("no tokio runtime to publish on".into()));
                return;
            };
            let log = log.clone();
            rt.spawn(async move {
                if let Err(e) = log.publish(std::slice::from_ref(&fact)).await {
                    request_unacknowledged(&e);
                }
            });
        }
    }
}

/// Counts (and logs) a request event the log has not acknowledged yet.
fn request_unacknowledged(e: &PortError) {
    warn!(error = %e, "request event not acknowledged yet (queued unless the queue was full)");
    metrics::counter!("tollgate_request_events_unacknowledged_total").increment(1);
}

/// An admitted check's request event, handed to the caller of
/// [`admit_holding`] to publish: [`RequestEvent::send`] sends it on its
/// own, as a check does; [`RequestEvent::take`] gives the fact to publish
/// with the call's own event, in one publish (what the tower Layer does
/// when its service answers at once: one append and one commit per call
/// instead of two). Dropped unsent, it is sent then, so no path (an error,
/// a panic, a dropped future) loses it. The reservation it names is in the
/// view already.
#[must_use = "a request event not sent goes when it is dropped"]
pub struct RequestEvent {
    fact: Option<UsageFact>,
    log: Arc<dyn Log>,
}

impl RequestEvent {
    /// Publishes it in the background now, as a check does.
    pub fn send(mut self) {
        if let Some(fact) = self.fact.take() {
            send_request(&self.log, fact);
        }
    }

    /// The event, to publish with others: its publish is the taker's now.
    pub fn take(mut self) -> UsageFact {
        // Only `send`, `take` and `drop` empty it, and each consumes `self`.
        self.fact.take().expect("a request event not yet sent")
    }
}

impl std::fmt::Debug for RequestEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestEvent").field("event", &self.fact.as_ref().map(|f| &f.id)).finish_non_exhaustive()
    }
}

impl Drop for RequestEvent {
    fn drop(&mut self) {
        if let Some(fact) = self.fact.take() {
            send_request(&self.log, fact);
        }
    }
}
