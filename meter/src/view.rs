//! What the hot-path view exchanges with its callers: a check's hold, a
//! settled fact, and a counter's usage as the view sees it; and, in
//! [`model`], the view's rules: its reference state machine, which
//! `MemoryView` runs and `RedisView`'s scripts are checked against.

pub mod model;

pub use model::{
    COUNTER_GRACE, EVENT_INDEX_TTL, LEASE_GRACE, Millis, ProjectDump, Values, ViewModel, counter_expiry, event_expiry,
    hold_expiry,
};

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

/// A counter as the view sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterUsage {
    pub durable: Totals,
    pub pending: Totals,
    pub reserved_calls: u64,
}
