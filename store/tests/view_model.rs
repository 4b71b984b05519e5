//! The view's reference model against its two implementations (DESIGN §15).
//!
//! Each case is a generated sequence of view operations — seed, check (plans
//! made by `plan_check` from a fixed set of quotas: requests, calls, rows,
//! tokens, cost with its blackout and probes, storage, a monitor quota, and
//! quotas that share a counter), settle (with and without a reservation, the
//! same event again), unsettle, release, fold (of events settled, never
//! settled, or settled after their fold: the tombstone), seeds with a log
//! tail (pending facts, some already settled or folded, and reservations
//! held again), usage reads, and time moving
//! forward past leases and windows — run against [`meter::ViewModel`], a
//! [`MemoryView`] and a [`RedisView`] (real Redis at
//! `TOLLGATE_TEST_REDIS_URL`, its own key prefix per case, keys deleted
//! after). Every step must give identical answers, and at the end the
//! project's state, dumped by each ([`ProjectDump`]; for Redis a `SCAN` of
//! its keys), must be identical, expiries included.
//!
//! ## Time
//!
//! Redis expires keys by its own clock, which the test cannot move. So the
//! generated times start at the real now (`t0`) and move forward by at most
//! 40 minutes, and every expiry a case can produce is either well before
//! `t0` (a window that reset two hours ago, a lease that ended two hours
//! ago: gone at once in Redis and in the model) or at least an hour after
//! it (a live window's reset + the grace, a lease + the grace, an event
//! index's `at` + 7 days, a tombstone's fold + an hour). The scripts set expiries with `PEXPIREAT` from
//! the arguments, as the model computes them, so the two agree exactly —
//! on expiry and on every recorded expiry time. (Each sequence opens with a
//! read at `t0`, so the model's clock starts where Redis's is.) Leases, which the scripts
//! compare with the `at` they are given, do run out during a case.
//!
//! Expiry *during* a sequence (counters an hour after their reset, event
//! indexes after 7 days, the sweep) cannot be driven through Redis; the
//! second property runs the same operations with jumps of hours and days
//! against the model and a `MemoryView` only.
//!
//! `PROPTEST_CASES` sets the number of cases (default 64, up to 40
//! operations each).

use std::future::Future;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use meter::{
    ApiKeyId, Caller, CheckInput, Counter, CounterKey, Dimension, Estimate, EventId, Hold, Metric, Mode, ProjectDump,
    ProjectId, Quota, QuotaId, QuotaSpec, ReservationId, Scope, Seed, SeedHold, Settlement, Totals, View, ViewModel,
    WindowKind, plan_check, window_at,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;
use store::{MemoryView, RedisView};
use uuid::Uuid;

// ---------------------------------------------------------------- the world

const KEYS: [&str; 2] = ["k1", "k2"];
const ACTORS: [&str; 2] = ["u1", "u2"];
/// Call events are drawn from a small pool, so the same event is settled,
/// folded and taken back more than once.
const CALL_EVENTS: usize = 5;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64)
}

