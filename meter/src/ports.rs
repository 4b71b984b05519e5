//! The ports: what the rules need from the outside world. Adapters in the
//! `store` crate implement them (Kafka, Redis, PostgreSQL; and embedded ones),
//! and every implementation runs the same conformance suite.
//!
//! Errors say once, at the adapter, whether retrying can help.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::admission::{CheckOutcome, CheckPlan};
use crate::apply::QuotaPlan;
use crate::audit::AuditEntry;
use crate::ids::{ApiKeyId, AuditId, EventId, ProjectId, QuotaId, ReservationId, RoleId};
use crate::price::{Price, PriceKey};
use crate::quota::{Quota, QuotaPatch};
use crate::role::Role;
use crate::usage::{Counter, CounterKey, Totals, UsageFact};
use crate::window::WindowKind;

/// An adapter failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortError {
    /// Worth retrying: a connection dropped, a broker is electing, a timeout.
    #[error("transient: {0}")]
    Transient(String),
    /// Retrying will not help: bad configuration, a schema mismatch, a bug.
    #[error("permanent: {0}")]
    Permanent(String),
    /// A uniqueness rule was hit (a duplicate quota identity, for instance).
    #[error("conflict: {0}")]
    Conflict(String),
    /// Another writer moved the offsets this batch started from.
    #[error("fenced: {0}")]
    Fenced(String),
}

impl PortError {
    pub fn is_transient(&self) -> bool {
        matches!(self, PortError::Transient(_))
    }
}

pub type PortResult<T> = Result<T, PortError>;

/// The time, injected.
pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

/// A clock tests set by hand.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    pub fn new(at: DateTime<Utc>) -> Self {
        ManualClock(Arc::new(Mutex::new(at)))
    }
    pub fn set(&self, at: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }
    pub fn advance(&self, by: chrono::Duration) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *t += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Project {
    pub id: ProjectId,
    pub name: String,
    /// Immutable after creation: calendar windows already folded depend on it.
    pub timezone: Tz,
    pub created_at: DateTime<Utc>,
}

/// Per-key limits a key or role can narrow (ADR-0011 §1).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_timeout: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u64>,
}

/// An API key; its secret is only ever stored hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: ApiKeyId,
    pub project_id: ProjectId,
    pub name: String,
    /// The first characters of the secret, to recognise it in a list.
    pub prefix: String,
    pub grants: Grants,
    /// The role it takes grants and a quota from, if any.
    pub role_id: Option<RoleId>,
    pub created_at: DateTime<Utc>,
}

/// The offsets one batch moves, partition by partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetMove {
    pub partition: i32,
    /// Where the batch started: the stored offset must still be this.
    pub from: i64,
    /// The next offset to read after the batch.
    pub to: i64,
}

/// One batch for the store to fold, atomically with its offsets.
#[derive(Debug, Clone)]
pub struct FoldBatch {
    pub consumer: String,
    pub topic: String,
    pub offsets: Vec<OffsetMove>,
    pub facts: Vec<UsageFact>,
}

/// What a fold did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FoldReport {
    pub folded: Vec<(ProjectId, EventId)>,
    pub duplicates: Vec<(ProjectId, EventId)>,
    /// The new durable totals of every counter the batch touched.
    pub totals: Vec<(ProjectId, Counter, Totals)>,
}

/// One `quota_unpriced` exception: a cost cap whose window held AI usage no
/// price covered. Deduplicated on the quota; `occurrence_count` is how many
/// checks ran under it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpricedException {
    pub project_id: ProjectId,
    pub quota_id: QuotaId,
    /// The quota's limit when last filed (picodollars).
    pub limit: u64,
    pub window_key: String,
    /// LLM events the window metered, and how many had an unpriced component.
    pub llm_events: u64,
    pub unpriced_events: u64,
    /// At most [`crate::price::MAX_UNPRICED_ROWS`].
    pub unpriced_rows: Vec<PriceKey>,
    pub occurrence_count: u64,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
}

