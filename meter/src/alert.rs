//! Quota alerts: which `quota.exceeded` and `quota.nearly_used`
//! notifications (and monitor-breach audit entries) one folded batch makes
//! due, with no I/O.
//!
//! The fold calls [`quota_notifications`] inside its own transaction with
//! the project's quotas, what each touched counter held before the batch
//! ([`totals_before`]), the batch's new facts in log order and each
//! project's storage footprint after the batch; it enqueues what comes back
//! in the outbox with its dedup key (quota, window key, kind, threshold),
//! so each notification is made **once**, whatever gateways, redeliveries
//! or replays see it again.
//!
//! The rules:
//!
//! - **Edge-triggered, per fact.** The new facts are walked in log order;
//!   each one adds its quantities to a running copy of the counters, and a
//!   threshold fires on the fact that takes the quota's usage from below it
//!   to at or above it. So the message's `timestamp` is that fact's receipt
//!   and its `observed_value` the usage right after it, whatever batches
//!   the log was cut into: a replay computes the same bytes.
//! - **`quota.nearly_used`** at 80 % (`severity: warning`, `threshold: 80`)
//!   and at 100 % (`critical`, `threshold: 100`) of the limit (80 % rounded
//!   up to a whole unit), enforce and monitor quotas alike.
//! - **`quota.exceeded`**, whichever comes first in the log: for an
//!   **enforce** quota, folded usage reaching the limit (the quota is used
//!   up: the next check is refused) or a refused check's breach carried by
//!   its request event; for a **monitor** quota, folded usage going over
//!   the limit (what an enforce quota would have refused) or a breach its
//!   check found (carried the same way). A monitor quota's `exceeded` also
//!   makes its `quotas:MonitorBreach` audit entry (once per quota and
//!   window by the entry's once-key).
//! - **Once per quota per window, re-armed when the window rolls**: a new
//!   window key is a new counter that starts from zero, and a new dedup key.
//!   A quota of `actor` scope with a null ref has one budget per actor but
//!   one notification per window: the first actor to cross fires it, with
//!   that actor as `scope_ref`.
//! - **`storage_bytes`** is a stock, not a flow: it is judged on the
//!   footprint after the batch (a level, not an edge), and its window key is
//!   the UTC day of the batch's newest storage fact, so a footprint that
//!   stays over its cap notifies once per UTC day it is written to.
//! - A threshold of zero (a zero limit) fires on the first unit of usage.
//!   Corrections are not walked: what they take back never notifies, and
//!   what an amendment adds is seen by the next crossing fact.
//!
//! Ids are replay-stable: a message's id (its `webhook-id`) and an audit
//! entry's id are the receipt's milliseconds (so they stay time-ordered, as
//! the delivery log's cursor needs) followed by a hash of the dedup key.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde_json::{Value, json};

use crate::admission::{Caller, dimension_for, quota_fields};
use crate::audit::{AuditEntry, MonitorBreach};
use crate::correction::Delta;
use crate::ids::{AuditId, MessageId, ProjectId};
use crate::price::{PriceBook, Usd};
use crate::quota::{Mode, Quota, Scope};
use crate::usage::{Counter, CounterKey, EventKind, Field, Totals, UsageFact, counters_where};
use crate::webhook::{Notification, QUOTA_EXCEEDED, QUOTA_NEARLY_USED, dedup_key};
use crate::window::window_at;

/// The `quota.nearly_used` thresholds, in percent, with their severity.
pub const NEARLY_USED: [(u32, &str); 2] = [(80, "warning"), (100, "critical")];

/// What one batch makes due.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Alerts {
    /// In the order they fired; each dedup key once.
    pub notifications: Vec<Notification>,
    /// The monitor breaches' audit entries, in the order they fired.
    pub audit: Vec<AuditEntry>,
}

