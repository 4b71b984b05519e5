//! # The view's reference model
//!
//! The hot-path view (DESIGN §5) has one set of rules, and they are written
//! here: [`ViewModel`] is the view's state machine as plain data and plain
//! methods, with no I/O, no lock and no clock. `MemoryView` (in `store`) is
//! this model behind a mutex; the Lua scripts of `RedisView` implement the
//! same rules inside Redis; and a property test (`store/tests/view_model.rs`)
//! runs generated sequences of operations against the model, a `MemoryView`
//! and a `RedisView` and requires the same answers at every step and the same
//! state ([`ProjectDump`]) at the end. A rule changes here first.
//!
//! ## State
//!
//! Per project, the records Redis holds under the project's keys (see
//! `store/src/redis_view.rs` for the key layout), each with the same expiry.
//! Times are milliseconds since the epoch ([`Millis`]), the scripts'
//! resolution.
//!
//! | record | Redis key | holds | expires |
//! |---|---|---|---|
//! | [`CounterRecord`] | `c:<counter>` | durable totals (exact `u64` sums, the `i64` footprint), whether a footprint is stored, and pending deltas (`i64`, every [`Field`]) | [`COUNTER_GRACE`] after its window resets, or never |
//! | [`LeaseRecord`] | `r:<counter>` | reservation id → lease end | at the latest lease + [`LEASE_GRACE`] written to it |
//! | [`EstimateRecord`] | `e:<counter>` | reservation id → the estimate it holds there (a value list) | as its lease record |
//! | [`HoldRecord`] | `res:<rid>` | the counters a reservation holds; once released, a tombstone (the one member `~`) | at its lease + [`LEASE_GRACE`]; a hold an unseeded project did not have, [`LEASE_GRACE`] after its release |
//! | [`EventRecord`] | `ev:<event>` | per counter, what the event added to pending; or, once folded, a tombstone | [`EVENT_INDEX_TTL`] after the `at` of its last write; a tombstone [`TOMBSTONE_TTL`] after its fold |
//! | `loaded` | `loaded` | the project was seeded (by this server instance, see below) | never |
//!
//! `<counter>` is [`CounterKey::encode`](crate::CounterKey::encode). A
//! record exists exactly when its Redis key would: a write that stores
//! nothing creates nothing, and an empty lease set is gone.
//!
//! ## Rules
//!
//! - **Unseeded is unknown.** A check or a usage read of a project without
//!   the `loaded` marker answers `None` and changes nothing: the caller seeds
//!   from the store and asks again, so a flushed view never admits against
//!   zero. Seed sets the marker; settle, unsettle, release and fold neither
//!   need it nor set it.
//! - **The request is counted before the compare**, once per request event
//!   and counter (a retried check counts nothing again), and it stays counted
//!   when the check is refused: a refused request is still a request.
//! - **A check is all or nothing.** Every limit of the plan is read (see
//!   [`LimitKind`]); if any enforce cap or blackout has `used + need > limit`
//!   the check is refused and reserves nothing; else it reserves this
//!   reservation on every reserving counter. A limit's `used` counts the live
//!   reservations (lease after the check's `at`) when `calls` is among its
//!   fields, and their estimates of its other fields (tokens, cost: an
//!   [`EstimateRecord`]), without the check's own reservation (a retry). An
//!   admitted check holds the plan's estimate with its lease on every
//!   reserving counter; the lease's end frees both (a check purges the
//!   estimates of ended leases with the leases).
//! - **A settle replaces the reservation with the real delta**: it releases
//!   the reservation and adds the deltas to pending (a counter named twice is
//!   summed), indexed by event id. An event already indexed adds nothing.
//! - **Pending is dropped by event id**: unsettle and fold take back exactly
//!   what the index says the event added, then forget the event; a counter
//!   that expired meanwhile is left alone, not recreated.
//! - **A fold leaves a tombstone** per folded event ([`EventRecord::folded`],
//!   for [`TOMBSTONE_TTL`]): a settle of an event whose fold already reached
//!   the view (a late settle, a client's resend, a reseed that read the
//!   event in the log tail while the projector folded it) adds nothing, and
//!   a check whose request event was folded counts no request again. The
//!   durable total already holds the event.
//! - **A seed is the log's state** ([`Seed`]): the durable totals as of
//!   some log offsets, and the log tail past them — each unfolded fact added
//!   as a settle adds it (not over an event already indexed or tombstoned),
//!   and each live reservation of the tail held as a check holds it (not
//!   one whose hold is already there: held, or a tombstone) — then the
//!   marker, in one step, so no check admits against half a seed.
//! - **A released hold is a tombstone** ([`HoldRecord::released`], until
//!   the hold would have expired): a seed that read a reservation in the log
//!   tail while a gateway settled or freed it on this view does not hold it
//!   again. (Without it, a second gateway's first seed, racing the first
//!   gateway's traffic, left settled reservations held until their leases
//!   ended: the view counted those calls twice and refused calls under the
//!   limit.) On a project not seeded, a release of a hold the view does
//!   not have — lost with a flush before the call was settled — leaves a
//!   tombstone too, for [`LEASE_GRACE`] after the release (no lease is
//!   longer): a settle reaches the view before its call event reaches the
//!   log, so the seed that follows the flush may read the request event
//!   without the call, and would hold the reservation again until its
//!   lease ended. A seeded project writes nothing for a hold it does not
//!   have (the check reserved nothing, or its lease is long over): a
//!   tombstone per unreserved call would be a key per call for an hour.
//! - **A marker of another server instance is no marker.** Redis's `loaded`
//!   holds the `run_id` of the server that seeded it; a Redis restarted from
//!   a snapshot (or a replica promoted) has another `run_id`, so its
//!   restored marker reads as unseeded: the seeder forgets the project's
//!   stale keys and seeds afresh, and counters never go back silently to
//!   what the snapshot held. The model (and `MemoryView`, which cannot be
//!   restored) has one instance, so this rule never fires there.
//! - **Durable totals are never lowered** by a seed or a fold (`max`), and
//!   the footprint (`storage`) is replaced only by a total reflecting more
//!   storage facts (`storage_events` greater, or none stored yet); a total
//!   with no storage facts says nothing about storage.
//! - **Expiry**: a counter goes [`COUNTER_GRACE`] after its window resets
//!   (late settles of a closed window still land); a lease set and a hold at
//!   their latest lease + [`LEASE_GRACE`]; an event index
//!   [`EVENT_INDEX_TTL`] after its last write. A record whose expiry is set
//!   at or before the view's clock is gone at once (as `PEXPIREAT` in the past
//!   deletes a key). A lease that ended is no longer counted, and is purged
//!   from its set by the next check of that counter.
//!
//! ## Time
//!
//! Every operation takes an explicit `at`. The model's clock, the analogue
//! of the Redis server's clock that expires keys, is the latest `at` it was
//! given: it never runs backwards, and a record is expired when its expiry
//! is at or before the clock. Leases are compared with each call's own `at`,
//! as the scripts compare them with the `now` they are given; absolute
//! expiries (a window's reset, a lease, an event index's `at` + TTL) are
//! computed from the arguments, as the scripts compute their `PEXPIREAT`s.
//!
//! ## Accuracy
//!
//! Sums and comparisons are exact integers, where the scripts use doubles
//! (exact up to 2^53): the two agree on every count, token and byte amount,
//! and on costs up to about $9,007 (picodollars). A pending amount saturates
//! at `i64` bounds where Redis's `HINCRBY` would fail.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hash;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::admission::{CheckOutcome, CheckPlan, LimitKind};
use crate::error::{PortError, PortResult};
use crate::ids::{EventId, ProjectId, ReservationId};
use crate::usage::{Counter, CounterKey, Field, Totals};
use crate::view::{CounterUsage, Hold, Seed, Settlement};

