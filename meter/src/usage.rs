//! Usage facts and the counters they land in.
//!
//! A usage fact is the domain form of one event on the log. Where it counts
//! is decided here, once, for the projector's fold, the gateway's settle and
//! the check alike: the same fact always maps to the same counters, which is
//! what lets the view drop a pending delta exactly when its event is folded.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::ids::{ApiKeyId, EventId, ProjectId, ReservationId};
use crate::quota::FieldError;
use crate::window::{WindowKind, window_at};

/// What an event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A request reached the check (counted even when refused).
    Request,
    /// A call finished; with outcome `success` it counts one call and its rows.
    Call,
    Tokens,
    StorageDelta,
    StorageSnapshot,
    Correction,
}

impl EventKind {
    pub const ALL: [EventKind; 6] = [
        EventKind::Request,
        EventKind::Call,
        EventKind::Tokens,
        EventKind::StorageDelta,
        EventKind::StorageSnapshot,
        EventKind::Correction,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Request => "request",
            EventKind::Call => "call",
            EventKind::Tokens => "tokens",
            EventKind::StorageDelta => "storage_delta",
            EventKind::StorageSnapshot => "storage_snapshot",
            EventKind::Correction => "correction",
        }
    }
    /// Whether this release folds this kind. The others are part of the
    /// schema; an event of such a kind is refused at the API and dead-lettered
    /// by the projector rather than silently ignored.
    pub fn is_folded(self) -> bool {
        matches!(self, EventKind::Request | EventKind::Call)
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EventKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or(())
    }
}

/// How a call ended. Only successful calls that returned data are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    #[default]
    Success,
    Failure,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "failure",
        }
    }
}

impl FromStr for Outcome {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "success" => Ok(Outcome::Success),
            "failure" => Ok(Outcome::Failure),
            _ => Err(()),
        }
    }
}

/// One usage fact, as it is on the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageFact {
    pub id: EventId,
    pub project_id: ProjectId,
    pub api_key_id: Option<ApiKeyId>,
    pub agent_id: Option<String>,
    pub actor_id: Option<String>,
    pub occurred_at: DateTime<Utc>,
    pub kind: EventKind,
    pub outcome: Outcome,
    pub rows: u64,
    pub reservation_id: Option<ReservationId>,
    /// The gateway instance that emitted it.
    pub gateway: String,
}

/// How far back an event may be and still be counted (and deduplicated).
pub const DEFAULT_DEDUP_HORIZON: Duration = Duration::days(35);
/// How far ahead of the clock an event may claim to be.
pub const MAX_FUTURE_SKEW: Duration = Duration::minutes(5);

/// Why a fact cannot be counted, as a DLQ reason or an API error.
pub fn check_fact_time(
    occurred_at: DateTime<Utc>,
    at: DateTime<Utc>,
    horizon: Duration,
) -> Result<(), FieldError> {
    if occurred_at > at + MAX_FUTURE_SKEW {
        return Err(FieldError::new("occurred_at", "is more than 5 minutes in the future"));
    }
    if occurred_at < at - horizon {
        return Err(FieldError::new(
            "occurred_at",
            format!("is older than the dedup horizon of {} days", horizon.num_days()),
        ));
    }
    Ok(())
}

/// Checks what the fold needs of a fact beyond its types.
pub fn check_fact(fact: &UsageFact) -> Result<(), FieldError> {
    if !fact.kind.is_folded() {
        return Err(FieldError::new("type", format!("{} events are not metered by this release", fact.kind)));
    }
    if fact.kind == EventKind::Request && fact.rows != 0 {
        return Err(FieldError::new("rows", "a request event carries no rows"));
    }
    if fact.rows > i64::MAX as u64 {
        return Err(FieldError::new("rows", "is too large"));
    }
    Ok(())
}

/// The population a counter counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Dimension {
    /// The whole project.
    Project,
    /// All key-authenticated traffic of the project (`api_key`, null ref).
    AllApiKeys,
    /// One API key.
    ApiKey(ApiKeyId),
    /// One end user.
    Actor(String),
}

impl Dimension {
    /// A stable, compact string for storage keys: `p`, `k*`, `k:<id>`, `a:<id>`.
    pub fn encode(&self) -> String {
        match self {
            Dimension::Project => "p".to_owned(),
            Dimension::AllApiKeys => "k*".to_owned(),
            Dimension::ApiKey(k) => format!("k:{k}"),
            Dimension::Actor(a) => format!("a:{a}"),
        }
    }

    pub fn decode(s: &str) -> Option<Dimension> {
        match s {
            "p" => Some(Dimension::Project),
            "k*" => Some(Dimension::AllApiKeys),
            _ => {
                if let Some(k) = s.strip_prefix("k:") {
                    ApiKeyId::parse(k).ok().map(Dimension::ApiKey)
                } else {
                    s.strip_prefix("a:").map(|a| Dimension::Actor(a.to_owned()))
                }
            }
        }
    }
}

/// One counter: a dimension in one window.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CounterKey {
    pub dimension: Dimension,
    pub window: WindowKind,
    pub window_key: String,
}

