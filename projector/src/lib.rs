//! # projector — folds the usage log, exactly once, and nothing stops it
//!
//! Each step reads a batch from the log and sorts every record into *fold*
//! or *dead-letter* (malformed bytes, an invalid fact, an unknown project, an
//! event outside the dedup horizon or too far in the future, a kind this
//! release does not fold), then folds the facts into the store **in the
//! same transaction that moves the partition offsets past every record of
//! the batch and keeps its dead letters** (the store's dead-letter outbox).
//! Only after that commit are the dead letters published and the view
//! brought up to date. So:
//!
//! - a crash before the commit re-reads the same records (nothing lost);
//! - a crash after it resumes from the stored offsets (nothing counted twice);
//! - a second projector that moved the offsets fences this one out;
//! - the same event id sent twice is folded once (dedup in the store);
//! - every record is folded or dead-lettered: none is skipped.
//!
//! Kafka's committed offsets are never read or written.
//!
//! ## Time: the record's receipt, never this process's clock
//!
//! A fact is judged late or early against its receipt
//! ([`UsageFact::receipt`]): `received_at`, stamped by the gateway, else the
//! log's own timestamp of the record ([`LogRecord::timestamp`], which the
//! projector writes into the fact), else (neither: a record of an old
//! embedded log) its event time, so it is never late. The price book is read
//! as of that receipt too. Everything the fold depends on is in the record,
//! so a projector that lags, one that catches up after days, and a replay
//! from offset 0 fold every record exactly alike. The clock only says *when*
//! to purge the dedup set; the cutoff comes from the fold's own position
//! ([`Ledger::purge_processed`](meter::Ledger::purge_processed)).
//!
//! ## No record can stop it
//!
//! A batch the store refuses permanently (a value it cannot keep, say) is
//! **bisected** — split in two at a fact, each half folded on its own, with
//! per-partition offset ranges kept contiguous — until the refused fact is
//! alone; that record is dead-lettered with the store's reason, in a
//! transaction that moves the offsets past it, and the rest is folded.
//! Should the store refuse [`ProjectorConfig::max_store_refusals`] records
//! in a row with nothing folded between them, it is taken to be broken (a
//! missing table, say) rather than the records, and the projector stops
//! instead of dead-lettering the whole log. A transient failure re-seeks to
//! the stored offsets and retries.
//!
//! ## Dead letters, once
//!
//! A dead letter is published from the store's outbox after the commit that
//! kept it: the projector claims pending letters (a lease, so two
//! projectors never publish one letter at once), records where the DLQ
//! ends (a *mark*) before the first attempt, publishes, and records them as
//! published. A letter that already has a mark may be on the DLQ (the
//! attempt failed, or the projector died before recording it), so the DLQ
//! is read from the mark first and the letter is published only if it is
//! not there. A DLQ that cannot be written is retried with a backoff, the
//! projector waiting rather than exiting; the letters are durable in the
//! store meanwhile. What this cannot rule out: a publish held in a stalled
//! broker's socket beyond both the producer's timeout and the lease, which
//! lands after another attempt found nothing.
//!
//! ## The audit trail
//!
//! Beside the projector, the [`audit`] relay publishes the store's audit
//! outbox to the audit topic, and the audit folder writes the audit log
//! from that topic (its own consumer name and offsets).

pub mod audit;
pub mod notify;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use meter::{
    Clock, Counter, CounterKey, DeadLetter, DlqMark, EventId, EventKind, FactSource, FoldBatch, FoldReport, LogReader,
    LogRecord, OffsetMove, PortError, PortResult, ProjectId, Store, Totals, UsageFact, View,
};
use tracing::{debug, info, warn};

pub mod replay;