/// The records' maps: keyed by ids and counter names, hashed with foldhash
/// (a random seed per map) where std's SipHash took about 270 instructions
/// per lookup, and a check and its settle make some thirty lookups.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// How long a counter outlives its window's reset (late settles still land).
pub const COUNTER_GRACE: Duration = Duration::from_secs(3600);
/// How long a reservation's records outlive its lease.
pub const LEASE_GRACE: Duration = Duration::from_secs(3600);
/// How long an event's pending index lives after its last write, if the
/// event is never folded.
pub const EVENT_INDEX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long the tombstone a fold leaves per event lives: longer than a
/// settle can arrive after its fold (a gateway's retried settle, a reseed
/// reading the log tail), short enough that the tombstones of an hour of
/// events are all the view keeps of folded ones.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(3600);

/// Milliseconds since the epoch: the resolution of every time the view keeps.
pub type Millis = i64;

/// Signed amounts of every field, in [`Field::ALL`] order: a counter's
/// pending deltas, or what one event added to one counter (the scripts'
/// "value list").
pub type Values = [i64; Field::ALL.len()];

/// An instant at the view's resolution.
pub fn millis(at: DateTime<Utc>) -> Millis {
    at.timestamp_millis()
}

fn duration_millis(d: Duration) -> Millis {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// When a counter may go: [`COUNTER_GRACE`] after its window resets, or never.
pub fn counter_expiry(c: &Counter) -> Option<Millis> {
    c.resets_at.map(|r| millis(r).saturating_add(duration_millis(COUNTER_GRACE)))
}

/// When the records of a reservation (its lease sets and its hold) may go:
/// [`LEASE_GRACE`] after its lease.
pub fn hold_expiry(hold: &Hold) -> Millis {
    millis(hold.lease_until).saturating_add(duration_millis(LEASE_GRACE))
}

/// When an event index last written at `at` may go.
pub fn event_expiry(at: DateTime<Utc>) -> Millis {
    millis(at).saturating_add(duration_millis(EVENT_INDEX_TTL))
}

/// When the tombstone of an event folded at `at` may go.
pub fn tombstone_expiry(at: DateTime<Utc>) -> Millis {
    millis(at).saturating_add(duration_millis(TOMBSTONE_TTL))
}

/// When the tombstone of a hold released at `at` that the view did not
/// have may go (a flushed Redis lost it before the call was settled):
/// [`LEASE_GRACE`] after the release. A gateway's lease is at most
/// [`LEASE_GRACE`], so the reservation's lease has ended by then and no
/// seed holds it again.
pub fn lost_hold_expiry(at: DateTime<Utc>) -> Millis {
    millis(at).saturating_add(duration_millis(LEASE_GRACE))
}

/// When the records of a seeded reservation with this lease may go.
fn lease_expiry(lease_until: DateTime<Utc>) -> Millis {
    millis(lease_until).saturating_add(duration_millis(LEASE_GRACE))
}

/// The `u64` behind a sum field of `t`, or `None` for `storage` (an `i64`).
/// [`Totals::get`] clamps at `i64::MAX`; durable sums are kept exact to `u64`.
pub fn sum_field(t: &mut Totals, f: Field) -> Option<&mut u64> {
    Some(match f {
        Field::Requests => &mut t.requests,
        Field::Calls => &mut t.calls,
        Field::Rows => &mut t.rows,
        Field::Tokens => &mut t.tokens,
        Field::CostLlmTokens => &mut t.cost_llm_tokens,
        Field::CostComputeExecution => &mut t.cost_compute_execution,
        Field::CostApiRequest => &mut t.cost_api_request,
        Field::CostStorage => &mut t.cost_storage,
        Field::LlmEvents => &mut t.llm_events,
        Field::LlmPriced => &mut t.llm_priced,
        Field::LlmUnpriced => &mut t.llm_unpriced,
        Field::StorageEvents => &mut t.storage_events,
        Field::Storage => return None,
    })
}

/// A durable value of one field, exact: a `u64` sum or the `i64` footprint.
pub fn durable_value(t: &Totals, f: Field) -> i128 {
    let mut t = *t;
    match sum_field(&mut t, f) {
        Some(v) => i128::from(*v),
        None => i128::from(t.storage),
    }
}

/// One limit's [`UsageParts`](crate::UsageParts), saturating into their types.
fn meter_parts(durable: u128, settled: i128, reserved: u128) -> crate::UsageParts {
    crate::UsageParts {
        durable: u64::try_from(durable).unwrap_or(u64::MAX),
        settled: i64::try_from(settled).unwrap_or(if settled < 0 { i64::MIN } else { i64::MAX }),
        reserved: u64::try_from(reserved).unwrap_or(u64::MAX),
    }
}

/// A malformed plan is refused before anything is read or written: every
/// limit must name a counter of the plan.
pub fn validate_plan(plan: &CheckPlan) -> PortResult<()> {
    match plan.limits.iter().find(|l| l.counter >= plan.counters.len()) {
        Some(l) => {
            Err(PortError::Permanent(format!("check plan names counter {} of {}", l.counter, plan.counters.len())))
        }
        None => Ok(()),
    }
}

/// One counter's delta of a settlement, after merging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergedDelta {
    /// [`CounterKey::encode`].
    pub name: String,
    pub expires: Option<Millis>,
    pub values: Values,
}

/// The deltas of one settlement, one per counter, in name order: a counter
/// named twice is summed ([`Totals::add`]), its expiry the first one's.
pub fn merged_deltas(deltas: &[(Counter, Totals)]) -> Vec<MergedDelta> {
    // A settlement names a few counters: one sorted vector, no map.
    let mut by: Vec<(String, Option<Millis>, Totals)> = Vec::with_capacity(deltas.len());
    for (c, t) in deltas {
        let name = c.key.encode();
        match by.binary_search_by(|(n, _, _)| n.as_str().cmp(&name)) {
            Ok(i) => by[i].2.add(*t),
            Err(i) => by.insert(i, (name, counter_expiry(c), *t)),
        }
    }
    by.into_iter().map(|(name, expires, t)| MergedDelta { name, expires, values: t.values() }).collect()
}

fn add_values(to: &mut Values, v: &Values) {
    for (a, b) in to.iter_mut().zip(v) {
        *a = a.saturating_add(*b);
    }
}

fn sub_values(to: &mut Values, v: &Values) {
    for (a, b) in to.iter_mut().zip(v) {
        *a = a.saturating_sub(*b);
    }
}

/// What a counted request adds: one request.
fn one_request() -> Values {
    let mut v = [0; Field::ALL.len()];
    v[Field::Requests.index()] = 1;
    v
}

// ---------------------------------------------------------------- records

/// A record that may expire (`None` = never).
trait Expiring {
    fn expires(&self) -> Option<Millis>;
    fn expired(&self, now: Millis) -> bool {
        self.expires().is_some_and(|e| e <= now)
    }
}

/// `c:<counter>`: a counter's durable totals and pending deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterRecord {
    /// The projector's totals, exact.
    pub durable: Totals,
    /// Whether a durable footprint is stored (Redis: `t_sto_n` exists).
    pub footprint: bool,
    /// Settled but not folded, signed as `HINCRBY` keeps it.
    pub pending: Values,
    pub expires: Option<Millis>,
}

