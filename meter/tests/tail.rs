//! The law of a reseed (DESIGN §10): a view rebuilt from the durable totals
//! at any point of the log plus the log's tail past it (and, for the
//! reservations, the recent records before it) holds what the live
//! view held — the same calls and rows on every counter a quota reads, and
//! the same live reservations — so admission after a view loss is what it
//! would have been without one. Run on the reference model
//! ([`meter::ViewModel`]), which `MemoryView` runs and the Redis scripts are
//! checked against.

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;

use meter::usage::counters_for;
use meter::{
    ApiKeyId, Caller, CheckInput, EventId, EventKind, Fold, Hold, Metric, Mode, Outcome, PriceBook, ProjectId, Quota,
    QuotaId, QuotaSpec, ReservationId, Scope, Settlement, UsageFact, ViewModel, Watched, WindowKind, plan_check,
    seed_from_tail,
};

fn t0() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2030-05-05T10:00:00Z").expect("timestamp").with_timezone(&Utc)
}

fn project() -> ProjectId {
    ProjectId::parse("p1").expect("id")
}

fn quota(n: usize, scope: Scope, metric: Metric, window: WindowKind, limit: u64) -> Quota {
    Quota {
        id: QuotaId::parse(format!("q{n}")).expect("id"),
        spec: QuotaSpec {
            project_id: project(),
            scope,
            scope_ref: None,
            metric,
            window,
            limit,
            mode: Mode::Enforce,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: t0(),
        updated_at: t0(),
    }
}

fn quotas() -> Vec<Quota> {
    vec![
        quota(0, Scope::Project, Metric::Calls, WindowKind::Day, 12),
        quota(1, Scope::ApiKey, Metric::Calls, WindowKind::Rolling1m, 6),
        quota(2, Scope::Project, Metric::Rows, WindowKind::Day, 200),
        quota(3, Scope::Project, Metric::Requests, WindowKind::Rolling1m, 40),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    /// A check by key 0 or 1, its lease in seconds (some already over at the seed).
    Check { key: usize, lease_s: i64 },
    /// Settles the n-th open reservation (or a call without one), with rows.
    Settle { pick: Option<prop::sample::Index>, rows: u64, success: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, prop_oneof![4 => 5i64..120, 1 => Just(-1i64)]).prop_map(|(key, lease_s)| Op::Check { key, lease_s }),
        2 => (prop::option::weighted(0.8, any::<prop::sample::Index>()), 0..20u64, prop::bool::weighted(0.85))
            .prop_map(|(pick, rows, success)| Op::Settle { pick, rows, success }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Live view vs a view seeded from a fold of the first `k` records plus
    /// the tail: the same calls, rows and live reservations everywhere a
    /// quota reads, and the same next admissions.
    #[test]
    fn a_seed_from_totals_and_tail_holds_what_the_live_view_held(
        ops in prop::collection::vec(op(), 1..40),
        cut in any::<prop::sample::Index>(),
    ) {
        let (tz, book, q) = (Tz::UTC, PriceBook::default(), quotas());
        let watched = Watched::of(&q);
        let p = project();
        let at = t0();
        let mut live = ViewModel::new();
        live.seed(&p, &meter::Seed::default(), at);
        let mut log: Vec<UsageFact> = Vec::new();
        let mut open: Vec<ReservationId> = Vec::new();
        let key = |k: usize| ApiKeyId::parse(format!("k{k}")).expect("id");
        for (i, op) in ops.iter().enumerate() {
            match op {
                Op::Check { key: k, lease_s } => {
                    let caller = Caller { api_key: Some(key(*k)), ..Caller::default() };
                    let plan = plan_check(&q, tz, &CheckInput { caller, storage_delta: None, ..Default::default() }, at);
                    let hold = Hold {
                        reservation: ReservationId::parse(format!("r{i}")).expect("id"),
                        request_event: EventId::parse(format!("q{i}")).expect("id"),
                        lease_until: at + Duration::seconds(*lease_s),
                    };
                    let o = live.check(&p, &plan, &hold, at).expect("valid").expect("seeded");
                    if o.admitted {
                        open.push(hold.reservation.clone());
                    }
                    log.push(UsageFact {
                        api_key_id: Some(key(*k)),
                        reservation_id: Some(hold.reservation.clone()),
                        admitted: Some(o.admitted),
                        lease_until: o.admitted.then_some(hold.lease_until),
                        held: if o.admitted {
                            plan.reserved_counters().into_iter().map(|c| plan.counters[c].clone()).collect()
                        } else {
                            Vec::new()
                        },
                        ..UsageFact::new(hold.request_event.clone(), p.clone(), EventKind::Request, at)
                    });
                }
                Op::Settle { pick, rows, success } => {
                    let rid = pick.as_ref().filter(|_| !open.is_empty()).map(|ix| open.remove(ix.index(open.len())));
                    let fact = UsageFact {
                        api_key_id: Some(key(i % 2)),
                        reservation_id: rid.clone(),
                        outcome: if *success { Outcome::Success } else { Outcome::Failure },
                        rows: *rows,
                        ..UsageFact::new(EventId::parse(format!("c{i}")).expect("id"), p.clone(), EventKind::Call, at)
                    };
                    let deltas = counters_for(&fact, tz, &book)
                        .into_iter()
                        .filter(|(c, _)| c.resets_at.is_none_or(|r| r > at) && watched.covers(&c.key))
                        .collect();
                    live.settle(&p, &[Settlement { event: fact.id.clone(), reservation: rid, deltas }], at);
                    log.push(fact);
                }
            }
        }
        // The projector folded the first k records, and the live view learnt it.
        let k = cut.index(log.len() + 1);
        let mut fold = Fold::new();
        for f in &log[..k] {
            fold.apply(f, tz, &book);
        }
        let totals: Vec<_> = fold.totals().map(|(_, c, t)| (c, t)).collect();
        let folded: Vec<EventId> = log[..k].iter().map(|f| f.id.clone()).collect();
        live.apply_fold(&p, &totals, &folded, at);
        // The view is lost; a new one is seeded from the same point.
        let open_totals = totals.iter().filter(|(c, _)| c.resets_at.is_none_or(|r| r > at)).cloned().collect();
        let seed = seed_from_tail(open_totals, &log[..k], &log[k..], tz, &book, &watched, at);
        let mut seeded = ViewModel::new();
        seeded.seed(&p, &seed, at);

        let caller = Caller { api_key: Some(key(0)), ..Caller::default() };
        let plan = plan_check(&q, tz, &CheckInput { caller, storage_delta: None, ..Default::default() }, at);
        for c in &plan.counters {
            let a = live.usage(&p, &c.key, at).expect("seeded");
            let b = seeded.usage(&p, &c.key, at).expect("seeded");
            let calls_rows = |u: meter::CounterUsage| {
                (u.durable.calls + u.pending.calls, u.durable.rows + u.pending.rows, u.reserved_calls)
            };
            prop_assert_eq!(calls_rows(a), calls_rows(b), "counter {} with {} of {} folded", c.key.encode(), k, log.len());
        }
        // And the next checks decide alike.
        for n in 0..4 {
            let hold = Hold {
                reservation: ReservationId::parse(format!("n{n}")).expect("id"),
                request_event: EventId::parse(format!("nq{n}")).expect("id"),
                lease_until: at + Duration::seconds(30),
            };
            let a = live.check(&p, &plan, &hold, at).expect("valid").expect("seeded").admitted;
            let b = seeded.check(&p, &plan, &hold, at).expect("valid").expect("seeded").admitted;
            prop_assert_eq!(a, b, "check {} after the seed", n);
        }
    }
}