fn quota(n: usize, scope: Scope, scope_ref: Option<&str>, metric: Metric, window: WindowKind, limit: u64) -> Quota {
    let t = DateTime::<Utc>::UNIX_EPOCH;
    Quota {
        id: QuotaId::parse(format!("q{n}")).expect("quota id"),
        spec: QuotaSpec {
            project_id: ProjectId::parse("p").expect("project id"),
            scope,
            scope_ref: scope_ref.map(str::to_owned),
            metric,
            window,
            limit,
            mode: Mode::Enforce,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: t,
        updated_at: t,
    }
}

/// The quotas checks are planned from (a generated mask picks some).
fn quotas() -> Vec<Quota> {
    let mut monitor = quota(4, Scope::Project, None, Metric::Calls, WindowKind::Rolling1m, 1);
    monitor.spec.mode = Mode::Monitor;
    vec![
        // requests, calls and rows of the project share the (project, day) counter
        quota(0, Scope::Project, None, Metric::Requests, WindowKind::Day, 6),
        quota(1, Scope::ApiKey, Some("k1"), Metric::Calls, WindowKind::Rolling1m, 2),
        quota(2, Scope::Actor, None, Metric::Calls, WindowKind::Day, 3),
        quota(3, Scope::Project, None, Metric::Rows, WindowKind::Day, 20),
        monitor,
        quota(5, Scope::Project, None, Metric::Calls, WindowKind::Day, 4),
        quota(6, Scope::Project, None, Metric::CostUsd, WindowKind::Day, 2_000),
        quota(7, Scope::Project, None, Metric::StorageBytes, WindowKind::Current, 1_000),
        quota(8, Scope::Actor, None, Metric::Tokens, WindowKind::Day, 150),
        quota(9, Scope::ApiKey, None, Metric::Requests, WindowKind::Rolling1m, 4),
    ]
}

/// The counters settles, folds, seeds and usage reads pick from at `at`:
/// those the plans read, every key's, a window that closed two hours before
/// `t0` (expired from the start), and the footprint.
fn universe(t0: DateTime<Utc>, at: DateTime<Utc>) -> Vec<Counter> {
    let mut dims = vec![Dimension::Project, Dimension::AllApiKeys];
    dims.extend(KEYS.iter().map(|k| Dimension::ApiKey(ApiKeyId::parse(*k).expect("key id"))));
    dims.extend(ACTORS.iter().map(|a| Dimension::Actor((*a).to_owned())));
    let mut out = Vec::new();
    for d in dims {
        for kind in [WindowKind::Rolling1m, WindowKind::Day] {
            let w = window_at(kind, Tz::UTC, at);
            out.push(Counter {
                key: CounterKey { dimension: d.clone(), window: kind, window_key: w.key },
                resets_at: w.resets_at,
            });
        }
    }
    out.push(Counter {
        key: CounterKey { dimension: Dimension::Project, window: WindowKind::Day, window_key: "closed".into() },
        resets_at: Some(t0 - Duration::hours(2)),
    });
    out.push(Counter { key: CounterKey::footprint(), resets_at: None });
    out
}

// ---------------------------------------------------------------- operations

#[derive(Debug, Clone)]
struct CheckGen {
    key: Option<usize>,
    actor: Option<usize>,
    /// Which of [`quotas`] the project has, one bit each.
    mask: u16,
    storage_delta: Option<i64>,
    /// The lease's end, relative to the check's `at`.
    lease_ms: i64,
    /// Retry the last check's hold (same reservation and request event).
    retry: bool,
    /// The gateway's clock is behind the view's by this much.
    skew_ms: i64,
    /// The call's estimate (tokens, picodollars), reserved on the tokens
    /// and cost quotas.
    estimate: Estimate,
}

#[derive(Debug, Clone)]
struct SettleGen {
    /// Into the call events.
    event: Index,
    /// Into the holds checks took so far.
    reservation: Option<Index>,
    deltas: Vec<(Index, Totals)>,
}

#[derive(Debug, Clone)]
enum Op {
    /// Time moves forward (ms).
    Advance(i64),
    /// Durable totals, the tail's facts (their reservations ignored), and
    /// reservations of checks so far held again (their lease, on counters
    /// picked here).
    Seed(SeedGen),
    Check(CheckGen),
    Settle(Vec<SettleGen>),
    /// Into the call and request events so far.
    Unsettle(Vec<Index>),
    Release(Index),
    Fold(Vec<(Index, Totals)>, Vec<Index>),
    Usage(Index),
}

#[derive(Debug, Clone)]
struct SeedGen {
    totals: Vec<(Index, Totals)>,
    pending: Vec<SettleGen>,
    holds: Vec<(Index, Vec<Index>, Estimate)>,
}

fn seed_gen(max: usize) -> impl Strategy<Value = SeedGen> {
    (
        counter_amounts(max),
        prop::collection::vec(settle_gen(), 0..3),
        prop::collection::vec((any::<Index>(), prop::collection::vec(any::<Index>(), 1..3), estimate()), 0..3),
    )
        .prop_map(|(totals, pending, holds)| SeedGen { totals, pending, holds })
}

/// Small amounts of every kind (quantities far below 2^53, where the
/// scripts' doubles are exact); sometimes nothing at all.
fn amounts() -> impl Strategy<Value = Totals> {
    prop_oneof![
        1 => Just(Totals::default()),
        3 => (0u64..3, 0u64..3, 0u64..25).prop_map(|(requests, calls, rows)| Totals {
            requests,
            calls,
            rows,
            ..Totals::default()
        }),
        2 => (0u64..200, 0u64..3_000, 0u64..3, any::<bool>()).prop_map(|(tokens, picos, events, priced)| Totals {
            tokens,
            cost_llm_tokens: picos,
            cost_api_request: picos / 7,
            llm_events: events,
            llm_priced: if priced { events.min(1) } else { 0 },
            llm_unpriced: if priced { events.saturating_sub(1) } else { events },
            ..Totals::default()
        }),
        2 => (0u64..4, -600i64..600).prop_map(|(storage_events, storage)| Totals {
            storage_events,
            storage,
            ..Totals::default()
        }),
    ]
}

/// Nothing estimated half the time; else tokens, picodollars or both, some
/// as large as the tokens and cost quotas' limits.
fn estimate() -> impl Strategy<Value = Estimate> {
    prop_oneof![
        2 => Just(Estimate::default()),
        2 => (0u64..120, 0u64..1_800).prop_map(|(tokens, cost)| Estimate { tokens, cost }),
    ]
}

fn counter_amounts(max: usize) -> impl Strategy<Value = Vec<(Index, Totals)>> {
    prop::collection::vec((any::<Index>(), amounts()), 0..max)
}

fn check_gen() -> impl Strategy<Value = CheckGen> {
    (
        prop::option::weighted(0.85, 0..KEYS.len()),
        prop::option::of(0..ACTORS.len()),
        any::<u16>(),
        prop_oneof![2 => Just(None), 1 => (-300i64..700).prop_map(Some)],
        prop_oneof![1 => Just(-2 * 3_600_000i64), 1 => Just(-1i64), 5 => 1_000i64..120_000],
        prop::bool::weighted(0.15),
        prop_oneof![4 => Just(0i64), 1 => 1i64..2_000],
        estimate(),
    )
        .prop_map(|(key, actor, mask, storage_delta, lease_ms, retry, skew_ms, estimate)| CheckGen {
            key,
            actor,
            mask,
            storage_delta,
            lease_ms,
            retry,
            skew_ms,
            estimate,
        })
}

fn settle_gen() -> impl Strategy<Value = SettleGen> {
    (any::<Index>(), prop::option::weighted(0.6, any::<Index>()), counter_amounts(4))
        .prop_map(|(event, reservation, deltas)| SettleGen { event, reservation, deltas })
}

/// One operation; `advance` is how far time may move in one.
fn op(advance: BoxedStrategy<i64>) -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => advance.prop_map(Op::Advance),
        1 => seed_gen(4).prop_map(Op::Seed),
        6 => check_gen().prop_map(Op::Check),
        3 => prop::collection::vec(settle_gen(), 1..3).prop_map(Op::Settle),
        1 => prop::collection::vec(any::<Index>(), 1..3).prop_map(Op::Unsettle),
        1 => any::<Index>().prop_map(Op::Release),
        2 => (counter_amounts(4), prop::collection::vec(any::<Index>(), 0..3)).prop_map(|(t, e)| Op::Fold(t, e)),
        2 => any::<Index>().prop_map(Op::Usage),
    ]
}

