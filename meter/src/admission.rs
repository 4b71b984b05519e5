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

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use crate::ids::{ApiKeyId, QuotaId};
use crate::quota::{Metric, Mode, Quota, Scope};
use crate::usage::{Counter, CounterKey, Dimension};
use crate::window::{Window, WindowKind, window_at};

/// One limit the view must compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedLimit {
    /// Index into the quotas the plan was made from.
    pub quota: usize,
    /// Index into [`CheckPlan::counters`].
    pub counter: usize,
    pub metric: Metric,
    pub limit: u64,
    /// What this check adds before comparing: refuse when `used + need > limit`.
    pub need: u64,
    /// Only enforce limits can refuse.
    pub enforce: bool,
    /// Whether an admitted check holds one call on this counter until settled.
    pub reserve: bool,
}

/// Everything the view needs to run one check.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CheckPlan {
    pub counters: Vec<Counter>,
    pub limits: Vec<PlannedLimit>,
    /// Counters that count this request (before comparing).
    pub count_request: Vec<usize>,
    /// The window of each limit (for `resets_at`).
    pub windows: Vec<Window>,
}

impl CheckPlan {
    /// Counters this check reserves on when admitted.
    pub fn reserved_counters(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.limits.iter().filter(|l| l.reserve).map(|l| l.counter).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// What the view observed: whether it admitted, and each limit's usage
/// (durable + settled + reserved, before this check's own reservation, after
/// this request was counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    pub admitted: bool,
    pub used: Vec<u64>,
}

/// The dimension a quota counts for this caller, if it applies at all.
pub fn dimension_for(quota: &Quota, api_key: &ApiKeyId, actor: Option<&str>) -> Option<Dimension> {
    let s = &quota.spec;
    match (s.scope, s.scope_ref.as_deref()) {
        (Scope::Project, _) => Some(Dimension::Project),
        (Scope::ApiKey, None) => Some(Dimension::AllApiKeys),
        (Scope::ApiKey, Some(r)) => (r == api_key.as_str()).then(|| Dimension::ApiKey(api_key.clone())),
        (Scope::Actor, None) => actor.map(|a| Dimension::Actor(a.to_owned())),
        (Scope::Actor, Some(r)) => (Some(r) == actor).then(|| Dimension::Actor(r.to_owned())),
        (Scope::Agent, _) => None,
    }
}

/// Plans a check of `quotas` (the project's) for one caller at `at`.
pub fn plan_check(
    quotas: &[Quota],
    tz: Tz,
    api_key: &ApiKeyId,
    actor: Option<&str>,
    at: DateTime<Utc>,
) -> CheckPlan {
    let mut plan = CheckPlan::default();
    let mut index: BTreeMap<(Dimension, WindowKind), usize> = BTreeMap::new();
    for (qi, q) in quotas.iter().enumerate() {
        if !q.spec.metric.is_metered() {
            continue;
        }
        let Some(dimension) = dimension_for(q, api_key, actor) else {
            continue;
        };
        let window = window_at(q.spec.window, tz, at);
        let counter = *index.entry((dimension.clone(), q.spec.window)).or_insert_with(|| {
            plan.counters.push(Counter {
                key: CounterKey { dimension, window: window.kind, window_key: window.key.clone() },
                resets_at: window.resets_at,
            });
            plan.counters.len() - 1
        });
        let (need, reserve) = match q.spec.metric {
            Metric::Requests => (0, false),
            Metric::Calls => (1, true),
            _ => (1, false),
        };
        let enforce = q.spec.mode == Mode::Enforce;
        if q.spec.metric == Metric::Requests && !plan.count_request.contains(&counter) {
            plan.count_request.push(counter);
        }
        plan.limits.push(PlannedLimit {
            quota: qi,
            counter,
            metric: q.spec.metric,
            limit: q.spec.limit,
            need,
            enforce,
            reserve: reserve && enforce,
        });
        plan.windows.push(window);
    }
    plan
}

/// The quota that refused a check, as reported to the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breach {
    pub quota_id: QuotaId,
    pub scope: Scope,
    pub scope_ref: Option<String>,
    pub metric: Metric,
    pub limit: u64,
    pub used: u64,
    pub window: WindowKind,
    pub resets_at: Option<DateTime<Utc>>,
    pub retry_after_secs: Option<u64>,
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
    let mut remaining: BTreeMap<Metric, (u64, Option<DateTime<Utc>>)> = BTreeMap::new();
    for (li, l) in plan.limits.iter().enumerate() {
        let used = outcome.used.get(li).copied().unwrap_or(0);
        let over = used.saturating_add(l.need) > l.limit;
        let q = &quotas[l.quota];
        if over && !l.enforce {
            monitor_breaches.push(q.id.clone());
        }
        if over && l.enforce {
            let better = match breach {
                None => true,
                Some((bi, b)) => {
                    let bq = &quotas[b.quota];
                    (q.spec.scope, plan.windows[li].resets_at)
                        > (bq.spec.scope, plan.windows[bi].resets_at)
                }
            };
            if better {
                breach = Some((li, l));
            }
        }
        if l.enforce && matches!(l.metric, Metric::Calls | Metric::Rows) {
            let held = u64::from(outcome.admitted && l.reserve);
            let left = l.limit.saturating_sub(used.saturating_add(held));
            let entry = remaining.entry(l.metric).or_insert((u64::MAX, None));
            if left < entry.0 {
                *entry = (left, plan.windows[li].resets_at);
            }
        }
    }
    let breach = breach.map(|(li, l)| {
        let q = &quotas[l.quota];
        let w = &plan.windows[li];
        Breach {
            quota_id: q.id.clone(),
            scope: q.spec.scope,
            scope_ref: q.spec.scope_ref.clone(),
            metric: l.metric,
            limit: l.limit,
            used: outcome.used.get(li).copied().unwrap_or(0),
            window: w.kind,
            resets_at: w.resets_at,
            retry_after_secs: w.retry_after_secs(at),
        }
    });
    let calls = remaining.get(&Metric::Calls).copied();
    let rows = remaining.get(&Metric::Rows).copied();
    let reset = match (calls, rows) {
        (Some((c, rc)), Some((r, rr))) => if c <= r { rc } else { rr },
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
    }
}