impl CounterRecord {
    /// `max(0, durable + pending)` of one field, as a check reads it.
    fn value(&self, f: Field) -> u128 {
        let v = durable_value(&self.durable, f) + i128::from(self.pending[f.index()]);
        u128::try_from(v).unwrap_or(0)
    }
}

/// `r:<counter>`: the reservations held on a counter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseRecord {
    /// Reservation id → lease end.
    pub leases: BTreeMap<ReservationId, Millis>,
    pub expires: Option<Millis>,
}

/// `e:<counter>`: what the reservations held on a counter hold there
/// besides one call (their checks' estimates), by reservation id. An entry
/// exists only beside the same reservation's lease in the counter's
/// [`LeaseRecord`], with the same expiry written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EstimateRecord {
    pub amounts: BTreeMap<ReservationId, Values>,
    pub expires: Option<Millis>,
}

/// `res:<rid>`: the counters a reservation holds; once released (settled or
/// freed), a tombstone until the hold would have expired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldRecord {
    /// Counter names ([`CounterKey::encode`]).
    pub counters: BTreeSet<String>,
    /// The reservation was released: a seed does not hold it again.
    pub released: bool,
    pub expires: Option<Millis>,
}

/// `ev:<event>`: what an event added to each counter's pending, or its
/// tombstone once folded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventRecord {
    /// Counter name → the amounts added there (none on a tombstone).
    pub deltas: Deltas,
    /// The event's fold reached the view: it adds nothing any more.
    pub folded: bool,
    pub expires: Option<Millis>,
}

/// An event's deltas by counter name, in name order: a map of the few
/// counters one event lands in, kept as one sorted vector (a map's node of
/// 13-value entries is larger than the allocator's per-thread caches take,
/// and one is made per event on the hot path).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deltas(Vec<(String, Values)>);

impl Deltas {
    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| n.as_str().cmp(name))
    }

    /// Sets `name`'s amounts, replacing any it had.
    pub fn insert(&mut self, name: String, values: Values) {
        match self.find(&name) {
            Ok(i) => self.0[i].1 = values,
            Err(i) => self.0.insert(i, (name, values)),
        }
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.find(name).is_ok()
    }

    pub fn get(&self, name: &str) -> Option<&Values> {
        self.find(name).ok().map(|i| &self.0[i].1)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The counters and their amounts, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Values)> {
        self.0.iter().map(|(n, v)| (n, v))
    }
}

impl IntoIterator for Deltas {
    type Item = (String, Values);
    type IntoIter = std::vec::IntoIter<(String, Values)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl FromIterator<(String, Values)> for Deltas {
    fn from_iter<I: IntoIterator<Item = (String, Values)>>(iter: I) -> Self {
        let mut d = Deltas::default();
        for (n, v) in iter {
            d.insert(n, v);
        }
        d
    }
}

macro_rules! expiring {
    ($($t:ty),*) => {$(
        impl Expiring for $t {
            fn expires(&self) -> Option<Millis> {
                self.expires
            }
        }
    )*};
}
expiring!(CounterRecord, LeaseRecord, EstimateRecord, HoldRecord, EventRecord);

/// `PEXPIREAT` unless the record already expires later (`extend_expiry`).
fn extend(expires: &mut Option<Millis>, until: Millis) {
    if expires.is_none_or(|e| e < until) {
        *expires = Some(until);
    }
}

/// The live record under `key`, dropping it first if it expired.
fn live<'a, K, Q, V>(map: &'a mut HashMap<K, V>, key: &Q, now: Millis) -> Option<&'a mut V>
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
fn live_or_new<'a, K, Q, V>(map: &'a mut HashMap<K, V>, key: &Q, now: Millis) -> &'a mut V
where
    K: Borrow<Q> + Hash + Eq,
    Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    V: Expiring + Default,
{
    // The key is cloned only for a record that is new.
    if map.get(key).is_none_or(|v| v.expired(now)) {
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key).expect("present: found live, or inserted above")
}

/// The live record under `key`, for reading.
fn live_ref<'a, K, Q, V>(map: &'a HashMap<K, V>, key: &Q, now: Millis) -> Option<&'a V>
where
    K: Borrow<Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    V: Expiring,
{
    map.get(key).filter(|v| !v.expired(now))
}

/// Drops `key` if its record is expired (after a write set its expiry).
fn drop_if_expired<K, Q, V>(map: &mut HashMap<K, V>, key: &Q, now: Millis)
where
    K: Borrow<Q> + Hash + Eq,
    Q: Hash + Eq + ?Sized,
    V: Expiring,
{
    if map.get(key).is_some_and(|v| v.expired(now)) {
        map.remove(key);
    }
}

/// The live records of a map, ordered, for a dump.
fn live_sorted<K: Ord + Clone, V: Expiring + Clone>(map: &HashMap<K, V>, now: Millis) -> BTreeMap<K, V> {
    map.iter().filter(|(_, v)| !v.expired(now)).map(|(k, v)| (k.clone(), v.clone())).collect()
}

// ---------------------------------------------------------------- a project

/// One project's state in one comparable form: its live records, as the
/// model, `MemoryView` and (read back key by key) `RedisView` hold them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProjectDump {
    pub loaded: bool,
    pub counters: BTreeMap<String, CounterRecord>,
    pub leases: BTreeMap<String, LeaseRecord>,
    pub estimates: BTreeMap<String, EstimateRecord>,
    pub holds: BTreeMap<ReservationId, HoldRecord>,
    pub events: BTreeMap<EventId, EventRecord>,
}

/// Everything the view holds for one project.
#[derive(Debug, Clone, Default)]
struct ProjectState {
    loaded: bool,
    counters: HashMap<String, CounterRecord>,
    leases: HashMap<String, LeaseRecord>,
    estimates: HashMap<String, EstimateRecord>,
    holds: HashMap<ReservationId, HoldRecord>,
    events: HashMap<EventId, EventRecord>,
}

impl ProjectState {
    fn records(&self) -> usize {
        self.counters.len() + self.leases.len() + self.estimates.len() + self.holds.len() + self.events.len()
    }

    /// Writes a counter (creating it), then sets its expiry (`expire_at`,
    /// which leaves it alone for a counter that never resets).
    fn write_counter(
        &mut self,
        name: &str,
        expires: Option<Millis>,
        now: Millis,
        write: impl FnOnce(&mut CounterRecord),
    ) {
        let c = live_or_new(&mut self.counters, name, now);
        write(c);
        if expires.is_some() {
            c.expires = expires;
        }
        drop_if_expired(&mut self.counters, name, now);
    }