/// Tunables of the projector loop.
#[derive(Debug, Clone)]
pub struct ProjectorConfig {
    /// The name its offsets are stored under.
    pub consumer: String,
    /// The usage topic.
    pub topic: String,
    /// Most records folded in one transaction.
    pub max_batch: usize,
    /// How long one poll waits for the first record.
    pub poll_wait: Duration,
    /// Once a poll brought fewer than `max_batch` records, how long the step
    /// waits before it reads once more, for what came meanwhile, and folds
    /// them all: fewer, larger fold
    /// transactions under a trickle of traffic (on SQLite the fold shares
    /// the one write lock with the log), at this much added freshness lag.
    /// Zero folds every poll at once.
    pub linger: Duration,
    /// Events older than this at their receipt are dead-lettered.
    pub horizon: chrono::Duration,
    /// How far receipt times may run out of order on the log (a gateway's
    /// retried publishes after an outage, clocks apart): the dedup set
    /// keeps ids for the horizon plus this past the newest receipt folded.
    pub receipt_disorder: chrono::Duration,
    /// How often the dedup set is purged (by this process's clock: when,
    /// never what).
    pub purge_every: chrono::Duration,
    /// How long a claim on pending dead letters lasts: longer than one
    /// attempt to publish them can take (the Kafka reader's DLQ producer
    /// gives up on a letter after 10 s), and how long letters a killed
    /// projector claimed wait for another.
    pub dead_letter_lease: chrono::Duration,
    /// Whether dead letters are published to the DLQ (a rebuild into a
    /// shadow store keeps them in its outbox only: the live fold published
    /// them already).
    pub publish_dead_letters: bool,
    /// Records the store may refuse in a row, with none folded between them,
    /// before the projector takes the store, not the records, to be at fault
    /// and stops.
    pub max_store_refusals: usize,
    /// Share the topic's partitions with the other projectors of the same
    /// consumer name ([`meter::share`]); `None`: read every partition (a
    /// replay's fold into a shadow, `tollgate dev`).
    pub share: Option<ShareConfig>,
}

/// How a projector shares the topic's partitions with others.
#[derive(Debug, Clone)]
pub struct ShareConfig {
    /// How long a membership lasts unrenewed: how soon a killed projector's
    /// partitions are taken by the others.
    pub member_lease: chrono::Duration,
    /// How often a projector renews its membership and takes its share
    /// (well under the lease).
    pub heartbeat: Duration,
}

impl Default for ShareConfig {
    fn default() -> Self {
        ShareConfig { member_lease: chrono::Duration::seconds(10), heartbeat: Duration::from_secs(1) }
    }
}

