//! The `View` conformance suite. Every behaviour is a generic body
//! (`suite_*`) taking a `&dyn View` (or an `Arc<dyn View>` when it spawns
//! tasks); `conformance!` stamps every one out as a test per backend:
//!
//! - `redis::*` runs against a real Redis at `TOLLGATE_REDIS_URL` (default
//!   `redis://127.0.0.1:6379`). Each test gets its own key prefix (and each
//!   body its own project id), so the tests run in parallel against one
//!   Redis; the keys are removed afterwards.
//! - `memory::*` runs against a fresh [`MemoryView`] per test.
//!
//! The bodies use the real time, since Redis expires keys by its own clock.
//! Backend-specific behaviour stays in its module: connection errors and key
//! prefixes for Redis; for memory, what needs the time moved by days.
//!
//! These examples are the readable spec of the view. The rules themselves
//! are written once, in the reference model `meter::ViewModel` (which
//! `MemoryView` runs); `tests/view_model.rs` checks `RedisView` against it
//! on generated operation sequences.

use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use meter::{
    Caller, CheckInput, CheckOutcome, CheckPlan, Counter, CounterKey, Dimension, EventId, Field, Hold, LimitKind,
    Metric, Mode, PlannedLimit, ProjectId, Quota, QuotaId, QuotaSpec, ReservationId, Scope, Seed, Settlement, Totals,
    View, WindowKind, plan_check, window_at,
};
use store::{MemoryView, RedisView};
use uuid::Uuid;

// ---------------------------------------------------------------- helpers

fn uid() -> String {
    Uuid::new_v4().simple().to_string()
}

fn project() -> ProjectId {
    ProjectId::parse(format!("p-{}", uid())).expect("project id")
}

fn event() -> EventId {
    EventId::parse(format!("e-{}", uid())).expect("event id")
}

/// Today's `day` counter of a dimension (the time is real: the Redis view
/// expires counters relative to the wall clock).
fn counter(dimension: Dimension, at: DateTime<Utc>) -> Counter {
    let w = window_at(WindowKind::Day, Tz::UTC, at);
    Counter { key: CounterKey { dimension, window: w.kind, window_key: w.key }, resets_at: w.resets_at }
}

fn project_counter(at: DateTime<Utc>) -> Counter {
    counter(Dimension::Project, at)
}

fn actor_counter(at: DateTime<Utc>) -> Counter {
    counter(Dimension::Actor("u1".into()), at)
}

/// A plan over `counters` with `(counter, metric, limit)` enforce caps on
/// the metric's field, needs and reservations as `plan_check` makes them
/// for requests, calls and rows.
fn plan(counters: &[Counter], limits: &[(usize, Metric, u64)], at: DateTime<Utc>) -> CheckPlan {
    let mut p = CheckPlan { counters: counters.to_vec(), ..CheckPlan::default() };
    for &(counter, metric, limit) in limits {
        let (field, need, reserve) = match metric {
            Metric::Requests => (Field::Requests, 0, false),
            Metric::Calls => (Field::Calls, 1, true),
            Metric::Rows => (Field::Rows, 1, false),
            Metric::Tokens => (Field::Tokens, 1, false),
            Metric::CostUsd => (Field::CostLlmTokens, 1, false),
            Metric::StorageBytes => (Field::Storage, 1, false),
        };
        if metric == Metric::Requests && !p.count_request.contains(&counter) {
            p.count_request.push(counter);
        }
        push(&mut p, counter, metric, LimitKind::Cap, &[field], limit, need, true, reserve, at);
    }
    p
}

/// Adds one limit to a plan, as written.
#[allow(clippy::too_many_arguments)]
fn push(
    p: &mut CheckPlan,
    counter: usize,
    metric: Metric,
    kind: LimitKind,
    fields: &[Field],
    limit: u64,
    need: u64,
    enforce: bool,
    reserve: bool,
    at: DateTime<Utc>,
) {
    let quota = p.limits.len();
    p.limits.push(PlannedLimit {
        quota,
        counter,
        metric,
        kind,
        fields: fields.to_vec().into(),
        limit,
        need,
        enforce,
        reserve,
    });
    // One window per counter, as a planned check has.
    while p.windows.len() <= counter {
        p.windows.push(window_at(WindowKind::Day, Tz::UTC, at));
    }
}

/// A plan of one limit on one counter that neither counts nor reserves.
fn one_limit(
    c: &Counter,
    kind: LimitKind,
    fields: &[Field],
    limit: u64,
    need: u64,
    enforce: bool,
    at: DateTime<Utc>,
) -> CheckPlan {
    let mut p = CheckPlan { counters: vec![c.clone()], ..CheckPlan::default() };
    push(&mut p, 0, Metric::CostUsd, kind, fields, limit, need, enforce, false, at);
    p
}

/// The project's storage footprint (never resets).
fn footprint() -> Counter {
    Counter { key: CounterKey::footprint(), resets_at: None }
}

/// A durable footprint of `bytes`, reflecting `events` storage facts.
fn held(bytes: i64, events: u64) -> Totals {
    Totals { storage: bytes, storage_events: events, ..Totals::default() }
}

/// What one tokens event adds: `tokens` billable tokens costing `picos` on
/// the AI meter, priced or not.
fn tokens(tokens: u64, picos: u64, priced: bool) -> Totals {
    Totals {
        tokens,
        cost_llm_tokens: picos,
        llm_events: 1,
        llm_priced: u64::from(priced),
        llm_unpriced: u64::from(!priced),
        ..Totals::default()
    }
}

async fn settle_one(view: &dyn View, p: &ProjectId, c: &Counter, t: Totals, at: DateTime<Utc>) -> EventId {
    let e = event();
    let s = Settlement { event: e.clone(), reservation: None, deltas: vec![(c.clone(), t)] };
    view.settle(p, &[s], at).await.expect("settle");
    e
}

