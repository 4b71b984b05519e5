//! [`SeedingView`]: the view as the gateway uses it, seeding itself from the
//! log's state when it holds nothing for a project.
//!
//! A view answers "not seeded" (`Ok(None)`) for a project it holds nothing
//! for: a new project, or one whose state Redis lost (flushed, restarted
//! empty, or restored from an older snapshot, whose marker another server
//! wrote). The caller must then seed it and ask again. Every reader of the
//! view in the gateway (a check, a quota's current usage, a key's usage this
//! period) needs that protocol, so it is written once, here, as a [`View`]
//! over a view and the ports a seed reads. It costs nothing on the common
//! path: a seeded project is one call to the inner view, as before.
//!
//! ## A seed is the log's state (DESIGN §10)
//!
//! Redis is a cache of the log, so a lost view is rebuilt from it, and only
//! then admits:
//!
//! 1. this gateway's own queued publishes are flushed to the log
//!    ([`Log::flush`]), so what it settled is on the log the seed reads (if
//!    they cannot be, the seed fails: a transient error, which a check
//!    answers by its view-down policy);
//! 2. what the view holds under a marker it no longer trusts is forgotten
//!    ([`View::forget_stale`]: a snapshot's old counts);
//! 3. the durable totals are read with the offsets they stand at, in one
//!    snapshot ([`meter::Ledger::seed_totals`]);
//! 4. the project's log tail past those offsets is read to the log's end
//!    ([`LogTail`]), with the records before them appended within a lease
//!    (a reservation outlives the fold of its request event), and turned
//!    into pending deltas by event id (the tail) and live reservations
//!    (both) ([`meter::seed_from_tail`]);
//! 5. all of it is written with the marker in one step ([`View::seed`]).
//!
//! Whatever happens meanwhile stays exact: a settle that reaches the view
//! before the seed is indexed, so the seed does not add it again, and the
//! reservation it releases is left a tombstone even though the loss took
//! its hold, so the seed does not hold it again (a settle writes the view
//! before it publishes, so the tail may have the request without the
//! call); a fold that reaches it first leaves tombstones, so the seed does
//! not add what the fold already counts; a fold after it drops what the
//! seed added. Seeds of one gateway run one at a time (many checks of a
//! flushed project wait for one seed); seeds of two gateways may race and
//! write the same state twice, which is idempotent.
//!
//! What it cannot see: another gateway's publishes still queued in that
//! process when the view was lost (a log outage at the same time) are not
//! on the log yet; their usage is missing from the view until they are
//! published and folded. And a signed-in user's check publishes no request
//! event, so a role quota's live reservations are not restored (its settled
//! calls are). And one race of two gateways' seeds over-counts: if one
//! gateway's seed lands first without a reservation (its tail read came
//! before the request event reached the log), the call is settled on the
//! now seeded view (which leaves no tombstone for a hold it does not have),
//! and then the other gateway's seed lands holding the reservation from an
//! earlier tail read, the call counts twice until its lease ends: the view
//! refuses early, never admits past the limit.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Hold, Log, LogTail, PortError, PortResult,
    PriceBook, ProjectId, ReservationId, Seed, Settlement, Totals, View, Watched,
};
use tracing::{info, warn};

use crate::state::Stores;

/// Where a seed reads the log: the tail, and which consumer's offsets the
/// durable totals stand at.
#[derive(Clone)]
pub struct TailSource {
    pub tail: Arc<dyn LogTail>,
    /// The projector's consumer name and usage topic (its offsets in the store).
    pub consumer: String,
    pub topic: String,
    /// How long a seed waits for this gateway's queued publishes.
    pub flush_timeout: Duration,
    /// How far before the seed the log is read back for reservations whose
    /// request events are already folded: the longest lease a gateway
    /// grants, plus the clocks' skew.
    pub lease_horizon: Duration,
}