/// A sequence: most start with a seed (else every check answers `None`
/// until one comes).
fn ops(advance: BoxedStrategy<i64>) -> impl Strategy<Value = Vec<Op>> {
    (prop::option::weighted(0.85, seed_gen(5)), prop::collection::vec(op(advance), 1..40)).prop_map(|(seed, rest)| {
        let mut out: Vec<Op> = seed.map(Op::Seed).into_iter().collect();
        out.extend(rest);
        out.truncate(40);
        out
    })
}

/// Within the three-way runs: 40 moves of at most a minute stay under the
/// hour before any live expiry (see the module doc).
fn near_advance() -> BoxedStrategy<i64> {
    prop_oneof![3 => 0i64..2_000, 2 => 5_000i64..60_000].boxed()
}

/// In the model-and-memory runs: also hours and days.
fn far_advance() -> BoxedStrategy<i64> {
    prop_oneof![3 => 0i64..2_000, 2 => 5_000i64..60_000, 2 => 3_600_000i64..9 * 86_400_000].boxed()
}

// ---------------------------------------------------------------- a run

/// One sequence's state: the three views and what the sequence created.
struct Run<'a> {
    project: ProjectId,
    model: ViewModel,
    memory: MemoryView,
    redis: Option<&'a RedisView>,
    quotas: Vec<Quota>,
    t0: DateTime<Utc>,
    /// The sequence's time (the view's clock, give or take a check's skew).
    now: DateTime<Utc>,
    holds: Vec<Hold>,
}