/// A project storage quota of `limit` bytes.
fn storage_quota(p: &ProjectId, limit: u64, at: DateTime<Utc>) -> Quota {
    Quota {
        id: QuotaId::parse(format!("q-{}", uid())).expect("quota id"),
        spec: QuotaSpec {
            project_id: p.clone(),
            scope: Scope::Project,
            scope_ref: None,
            metric: Metric::StorageBytes,
            window: WindowKind::Current,
            limit,
            mode: Mode::Enforce,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: at,
        updated_at: at,
    }
}

fn hold(lease_until: DateTime<Utc>) -> Hold {
    Hold {
        reservation: ReservationId::parse(format!("r-{}", uid())).expect("reservation id"),
        request_event: event(),
        lease_until,
    }
}

/// One check; its usage split is checked against its totals (every cap
/// and probe reads `durable + settled + reserved`) and then left out, so
/// that the tests compare verdicts and totals (`explain_splits_usage`
/// compares the split).
async fn check(view: &dyn View, p: &ProjectId, plan: &CheckPlan, h: &Hold, at: DateTime<Utc>) -> CheckOutcome {
    let mut o = view.check(p, plan, h, at).await.expect("check").expect("project is seeded");
    assert_eq!(o.parts.len(), plan.limits.len(), "one split per limit: {o:?}");
    for ((l, used), parts) in plan.limits.iter().zip(&o.used).zip(&o.parts) {
        if l.kind != LimitKind::Blackout {
            let sum = i128::from(parts.durable) + i128::from(parts.settled) + i128::from(parts.reserved);
            assert_eq!(sum, i128::from(*used), "{l:?} reads its split: {o:?}");
        }
    }
    o.parts.clear();
    o
}

async fn seeded(view: &dyn View, totals: &[(Counter, Totals)]) -> ProjectId {
    let p = project();
    view.seed(&p, &Seed::of_totals(totals.to_vec()), Utc::now()).await.expect("seed");
    p
}

async fn usage(view: &dyn View, p: &ProjectId, c: &Counter, at: DateTime<Utc>) -> meter::CounterUsage {
    view.usage(p, &c.key, at).await.expect("usage").expect("project is seeded")
}

/// What a monitor-only check sees of calls and rows (it counts no request
/// and reserves nothing).
async fn probe(view: &dyn View, p: &ProjectId, c: &Counter, at: DateTime<Utc>) -> Vec<u64> {
    let mut pl = plan(std::slice::from_ref(c), &[(0, Metric::Calls, 1000), (0, Metric::Rows, 1000)], at);
    for l in &mut pl.limits {
        l.enforce = false;
        l.reserve = false;
    }
    check(view, p, &pl, &hold(at + Duration::seconds(30)), at).await.used
}

fn calls(n: u64, rows: u64) -> Totals {
    Totals { calls: n, rows, ..Totals::default() }
}

// ---------------------------------------------------------------- suites

async fn suite_unseeded_project_answers_none_and_changes_nothing(view: &dyn View) {
    let at = Utc::now();
    let p = project();
    let c = project_counter(at);
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Requests, 10), (0, Metric::Calls, 10)], at);
    let h = hold(at + Duration::seconds(30));
    assert_eq!(view.check(&p, &pl, &h, at).await.expect("check"), None);
    assert_eq!(view.usage(&p, &c.key, at).await.expect("usage"), None);
    view.seed(&p, &Seed::default(), Utc::now()).await.expect("seed");
    let u = usage(view, &p, &c, at).await;
    assert_eq!(u, meter::CounterUsage::default(), "the unseeded check counted or reserved something");
}

async fn suite_admits_up_to_the_limit_then_refuses_reserving_nothing(view: &dyn View) {
    let at = Utc::now();
    let (wide, tight) = (project_counter(at), actor_counter(at));
    let p = seeded(view, &[]).await;
    // The project allows 10 calls, the actor 3: the actor's limit refuses.
    let pl = plan(&[wide.clone(), tight.clone()], &[(0, Metric::Calls, 10), (1, Metric::Calls, 3)], at);
    for i in 0..3u64 {
        let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
        assert!(o.admitted, "check {i} refused");
        assert_eq!(o.used, vec![i, i]);
    }
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert!(!o.admitted, "the 4th call was admitted");
    assert_eq!(o.used, vec![3, 3]);
    assert_eq!(usage(view, &p, &tight, at).await.reserved_calls, 3);
    assert_eq!(usage(view, &p, &wide, at).await.reserved_calls, 3, "a refused check reserved on another counter");
}

/// The split a check answers for explain: 5 calls folded, 2 settled since,
/// 1 held by another check's live reservation; the requests limit counts
/// this check's own request as settled.
async fn suite_explain_splits_usage_into_durable_settled_and_reserved(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[(c.clone(), calls(5, 0))]).await;
    settle_one(view, &p, &c, calls(2, 0), at).await;
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 100), (0, Metric::Requests, 100)], at);
    let other = view.check(&p, &pl, &hold(at + Duration::seconds(30)), at).await.expect("check").expect("seeded");
    assert!(other.admitted);
    let o = view.check(&p, &pl, &hold(at + Duration::seconds(30)), at).await.expect("check").expect("seeded");
    let split = |durable, settled, reserved| meter::UsageParts { durable, settled, reserved };
    assert_eq!(o.used, vec![8, 2], "{o:?}");
    assert_eq!(o.parts, vec![split(5, 2, 1), split(0, 2, 0)], "{o:?}");
}

async fn suite_concurrent_checks_admit_exactly_the_limit(view: Arc<dyn View>) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(&*view, &[]).await;
    let pl = Arc::new(plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 50)], at));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (view, p, pl) = (view.clone(), p.clone(), pl.clone());
            tokio::spawn(async move { check(&*view, &p, &pl, &hold(at + Duration::seconds(60)), at).await.admitted })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        if t.await.expect("task") {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 50);
    assert_eq!(usage(&*view, &p, &c, at).await.reserved_calls, 50);
}

async fn suite_settle_releases_the_reservation_and_adds_pending(view: &dyn View) {
    let at = Utc::now();
    let (wide, tight) = (project_counter(at), actor_counter(at));
    let p = seeded(view, &[]).await;
    let pl = plan(&[wide.clone(), tight.clone()], &[(0, Metric::Calls, 5), (1, Metric::Calls, 5)], at);
    let h = hold(at + Duration::seconds(30));
    assert!(check(view, &p, &pl, &h, at).await.admitted);
    assert_eq!(usage(view, &p, &wide, at).await.reserved_calls, 1);
    let s = Settlement {
        event: event(),
        reservation: Some(h.reservation.clone()),
        deltas: vec![(wide.clone(), calls(1, 7)), (tight.clone(), calls(1, 7))],
    };
    view.settle(&p, &[s], at).await.expect("settle");
    for c in [&wide, &tight] {
        let u = usage(view, &p, c, at).await;
        assert_eq!(u.reserved_calls, 0, "the reservation is still held");
        assert_eq!(u.pending, calls(1, 7));
    }
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!(o.used, vec![1, 1], "the settled call counts once (pending, not reserved)");
    // A failed call settles with no deltas: it only frees its slot.
    let h2 = hold(at + Duration::seconds(30));
    assert!(check(view, &p, &pl, &h2, at).await.admitted);
    let failed = Settlement { event: event(), reservation: Some(h2.reservation.clone()), deltas: vec![] };
    view.settle(&p, &[failed], at).await.expect("settle");
    let u = usage(view, &p, &wide, at).await;
    assert_eq!((u.pending, u.reserved_calls), (calls(1, 7), 1), "only the other check's slot is held");
}

async fn suite_the_same_event_settled_twice_counts_once(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[]).await;
    let s = Settlement { event: event(), reservation: None, deltas: vec![(c.clone(), calls(1, 4))] };
    view.settle(&p, &[s.clone(), s.clone()], at).await.expect("settle");
    view.settle(&p, std::slice::from_ref(&s), at).await.expect("settle again");
    assert_eq!(usage(view, &p, &c, at).await.pending, calls(1, 4));
    // A counter named twice in one settlement is summed, and taken back whole.
    let twice = Settlement {
        event: event(),
        reservation: None,
        deltas: vec![(c.clone(), calls(1, 1)), (c.clone(), calls(1, 2))],
    };
    view.settle(&p, std::slice::from_ref(&twice), at).await.expect("settle");
    assert_eq!(usage(view, &p, &c, at).await.pending, calls(3, 7));
    view.unsettle(&p, std::slice::from_ref(&twice.event)).await.expect("unsettle");
    assert_eq!(usage(view, &p, &c, at).await.pending, calls(1, 4));
}

