//! # The view in memory
//!
//! [`MemoryView`] implements [`meter::View`] inside the process, with the
//! same observable behaviour as [`RedisView`](crate::RedisView): the Lua
//! scripts in `src/lua/` are the specification, and this module follows them
//! step by step (each function below names the script it mirrors). It runs
//! `tollgate dev` and the gateway's tower layer; it is not a test double, and
//! it passes the same conformance suite (`tests/view_conformance.rs`).
//!
//! ## Atomicity
//!
//! All state sits behind one mutex, taken once per operation and never held
//! across an `.await` (no operation awaits anything), so every operation is
//! one atomic step, as a script is in Redis. Clones share the state.
//!
//! ## Layout
//!
//! Per project, the same records the Redis keys hold, each with the same
//! expiry:
//!
//! | record | Redis key | holds | expires |
//! |---|---|---|---|
//! | counter | `c:<counter>` | durable totals (exact `u64` sums, `i64` footprint) and pending deltas (`i64`), every [`Field`] | one hour after its window resets ([`COUNTER_GRACE`]) |
//! | leases | `r:<counter>` | reservation id → lease end | at the latest lease + [`LEASE_GRACE`] |
//! | hold | `res:<rid>` | the counters a reservation holds | at its lease + [`LEASE_GRACE`] |
//! | event | `ev:<event>` | per counter, what the event added to pending | [`EVENT_INDEX_TTL`] after its last write |
//! | `loaded` | `loaded` | the durable totals were seeded | never |
//!
//! ## Time
//!
//! The time is injected: the view never reads a clock. Its "now", the
//! analogue of the Redis server's clock that expires keys, is the latest `at`
//! any operation was given (it never runs backwards); operations without an
//! `at` (seed, unsettle, release, fold) use that. Leases, as in the scripts,
//! are compared with each call's own `at`. Records are expired lazily, when
//! an operation reaches them, and swept from memory at most once a minute of
//! that "now", so memory stays bounded by what is live (plus a project's
//! `loaded` marker, which like Redis's never expires).
//!
//! ## Accuracy
//!
//! Sums and comparisons are exact integers, where the scripts use doubles
//! (exact up to 2^53): the two agree on every count, token and byte amount,
//! and on costs up to about $9,007 (picodollars); above that the scripts may
//! be off by a few thousand picodollars, this view is not. A pending amount
//! saturates at `i64` bounds where Redis's `HINCRBY` would fail.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Field, Hold, LimitKind, PortError, PortResult,
    ProjectId, ReservationId, Settlement, Totals, View,
};

use crate::redis_view::{COUNTER_GRACE, EVENT_INDEX_TTL, LEASE_GRACE, sum_field};

/// How often (in the view's time) expired records are swept from memory.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Milliseconds since the epoch: the scripts' resolution.
type Ms = i64;

fn ms(at: DateTime<Utc>) -> Ms {
    at.timestamp_millis()
}

fn dur_ms(d: Duration) -> Ms {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// When a counter may go: one hour after its window resets, or never.
fn counter_expiry(c: &Counter) -> Option<Ms> {
    c.resets_at.map(|r| ms(r).saturating_add(dur_ms(COUNTER_GRACE)))
}

/// The in-memory hot-path view. Cheap to clone: clones share one state.
#[derive(Clone, Default)]
pub struct MemoryView {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for MemoryView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryView").field("records", &self.records()).finish_non_exhaustive()
    }
}

impl MemoryView {
    /// An empty view: every project is unseeded.
    pub fn new() -> MemoryView {
        MemoryView::default()
    }

