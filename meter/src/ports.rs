//! The ports: what the rules need from the outside world, one small trait
//! per concern. Adapters in the `store` crate implement them (Kafka, Redis,
//! PostgreSQL; and embedded ones), and every implementation runs the same
//! conformance suite.
//!
//! The durable store is ten traits — [`TenantStore`] (projects, keys,
//! roles), [`QuotaStore`], [`AuditStore`] (the audit outbox and the
//! audit log folded from the audit topic), [`PriceStore`] (the price book
//! and what it failed to price), [`Ledger`] (the fold, its offsets and the
//! durable totals), [`ReportStore`] (usage reports) and [`WebhookStore`]
//! (endpoints and the notification outbox), [`ExportStore`] (billing
//! export runs, and a cut of the fold to export from), [`ScheduleStore`]
//! (export schedules the notifier runs), [`PartitionLeases`] (projectors
//! sharing the usage topic) — which one database
//! implements together as a [`Store`]. A caller holds only the ones it uses.
//!
//! Errors say once, at the adapter, whether retrying can help.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::admission::{CheckOutcome, CheckPlan};
use crate::apply::QuotaPlan;
use crate::audit::{AuditBatch, AuditEntry, PriceAudit};
use crate::error::PortResult;
use crate::export::{ExportRun, ExportSchedule, ExportedLine, Reconciliation};
use crate::fold::{DlqMark, FoldBatch, FoldReport, PendingDeadLetter};
use crate::ids::{
    ApiKeyId, AuditId, EventId, MessageId, PermitId, ProjectId, QuotaId, ReservationId, RoleId, WebhookId,
};
use crate::permit::{Claimed, Permit, PermitClaim};
use crate::price::{Price, PriceKey};
use crate::quota::Quota;
use crate::report::{ModelUsageRow, Population, UnpricedException, UnpricedRow};
use crate::role::Role;
use crate::tenant::{ApiKey, Project};
use crate::usage::{Counter, CounterKey, Totals, UsageFact};
use crate::view::{CounterUsage, Hold, Seed, Settlement};
use crate::webhook::{Attempt, DeliveryStatus, DueDelivery, Endpoint, EndpointChange, Next, Notification};
use crate::window::WindowKind;

/// Projects, API keys and roles. A change to a key or a role takes its
/// audit entries, which are written to the audit outbox in the change's
/// transaction (see [`AuditStore`]): both or neither.
#[async_trait]
pub trait TenantStore: Send + Sync {
    async fn create_project(&self, project: &Project) -> PortResult<()>;
    async fn project(&self, id: &ProjectId) -> PortResult<Option<Project>>;
    /// Every project, by id.
    async fn projects(&self) -> PortResult<Vec<Project>>;
    async fn create_api_key(&self, key: &ApiKey, secret_hash: &str, audit: &[AuditEntry]) -> PortResult<()>;
    async fn api_key(&self, id: &ApiKeyId) -> PortResult<Option<ApiKey>>;
    async fn api_key_by_secret_hash(&self, hash: &str) -> PortResult<Option<ApiKey>>;
    /// Soft-deletes a key (`deleted_at`): it no longer authenticates or
    /// reads back, and quotas naming it go inert. False if there was no
    /// live key with this id (and `audit` is not written).
    async fn delete_api_key(&self, id: &ApiKeyId, at: DateTime<Utc>, audit: &[AuditEntry]) -> PortResult<bool>;
    /// A project's live keys, by id.
    async fn api_keys(&self, project: &ProjectId) -> PortResult<Vec<ApiKey>>;
    /// Replaces a live key's grants and role with `key`'s (its other fields
    /// are not written) and writes `audit`, in one transaction. False if
    /// there was no live key with its id (and `audit` is not written).
    async fn update_api_key(&self, key: &ApiKey, audit: &[AuditEntry]) -> PortResult<bool>;
    async fn create_role(&self, role: &Role, audit: &[AuditEntry]) -> PortResult<()>;
    async fn role(&self, id: &RoleId) -> PortResult<Option<Role>>;
    /// A project's roles, by id.
    async fn roles(&self, project: &ProjectId) -> PortResult<Vec<Role>>;
}