    /// Raises a counter's durable totals to `t` (`raise_totals` +
    /// `expire_at`). On a missing counter, all-zero totals store nothing, so
    /// they create nothing.
    fn raise(&mut self, c: &Counter, t: Totals, now: Millis) {
        let name = c.key.encode();
        if t.is_zero() && live(&mut self.counters, name.as_str(), now).is_none() {
            return;
        }
        self.write_counter(&name, counter_expiry(c), now, |rec| {
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

    /// Lowers a counter's durable sums to `t` where they are above it
    /// (`lower.lua`): after a correction took usage back. A counter the view
    /// does not hold is left alone; the footprint is never touched.
    fn lower(&mut self, c: &Counter, t: Totals) {
        let name = c.key.encode();
        let Some(rec) = self.counters.get_mut(name.as_str()) else { return };
        let mut new = t;
        for f in Field::ALL {
            if f != Field::StorageEvents
                && let (Some(d), Some(n)) = (sum_field(&mut rec.durable, f), sum_field(&mut new, f))
            {
                *d = (*d).min(*n);
            }
        }
    }

    /// Takes back what an event added to pending, then forgets the event
    /// (`drop_event`). A counter that already expired is left alone.
    fn drop_event(&mut self, event: &EventId, now: Millis) {
        let Some(ev) = live(&mut self.events, event, now).map(std::mem::take) else { return };
        self.events.remove(event);
        for (name, v) in ev.deltas {
            if let Some(c) = live(&mut self.counters, name.as_str(), now) {
                sub_values(&mut c.pending, &v);
            }
        }
    }

    /// Drops what an event added, then leaves its tombstone (`fold_event`).
    fn fold_event(&mut self, event: &EventId, at: DateTime<Utc>, now: Millis) {
        self.drop_event(event, now);
        self.events.insert(
            event.clone(),
            EventRecord { folded: true, expires: Some(tombstone_expiry(at)), ..EventRecord::default() },
        );
        drop_if_expired(&mut self.events, event, now);
    }

    /// Adds one settled fact's deltas to pending unless the event is already
    /// indexed (pending, or a tombstone).
    fn add_pending(&mut self, s: &Settlement, at: DateTime<Utc>, now: Millis) {
        if live(&mut self.events, &s.event, now).is_some() {
            return; // already pending or folded: adds nothing
        }
        let mut wrote = false;
        for d in merged_deltas(&s.deltas) {
            if d.values.iter().all(|v| *v == 0) {
                continue;
            }
            self.write_counter(&d.name, d.expires, now, |rec| add_values(&mut rec.pending, &d.values));
            live_or_new(&mut self.events, &s.event, now).deltas.insert(d.name, d.values);
            wrote = true;
        }
        if wrote {
            self.expire_event(&s.event, at, now);
        }
    }

    /// Holds a reservation on counters until `lease_until`, as an admitted
    /// check does: one call on each, and `estimate` beside it unless zero.
    fn hold<'n>(
        &mut self,
        rid: &ReservationId,
        names: impl IntoIterator<Item = &'n String>,
        lease_until: DateTime<Utc>,
        estimate: &Values,
        now: Millis,
    ) {
        let lease = millis(lease_until);
        let until = lease_expiry(lease_until);
        let estimated = estimate.iter().any(|v| *v != 0);
        let mut held = false;
        for name in names {
            let z = live_or_new(&mut self.leases, name, now);
            z.leases.insert(rid.clone(), lease);
            extend(&mut z.expires, until);
            drop_if_expired(&mut self.leases, name, now);
            if estimated {
                let e = live_or_new(&mut self.estimates, name, now);
                e.amounts.insert(rid.clone(), *estimate);
                extend(&mut e.expires, until);
                drop_if_expired(&mut self.estimates, name, now);
            }
            live_or_new(&mut self.holds, rid, now).counters.insert(name.clone());
            held = true;
        }
        if held && let Some(h) = self.holds.get_mut(rid) {
            extend(&mut h.expires, until);
            drop_if_expired(&mut self.holds, rid, now);
        }
    }

    /// seed.lua: the durable totals, the tail's pending facts and live
    /// reservations, then the marker.
    fn seed(&mut self, seed: &Seed, at: DateTime<Utc>, now: Millis) {
        for (c, t) in &seed.totals {
            self.raise(c, *t, now);
        }
        for s in &seed.pending {
            self.add_pending(s, at, now);
        }
        let at_ms = millis(at);
        for h in seed.holds.iter().filter(|h| millis(h.lease_until) > at_ms) {
            if live_ref(&self.holds, &h.reservation, now).is_some() {
                continue; // held since the tail was read, or released since: not again
            }
            let names: Vec<String> = h.counters.iter().map(|c| c.key.encode()).collect();
            self.hold(&h.reservation, &names, h.lease_until, &h.estimate.totals().values(), now);
        }
        self.loaded = true;
    }

    /// Frees a reservation on every counter it holds (`release`) and leaves
    /// its hold as a tombstone, with the hold's expiry. A hold an unseeded
    /// project does not have (lost with a flush) becomes a tombstone until
    /// [`lost_hold_expiry`], so the seed to come, which may read its request
    /// event in the log tail without this release's call event, does not
    /// hold it again; a seeded project has no hold to restore (the check
    /// reserved nothing, or its lease is long over), so none is written.
    fn release(&mut self, rid: &ReservationId, at: DateTime<Utc>, now: Millis) {
        let Some(hold) = live(&mut self.holds, rid, now) else {
            if self.loaded {
                return;
            }
            self.holds.insert(
                rid.clone(),
                HoldRecord { released: true, expires: Some(lost_hold_expiry(at)), ..HoldRecord::default() },
            );
            drop_if_expired(&mut self.holds, rid, now);
            return;
        };
        hold.released = true;
        for name in std::mem::take(&mut hold.counters) {
            if let Some(z) = live(&mut self.leases, name.as_str(), now) {
                z.leases.remove(rid);
                if z.leases.is_empty() {
                    self.leases.remove(name.as_str());
                }
            }
            if let Some(e) = live(&mut self.estimates, name.as_str(), now) {
                e.amounts.remove(rid);
                if e.amounts.is_empty() {
                    self.estimates.remove(name.as_str());
                }
            }
        }
    }

    /// Sets an event index's expiry after a write (`PEXPIREAT`).
    fn expire_event(&mut self, event: &EventId, at: DateTime<Utc>, now: Millis) {
        if let Some(ev) = self.events.get_mut(event) {
            ev.expires = Some(event_expiry(at));
        }
        drop_if_expired(&mut self.events, event, now);
    }

    /// check.lua, on a seeded project and a validated plan.
    fn check(&mut self, plan: &CheckPlan, hold: &Hold, at: DateTime<Utc>, now: Millis) -> CheckOutcome {
        let names: Vec<String> = plan.counters.iter().map(|c| c.key.encode()).collect();
        let rid = &hold.reservation;
        let at_ms = millis(at);

        // Purge ended leases; count the request once per event and counter.
        let mut counted = false;
        for (i, c) in plan.counters.iter().enumerate() {
            if let Some(z) = live(&mut self.leases, names[i].as_str(), now) {
                let ended: Vec<ReservationId> =
                    z.leases.iter().filter(|(_, lease)| **lease <= at_ms).map(|(r, _)| r.clone()).collect();
                z.leases.retain(|_, lease| *lease > at_ms);
                if z.leases.is_empty() {
                    self.leases.remove(names[i].as_str());
                }
                if !ended.is_empty()
                    && let Some(e) = live(&mut self.estimates, names[i].as_str(), now)
                {
                    e.amounts.retain(|r, _| !ended.contains(r));
                    if e.amounts.is_empty() {
                        self.estimates.remove(names[i].as_str());
                    }
                }
            }
            if plan.count_request.contains(&i) {
                if live_ref(&self.events, &hold.request_event, now).is_some_and(|e| e.folded) {
                    continue; // folded: its request is in the durable total
                }
                let ev = live_or_new(&mut self.events, &hold.request_event, now);
                if !ev.deltas.contains_key(&names[i]) {
                    ev.deltas.insert(names[i].clone(), one_request());
                    self.write_counter(&names[i], counter_expiry(c), now, |rec| {
                        add_values(&mut rec.pending, &one_request());
                    });
                    counted = true;
                }
            }
        }
        if counted {
            self.expire_event(&hold.request_event, at, now);
        }

        // What each limit reads (live reservations without this check's own).
        let mut admitted = true;
        let mut used = Vec::with_capacity(plan.limits.len());
        let mut parts = Vec::with_capacity(plan.limits.len());
        for l in &plan.limits {
            let name = names[l.counter].as_str();
            let rec = live_ref(&self.counters, name, now);
            let value = |f: Field| rec.map_or(0, |c| c.value(f));
            let held = || {
                live_ref(&self.leases, name, now)
                    .map_or(0, |z| z.leases.iter().filter(|(r, lease)| **lease > at_ms && *r != rid).count())
            };
            let durable = |f: Field| rec.map_or(0, |c| u128::try_from(durable_value(&c.durable, f)).unwrap_or(0));
            // The estimates of the other live reservations, of one field.
            let estimated = |f: Field| -> u128 {
                let (Some(e), Some(z)) = (live_ref(&self.estimates, name, now), live_ref(&self.leases, name, now))
                else {
                    return 0;
                };
                e.amounts
                    .iter()
                    .filter(|(r, _)| *r != rid && z.leases.get(*r).is_some_and(|lease| *lease > at_ms))
                    .fold(0u128, |acc, (_, v)| acc.saturating_add(u128::try_from(v[f.index()]).unwrap_or(0)))
            };
            let (mut u, mut base, mut kept, mut reserved): (u128, u128, u128, u128) = (0, 0, 0, 0);
            for f in l.fields.iter() {
                u = u.saturating_add(value(*f));
                base = base.saturating_add(value(*f));
                kept = kept.saturating_add(durable(*f));
                if l.kind == LimitKind::Blackout {
                    continue;
                }
                let h = if *f == Field::Calls { held() as u128 } else { estimated(*f) };
                u = u.saturating_add(h);
                reserved = reserved.saturating_add(h);
            }
            if l.kind == LimitKind::Blackout && value(Field::LlmPriced) > 0 {
                u = 0;
            }
            let u = u64::try_from(u).unwrap_or(u64::MAX);
            used.push(u);
            let signed = |v: u128| i128::try_from(v).unwrap_or(i128::MAX);
            parts.push(meter_parts(kept, signed(base) - signed(kept), reserved));
            if l.enforce && l.kind != LimitKind::Probe && u.saturating_add(l.need) > l.limit {
                admitted = false;
            }
        }

        if admitted {
            let reserved = names.iter().enumerate().filter(|(i, _)| plan.reserves(*i)).map(|(_, n)| n);
            self.hold(rid, reserved, hold.lease_until, &plan.estimate.totals().values(), now);
        }

        CheckOutcome { admitted, used, parts }
    }

    /// settle.lua.
    fn settle(&mut self, settlements: &[Settlement], at: DateTime<Utc>, now: Millis) {
        for s in settlements {
            if let Some(rid) = &s.reservation {
                self.release(rid, at, now);
            }
            self.add_pending(s, at, now);
        }
    }

    /// usage.lua (writes nothing; ended leases are not counted).
    fn usage(&self, counter: &CounterKey, at: DateTime<Utc>, now: Millis) -> CounterUsage {
        let name = counter.encode();
        let (durable, pending) = live_ref(&self.counters, name.as_str(), now)
            .map(|c| (c.durable, Totals::from_values(&c.pending)))
            .unwrap_or_default();
        let at_ms = millis(at);
        let leases = live_ref(&self.leases, name.as_str(), now);
        let reserved = leases.map_or(0, |z| z.leases.values().filter(|lease| **lease > at_ms).count());
        let mut estimates: Values = [0; Field::ALL.len()];
        if let (Some(z), Some(e)) = (leases, live_ref(&self.estimates, name.as_str(), now)) {
            for (rid, v) in &e.amounts {
                if z.leases.get(rid).is_some_and(|lease| *lease > at_ms) {
                    add_values(&mut estimates, v);
                }
            }
        }
        CounterUsage { durable, pending, reserved_calls: reserved as u64, reserved: Totals::from_values(&estimates) }
    }

    fn dump(&self, now: Millis) -> ProjectDump {
        ProjectDump {
            loaded: self.loaded,
            counters: live_sorted(&self.counters, now),
            leases: live_sorted(&self.leases, now),
            estimates: live_sorted(&self.estimates, now),
            holds: live_sorted(&self.holds, now),
            events: live_sorted(&self.events, now),
        }
    }

    /// Forgets expired records; whether anything is left.
    fn sweep(&mut self, now: Millis) -> bool {
        self.counters.retain(|_, v| !v.expired(now));
        self.leases.retain(|_, v| !v.expired(now) && !v.leases.is_empty());
        self.estimates.retain(|_, v| !v.expired(now) && !v.amounts.is_empty());
        self.holds.retain(|_, v| !v.expired(now));
        self.events.retain(|_, v| !v.expired(now));
        self.loaded || self.records() > 0
    }
}

// ---------------------------------------------------------------- the view

/// The view's state machine: every project's records and the view's clock.
/// Each method is one atomic operation of [`View`](crate::View) (one script
/// in Redis), with the time made explicit.
#[derive(Debug, Clone)]
pub struct ViewModel {
    /// The latest `at` any operation was given.
    clock: Millis,
    projects: HashMap<ProjectId, ProjectState>,
}

impl Default for ViewModel {
    fn default() -> Self {
        ViewModel { clock: millis(DateTime::<Utc>::MIN_UTC), projects: HashMap::default() }
    }
}

impl ViewModel {
    /// An empty view: every project is unseeded, and no time has passed.
    pub fn new() -> ViewModel {
        ViewModel::default()
    }

    /// The view's clock: the latest `at` it was given (the earliest instant
    /// before any). An adapter whose port gives an operation no time passes
    /// this.
    pub fn now(&self) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(self.clock).unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    /// Moves the clock to `at`, never back.
    fn advance(&mut self, at: DateTime<Utc>) -> Millis {
        self.clock = self.clock.max(millis(at));
        self.clock
    }

    /// [`View::check`](crate::View::check): `None` when the project is not
    /// seeded (nothing changes); an error, changing nothing, for a malformed
    /// plan.
    pub fn check(
        &mut self,
        project: &ProjectId,
        plan: &CheckPlan,
        hold: &Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CheckOutcome>> {
        validate_plan(plan)?;
        let now = self.advance(at);
        Ok(match self.projects.get_mut(project) {
            Some(p) if p.loaded => Some(p.check(plan, hold, at, now)),
            _ => None,
        })
    }

    /// [`View::seed`](crate::View::seed): raises durable totals, adds the
    /// tail's pending facts (not over an indexed or folded event) and holds
    /// its live reservations, and marks the project seeded.
    pub fn seed(&mut self, project: &ProjectId, seed: &Seed, at: DateTime<Utc>) {
        let now = self.advance(at);
        self.projects.entry(project.clone()).or_default().seed(seed, at, now);
    }

    /// [`View::settle`](crate::View::settle).
    pub fn settle(&mut self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) {
        let now = self.advance(at);
        if settlements.is_empty() {
            return;
        }
        self.projects.entry(project.clone()).or_default().settle(settlements, at, now);
    }

    /// [`View::unsettle`](crate::View::unsettle).
    pub fn unsettle(&mut self, project: &ProjectId, events: &[EventId], at: DateTime<Utc>) {
        let now = self.advance(at);
        if let Some(p) = self.projects.get_mut(project) {
            for e in events {
                p.drop_event(e, now);
            }
        }
    }

    /// [`View::release`](crate::View::release).
    pub fn release(&mut self, project: &ProjectId, reservation: &ReservationId, at: DateTime<Utc>) {
        let now = self.advance(at);
        self.projects.entry(project.clone()).or_default().release(reservation, at, now);
    }

    /// [`View::apply_fold`](crate::View::apply_fold): raises durable totals,
    /// then drops the pending deltas of the folded events and leaves their
    /// tombstones.
    pub fn apply_fold(
        &mut self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
        at: DateTime<Utc>,
    ) {
        let now = self.advance(at);
        if totals.is_empty() && events.is_empty() {
            return;
        }
        let p = self.projects.entry(project.clone()).or_default();
        for (c, t) in totals {
            p.raise(c, *t, now);
        }
        for e in events {
            p.fold_event(e, at, now);
        }
    }

    /// [`View::lower_totals`](crate::View::lower_totals).
    pub fn lower_totals(&mut self, project: &ProjectId, totals: &[(Counter, Totals)], at: DateTime<Utc>) {
        let now = self.advance(at);
        let Some(p) = self.projects.get_mut(project) else { return };
        for (c, t) in totals {
            if live(&mut p.counters, c.key.encode().as_str(), now).is_some() {
                p.lower(c, *t);
            }
        }
    }

    /// [`View::usage`](crate::View::usage): `None` when not seeded.
    pub fn usage(&mut self, project: &ProjectId, counter: &CounterKey, at: DateTime<Utc>) -> Option<CounterUsage> {
        let now = self.advance(at);
        self.projects.get(project).filter(|p| p.loaded).map(|p| p.usage(counter, at, now))
    }

    /// One project's live records, in one comparable form.
    pub fn dump(&self, project: &ProjectId) -> ProjectDump {
        self.projects.get(project).map(|p| p.dump(self.clock)).unwrap_or_default()
    }

    /// Forgets every expired record, and the projects left with nothing
    /// (an unseeded project with no live record is no different from an
    /// unknown one). Changes no answer and no dump: it only frees memory.
    pub fn sweep(&mut self) {
        let now = self.clock;
        self.projects.retain(|_, p| p.sweep(now));
    }

    /// How many records (counters, lease sets, holds, event indexes, and one
    /// per project) the model holds, expired ones not swept yet included.
    pub fn records(&self) -> usize {
        self.projects.values().map(|p| 1 + p.records()).sum()
    }
}

#[cfg(test)]
mod tests {
    use chrono::Duration as Span;

    use super::*;
    use crate::admission::PlannedLimit;
    use crate::quota::Metric;
    use crate::usage::Dimension;
    use crate::window::WindowKind;

    fn t0() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2030-01-01T00:00:00Z").expect("timestamp").with_timezone(&Utc)
    }

    fn project() -> ProjectId {
        ProjectId::parse("p1").expect("project id")
    }

    fn day_counter(resets_at: DateTime<Utc>) -> Counter {
        Counter {
            key: CounterKey { dimension: Dimension::Project, window: WindowKind::Day, window_key: "d".into() },
            resets_at: Some(resets_at),
        }
    }

    fn hold(n: u32, lease_until: DateTime<Utc>) -> Hold {
        Hold {
            reservation: ReservationId::parse(format!("r{n}")).expect("id"),
            request_event: EventId::parse(format!("q{n}")).expect("id"),
            lease_until,
        }
    }

    /// Counts the request and caps calls at `limit` on one counter.
    fn plan(c: &Counter, calls: u64) -> CheckPlan {
        let cap = |metric, fields: Vec<Field>, limit, need, reserve| PlannedLimit {
            quota: 0,
            counter: 0,
            metric,
            kind: LimitKind::Cap,
            fields: fields.into(),
            limit,
            need,
            enforce: true,
            reserve,
        };
        CheckPlan {
            counters: vec![c.clone()],
            limits: vec![
                cap(Metric::Requests, vec![Field::Requests], 100, 0, false),
                cap(Metric::Calls, vec![Field::Calls], calls, 1, true),
            ],
            count_request: vec![0],
            windows: Vec::new(),
            estimate: crate::Estimate::default(),
        }
    }

    /// Caps tokens at `limit` on one counter, reserving `estimate` tokens.
    fn token_plan(c: &Counter, limit: u64, estimate: u64) -> CheckPlan {
        CheckPlan {
            counters: vec![c.clone()],
            limits: vec![PlannedLimit {
                quota: 0,
                counter: 0,
                metric: Metric::Tokens,
                kind: LimitKind::Cap,
                fields: vec![Field::Tokens].into(),
                limit,
                need: estimate,
                enforce: true,
                reserve: true,
            }],
            count_request: Vec::new(),
            windows: Vec::new(),
            estimate: crate::Estimate { tokens: estimate, cost: 0 },
        }
    }

    /// An estimate is held with the lease: other checks read it until the
    /// settle replaces it with the actual tokens, or the lease ends.
    #[test]
    fn an_estimate_is_reserved_until_settled_or_its_lease_ends() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(1));
        v.seed(&p, &Seed::default(), t0());
        let first = hold(1, t0() + Span::seconds(10));
        let o = v.check(&p, &token_plan(&c, 100, 60), &first, t0()).expect("valid").expect("seeded");
        assert!(o.admitted);
        // 60 held + 41 > 100: refused, reserving nothing; 40 fits.
        let o = v.check(&p, &token_plan(&c, 100, 41), &hold(2, t0() + Span::seconds(10)), t0()).expect("v").expect("s");
        assert_eq!((o.admitted, o.used, o.parts[0].reserved), (false, vec![60], 60));
        let third = hold(3, t0() + Span::seconds(20));
        assert!(v.check(&p, &token_plan(&c, 100, 40), &third, t0()).expect("v").expect("s").admitted);
        // A retry of the first reads the others' estimates, not its own.
        let o = v.check(&p, &token_plan(&c, 100, 60), &first, t0()).expect("v").expect("s");
        assert_eq!((o.admitted, o.used), (true, vec![40]));
        // The first settles with 10 actual tokens: its 60 are replaced.
        let actual = Settlement {
            event: EventId::parse("t1").expect("id"),
            reservation: Some(first.reservation.clone()),
            deltas: vec![(c.clone(), Totals { tokens: 10, ..Totals::default() })],
        };
        v.settle(&p, &[actual], t0());
        let o = v.check(&p, &token_plan(&c, 100, 50), &hold(4, t0() + Span::seconds(30)), t0()).expect("v").expect("s");
        assert_eq!((o.admitted, o.used, o.parts[0].reserved), (true, vec![50], 40), "10 settled + 40 held");
        // Past the third's lease only the fourth's 50 and the 10 are read.
        let later = t0() + Span::seconds(25);
        let o =
            v.check(&p, &token_plan(&c, 100, 41), &hold(5, later + Span::seconds(5)), later).expect("v").expect("s");
        assert_eq!((o.admitted, o.used), (false, vec![60]));
        let d = v.dump(&p);
        let held = &d.estimates[&c.key.encode()].amounts;
        assert!(!held.contains_key(&third.reservation), "the ended lease's estimate is purged: {held:?}");
        assert!(!held.contains_key(&first.reservation), "the settled one's is released");
    }

