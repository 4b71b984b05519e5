//! The admission verdict.
//!
//! A check is planned here (which counters, which limits, what each needs),
//! executed atomically by the view (one Redis script, or one lock in memory),
//! and decided here from what the view observed. The view's only rule is the
//! all-or-nothing one: it reserves on every counter of the plan or on none,
//! and refuses when any enforce limit has `used + need > limit`.
//!
//! Exactness: for `requests` the request is counted before the comparison
//! (`need = 0`), for `calls` a slot is reserved (`need = 1`), so admitted
//! calls never exceed the limit at any concurrency. `rows` are known only
//! after the call: a call is admitted while `used < limit` and may overshoot
//! by the rows of the calls in flight.
//!
//! Tokens and cost: without an [`Estimate`] a call is admitted while
//! `used < limit` (`need = 1`), so concurrent generations may overshoot by
//! the tokens (or cost) of every generation in flight, one per admitted
//! check. A check that names an estimate reserves it on the matching
//! enforce `tokens` / `cost_usd` quotas exactly as a call reserves on
//! `calls` (`need` = the estimate, held on the counter with the lease): the
//! overshoot is then bounded by the error of the estimates, not by their
//! number. The settle replaces the estimate with the actual usage; a lease
//! that lapses frees it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use crate::ids::{ApiKeyId, QuotaId};
use crate::price::{BLACKOUT_EVENTS, MeterType};
use crate::quota::{Metric, Mode, OnUnpriced, Quota, Scope};
use crate::usage::{Counter, CounterKey, Dimension, Field};
use crate::window::{Window, WindowKind, window_at};

/// How a planned limit reads its counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// `used` = the sum of `fields`; refuses when `used + need > limit`.
    Cap,
    /// A pricing blackout: `used` = the window's LLM events when none of
    /// them is priced, else 0; planned with `need` 1 and `limit` 3, so it
    /// refuses once three LLM events are in and nothing is priced.
    Blackout,
    /// Read only, never refuses: what the check found, for exceptions.
    Probe,
}

/// One limit the view must compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedLimit {
    /// Index into the quotas the plan was made from.
    pub quota: usize,
    /// Index into [`CheckPlan::counters`].
    pub counter: usize,
    pub metric: Metric,
    pub kind: LimitKind,
    /// The counter fields summed into `used` (with live reservations when
    /// `calls` is among them).
    pub fields: Cow<'static, [Field]>,
    pub limit: u64,
    /// What this check adds before comparing: refuse when `used + need > limit`.
    pub need: u64,
    /// Only enforce limits can refuse.
    pub enforce: bool,
    /// Whether an admitted check holds its reservation on this counter
    /// until settled: one call, and the plan's [`Estimate`] (if any).
    pub reserve: bool,
}

/// What a call is expected to use, named by its check: `tokens` (billable
/// tokens) and `cost` (picodollars on the `llm_tokens` meter). Zero means
/// "not estimated".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Estimate {
    pub tokens: u64,
    pub cost: u64,
}

impl Estimate {
    pub fn is_zero(&self) -> bool {
        self.tokens == 0 && self.cost == 0
    }

    /// The estimate as counter amounts: what a reservation holding it adds
    /// to a limit reading these fields.
    pub fn totals(&self) -> crate::usage::Totals {
        crate::usage::Totals { tokens: self.tokens, cost_llm_tokens: self.cost, ..Default::default() }
    }

    /// What the estimate adds to a limit summing `fields`.
    pub fn on(&self, fields: &[Field]) -> u64 {
        fields.iter().fold(0u64, |acc, f| {
            acc.saturating_add(match f {
                Field::Tokens => self.tokens,
                Field::CostLlmTokens => self.cost,
                _ => 0,
            })
        })
    }
}

/// Everything the view needs to run one check.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CheckPlan {
    pub counters: Vec<Counter>,
    pub limits: Vec<PlannedLimit>,
    /// Counters that count this request (before comparing).
    pub count_request: Vec<usize>,
    /// The window of each counter (same order as `counters`): when it
    /// resets. A limit's is [`CheckPlan::window_of`].
    pub windows: Vec<Window>,
    /// What an admitted check's reservation holds on each of its counters
    /// besides one call (zero when nothing reserves it).
    pub estimate: Estimate,
}

impl CheckPlan {
    /// Counters this check reserves on when admitted.
    pub fn reserved_counters(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.limits.iter().filter(|l| l.reserve).map(|l| l.counter).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether this check reserves on counter `counter` when admitted (one
    /// of [`CheckPlan::reserved_counters`], without building the list).
    pub fn reserves(&self, counter: usize) -> bool {
        self.limits.iter().any(|l| l.reserve && l.counter == counter)
    }

    /// The window of limit `li` (its counter's).
    pub fn window_of(&self, li: usize) -> Option<&Window> {
        self.windows.get(self.limits.get(li)?.counter)
    }
}

/// What the view observed: whether it admitted, and each limit's usage
/// (durable + settled + reserved, before this check's own reservation, after
/// this request was counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    pub admitted: bool,
    pub used: Vec<u64>,
    /// How each limit's usage splits (same order as `used`): what
    /// [`explain`] answers. Empty from a view that does not split it.
    pub parts: Vec<UsageParts>,
}

impl CheckOutcome {
    /// An outcome with its usage unsplit.
    pub fn of(admitted: bool, used: Vec<u64>) -> CheckOutcome {
        CheckOutcome { admitted, used, parts: Vec::new() }
    }
}

/// One limit's usage as the view read it, in the same step as its verdict:
/// `durable` the folded totals of its fields (each at least 0), `settled`
/// what settled but unfolded facts add to them (negative when a correction
/// takes some back), `reserved` what the live reservations of other checks
/// hold on its fields: one call each (a limit on `calls`), and their
/// [`Estimate`]s (a limit on `tokens` or `cost_usd`). A cap's `used` is `durable + settled + reserved`
/// (each field at least 0); a blackout's is its LLM events when none is
/// priced, else 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageParts {
    pub durable: u64,
    pub settled: i64,
    pub reserved: u64,
}