/// Quotas. Every change goes through a [`QuotaPlan`], with its audit entries.
#[async_trait]
pub trait QuotaStore: Send + Sync {
    async fn quota(&self, id: &QuotaId) -> PortResult<Option<Quota>>;
    async fn quotas(&self, project: &ProjectId) -> PortResult<Vec<Quota>>;
    /// Carries out a plan and writes its audit entries in **one
    /// transaction**: all of it or none. Fails, changing nothing, with
    /// [`PortError::Fenced`](crate::PortError::Fenced) if the plan has
    /// `based_on` and the project's quotas are no longer exactly those; with
    /// [`PortError::Conflict`](crate::PortError::Conflict) on a duplicate
    /// identity, or when a quota to update or delete is gone.
    async fn apply_quotas(&self, plan: &QuotaPlan, audit: &[AuditEntry]) -> PortResult<()>;
}

/// The audit trail (see [`crate::audit`]): an **outbox** every writer fills
/// in its own transaction, which the audit relay publishes to the audit
/// topic, and the **audit log** the audit folder writes from that topic,
/// which is what [`AuditStore::audit`] reads.
#[async_trait]
pub trait AuditStore: Send + Sync {
    /// Writes an entry to the outbox, to be published. An entry with a
    /// [`once_key`](AuditEntry::once_key) (a monitor breach: its quota and
    /// window) is written at most once, and so is an id: returns whether
    /// this call wrote it. It reaches [`AuditStore::audit`] once relayed and
    /// folded (about a poll later).
    async fn record_audit(&self, entry: &AuditEntry) -> PortResult<bool>;
    /// A project's folded audit entries (`Some(project)`), or the
    /// installation-wide ones (`None`: a write of prices), in id (time)
    /// order, after the cursor, at most `limit`.
    async fn audit(
        &self,
        project: Option<&ProjectId>,
        after: Option<&AuditId>,
        limit: usize,
    ) -> PortResult<Vec<AuditEntry>>;
    /// Up to `limit` outbox entries not yet published, in the order they
    /// were written.
    async fn unpublished_audit(&self, limit: usize) -> PortResult<Vec<AuditEntry>>;
    /// Records outbox entries as on the audit topic since `at`. Idempotent;
    /// an id the outbox does not hold is ignored.
    async fn audit_published(&self, ids: &[AuditId], at: DateTime<Utc>) -> PortResult<()>;
    /// Folds entries read from the audit topic into the audit log and moves
    /// the batch's consumer offsets past them, in **one transaction**. An
    /// entry whose id (or once-key) the log holds already adds nothing, so
    /// a record published twice (a relay killed between its publish and its
    /// mark) is one entry. Fails with
    /// [`PortError::Fenced`](crate::PortError::Fenced), changing nothing, if
    /// the offsets moved. Returns how many entries were new.
    async fn fold_audit(&self, batch: &AuditBatch) -> PortResult<usize>;
}

/// The price book, and the usage it could not price.
#[async_trait]
pub trait PriceStore: Send + Sync {
    /// Adds price rows, recorded at `at` (the caller's clock: the instant
    /// the book learns them). All or nothing. A row with the same
    /// (provider, model, component, effective_from) as an earlier one
    /// replaces it in [`PriceStore::prices`], but as a new version: the fold
    /// prices a fact only with the versions recorded at or before its
    /// receipt ([`crate::PriceBook::price_as_of`]), so putting a row never
    /// re-prices what was received before it.
    ///
    /// With `audit`, the write's audit entry
    /// ([`price_change`](crate::audit::price_change) against the book as it
    /// stands in the write's transaction, writes of prices serialised) goes
    /// to the audit outbox in that same **transaction**, and is returned:
    /// the rows and their entry, or neither. Without it (seeding a book in
    /// tests), nothing is audited.
    async fn put_prices(
        &self,
        prices: &[Price],
        at: DateTime<Utc>,
        audit: Option<&PriceAudit>,
    ) -> PortResult<Option<AuditEntry>>;
    /// The current price book (of each key and `effective_from`, the latest
    /// version), ordered by key then `effective_from`.
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
}