fn call_event(i: usize) -> EventId {
    EventId::parse(format!("e{i}")).expect("event id")
}

/// The same answer from all three (the Redis one when there is a Redis).
fn same<T: PartialEq + std::fmt::Debug>(
    step: usize,
    op: &Op,
    model: T,
    memory: T,
    redis: Option<T>,
) -> Result<T, TestCaseError> {
    prop_assert_eq!(&memory, &model, "memory vs model at step {}: {:?}", step, op);
    if let Some(r) = redis {
        prop_assert_eq!(&r, &model, "redis vs model at step {}: {:?}", step, op);
    }
    Ok(model)
}

/// A write all three accepted.
fn succeeded(
    step: usize,
    op: &Op,
    memory: meter::PortResult<()>,
    redis: Option<meter::PortResult<()>>,
) -> Result<(), TestCaseError> {
    let out = same(step, op, Ok(()), memory, redis)?;
    prop_assert!(out.is_ok(), "{:?} failed at step {}: {:?}", op, step, out);
    Ok(())
}

/// Awaits a Redis call, when there is a Redis.
async fn on_redis<'v, T, F: Future<Output = T>>(
    redis: Option<&'v RedisView>,
    f: impl FnOnce(&'v RedisView) -> F,
) -> Option<T> {
    match redis {
        Some(r) => Some(f(r).await),
        None => None,
    }
}

