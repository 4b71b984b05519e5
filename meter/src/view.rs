//! What the hot-path view exchanges with its callers: a check's hold, a
//! settled fact, and a counter's usage as the view sees it; and, in
//! [`model`], the view's rules: its reference state machine, which
//! `MemoryView` runs and `RedisView`'s scripts are checked against.

pub mod model;
pub mod tail;

pub use model::{
    COUNTER_GRACE, EVENT_INDEX_TTL, LEASE_GRACE, Millis, ProjectDump, TOMBSTONE_TTL, Values, ViewModel, counter_expiry,
    event_expiry, hold_expiry, tombstone_expiry,
};
pub use tail::seed_from_tail;

use chrono::{DateTime, Utc};

use crate::ids::{EventId, ReservationId};
use crate::usage::{Counter, Totals};

/// What an admitted check holds, and the request event it counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub reservation: ReservationId,
    pub request_event: EventId,
    pub lease_until: DateTime<Utc>,
}

/// A settled fact for the view: its deltas become pending until folded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub event: EventId,
    pub reservation: Option<ReservationId>,
    pub deltas: Vec<(Counter, Totals)>,
}

/// What a (re)seed writes into a project's view, in one step: the durable
/// totals as of some log offsets, and what the log holds past them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seed {
    pub totals: Vec<(Counter, Totals)>,
    /// Facts of the log tail not folded yet, added as a settle adds them
    /// (no reservation is released by them: the tail's settled
    /// reservations are left out of `holds` instead).
    pub pending: Vec<Settlement>,
    /// Reservations of the tail's admitted request events that no call
    /// event of the tail settled.
    pub holds: Vec<SeedHold>,
}

impl Seed {
    /// A seed of durable totals alone (nothing unfolded, nothing held).
    pub fn of_totals(totals: Vec<(Counter, Totals)>) -> Seed {
        Seed { totals, ..Seed::default() }
    }
}

/// A live reservation a seed restores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedHold {
    pub reservation: ReservationId,
    pub lease_until: DateTime<Utc>,
    /// The counters it holds (its check's reserving counters).
    pub counters: Vec<Counter>,
    /// What it holds on each of them besides one call.
    pub estimate: crate::admission::Estimate,
}

/// A counter as the view sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterUsage {
    pub durable: Totals,
    pub pending: Totals,
    pub reserved_calls: u64,
    /// What the live reservations hold besides their calls: the sum of
    /// their checks' estimates (tokens, cost).
    pub reserved: Totals,
}
