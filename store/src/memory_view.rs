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
//! ## Atomicity, and no global lock
//!
//! Projects are spread over [`SHARDS`] shards by their id, each a model of
//! its own behind its own mutex, so checks of different projects do not
//! wait for each other (every operation of the port names one project, as
//! every Redis script touches one project's keys). A shard's mutex is taken
//! once per operation and never held across an `.await` (no operation
//! awaits anything), so every operation is one atomic step, as a script is
//! in Redis. Clones share the state.
//!
//! ## Time
//!
//! The time is injected: the view never reads a clock. A shard's model's
//! clock, the analogue of the Redis server's clock that expires keys, is the
//! latest `at` any operation on that shard was given (it never runs
//! backwards); the operations the port gives no `at` (unsettle, release,
//! lowering totals) run at that clock.
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
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use chrono::{DateTime, TimeDelta, Utc};
use meter::{
    CheckOutcome, CheckPlan, Counter, CounterKey, CounterUsage, EventId, Hold, PortResult, ProjectDump, ProjectId,
    ReservationId, Seed, Settlement, Totals, View, ViewModel,
};

/// How often (in the model's time) expired records are swept from memory.
const SWEEP_EVERY: TimeDelta = TimeDelta::minutes(1);

/// How many shards the projects are spread over.
pub const SHARDS: usize = 32;

/// The in-memory hot-path view. Cheap to clone: clones share one state.
#[derive(Clone)]
pub struct MemoryView {
    shards: Arc<[Mutex<State>]>,
}

impl Default for MemoryView {
    fn default() -> Self {
        MemoryView { shards: (0..SHARDS).map(|_| Mutex::new(State::default())).collect() }
    }
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
        self.shards.iter().map(|s| lock(s).model.records()).sum()
    }

    /// One project's live records, in the model's comparable form (for
    /// tests and debugging).
    pub fn dump(&self, project: &ProjectId) -> ProjectDump {
        lock(self.shard(project)).model.dump(project)
    }

    /// The shard that holds `project`.
    fn shard(&self, project: &ProjectId) -> &Mutex<State> {
        // A fixed seed: the shard only spreads projects, it guards nothing.
        let h = foldhash::fast::FixedState::with_seed(0).hash_one(project.as_str());
        // The remainder is below SHARDS, so it fits.
        &self.shards[(h % self.shards.len() as u64) as usize]
    }

    /// Runs one operation on the model of `project`'s shard, then sweeps
    /// that shard if a sweep is due.
    fn with<T>(&self, project: &ProjectId, op: impl FnOnce(&mut ViewModel) -> T) -> T {
        let mut st = lock(self.shard(project));
        let out = op(&mut st.model);
        st.sweep_if_due();
        out
    }
}

fn lock(shard: &Mutex<State>) -> MutexGuard<'_, State> {
    shard.lock().unwrap_or_else(|e| e.into_inner())
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
        self.with(project, |m| m.check(project, plan, hold, at))
    }

    async fn seed(&self, project: &ProjectId, seed: &Seed, at: DateTime<Utc>) -> PortResult<()> {
        self.with(project, |m| m.seed(project, seed, at));
        Ok(())
    }

    async fn settle(&self, project: &ProjectId, settlements: &[Settlement], at: DateTime<Utc>) -> PortResult<()> {
        self.with(project, |m| m.settle(project, settlements, at));
        Ok(())
    }

    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        self.with(project, |m| m.unsettle(project, events, m.now()));
        Ok(())
    }

    async fn release(&self, project: &ProjectId, reservation: &ReservationId, at: DateTime<Utc>) -> PortResult<()> {
        self.with(project, |m| m.release(project, reservation, at));
        Ok(())
    }

    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(Counter, Totals)],
        events: &[EventId],
        at: DateTime<Utc>,
    ) -> PortResult<()> {
        self.with(project, |m| m.apply_fold(project, totals, events, at));
        Ok(())
    }

    async fn lower_totals(&self, project: &ProjectId, totals: &[(Counter, Totals)]) -> PortResult<()> {
        self.with(project, |m| m.lower_totals(project, totals, m.now()));
        Ok(())
    }

    async fn usage(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<CounterUsage>> {
        Ok(self.with(project, |m| m.usage(project, counter, at)))
    }
}