    /// How many records (counters, lease sets, holds, event indexes and
    /// projects) the view holds, expired ones not swept yet included: a gauge
    /// of its memory.
    pub fn records(&self) -> usize {
        let st = self.lock();
        st.projects.values().map(|p| 1 + p.counters.len() + p.leases.len() + p.holds.len() + p.events.len()).sum()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// ---------------------------------------------------------------- records

/// A record that may expire at an instant (`None` = never).
trait Expiring {
    fn expires(&self) -> Option<Ms>;
    fn expired(&self, now: Ms) -> bool {
        self.expires().is_some_and(|e| e <= now)
    }
}

/// `PEXPIREAT` unless the record already expires later (`extend_expiry`).
fn extend(expires: &mut Option<Ms>, until: Ms) {
    if expires.is_none_or(|e| e < until) {
        *expires = Some(until);
    }
}

/// The live record under `key`, dropping it first if it expired.
fn live<'a, K, Q, V>(map: &'a mut HashMap<K, V>, key: &Q, now: Ms) -> Option<&'a mut V>
where
    K: Borrow<Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    V: Expiring,
{
    if map.get(key).is_some_and(|v| v.expired(now)) {
        map.remove(key);
    }
    map.get_mut(key)
}

/// The live record under `key`, created empty when missing or expired (a
/// write to a missing Redis key creates it).
fn live_or_new<'a, K, V>(map: &'a mut HashMap<K, V>, key: &K, now: Ms) -> &'a mut V
where
    K: Hash + Eq + Clone,
    V: Expiring + Default,
{
    if map.get(key).is_some_and(|v| v.expired(now)) {
        map.remove(key);
    }
    map.entry(key.clone()).or_default()
}

/// The live record under `key`, for reading.
fn live_ref<'a, K, Q, V>(map: &'a HashMap<K, V>, key: &Q, now: Ms) -> Option<&'a V>
where
    K: Borrow<Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    V: Expiring,
{
    map.get(key).filter(|v| !v.expired(now))
}

/// Settled-but-unfolded amounts of every field, in [`Field::ALL`] order,
/// signed as `HINCRBY` keeps them.
#[derive(Debug, Clone, Copy, Default)]
struct Pending([i64; Field::ALL.len()]);

impl Pending {
    fn add(&mut self, t: Totals) {
        for f in Field::ALL {
            let p = &mut self.0[f.index()];
            *p = p.saturating_add(t.get(f));
        }
    }
    fn sub(&mut self, t: Totals) {
        for f in Field::ALL {
            let p = &mut self.0[f.index()];
            *p = p.saturating_sub(t.get(f));
        }
    }
    /// As the usage reply parses it: a negative sum reads as 0, the
    /// footprint delta keeps its sign.
    fn totals(&self) -> Totals {
        Totals::from_values(&self.0)
    }
}

/// A durable value, exact: a `u64` sum or the `i64` footprint.
fn durable(t: &Totals, f: Field) -> i128 {
    let mut t = *t;
    match sum_field(&mut t, f) {
        Some(v) => i128::from(*v),
        None => i128::from(t.storage),
    }
}

/// `c:<counter>`.
#[derive(Debug, Default)]
struct CounterRec {
    durable: Totals,
    /// Whether a footprint is stored (`t_sto_n` exists in Redis).
    footprint: bool,
    pending: Pending,
    expires: Option<Ms>,
}

impl CounterRec {
    /// `max(0, durable + pending)` of one field, as the check script reads it.
    fn value(&self, f: Field) -> u128 {
        let v = durable(&self.durable, f) + i128::from(self.pending.0[f.index()]);
        u128::try_from(v).unwrap_or(0)
    }
}

impl Expiring for CounterRec {
    fn expires(&self) -> Option<Ms> {
        self.expires
    }
}

/// `r:<counter>`: reservation id → lease end.
#[derive(Debug, Default)]
struct Leases {
    by: HashMap<ReservationId, Ms>,
    expires: Option<Ms>,
}

impl Expiring for Leases {
    fn expires(&self) -> Option<Ms> {
        self.expires
    }
}

/// `res:<rid>`: the counters a reservation holds.
#[derive(Debug, Default)]
struct HoldRec {
    counters: BTreeSet<String>,
    expires: Option<Ms>,
}

impl Expiring for HoldRec {
    fn expires(&self) -> Option<Ms> {
        self.expires
    }
}