async fn suite_unsettle_takes_back_pending(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[]).await;
    let s = Settlement { event: event(), reservation: None, deltas: vec![(c.clone(), calls(1, 9))] };
    view.settle(&p, std::slice::from_ref(&s), at).await.expect("settle");
    view.unsettle(&p, std::slice::from_ref(&s.event)).await.expect("unsettle");
    view.unsettle(&p, std::slice::from_ref(&s.event)).await.expect("unsettle again");
    assert_eq!(usage(view, &p, &c, at).await.pending, Totals::default());
    // A request event that never reached the log is taken back too.
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Requests, 10)], at);
    let h = hold(at + Duration::seconds(30));
    check(view, &p, &pl, &h, at).await;
    assert_eq!(usage(view, &p, &c, at).await.pending.requests, 1);
    view.unsettle(&p, std::slice::from_ref(&h.request_event)).await.expect("unsettle");
    assert_eq!(usage(view, &p, &c, at).await.pending.requests, 0);
}

async fn suite_fold_moves_pending_into_durable_without_double_counting(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[(c.clone(), Totals { requests: 4, calls: 10, rows: 100, ..Totals::default() })]).await;
    let pl = plan(
        std::slice::from_ref(&c),
        &[(0, Metric::Requests, 1000), (0, Metric::Calls, 1000), (0, Metric::Rows, 1000)],
        at,
    );
    let h = hold(at + Duration::seconds(30));
    let first = check(view, &p, &pl, &h, at).await;
    assert_eq!(first.used, vec![5, 10, 100]);
    let s =
        Settlement { event: event(), reservation: Some(h.reservation.clone()), deltas: vec![(c.clone(), calls(1, 5))] };
    view.settle(&p, std::slice::from_ref(&s), at).await.expect("settle");
    let before = probe(view, &p, &c, at).await;
    assert_eq!(before, vec![11, 105]);
    let u = usage(view, &p, &c, at).await;
    assert_eq!(
        (u.durable, u.pending),
        (
            Totals { requests: 4, calls: 10, rows: 100, ..Totals::default() },
            Totals { requests: 1, calls: 1, rows: 5, ..Totals::default() }
        )
    );
    // The projector folded the request event and the call event.
    let folded = Totals { requests: 5, calls: 11, rows: 105, ..Totals::default() };
    let events = [h.request_event.clone(), s.event.clone()];
    view.apply_fold(&p, &[(c.clone(), folded)], &events, Utc::now()).await.expect("fold");
    let u = usage(view, &p, &c, at).await;
    assert_eq!((u.durable, u.pending), (folded, Totals::default()));
    assert_eq!(probe(view, &p, &c, at).await, before, "usage changed across the fold");
    // The same fold delivered again changes nothing; an older total never lowers.
    view.apply_fold(&p, &[(c.clone(), folded)], &events, Utc::now()).await.expect("fold again");
    view.apply_fold(
        &p,
        &[(c.clone(), Totals { requests: 1, calls: 1, rows: 1, ..Totals::default() })],
        &[],
        Utc::now(),
    )
    .await
    .expect("stale fold");
    let u = usage(view, &p, &c, at).await;
    assert_eq!((u.durable, u.pending), (folded, Totals::default()));
    // A fold of an event the view never saw only raises totals.
    view.apply_fold(
        &p,
        &[(c.clone(), Totals { requests: 5, calls: 12, rows: 106, ..Totals::default() })],
        &[event()],
        Utc::now(),
    )
    .await
    .expect("fold");
    assert_eq!(
        usage(view, &p, &c, at).await.durable,
        Totals { requests: 5, calls: 12, rows: 106, ..Totals::default() }
    );
}

/// After a fold of corrections that took usage back, the durable sums are
/// lowered to the new totals (a fold alone only raises them); pending
/// deltas, the footprint and counters the view does not hold are left alone.
async fn suite_a_correction_lowers_durable_sums_and_nothing_else(view: &dyn View) {
    let at = Utc::now();
    let (c, a, fp) =
        (project_counter(at), actor_counter(at), Counter { key: CounterKey::footprint(), resets_at: None });
    let p = seeded(
        view,
        &[(c.clone(), Totals { requests: 4, calls: 4, rows: 18, ..Totals::default() }), (fp.clone(), held(500, 3))],
    )
    .await;
    let s = Settlement { event: event(), reservation: None, deltas: vec![(c.clone(), calls(1, 2))] };
    view.settle(&p, std::slice::from_ref(&s), at).await.expect("settle");
    // A void of a call of 5 rows: 3 calls, 13 rows now; requests stay.
    let lowered = Totals { requests: 4, calls: 3, rows: 13, ..Totals::default() };
    // The fold's raise leaves it as it was …
    view.apply_fold(&p, &[(c.clone(), lowered)], &[], Utc::now()).await.expect("fold");
    assert_eq!(usage(view, &p, &c, at).await.durable, Totals { requests: 4, calls: 4, rows: 18, ..Totals::default() });
    // … the lowering takes it back, and only it.
    view.lower_totals(&p, &[(c.clone(), lowered), (a.clone(), Totals::default()), (fp.clone(), Totals::default())])
        .await
        .expect("lower");
    let u = usage(view, &p, &c, at).await;
    assert_eq!((u.durable, u.pending), (lowered, calls(1, 2)));
    assert_eq!(probe(view, &p, &c, at).await, vec![4, 15], "durable + pending");
    assert_eq!(usage(view, &p, &a, at).await.durable, Totals::default(), "not created");
    assert_eq!(usage(view, &p, &fp, at).await.durable, held(500, 3), "the footprint is not a sum");
    // Lowering never raises.
    view.lower_totals(&p, &[(c.clone(), Totals { calls: 9, rows: 99, ..lowered })]).await.expect("lower");
    assert_eq!(usage(view, &p, &c, at).await.durable, lowered);
}

async fn suite_expired_leases_free_the_slot(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[]).await;
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 1)], at);
    // A lease already over when taken holds nothing for the next check.
    assert!(check(view, &p, &pl, &hold(at - Duration::milliseconds(1)), at).await.admitted);
    assert_eq!(usage(view, &p, &c, at).await.reserved_calls, 0);
    // A live lease holds the slot until it ends.
    assert!(check(view, &p, &pl, &hold(at + Duration::seconds(10)), at).await.admitted);
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(20)), at + Duration::seconds(5)).await;
    assert_eq!((o.admitted, o.used), (false, vec![1]));
    let later = at + Duration::seconds(11);
    assert_eq!(usage(view, &p, &c, later).await.reserved_calls, 0);
    assert!(check(view, &p, &pl, &hold(later + Duration::seconds(10)), later).await.admitted);
}

async fn suite_requests_limit_counts_refused_requests(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[]).await;
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Requests, 2)], at);
    let mut seen = Vec::new();
    for _ in 0..4 {
        let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
        seen.push((o.admitted, o.used[0]));
    }
    assert_eq!(seen, vec![(true, 1), (true, 2), (false, 3), (false, 4)]);
    assert_eq!(usage(view, &p, &c, at).await.pending.requests, 4);
    // A check refused by its calls limit still counts its request.
    let both = plan(std::slice::from_ref(&c), &[(0, Metric::Requests, 100), (0, Metric::Calls, 1)], at);
    assert!(check(view, &p, &both, &hold(at + Duration::seconds(30)), at).await.admitted);
    let o = check(view, &p, &both, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!((o.admitted, o.used.clone()), (false, vec![6, 1]));
    let u = usage(view, &p, &c, at).await;
    assert_eq!((u.pending.requests, u.reserved_calls), (6, 1));
}

