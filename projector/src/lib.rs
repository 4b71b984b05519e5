//! # projector — folds the usage log, exactly once
//!
//! Each step reads a batch from the log, sorts every record into *fold* or
//! *dead-letter* (malformed bytes, an unknown project, an event outside the
//! dedup horizon or too far in the future, a kind this release does not
//! fold), puts the dead letters on the DLQ topic, and then folds the rest into
//! the store **in the same transaction that moves the partition offsets**.
//! Only after that commit is the view brought up to date. So:
//!
//! - a crash before the commit re-reads the same records (nothing lost);
//! - a crash after it resumes from the stored offsets (nothing counted twice);
//! - a second projector that moved the offsets fences this one out;
//! - the same event id sent twice is folded once (dedup in the store).
//!
//! Kafka's committed offsets are never read or written.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use meter::{
    Clock, Counter, EventId, FoldBatch, LogReader, LogRecord, OffsetMove, PortError, PortResult, ProjectId, Store,
    Totals, UsageFact, View,
};
use tracing::{debug, info, warn};

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
    /// Events older than this are dead-lettered.
    pub horizon: chrono::Duration,
}

impl ProjectorConfig {
    pub fn new(topic: impl Into<String>) -> Self {
        ProjectorConfig {
            consumer: "tollgate-projector".to_owned(),
            topic: topic.into(),
            max_batch: 5000,
            poll_wait: Duration::from_millis(200),
            horizon: meter::usage::DEFAULT_DEDUP_HORIZON,
        }
    }
}

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    pub read: usize,
    pub folded: usize,
    pub duplicates: usize,
    pub dead_lettered: usize,
}

/// The projector: a log reader, the store and the view.
pub struct Projector<R: LogReader> {
    reader: R,
    store: Arc<dyn Store>,
    view: Arc<dyn View>,
    clock: Arc<dyn Clock>,
    config: ProjectorConfig,
    positions: BTreeMap<i32, i64>,
    known_projects: HashMap<ProjectId, ()>,
}

impl<R: LogReader> Projector<R> {
    pub fn new(
        reader: R,
        store: Arc<dyn Store>,
        view: Arc<dyn View>,
        clock: Arc<dyn Clock>,
        config: ProjectorConfig,
    ) -> Self {
        Projector { reader, store, view, clock, config, positions: BTreeMap::new(), known_projects: HashMap::new() }
    }

    /// Positions the reader at the offsets the store holds (0 where it holds none).
    pub async fn start(&mut self) -> PortResult<()> {
        let stored = self.store.offsets(&self.config.consumer, &self.config.topic).await?;
        let mut positions = BTreeMap::new();
        for p in self.reader.partitions().await? {
            positions.insert(p, stored.get(&p).copied().unwrap_or(0));
        }
        self.reader.seek(&positions).await?;
        info!(consumer = %self.config.consumer, ?positions, "projector positioned");
        self.positions = positions;
        Ok(())
    }