/// A [`View`] that seeds an unseeded project from the durable totals and
/// the log tail, then answers. Every other operation goes straight through.
#[derive(Clone)]
pub struct SeedingView {
    inner: Arc<dyn View>,
    stores: Stores,
    log: Arc<dyn Log>,
    /// `None`: seeds from the durable totals alone (a deployment whose log
    /// cannot be read back, or a test that needs none).
    source: Option<TailSource>,
    /// One seed at a time in this process.
    seeding: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for SeedingView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedingView").finish_non_exhaustive()
    }
}

impl SeedingView {
    pub fn new(inner: Arc<dyn View>, stores: Stores, log: Arc<dyn Log>, source: Option<TailSource>) -> Self {
        SeedingView { inner, stores, log, source, seeding: Arc::default() }
    }

    /// The view it reads and writes.
    pub fn inner(&self) -> &Arc<dyn View> {
        &self.inner
    }

    /// Whether seeds read the log tail.
    pub fn reads_tail(&self) -> bool {
        self.source.is_some()
    }

    /// Where the usage topic ends now, per partition, if this deployment
    /// reads its log back (`None` otherwise, or when the log does not answer
    /// within `wait`).
    pub async fn log_ends(&self, wait: std::time::Duration) -> Option<std::collections::BTreeMap<i32, i64>> {
        let source = self.source.as_ref()?;
        tokio::time::timeout(wait, source.tail.ends()).await.ok()?.ok()
    }

    /// Seeds a project (see the module doc), unless another task of this
    /// process seeded it while this one waited for its turn.
    async fn seed_project(&self, project: &ProjectId, at: DateTime<Utc>) -> PortResult<()> {
        let _turn = self.seeding.lock().await;
        if self.inner.usage(project, &CounterKey::footprint(), at).await?.is_some() {
            return Ok(());
        }
        if self.inner.forget_stale(project).await? {
            warn!(%project, "the view held a project under another server's marker (restored snapshot); forgotten");
            metrics::counter!("tollgate_view_stale_forgotten_total").increment(1);
        }
        let seed = match &self.source {
            None => Seed::of_totals(self.stores.ledger.open_totals(project, at).await?),
            Some(src) => self.seed_from_log(src, project, at).await?,
        };
        self.inner.seed(project, &seed, at).await?;
        metrics::counter!("tollgate_view_reseeds_total").increment(1);
        info!(
            %project,
            counters = seed.totals.len(),
            pending = seed.pending.len(),
            held = seed.holds.len(),
            "view seeded"
        );
        Ok(())
    }

    /// The durable totals and the log tail past them, as one [`Seed`].
    async fn seed_from_log(&self, src: &TailSource, project: &ProjectId, at: DateTime<Utc>) -> PortResult<Seed> {
        if let Err(e) = self.log.flush(src.flush_timeout).await {
            return Err(PortError::Transient(format!(
                "this gateway's queued events are not on the log yet, so the view cannot be seeded: {e}"
            )));
        }
        let (offsets, totals) = self.stores.ledger.seed_totals(project, &src.consumer, &src.topic, at).await?;
        let since = at - chrono::Duration::from_std(src.lease_horizon).unwrap_or(chrono::Duration::hours(1));
        let records = src.tail.tail(project, &offsets, since).await?;
        let (mut recent, mut facts) = (Vec::new(), Vec::with_capacity(records.len()));
        for r in &records {
            // What does not decode is the projector's to dead-letter.
            let Ok(mut f) = schemas::decode_usage(&r.payload) else { continue };
            if f.received_at.is_none() {
                f.received_at = r.timestamp;
            }
            if &f.project_id != project {
                continue;
            }
            if r.offset < offsets.get(&r.partition).copied().unwrap_or(0) {
                recent.push(f);
            } else {
                facts.push(f);
            }
        }
        metrics::counter!("tollgate_view_reseed_tail_events_total").increment(facts.len() as u64);
        let Some(p) = self.stores.tenants.project(project).await? else {
            return Ok(Seed::of_totals(totals));
        };
        let quotas = self.stores.quotas.quotas(project).await?;
        let book = if facts.iter().any(|f| f.kind == meter::EventKind::Tokens) {
            PriceBook::new(self.stores.prices.prices().await?)
        } else {
            PriceBook::default()
        };
        Ok(meter::seed_from_tail(totals, &recent, &facts, p.timezone, &book, &Watched::of(&quotas), at))
    }
}