async fn suite_release_frees_a_slot(view: &dyn View) {
    let at = Utc::now();
    let (wide, tight) = (project_counter(at), actor_counter(at));
    let p = seeded(view, &[]).await;
    let pl = plan(&[wide.clone(), tight.clone()], &[(0, Metric::Calls, 1), (1, Metric::Calls, 1)], at);
    let first = hold(at + Duration::seconds(30));
    assert!(check(view, &p, &pl, &first, at).await.admitted);
    assert!(!check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await.admitted);
    view.release(&p, &first.reservation, at).await.expect("release");
    view.release(&p, &first.reservation, at).await.expect("release again");
    for c in [&wide, &tight] {
        assert_eq!(usage(view, &p, c, at).await.reserved_calls, 0);
    }
    assert!(check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await.admitted);
}

async fn suite_seed_never_lowers_a_total(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = project();
    view.apply_fold(
        &p,
        &[(c.clone(), Totals { requests: 5, calls: 5, rows: 5, ..Totals::default() })],
        &[],
        Utc::now(),
    )
    .await
    .expect("fold");
    assert_eq!(view.usage(&p, &c.key, at).await.expect("usage"), None, "a fold does not mark the project seeded");
    view.seed(
        &p,
        &Seed::of_totals(vec![(c.clone(), Totals { requests: 3, calls: 3, rows: 3, ..Totals::default() })]),
        Utc::now(),
    )
    .await
    .expect("seed");
    assert_eq!(usage(view, &p, &c, at).await.durable, Totals { requests: 5, calls: 5, rows: 5, ..Totals::default() });
    view.seed(
        &p,
        &Seed::of_totals(vec![(c.clone(), Totals { requests: 7, calls: 2, rows: 9, ..Totals::default() })]),
        Utc::now(),
    )
    .await
    .expect("seed");
    assert_eq!(usage(view, &p, &c, at).await.durable, Totals { requests: 7, calls: 5, rows: 9, ..Totals::default() });
    // Exact beyond 2^53: totals are compared as decimal strings.
    let big = Totals { requests: u64::MAX - 1, calls: 9_007_199_254_740_993, rows: 10, ..Totals::default() };
    view.seed(&p, &Seed::of_totals(vec![(c.clone(), big)]), Utc::now()).await.expect("seed");
    view.seed(
        &p,
        &Seed::of_totals(vec![(
            c.clone(),
            Totals { requests: u64::MAX - 2, calls: 9_007_199_254_740_992, rows: 9, ..Totals::default() },
        )]),
        Utc::now(),
    )
    .await
    .expect("seed");
    assert_eq!(usage(view, &p, &c, at).await.durable, big);
}

async fn suite_a_retried_check_counts_once(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[]).await;
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Requests, 10), (0, Metric::Calls, 1)], at);
    let h = hold(at + Duration::seconds(30));
    let first = check(view, &p, &pl, &h, at).await;
    let again = check(view, &p, &pl, &h, at).await;
    assert_eq!(first, CheckOutcome::of(true, vec![1, 0]));
    assert_eq!(again, first, "a retried check counted itself");
    let u = usage(view, &p, &c, at).await;
    assert_eq!((u.pending.requests, u.reserved_calls), (1, 1));
}

async fn suite_counters_expire_an_hour_after_their_window_resets(view: &dyn View) {
    let at = Utc::now();
    // Windows that reset 61 and 59 minutes ago: the first is gone, the second
    // lives for one more minute (the grace lets late settles land).
    let closed = |minutes: i64, key: &str| Counter {
        key: CounterKey { dimension: Dimension::Project, window: WindowKind::Day, window_key: key.to_owned() },
        resets_at: Some(at - Duration::minutes(minutes)),
    };
    let (gone, kept) = (closed(61, "gone"), closed(59, "kept"));
    let t = Totals { requests: 1, calls: 2, rows: 3, ..Totals::default() };
    let p = seeded(view, &[(gone.clone(), t), (kept.clone(), t)]).await;
    let s = Settlement {
        event: event(),
        reservation: None,
        deltas: vec![(gone.clone(), calls(1, 1)), (kept.clone(), calls(1, 1))],
    };
    view.settle(&p, std::slice::from_ref(&s), at).await.expect("settle");
    assert_eq!(
        usage(view, &p, &gone, at).await,
        meter::CounterUsage::default(),
        "an expired counter was kept or recreated"
    );
    let u = usage(view, &p, &kept, at).await;
    assert_eq!((u.durable, u.pending), (t, calls(1, 1)));
    // Taking the event back leaves the expired counter alone.
    view.unsettle(&p, std::slice::from_ref(&s.event)).await.expect("unsettle");
    assert_eq!(usage(view, &p, &gone, at).await, meter::CounterUsage::default());
    assert_eq!(usage(view, &p, &kept, at).await.pending, Totals::default());
}

async fn suite_token_and_cost_caps_refuse_at_the_limit(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    // $1,000 in picodollars: still below 2^53, so the byte-exact boundary holds in Lua too.
    let dollars_1000: u64 = 1_000_000_000_000_000;
    let p =
        seeded(view, &[(c.clone(), Totals { tokens: 90, cost_llm_tokens: dollars_1000 - 10, ..Totals::default() })])
            .await;
    let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Tokens, 100), (0, Metric::CostUsd, dollars_1000)], at);
    settle_one(view, &p, &c, tokens(9, 9, true), at).await;
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!((o.admitted, o.used.clone()), (true, vec![99, dollars_1000 - 1]), "one below both limits");
    // Tokens reach their limit: with need 1 the check is refused.
    settle_one(view, &p, &c, Totals { tokens: 1, ..Totals::default() }, at).await;
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!((o.admitted, o.used.clone()), (false, vec![100, dollars_1000 - 1]));
    // The cost alone at its limit refuses too.
    let cost = plan(std::slice::from_ref(&c), &[(0, Metric::CostUsd, dollars_1000)], at);
    assert!(check(view, &p, &cost, &hold(at + Duration::seconds(30)), at).await.admitted);
    settle_one(view, &p, &c, Totals { cost_llm_tokens: 1, ..Totals::default() }, at).await;
    let o = check(view, &p, &cost, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!((o.admitted, o.used), (false, vec![dollars_1000]));
}

async fn suite_a_cost_cap_sums_its_cost_fields(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p =
        seeded(view, &[(c.clone(), Totals { cost_llm_tokens: 10, cost_compute_execution: 20, ..Totals::default() })])
            .await;
    settle_one(view, &p, &c, Totals { cost_api_request: 30, cost_storage: 40, tokens: 1000, ..Totals::default() }, at)
        .await;
    let mut pl = CheckPlan { counters: vec![c.clone()], ..CheckPlan::default() };
    push(&mut pl, 0, Metric::CostUsd, LimitKind::Cap, &Field::COSTS, 101, 1, true, false, at);
    push(&mut pl, 0, Metric::CostUsd, LimitKind::Cap, &[Field::CostLlmTokens], 11, 1, true, false, at);
    push(
        &mut pl,
        0,
        Metric::CostUsd,
        LimitKind::Cap,
        &[Field::CostComputeExecution, Field::CostApiRequest],
        1000,
        1,
        true,
        false,
        at,
    );
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!((o.admitted, o.used), (true, vec![100, 10, 50]), "tokens are not cost");
    // One picodollar more on any meter reaches the summed cap.
    settle_one(view, &p, &c, Totals { cost_storage: 1, ..Totals::default() }, at).await;
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!((o.admitted, o.used), (false, vec![101, 10, 50]));
}