impl CounterKey {
    /// `<dimension>|<window>|<window_key>`: the counter's name in the view.
    pub fn encode(&self) -> String {
        format!("{}|{}|{}", self.dimension.encode(), self.window.as_str(), self.window_key)
    }

    pub fn decode(s: &str) -> Option<CounterKey> {
        let mut it = s.splitn(3, '|');
        let dimension = Dimension::decode(it.next()?)?;
        let window = it.next()?.parse().ok()?;
        let window_key = it.next()?.to_owned();
        Some(CounterKey { dimension, window, window_key })
    }
}

/// A counter plus when it stops mattering (its window's reset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter {
    pub key: CounterKey,
    pub resets_at: Option<DateTime<Utc>>,
}

/// Amounts a fact adds to a counter, or a counter's totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Totals {
    pub requests: u64,
    pub calls: u64,
    pub rows: u64,
}

impl Totals {
    pub fn is_zero(&self) -> bool {
        *self == Totals::default()
    }
    pub fn add(&mut self, other: Totals) {
        self.requests = self.requests.saturating_add(other.requests);
        self.calls = self.calls.saturating_add(other.calls);
        self.rows = self.rows.saturating_add(other.rows);
    }
}

/// What one fact adds, wherever it is counted.
pub fn delta_of(fact: &UsageFact) -> Totals {
    match (fact.kind, fact.outcome) {
        (EventKind::Request, _) => Totals { requests: 1, ..Totals::default() },
        (EventKind::Call, Outcome::Success) => Totals { calls: 1, rows: fact.rows, requests: 0 },
        _ => Totals::default(),
    }
}

/// The dimensions a fact is attributed to.
pub fn dimensions_of(api_key: Option<&ApiKeyId>, actor: Option<&str>) -> Vec<Dimension> {
    let mut dims = vec![Dimension::Project];
    if let Some(k) = api_key {
        dims.push(Dimension::AllApiKeys);
        dims.push(Dimension::ApiKey(k.clone()));
    }
    if let Some(a) = actor {
        dims.push(Dimension::Actor(a.to_owned()));
    }
    dims
}

/// Every counter a fact lands in (each flow window of each dimension), with
/// what it adds there. Empty when the fact adds nothing.
pub fn counters_for(fact: &UsageFact, tz: Tz) -> Vec<(Counter, Totals)> {
    let delta = delta_of(fact);
    if delta.is_zero() {
        return Vec::new();
    }
    let windows: Vec<_> = WindowKind::FLOW.iter().map(|w| window_at(*w, tz, fact.occurred_at)).collect();
    let mut out = Vec::new();
    for dimension in dimensions_of(fact.api_key_id.as_ref(), fact.actor_id.as_deref()) {
        // A request is counted only where `requests` quotas can scope it.
        if fact.kind == EventKind::Request && matches!(dimension, Dimension::Actor(_)) {
            continue;
        }
        for w in &windows {
            out.push((
                Counter {
                    key: CounterKey {
                        dimension: dimension.clone(),
                        window: w.kind,
                        window_key: w.key.clone(),
                    },
                    resets_at: w.resets_at,
                },
                delta,
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fact(kind: EventKind, outcome: Outcome, rows: u64) -> UsageFact {
        UsageFact {
            id: EventId::parse("e1").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            api_key_id: Some(ApiKeyId::parse("k1").expect("id")),
            agent_id: None,
            actor_id: Some("u1".into()),
            occurred_at: DateTime::parse_from_rfc3339("2026-07-07T12:31:00Z")
                .expect("ts")
                .with_timezone(&Utc),
            kind,
            outcome,
            rows,
            reservation_id: None,
            gateway: "g".into(),
        }
    }

    #[test]
    fn a_successful_call_counts_in_every_window_of_every_dimension() {
        let c = counters_for(&fact(EventKind::Call, Outcome::Success, 7), Tz::UTC);
        assert_eq!(c.len(), 4 * 5);
        assert!(c.iter().all(|(_, d)| *d == Totals { requests: 0, calls: 1, rows: 7 }));
    }

    #[test]
    fn a_failed_call_counts_nothing_and_a_request_skips_actors() {
        assert!(counters_for(&fact(EventKind::Call, Outcome::Failure, 7), Tz::UTC).is_empty());
        let c = counters_for(&fact(EventKind::Request, Outcome::Success, 0), Tz::UTC);
        assert_eq!(c.len(), 3 * 5);
    }

    #[test]
    fn counter_keys_round_trip() {
        for (c, _) in counters_for(&fact(EventKind::Call, Outcome::Success, 1), Tz::UTC) {
            assert_eq!(CounterKey::decode(&c.key.encode()), Some(c.key));
        }
    }

    #[test]
    fn fact_time_bounds() {
        let at = DateTime::parse_from_rfc3339("2026-07-07T12:00:00Z").expect("ts").with_timezone(&Utc);
        assert!(check_fact_time(at, at, DEFAULT_DEDUP_HORIZON).is_ok());
        assert!(check_fact_time(at + Duration::minutes(6), at, DEFAULT_DEDUP_HORIZON).is_err());
        assert!(check_fact_time(at - Duration::days(36), at, DEFAULT_DEDUP_HORIZON).is_err());
    }
}