/// What the rule needs of one folded batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchAlerts<'a> {
    /// The quotas of the batch's projects (others are ignored).
    pub quotas: &'a [Quota],
    pub zones: &'a HashMap<ProjectId, Tz>,
    pub book: &'a PriceBook,
    /// The batch's newly folded facts (no duplicates, no corrections), in
    /// log order.
    pub facts: &'a [&'a UsageFact],
    /// What each counter the batch touched held before it ([`totals_before`]);
    /// a counter missing here held nothing.
    pub before: &'a HashMap<(ProjectId, CounterKey), Totals>,
    /// Each project's storage footprint after the batch, for the projects
    /// whose footprint the batch changed.
    pub footprints: &'a HashMap<ProjectId, i64>,
}

/// What each counter held before a batch: its absolute totals after the
/// batch (as the store returned them) less what the batch changed. A sum
/// that the store saturated or floored may read a little off; it never
/// reads below zero.
pub fn totals_before(
    after: &[(ProjectId, Counter, Totals)],
    changes: &[(ProjectId, Counter, Delta)],
) -> HashMap<(ProjectId, CounterKey), Totals> {
    let deltas: HashMap<(&ProjectId, &CounterKey), &Delta> = changes.iter().map(|(p, c, d)| ((p, &c.key), d)).collect();
    let mut out = HashMap::new();
    for (p, c, t) in after {
        if c.key == CounterKey::footprint() {
            continue;
        }
        let mut before = *t;
        if let Some(d) = deltas.get(&(p, &c.key)) {
            for f in Field::ALL {
                before.set(f, t.get(f).saturating_sub(d[f.index()]).max(0));
            }
        }
        out.insert((p.clone(), c.key.clone()), before);
    }
    out
}

fn usage(t: &Totals, fields: &[Field]) -> u64 {
    fields.iter().fold(0u64, |acc, f| acc.saturating_add(u64::try_from(t.get(*f)).unwrap_or(0)))
}

/// The least usage that is at least `percent` of `limit` (rounded up), and
/// at least one unit.
fn threshold(limit: u64, percent: u32) -> u64 {
    let t = (u128::from(limit) * u128::from(percent)).div_ceil(100);
    u64::try_from(t).unwrap_or(u64::MAX).max(1)
}

/// The usage at which `quota.exceeded` fires from folded usage.
fn exceeded_at(q: &Quota) -> u64 {
    match q.spec.mode {
        Mode::Enforce => q.spec.limit.max(1),
        Mode::Monitor => q.spec.limit.saturating_add(1),
    }
}

/// FNV-1a, 64 bits: stable across builds and platforms.
fn fnv(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `<prefix><48 bits of ms>7<hash>`: the shape of a UUIDv7 in hex, its
/// random bits a hash of the dedup key.
fn stable_id(prefix: &str, key: &str, at: DateTime<Utc>) -> String {
    let ms = u64::try_from(at.timestamp_millis()).unwrap_or(0) & 0xffff_ffff_ffff;
    format!("{prefix}{ms:012x}7{:019x}", u128::from(fnv(key)) << 12)
}

/// The `webhook-id` of a notification: replay-stable, from its dedup key
/// and the receipt of the fact that caused it.
pub fn message_id(dedup: &str, at: DateTime<Utc>) -> MessageId {
    // Invariant: `msg_` and hex digits are in the id alphabet.
    MessageId::parse(stable_id("msg_", dedup, at)).unwrap_or_else(|_| unreachable!("hex digits form an id"))
}

fn audit_id(dedup: &str, at: DateTime<Utc>) -> AuditId {
    // Invariant: `aud_` and hex digits are in the id alphabet.
    AuditId::parse(stable_id("aud_", dedup, at)).unwrap_or_else(|_| unreachable!("hex digits form an id"))
}

/// An amount in the quota's unit, as the API shows it: decimal dollars (a
/// string) for `cost_usd`, else an integer.
fn amount(q: &Quota, v: u64) -> Value {
    if q.spec.metric.is_money() { json!(Usd(i64::try_from(v).unwrap_or(i64::MAX)).to_string()) } else { json!(v) }
}

/// One firing: a quota, its window, what was seen and the fact that did it.
struct Firing<'a> {
    quota: &'a Quota,
    window_key: String,
    scope_ref: Option<String>,
    limit: u64,
    observed: u64,
    mode: Mode,
    fact: &'a UsageFact,
}