async fn suite_a_blackout_refuses_the_third_unpriced_event_until_one_is_priced(view: &dyn View) {
    let at = Utc::now();
    let (c, other) = (project_counter(at), actor_counter(at));
    let p = seeded(view, &[]).await;
    // A cost cap with its blackout and a calls cap on another counter, as a check plans them.
    let mut pl = CheckPlan { counters: vec![c.clone(), other.clone()], ..CheckPlan::default() };
    push(&mut pl, 0, Metric::CostUsd, LimitKind::Cap, &[Field::CostLlmTokens], 1_000_000, 1, true, false, at);
    push(&mut pl, 0, Metric::CostUsd, LimitKind::Blackout, &[Field::LlmEvents], 2, 1, true, false, at);
    push(&mut pl, 1, Metric::Calls, LimitKind::Cap, &[Field::Calls], 100, 1, true, true, at);
    let mut monitor = pl.clone();
    monitor.limits[1].enforce = false;
    let run = |pl: &CheckPlan| {
        let pl = pl.clone();
        let p = p.clone();
        async move { check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await }
    };
    // With need 1 and limit 2, the call that would be the third unpriced
    // event is refused: the first two pass.
    assert_eq!(run(&pl).await, CheckOutcome::of(true, vec![0, 0, 0]));
    settle_one(view, &p, &c, tokens(10, 0, false), at).await;
    assert_eq!(run(&pl).await, CheckOutcome::of(true, vec![0, 1, 1]));
    settle_one(view, &p, &c, tokens(10, 0, false), at).await;
    // The third refuses, reserving nothing anywhere.
    assert_eq!(run(&pl).await, CheckOutcome::of(false, vec![0, 2, 2]));
    assert_eq!(usage(view, &p, &other, at).await.reserved_calls, 2, "a refused check reserved");
    // A monitor blackout never refuses (it took a third call slot).
    assert_eq!(run(&monitor).await, CheckOutcome::of(true, vec![0, 2, 2]));
    settle_one(view, &p, &c, tokens(10, 0, false), at).await;
    assert_eq!(run(&pl).await, CheckOutcome::of(false, vec![0, 3, 3]));
    // One priced event lifts it, however many unpriced ones follow.
    settle_one(view, &p, &c, tokens(10, 5, true), at).await;
    settle_one(view, &p, &c, tokens(10, 0, false), at).await;
    assert_eq!(run(&pl).await, CheckOutcome::of(true, vec![5, 0, 3]));
    // Priced usage already durable lifts it too.
    let q = seeded(view, &[(c.clone(), Totals { llm_events: 7, llm_priced: 1, llm_unpriced: 6, ..Totals::default() })])
        .await;
    let bo = one_limit(&c, LimitKind::Blackout, &[Field::LlmEvents], 2, 1, true, at);
    assert_eq!(check(view, &q, &bo, &hold(at + Duration::seconds(30)), at).await, CheckOutcome::of(true, vec![0]));
}

async fn suite_a_probe_reports_the_sum_and_never_refuses(view: &dyn View) {
    let at = Utc::now();
    let c = project_counter(at);
    let p = seeded(view, &[(c.clone(), Totals { llm_events: 4, llm_unpriced: 3, llm_priced: 1, ..Totals::default() })])
        .await;
    settle_one(view, &p, &c, tokens(1, 0, false), at).await;
    let mut pl = CheckPlan { counters: vec![c.clone()], ..CheckPlan::default() };
    // Even marked enforce, with a limit of 0 and a need, a probe does not refuse.
    push(&mut pl, 0, Metric::CostUsd, LimitKind::Probe, &[Field::LlmUnpriced], 0, 1, true, false, at);
    push(&mut pl, 0, Metric::CostUsd, LimitKind::Probe, &[Field::LlmEvents], 0, 0, false, false, at);
    push(
        &mut pl,
        0,
        Metric::CostUsd,
        LimitKind::Probe,
        &[Field::LlmPriced, Field::LlmUnpriced],
        0,
        0,
        false,
        false,
        at,
    );
    let o = check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await;
    assert_eq!(o, CheckOutcome::of(true, vec![4, 5, 5]));
}

async fn suite_a_storage_cap_refuses_past_the_exact_byte(view: &dyn View) {
    let at = Utc::now();
    let fp = footprint();
    let p = seeded(view, &[(fp.clone(), held(1_000, 3))]).await;
    let q = [storage_quota(&p, 1_500, at)];
    let write = |delta: i64| {
        let input = CheckInput { caller: Caller::default(), storage_delta: Some(delta), ..Default::default() };
        plan_check(&q, Tz::UTC, &input, at)
    };
    let pl = write(500);
    assert_eq!((pl.counters.len(), &pl.counters[0].key), (1, &fp.key), "a storage quota reads the footprint");
    assert_eq!(check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await, CheckOutcome::of(true, vec![1_000]));
    assert_eq!(
        check(view, &p, &write(501), &hold(at + Duration::seconds(30)), at).await,
        CheckOutcome::of(false, vec![1_000])
    );
    // A delete settled but not folded lowers the footprint at once.
    let del = settle_one(view, &p, &fp, held(-300, 1), at).await;
    let u = usage(view, &p, &fp, at).await;
    assert_eq!((u.durable, u.pending), (held(1_000, 3), held(-300, 1)));
    assert!(check(view, &p, &write(800), &hold(at + Duration::seconds(30)), at).await.admitted);
    assert_eq!(
        check(view, &p, &write(801), &hold(at + Duration::seconds(30)), at).await,
        CheckOutcome::of(false, vec![700])
    );
    // Pending deletes beyond the footprint read as nothing held, not less.
    settle_one(view, &p, &fp, held(-900, 1), at).await;
    assert_eq!(usage(view, &p, &fp, at).await.pending, held(-1_200, 2));
    assert_eq!(
        check(view, &p, &write(1_500), &hold(at + Duration::seconds(30)), at).await,
        CheckOutcome::of(true, vec![0])
    );
    // Taking the delete back restores the bytes it removed.
    view.unsettle(&p, std::slice::from_ref(&del)).await.expect("unsettle");
    assert_eq!(usage(view, &p, &fp, at).await.pending, held(-900, 1));
    assert_eq!(
        check(view, &p, &write(1_400), &hold(at + Duration::seconds(30)), at).await,
        CheckOutcome::of(true, vec![100])
    );
    assert!(!check(view, &p, &write(1_401), &hold(at + Duration::seconds(30)), at).await.admitted);
}

