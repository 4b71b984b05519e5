//! # The view in memory
//!
//! [`MemoryView`] implements [`meter::View`] inside the process: it is the
//! view's reference model, [`meter::ViewModel`], behind one mutex, plus a
//! sweep that frees the memory of expired records. It has no rule of its
//! own: the records it holds, their expiries and every rule are the model's
//! (see `meter::view::model`), which the Lua scripts of
//! [`RedisView`](crate::RedisView) are checked against
//! (`tests/view_model.rs`). It runs `tollgate dev` and the gateway's tower
//! layer; it is not a test double, and it passes the same conformance suite
//! (`tests/view_conformance.rs`).
//!
//! ## Atomicity
//!
//! The model sits behind one mutex, taken once per operation and never held
//! across an `.await` (no operation awaits anything), so every operation is
//! one atomic step, as a script is in Redis. Clones share the state.
//!
//! ## Time
//!
//! The time is injected: the view never reads a clock. The model's clock,
//! the analogue of the Redis server's clock that expires keys, is the latest
//! `at` any operation was given (it never runs backwards); the operations
//! the port gives no `at` (seed, unsettle, release, fold) run at that clock.
//! Records are expired lazily, when an operation reaches them, and swept from
//! memory at most once a minute of that clock, so memory stays bounded by
//! what is live (plus a project's `loaded` marker, which like Redis's never
//! expires).
//!
//! ## Accuracy
//!
//! The model's: exact integers where the scripts use doubles (the two agree
//! on every count, token and byte amount, and on costs up to about $9,007);
//! a pending amount saturates at `i64` bounds where Redis's `HINCRBY` would
//! fail.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use chrono::{DateTime, TimeDelta, Utc};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Hold, PortResult, ProjectDump, ProjectId,
    ReservationId, Settlement, Totals, View, ViewModel,
};

/// How often (in the model's time) expired records are swept from memory.
const SWEEP_EVERY: TimeDelta = TimeDelta::minutes(1);

/// The in-memory hot-path view. Cheap to clone: clones share one state.
#[derive(Clone, Default)]
pub struct MemoryView {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    model: ViewModel,
    /// When the next sweep is due (`None`: at the first operation).
    next_sweep: Option<DateTime<Utc>>,
}

impl State {
    /// Sweeps when one is due by the model's clock.
    fn sweep_if_due(&mut self) {
        let now = self.model.now();
        if self.next_sweep.is_none_or(|due| now >= due) {
            self.model.sweep();
            self.next_sweep = Some(now.checked_add_signed(SWEEP_EVERY).unwrap_or(now));
        }
    }
}

impl fmt::Debug for MemoryView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryView").field("records", &self.records()).finish_non_exhaustive()
    }
}

impl MemoryView {
    /// An empty view: every project is unseeded.
    pub fn new() -> MemoryView {
        MemoryView::default()
    }

    /// How many records (counters, lease sets, holds, event indexes and
    /// projects) the view holds, expired ones not swept yet included: a gauge
    /// of its memory.
    pub fn records(&self) -> usize {
        self.lock().model.records()
    }

    /// One project's live records, in the model's comparable form (for
    /// tests and debugging).
    pub fn dump(&self, project: &ProjectId) -> ProjectDump {
        self.lock().model.dump(project)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one operation on the model, then sweeps if one is due.
    fn with<T>(&self, op: impl FnOnce(&mut ViewModel) -> T) -> T {
        let mut st = self.lock();
        let out = op(&mut st.model);
        st.sweep_if_due();
        out
    }
}

#[async_trait]
impl View for MemoryView {
    async fn check(
        &self,
        project: &ProjectId,
        plan: &CheckPlan,
        hold: &Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CheckOutcome>> {
        self.with(|m| m.check(project, plan, hold, at))
    }

    async fn seed(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        self.with(|m| m.seed(project, totals, m.now()));
        Ok(())
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()> {
        self.with(|m| m.settle(project, settlements, at));
        Ok(())
    }

    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        self.with(|m| m.unsettle(project, events, m.now()));
        Ok(())
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId) -> PortResult<()> {
        self.with(|m| m.release(project, reservation, m.now()));
        Ok(())
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
    ) -> PortResult<()> {
        self.with(|m| m.apply_fold(project, totals, events, m.now()));
        Ok(())
    }

    async fn lower_totals(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        self.with(|m| m.lower_totals(project, totals, m.now()));
        Ok(())
    }

    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>> {
        Ok(self.with(|m| m.usage(project, counter, at)))
    }
}