    #[test]
    fn the_clock_never_runs_backwards() {
        let mut v = ViewModel::new();
        assert_eq!(v.now(), DateTime::<Utc>::MIN_UTC);
        let p = project();
        v.seed(&p, &Seed::default(), t0());
        v.usage(&p, &day_counter(t0()).key, t0() - Span::days(1));
        assert_eq!(v.now(), t0());
    }

    #[test]
    fn a_zero_total_creates_no_counter_and_a_past_expiry_removes_one() {
        let mut v = ViewModel::new();
        let p = project();
        let live = day_counter(t0() + Span::days(1));
        v.seed(&p, &Seed::of_totals(vec![(live.clone(), Totals::default())]), t0());
        assert!(v.dump(&p).counters.is_empty(), "nothing stored, nothing created");
        // A window that reset more than the grace ago: written, then gone at once.
        let closed = day_counter(t0() - Span::hours(2));
        v.apply_fold(&p, &[(closed, Totals { calls: 1, ..Totals::default() })], &[], t0());
        assert!(v.dump(&p).counters.is_empty());
        v.apply_fold(&p, &[(live.clone(), Totals { calls: 1, ..Totals::default() })], &[], t0());
        let dump = v.dump(&p);
        let rec = dump.counters.get(&live.key.encode()).expect("stored");
        assert_eq!((rec.durable.calls, rec.expires), (1, counter_expiry(&live)));
    }