/// The fold: durable aggregates, the dedup set and the consumer offsets,
/// which only ever change together.
#[async_trait]
pub trait Ledger: Send + Sync {
    /// The next offset to read, per partition, for a consumer.
    async fn offsets(&self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>>;
    /// Folds a batch: skips ids already folded, adds the rest to the
    /// aggregates (tokens events priced at their event time against the
    /// price book as of their receipt, their unpriced rows recorded; storage
    /// facts turned into the project's footprint, see
    /// [`crate::usage::Footprint`]; sums saturating at `i64::MAX`), keeps the
    /// batch's dead letters as pending, remembers the newest receipt folded
    /// and moves the offsets, all in one transaction. Fails with
    /// [`PortError::Fenced`](crate::PortError::Fenced) (changing nothing) if
    /// the offsets moved, and with
    /// [`PortError::Permanent`](crate::PortError::Permanent) (changing
    /// nothing) if it refuses one of the facts: the caller isolates it.
    async fn fold_batch(&self, batch: &FoldBatch) -> PortResult<FoldReport>;
    /// Claims up to `limit` pending dead letters of a consumer for
    /// `claimant` until `until`: those nobody claimed, those `claimant`
    /// claimed before, and those whose claim lapsed before `at`. So two
    /// publishers never hold one letter at once. Ordered by partition, offset.
    async fn claim_dead_letters(
        &self,
        consumer: &str,
        topic: &str,
        claimant: &str,
        at: DateTime<Utc>,
        until: DateTime<Utc>,
        limit: usize,
    ) -> PortResult<Vec<PendingDeadLetter>>;
    /// Sets the mark of pending dead letters (by source partition and
    /// offset) that have none, before their first publish.
    async fn mark_dead_letters(
        &self,
        consumer: &str,
        topic: &str,
        letters: &[(i32, i64)],
        mark: &DlqMark,
    ) -> PortResult<()>;
    /// Records dead letters as on the dead-letter topic: no longer pending.
    async fn dead_letters_published(&self, consumer: &str, topic: &str, letters: &[(i32, i64)]) -> PortResult<()>;
    /// Forgets folded event ids that occurred more than `keep` before the
    /// newest receipt this consumer folded (never after `at`, the caller's
    /// clock, which only ever makes it keep more). The cutoff comes from the
    /// fold's own position, not from a wall clock: an event older than the
    /// horizon at its receipt is dead-lettered before its id is looked up,
    /// so with `keep` at least the horizon plus how far receipts run out of
    /// order on the log, a purge never changes what a later record folds
    /// to, and a replay purging at other moments folds the same. Returns
    /// how many ids were forgotten.
    async fn purge_processed(
        &self,
        consumer: &str,
        topic: &str,
        keep: chrono::Duration,
        at: DateTime<Utc>,
    ) -> PortResult<u64>;
    /// Durable totals of the given counters (missing ones are zero).
    async fn totals(&self, project: &ProjectId, counters: &[CounterKey]) -> PortResult<Vec<(CounterKey, Totals)>>;
    /// Durable totals of every counter of a project whose window is open at `at`.
    async fn open_totals(&self, project: &ProjectId, at: DateTime<Utc>) -> PortResult<Vec<(Counter, Totals)>>;
    /// [`Ledger::open_totals`] with the offsets of `consumer` on `topic`
    /// they stand at (per partition, the next record to fold; a partition
    /// missing has folded nothing), read together in one snapshot: the log
    /// past those offsets is exactly what the totals do not hold yet. What a
    /// reseed of the view starts from.
    async fn seed_totals(
        &self,
        project: &ProjectId,
        consumer: &str,
        topic: &str,
        at: DateTime<Utc>,
    ) -> PortResult<(BTreeMap<i32, i64>, Vec<(Counter, Totals)>)>;
    /// What the dedup set holds of a folded event, for the checks of a
    /// correction at ingest ([`crate::correction`]): `None` when it holds
    /// nothing (unknown, not folded yet, or purged). A store that keeps no
    /// such thing answers `None`, and the fold judges.
    async fn correction_target(
        &self,
        _project: &ProjectId,
        _event: &crate::ids::EventId,
    ) -> PortResult<Option<crate::correction::Target>> {
        Ok(None)
    }
}

/// Usage reports over what was folded.
#[async_trait]
pub trait ReportStore: Send + Sync {
    /// The token usage breakdown of a project in one window (`day` or
    /// `calendar_month`, by window key), ordered by key, meter, embedding.
    async fn model_usage(
        &self,
        project: &ProjectId,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<ModelUsageRow>>;
    /// The durable totals of every member of a population (each actor, each
    /// key…) in one window of a project, ordered by dimension.
    async fn population_totals(
        &self,
        project: &ProjectId,
        population: Population,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<(CounterKey, Totals)>>;
}

/// Webhook endpoints and the notification outbox (see [`crate::webhook`]).
/// An admin's change to an endpoint takes its audit entries, written to the
/// audit outbox in the change's transaction (only if the change happened).
#[async_trait]
pub trait WebhookStore: Send + Sync {
    async fn create_endpoint(&self, endpoint: &Endpoint, audit: &[AuditEntry]) -> PortResult<()>;
    async fn endpoint(&self, id: &WebhookId) -> PortResult<Option<Endpoint>>;
    /// A project's endpoints, in id (creation) order.
    async fn endpoints(&self, project: &ProjectId) -> PortResult<Vec<Endpoint>>;
    /// Replaces what can change of an endpoint (url, event types,
    /// description, enabled, disabled reason, secrets, failing since,
    /// updated at). False if there is no such endpoint.
    async fn update_endpoint(&self, endpoint: &Endpoint, audit: &[AuditEntry]) -> PortResult<bool>;
    /// Deletes an endpoint and its deliveries. False if there was none.
    async fn delete_endpoint(&self, id: &WebhookId, audit: &[AuditEntry]) -> PortResult<bool>;
    /// Enqueues a notification **once**: the message, and a pending
    /// delivery due at its `created_at` to every enabled endpoint of its
    /// project whose event types match (only to `to`, if given), all in one
    /// transaction. A message whose dedup key is already there adds nothing:
    /// returns whether this call enqueued it.
    async fn enqueue(&self, notification: &Notification, to: Option<&WebhookId>) -> PortResult<bool>;
    /// Claims up to `limit` deliveries due at `at` (pending, their endpoint
    /// enabled, unclaimed or their claim lapsed before `at`) for `claimant`
    /// until `until`, earliest due first: two notifiers never hold one
    /// delivery at once.
    async fn claim_deliveries(
        &self,
        claimant: &str,
        at: DateTime<Utc>,
        until: DateTime<Utc>,
        limit: usize,
    ) -> PortResult<Vec<DueDelivery>>;
    /// Records an attempt of a delivery `claimant` holds, and what follows
    /// it, in one transaction: the attempt in the delivery log, the
    /// delivery's status and next attempt, its claim released, the
    /// endpoint's health, and — if this attempt disabled the endpoint (it
    /// was enabled) — `disabled_audit`. `None`, changing nothing, if the
    /// claim was lost; otherwise whether the endpoint was disabled by it.
    async fn record_attempt(
        &self,
        claimant: &str,
        delivery: &DueDelivery,
        attempt: &Attempt,
        next: &Next,
        change: &EndpointChange,
        disabled_audit: Option<&AuditEntry>,
    ) -> PortResult<Option<bool>>;
    /// An endpoint's delivery log: messages in id (time) order after the
    /// cursor, at most `limit`, each with its attempts.
    async fn deliveries(
        &self,
        endpoint: &WebhookId,
        after: Option<&MessageId>,
        limit: usize,
    ) -> PortResult<Vec<DeliveryLog>>;
    /// A project's quota notifications (`quota.exceeded` and
    /// `quota.nearly_used`: its breaches and near breaches, whether or not
    /// an endpoint took them), in id (time) order after the cursor, at most
    /// `limit`.
    async fn quota_notifications(
        &self,
        project: &ProjectId,
        after: Option<&MessageId>,
        limit: usize,
    ) -> PortResult<Vec<Notification>>;
    /// Makes a delivery pending again, due at `at`, with a fresh schedule
    /// (also a successful one). False if the endpoint never got that message.
    async fn resend(&self, endpoint: &WebhookId, message: &MessageId, at: DateTime<Utc>) -> PortResult<bool>;
    /// Resends (as [`WebhookStore::resend`]) every delivery of an endpoint
    /// that finally failed, of messages created in `[since, until)`.
    /// Returns how many.
    async fn recover(
        &self,
        endpoint: &WebhookId,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        at: DateTime<Utc>,
    ) -> PortResult<u64>;
}

/// One message of an endpoint's delivery log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryLog {
    pub message: Notification,
    pub status: DeliveryStatus,
    /// When the next attempt is due, while pending.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub attempts: Vec<Attempt>,
}

/// One storage fact of a project, as the fold kept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredStorageFact {
    pub event_id: EventId,
    /// A delta or a snapshot.
    pub snapshot: bool,
    pub occurred_at: DateTime<Utc>,
    pub bytes: i64,
}

/// The fold as of one instant (a read-only snapshot: PostgreSQL
/// `REPEATABLE READ`, a SQLite read transaction), for an export run: its
/// offsets and every total read through it agree, whatever the projector
/// commits meanwhile.
#[async_trait]
pub trait FoldCut: Send {
    /// The consumer's next offset per partition of `topic`.
    async fn offsets(&mut self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>>;
    /// The newest receipt time the consumer folded.
    async fn newest_receipt(&mut self, consumer: &str, topic: &str) -> PortResult<Option<DateTime<Utc>>>;
    /// The keys of the `window` (`day` or `calendar_month`) counters and
    /// breakdown rows the project has, in order.
    async fn window_keys(&mut self, project: &ProjectId, window: WindowKind) -> PortResult<Vec<String>>;
    /// The counters of one window of the project whose dimension's encoding
    /// is bytewise after `after` (all, if `None`), in that order, at most
    /// `limit` (a counter per dimension: a page of dimensions).
    async fn window_totals(
        &mut self,
        project: &ProjectId,
        window: WindowKind,
        key: &str,
        after: Option<&str>,
        limit: usize,
    ) -> PortResult<Vec<(CounterKey, Totals)>>;
    /// The breakdown by model of one window of the project, of the
    /// dimensions in `range`, by dimension (bytewise) and then in meter's
    /// orders.
    async fn window_models(
        &mut self,
        project: &ProjectId,
        window: WindowKind,
        key: &str,
        range: &crate::export::DimRange,
    ) -> PortResult<Vec<(crate::usage::Dimension, ModelUsageRow)>>;
    /// The project's storage facts that occurred before `before`, in
    /// (occurred_at, event id) order.
    async fn storage_facts(&mut self, project: &ProjectId, before: DateTime<Utc>)
    -> PortResult<Vec<StoredStorageFact>>;
    /// Ends the cut.
    async fn close(self: Box<Self>) -> PortResult<()>;
}

/// Billing exports: a cut of the fold to export from, the runs, and what
/// the runs of each export wrote (see [`crate::export`]).
#[async_trait]
pub trait ExportStore: Send + Sync {
    /// A cut of the fold, as of now.
    async fn fold_cut(&self) -> PortResult<Box<dyn FoldCut>>;
    /// Records a run as it starts (status `running`).
    async fn create_export_run(&self, run: &ExportRun) -> PortResult<()>;
    /// What the runs of the export that ended `complete` or `partial` wrote
    /// of the lines of one charge period (by the period's key) whose
    /// customers are in `range`, summed per line; lines summing to zero are
    /// left out.
    async fn exported_lines(
        &self,
        export_key: &str,
        period_key: &str,
        range: &crate::export::DimRange,
    ) -> PortResult<Vec<ExportedLine>>;
    /// The charge periods the export's complete and partial runs wrote lines
    /// of, in order.
    async fn exported_periods(&self, export_key: &str) -> PortResult<Vec<String>>;
    /// Records lines a running run wrote (each line at most once per run).
    /// They count for the next runs once the run ends complete or partial;
    /// a run that fails, or dies, never counts them.
    async fn record_export_lines(&self, run_id: &str, export_key: &str, lines: &[ExportedLine]) -> PortResult<()>;
    /// Ends a run, in one transaction: stores the run as it ended (from then
    /// on, if it is complete or partial, its recorded lines count; if it
    /// failed they are dropped), writes its audit entries to the outbox,
    /// and, for a partial or failed run, enqueues its notification
    /// ([`crate::export::schedule::notification`]; a complete run's waits
    /// for its reconciliation).
    async fn finish_export_run(&self, run: &ExportRun, audit: &[AuditEntry]) -> PortResult<()>;
    async fn export_run(&self, id: &str) -> PortResult<Option<ExportRun>>;
    /// When the newest complete run of the export started (the periods it
    /// saw closed are final), if one has.
    async fn last_complete_run(&self, export_key: &str) -> PortResult<Option<DateTime<Utc>>>;
    /// The project's runs, newest first.
    async fn export_runs(&self, project: &ProjectId, limit: usize) -> PortResult<Vec<ExportRun>>;
    /// Sets a finished run's reconciliation and, for a complete run,
    /// enqueues its `export.completed` notification (once: setting it again
    /// enqueues nothing more), in one transaction, at `at`; `false` when
    /// there is no such run.
    async fn set_reconciliation(
        &self,
        id: &str,
        reconciliation: &Reconciliation,
        at: DateTime<Utc>,
    ) -> PortResult<bool>;
    /// Marks the project's runs still `running` that started before
    /// `started_before` as failed (their process died), at `at`, and
    /// enqueues their `export.failed` notifications; how many.
    /// A project has at most one run `running` ([`ExportStore::create_export_run`]
    /// of a second is a [`crate::PortError::Conflict`]).
    async fn abandon_export_runs(
        &self,
        project: &ProjectId,
        started_before: DateTime<Utc>,
        at: DateTime<Utc>,
    ) -> PortResult<u64>;
}

/// Export schedules (see [`crate::export::schedule`]): what the admin API
/// keeps, and what notifiers claim and run. A change by an admin takes its
/// audit entries, written to the audit outbox in its transaction.
#[async_trait]
pub trait ScheduleStore: Send + Sync {
    async fn create_schedule(&self, schedule: &ExportSchedule, audit: &[AuditEntry]) -> PortResult<()>;
    async fn schedule(&self, id: &str) -> PortResult<Option<ExportSchedule>>;
    /// Schedules by id, those after `after`, at most `limit`.
    async fn schedules(&self, after: Option<&str>, limit: usize) -> PortResult<Vec<ExportSchedule>>;
    /// Stores an admin's change (enabled, cadence, format, destination,
    /// next run); `false` when there is no such schedule.
    async fn update_schedule(&self, schedule: &ExportSchedule, audit: &[AuditEntry]) -> PortResult<bool>;
    async fn delete_schedule(&self, id: &str, audit: &[AuditEntry]) -> PortResult<bool>;
    /// Claims the enabled schedule due soonest (`next_run_at <= at`) that
    /// no live claim holds, for `claimant` until `until`; `None` when none
    /// is due. Two claimants never hold one schedule at once.
    async fn claim_due_schedule(
        &self,
        claimant: &str,
        at: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> PortResult<Option<ExportSchedule>>;
    /// Extends `claimant`'s claim to `until`; `false` when it no longer holds it.
    async fn extend_schedule_claim(&self, id: &str, claimant: &str, until: DateTime<Utc>) -> PortResult<bool>;
    /// Records that `claimant` ran the schedule at `ran_at` and sets when it
    /// runs next, releasing the claim; `false` when it no longer held it.
    async fn finish_schedule_run(
        &self,
        id: &str,
        claimant: &str,
        ran_at: DateTime<Utc>,
        next_run_at: DateTime<Utc>,
    ) -> PortResult<bool>;
    /// The runs the schedule started, newest first, at most `limit`.
    async fn schedule_runs(&self, id: &str, limit: usize) -> PortResult<Vec<ExportRun>>;
}

/// Projectors sharing a topic's partitions (see [`crate::share`]): each
/// member's heartbeat, and who holds what.
#[async_trait]
pub trait PartitionLeases: Send + Sync {
    /// A heartbeat of `member` among the projectors of `consumer` on
    /// `topic`, in one transaction that holds the partitions' owners still
    /// against other members' heartbeats: renews its membership until
    /// `until`, forgets members whose membership lapsed before `at`, and
    /// gives it its share of `partitions` ([`crate::share::assign`]).
    /// Returns the partitions it now holds.
    async fn share_partitions(
        &self,
        consumer: &str,
        topic: &str,
        member: &str,
        partitions: &[i32],
        at: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> PortResult<BTreeSet<i32>>;
    /// `member` leaves: its membership ends and its partitions are free.
    async fn leave_partitions(&self, consumer: &str, topic: &str, member: &str) -> PortResult<()>;
    /// Each partition's owner as the store holds it (`None`: free), and the
    /// members whose membership lasts past `at`.
    async fn partition_owners(
        &self,
        consumer: &str,
        topic: &str,
        at: DateTime<Utc>,
    ) -> PortResult<(BTreeMap<i32, Option<String>>, BTreeSet<String>)>;
}

/// One database that is every store port at once (PostgreSQL, or the
/// embedded SQLite file). Implemented for anything that implements them all.
pub trait Store:
    TenantStore
    + QuotaStore
    + AuditStore
    + PriceStore
    + Ledger
    + ReportStore
    + WebhookStore
    + ExportStore
    + ScheduleStore
    + PartitionLeases
{
}

impl<
    T: TenantStore
        + QuotaStore
        + AuditStore
        + PriceStore
        + Ledger
        + ReportStore
        + WebhookStore
        + ExportStore
        + ScheduleStore
        + PartitionLeases,
> Store for T
{
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
    /// Seeds a project in one step (see [`Seed`]): raises its durable totals
    /// (never lowers one), adds the tail's unfolded facts as a settle adds
    /// them (not over an event already pending or folded), holds the tail's
    /// live reservations (leases after `at`), and marks it seeded.
    async fn seed(&self, project: &ProjectId, seed: &Seed, at: DateTime<Utc>) -> PortResult<()>;
    /// Before a seed: forgets what the view holds of a project under a marker
    /// it no longer trusts (a Redis restored from a snapshot, whose marker
    /// was written by another server instance), so the seed starts from
    /// nothing rather than from the snapshot's old counts. True if it forgot
    /// something. A view that cannot be restored has nothing to forget.
    async fn forget_stale(&self, project: &ProjectId) -> PortResult<bool> {
        let _ = project;
        Ok(false)
    }
    /// Records settled facts as pending and releases their reservations.
    /// A fact already pending is not added twice.
    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()>;
    /// Takes back pending deltas of facts that never reached the log.
    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()>;
    /// Releases a reservation without settling it; `at` is the release's
    /// time (a hold the view does not have is remembered as released until
    /// [`LEASE_GRACE`](crate::view::LEASE_GRACE) after it).
    async fn release(&self, project: &ProjectId, reservation: &ReservationId, at: DateTime<Utc>) -> PortResult<()>;
    /// After a durable fold at `at`: raises durable totals, drops the
    /// pending deltas of the folded events and leaves a tombstone per event
    /// (for [`TOMBSTONE_TTL`](crate::view::TOMBSTONE_TTL)) that a late
    /// settle of it respects. Idempotent: applying it again changes nothing
    /// but the tombstones' expiry.
    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
        at: DateTime<Utc>,
    ) -> PortResult<()>;
    /// After a durable fold of corrections that took usage back: lowers
    /// the durable sums of those counters to `totals` where they are above
    /// them (a fold only ever raises them). Counters the view does not
    /// hold are left alone; the footprint is never touched.
    async fn lower_totals(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()>;
    /// A counter's state, or `None` if the project is not seeded.
    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>>;
}

/// Concurrency permits (see [`crate::permit`]): slots with leases, shared
/// by every gateway of an installation (Redis, PostgreSQL), or one
/// process's (memory, for `tollgate dev` and the embedded Layer). Every
/// operation first reaps the permits whose lease lapsed at `at`.
#[async_trait]
pub trait Permits: Send + Sync {
    /// Takes a slot of the claim's holder and one of the installation's in
    /// one atomic step, or neither ([`Claimed::Full`] names the pool that
    /// was full, the holder's first). Two gateways never take the same
    /// slot. The claim's id is a new one.
    async fn claim(&self, claim: &PermitClaim, at: DateTime<Utc>) -> PortResult<Claimed>;
    /// Extends a live permit's lease to `at` plus its lease; `None` if it
    /// is not held (released, lapsed or unknown).
    async fn renew(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<Option<Permit>>;
    /// Frees a permit's slots; false if it was not held.
    async fn release(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<bool>;
}

/// The write side of the log.
///
/// A publish is **acknowledged** (`Ok`) only once every fact is durably on
/// the log (acks from all replicas). It answers within a bound the adapter
/// is configured with (its *publish timeout*), whatever the log does:
///
/// - `Ok(())`: every fact is on the log;
/// - [`PortError::Transient`](crate::PortError::Transient): not acknowledged *yet* — the log did not
///   answer within the timeout, or the adapter knows it is unreachable and
///   answers at once. The facts are **not** dropped: they stay in this
///   process's bounded queue and are published again and again until the
///   log acknowledges them ([`Log::flush`] waits for that). The caller
///   treats them as "in flight": whatever it wrote ahead of the publish
///   (a pending delta in the view) stays, and a client may publish the same
///   facts again — a fact whose id (per project) is still queued is not
///   queued twice, and a fact on the log twice is folded once (dedup by id).
///   The same error, with nothing queued, when the queue is full or the
///   process cannot retry (no async runtime): the caller must publish again.
/// - [`PortError::Permanent`](crate::PortError::Permanent): the facts can never be published (one cannot
///   be encoded, or the log refused it for good); nothing of them is queued.
///
/// Facts queued when the process dies are lost with it (never acknowledged).
/// Facts of one project stay in order on the log, except that a fact
/// published again after a failure lands after later ones (the fold does not
/// depend on order).
#[async_trait]
pub trait Log: Send + Sync {
    /// Publishes facts; see the trait for what each answer means.
    async fn publish(&self, facts: &[UsageFact]) -> PortResult<()>;

    /// Hands `facts` to the log without waiting for their acknowledgement,
    /// if this log can: `Some(Ok(()))` once they are queued (they are then
    /// published, and retried until acknowledged, exactly as the facts of a
    /// [`Log::publish`] that answered "not yet"); `Some(Err(_))` when nothing
    /// was queued (a full queue, no runtime to retry on, a fact that cannot
    /// be encoded). `None`, the default: this log queues nothing by itself,
    /// and a caller that will not wait awaits [`Log::publish`] in a task of
    /// its own. What a check does with its request event.
    fn queue(&self, facts: &[UsageFact]) -> Option<PortResult<()>> {
        let _ = facts;
        None
    }

    /// Waits until every fact this process handed to [`Log::publish`] before
    /// this call is acknowledged (or dropped as permanently unpublishable),
    /// at most `timeout`: [`PortError::Transient`](crate::PortError::Transient) if some are still queued
    /// then (they stay queued). Used at shutdown, and before the view is
    /// re-seeded from the log, so what this process settled is on the log
    /// the seed reads. The default is for a log that queues nothing (a
    /// publish that returned is acknowledged or failed for good).
    async fn flush(&self, timeout: Duration) -> PortResult<()> {
        let _ = timeout;
        Ok(())
    }
}

/// The write side of the audit topic: where the audit relay publishes the
/// outbox ([`AuditStore::unpublished_audit`]).
///
/// `Ok` once every entry is durably on the topic (acks from all replicas),
/// keyed by project and in order within a project. Nothing is queued: on an
/// error some entries may be on the topic and some not, and the relay
/// publishes them all again; the audit folder keeps one of each id.
#[async_trait]
pub trait AuditLog: Send + Sync {
    async fn publish_audit(&self, entries: &[AuditEntry]) -> PortResult<()>;
}

/// A project's records of the usage log past given offsets, up to where the
/// log ends when asked: the *tail* a reseed of the view reads after the
/// durable totals ([`Ledger::seed_totals`]), so the seed holds what the
/// projector has not folded yet (DESIGN §10) — and the records a little
/// before those offsets, appended since a given instant, for the
/// reservations still live (their request events are folded at once).
#[async_trait]
pub trait LogTail: Send + Sync {
    /// Every record keyed by `project` at or past `from` (per partition; a
    /// partition missing from `from` is read from its start) or appended at
    /// or after `since` (by the log's timestamp), up to the end each
    /// partition has when the call begins, in offset order per partition.
    /// A record below its partition's `from` is folded already. Fails
    /// (transient) rather than answer with less.
    async fn tail(
        &self,
        project: &ProjectId,
        from: &BTreeMap<i32, i64>,
        since: DateTime<Utc>,
    ) -> PortResult<Vec<LogRecord>>;
    /// Where the usage topic ends now (the next offset to be written), per
    /// partition: against the projector's stored offsets, how far its fold
    /// is behind. A log that cannot tell answers
    /// [`PortError::Permanent`](crate::PortError::Permanent).
    async fn ends(&self) -> PortResult<BTreeMap<i32, i64>> {
        Err(crate::PortError::Permanent("this log cannot tell where it ends".into()))
    }
}

/// One record read from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// The log's own timestamp of the record (Kafka's message timestamp,
    /// the embedded log's append time), to the millisecond, if it has one:
    /// the receipt of a fact the gateway did not stamp.
    pub timestamp: Option<DateTime<Utc>>,
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
    /// Where the usage topic ends now (the next offset to be written), per
    /// partition: what a replay measures its progress against. A log that
    /// cannot tell answers [`PortError::Permanent`](crate::PortError::Permanent).
    async fn ends(&mut self) -> PortResult<BTreeMap<i32, i64>> {
        Err(crate::PortError::Permanent("this log cannot tell where it ends".into()))
    }
    /// Puts a record that cannot be folded on the dead-letter topic, with
    /// its reason and its source (topic, partition, offset). Once the call
    /// returns the letter is durably there; a failed call may or may not
    /// have written it, which [`LogReader::dead_lettered_since`] tells.
    async fn dead_letter(&mut self, record: &LogRecord, reason: &str) -> PortResult<()>;
    /// Where the dead-letter topic ends now, per partition.
    async fn dead_letter_mark(&mut self) -> PortResult<DlqMark>;
    /// The source positions (partition, offset) of this reader's topic of
    /// every dead letter on the dead-letter topic past `mark`.
    async fn dead_lettered_since(&mut self, mark: &DlqMark) -> PortResult<BTreeSet<(i32, i64)>>;
}