async fn suite_the_footprint_moves_only_with_more_storage_facts(view: &dyn View) {
    let at = Utc::now();
    let fp = footprint();
    let p = seeded(view, &[(fp.clone(), Totals { cost_storage: 50, ..held(1_000, 5) })]).await;
    let e = settle_one(view, &p, &fp, held(-600, 1), at).await;
    // The fold of the delete lowers the durable footprint and drops its pending delta.
    view.apply_fold(
        &p,
        &[(fp.clone(), Totals { cost_storage: 40, ..held(400, 6) })],
        std::slice::from_ref(&e),
        Utc::now(),
    )
    .await
    .expect("fold");
    let u = usage(view, &p, &fp, at).await;
    assert_eq!(
        (u.durable, u.pending),
        (Totals { cost_storage: 50, ..held(400, 6) }, Totals::default()),
        "sums still never go down"
    );
    // Stale totals (fewer or as many storage facts) change nothing, by fold or by seed.
    view.apply_fold(&p, &[(fp.clone(), held(900, 4))], &[], Utc::now()).await.expect("stale fold");
    view.apply_fold(&p, &[(fp.clone(), held(2_000, 6))], &[], Utc::now()).await.expect("same-count fold");
    view.seed(&p, &Seed::of_totals(vec![(fp.clone(), held(3_000, 5))]), Utc::now()).await.expect("late seed");
    assert_eq!(usage(view, &p, &fp, at).await.durable, Totals { cost_storage: 50, ..held(400, 6) });
    // A total with no storage facts says nothing about the footprint.
    view.apply_fold(&p, &[(fp.clone(), Totals::default())], &[], Utc::now()).await.expect("empty fold");
    assert_eq!(usage(view, &p, &fp, at).await.durable.storage, 400);
    // A newer footprint may be negative (deltas with no snapshot): kept exactly, read as 0.
    view.apply_fold(&p, &[(fp.clone(), held(-50, 7))], &[], Utc::now()).await.expect("fold");
    assert_eq!(usage(view, &p, &fp, at).await.durable, Totals { cost_storage: 50, ..held(-50, 7) });
    let pl = one_limit(&fp, LimitKind::Cap, &[Field::Storage], 10, 10, true, at);
    assert_eq!(check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await, CheckOutcome::of(true, vec![0]));
    // A view seeded with a footprint for the first time takes it whatever its count.
    let fresh = seeded(view, &[(fp.clone(), held(0, 2))]).await;
    assert_eq!(usage(view, &fresh, &fp, at).await.durable, held(0, 2));
    view.seed(&fresh, &Seed::of_totals(vec![(fp.clone(), held(70, 2))]), Utc::now()).await.expect("seed");
    assert_eq!(usage(view, &fresh, &fp, at).await.durable, held(0, 2));
}

async fn suite_unsettle_of_a_tokens_settlement_takes_back_every_field(view: &dyn View) {
    let at = Utc::now();
    let (wide, tight) = (project_counter(at), actor_counter(at));
    let p = seeded(view, &[]).await;
    let kept = settle_one(view, &p, &wide, tokens(7, 3, true), at).await;
    // Beyond 2^53: pending amounts are stored exactly.
    let big = Totals { cost_compute_execution: 12_345_678_901_234_567, ..tokens(1_000, 9_007_199_254_740_993, false) };
    let s = Settlement { event: event(), reservation: None, deltas: vec![(wide.clone(), big), (tight.clone(), big)] };
    view.settle(&p, std::slice::from_ref(&s), at).await.expect("settle");
    let mut both = tokens(7, 3, true);
    both.add(big);
    assert_eq!(usage(view, &p, &wide, at).await.pending, both);
    assert_eq!(usage(view, &p, &tight, at).await.pending, big);
    view.unsettle(&p, std::slice::from_ref(&s.event)).await.expect("unsettle");
    assert_eq!(usage(view, &p, &wide, at).await.pending, tokens(7, 3, true));
    assert_eq!(usage(view, &p, &tight, at).await.pending, Totals::default());
    // A fold drops every field of the event it folds.
    view.apply_fold(&p, &[(wide.clone(), tokens(7, 3, true))], std::slice::from_ref(&kept), Utc::now())
        .await
        .expect("fold");
    let u = usage(view, &p, &wide, at).await;
    assert_eq!((u.durable, u.pending), (tokens(7, 3, true), Totals::default()));
}

// ---------------------------------------------------------------- Redis

fn url() -> String {
    testkit::env::redis_url()
}

/// A view with a prefix of its own (`testkit::RedisPrefix`: its keys go when
/// it is dropped); `None`, and the test skipped, when Redis does not answer.
struct Fresh {
    view: RedisView,
    prefix: String,
    _keys: testkit::RedisPrefix,
}

impl Fresh {
    async fn new() -> Option<Fresh> {
        if !testkit::available(&[testkit::Service::Redis]) {
            return None;
        }
        let keys = testkit::RedisPrefix::new("tgtest");
        let view = RedisView::connect(&keys.url, &keys.prefix).await.expect("connect to the test Redis");
        Some(Fresh { view, prefix: keys.prefix.clone(), _keys: keys })
    }

    async fn cleanup(self) {}

    /// The start of every key of project `p` ("P{p}:"), for reading them raw.
    fn base(&self, p: &ProjectId) -> String {
        format!("{}{{{}}}:", self.prefix, p.as_str())
    }

    /// A connection of its own to the test Redis, beside the view's.
    async fn raw(&self) -> ::redis::aio::MultiplexedConnection {
        let client = ::redis::Client::open(url()).expect("redis url");
        client.get_multiplexed_async_connection().await.expect("redis connection")
    }
}

/// Stamps out every generic suite as a test for one backend. `$fixture` is
/// an expression giving a future of a value with a `view` field and an async
/// `cleanup(self)`, kept alive for the test.
macro_rules! conformance {
    ($fixture:expr) => {
        conformance!(@each $fixture;
            suite_unseeded_project_answers_none_and_changes_nothing,
            suite_admits_up_to_the_limit_then_refuses_reserving_nothing,
            suite_settle_releases_the_reservation_and_adds_pending,
            suite_the_same_event_settled_twice_counts_once,
            suite_unsettle_takes_back_pending,
            suite_fold_moves_pending_into_durable_without_double_counting,
            suite_expired_leases_free_the_slot,
            suite_requests_limit_counts_refused_requests,
            suite_release_frees_a_slot,
            suite_seed_never_lowers_a_total,
            suite_a_retried_check_counts_once,
            suite_counters_expire_an_hour_after_their_window_resets,
            suite_token_and_cost_caps_refuse_at_the_limit,
            suite_a_cost_cap_sums_its_cost_fields,
            suite_a_blackout_refuses_the_third_unpriced_event_until_one_is_priced,
            suite_a_probe_reports_the_sum_and_never_refuses,
            suite_a_storage_cap_refuses_past_the_exact_byte,
            suite_the_footprint_moves_only_with_more_storage_facts,
            suite_unsettle_of_a_tokens_settlement_takes_back_every_field,
            suite_a_correction_lowers_durable_sums_and_nothing_else,
            suite_explain_splits_usage_into_durable_settled_and_reserved,
        );

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn suite_concurrent_checks_admit_exactly_the_limit() {
            let Some(fixture) = $fixture.await else { return };
            let view: Arc<dyn View> = Arc::new(fixture.view.clone());
            super::suite_concurrent_checks_admit_exactly_the_limit(view).await;
            fixture.cleanup().await;
        }
    };
    (@each $fixture:expr; $($name:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $name() {
            let Some(fixture) = $fixture.await else { return };
            super::$name(&fixture.view).await;
            fixture.cleanup().await;
        }
    )*};
}

mod redis {
    use super::*;

    conformance!(Fresh::new());

    #[tokio::test]
    async fn a_prefix_with_a_hash_tag_is_refused() {
        let err = RedisView::connect(&url(), "tg:{x}:").await.expect_err("prefix with braces");
        assert!(!err.is_transient());
    }

    /// Event indexes written before the counters had 13 fields hold
    /// `req,calls,rows`: a prefix of today's value list, so they still read.
    #[tokio::test]
    async fn an_event_index_of_an_older_version_is_taken_back() {
        let Some(fixture) = Fresh::new().await else { return };
        let at = Utc::now();
        let c = project_counter(at);
        let p = seeded(&fixture.view, &[]).await;
        let base = fixture.base(&p);
        let e = event();
        let mut conn = fixture.raw().await;
        let ckey = format!("{base}c:{}", c.key.encode());
        let _: () = ::redis::cmd("HSET")
            .arg(&ckey)
            .arg("p_req")
            .arg(1)
            .arg("p_calls")
            .arg(1)
            .arg("p_rows")
            .arg(5)
            .query_async(&mut conn)
            .await
            .expect("hset");
        let _: () = ::redis::cmd("HSET")
            .arg(format!("{base}ev:{e}"))
            .arg(c.key.encode())
            .arg("1,1,5")
            .query_async(&mut conn)
            .await
            .expect("hset");
        assert_eq!(usage(&fixture.view, &p, &c, at).await.pending, Totals { requests: 1, ..calls(1, 5) });
        fixture.view.unsettle(&p, &[e]).await.expect("unsettle");
        assert_eq!(usage(&fixture.view, &p, &c, at).await.pending, Totals::default());
        fixture.cleanup().await;
    }