/// An unpriced (provider, model, component) seen in a counter's window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpricedRow {
    pub counter: Counter,
    pub key: PriceKey,
}

/// Token usage of one (provider, model, component, meter) in one window of a
/// project, priced and unpriced quantities apart (the finance breakdown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelUsageRow {
    pub key: PriceKey,
    pub meter: crate::price::MeterType,
    pub embedding: bool,
    pub priced_quantity: u64,
    pub unpriced_quantity: u64,
    pub cost: crate::price::Usd,
}

/// The durable store: configuration, aggregates and offsets.
#[async_trait]
pub trait Store: Send + Sync {
    async fn create_project(&self, project: &Project) -> PortResult<()>;
    async fn project(&self, id: &ProjectId) -> PortResult<Option<Project>>;
    async fn create_api_key(&self, key: &ApiKey, secret_hash: &str) -> PortResult<()>;
    async fn create_role(&self, role: &Role) -> PortResult<()>;
    async fn role(&self, id: &RoleId) -> PortResult<Option<Role>>;
    async fn api_key(&self, id: &ApiKeyId) -> PortResult<Option<ApiKey>>;
    async fn api_key_by_secret_hash(&self, hash: &str) -> PortResult<Option<ApiKey>>;
    /// Soft-deletes a key (`deleted_at`): it no longer authenticates or
    /// reads back, and quotas naming it go inert. False if there was no
    /// live key with this id.
    async fn delete_api_key(&self, id: &ApiKeyId, at: DateTime<Utc>) -> PortResult<bool>;
    /// Fails with [`PortError::Conflict`] on a duplicate identity.
    async fn create_quota(&self, quota: &Quota) -> PortResult<()>;
    async fn quota(&self, id: &QuotaId) -> PortResult<Option<Quota>>;
    async fn quotas(&self, project: &ProjectId) -> PortResult<Vec<Quota>>;
    async fn update_quota(&self, id: &QuotaId, patch: &QuotaPatch, at: DateTime<Utc>) -> PortResult<Option<Quota>>;
    async fn delete_quota(&self, id: &QuotaId) -> PortResult<bool>;
    /// Carries out a plan and writes its audit entries in **one
    /// transaction**: all of it or none. Fails, changing nothing, with
    /// [`PortError::Fenced`] if the plan has `based_on` and the project's
    /// quotas are no longer exactly those; with [`PortError::Conflict`] on a
    /// duplicate identity, or when a quota to update or delete is gone.
    async fn apply_quotas(&self, plan: &QuotaPlan, audit: &[AuditEntry]) -> PortResult<()>;
    /// Appends an audit entry. An entry with a
    /// [`once_key`](AuditEntry::once_key) (a monitor breach: its quota and
    /// window) is written at most once: returns whether this call wrote it.
    async fn record_audit(&self, entry: &AuditEntry) -> PortResult<bool>;
    /// A project's audit entries in id (time) order, after the cursor, at most `limit`.
    async fn audit(&self, project: &ProjectId, after: Option<&AuditId>, limit: usize) -> PortResult<Vec<AuditEntry>>;
    /// Adds price rows; a row with the same (provider, model, component,
    /// effective_from) is replaced. All or nothing.
    async fn put_prices(&self, prices: &[Price]) -> PortResult<()>;
    /// The whole price book, ordered by key then `effective_from`.
    async fn prices(&self) -> PortResult<Vec<Price>>;
    /// Remembers unpriced rows of counters (idempotent). The gateway writes
    /// them when it accepts an event, the fold again from the log.
    async fn record_unpriced(&self, project: &ProjectId, rows: &[UnpricedRow]) -> PortResult<()>;
    /// The distinct unpriced rows of one counter, ordered, at most `limit`.
    async fn unpriced_rows(&self, project: &ProjectId, counter: &CounterKey, limit: usize)
    -> PortResult<Vec<PriceKey>>;
    /// Files a `quota_unpriced` exception, or counts one more occurrence of
    /// the quota's (replacing its counts and rows, keeping `first_seen`).
    /// `occurrence_count` of the argument is ignored. Returns the stored one.
    async fn file_exception(&self, exception: &UnpricedException) -> PortResult<UnpricedException>;
    /// A project's exceptions ordered by quota id, after the cursor, at most `limit`.
    async fn exceptions(
        &self,
        project: &ProjectId,
        after: Option<&QuotaId>,
        limit: usize,
    ) -> PortResult<Vec<UnpricedException>>;
    /// The token usage breakdown of a project in one window (`day` or
    /// `calendar_month`, by window key), ordered by key, meter, embedding.
    async fn model_usage(
        &self,
        project: &ProjectId,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<ModelUsageRow>>;
    /// The durable totals of every counter of a project in one window whose
    /// dimension encoding starts with `prefix` (`a:` actors, `g:` agents,
    /// `k:` keys, `u:` users), ordered by dimension.
    async fn window_totals(
        &self,
        project: &ProjectId,
        window: WindowKind,
        window_key: &str,
        prefix: &str,
    ) -> PortResult<Vec<(CounterKey, Totals)>>;
    /// Durable totals of the given counters (missing ones are zero).
    async fn totals(&self, project: &ProjectId, counters: &[CounterKey]) -> PortResult<Vec<(CounterKey, Totals)>>;
    /// Durable totals of every counter of a project whose window is open at `at`.
    async fn open_totals(&self, project: &ProjectId, at: DateTime<Utc>) -> PortResult<Vec<(Counter, Totals)>>;
    /// The next offset to read, per partition, for a consumer.
    async fn offsets(&self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>>;
    /// Folds a batch: skips ids already folded, adds the rest to the
    /// aggregates (tokens events priced against the store's price book at
    /// their event time, their unpriced rows recorded; storage facts turned
    /// into the project's footprint, see [`crate::usage::Footprint`]) and
    /// moves the offsets, all in one transaction. Fails with
    /// [`PortError::Fenced`] (changing nothing) if the offsets moved.
    async fn fold_batch(&self, batch: &FoldBatch) -> PortResult<FoldReport>;
}

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

/// The hot-path view (Redis, or memory): durable totals, pending deltas and
/// live reservations, per counter.
#[async_trait]
pub trait View: Send + Sync {
    /// Runs a plan atomically. `Ok(None)` means the view holds nothing for
    /// this project (new, or flushed): seed it, then check again.
    async fn check(
        &self,
        project: &ProjectId,
        plan: &CheckPlan,
        hold: &Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CheckOutcome>>;
    /// Loads durable totals into an unseeded project (never lowers a total).
    async fn seed(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()>;
    /// Records settled facts as pending and releases their reservations.
    /// A fact already pending is not added twice.
    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()>;
    /// Takes back pending deltas of facts that never reached the log.
    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()>;
    /// Releases a reservation without settling it.
    async fn release(&self, project: &ProjectId, reservation: &ReservationId) -> PortResult<()>;
    /// After a durable fold: raises durable totals and drops the pending
    /// deltas of the folded events.
    async fn apply_fold(&self, project: &ProjectId, totals: &[(Counter, Totals)], events: &[EventId])
    -> PortResult<()>;
    /// A counter's state, or `None` if the project is not seeded.
    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>>;
}

/// The write side of the log.
#[async_trait]
pub trait Log: Send + Sync {
    /// Returns once every fact is durably on the log (acks from all replicas).
    async fn publish(&self, facts: &[UsageFact]) -> PortResult<()>;
}

/// One record read from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

/// The read side of the log, positioned by offsets the store keeps.
#[async_trait]
pub trait LogReader: Send {
    /// The partitions of the usage topic.
    async fn partitions(&mut self) -> PortResult<Vec<i32>>;
    /// Positions every partition at the given next offset.
    async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()>;
    /// Up to `max` records, waiting at most `wait` for the first.
    async fn poll(&mut self, max: usize, wait: Duration) -> PortResult<Vec<LogRecord>>;
    /// Puts a record that cannot be folded on the dead-letter topic.
    async fn dead_letter(&mut self, record: &LogRecord, reason: &str) -> PortResult<()>;
}