#[derive(Default)]
struct Out {
    alerts: Alerts,
    seen: HashSet<String>,
}

impl Out {
    fn fire(&mut self, f: &Firing<'_>, kind: &str, nearly: Option<(u32, &str)>) {
        let q = f.quota;
        let key = dedup_key(q.id.as_str(), &f.window_key, kind, nearly.map(|(t, _)| t));
        if !self.seen.insert(key.clone()) {
            return;
        }
        let at = f.fact.receipt();
        let mut data = json!({
            "quota_id": q.id,
            "project_id": q.spec.project_id,
            "scope": q.spec.scope.as_str(),
            "scope_ref": f.scope_ref,
            "metric": q.spec.metric.as_str(),
            "meter_type": q.spec.meter_type,
            "window": q.spec.window.as_str(),
            "window_key": f.window_key,
            "limit": amount(q, f.limit),
            "observed_value": amount(q, f.observed),
            "mode": f.mode.as_str(),
        });
        if let (Some((t, severity)), Some(map)) = (nearly, data.as_object_mut()) {
            map.insert("threshold".into(), json!(t));
            map.insert("severity".into(), json!(severity));
        }
        let n = Notification::new(message_id(&key, at), q.spec.project_id.clone(), kind, data, Some(key.clone()), at);
        self.alerts.notifications.push(n);
        if kind == QUOTA_EXCEEDED && f.mode == Mode::Monitor {
            let breach = MonitorBreach {
                quota_id: q.id.clone(),
                project_id: q.spec.project_id.clone(),
                metric: q.spec.metric,
                meter_type: q.spec.meter_type.clone(),
                window: q.spec.window,
                window_key: f.window_key.clone(),
                limit: f.limit,
                observed_value: f.observed,
            };
            self.alerts.audit.push(breach.entry(audit_id(&key, at), at));
        }
    }

    /// Every threshold that `prev → now` crossed.
    fn crossings(&mut self, f: &Firing<'_>, prev: Option<u64>) {
        let crossed = |t: u64| f.observed >= t && prev.is_none_or(|p| p < t);
        for (percent, severity) in NEARLY_USED {
            if crossed(threshold(f.limit, percent)) {
                self.fire(f, QUOTA_NEARLY_USED, Some((percent, severity)));
            }
        }
        if crossed(exceeded_at(f.quota)) {
            self.fire(f, QUOTA_EXCEEDED, None);
        }
    }
}

fn caller_of(fact: &UsageFact) -> Caller {
    Caller {
        api_key: fact.api_key_id.clone(),
        agent: fact.agent_id.clone(),
        actor: fact.actor_id.clone(),
        user: fact.user_id.clone(),
    }
}

/// The `scope_ref` a firing reports: the quota's, or on a null-ref actor
/// quota the actor that crossed.
fn scope_ref_of(q: &Quota, fact: &UsageFact) -> Option<String> {
    match (q.spec.scope, &q.spec.scope_ref) {
        (Scope::Actor, None) => fact.actor_id.clone(),
        (_, r) => r.clone(),
    }
}

