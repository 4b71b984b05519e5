//! [`SeedingView`]: the view as the gateway uses it, seeding itself from the
//! durable totals when it holds nothing for a project.
//!
//! A view answers "not seeded" (`Ok(None)`) for a project it holds nothing
//! for: a new project, or one whose state Redis lost (flushed, restarted
//! empty). The caller must then load the project's durable totals from the
//! ledger, seed them, and ask again. Every reader of the view in the gateway
//! (a check, a quota's current usage, a key's usage this period) needs that
//! protocol, so it is written once, here, as a [`View`] over a view and a
//! [`Ledger`]. It costs nothing on the common path: a seeded project is one
//! call to the inner view, as before; only an unseeded one reads the ledger.

use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Hold, Ledger, PortError, PortResult,
    ProjectId, ReservationId, Settlement, Totals, View,
};

/// A [`View`] that seeds an unseeded project from the ledger's durable
/// totals, then answers. Every other operation goes straight through.
#[derive(Clone)]
pub struct SeedingView {
    inner: Arc<dyn View>,
    ledger: Arc<dyn Ledger>,
}

impl std::fmt::Debug for SeedingView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedingView").finish_non_exhaustive()
    }
}

impl SeedingView {
    pub fn new(inner: Arc<dyn View>, ledger: Arc<dyn Ledger>) -> Self {
        SeedingView { inner, ledger }
    }

    /// The view it reads and writes.
    pub fn inner(&self) -> &Arc<dyn View> {
        &self.inner
    }

    /// Loads the project's durable totals of every open window into the view.
    async fn seed_from_ledger(&self, project: &ProjectId, at: DateTime<Utc>) -> PortResult<()> {
        let totals = self.ledger.open_totals(project, at).await?;
        self.inner.seed(project, &totals).await?;
        metrics::counter!("tollgate_view_reseeds_total").increment(1);
        Ok(())
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
        self.seed_from_ledger(project, at).await?;
        match self.inner.check(project, plan, hold, at).await? {
            Some(o) => Ok(Some(o)),
            None => Err(PortError::Transient("view not seeded after seeding".into())),
        }
    }

    async fn seed(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        self.inner.seed(project, totals).await
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()> {
        self.inner.settle(project, settlements, at).await
    }

    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        self.inner.unsettle(project, events).await
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId) -> PortResult<()> {
        self.inner.release(project, reservation).await
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
    ) -> PortResult<()> {
        self.inner.apply_fold(project, totals, events).await
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
        self.seed_from_ledger(project, at).await?;
        self.inner.usage(project, counter, at).await
    }
}

#[cfg(all(test, feature = "embedded"))]
mod tests {
    use meter::{Caller, CheckInput, Dimension, WindowKind};
    use store::{MemoryView, SqliteStore};

    use super::*;

    /// A ledger-backed seeding view over an empty memory view: the first
    /// check seeds the project, and a read of a counter of an unseeded
    /// project seeds it too.
    #[tokio::test]
    async fn an_unseeded_project_is_seeded_from_the_ledger() {
        let dir = std::env::temp_dir().join(format!("tollgate-seeding-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let ledger: Arc<dyn Ledger> = Arc::new(store);
        let inner: Arc<dyn View> = Arc::new(MemoryView::new());
        let view = SeedingView::new(inner.clone(), ledger);
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
            &CheckInput { caller: Caller::default(), storage_delta: None },
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