impl ProjectorConfig {
    pub fn new(topic: impl Into<String>) -> Self {
        ProjectorConfig {
            consumer: "tollgate-projector".to_owned(),
            topic: topic.into(),
            max_batch: 5000,
            poll_wait: Duration::from_millis(200),
            linger: Duration::from_millis(10),
            horizon: meter::usage::DEFAULT_DEDUP_HORIZON,
            receipt_disorder: chrono::Duration::days(7),
            purge_every: chrono::Duration::hours(1),
            dead_letter_lease: chrono::Duration::seconds(30),
            publish_dead_letters: true,
            max_store_refusals: 16,
            share: None,
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    pub read: usize,
    pub folded: usize,
    pub duplicates: usize,
    /// Records put in the dead-letter outbox (those the store refused included).
    pub dead_lettered: usize,
    /// Of the dead-lettered, those the store refused.
    pub refused: usize,
    /// Transactions the batch took (more than one when it was bisected).
    pub commits: usize,
}

/// What becomes of one record: a fact to fold, or a dead letter's reason.
#[derive(Debug, Clone)]
enum Sorted {
    Fold(Box<UsageFact>),
    Dead(String),
}

/// The most folded event ids the view backlog keeps (see
/// [`Projector::flush_view_backlog`]).
const MAX_VIEW_BACKLOG_EVENTS: usize = 1_000_000;

/// What a project's view still has to learn of the fold: the newest durable
/// totals per counter, and the events whose pending deltas to drop.
#[derive(Debug, Default)]
struct ViewUpdate {
    totals: BTreeMap<CounterKey, (Counter, Totals)>,
    events: BTreeSet<EventId>,
}

/// Pending dead letters claimed at once.
const CLAIM: usize = 500;
/// The longest wait between two attempts to publish dead letters.
const MAX_DLQ_BACKOFF: Duration = Duration::from_secs(5);

/// Seeks `reader` to the offsets `store` holds for `consumer` on `topic`
/// (0 on a partition it holds none for); answers where it now stands.
pub(crate) async fn seek_to_stored<R: LogReader>(
    reader: &mut R,
    store: &dyn Store,
    consumer: &str,
    topic: &str,
) -> PortResult<BTreeMap<i32, i64>> {
    let partitions: BTreeSet<i32> = reader.partitions().await?.into_iter().collect();
    seek_partitions(reader, store, consumer, topic, &partitions).await
}

/// Seeks `reader` to the stored offsets of `partitions` only (it reads no
/// other); answers where it now stands.
async fn seek_partitions<R: LogReader>(
    reader: &mut R,
    store: &dyn Store,
    consumer: &str,
    topic: &str,
    partitions: &BTreeSet<i32>,
) -> PortResult<BTreeMap<i32, i64>> {
    let stored = store.offsets(consumer, topic).await?;
    let positions: BTreeMap<i32, i64> = partitions.iter().map(|p| (*p, stored.get(p).copied().unwrap_or(0))).collect();
    reader.seek(&positions).await?;
    Ok(positions)
}

/// The projector: a log reader, the store and the view.
pub struct Projector<R: LogReader> {
    reader: R,
    store: Arc<dyn Store>,
    view: Arc<dyn View>,
    clock: Arc<dyn Clock>,
    config: ProjectorConfig,
    positions: BTreeMap<i32, i64>,
    known_projects: BTreeSet<ProjectId>,
    /// This instance's name on its claims of dead letters.
    claimant: String,
    /// Records the store refused since it last folded one.
    refusals: usize,
    last_purge: Option<DateTime<Utc>>,
    /// When to look at the outbox for dead letters to publish next: at once
    /// (`None`) at start, since a projector before this one may have left
    /// some, and after a batch dead-lettered records; else a lease after the
    /// last look, when claims a dead projector held have lapsed.
    letters_check_at: Option<DateTime<Utc>>,
    /// View updates not applied yet (the view failed), by project.
    backlog: BTreeMap<ProjectId, ViewUpdate>,
    /// Every partition of the topic (sharing: what the share is of).
    partitions: Vec<i32>,
    /// Sharing: when the next heartbeat is due.
    next_heartbeat: Option<tokio::time::Instant>,
    /// When the lag per partition is sampled next (at once at start).
    next_lag_sample: Option<tokio::time::Instant>,
}

/// How often a projector samples how far each of its partitions' ends is
/// past its position: reading the ends costs a metadata request and one
/// watermark request per partition on Kafka.
const LAG_SAMPLE_EVERY: Duration = Duration::from_secs(5);

impl<R: LogReader> Projector<R> {
    pub fn new(
        reader: R,
        store: Arc<dyn Store>,
        view: Arc<dyn View>,
        clock: Arc<dyn Clock>,
        config: ProjectorConfig,
    ) -> Self {
        // Unique per instance: two projectors in one process (or on one
        // clock held still in a test) must never share their claims.
        let claimant = format!("{}@{}-{}", config.consumer, std::process::id(), uuid::Uuid::new_v4().simple());
        Projector {
            reader,
            store,
            view,
            clock,
            config,
            positions: BTreeMap::new(),
            known_projects: BTreeSet::new(),
            claimant,
            refusals: 0,
            last_purge: None,
            letters_check_at: None,
            backlog: BTreeMap::new(),
            partitions: Vec::new(),
            next_heartbeat: None,
            next_lag_sample: None,
        }
    }

    /// The reader (a replay raises its bound between steps).
    pub fn reader_mut(&mut self) -> &mut R {
        &mut self.reader
    }

    /// Positions the reader at the offsets the store holds (0 where it
    /// holds none) of the partitions it reads: all of them, or (sharing)
    /// its share, taken now.
    pub async fn start(&mut self) -> PortResult<()> {
        self.partitions = self.reader.partitions().await?;
        let mine = match self.config.share.clone() {
            None => self.partitions.iter().copied().collect(),
            Some(share) => self.heartbeat(&share).await?,
        };
        self.position(&mine).await
    }

    /// Seeks to the stored offsets of `partitions`, reading no other.
    async fn position(&mut self, partitions: &BTreeSet<i32>) -> PortResult<()> {
        let (store, c) = (self.store.as_ref(), &self.config);
        let positions = seek_partitions(&mut self.reader, store, &c.consumer, &c.topic, partitions).await?;
        info!(consumer = %self.config.consumer, ?positions, "projector positioned");
        metrics::gauge!("tollgate_projector_partitions").set(positions.len() as f64);
        // A partition given back is another projector's to report.
        for p in self.positions.keys().filter(|p| !positions.contains_key(p)) {
            self.lag_gauge(*p).set(0.0);
        }
        self.positions = positions;
        self.next_lag_sample = None;
        Ok(())
    }

    fn lag_gauge(&self, partition: i32) -> metrics::Gauge {
        metrics::gauge!(
            "tollgate_projector_partition_lag_offsets",
            "consumer" => self.config.consumer.clone(),
            "partition" => partition.to_string()
        )
    }

    /// Samples, at most every [`LAG_SAMPLE_EVERY`], how far the log's end
    /// of each partition this projector holds is past its position
    /// (`tollgate_projector_partition_lag_offsets`: records on Kafka, whose
    /// offsets are contiguous; an upper bound on the embedded log, whose
    /// topics share one sequence of offsets). A log that cannot tell its
    /// ends leaves the gauge unset.
    async fn sample_lag(&mut self) {
        let now = tokio::time::Instant::now();
        if self.next_lag_sample.is_some_and(|due| now < due) {
            return;
        }
        self.next_lag_sample = Some(now + LAG_SAMPLE_EVERY);
        // A log that does not answer soon is sampled next time: the
        // fold does not wait for a gauge.
        match tokio::time::timeout(Duration::from_secs(1), self.reader.ends())
            .await
            .unwrap_or_else(|_| Err(PortError::Transient("no answer within 1 s".into())))
        {
            Ok(ends) => {
                for (p, at) in &self.positions {
                    let behind = ends.get(p).map_or(0, |end| end.saturating_sub(*at).max(0));
                    self.lag_gauge(*p).set(behind as f64);
                }
            }
            Err(e) => debug!(error = %e, "the log's ends are unknown: lag not sampled"),
        }
    }

    /// Sharing: renews this projector's membership and takes its share of
    /// the partitions ([`meter::share`]); the next heartbeat is due a
    /// [`ShareConfig::heartbeat`] later.
    async fn heartbeat(&mut self, share: &ShareConfig) -> PortResult<BTreeSet<i32>> {
        let at = self.clock.now();
        let mine = self
            .store
            .share_partitions(
                &self.config.consumer,
                &self.config.topic,
                &self.claimant,
                &self.partitions,
                at,
                at + share.member_lease,
            )
            .await?;
        self.next_heartbeat = Some(tokio::time::Instant::now() + share.heartbeat);
        Ok(mine)
    }

    /// Sharing: a heartbeat when one is due, and a move to the partitions
    /// it gives (between batches: nothing is in flight).
    async fn share(&mut self) -> PortResult<()> {
        let Some(share) = self.config.share.clone() else { return Ok(()) };
        if self.next_heartbeat.is_some_and(|t| tokio::time::Instant::now() < t) {
            return Ok(());
        }
        let mine = self.heartbeat(&share).await?;
        let held: BTreeSet<i32> = self.positions.keys().copied().collect();
        if mine != held {
            info!(consumer = %self.config.consumer, from = ?held, to = ?mine, "projector's share of the partitions changed");
            self.position(&mine).await?;
        }
        Ok(())
    }

    /// Sharing: gives back this projector's membership and partitions, so
    /// the others take them at once rather than when its lease lapses.
    async fn leave(&self) {
        if self.config.share.is_some()
            && let Err(e) = self.store.leave_partitions(&self.config.consumer, &self.config.topic, &self.claimant).await
        {
            warn!(error = %e, "projector could not give back its partitions; they are free when its lease lapses");
        }
    }

    /// Runs steps until `shutdown` resolves. Transient failures (and a
    /// fence) re-seek to the stored offsets and retry; they never skip a
    /// record. It returns an error only for a store it takes to be broken.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) -> PortResult<()> {
        tokio::pin!(shutdown);
        loop {
            if let Err(e) = self.start().await {
                warn!(error = %e, "projector cannot start yet");
                tokio::select! {
                    _ = &mut shutdown => {
                        self.leave().await;
                        return Ok(());
                    }
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                }
            }
            loop {
                let step = tokio::select! {
                    _ = &mut shutdown => {
                        self.leave().await;
                        return Ok(());
                    }
                    r = self.step() => r,
                };
                match step {
                    Ok(r) if r.read > 0 => debug!(?r, "projector step"),
                    Ok(_) => {}
                    Err(PortError::Permanent(e)) => {
                        return Err(PortError::Permanent(e));
                    }
                    Err(e) => {
                        warn!(error = %e, "projector step failed; re-seeking to stored offsets");
                        tokio::select! {
                            _ = &mut shutdown => return Ok(()),
                            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                        }
                        break;
                    }
                }
            }
        }
    }

    /// Publishes dead letters left pending, reads a batch, sorts it, folds
    /// and commits it (bisecting what the store refuses), publishes its dead
    /// letters, then updates the view.
    pub async fn step(&mut self) -> PortResult<StepReport> {
        self.share().await?;
        self.publish_dead_letters().await;
        self.sample_lag().await;
        let mut records = self.reader.poll(self.config.max_batch, self.config.poll_wait).await?;
        if !records.is_empty() && !self.config.linger.is_zero() && records.len() < self.config.max_batch {
            // One read after the linger, not one per record appended
            // meanwhile (each a query of the log, on the cores the
            // appenders run on).
            tokio::time::sleep(self.config.linger).await;
            // A failed read ends the lingering, not the step: the records
            // in hand are folded, and the next poll meets the failure again.
            if let Ok(more) = self.reader.poll(self.config.max_batch - records.len(), Duration::ZERO).await {
                records.extend(more);
            }
        }
        // Sharing: a record of a partition given back, fetched before the
        // move, is the new holder's to fold.
        if self.config.share.is_some() {
            records.retain(|r| self.positions.contains_key(&r.partition));
        }
        let mut report = StepReport { read: records.len(), ..StepReport::default() };
        if records.is_empty() {
            self.flush_view_backlog().await;
            self.purge().await;
            return Ok(report);
        }
        let now = self.clock.now();
        let mut sorted = Vec::with_capacity(records.len());
        for rec in &records {
            sorted.push(self.sort(rec).await?);
        }
        let folds = self.commit(&records, &mut sorted, &mut report).await?;
        // Corrections the fold refused: dead-lettered in its transaction.
        for (project, event, reason) in folds.iter().flat_map(|f| &f.refused) {
            debug!(%project, %event, %reason, "correction refused");
            report.dead_lettered += 1;
            self.letters_check_at = None;
            metrics::counter!("tollgate_dead_letters_total", "reason" => "invalid").increment(1);
        }
        for s in &sorted {
            if let Sorted::Dead(reason) = s {
                debug!(%reason, "dead-lettered");
                report.dead_lettered += 1;
                self.letters_check_at = None;
                metrics::counter!("tollgate_dead_letters_total", "reason" => reason_class(reason)).increment(1);
            }
        }
        if report.dead_lettered > 0 {
            warn!(n = report.dead_lettered, refused = report.refused, "records dead-lettered");
        }
        report.folded = folds.iter().map(|f| f.folded.len()).sum();
        report.duplicates = folds.iter().map(|f| f.duplicates.len()).sum();
        metrics::counter!("tollgate_projector_events_total", "result" => "folded").increment(report.folded as u64);
        metrics::counter!("tollgate_projector_events_total", "result" => "duplicate")
            .increment(report.duplicates as u64);
        metrics::counter!("tollgate_projector_events_total", "result" => "dead_lettered")
            .increment(report.dead_lettered as u64);
        let oldest = sorted
            .iter()
            .filter_map(|s| match s {
                Sorted::Fold(f) => Some(f.receipt()),
                Sorted::Dead(_) => None,
            })
            .min();
        if let Some(oldest) = oldest {
            metrics::histogram!("tollgate_projector_lag_seconds")
                .record((now - oldest).num_milliseconds().max(0) as f64 / 1000.0);
        }
        self.publish_dead_letters().await;

        // The view: per project, the newest durable totals of each counter
        // the batch touched and the events whose pending deltas they now
        // contain (folded or duplicate alike).
        let mut totals: BTreeMap<(ProjectId, CounterKey), (Counter, Totals)> = BTreeMap::new();
        let mut events: BTreeMap<ProjectId, Vec<EventId>> = BTreeMap::new();
        let mut lowered: BTreeMap<ProjectId, Vec<(Counter, Totals)>> = BTreeMap::new();
        for fold in folds {
            for (p, c, t) in fold.lowered {
                lowered.entry(p).or_default().push((c, t));
            }
            for (p, c, t) in fold.totals {
                totals.insert((p, c.key.clone()), (c, t));
            }
            for (p, e) in fold.folded.into_iter().chain(fold.duplicates) {
                events.entry(p).or_default().push(e);
            }
        }
        for ((p, key), ct) in totals {
            self.backlog.entry(p).or_default().totals.insert(key, ct);
        }
        for (p, e) in events {
            self.backlog.entry(p).or_default().events.extend(e);
        }
        self.flush_view_backlog().await;
        for (project, totals) in lowered {
            self.lower_view(&project, &totals).await;
        }
        self.purge().await;
        Ok(report)
    }

    /// Folds `records` (sorted as `sorted`) in as few transactions as the
    /// store allows: the whole batch, or, when it refuses it, each half on
    /// its own, down to the refused fact, which becomes a dead letter with
    /// the store's reason. Returns what each commit folded, in order.
    async fn commit(
        &mut self,
        records: &[LogRecord],
        sorted: &mut [Sorted],
        report: &mut StepReport,
    ) -> PortResult<Vec<FoldReport>> {
        let mut folds = Vec::new();
        // Spans of the batch still to fold, the next one last.
        let mut spans = vec![(0, records.len())];
        while let Some((lo, hi)) = spans.pop() {
            let batch = self.batch_of(&records[lo..hi], &sorted[lo..hi]);
            match self.store.fold_batch(&batch).await {
                Ok(fold) => {
                    for m in &batch.offsets {
                        self.positions.insert(m.partition, m.to);
                    }
                    if !batch.facts.is_empty() {
                        self.refusals = 0;
                    }
                    report.commits += 1;
                    folds.push(fold);
                }
                Err(PortError::Permanent(why)) => {
                    let facts: Vec<usize> = (lo..hi).filter(|&i| matches!(sorted[i], Sorted::Fold(_))).collect();
                    match facts.as_slice() {
                        // Offsets and dead letters alone refused: it is the store.
                        [] => return Err(PortError::Permanent(why)),
                        [one] => {
                            self.refusals += 1;
                            if self.refusals >= self.config.max_store_refusals {
                                return Err(PortError::Permanent(format!(
                                    "the store refused {} records in a row with none folded between them, \
                                     so it is taken to be at fault; the last refusal: {why}",
                                    self.refusals
                                )));
                            }
                            let rec = &records[*one];
                            warn!(partition = rec.partition, offset = rec.offset, error = %why, "the store refuses a record");
                            metrics::counter!("tollgate_projector_store_refusals_total").increment(1);
                            report.refused += 1;
                            sorted[*one] = Sorted::Dead(format!("refused by the store: {why}"));
                            spans.push((lo, hi));
                        }
                        more => {
                            let mid = more[more.len() / 2];
                            debug!(lo, mid, hi, "bisecting a batch the store refused");
                            spans.push((mid, hi));
                            spans.push((lo, mid));
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(folds)
    }

    /// The batch that folds `records` as `sorted` says, from where each
    /// partition stands now to just past its last record there.
    fn batch_of(&self, records: &[LogRecord], sorted: &[Sorted]) -> FoldBatch {
        let mut moves: BTreeMap<i32, OffsetMove> = BTreeMap::new();
        let mut facts = Vec::new();
        let mut dead_letters = Vec::new();
        let mut sources = BTreeMap::new();
        for (rec, s) in records.iter().zip(sorted) {
            let from = self.positions.get(&rec.partition).copied().unwrap_or(0);
            let m = moves.entry(rec.partition).or_insert(OffsetMove { partition: rec.partition, from, to: from });
            m.to = m.to.max(rec.offset + 1);
            match s {
                Sorted::Fold(f) => {
                    // A correction the fold may refuse is dead-lettered as its record.
                    if f.kind == EventKind::Correction {
                        sources.insert(
                            facts.len(),
                            FactSource {
                                partition: rec.partition,
                                offset: rec.offset,
                                key: rec.key.clone(),
                                payload: rec.payload.clone(),
                            },
                        );
                    }
                    facts.push(UsageFact::clone(f));
                }
                Sorted::Dead(reason) => dead_letters.push(DeadLetter {
                    partition: rec.partition,
                    offset: rec.offset,
                    key: rec.key.clone(),
                    payload: rec.payload.clone(),
                    reason: reason.clone(),
                }),
            }
        }
        FoldBatch {
            consumer: self.config.consumer.clone(),
            topic: self.config.topic.clone(),
            offsets: moves.into_values().collect(),
            facts,
            dead_letters,
            sources,
            horizon: Some(self.config.horizon),
        }
    }

    /// Brings the view up to date with everything folded so far: each
    /// project's update of the backlog is tried (up to three times, briefly
    /// apart); one that still fails stays in the backlog, merged with the
    /// next batches' (the newest totals per counter, every event id), and
    /// is tried again at the next step — also when the log is idle. So the
    /// pending deltas of a folded event are dropped whenever the view is
    /// back, however many updates failed meanwhile (DESIGN §10).
    async fn flush_view_backlog(&mut self) {
        if self.backlog.is_empty() {
            return;
        }
        let at = self.clock.now();
        let projects: Vec<ProjectId> = self.backlog.keys().cloned().collect();
        for project in projects {
            let Some(update) = self.backlog.get(&project) else { continue };
            let totals: Vec<(Counter, Totals)> = update.totals.values().cloned().collect();
            let events: Vec<EventId> = update.events.iter().cloned().collect();
            let mut delay = Duration::from_millis(20);
            let mut done = false;
            for attempt in 0..3 {
                match self.view.apply_fold(&project, &totals, &events, at).await {
                    Ok(()) => {
                        done = true;
                        break;
                    }
                    Err(e) => {
                        warn!(error = %e, %project, attempt, "view update failed; kept for the next step");
                        metrics::counter!("tollgate_view_update_failures_total").increment(1);
                        if attempt < 2 {
                            tokio::time::sleep(delay).await;
                            delay *= 2;
                        }
                    }
                }
            }
            if done {
                self.backlog.remove(&project);
            } else {
                // The view is down: the others would fail alike.
                break;
            }
        }
        let mut held: usize = self.backlog.values().map(|u| u.events.len()).sum();
        while held > MAX_VIEW_BACKLOG_EVENTS {
            // Bounded: the oldest projects' updates go first. Their pending
            // deltas then over-count until their indexes expire (a view down
            // this long has usually lost them anyway, and is re-seeded).
            let Some((project, update)) = self.backlog.pop_first() else { break };
            warn!(%project, events = update.events.len(), "view backlog full; an update is dropped");
            metrics::counter!("tollgate_view_backlog_dropped_total").increment(update.events.len() as u64);
            held -= update.events.len();
        }
        metrics::gauge!("tollgate_view_backlog_events").set(held as f64);
    }

    /// Lowers the counters corrections took usage back from (after
    /// [`Projector::update_view`], which only raises), retried like it.
    async fn lower_view(&self, project: &ProjectId, totals: &[(Counter, Totals)]) {
        let mut delay = Duration::from_millis(50);
        for attempt in 0..6 {
            match self.view.lower_totals(project, totals).await {
                Ok(()) => return,
                Err(e) => {
                    warn!(error = %e, %project, attempt, "view update (lowering) failed");
                    metrics::counter!("tollgate_view_update_failures_total").increment(1);
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
        // The view over-counts (the safe direction) until it is re-seeded.
    }

    /// Decodes and validates one record: a fact to fold, or why not.
    /// `Err` when the store cannot answer.
    async fn sort(&mut self, rec: &LogRecord) -> PortResult<Sorted> {
        let mut fact = match schemas::decode_usage(&rec.payload) {
            Ok(f) => f,
            Err(e) => return Ok(Sorted::Dead(format!("malformed: {e}"))),
        };
        // The receipt: the gateway's stamp, else the log's own timestamp.
        if fact.received_at.is_none() {
            fact.received_at = rec.timestamp;
        }
        if let Err(e) = meter::usage::check_fact(&fact) {
            return Ok(Sorted::Dead(format!("invalid: {e}")));
        }
        if let Err(e) = meter::usage::check_fact_time(fact.occurred_at, fact.receipt(), self.config.horizon) {
            return Ok(Sorted::Dead(format!("out of range: {e}")));
        }
        if !self.known_projects.contains(&fact.project_id) {
            if self.store.project(&fact.project_id).await?.is_none() {
                return Ok(Sorted::Dead(format!("invalid: unknown project {}", fact.project_id)));
            }
            self.known_projects.insert(fact.project_id.clone());
        }
        Ok(Sorted::Fold(Box::new(fact)))
    }

    /// Publishes every pending dead letter, waiting (with a backoff) for as
    /// long as the DLQ or the store cannot be written: the letters are
    /// durable in the store meanwhile, and the projector does not exit.
    async fn publish_dead_letters(&mut self) {
        if !self.config.publish_dead_letters || self.letters_check_at.is_some_and(|t| self.clock.now() < t) {
            return;
        }
        let mut delay = Duration::from_millis(100);
        loop {
            match self.publish_pending().await {
                Ok(n) => {
                    metrics::counter!("tollgate_dead_letters_published_total").increment(n as u64);
                    self.letters_check_at = Some(self.clock.now() + self.config.dead_letter_lease);
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "dead letters not published yet; retrying");
                    metrics::counter!("tollgate_dead_letter_publish_failures_total").increment(1);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(MAX_DLQ_BACKOFF);
                }
            }
        }
    }

    /// One pass over the pending dead letters; how many it published.
    async fn publish_pending(&mut self) -> PortResult<usize> {
        let (consumer, topic) = (self.config.consumer.clone(), self.config.topic.clone());
        let mut published = 0;
        loop {
            let now = self.clock.now();
            let until = now + self.config.dead_letter_lease;
            let claimed = self.store.claim_dead_letters(&consumer, &topic, &self.claimant, now, until, CLAIM).await?;
            if claimed.is_empty() {
                return Ok(published);
            }
            let position = |l: &DeadLetter| (l.partition, l.offset);
            // Letters an earlier attempt may have written: look past the
            // earliest of their marks.
            let marks: Vec<&DlqMark> = claimed.iter().filter_map(|p| p.mark.as_ref()).collect();
            let present = if marks.is_empty() {
                BTreeSet::new()
            } else {
                self.reader.dead_lettered_since(&earliest(&marks)).await?
            };
            let fresh: Vec<(i32, i64)> =
                claimed.iter().filter(|p| p.mark.is_none()).map(|p| position(&p.letter)).collect();
            if !fresh.is_empty() {
                let mark = self.reader.dead_letter_mark().await?;
                self.store.mark_dead_letters(&consumer, &topic, &fresh, &mark).await?;
            }
            for p in &claimed {
                let l = &p.letter;
                if present.contains(&position(l)) {
                    debug!(partition = l.partition, offset = l.offset, "dead letter already on the DLQ");
                    continue;
                }
                let record = LogRecord {
                    partition: l.partition,
                    offset: l.offset,
                    key: l.key.clone(),
                    payload: l.payload.clone(),
                    timestamp: None,
                };
                self.reader.dead_letter(&record, &l.reason).await?;
                published += 1;
            }
            let all: Vec<(i32, i64)> = claimed.iter().map(|p| position(&p.letter)).collect();
            self.store.dead_letters_published(&consumer, &topic, &all).await?;
        }
    }

    /// Purges the dedup set if it is time to (see
    /// [`ProjectorConfig::purge_every`]); a failure waits for the next time.
    async fn purge(&mut self) {
        let now = self.clock.now();
        if self.last_purge.is_some_and(|t| now - t < self.config.purge_every) {
            return;
        }
        self.last_purge = Some(now);
        let keep = self.config.horizon + self.config.receipt_disorder;
        match self.store.purge_processed(&self.config.consumer, &self.config.topic, keep, now).await {
            Ok(0) => {}
            Ok(n) => info!(forgotten = n, "dedup set purged"),
            Err(e) => warn!(error = %e, "purging the dedup set failed; trying again later"),
        }
    }
}

/// Per partition, the earliest of `marks` (a partition one of them does not
/// know is read from its start).
fn earliest(marks: &[&DlqMark]) -> DlqMark {
    let partitions: BTreeSet<i32> = marks.iter().flat_map(|m| m.keys().copied()).collect();
    partitions
        .into_iter()
        .map(|p| (p, marks.iter().map(|m| m.get(&p).copied().unwrap_or(0)).min().unwrap_or(0)))
        .collect()
}

/// The cause of a dead letter, as a metric label: the reason's first word
/// (`malformed`, `invalid`, `out_of_range`; `store` for what the store
/// refused).
fn reason_class(reason: &str) -> &'static str {
    match reason.split(':').next().unwrap_or_default() {
        "malformed" => "malformed",
        "invalid" => "invalid",
        "out of range" => "out_of_range",
        _ => "store",
    }
}