    /// A reservation's keys expire `LEASE_GRACE` after its lease: its index
    /// as set when it is first held, the counter's leases after the latest
    /// lease written to them (moved later, never earlier by a retry).
    #[tokio::test]
    async fn reservation_keys_expire_a_grace_after_the_latest_lease() {
        let Some(fixture) = Fresh::new().await else { return };
        let at = Utc::now();
        let c = project_counter(at);
        let p = seeded(&fixture.view, &[]).await;
        let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 10)], at);
        let (late, early) = (hold(at + Duration::seconds(60)), hold(at + Duration::seconds(30)));
        for h in [&early, &late, &early] {
            assert!(check(&fixture.view, &p, &pl, h, at).await.admitted);
        }
        let base = fixture.base(&p);
        let mut conn = fixture.raw().await;
        let grace = Duration::from_std(meter::view::LEASE_GRACE).expect("grace");
        let until = |h: &Hold| meter::view::model::millis(h.lease_until + grace);
        for (key, want) in [
            (format!("{base}res:{}", late.reservation), until(&late)),
            (format!("{base}res:{}", early.reservation), until(&early)),
            (format!("{base}r:{}", c.key.encode()), until(&late)),
        ] {
            let got: i64 = ::redis::cmd("PEXPIRETIME").arg(&key).query_async(&mut conn).await.expect("pexpiretime");
            assert_eq!(got, want, "{key}");
        }
        fixture.cleanup().await;
    }

    /// Redis lost its keys (flushed) while two calls were admitted. One
    /// call's settle and the other's release reach the empty view before
    /// the seed that follows, and that seed's log tail holds both request
    /// events but neither call event (a settle writes the view before it
    /// publishes). The seed holds neither reservation again: without the
    /// tombstones both counted until their leases ended, so the view read
    /// three calls where one was made and refused the second under a limit
    /// of two.
    #[tokio::test]
    async fn a_hold_released_after_a_flush_is_not_held_again_by_the_seed() {
        let Some(fixture) = Fresh::new().await else { return };
        let view = &fixture.view;
        let at = Utc::now();
        let c = project_counter(at);
        let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 2)], at);
        let p = seeded(view, &[]).await;
        let (settled, freed) = (hold(at + Duration::seconds(30)), hold(at + Duration::seconds(30)));
        assert!(check(view, &p, &pl, &settled, at).await.admitted);
        assert!(check(view, &p, &pl, &freed, at).await.admitted);
        assert!(view.forget_all().await.expect("flush the view") > 0);
        let call = Settlement {
            event: event(),
            reservation: Some(settled.reservation.clone()),
            deltas: vec![(c.clone(), calls(1, 0))],
        };
        view.settle(&p, &[call], at).await.expect("settle");
        view.release(&p, &freed.reservation, at).await.expect("release");
        let tail = |h: &Hold| meter::SeedHold {
            reservation: h.reservation.clone(),
            lease_until: h.lease_until,
            counters: vec![c.clone()],
            estimate: Default::default(),
        };
        view.seed(&p, &Seed { holds: vec![tail(&settled), tail(&freed)], ..Seed::default() }, at).await.expect("seed");
        let u = usage(view, &p, &c, at).await;
        assert_eq!((u.pending.calls, u.reserved_calls), (1, 0), "the settled call counts once, the freed one not");
        assert!(check(view, &p, &pl, &hold(at + Duration::seconds(30)), at).await.admitted, "one of two used");
        // Seeded: the release of a hold it does not have writes nothing.
        let holds = view.dump(&p).await.expect("dump").holds.len();
        view.release(&p, &hold(at + Duration::seconds(30)).reservation, at).await.expect("release");
        assert_eq!(view.dump(&p).await.expect("dump").holds.len(), holds, "no key per unreserved call");
        fixture.cleanup().await;
    }

    /// The functions' library is Redis's, not ours: a server that lost it
    /// (its functions flushed, a restart with nothing) gets it again from the
    /// next call, which answers as if nothing happened; a server restarted
    /// from a snapshot has it back with the data, and must still read the
    /// restored `loaded` marker as another server's (the `run_id` the
    /// library keeps is read afresh in the new process).
    #[tokio::test]
    async fn a_server_that_lost_the_functions_gets_them_again() {
        if !testkit::available(&[testkit::Service::Redis]) {
            return;
        }
        let mut server = testkit::RedisServer::start().await;
        let view = RedisView::connect(&server.url(), "tg:").await.expect("connect to our own redis");
        let client = ::redis::Client::open(server.url()).expect("redis url");
        let at = Utc::now();
        let c = project_counter(at);
        let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 3)], at);
        let lease = at + Duration::seconds(30);
        let p = seeded(&view, &[(c.clone(), calls(1, 0))]).await;
        assert_eq!(check(&view, &p, &pl, &hold(lease), at).await.used, vec![1]);

        let mut conn = client.get_multiplexed_async_connection().await.expect("redis connection");
        let _: () = ::redis::cmd("FUNCTION").arg("FLUSH").query_async(&mut conn).await.expect("FUNCTION FLUSH");
        let libraries: Vec<::redis::Value> =
            ::redis::cmd("FUNCTION").arg("LIST").query_async(&mut conn).await.expect("FUNCTION LIST");
        assert!(libraries.is_empty(), "flushed: {libraries:?}");
        // The first reservation is still held: this one is the third call.
        let o = check(&view, &p, &pl, &hold(lease), at).await;
        assert_eq!((o.admitted, o.used), (true, vec![2]), "answered after loading the library again");
        let libraries: Vec<::redis::Value> =
            ::redis::cmd("FUNCTION").arg("LIST").query_async(&mut conn).await.expect("FUNCTION LIST");
        assert_eq!(libraries.len(), 1, "the library is back");

        server.restart_empty().await;
        // The first call after a restart may meet the dropped connection
        // (transient: the connection is made again behind it).
        let after = async |view: &RedisView, p: &ProjectId| {
            for _ in 0..20 {
                match view.check(p, &pl, &hold(lease), at).await {
                    Err(e) if e.is_transient() => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
                    r => return r.expect("check after a restart"),
                }
            }
            panic!("redis did not come back");
        };
        assert_eq!(after(&view, &p).await, None);
        let p = seeded(&view, &[(c.clone(), calls(1, 0))]).await;
        assert_eq!(check(&view, &p, &pl, &hold(lease), at).await.used, vec![1]);

        server.save().await;
        server.restart_from_snapshot().await;
        assert_eq!(after(&view, &p).await, None, "the restored marker holds the old server's run_id");
        assert_eq!(view.usage(&p, &c.key, at).await.expect("usage after a restore"), None);
    }

    #[tokio::test]
    async fn an_unreachable_redis_is_transient() {
        let err = RedisView::connect("redis://127.0.0.1:1", "tg:").await.expect_err("nothing listens on port 1");
        assert!(err.is_transient(), "{err}");
    }
}