/// Who is asking, as the gateway identified them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    pub api_key: Option<ApiKeyId>,
    pub agent: Option<String>,
    pub actor: Option<String>,
    /// A signed-in user (`user:<subject>`).
    pub user: Option<String>,
}

impl Caller {
    pub fn key(api_key: &ApiKeyId, actor: Option<&str>) -> Caller {
        Caller { api_key: Some(api_key.clone()), actor: actor.map(str::to_owned), ..Caller::default() }
    }
}

/// The dimension a quota counts for this caller, if it applies at all.
pub fn dimension_for(quota: &Quota, caller: &Caller) -> Option<Dimension> {
    let s = &quota.spec;
    match (s.scope, s.scope_ref.as_deref()) {
        (Scope::Project, _) => Some(Dimension::Project),
        (Scope::ApiKey, None) => caller.api_key.as_ref().map(|_| Dimension::AllApiKeys),
        (Scope::ApiKey, Some(r)) => {
            caller.api_key.as_ref().filter(|k| k.as_str() == r).map(|k| Dimension::ApiKey(k.clone()))
        }
        // A null agent ref is the whole project.
        (Scope::Agent, None) => Some(Dimension::Project),
        (Scope::Agent, Some(r)) => (caller.agent.as_deref() == Some(r)).then(|| Dimension::Agent(r.to_owned())),
        (Scope::User, Some(r)) => (caller.user.as_deref() == Some(r)).then(|| Dimension::User(r.to_owned())),
        (Scope::User, None) => None,
        (Scope::Actor, None) => caller.actor.as_ref().map(|a| Dimension::Actor(a.clone())),
        (Scope::Actor, Some(r)) => (caller.actor.as_deref() == Some(r)).then(|| Dimension::Actor(r.to_owned())),
    }
}

/// The counters a project's checks can read: those of its quotas, plus each
/// key's and signed-in user's `day` and `calendar_month` counters (a role's
/// quota lands there, and a key's `usage_this_period` reads them).
///
/// Why: the gateway settles a fact into the view only on these counters, so
/// a call event costs the view two to a few counter updates instead of
/// fifteen. Every counter still gets its durable total when the projector
/// folds the event; a counter outside this set lags the settle by that fold
/// (normally well under a second). The one case it matters: a quota created
/// while events are in flight counts those events once they are folded,
/// not from their settle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Watched {
    /// By dimension, so that a lookup borrows the dimension it is given.
    exact: std::collections::BTreeMap<Dimension, std::collections::BTreeSet<WindowKind>>,
    all_keys: std::collections::BTreeSet<WindowKind>,
    any_actor: std::collections::BTreeSet<WindowKind>,
}

impl Watched {
    pub fn of(quotas: &[Quota]) -> Watched {
        let mut w = Watched::default();
        for q in quotas {
            let win = q.spec.window;
            match (q.spec.scope, q.spec.scope_ref.as_deref()) {
                (Scope::Project, _) | (Scope::Agent, None) => {
                    w.exact.entry(Dimension::Project).or_default().insert(win);
                }
                (Scope::ApiKey, None) => {
                    w.all_keys.insert(win);
                }
                (Scope::ApiKey, Some(r)) => {
                    if let Ok(k) = ApiKeyId::parse(r) {
                        w.exact.entry(Dimension::ApiKey(k)).or_default().insert(win);
                    }
                }
                (Scope::Agent, Some(r)) => {
                    w.exact.entry(Dimension::Agent(r.to_owned())).or_default().insert(win);
                }
                (Scope::Actor, None) => {
                    w.any_actor.insert(win);
                }
                (Scope::Actor, Some(r)) => {
                    w.exact.entry(Dimension::Actor(r.to_owned())).or_default().insert(win);
                }
                (Scope::User, Some(r)) => {
                    w.exact.entry(Dimension::User(r.to_owned())).or_default().insert(win);
                }
                (Scope::User, None) => {}
            }
        }
        w
    }

    /// Whether a check (or a key's detail) can read this counter.
    pub fn covers(&self, key: &CounterKey) -> bool {
        self.covers_parts(&key.dimension, key.window)
    }

    /// [`Watched::covers`] of a counter given by its dimension and window.
    pub fn covers_parts(&self, dimension: &Dimension, window: WindowKind) -> bool {
        let own = matches!(window, WindowKind::Day | WindowKind::CalendarMonth);
        match dimension {
            Dimension::ApiKey(_) | Dimension::User(_) if own => true,
            Dimension::AllApiKeys => self.all_keys.contains(&window),
            Dimension::Actor(_) if self.any_actor.contains(&window) => true,
            d => self.exact.get(d).is_some_and(|w| w.contains(&window)),
        }
    }
}