impl Run<'_> {
    fn counters(&self) -> Vec<Counter> {
        universe(self.t0, self.now)
    }

    fn pick(&self, picks: &[(Index, Totals)]) -> Vec<(Counter, Totals)> {
        let u = self.counters();
        picks.iter().map(|(i, t)| (u[i.index(u.len())].clone(), *t)).collect()
    }

    /// Every event id the sequence used: the call events, then each check's request event.
    fn events(&self) -> Vec<EventId> {
        (0..CALL_EVENTS).map(call_event).chain(self.holds.iter().map(|h| h.request_event.clone())).collect()
    }

    fn hold(&self, i: &Index) -> Option<&Hold> {
        (!self.holds.is_empty()).then(|| &self.holds[i.index(self.holds.len())])
    }

    async fn step(&mut self, step: usize, op: &Op) -> Result<(), TestCaseError> {
        let p = self.project.clone();
        let redis = self.redis;
        match op {
            Op::Advance(ms) => self.now += Duration::milliseconds(*ms),
            Op::Seed(g) => {
                let seed = Seed {
                    totals: self.pick(&g.totals),
                    pending: g
                        .pending
                        .iter()
                        .map(|s| Settlement {
                            event: call_event(s.event.index(CALL_EVENTS)),
                            reservation: None,
                            deltas: self.pick(&s.deltas),
                        })
                        .collect(),
                    holds: g
                        .holds
                        .iter()
                        .filter_map(|(h, counters, estimate)| {
                            let h = self.hold(h)?;
                            let u = self.counters();
                            Some(SeedHold {
                                reservation: h.reservation.clone(),
                                lease_until: h.lease_until,
                                counters: counters.iter().map(|i| u[i.index(u.len())].clone()).collect(),
                                estimate: *estimate,
                            })
                        })
                        .collect(),
                };
                let at = self.now;
                self.model.seed(&p, &seed, at);
                let m = self.memory.seed(&p, &seed, at).await;
                let r = on_redis(redis, |r| r.seed(&p, &seed, at)).await;
                succeeded(step, op, m, r)?;
            }
            Op::Check(g) => {
                let at = self.now - Duration::milliseconds(g.skew_ms);
                let hold = match self.holds.last() {
                    Some(h) if g.retry => h.clone(),
                    _ => {
                        let n = self.holds.len();
                        let hold = Hold {
                            reservation: ReservationId::parse(format!("r{n}")).expect("reservation id"),
                            request_event: EventId::parse(format!("q{n}")).expect("event id"),
                            lease_until: at + Duration::milliseconds(g.lease_ms),
                        };
                        self.holds.push(hold.clone());
                        hold
                    }
                };
                let quotas: Vec<Quota> = self
                    .quotas
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| g.mask & (1 << i) != 0)
                    .map(|(_, q)| q.clone())
                    .collect();
                let caller = Caller {
                    api_key: g.key.map(|k| ApiKeyId::parse(KEYS[k]).expect("key id")),
                    actor: g.actor.map(|a| ACTORS[a].to_owned()),
                    ..Caller::default()
                };
                let plan = plan_check(
                    &quotas,
                    Tz::UTC,
                    &CheckInput { caller, storage_delta: g.storage_delta, estimate: g.estimate },
                    at,
                );
                let model = self.model.check(&p, &plan, &hold, at);
                let m = self.memory.check(&p, &plan, &hold, at).await;
                let r = on_redis(redis, |r| r.check(&p, &plan, &hold, at)).await;
                let out = same(step, op, model, m, r)?;
                prop_assert!(out.is_ok(), "plans of plan_check are valid: {:?}", out);
            }
            Op::Settle(gens) => {
                let settlements: Vec<Settlement> = gens
                    .iter()
                    .map(|g| Settlement {
                        event: call_event(g.event.index(CALL_EVENTS)),
                        reservation: g.reservation.as_ref().and_then(|i| self.hold(i)).map(|h| h.reservation.clone()),
                        deltas: self.pick(&g.deltas),
                    })
                    .collect();
                let at = self.now;
                self.model.settle(&p, &settlements, at);
                let m = self.memory.settle(&p, &settlements, at).await;
                let r = on_redis(redis, |r| r.settle(&p, &settlements, at)).await;
                succeeded(step, op, m, r)?;
            }
            Op::Unsettle(picks) => {
                let all = self.events();
                let events: Vec<EventId> = picks.iter().map(|i| all[i.index(all.len())].clone()).collect();
                let at = self.model.now();
                self.model.unsettle(&p, &events, at);
                let m = self.memory.unsettle(&p, &events).await;
                let r = on_redis(redis, |r| r.unsettle(&p, &events)).await;
                succeeded(step, op, m, r)?;
            }
            Op::Release(i) => {
                let Some(rid) = self.hold(i).map(|h| h.reservation.clone()) else { return Ok(()) };
                let at = self.model.now();
                self.model.release(&p, &rid, at);
                let m = self.memory.release(&p, &rid, at).await;
                let r = on_redis(redis, |r| r.release(&p, &rid, at)).await;
                succeeded(step, op, m, r)?;
            }
            Op::Fold(picks, event_picks) => {
                let totals = self.pick(picks);
                let all = self.events();
                let events: Vec<EventId> = event_picks.iter().map(|i| all[i.index(all.len())].clone()).collect();
                let at = self.now;
                self.model.apply_fold(&p, &totals, &events, at);
                let m = self.memory.apply_fold(&p, &totals, &events, at).await;
                let r = on_redis(redis, |r| r.apply_fold(&p, &totals, &events, at)).await;
                succeeded(step, op, m, r)?;
            }
            Op::Usage(i) => {
                let u = self.counters();
                let key = u[i.index(u.len())].key.clone();
                let at = self.now;
                let model = Ok(self.model.usage(&p, &key, at));
                let m = self.memory.usage(&p, &key, at).await;
                let r = on_redis(redis, |r| r.usage(&p, &key, at)).await;
                let out = same(step, op, model, m, r)?;
                prop_assert!(out.is_ok(), "usage failed at step {}: {:?}", step, out);
            }
        }
        // The memory view is the model: the same state after every step.
        prop_assert_eq!(
            self.memory.dump(&p),
            self.model.dump(&p),
            "memory state vs model after step {}: {:?}",
            step,
            op
        );
        Ok(())
    }

    async fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        // A timed read first, so the model's clock (the latest `at` it was
        // given) starts at t0, where Redis's is: before it, the model's
        // clock is the beginning of time, and a fold of a window that closed
        // hours ago would still land in it (MemoryView's too) while Redis
        // drops the key at once.
        let (p, key, t0) = (self.project.clone(), CounterKey::footprint(), self.t0);
        let model = Ok(self.model.usage(&p, &key, t0));
        let m = self.memory.usage(&p, &key, t0).await;
        let r = on_redis(self.redis, |r| r.usage(&p, &key, t0)).await;
        let opened = same(0, &Op::Advance(0), model, m, r)?;
        prop_assert_eq!(opened, Ok(None), "a fresh project is unseeded");
        for (i, op) in ops.iter().enumerate() {
            self.step(i, op).await?;
        }
        let model: ProjectDump = self.model.dump(&self.project);
        if let Some(r) = self.redis {
            let dump = r.dump(&self.project).await.map_err(|e| TestCaseError::fail(format!("redis dump: {e}")))?;
            prop_assert_eq!(dump, model, "redis state vs model at the end");
        }
        Ok(())
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime")
}

fn fresh_run(redis: Option<&RedisView>, t0: DateTime<Utc>) -> Run<'_> {
    Run {
        project: ProjectId::parse(format!("p-{}", Uuid::new_v4().simple())).expect("project id"),
        model: ViewModel::new(),
        memory: MemoryView::new(),
        redis,
        quotas: quotas(),
        t0,
        now: t0,
        holds: Vec::new(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn the_model_memory_and_redis_agree(ops in ops(near_advance())) {
        if !testkit::available(&[testkit::Service::Redis]) {
            return Ok(());
        }
        runtime().block_on(async {
            // Its keys go when it is dropped.
            let keys = testkit::RedisPrefix::new("tgmodel");
            let view = RedisView::connect(&keys.url, &keys.prefix).await.expect("connect to the test Redis");
            fresh_run(Some(&view), Utc::now()).run(&ops).await
        })?;
    }

    #[test]
    fn the_model_and_memory_agree_across_days(ops in ops(far_advance())) {
        let t0 = DateTime::parse_from_rfc3339("2030-03-30T23:59:30Z").expect("timestamp").with_timezone(&Utc);
        runtime().block_on(fresh_run(None, t0).run(&ops))?;
    }
}