    /// Runs steps until `shutdown` resolves. Transient failures re-seek to the
    /// stored offsets and retry; they never skip a record.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) -> PortResult<()> {
        tokio::pin!(shutdown);
        loop {
            if let Err(e) = self.start().await {
                warn!(error = %e, "projector cannot start yet");
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                }
            }
            loop {
                let step = tokio::select! {
                    _ = &mut shutdown => return Ok(()),
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
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        break;
                    }
                }
            }
        }
    }

    /// Reads, sorts, dead-letters, folds and commits one batch, then updates the view.
    pub async fn step(&mut self) -> PortResult<StepReport> {
        let records = self.reader.poll(self.config.max_batch, self.config.poll_wait).await?;
        let mut report = StepReport { read: records.len(), ..StepReport::default() };
        if records.is_empty() {
            return Ok(report);
        }
        let now = self.clock.now();
        let mut facts = Vec::with_capacity(records.len());
        let mut moves: BTreeMap<i32, OffsetMove> = BTreeMap::new();
        for rec in &records {
            let from = self.positions.get(&rec.partition).copied().unwrap_or(0);
            let m = moves.entry(rec.partition).or_insert(OffsetMove { partition: rec.partition, from, to: from });
            m.to = m.to.max(rec.offset + 1);
            match self.sort(rec, now).await? {
                Ok(fact) => facts.push(fact),
                Err(reason) => {
                    warn!(partition = rec.partition, offset = rec.offset, %reason, "dead-lettering record");
                    self.reader.dead_letter(rec, &reason).await?;
                    report.dead_lettered += 1;
                    metrics::counter!("tollgate_dead_letters_total", "reason" => reason_class(&reason)).increment(1);
                }
            }
        }
        let batch = FoldBatch {
            consumer: self.config.consumer.clone(),
            topic: self.config.topic.clone(),
            offsets: moves.values().cloned().collect(),
            facts,
        };
        let folded = self.store.fold_batch(&batch).await?;
        for m in moves.values() {
            self.positions.insert(m.partition, m.to);
        }
        report.folded = folded.folded.len();
        report.duplicates = folded.duplicates.len();
        metrics::counter!("tollgate_projector_events_total", "result" => "folded").increment(report.folded as u64);
        metrics::counter!("tollgate_projector_events_total", "result" => "duplicate")
            .increment(report.duplicates as u64);
        metrics::counter!("tollgate_projector_events_total", "result" => "dead_lettered")
            .increment(report.dead_lettered as u64);
        if let Some(oldest) = batch.facts.iter().map(|f| f.occurred_at).min() {
            metrics::histogram!("tollgate_projector_lag_seconds")
                .record((now - oldest).num_milliseconds().max(0) as f64 / 1000.0);
        }

        // The view: per project, the new durable totals and the events whose
        // pending deltas they now contain (folded or duplicate alike).
        type Folded = (Vec<(Counter, Totals)>, Vec<EventId>);
        let mut per_project: BTreeMap<ProjectId, Folded> = BTreeMap::new();
        for (p, c, t) in folded.totals {
            per_project.entry(p).or_default().0.push((c, t));
        }
        for (p, e) in folded.folded.into_iter().chain(folded.duplicates) {
            per_project.entry(p).or_default().1.push(e);
        }
        for (project, (totals, events)) in per_project {
            self.update_view(&project, &totals, &events).await;
        }
        Ok(report)
    }

    async fn update_view(&self, project: &ProjectId, totals: &[(Counter, Totals)], events: &[EventId]) {
        let mut delay = Duration::from_millis(50);
        for attempt in 0..6 {
            match self.view.apply_fold(project, totals, events).await {
                Ok(()) => return,
                Err(e) => {
                    warn!(error = %e, %project, attempt, "view update failed");
                    metrics::counter!("tollgate_view_update_failures_total").increment(1);
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
        // The store is right; the view catches up at the next fold of these
        // counters, or is re-seeded from the store if it was lost.
    }

    /// Decodes and validates one record: `Ok(Ok(fact))` to fold,
    /// `Ok(Err(reason))` to dead-letter, `Err` when the store cannot answer.
    async fn sort(
        &mut self,
        rec: &LogRecord,
        now: chrono::DateTime<chrono::Utc>,
    ) -> PortResult<Result<UsageFact, String>> {
        let fact = match schemas::decode_usage(&rec.payload) {
            Ok(f) => f,
            Err(e) => return Ok(Err(format!("malformed: {e}"))),
        };
        if let Err(e) = meter::usage::check_fact(&fact) {
            return Ok(Err(format!("invalid: {e}")));
        }
        if let Err(e) = meter::usage::check_fact_time(fact.occurred_at, now, self.config.horizon) {
            return Ok(Err(format!("out of range: {e}")));
        }
        if !self.known_projects.contains_key(&fact.project_id) {
            if self.store.project(&fact.project_id).await?.is_none() {
                return Ok(Err(format!("invalid: unknown project {}", fact.project_id)));
            }
            self.known_projects.insert(fact.project_id.clone(), ());
        }
        Ok(Ok(fact))
    }
}

/// The cause of a dead letter, as a metric label: the reason's first word
/// (`malformed`, `invalid`, `out_of_range`, `store`).
fn reason_class(reason: &str) -> &'static str {
    match reason.split(':').next().unwrap_or_default() {
        "malformed" => "malformed",
        "invalid" => "invalid",
        "out of range" => "out_of_range",
        _ => "store",
    }
}