/// `ev:<event>`: what an event added to each counter's pending.
#[derive(Debug, Default)]
struct EventRec {
    deltas: BTreeMap<String, Totals>,
    expires: Option<Ms>,
}

impl Expiring for EventRec {
    fn expires(&self) -> Option<Ms> {
        self.expires
    }
}

// ---------------------------------------------------------------- state

#[derive(Debug)]
struct State {
    /// The view's clock: the latest `at` it was given.
    now: Ms,
    next_sweep: Ms,
    projects: HashMap<ProjectId, ProjectState>,
}

impl Default for State {
    fn default() -> Self {
        State { now: Ms::MIN, next_sweep: Ms::MIN, projects: HashMap::new() }
    }
}

impl State {
    /// Moves the clock to `at` (never back) and sweeps when one is due.
    fn advance(&mut self, at: DateTime<Utc>) -> Ms {
        self.now = self.now.max(ms(at));
        if self.now >= self.next_sweep {
            self.sweep();
            self.next_sweep = self.now.saturating_add(dur_ms(SWEEP_EVERY));
        }
        self.now
    }

    /// Drops every expired record, and the projects left with nothing.
    fn sweep(&mut self) {
        let now = self.now;
        self.projects.retain(|_, p| {
            p.counters.retain(|_, v| !v.expired(now));
            p.leases.retain(|_, v| !v.expired(now) && !v.by.is_empty());
            p.holds.retain(|_, v| !v.expired(now));
            p.events.retain(|_, v| !v.expired(now));
            p.loaded || !p.is_empty()
        });
    }
}

/// Everything the view holds for one project.
#[derive(Debug, Default)]
struct ProjectState {
    loaded: bool,
    counters: HashMap<String, CounterRec>,
    leases: HashMap<String, Leases>,
    holds: HashMap<ReservationId, HoldRec>,
    events: HashMap<EventId, EventRec>,
}

/// The deltas of one settlement, one per counter (a counter named twice is
/// summed; its expiry is the first one's), in name order.
fn merged(deltas: &[(Counter, Totals)]) -> BTreeMap<String, (Option<Ms>, Totals)> {
    let mut by: BTreeMap<String, (Option<Ms>, Totals)> = BTreeMap::new();
    for (c, t) in deltas {
        let e = by.entry(c.key.encode()).or_insert_with(|| (counter_expiry(c), Totals::default()));
        e.1.add(*t);
    }
    by
}

impl ProjectState {
    fn is_empty(&self) -> bool {
        self.counters.is_empty() && self.leases.is_empty() && self.holds.is_empty() && self.events.is_empty()
    }

    /// Writes a counter (creating it), then sets its expiry (`expire_at`):
    /// a counter whose expiry has passed is gone at once.
    fn write_counter(&mut self, name: &str, expires: Option<Ms>, now: Ms, write: impl FnOnce(&mut CounterRec)) {
        let c = live_or_new(&mut self.counters, &name.to_owned(), now);
        write(c);
        if expires.is_some() {
            c.expires = expires;
        }
        if c.expired(now) {
            self.counters.remove(name);
        }
    }

    /// `raise_totals` + `expire_at`: a durable sum never goes down; the
    /// footprint is replaced by one reflecting more storage facts (or when
    /// none is stored), and a total with no storage facts and no footprint
    /// leaves it alone.
    fn raise(&mut self, c: &Counter, t: Totals, now: Ms) {
        self.write_counter(&c.key.encode(), counter_expiry(c), now, |rec| {
            let mut new = t;
            for f in Field::ALL {
                if f != Field::StorageEvents
                    && let (Some(d), Some(n)) = (sum_field(&mut rec.durable, f), sum_field(&mut new, f))
                {
                    *d = (*d).max(*n);
                }
            }
            let says = t.storage_events != 0 || t.storage != 0;
            if says && (!rec.footprint || t.storage_events > rec.durable.storage_events) {
                rec.durable.storage_events = t.storage_events;
                rec.durable.storage = t.storage;
                rec.footprint = true;
            }
        });
    }

