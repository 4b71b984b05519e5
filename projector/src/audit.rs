//! The audit trail from the log (DESIGN §12): the **relay**, which
//! publishes the store's audit outbox to the audit topic, and the **audit
//! folder**, which writes the audit log from that topic. Both run where the
//! projector runs (`tollgate project`, `tollgate dev` and anything embedding
//! the gateway's `Embedded`), in one task ([`run`]); the
//! writers of entries (gateways, the projector's fold, the notifier) only
//! ever write the outbox, in their own transactions.
//!
//! - **Relay.** [`AuditRelay::step`] reads pending outbox entries in the
//!   order they were written, publishes them (acknowledged by the topic),
//!   then marks them published. A relay killed between the publish and the
//!   mark publishes them again at its next step: an entry's id is stable,
//!   so the copy is the same entry, and the folder keeps one. Several
//!   relays (two projectors) may publish the same entries; the same holds.
//! - **Folder.** [`AuditFolder::step`] reads a batch of the audit topic from
//!   the offsets the store keeps under its own consumer name, decodes each
//!   record ([`schemas::decode_audit`]), and folds the entries into the audit
//!   log **in the transaction that moves its offsets**
//!   ([`AuditStore::fold_audit`](meter::AuditStore::fold_audit)), idempotent
//!   on the id and the once-key. A record it cannot decode (a writer newer
//!   than this release, bytes not ours) is put on the dead-letter topic with
//!   its reason before that transaction: every record is folded or
//!   dead-lettered, none skipped (a crash between the two may dead-letter
//!   one twice). Kafka's committed offsets are never used.
//! - **Lag.** Each round relays, then polls the topic for at most
//!   [`AuditConfig::poll_wait`]: an entry reaches `GET /v1/audit` about one
//!   poll after it was written.
//! - **Failures** never stop it: a failed relay is retried with a backoff
//!   (the entries wait in the outbox), a failed fold re-seeks to the stored
//!   offsets and reads again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use meter::{AuditBatch, AuditId, AuditLog, AuditStore, Clock, LogReader, OffsetMove, PortResult, Store};
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Tunables of the relay and the folder.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// The name the folder's offsets are stored under.
    pub consumer: String,
    /// The audit topic.
    pub topic: String,
    /// Most records folded (and outbox entries published) at once.
    pub max_batch: usize,
    /// How long one poll of the topic waits for the first record.
    pub poll_wait: Duration,
}

impl AuditConfig {
    pub fn new(topic: impl Into<String>) -> Self {
        AuditConfig {
            consumer: "tollgate-audit".to_owned(),
            topic: topic.into(),
            max_batch: 500,
            poll_wait: Duration::from_millis(200),
        }
    }
}

/// Publishes the audit outbox to the audit topic.
pub struct AuditRelay {
    store: Arc<dyn AuditStore>,
    log: Arc<dyn AuditLog>,
    clock: Arc<dyn Clock>,
    batch: usize,
}

impl AuditRelay {
    pub fn new(store: Arc<dyn AuditStore>, log: Arc<dyn AuditLog>, clock: Arc<dyn Clock>, batch: usize) -> Self {
        AuditRelay { store, log, clock, batch: batch.max(1) }
    }

    /// One step: publishes up to a batch of pending entries and marks them
    /// published. Returns how many it published.
    pub async fn step(&self) -> PortResult<usize> {
        let pending = self.store.unpublished_audit(self.batch).await?;
        if pending.is_empty() {
            return Ok(0);
        }
        self.log.publish_audit(&pending).await?;
        let ids: Vec<AuditId> = pending.iter().map(|e| e.id.clone()).collect();
        self.store.audit_published(&ids, self.clock.now()).await?;
        metrics::counter!("tollgate_audit_published_total").increment(ids.len() as u64);
        Ok(ids.len())
    }

    /// Steps until the outbox is empty (or a step fails). Returns how many
    /// it published.
    pub async fn drain(&self) -> PortResult<usize> {
        let mut total = 0;
        loop {
            match self.step().await? {
                0 => return Ok(total),
                n => total += n,
            }
        }
    }
}

/// What one folder step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditStep {
    pub read: usize,
    /// Entries new to the audit log.
    pub folded: usize,
    /// Entries the log held already (a record published twice).
    pub duplicates: usize,
    pub dead_lettered: usize,
}

/// Folds the audit topic into the audit log.
pub struct AuditFolder<R: LogReader> {
    reader: R,
    store: Arc<dyn Store>,
    config: AuditConfig,
    positions: BTreeMap<i32, i64>,
}