// ---------------------------------------------------------------- Redis Cluster

/// A view on the test Redis Cluster (three masters) with a prefix of its
/// own: every suite, and exact admission under concurrent checks, holds
/// there as on one server, each project's keys living on the master of its
/// hash tag's slot.
struct OnCluster {
    view: RedisView,
    _keys: testkit::RedisPrefix,
}

impl OnCluster {
    async fn new() -> Option<OnCluster> {
        if !testkit::available(&[testkit::Service::RedisCluster]) {
            return None;
        }
        let keys = testkit::RedisPrefix::on_cluster("tgtest");
        let view = RedisView::connect(&keys.url, &keys.prefix).await.expect("connect to the test Redis Cluster");
        assert!(view.is_cluster(), "{} names a cluster", keys.url);
        Some(OnCluster { view, _keys: keys })
    }

    async fn cleanup(self) {}
}

/// How many keys under the prefix each node of the cluster URL holds.
async fn keys_per_node(keys: &testkit::RedisPrefix) -> Vec<usize> {
    let nodes = keys.url.strip_prefix("redis+cluster://").expect("a cluster url");
    let mut out = Vec::new();
    for node in nodes.split(',') {
        let client = ::redis::Client::open(format!("redis://{}", node.trim())).expect("node url");
        let mut conn = client.get_multiplexed_async_connection().await.expect("node connection");
        let mut cursor = 0u64;
        let mut n = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = ::redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", keys.prefix))
                .query_async(&mut conn)
                .await
                .expect("scan");
            n += batch.len();
            if next == 0 {
                break;
            }
            cursor = next;
        }
        out.push(n);
    }
    out
}

mod redis_cluster {
    use super::*;

    conformance!(OnCluster::new());

    /// Projects spread over the masters; `forget_all` finds every key on
    /// every master, and a dump reads the marker of the project's own master.
    #[tokio::test]
    async fn projects_spread_over_the_masters_and_forget_all_reaches_each() {
        let Some(fixture) = OnCluster::new().await else { return };
        let view = &fixture.view;
        let at = Utc::now();
        let mut projects = Vec::new();
        for _ in 0..12 {
            let p = seeded(view, &[]).await;
            assert!(view.dump(&p).await.expect("dump").loaded, "a seeded project reads as loaded");
            projects.push(p);
        }
        for p in &projects {
            let c = project_counter(at);
            assert_eq!(usage(view, p, &c, at).await.durable, Totals::default());
        }
        let before = keys_per_node(&fixture._keys).await;
        assert!(before.iter().filter(|n| **n > 0).count() >= 2, "the projects' keys on one master only: {before:?}");
        let deleted = view.forget_all().await.expect("forget_all");
        assert!(deleted >= 12, "one marker per project at least, deleted {deleted}");
        assert_eq!(keys_per_node(&fixture._keys).await.iter().sum::<usize>(), 0, "a key left on some master");
        for p in &projects {
            assert!(!view.dump(p).await.expect("dump").loaded, "forgotten everywhere");
        }
        fixture.cleanup().await;
    }
}

// ---------------------------------------------------------------- memory

/// A fresh in-memory view.
struct Memory {
    view: MemoryView,
}

impl Memory {
    async fn new() -> Option<Memory> {
        Some(Memory { view: MemoryView::new() })
    }

    async fn cleanup(self) {}
}

mod memory {
    use super::*;

    conformance!(Memory::new());

    /// A fixed instant far from the wall clock: the memory view's time is
    /// only what it is given.
    fn t0() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2030-01-01T00:00:00Z").expect("timestamp").with_timezone(&Utc)
    }

    /// A counter that never resets.
    fn lifetime() -> Counter {
        let w = window_at(WindowKind::Current, Tz::UTC, t0());
        Counter {
            key: CounterKey { dimension: Dimension::Project, window: w.kind, window_key: w.key },
            resets_at: w.resets_at,
        }
    }

    #[tokio::test]
    async fn an_event_index_is_forgotten_after_seven_days() {
        let view = MemoryView::new();
        let c = lifetime();
        let p = seeded(&view, &[]).await;
        let s = Settlement { event: event(), reservation: None, deltas: vec![(c.clone(), calls(1, 2))] };
        view.settle(&p, std::slice::from_ref(&s), t0()).await.expect("settle");
        let almost = t0() + Duration::days(7) - Duration::milliseconds(1);
        view.settle(&p, std::slice::from_ref(&s), almost).await.expect("settle within the TTL");
        assert_eq!(usage(&view, &p, &c, almost).await.pending, calls(1, 2));
        let after = t0() + Duration::days(7);
        view.settle(&p, std::slice::from_ref(&s), after).await.expect("settle after the TTL");
        assert_eq!(usage(&view, &p, &c, after).await.pending, calls(2, 4), "the index outlived its TTL");
    }

    #[tokio::test]
    async fn a_counter_expires_exactly_an_hour_after_its_reset() {
        let view = MemoryView::new();
        let c = counter(Dimension::Project, t0());
        let resets = c.resets_at.expect("a day resets");
        let p = seeded(&view, &[(c.clone(), Totals { requests: 1, calls: 1, rows: 1, ..Totals::default() })]).await;
        let last = resets + Duration::hours(1) - Duration::milliseconds(1);
        assert_eq!(usage(&view, &p, &c, last).await.durable.calls, 1);
        let gone = resets + Duration::hours(1);
        assert_eq!(usage(&view, &p, &c, gone).await, meter::CounterUsage::default());
        // The view's time does not run backwards: the counter stays gone.
        assert_eq!(usage(&view, &p, &c, last).await, meter::CounterUsage::default());
    }

    #[tokio::test]
    async fn expired_records_are_swept_from_memory() {
        let view = MemoryView::new();
        let at = t0();
        let c = counter(Dimension::Project, at);
        let p = seeded(&view, &[(c.clone(), Totals::default())]).await;
        let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Requests, 1000), (0, Metric::Calls, 1000)], at);
        for _ in 0..100 {
            let h = hold(at + Duration::seconds(30));
            assert!(check(&view, &p, &pl, &h, at).await.admitted);
            let s =
                Settlement { event: event(), reservation: Some(h.reservation), deltas: vec![(c.clone(), calls(1, 1))] };
            view.settle(&p, &[s], at).await.expect("settle");
        }
        // Leases taken and never settled or released.
        for _ in 0..20 {
            assert!(check(&view, &p, &pl, &hold(at + Duration::seconds(30)), at).await.admitted);
        }
        assert!(view.records() > 200, "{} records", view.records());
        // Eight days on (past every grace and TTL), any call on a project
        // of the same shard sweeps it; the seeded project keeps only its
        // loaded marker.
        view.usage(&p, &c.key, at + Duration::days(8)).await.expect("usage");
        assert_eq!(view.records(), 1);
        assert_eq!(usage(&view, &p, &c, at + Duration::days(8)).await, meter::CounterUsage::default());
    }

    #[tokio::test]
    async fn clones_share_one_view() {
        let view = MemoryView::new();
        let other = view.clone();
        let at = Utc::now();
        let c = project_counter(at);
        let p = seeded(&view, &[]).await;
        let pl = plan(std::slice::from_ref(&c), &[(0, Metric::Calls, 1)], at);
        assert!(check(&other, &p, &pl, &hold(at + Duration::seconds(30)), at).await.admitted);
        assert!(!check(&view, &p, &pl, &hold(at + Duration::seconds(30)), at).await.admitted);
    }
}