/// What one check is: who asks, when, and the bytes the write adds (storage
/// quotas apply only to a write that adds bytes; deletes are never refused).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckInput {
    pub caller: Caller,
    pub storage_delta: Option<i64>,
    /// What the call is expected to use, reserved on the matching quotas.
    pub estimate: Estimate,
}

/// The counter fields a quota's usage sums (as the check reads them, and
/// as the fold's alerts judge it).
pub fn quota_fields(q: &Quota) -> &'static [Field] {
    match q.spec.metric {
        Metric::Requests => &[Field::Requests],
        Metric::Calls => &[Field::Calls],
        Metric::Rows => &[Field::Rows],
        Metric::Tokens => &[Field::Tokens],
        Metric::CostUsd => match q.spec.meter() {
            Some(MeterType::LlmTokens) => &[Field::CostLlmTokens],
            Some(MeterType::ComputeExecution) => &[Field::CostComputeExecution],
            Some(MeterType::ApiRequest) => &[Field::CostApiRequest],
            Some(MeterType::Storage) => &[Field::CostStorage],
            None => &Field::COSTS,
        },
        Metric::StorageBytes => &[Field::Storage],
    }
}

/// Plans a check of `quotas` (the project's) for one caller at `at`.
pub fn plan_check(quotas: &[Quota], tz: Tz, input: &CheckInput, at: DateTime<Utc>) -> CheckPlan {
    let caller = &input.caller;
    let mut plan = CheckPlan::default();
    for (qi, q) in quotas.iter().enumerate() {
        let metric = q.spec.metric;
        // Requests are key-authenticated traffic only.
        if metric == Metric::Requests && caller.api_key.is_none() {
            continue;
        }
        let fields = quota_fields(q);
        let estimated = match metric {
            Metric::Tokens | Metric::CostUsd => input.estimate.on(fields),
            _ => 0,
        };
        let need = match metric {
            Metric::StorageBytes => match input.storage_delta {
                Some(d) if d > 0 => d as u64,
                _ => continue,
            },
            Metric::Requests => 0,
            _ if estimated > 0 => estimated,
            _ => 1,
        };
        let Some(dimension) = dimension_for(q, caller) else {
            continue;
        };
        // A plan has a few counters: a scan finds one faster than a map.
        let kind = q.spec.window;
        let counter = match plan.counters.iter().position(|c| c.key.window == kind && c.key.dimension == dimension) {
            Some(i) => i,
            None => {
                let window = window_at(kind, tz, at);
                let key = CounterKey { dimension, window: window.kind, window_key: window.key.clone() };
                plan.counters.push(Counter { key, resets_at: window.resets_at });
                plan.windows.push(window);
                plan.counters.len() - 1
            }
        };
        let enforce = q.spec.mode == Mode::Enforce;
        if metric == Metric::Requests && !plan.count_request.contains(&counter) {
            plan.count_request.push(counter);
        }
        let mut push = |kind, fields, limit, need, enforce, reserve| {
            plan.limits.push(PlannedLimit { quota: qi, counter, metric, kind, fields, limit, need, enforce, reserve });
        };
        let reserve = enforce && (metric == Metric::Calls || estimated > 0);
        push(LimitKind::Cap, Cow::Borrowed(fields), q.spec.limit, need, enforce, reserve);
        // The unpriced verdict reads the AI meter: a quota naming a
        // platform meter has none.
        if metric == Metric::CostUsd && matches!(q.spec.meter(), None | Some(MeterType::LlmTokens)) {
            let blocks = enforce && q.spec.on_unpriced.unwrap_or(OnUnpriced::Block) == OnUnpriced::Block;
            if blocks {
                push(LimitKind::Blackout, Cow::Borrowed(&[Field::LlmEvents]), BLACKOUT_EVENTS, 1, true, false);
            }
            push(LimitKind::Probe, Cow::Borrowed(&[Field::LlmUnpriced]), 0, 0, false, false);
            push(LimitKind::Probe, Cow::Borrowed(&[Field::LlmEvents]), 0, 0, false, false);
        }
    }
    if plan.limits.iter().any(|l| l.reserve && matches!(l.metric, Metric::Tokens | Metric::CostUsd)) {
        plan.estimate = input.estimate;
    }
    plan
}

/// Why a check was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreachKind {
    /// 429 `QUOTA_EXCEEDED`, with `Retry-After`.
    Exceeded,
    /// 409 `QUOTA_STORAGE_EXCEEDED`: waiting is no remedy.
    Storage,
    /// 409 `QUOTA_UNENFORCEABLE`: a cost cap over a pricing blackout.
    Unenforceable,
}

/// The quota that refused a check, as reported to the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breach {
    pub kind: BreachKind,
    pub quota_id: QuotaId,
    /// Index into the quotas the plan was made from.
    pub quota: usize,
    pub scope: Scope,
    pub scope_ref: Option<String>,
    pub metric: Metric,
    pub limit: u64,
    pub used: u64,
    pub window: WindowKind,
    /// The counter it was read from (for the unpriced rows of a blackout).
    pub counter: CounterKey,
    pub resets_at: Option<DateTime<Utc>>,
    pub retry_after_secs: Option<u64>,
}

/// Unpriced usage a `cost_usd` check found in its window: one
/// `quota_unpriced` exception to file (or count again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpricedFinding {
    pub quota: usize,
    pub quota_id: QuotaId,
    pub counter: CounterKey,
    pub llm_events: u64,
    pub unpriced_events: u64,
}