impl<R: LogReader> AuditFolder<R> {
    pub fn new(reader: R, store: Arc<dyn Store>, config: AuditConfig) -> Self {
        AuditFolder { reader, store, config, positions: BTreeMap::new() }
    }

    /// The reader (a replay raises its bound between steps).
    pub fn reader_mut(&mut self) -> &mut R {
        &mut self.reader
    }

    /// Positions the reader at the offsets the store holds (0 where it holds none).
    pub async fn start(&mut self) -> PortResult<()> {
        let positions =
            crate::seek_to_stored(&mut self.reader, self.store.as_ref(), &self.config.consumer, &self.config.topic)
                .await?;
        info!(consumer = %self.config.consumer, ?positions, "audit folder positioned");
        self.positions = positions;
        Ok(())
    }

    /// Reads a batch, dead-letters what cannot be decoded, and folds the
    /// rest with the offsets past all of it.
    pub async fn step(&mut self) -> PortResult<AuditStep> {
        let records = self.reader.poll(self.config.max_batch, self.config.poll_wait).await?;
        let mut report = AuditStep { read: records.len(), ..AuditStep::default() };
        if records.is_empty() {
            return Ok(report);
        }
        let mut entries = Vec::with_capacity(records.len());
        let mut ends: BTreeMap<i32, i64> = BTreeMap::new();
        for r in &records {
            // An offset is the broker's, never near i64::MAX; saturate anyway.
            let next = r.offset.saturating_add(1);
            let end = ends.entry(r.partition).or_insert(next);
            *end = (*end).max(next);
            match schemas::decode_audit(&r.payload) {
                Ok(e) => entries.push(e),
                Err(e) => {
                    let reason = format!("malformed: {e}");
                    self.reader.dead_letter(r, &reason).await?;
                    warn!(partition = r.partition, offset = r.offset, %reason, "audit record dead-lettered");
                    metrics::counter!("tollgate_dead_letters_total", "reason" => "audit").increment(1);
                    report.dead_lettered += 1;
                }
            }
        }
        let offsets: Vec<OffsetMove> = ends
            .iter()
            .map(|(&partition, &to)| {
                let from = self.positions.get(&partition).copied().unwrap_or(0);
                OffsetMove { partition, from, to: to.max(from) }
            })
            .collect();
        let batch = AuditBatch {
            consumer: self.config.consumer.clone(),
            topic: self.config.topic.clone(),
            entries,
            offsets: offsets.clone(),
        };
        report.folded = self.store.fold_audit(&batch).await?;
        report.duplicates = batch.entries.len().saturating_sub(report.folded);
        for m in offsets {
            self.positions.insert(m.partition, m.to);
        }
        metrics::counter!("tollgate_audit_folded_total").increment(report.folded as u64);
        Ok(report)
    }
}

/// The longest wait between two attempts after a failure.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Runs the relay (if given) and the folder until `shutdown` resolves: each
/// round relays what the outbox holds, then folds a poll of the topic.
/// Failures are retried (see the module doc); it ends only at shutdown.
pub async fn run<R: LogReader>(
    relay: Option<AuditRelay>,
    mut folder: AuditFolder<R>,
    shutdown: impl std::future::Future<Output = ()>,
) -> PortResult<()> {
    tokio::pin!(shutdown);
    let mut relay_backoff = Duration::from_millis(100);
    let mut relay_at = Instant::now();
    let mut fold_backoff = Duration::from_millis(100);
    let mut positioned = false;
    loop {
        if let Some(relay) = &relay
            && Instant::now() >= relay_at
        {
            let relayed = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                r = relay.step() => r,
            };
            match relayed {
                Ok(n) => {
                    if n > 0 {
                        debug!(n, "audit entries published");
                    }
                    relay_backoff = Duration::from_millis(100);
                }
                Err(e) => {
                    warn!(error = %e, "audit relay failed; the entries stay in the outbox");
                    relay_at = Instant::now() + relay_backoff;
                    relay_backoff = (relay_backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        let folded = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            r = async {
                if !positioned {
                    folder.start().await?;
                }
                folder.step().await
            } => r,
        };
        match folded {
            Ok(r) => {
                positioned = true;
                fold_backoff = Duration::from_millis(100);
                if r.read > 0 {
                    debug!(?r, "audit folder step");
                }
            }
            Err(e) => {
                warn!(error = %e, "audit folder step failed; re-seeking to its stored offsets");
                positioned = false;
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(fold_backoff) => {}
                }
                fold_backoff = (fold_backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