/// The notifications (and monitor-breach audit entries) one folded batch
/// makes due. Pure: the same inputs give the same bytes.
pub fn quota_notifications(input: &BatchAlerts<'_>) -> Alerts {
    let mut by_project: HashMap<&ProjectId, Vec<&Quota>> = HashMap::new();
    for q in input.quotas {
        by_project.entry(&q.spec.project_id).or_default().push(q);
    }
    let mut out = Out::default();
    let mut running: HashMap<(ProjectId, CounterKey), Totals> = HashMap::new();
    // The newest storage fact of each project, for its storage quotas.
    let mut stored: Vec<&UsageFact> = Vec::new();
    for fact in input.facts {
        let Some(quotas) = by_project.get(&fact.project_id) else { continue };
        let tz = input.zones.get(&fact.project_id).copied().unwrap_or(Tz::UTC);
        if matches!(fact.kind, EventKind::StorageDelta | EventKind::StorageSnapshot) {
            stored.retain(|f| f.project_id != fact.project_id);
            stored.push(fact);
        }
        // The counter each flow quota of the project reads for this fact.
        let caller = caller_of(fact);
        let read: Vec<(&Quota, CounterKey)> = quotas
            .iter()
            .filter(|q| !q.spec.metric.is_stock())
            .filter_map(|q| {
                let dimension = dimension_for(q, &caller)?;
                let window = window_at(q.spec.window, tz, fact.occurred_at);
                Some((*q, CounterKey { dimension, window: window.kind, window_key: window.key }))
            })
            .collect();
        // What it adds to those counters (a fact lands in a counter a quota
        // reads exactly when that quota reads it for this fact too: the
        // dimension follows the caller), kept running over the batch.
        let lands = match read.is_empty() {
            true => Vec::new(),
            false => counters_where(fact, tz, input.book, |d, w| {
                read.iter().any(|(_, k)| k.window == w && k.dimension == *d)
            }),
        };
        for (c, delta) in &lands {
            let key = (fact.project_id.clone(), c.key.clone());
            match running.get_mut(&key) {
                Some(t) => t.add(*delta),
                None => {
                    let mut t = input.before.get(&key).copied().unwrap_or_default();
                    t.add(*delta);
                    running.insert(key, t);
                }
            }
        }
        for (q, key) in read {
            let Some((_, delta)) = lands.iter().find(|(c, _)| c.key == key) else { continue };
            let fields = quota_fields(q);
            let added = usage(delta, fields);
            if added == 0 {
                continue;
            }
            let key = (fact.project_id.clone(), key);
            let now = running.get(&key).map_or(0, |t| usage(t, fields));
            let firing = Firing {
                quota: q,
                window_key: key.1.window_key,
                scope_ref: scope_ref_of(q, fact),
                limit: q.spec.limit,
                observed: now,
                mode: q.spec.mode,
                fact,
            };
            out.crossings(&firing, Some(now.saturating_sub(added)));
        }
        // The breaches its check found, carried on the log.
        for b in &fact.breaches {
            let Some(q) = quotas.iter().find(|q| q.id == b.quota_id) else { continue };
            let window_key = if q.spec.metric.is_stock() {
                fact.occurred_at.date_naive().format("%Y-%m-%d").to_string()
            } else {
                b.window_key.clone()
            };
            let firing = Firing {
                quota: q,
                window_key,
                scope_ref: scope_ref_of(q, fact),
                limit: b.limit,
                observed: b.observed,
                mode: if b.enforce { Mode::Enforce } else { Mode::Monitor },
                fact,
            };
            out.fire(&firing, QUOTA_EXCEEDED, None);
        }
    }
    // Storage: the footprint after the batch, keyed by the UTC day of the
    // batch's newest storage fact.
    for fact in stored {
        let (Some(quotas), Some(bytes)) = (by_project.get(&fact.project_id), input.footprints.get(&fact.project_id))
        else {
            continue;
        };
        let observed = u64::try_from(*bytes).unwrap_or(0);
        for q in quotas.iter().filter(|q| q.spec.metric.is_stock()) {
            let firing = Firing {
                quota: q,
                window_key: fact.occurred_at.date_naive().format("%Y-%m-%d").to_string(),
                scope_ref: q.spec.scope_ref.clone(),
                limit: q.spec.limit,
                observed,
                mode: q.spec.mode,
                fact,
            };
            out.crossings(&firing, None);
        }
    }
    out.alerts
}

#[cfg(test)]
mod tests;
