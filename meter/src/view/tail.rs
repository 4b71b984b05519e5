//! # A seed from the log: durable totals plus the tail
//!
//! The view is a cache of the log (DESIGN §10). When it is lost — Redis
//! flushed, restarted empty, restored from an older snapshot — what it held
//! is rebuilt from two reads: the durable totals with the log offsets they
//! stand at (one consistent read of the store), and the log's records past
//! those offsets (the *tail*: what the projector has not folded yet). This
//! module turns the tail into the view's state, as a [`Seed`]:
//!
//! - every fact of the tail becomes a pending delta under its event id,
//!   exactly the deltas a settle of it writes (the counters a check can
//!   read, of windows still open at the seed), so the projector's fold of
//!   it later drops exactly that;
//! - every admitted request event still within its lease whose reservation
//!   no call event settles becomes a live reservation on the counters its
//!   check held.
//!
//! A reservation outlives the fold of its request event (the projector
//! folds it at once; the call settles it up to a lease later), so the seed
//! also reads the *recent* records before those offsets — those received
//! within a lease of the seed — for reservations only: their request events
//! and the call events that settled them. A fact twice on the tail counts
//! once (the first; the fold dedups by id too), and not at all if it is
//! among the recent folded records.
//!
//! What it cannot know: a reservation whose settling call was folded
//! *before* the recent records begin while its request event is later (the
//! request event is published in the background, so it can land after the
//! call) is held again until its lease ends — an over-count, never an
//! under-count, bounded by the lease.

use std::collections::{BTreeSet, HashSet};

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use crate::admission::Watched;
use crate::ids::ReservationId;
use crate::price::PriceBook;
use crate::usage::{EventKind, UsageFact, counters_for};
use crate::view::{Seed, SeedHold, Settlement};

/// What a seed at `at` writes: `totals` (the durable totals as of the
/// tail's start), the `tail`'s unfolded facts, and the live reservations of
/// the `recent` folded records and the tail. `tz` is the project's time
/// zone, `book` the price book a settle prices with, `watched` the counters
/// its quotas read.
pub fn seed_from_tail(
    totals: Vec<(crate::usage::Counter, crate::usage::Totals)>,
    recent: &[UsageFact],
    tail: &[UsageFact],
    tz: Tz,
    book: &PriceBook,
    watched: &Watched,
    at: DateTime<Utc>,
) -> Seed {
    let all = || recent.iter().chain(tail);
    let settled: BTreeSet<&ReservationId> =
        all().filter(|f| f.kind != EventKind::Request).filter_map(|f| f.reservation_id.as_ref()).collect();
    let mut seen: HashSet<&crate::ids::EventId> = recent.iter().map(|f| &f.id).collect();
    let mut pending = Vec::new();
    for f in tail {
        if !seen.insert(&f.id) {
            continue;
        }
        let deltas: Vec<_> = counters_for(f, tz, book)
            .into_iter()
            .filter(|(c, _)| c.resets_at.is_none_or(|r| r > at) && watched.covers(&c.key))
            .collect();
        if !deltas.is_empty() {
            pending.push(Settlement { event: f.id.clone(), reservation: None, deltas });
        }
    }
    let mut held = BTreeSet::new();
    let mut holds = Vec::new();
    for f in all() {
        if f.kind == EventKind::Request
            && f.admitted == Some(true)
            && let (Some(rid), Some(lease_until)) = (&f.reservation_id, f.lease_until)
            && lease_until > at
            && !settled.contains(rid)
            && !f.held.is_empty()
            && held.insert(rid)
        {
            holds.push(SeedHold {
                reservation: rid.clone(),
                lease_until,
                counters: f.held.clone(),
                estimate: f.estimate,
            });
        }
    }
    Seed { totals, pending, holds }
}

#[cfg(test)]
mod tests {
    use chrono::Duration;