    /// `drop_event`: takes back what an event added to pending, then forgets
    /// the event. A counter that already expired is left alone (not recreated).
    fn drop_event(&mut self, event: &EventId, now: Ms) {
        let Some(ev) = live(&mut self.events, event, now).map(std::mem::take) else { return };
        self.events.remove(event);
        for (name, t) in ev.deltas {
            if let Some(c) = live(&mut self.counters, name.as_str(), now) {
                c.pending.sub(t);
            }
        }
    }

    /// `release`: frees a reservation on every counter it holds.
    fn release(&mut self, rid: &ReservationId, now: Ms) {
        let Some(hold) = live(&mut self.holds, rid, now).map(std::mem::take) else { return };
        self.holds.remove(rid);
        for name in hold.counters {
            if let Some(z) = live(&mut self.leases, name.as_str(), now) {
                z.by.remove(rid);
                if z.by.is_empty() {
                    self.leases.remove(name.as_str());
                }
            }
        }
    }

    /// check.lua, on a seeded project and a validated plan.
    fn check(&mut self, plan: &CheckPlan, hold: &Hold, at: Ms, now: Ms) -> CheckOutcome {
        let names: Vec<String> = plan.counters.iter().map(|c| c.key.encode()).collect();
        let rid = &hold.reservation;

        // Purge expired leases; count the request once per event and counter.
        let mut counted = false;
        for (i, c) in plan.counters.iter().enumerate() {
            if let Some(z) = live(&mut self.leases, names[i].as_str(), now) {
                z.by.retain(|_, lease| *lease > at);
                if z.by.is_empty() {
                    self.leases.remove(names[i].as_str());
                }
            }
            if plan.count_request.contains(&i) {
                let ev = live_or_new(&mut self.events, &hold.request_event, now);
                let fresh = !ev.deltas.contains_key(&names[i]);
                if fresh {
                    let one = Totals { requests: 1, ..Totals::default() };
                    ev.deltas.insert(names[i].clone(), one);
                    self.write_counter(&names[i], counter_expiry(c), now, |rec| rec.pending.add(one));
                    counted = true;
                }
            }
        }
        if counted && let Some(ev) = self.events.get_mut(&hold.request_event) {
            ev.expires = Some(now.saturating_add(dur_ms(EVENT_INDEX_TTL)));
        }

        // What each limit reads (live reservations without this check's own).
        let mut admitted = true;
        let mut used = Vec::with_capacity(plan.limits.len());
        for l in &plan.limits {
            let name = names[l.counter].as_str();
            let rec = live_ref(&self.counters, name, now);
            let value = |f: Field| rec.map_or(0, |c| c.value(f));
            let live = || {
                live_ref(&self.leases, name, now)
                    .map_or(0, |z| z.by.iter().filter(|(r, lease)| **lease > at && *r != rid).count())
            };
            let mut u: u128 = 0;
            for f in &l.fields {
                u = u.saturating_add(value(*f));
                if *f == Field::Calls && l.kind != LimitKind::Blackout {
                    u = u.saturating_add(live() as u128);
                }
            }
            if l.kind == LimitKind::Blackout && value(Field::LlmPriced) > 0 {
                u = 0;
            }
            let u = u64::try_from(u).unwrap_or(u64::MAX);
            used.push(u);
            if l.enforce && l.kind != LimitKind::Probe && u.saturating_add(l.need) > l.limit {
                admitted = false;
            }
        }

        if admitted {
            let lease = ms(hold.lease_until);
            let until = lease.saturating_add(dur_ms(LEASE_GRACE));
            let mut held = false;
            for i in plan.reserved_counters() {
                let z = live_or_new(&mut self.leases, &names[i], now);
                z.by.insert(rid.clone(), lease);
                extend(&mut z.expires, until);
                if z.expired(now) {
                    self.leases.remove(names[i].as_str());
                }
                live_or_new(&mut self.holds, rid, now).counters.insert(names[i].clone());
                held = true;
            }
            if held && let Some(h) = self.holds.get_mut(rid) {
                extend(&mut h.expires, until);
                if h.expired(now) {
                    self.holds.remove(rid);
                }
            }
        }

        CheckOutcome { admitted, used }
    }