    #[test]
    fn an_admitted_check_holds_until_its_lease_ends_or_it_is_released() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(1));
        v.seed(&p, &Seed::default(), t0());
        let pl = plan(&c, 1);
        let first = hold(1, t0() + Span::seconds(10));
        let o = v.check(&p, &pl, &first, t0()).expect("valid").expect("seeded");
        assert_eq!((o.admitted, o.used), (true, vec![1, 0]));
        let d = v.dump(&p);
        assert_eq!(d.holds[&first.reservation].expires, Some(hold_expiry(&first)));
        assert_eq!(d.events[&first.request_event].expires, Some(event_expiry(t0())));
        let o = v.check(&p, &pl, &hold(2, t0() + Span::seconds(10)), t0()).expect("valid").expect("seeded");
        assert_eq!((o.admitted, &o.used), (false, &vec![2, 1]));
        // The requests are settled (pending), the call is the first check's
        // live reservation.
        let split = |durable, settled, reserved| crate::UsageParts { durable, settled, reserved };
        assert_eq!(o.parts, vec![split(0, 2, 0), split(0, 0, 1)]);
        // The lease ended: the next check purges it and takes the slot.
        let later = t0() + Span::seconds(11);
        let third = hold(3, later + Span::seconds(10));
        assert!(v.check(&p, &pl, &third, later).expect("valid").expect("seeded").admitted);
        assert_eq!(v.dump(&p).leases[&c.key.encode()].leases.len(), 1, "the ended lease was purged");
        v.release(&p, &third.reservation, later);
        let d = v.dump(&p);
        assert!(d.leases.is_empty());
        let tomb = &d.holds[&third.reservation];
        assert!(tomb.released && tomb.counters.is_empty(), "a released hold is a tombstone");
        assert_eq!(tomb.expires, Some(hold_expiry(&third)), "until the hold would have expired");
    }

    #[test]
    fn a_malformed_plan_changes_nothing() {
        let mut v = ViewModel::new();
        let p = project();
        v.seed(&p, &Seed::default(), t0());
        let mut pl = plan(&day_counter(t0() + Span::days(1)), 1);
        pl.limits[1].counter = 1;
        let before = v.dump(&p);
        assert!(v.check(&p, &pl, &hold(1, t0()), t0()).is_err());
        assert_eq!(v.dump(&p), before);
    }

    #[test]
    fn sweeping_changes_no_dump() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::hours(1));
        v.seed(&p, &Seed::of_totals(vec![(c.clone(), Totals { rows: 3, ..Totals::default() })]), t0());
        v.check(&p, &plan(&c, 5), &hold(1, t0() + Span::seconds(30)), t0()).expect("valid");
        let s = Settlement {
            event: EventId::parse("e1").expect("id"),
            reservation: None,
            deltas: vec![(c.clone(), Totals { calls: 1, ..Totals::default() })],
        };
        v.settle(&p, &[s], t0());
        for later in [t0(), t0() + Span::hours(3), t0() + Span::days(8)] {
            v.usage(&p, &c.key, later);
            let before = v.dump(&p);
            v.sweep();
            assert_eq!(v.dump(&p), before, "at {later}");
        }
        assert_eq!(v.records(), 1, "only the project's loaded marker is left");
    }

    fn call_settlement(event: &str, c: &Counter, rid: Option<&Hold>) -> Settlement {
        Settlement {
            event: EventId::parse(event).expect("id"),
            reservation: rid.map(|h| h.reservation.clone()),
            deltas: vec![(c.clone(), Totals { calls: 1, rows: 2, ..Totals::default() })],
        }
    }

    fn pending_calls(v: &mut ViewModel, c: &Counter, at: DateTime<Utc>) -> (u64, u64) {
        let u = v.usage(&project(), &c.key, at).expect("seeded");
        (u.durable.calls, u.pending.calls)
    }

    /// A fold leaves a tombstone: a settle of the folded event after it adds
    /// nothing (the durable total holds it), until the tombstone lapses.
    #[test]
    fn a_late_settle_after_its_fold_adds_nothing() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(3));
        v.seed(&p, &Seed::default(), t0());
        let e = call_settlement("e1", &c, None);
        v.settle(&p, std::slice::from_ref(&e), t0());
        assert_eq!(pending_calls(&mut v, &c, t0()), (0, 1));
        let folded = [(c.clone(), Totals { calls: 1, rows: 2, ..Totals::default() })];
        v.apply_fold(&p, &folded, std::slice::from_ref(&e.event), t0());
        assert_eq!(pending_calls(&mut v, &c, t0()), (1, 0));
        let tomb = &v.dump(&p).events[&e.event];
        assert!(tomb.folded && tomb.deltas.is_empty());
        assert_eq!(tomb.expires, Some(tombstone_expiry(t0())));
        // The late settle (a resend, a reseed's tail) and a fold again: nothing.
        v.settle(&p, std::slice::from_ref(&e), t0() + Span::seconds(1));
        v.apply_fold(&p, &folded, std::slice::from_ref(&e.event), t0() + Span::seconds(2));
        assert_eq!(pending_calls(&mut v, &c, t0() + Span::seconds(2)), (1, 0));
        // A fold that reaches the view before the settle: the settle adds nothing either.
        let early = EventId::parse("e2").expect("id");
        let two = [(c.clone(), Totals { calls: 2, rows: 4, ..Totals::default() })];
        v.apply_fold(&p, &two, std::slice::from_ref(&early), t0() + Span::seconds(3));
        v.settle(&p, &[call_settlement("e2", &c, None)], t0() + Span::seconds(4));
        assert_eq!(pending_calls(&mut v, &c, t0() + Span::seconds(4)), (2, 0));
        // Past the tombstone's life the event is unknown again.
        let later = t0() + Span::seconds(3) + Span::from_std(TOMBSTONE_TTL).expect("ttl");
        assert!(!v.dump(&p).events.is_empty());
        v.usage(&p, &c.key, later);
        assert!(!v.dump(&p).events.contains_key(&early));
    }

    /// A check whose request event was already folded counts no request again.
    #[test]
    fn a_folded_request_event_is_not_counted_again() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(1));
        v.seed(&p, &Seed::default(), t0());
        let h = hold(1, t0() + Span::seconds(30));
        let requests = [(c.clone(), Totals { requests: 1, ..Totals::default() })];
        v.apply_fold(&p, &requests, std::slice::from_ref(&h.request_event), t0());
        let o = v.check(&p, &plan(&c, 5), &h, t0()).expect("valid").expect("seeded");
        assert_eq!(o.used[0], 1, "the durable request, not counted again");
    }

    /// A seed adds the tail's facts as settles do (not over an event already
    /// pending or folded) and holds its live reservations; a hold whose
    /// lease ended is left out.
    #[test]
    fn a_seed_restores_pending_facts_and_live_reservations() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(1));
        // Before the seed: one settle reached the flushed view, one fold too.
        v.settle(&p, &[call_settlement("e1", &c, None)], t0());
        v.apply_fold(
            &p,
            &[(c.clone(), Totals { calls: 1, rows: 2, ..Totals::default() })],
            &[EventId::parse("e3").expect("id")],
            t0(),
        );
        assert_eq!(v.usage(&p, &c.key, t0()), None, "not seeded yet");
        let live = crate::view::SeedHold {
            reservation: ReservationId::parse("r1").expect("id"),
            lease_until: t0() + Span::seconds(30),
            counters: vec![c.clone()],
            estimate: Default::default(),
        };
        let ended = crate::view::SeedHold {
            reservation: ReservationId::parse("r2").expect("id"),
            lease_until: t0(),
            counters: vec![c.clone()],
            estimate: Default::default(),
        };
        let seed = Seed {
            totals: vec![(c.clone(), Totals::default())],
            pending: ["e1", "e2", "e3"].iter().map(|e| call_settlement(e, &c, None)).collect(),
            holds: vec![live, ended],
        };
        v.seed(&p, &seed, t0());
        let u = v.usage(&p, &c.key, t0()).expect("seeded");
        assert_eq!((u.durable.calls, u.pending.calls, u.reserved_calls), (1, 2, 1));
        // The restored reservation is settled like any other.
        let h = Hold {
            reservation: ReservationId::parse("r1").expect("id"),
            request_event: EventId::parse("q").expect("id"),
            lease_until: t0() + Span::seconds(30),
        };
        v.settle(&p, &[call_settlement("e4", &c, Some(&h))], t0());
        let u = v.usage(&p, &c.key, t0()).expect("seeded");
        assert_eq!((u.pending.calls, u.reserved_calls), (3, 0));
    }

    /// Two gateways on one view: the second one's seed read a reservation
    /// of the first one's in the log tail, and the first one's caller
    /// settled it before that seed reached the view. The seed does not hold
    /// it again: the call counts once (its pending), not twice until the
    /// lease ends (which refused calls under the limit).
    #[test]
    fn a_seed_does_not_hold_again_a_reservation_settled_since_the_tail_was_read() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(1));
        v.seed(&p, &Seed::default(), t0());
        let h = hold(1, t0() + Span::seconds(30));
        assert!(v.check(&p, &plan(&c, 2), &h, t0()).expect("valid").expect("seeded").admitted);
        // The second seed's tail, read now: the request event's hold.
        let tail_hold = crate::view::SeedHold {
            reservation: h.reservation.clone(),
            lease_until: h.lease_until,
            counters: vec![c.clone()],
            estimate: Default::default(),
        };
        // The first gateway settles the call; then the second seed lands.
        v.settle(&p, &[call_settlement("call", &c, Some(&h))], t0());
        v.seed(&p, &Seed { holds: vec![tail_hold.clone()], ..Seed::default() }, t0());
        let u = v.usage(&p, &c.key, t0()).expect("seeded");
        assert_eq!((u.pending.calls, u.reserved_calls), (1, 0), "counted once");
        // A reservation still held when the seed lands is held once.
        let h2 = hold(2, t0() + Span::seconds(30));
        assert!(v.check(&p, &plan(&c, 3), &h2, t0()).expect("valid").expect("seeded").admitted);
        let again = crate::view::SeedHold { reservation: h2.reservation.clone(), ..tail_hold };
        v.seed(&p, &Seed { holds: vec![again], ..Seed::default() }, t0());
        assert_eq!(v.usage(&p, &c.key, t0()).expect("seeded").reserved_calls, 1);
    }

    /// Redis flushed while two calls were admitted. One call's settle, and
    /// the other's release, reach the empty view before its seed, whose
    /// log tail holds both request events but neither call event (the
    /// settle publishes after it writes the view). The seed holds neither
    /// reservation again: without the tombstones both counted until their
    /// leases ended.
    #[test]
    fn a_hold_released_after_a_flush_is_not_held_again_by_the_seed() {
        let mut v = ViewModel::new();
        let p = project();
        let c = day_counter(t0() + Span::days(1));
        let (settled, freed) = (hold(1, t0() + Span::seconds(30)), hold(2, t0() + Span::seconds(30)));
        v.settle(&p, &[call_settlement("call", &c, Some(&settled))], t0());
        v.release(&p, &freed.reservation, t0());
        let tail_hold = |h: &Hold| crate::view::SeedHold {
            reservation: h.reservation.clone(),
            lease_until: h.lease_until,
            counters: vec![c.clone()],
            estimate: Default::default(),
        };
        let seed = Seed { holds: vec![tail_hold(&settled), tail_hold(&freed)], ..Seed::default() };
        v.seed(&p, &seed, t0());
        let u = v.usage(&p, &c.key, t0()).expect("seeded");
        assert_eq!((u.pending.calls, u.reserved_calls), (1, 0), "the settled call counts once, the freed one not");
        let tombstone = HoldRecord { released: true, expires: Some(lost_hold_expiry(t0())), ..HoldRecord::default() };
        assert_eq!(v.dump(&p).holds.get(&settled.reservation), Some(&tombstone));
        assert_eq!(lost_hold_expiry(t0()), millis(t0() + Span::hours(1)), "LEASE_GRACE after the release");
        // Seeded now: a call that reserved nothing leaves no record.
        let unreserved = hold(3, t0() + Span::seconds(30));
        v.settle(&p, &[call_settlement("other", &c, Some(&unreserved))], t0());
        v.release(&p, &hold(4, t0() + Span::seconds(30)).reservation, t0());
        assert_eq!(v.dump(&p).holds.len(), 2, "the two tombstones of before: {:?}", v.dump(&p).holds);
    }

    /// A settlement naming a counter twice adds the sum there once, and
    /// the deltas come in name order whatever order they were named in.
    #[test]
    fn merged_deltas_sum_a_counter_named_twice_in_name_order() {
        let c = day_counter(t0() + Span::days(1));
        let k =
            Counter { key: CounterKey { dimension: Dimension::AllApiKeys, ..c.key.clone() }, resets_at: c.resets_at };
        let calls = |n| Totals { calls: n, ..Totals::default() };
        let merged = merged_deltas(&[(k.clone(), calls(1)), (c.clone(), calls(2)), (k.clone(), calls(4))]);
        let names: Vec<&str> = merged.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["k*|day|d", "p|day|d"]);
        assert_eq!(merged[0].values[Field::Calls.index()], 5);
        assert_eq!(merged[1].values[Field::Calls.index()], 2);
        assert_eq!(merged[0].expires, counter_expiry(&k));
    }

    /// An event's deltas compare equal whatever order they were written in
    /// (the memory view's against the Redis view's dump), and a name
    /// written again is replaced, not added beside the first.
    #[test]
    fn deltas_are_a_map_in_name_order() {
        let v = |n: i64| {
            let mut v: Values = [0; Field::ALL.len()];
            v[0] = n;
            v
        };
        let mut a = Deltas::default();
        a.insert("b".into(), v(2));
        a.insert("a".into(), v(1));
        let b: Deltas = [("a".to_owned(), v(9)), ("b".to_owned(), v(2)), ("a".to_owned(), v(1))].into_iter().collect();
        assert_eq!(a, b);
        assert_eq!(a.len(), 2);
        assert!(a.contains_key("a") && !a.contains_key("c"));
        assert_eq!(a.get("b"), Some(&v(2)));
        assert_eq!(a.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }
}