#[async_trait]
impl View for SeedingView {
    /// Checks; an unseeded project is seeded and checked again. Never
    /// answers `Ok(None)`: a project still unseeded after seeding is a
    /// transient failure of the view.
    async fn check(
        &self,
        project: &ProjectId,
        plan: &CheckPlan,
        hold: &Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CheckOutcome>> {
        if let Some(o) = self.inner.check(project, plan, hold, at).await? {
            return Ok(Some(o));
        }
        self.seed_project(project, at).await?;
        match self.inner.check(project, plan, hold, at).await? {
            Some(o) => Ok(Some(o)),
            None => Err(PortError::Transient("view not seeded after seeding".into())),
        }
    }

    async fn seed(&self, project: &ProjectId, seed: &Seed, at: DateTime<Utc>) -> PortResult<()> {
        self.inner.seed(project, seed, at).await
    }

    async fn forget_stale(&self, project: &ProjectId) -> PortResult<bool> {
        self.inner.forget_stale(project).await
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()> {
        self.inner.settle(project, settlements, at).await
    }

    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        self.inner.unsettle(project, events).await
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId, at: DateTime<Utc>) -> PortResult<()> {
        self.inner.release(project, reservation, at).await
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
        at: DateTime<Utc>,
    ) -> PortResult<()> {
        self.inner.apply_fold(project, totals, events, at).await
    }

    async fn lower_totals(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        self.inner.lower_totals(project, totals).await
    }

    /// A counter's state; an unseeded project is seeded and read again
    /// (`Ok(None)` only if it is still unseeded after that).
    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>> {
        if let Some(u) = self.inner.usage(project, counter, at).await? {
            return Ok(Some(u));
        }
        self.seed_project(project, at).await?;
        self.inner.usage(project, counter, at).await
    }
}

#[cfg(all(test, feature = "embedded"))]
mod tests {
    use meter::{Caller, CheckInput, Dimension, WindowKind};
    use store::{MemoryView, SqliteStore};

    use super::*;

    struct NoLog;

    #[async_trait]
    impl Log for NoLog {
        async fn publish(&self, _: &[meter::UsageFact]) -> PortResult<()> {
            Ok(())
        }
    }

    /// A ledger-backed seeding view over an empty memory view: the first
    /// check seeds the project, and a read of a counter of an unseeded
    /// project seeds it too.
    #[tokio::test]
    async fn an_unseeded_project_is_seeded_from_the_ledger() {
        let dir = std::env::temp_dir().join(format!("tollgate-seeding-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let inner: Arc<dyn View> = Arc::new(MemoryView::new());
        let view = SeedingView::new(inner.clone(), Stores::of(Arc::new(store)), Arc::new(NoLog), None);
        let project = ProjectId::parse("proj_1").expect("id");
        let at = Utc::now();
        let counter = CounterKey { dimension: Dimension::Project, window: WindowKind::Day, window_key: "k".into() };

        assert_eq!(inner.usage(&project, &counter, at).await.expect("usage"), None, "the inner view holds nothing");
        let u = view.usage(&project, &counter, at).await.expect("usage").expect("seeded by the read");
        assert_eq!(u, CounterUsage::default());

        let other = ProjectId::parse("proj_2").expect("id");
        let plan = meter::plan_check(
            &[],
            chrono_tz::Tz::UTC,
            &CheckInput { caller: Caller::default(), storage_delta: None, ..Default::default() },
            at,
        );
        let hold = Hold {
            reservation: ReservationId::parse("res_1").expect("id"),
            request_event: EventId::parse("req_1").expect("id"),
            lease_until: at + chrono::Duration::seconds(60),
        };
        assert!(view.check(&other, &plan, &hold, at).await.expect("check").is_some(), "seeded by the check");
        assert!(inner.usage(&other, &counter, at).await.expect("usage").is_some(), "and it stays seeded");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