    /// settle.lua.
    fn settle(&mut self, settlements: &[Settlement], now: Ms) {
        for s in settlements {
            if let Some(rid) = &s.reservation {
                self.release(rid, now);
            }
            let fresh = live(&mut self.events, &s.event, now).is_none();
            let mut wrote = false;
            for (name, (expires, t)) in merged(&s.deltas) {
                if fresh && !t.is_zero() {
                    self.write_counter(&name, expires, now, |rec| rec.pending.add(t));
                    live_or_new(&mut self.events, &s.event, now).deltas.insert(name, t);
                    wrote = true;
                }
            }
            if wrote && let Some(ev) = self.events.get_mut(&s.event) {
                ev.expires = Some(now.saturating_add(dur_ms(EVENT_INDEX_TTL)));
            }
        }
    }

    /// usage.lua (writes nothing).
    fn usage(&self, counter: &CounterKey, at: Ms, now: Ms) -> CounterUsage {
        let name = counter.encode();
        let (durable, pending) =
            live_ref(&self.counters, name.as_str(), now).map(|c| (c.durable, c.pending.totals())).unwrap_or_default();
        let reserved = live_ref(&self.leases, name.as_str(), now)
            .map(|z| z.by.values().filter(|lease| **lease > at).count())
            .unwrap_or(0);
        CounterUsage { durable, pending, reserved_calls: reserved as u64 }
    }
}

#[async_trait]
impl View for MemoryView {
    async fn check(
        &self,
        project: &ProjectId,
        plan: &CheckPlan,
        hold: &Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CheckOutcome>> {
        // Validated before anything changes, as RedisView does before the script.
        if let Some(l) = plan.limits.iter().find(|l| l.counter >= plan.counters.len()) {
            return Err(PortError::Permanent(format!(
                "check plan names counter {} of {}",
                l.counter,
                plan.counters.len()
            )));
        }
        let mut st = self.lock();
        let now = st.advance(at);
        match st.projects.get_mut(project) {
            Some(p) if p.loaded => Ok(Some(p.check(plan, hold, ms(at), now))),
            _ => Ok(None),
        }
    }

    async fn seed(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        let mut st = self.lock();
        let now = st.now;
        let p = st.projects.entry(project.clone()).or_default();
        for (c, t) in totals {
            p.raise(c, *t, now);
        }
        p.loaded = true;
        Ok(())
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()> {
        if settlements.is_empty() {
            return Ok(());
        }
        let mut st = self.lock();
        let now = st.advance(at);
        st.projects.entry(project.clone()).or_default().settle(settlements, now);
        Ok(())
    }

    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        let mut st = self.lock();
        let now = st.now;
        if let Some(p) = st.projects.get_mut(project) {
            for e in events {
                p.drop_event(e, now);
            }
        }
        Ok(())
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId) -> PortResult<()> {
        let mut st = self.lock();
        let now = st.now;
        if let Some(p) = st.projects.get_mut(project) {
            p.release(reservation, now);
        }
        Ok(())
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
    ) -> PortResult<()> {
        if totals.is_empty() && events.is_empty() {
            return Ok(());
        }
        let mut st = self.lock();
        let now = st.now;
        let p = st.projects.entry(project.clone()).or_default();
        for (c, t) in totals {
            p.raise(c, *t, now);
        }
        for e in events {
            p.drop_event(e, now);
        }
        Ok(())
    }

    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>> {
        let mut st = self.lock();
        let now = st.advance(at);
        Ok(st.projects.get(project).filter(|p| p.loaded).map(|p| p.usage(counter, ms(at), now)))
    }
}