/// The decision on one check, with what the caller's headers report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// `None` when admitted.
    pub breach: Option<Breach>,
    pub remaining_calls: Option<u64>,
    pub remaining_rows: Option<u64>,
    /// When the tightest calls/rows quota resets.
    pub reset: Option<DateTime<Utc>>,
    /// Monitor quotas this check found over their limit.
    pub monitor_breaches: Vec<QuotaId>,
    /// Cost quotas whose window holds unpriced AI usage.
    pub unpriced: Vec<UnpricedFinding>,
    /// The limit (index into the plan's) the refusal reports.
    pub reported: Option<usize>,
}

impl Verdict {
    pub fn admitted(&self) -> bool {
        self.breach.is_none()
    }
}

/// Decides from the view's observation. Every enforce breach refuses; the
/// most specific scope (actor > agent > api_key > project) is reported, and
/// among equals the one whose window resets last (waiting less would not help).
pub fn decide(quotas: &[Quota], plan: &CheckPlan, outcome: &CheckOutcome, at: DateTime<Utc>) -> Verdict {
    let mut breach: Option<(usize, &PlannedLimit)> = None;
    let mut monitor_breaches = Vec::new();
    let mut unpriced: Vec<UnpricedFinding> = Vec::new();
    let mut remaining: BTreeMap<Metric, (u64, Option<DateTime<Utc>>)> = BTreeMap::new();
    let resets = |li: usize| plan.window_of(li).and_then(|w| w.resets_at);
    for (li, l) in plan.limits.iter().enumerate() {
        let used = outcome.used.get(li).copied().unwrap_or(0);
        let q = &quotas[l.quota];
        if l.kind == LimitKind::Probe {
            match l.fields.first() {
                Some(Field::LlmUnpriced) if used > 0 => unpriced.push(UnpricedFinding {
                    quota: l.quota,
                    quota_id: q.id.clone(),
                    counter: plan.counters[l.counter].key.clone(),
                    llm_events: 0,
                    unpriced_events: used,
                }),
                Some(Field::LlmEvents) => {
                    if let Some(f) = unpriced.iter_mut().find(|f| f.quota == l.quota) {
                        f.llm_events = used;
                    }
                }
                _ => {}
            }
            continue;
        }
        let over = used.saturating_add(l.need) > l.limit;
        if over && !l.enforce && l.kind == LimitKind::Cap && !monitor_breaches.contains(&q.id) {
            monitor_breaches.push(q.id.clone());
        }
        if over && l.enforce {
            let better = match breach {
                None => true,
                Some((bi, b)) => {
                    let bq = &quotas[b.quota];
                    (q.spec.scope, resets(li)) > (bq.spec.scope, resets(bi))
                }
            };
            if better {
                breach = Some((li, l));
            }
        }
        if l.enforce && l.kind == LimitKind::Cap && matches!(l.metric, Metric::Calls | Metric::Rows) {
            let held = u64::from(outcome.admitted && l.reserve);
            let left = l.limit.saturating_sub(used.saturating_add(held));
            let entry = remaining.entry(l.metric).or_insert((u64::MAX, None));
            if left < entry.0 {
                *entry = (left, resets(li));
            }
        }
    }
    let reported = breach.map(|(li, _)| li);
    let breach = breach.map(|(li, l)| {
        let q = &quotas[l.quota];
        let w = &plan.windows[l.counter];
        let kind = match (l.kind, l.metric) {
            (LimitKind::Blackout, _) => BreachKind::Unenforceable,
            (_, Metric::StorageBytes) => BreachKind::Storage,
            _ => BreachKind::Exceeded,
        };
        Breach {
            kind,
            quota_id: q.id.clone(),
            quota: l.quota,
            scope: q.spec.scope,
            scope_ref: q.spec.scope_ref.clone(),
            metric: l.metric,
            limit: q.spec.limit,
            used: outcome.used.get(li).copied().unwrap_or(0),
            window: w.kind,
            counter: plan.counters[l.counter].key.clone(),
            resets_at: w.resets_at,
            retry_after_secs: if kind == BreachKind::Exceeded { w.retry_after_secs(at) } else { None },
        }
    });
    let calls = remaining.get(&Metric::Calls).copied();
    let rows = remaining.get(&Metric::Rows).copied();
    let reset = match (calls, rows) {
        (Some((c, rc)), Some((r, rr))) => {
            if c <= r {
                rc
            } else {
                rr
            }
        }
        (Some((_, rc)), None) => rc,
        (None, Some((_, rr))) => rr,
        (None, None) => None,
    };
    Verdict {
        breach,
        remaining_calls: calls.map(|c| c.0),
        remaining_rows: rows.map(|r| r.0),
        reset,
        monitor_breaches,
        unpriced,
        reported,
    }
}

/// What one limit did in a check (see [`explain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitVerdict {
    /// Within its limit with this check's need.
    Within,
    /// Over it, and it refused the check (an enforce quota).
    Refused,
    /// Over it without refusing: a monitor quota.
    Over,
    /// Read only (a probe for unpriced usage): it never refuses.
    Read,
}

impl LimitVerdict {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitVerdict::Within => "within",
            LimitVerdict::Refused => "refused",
            LimitVerdict::Over => "over",
            LimitVerdict::Read => "read",
        }
    }
}