    use super::*;
    use crate::Caller;
    use crate::admission::{CheckInput, plan_check};
    use crate::ids::{ApiKeyId, EventId, ProjectId, QuotaId};
    use crate::quota::{Metric, Mode, Quota, QuotaSpec, Scope};
    use crate::usage::{Counter, Outcome, Totals};
    use crate::view::{Hold, ViewModel};
    use crate::window::WindowKind;

    fn t0() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2030-01-01T12:00:00Z").expect("timestamp").with_timezone(&Utc)
    }

    fn project() -> ProjectId {
        ProjectId::parse("p1").expect("id")
    }

    fn key() -> ApiKeyId {
        ApiKeyId::parse("k1").expect("id")
    }

    /// A calls quota of `limit` a day on the project.
    fn quotas(limit: u64) -> Vec<Quota> {
        vec![Quota {
            id: QuotaId::parse("q1").expect("id"),
            spec: QuotaSpec {
                project_id: project(),
                scope: Scope::Project,
                scope_ref: None,
                metric: Metric::Calls,
                window: WindowKind::Day,
                limit,
                mode: Mode::Enforce,
                meter_type: None,
                on_unpriced: None,
            },
            created_at: t0(),
            updated_at: t0(),
        }]
    }

    fn request(n: u32, admitted: bool, held: Vec<Counter>, lease: Duration) -> UsageFact {
        UsageFact {
            api_key_id: Some(key()),
            reservation_id: Some(ReservationId::parse(format!("r{n}")).expect("id")),
            admitted: Some(admitted),
            lease_until: Some(t0() + lease),
            held,
            ..UsageFact::new(EventId::parse(format!("q{n}")).expect("id"), project(), EventKind::Request, t0())
        }
    }

    fn call(n: u32, settles: Option<u32>) -> UsageFact {
        UsageFact {
            api_key_id: Some(key()),
            reservation_id: settles.map(|r| ReservationId::parse(format!("r{r}")).expect("id")),
            outcome: Outcome::Success,
            rows: 3,
            ..UsageFact::new(EventId::parse(format!("c{n}")).expect("id"), project(), EventKind::Call, t0())
        }
    }

    fn day_counter() -> Counter {
        let plan = plan_check(
            &quotas(1),
            Tz::UTC,
            &CheckInput { caller: Caller { api_key: Some(key()), ..Caller::default() }, ..Default::default() },
            t0(),
        );
        plan.counters[plan.reserved_counters()[0]].clone()
    }

    #[test]
    fn the_tail_becomes_pending_deltas_and_live_reservations() {
        let c = day_counter();
        let tail = vec![
            request(1, true, vec![c.clone()], Duration::seconds(30)), // settled by c1 below
            request(2, true, vec![c.clone()], Duration::seconds(30)), // live
            request(3, true, vec![c.clone()], Duration::seconds(-1)), // lease over
            request(4, false, vec![], Duration::seconds(30)),         // refused
            call(1, Some(1)),
            call(1, Some(1)), // the same event again
            call(2, None),
        ];
        let q = quotas(10);
        let seed = seed_from_tail(Vec::new(), &[], &tail, Tz::UTC, &PriceBook::default(), &Watched::of(&q), t0());
        let events: Vec<&str> = seed.pending.iter().map(|s| s.event.as_str()).collect();
        // Each fact once, as a settle would write it (a request counts on
        // the watched counters too).
        assert_eq!(events, ["q1", "q2", "q3", "q4", "c1", "c2"]);
        assert!(seed.pending.iter().all(|s| s.reservation.is_none()));
        let d = &seed.pending[4].deltas;
        assert!(d.contains(&(c.clone(), Totals { calls: 1, rows: 3, ..Totals::default() })), "{d:?}");
        let held: Vec<&str> = seed.holds.iter().map(|h| h.reservation.as_str()).collect();
        assert_eq!(held, ["r2"]);
    }

    /// A reservation outlives the fold of its request event: the recent
    /// folded records restore it, unless a call (folded or not) settled it;
    /// a recent fact adds no pending delta (the totals hold it), nor does
    /// its copy on the tail.
    #[test]
    fn recent_folded_records_restore_reservations_only() {
        let c = day_counter();
        let recent = vec![
            request(1, true, vec![c.clone()], Duration::seconds(30)),
            request(2, true, vec![c.clone()], Duration::seconds(30)),
            request(3, true, vec![c.clone()], Duration::seconds(30)),
            call(1, Some(1)),
        ];
        let tail = vec![call(2, Some(2)), call(1, Some(1))];
        let q = quotas(10);
        let seed = seed_from_tail(Vec::new(), &recent, &tail, Tz::UTC, &PriceBook::default(), &Watched::of(&q), t0());
        let held: Vec<&str> = seed.holds.iter().map(|h| h.reservation.as_str()).collect();
        assert_eq!(held, ["r3"]);
        let events: Vec<&str> = seed.pending.iter().map(|s| s.event.as_str()).collect();
        assert_eq!(events, ["c2"], "c1 is folded already");
    }

    #[test]
    fn closed_windows_and_unwatched_counters_are_left_out() {
        let q = quotas(10);
        let mut old = call(1, None);
        old.occurred_at = t0() - Duration::days(2);
        let seed = seed_from_tail(Vec::new(), &[], &[old], Tz::UTC, &PriceBook::default(), &Watched::of(&q), t0());
        assert!(seed.pending.is_empty());
        let keyless = UsageFact { api_key_id: None, ..call(2, None) };
        let seed = seed_from_tail(Vec::new(), &[], &[keyless], Tz::UTC, &PriceBook::default(), &Watched::of(&[]), t0());
        assert!(seed.pending.is_empty(), "no quota reads any counter");
    }

    /// The reproduction in the model: a calls quota of 60, 30 calls
    /// settled (10 folded, 20 only on the log), 20 checks holding
    /// reservations, the view lost; after a seed from the totals and the
    /// tail exactly 10 more are admitted, and a fold of the tail after the
    /// seed (or before it: tombstones) counts nothing twice.
    #[test]
    fn a_seed_from_the_tail_admits_exactly_to_the_limit() {
        let q = quotas(60);
        let c = day_counter();
        let mut tail = Vec::new();
        for n in 10..30 {
            tail.push(call(n, None));
        }
        for n in 0..20 {
            tail.push(request(100 + n, true, vec![c.clone()], Duration::seconds(60)));
        }
        let folded = vec![(c.clone(), Totals { calls: 10, rows: 30, ..Totals::default() })];
        for fold_first in [false, true] {
            let mut v = ViewModel::new();
            let p = project();
            let seed =
                seed_from_tail(folded.clone(), &[], &tail, Tz::UTC, &PriceBook::default(), &Watched::of(&q), t0());
            let tail_events: Vec<EventId> = tail.iter().map(|f| f.id.clone()).collect();
            let all = vec![(c.clone(), Totals { calls: 30, rows: 90, ..Totals::default() })];
            if fold_first {
                // The projector folded the tail while the seeder read it.
                v.apply_fold(&p, &all, &tail_events, t0());
            }
            v.seed(&p, &seed, t0());
            if !fold_first {
                v.apply_fold(&p, &all, &tail_events, t0());
            }
            let u = v.usage(&p, &c.key, t0()).expect("seeded");
            assert_eq!((u.durable.calls + u.pending.calls, u.reserved_calls), (30, 20), "fold first: {fold_first}");
            let plan = plan_check(
                &q,
                Tz::UTC,
                &CheckInput { caller: Caller { api_key: Some(key()), ..Caller::default() }, ..Default::default() },
                t0(),
            );
            let mut admitted = 0;
            for n in 0..64 {
                let hold = Hold {
                    reservation: ReservationId::parse(format!("n{n}")).expect("id"),
                    request_event: EventId::parse(format!("nq{n}")).expect("id"),
                    lease_until: t0() + Duration::seconds(60),
                };
                if v.check(&p, &plan, &hold, t0()).expect("valid").expect("seeded").admitted {
                    admitted += 1;
                }
            }
            assert_eq!(admitted, 10, "fold first: {fold_first}");
        }
    }
}