/// One limit a check evaluated, explained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explained {
    pub quota_id: QuotaId,
    pub scope: Scope,
    pub scope_ref: Option<String>,
    pub metric: Metric,
    pub kind: LimitKind,
    pub window: WindowKind,
    pub window_key: String,
    pub parts: UsageParts,
    pub used: u64,
    pub limit: u64,
    pub need: u64,
    pub verdict: LimitVerdict,
    /// The one the refusal reports.
    pub reported: bool,
}

/// Every limit the check evaluated, from the same observation the verdict
/// was decided from (the view's one step): never a second read.
pub fn explain(quotas: &[Quota], plan: &CheckPlan, outcome: &CheckOutcome, verdict: &Verdict) -> Vec<Explained> {
    plan.limits
        .iter()
        .enumerate()
        .filter_map(|(li, l)| {
            let q = quotas.get(l.quota)?;
            let used = outcome.used.get(li).copied().unwrap_or(0);
            let over = used.saturating_add(l.need) > l.limit;
            let verdict_of = match (l.kind, over, l.enforce) {
                (LimitKind::Probe, _, _) => LimitVerdict::Read,
                (_, false, _) => LimitVerdict::Within,
                (_, true, true) => LimitVerdict::Refused,
                (_, true, false) => LimitVerdict::Over,
            };
            Some(Explained {
                quota_id: q.id.clone(),
                scope: q.spec.scope,
                scope_ref: q.spec.scope_ref.clone(),
                metric: l.metric,
                kind: l.kind,
                window: plan.window_of(li).map_or(q.spec.window, |w| w.kind),
                window_key: plan.counters.get(l.counter).map(|c| c.key.window_key.clone()).unwrap_or_default(),
                parts: outcome.parts.get(li).copied().unwrap_or_default(),
                used,
                limit: l.limit,
                need: l.need,
                verdict: verdict_of,
                reported: verdict.reported == Some(li),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ProjectId;
    use crate::quota::QuotaSpec;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
    }

    fn key(s: &str) -> ApiKeyId {
        ApiKeyId::parse(s).expect("key id")
    }

    fn quota(id: &str, scope: Scope, scope_ref: Option<&str>, metric: Metric, window: WindowKind, limit: u64) -> Quota {
        let t0 = utc("2026-01-01T00:00:00Z");
        Quota {
            id: QuotaId::parse(id).expect("quota id"),
            spec: QuotaSpec {
                project_id: ProjectId::parse("p1").expect("project id"),
                scope,
                scope_ref: scope_ref.map(str::to_owned),
                metric,
                window,
                limit,
                mode: Mode::Enforce,
                meter_type: None,
                on_unpriced: None,
            },
            created_at: t0,
            updated_at: t0,
        }
    }

    fn monitor(mut q: Quota) -> Quota {
        q.spec.mode = Mode::Monitor;
        q
    }

    /// Plans for key `k1` and actor `u1` at `at`, and decides with `used`.
    fn check(quotas: &[Quota], used: &[u64], at: DateTime<Utc>) -> (CheckPlan, Verdict) {
        let plan = plan_check(
            quotas,
            Tz::UTC,
            &CheckInput { caller: Caller::key(&key("k1"), Some("u1")), storage_delta: None, ..Default::default() },
            at,
        );
        assert_eq!(plan.limits.len(), used.len(), "one usage per planned limit");
        let admitted = plan.limits.iter().zip(used).all(|(l, u)| !l.enforce || u + l.need <= l.limit);
        let verdict = decide(quotas, &plan, &CheckOutcome::of(admitted, used.to_vec()), at);
        assert_eq!(verdict.admitted(), admitted, "decide agrees with the view");
        (plan, verdict)
    }

    const AT: &str = "2026-07-07T12:31:45.500Z";

    /// Every limit, in plan order, with its split, its verdict and the one
    /// the refusal reports; a monitor over its limit is `over`, not refused.
    #[test]
    fn explain_answers_every_limit_and_marks_the_reported_one() {
        let project = monitor(quota("q_project", Scope::Project, None, Metric::Calls, WindowKind::Day, 2));
        let api_key = quota("q_key", Scope::ApiKey, Some("k1"), Metric::Calls, WindowKind::Day, 5);
        let quotas = vec![project, api_key];
        let (plan, verdict) = check(&quotas, &[5, 5], utc(AT));
        let split = |durable, settled, reserved| UsageParts { durable, settled, reserved };
        let outcome = CheckOutcome { admitted: false, used: vec![5, 5], parts: vec![split(3, 1, 1), split(2, 2, 1)] };
        let e = explain(&quotas, &plan, &outcome, &verdict);
        let brief: Vec<_> = e
            .iter()
            .map(|x| (x.quota_id.as_str().to_owned(), x.parts, x.used, x.limit, x.need, x.verdict, x.reported))
            .collect();
        let q = |s: &str| QuotaId::parse(s).expect("id").as_str().to_owned();
        assert_eq!(
            brief,
            vec![
                (q("q_project"), split(3, 1, 1), 5, 2, 1, LimitVerdict::Over, false),
                (q("q_key"), split(2, 2, 1), 5, 5, 1, LimitVerdict::Refused, true),
            ]
        );
        assert_eq!((e[1].scope, e[1].scope_ref.as_deref(), e[1].window), (Scope::ApiKey, Some("k1"), WindowKind::Day));
        assert_eq!(e[1].window_key, "2026-07-07");
        // Admitted: nothing reported, every limit within.
        let (plan, verdict) = check(&quotas[1..], &[1], utc(AT));
        let e = explain(&quotas[1..], &plan, &CheckOutcome::of(true, vec![1]), &verdict);
        assert_eq!((e.len(), e[0].verdict, e[0].reported), (1, LimitVerdict::Within, false));
    }

    #[test]
    fn api_key_beats_project_and_actor_beats_both() {
        let project = quota("q_project", Scope::Project, None, Metric::Calls, WindowKind::Day, 5);
        let api_key = quota("q_key", Scope::ApiKey, Some("k1"), Metric::Calls, WindowKind::Day, 5);
        let actor = quota("q_actor", Scope::Actor, None, Metric::Calls, WindowKind::Day, 5);

        // The order of the quotas does not matter.
        for quotas in [vec![project.clone(), api_key.clone()], vec![api_key.clone(), project.clone()]] {
            let (_, v) = check(&quotas, &[5, 5], utc(AT));
            let b = v.breach.expect("refused");
            assert_eq!((b.scope, b.scope_ref.as_deref()), (Scope::ApiKey, Some("k1")));
            assert_eq!(b.quota_id.as_str(), "q_key");
        }
        let (_, v) = check(&[project.clone(), actor.clone(), api_key.clone()], &[5, 5, 5], utc(AT));
        let b = v.breach.expect("refused");
        assert_eq!((b.scope, b.quota_id.as_str()), (Scope::Actor, "q_actor"));

        // Only the broad quota breached: it is the one reported.
        let (_, v) = check(&[project, actor, api_key], &[5, 0, 4], utc(AT));
        let b = v.breach.expect("refused");
        assert_eq!((b.scope, b.quota_id.as_str(), b.used, b.limit), (Scope::Project, "q_project", 5, 5));
    }

    #[test]
    fn among_equal_scopes_the_window_that_resets_last_is_reported() {
        let minute = quota("q_min", Scope::Project, None, Metric::Calls, WindowKind::Rolling1m, 1);
        let month = quota("q_month", Scope::Project, None, Metric::Calls, WindowKind::CalendarMonth, 1);
        let (_, v) = check(&[minute, month], &[1, 1], utc(AT));
        let b = v.breach.expect("refused");
        assert_eq!(b.quota_id.as_str(), "q_month");
        assert_eq!(b.resets_at, Some(utc("2026-08-01T00:00:00Z")));
    }

    /// An estimate is what an enforce tokens or cost quota needs and holds
    /// (cost: the AI meter's, so a platform-meter quota needs one
    /// picodollar as without one); a monitor quota holds nothing, and
    /// without an estimate a tokens quota needs 1 and holds nothing.
    #[test]
    fn an_estimate_is_the_need_of_tokens_and_cost_quotas_and_is_held() {
        let tokens = quota("q_tok", Scope::Project, None, Metric::Tokens, WindowKind::Day, 1_000);
        let cost = quota("q_cost", Scope::Project, None, Metric::CostUsd, WindowKind::Day, 5_000);
        let mut platform = quota("q_api", Scope::Project, None, Metric::CostUsd, WindowKind::Day, 5_000);
        platform.spec.meter_type = Some("api_request".into());
        let watch = monitor(quota("q_watch", Scope::Actor, None, Metric::Tokens, WindowKind::Day, 10));
        let quotas = vec![tokens.clone(), cost, platform, watch];
        let input =
            |estimate| CheckInput { caller: Caller::key(&key("k1"), Some("u1")), estimate, ..Default::default() };
        let estimate = Estimate { tokens: 300, cost: 1_200 };
        let plan = plan_check(&quotas, Tz::UTC, &input(estimate), utc(AT));
        let caps: Vec<(&str, u64, bool)> = plan
            .limits
            .iter()
            .filter(|l| l.kind == LimitKind::Cap)
            .map(|l| (quotas[l.quota].id.as_str(), l.need, l.reserve))
            .collect();
        assert_eq!(caps, [("q_tok", 300, true), ("q_cost", 1_200, true), ("q_api", 1, false), ("q_watch", 300, false)]);
        assert_eq!(plan.estimate, estimate, "held with the reservation");
        let plan = plan_check(std::slice::from_ref(&tokens), Tz::UTC, &input(Estimate::default()), utc(AT));
        assert_eq!((plan.limits[0].need, plan.limits[0].reserve), (1, false));
        assert!(plan.reserved_counters().is_empty() && plan.estimate.is_zero());
        // Only a cost estimate: the tokens quota reads the call as unestimated.
        let plan = plan_check(&quotas[..2], Tz::UTC, &input(Estimate { tokens: 0, cost: 7 }), utc(AT));
        let needs: Vec<(u64, bool)> =
            plan.limits.iter().filter(|l| l.kind == LimitKind::Cap).map(|l| (l.need, l.reserve)).collect();
        assert_eq!(needs, [(1, false), (7, true)]);
    }

    #[test]
    fn monitor_quotas_report_but_never_refuse() {
        let q = monitor(quota("q_watch", Scope::Actor, None, Metric::Calls, WindowKind::Day, 2));
        let (plan, v) = check(std::slice::from_ref(&q), &[9], utc(AT));
        assert!(v.admitted());
        assert_eq!(v.monitor_breaches, vec![q.id.clone()]);
        assert!(plan.reserved_counters().is_empty(), "monitor quotas hold nothing");
        assert_eq!(v.remaining_calls, None, "headers report enforce quotas only");
    }

    #[test]
    fn remaining_headers_count_this_calls_reservation_only_when_admitted() {
        let calls = quota("q_calls", Scope::ApiKey, Some("k1"), Metric::Calls, WindowKind::Rolling1h, 10);
        let rows = quota("q_rows", Scope::Project, None, Metric::Rows, WindowKind::Day, 100);
        let wide = quota("q_calls_month", Scope::Project, None, Metric::Calls, WindowKind::CalendarMonth, 1000);
        let quotas = [calls.clone(), rows.clone(), wide];

        // Admitted: 3 used + this call's slot leaves 6; rows are not reserved.
        let (_, v) = check(&quotas, &[3, 40, 500], utc(AT));
        assert!(v.admitted());
        assert_eq!(v.remaining_calls, Some(6));
        assert_eq!(v.remaining_rows, Some(60));
        // The tighter of the two is calls, in the hourly window.
        assert_eq!(v.reset, Some(utc("2026-07-07T13:00:00Z")));

        // Rows the tighter: the reset is the rows window's.
        let (_, v) = check(&quotas, &[0, 99, 500], utc(AT));
        assert_eq!((v.remaining_calls, v.remaining_rows), (Some(9), Some(1)));
        assert_eq!(v.reset, Some(utc("2026-07-08T00:00:00Z")));

        // Refused (rows exhausted): nothing reserved, so the calls left are 10 − 3.
        let (_, v) = check(&quotas, &[3, 100, 500], utc(AT));
        assert!(!v.admitted());
        assert_eq!((v.remaining_calls, v.remaining_rows), (Some(7), Some(0)));

        // Over the limit (rows overshoot): remaining is 0, not an underflow.
        let (_, v) = check(&quotas, &[3, 130, 500], utc(AT));
        assert_eq!(v.remaining_rows, Some(0));
        assert_eq!(v.breach.expect("refused").used, 130);

        // Only one metric quota'd: the other header is absent.
        let (_, v) = check(std::slice::from_ref(&rows), &[0], utc(AT));
        assert_eq!((v.remaining_calls, v.remaining_rows), (None, Some(100)));
        let (_, v) = check(&[], &[], utc(AT));
        assert_eq!((v.remaining_calls, v.remaining_rows, v.reset), (None, None, None));
    }

    #[test]
    fn retry_after_comes_from_the_reported_window() {
        let minute = quota("q_min", Scope::Project, None, Metric::Calls, WindowKind::Rolling1m, 1);
        let (_, v) = check(std::slice::from_ref(&minute), &[1], utc(AT));
        let b = v.breach.expect("refused");
        assert_eq!(b.window, WindowKind::Rolling1m);
        assert_eq!(b.resets_at, Some(utc("2026-07-07T12:32:00Z")));
        assert_eq!(b.retry_after_secs, Some(15), "14.5 s rounds up");

        // A day in the project's zone: Kathmandu's day ends at 18:15 UTC.
        let day = quota("q_day", Scope::Project, None, Metric::Requests, WindowKind::Day, 3);
        let at = utc("2026-07-07T18:00:00Z");
        let plan = plan_check(
            std::slice::from_ref(&day),
            chrono_tz::Asia::Kathmandu,
            &CheckInput { caller: Caller::key(&key("k1"), None), storage_delta: None, ..Default::default() },
            at,
        );
        let v = decide(std::slice::from_ref(&day), &plan, &CheckOutcome::of(false, vec![4]), at);
        let b = v.breach.expect("refused");
        assert_eq!(b.resets_at, Some(utc("2026-07-07T18:15:00Z")));
        assert_eq!(b.retry_after_secs, Some(900));
    }

    #[test]
    fn requests_are_counted_before_comparing_and_calls_and_rows_need_one() {
        let requests = quota("q_req", Scope::Project, None, Metric::Requests, WindowKind::Day, 3);
        let calls = quota("q_calls", Scope::Project, None, Metric::Calls, WindowKind::Day, 3);
        let rows = quota("q_rows", Scope::Project, None, Metric::Rows, WindowKind::Day, 3);
        let quotas = [requests, calls, rows];
        let plan = plan_check(
            &quotas,
            Tz::UTC,
            &CheckInput { caller: Caller::key(&key("k1"), None), storage_delta: None, ..Default::default() },
            utc(AT),
        );
        // One counter (project, day) carries all three limits.
        assert_eq!(plan.counters.len(), 1);
        assert_eq!(plan.count_request, vec![0]);
        assert_eq!(plan.reserved_counters(), vec![0]);
        let needs: Vec<_> = plan.limits.iter().map(|l| (l.metric, l.need, l.reserve)).collect();
        assert_eq!(needs, [(Metric::Requests, 0, false), (Metric::Calls, 1, true), (Metric::Rows, 1, false)]);
        // The third request (counted: used 3) passes; the fourth does not.
        assert!(check(&quotas, &[3, 2, 2], utc(AT)).1.admitted());
        assert!(!check(&quotas, &[4, 2, 2], utc(AT)).1.admitted());
        // The third call takes the last slot; rows pass while below the limit.
        assert!(!check(&quotas, &[1, 3, 2], utc(AT)).1.admitted());
        assert!(!check(&quotas, &[1, 2, 3], utc(AT)).1.admitted());
    }

    #[test]
    fn a_null_actor_ref_gives_each_actor_a_budget() {
        let q = quota("q_actor", Scope::Actor, None, Metric::Calls, WindowKind::Day, 5);
        let plan = plan_check(
            std::slice::from_ref(&q),
            Tz::UTC,
            &CheckInput { caller: Caller::key(&key("k1"), Some("u7")), storage_delta: None, ..Default::default() },
            utc(AT),
        );
        assert_eq!(plan.counters.len(), 1);
        assert_eq!(plan.counters[0].key.dimension, Dimension::Actor("u7".into()));
        assert_eq!(plan.counters[0].key.window_key, "2026-07-07");
        assert_eq!(dimension_for(&q, &Caller::key(&key("k1"), Some("u8"))), Some(Dimension::Actor("u8".into())));
        // No actor named: an actor quota does not apply at all.
        assert!(
            plan_check(
                std::slice::from_ref(&q),
                Tz::UTC,
                &CheckInput { caller: Caller::key(&key("k1"), None), storage_delta: None, ..Default::default() },
                utc(AT)
            )
            .limits
            .is_empty()
        );

        // A named actor matches only itself.
        let one = quota("q_u1", Scope::Actor, Some("u1"), Metric::Calls, WindowKind::Day, 5);
        assert_eq!(dimension_for(&one, &Caller::key(&key("k1"), Some("u1"))), Some(Dimension::Actor("u1".into())));
        assert_eq!(dimension_for(&one, &Caller::key(&key("k1"), Some("u2"))), None);
        assert_eq!(dimension_for(&one, &Caller::key(&key("k1"), None)), None);
    }

    #[test]
    fn an_api_key_quota_matches_only_its_key() {
        let other = quota("q_k2", Scope::ApiKey, Some("k2"), Metric::Calls, WindowKind::Day, 1);
        assert_eq!(dimension_for(&other, &Caller::key(&key("k1"), None)), None);
        let (plan, v) = check(std::slice::from_ref(&other), &[], utc(AT));
        assert!(plan.limits.is_empty() && v.admitted());

        let mine = quota("q_k1", Scope::ApiKey, Some("k1"), Metric::Calls, WindowKind::Day, 1);
        assert_eq!(dimension_for(&mine, &Caller::key(&key("k1"), None)), Some(Dimension::ApiKey(key("k1"))));
        let every = quota("q_keys", Scope::ApiKey, None, Metric::Calls, WindowKind::Day, 1);
        assert_eq!(dimension_for(&every, &Caller::key(&key("k1"), None)), Some(Dimension::AllApiKeys));
        assert_eq!(dimension_for(&every, &Caller::key(&key("k2"), None)), Some(Dimension::AllApiKeys));
    }

    #[test]
    fn the_watched_counters_are_exactly_those_a_check_can_plan() {
        let quotas = [
            quota("q_p", Scope::Project, None, Metric::Calls, WindowKind::Rolling1m, 5),
            quota("q_k", Scope::ApiKey, Some("k1"), Metric::Rows, WindowKind::Rolling1h, 5),
            quota("q_keys", Scope::ApiKey, None, Metric::Requests, WindowKind::Rolling24h, 5),
            quota("q_actors", Scope::Actor, None, Metric::Calls, WindowKind::Day, 5),
            quota("q_store", Scope::Project, None, Metric::StorageBytes, WindowKind::Current, 5),
        ];
        let w = Watched::of(&quotas);
        let at = utc(AT);
        // Everything a plan reads is watched, for any caller.
        for (k, a) in [("k1", Some("u1")), ("k2", Some("u9")), ("k1", None)] {
            let input = CheckInput { caller: Caller::key(&key(k), a), storage_delta: Some(10), ..Default::default() };
            for c in plan_check(&quotas, Tz::UTC, &input, at).counters {
                assert!(w.covers(&c.key), "{:?} is planned but not watched", c.key);
            }
        }
        let ck = |d: Dimension, win: WindowKind| CounterKey { dimension: d, window: win, window_key: "x".into() };
        assert!(!w.covers(&ck(Dimension::Project, WindowKind::Day)), "no project/day quota");
        assert!(!w.covers(&ck(Dimension::ApiKey(key("k2")), WindowKind::Rolling1h)), "only k1's hour");
        assert!(
            w.covers(&ck(Dimension::ApiKey(key("k2")), WindowKind::CalendarMonth)),
            "every key's month (usage_this_period)"
        );
        assert!(w.covers(&ck(Dimension::User("user:a".into()), WindowKind::Day)), "role quotas of users");
        assert!(!w.covers(&ck(Dimension::Actor("u1".into()), WindowKind::CalendarMonth)));
        assert!(!w.covers(&ck(Dimension::Agent("bot".into()), WindowKind::Day)));
        assert!(w.covers(&CounterKey::footprint()));
    }

    #[test]
    fn quotas_that_share_a_counter_reserve_once() {
        let every = quota("q_actors", Scope::Actor, None, Metric::Calls, WindowKind::Day, 5);
        let one = quota("q_u1", Scope::Actor, Some("u1"), Metric::Calls, WindowKind::Day, 2);
        let plan = plan_check(
            &[every, one],
            Tz::UTC,
            &CheckInput { caller: Caller::key(&key("k1"), Some("u1")), storage_delta: None, ..Default::default() },
            utc(AT),
        );
        assert_eq!(plan.counters.len(), 1);
        assert_eq!(plan.limits.len(), 2);
        assert_eq!(plan.reserved_counters(), vec![0]);
    }
}
