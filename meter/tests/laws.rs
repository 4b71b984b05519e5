//! Laws of the pure core, checked with proptest (DESIGN §9, STYLE "laws"):
//!
//! - windows contain their instant and tile the timeline, in every flow
//!   window kind and in zones with DST, half-hour DST, midnight gaps and
//!   +05:30/+05:45/+12:45 offsets;
//! - the fold is order-insensitive, idempotent per event id, additive over
//!   disjoint batches, and equal to a naive reference model;
//! - admission, run against the reference model of the view
//!   (`meter::ViewModel`), which keeps the contract in `meter::admission`
//!   (checked at every step), never overshoots `calls` or `requests`, keeps the
//!   `rows` overshoot to the calls in flight, reserves nothing when it
//!   refuses, reports the most specific breaching scope, and never lets a
//!   monitor quota refuse.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::LazyLock;

use chrono::{DateTime, Duration, Offset, TimeZone, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use proptest::sample::select;

use meter::usage::counters_for;
use meter::{
    ApiKeyId, Caller, CheckInput, CheckOutcome, CounterKey, CounterUsage, Dimension, EventId, EventKind, Fold, Hold,
    Metric, Mode, Outcome, PriceBook, ProjectId, Quota, QuotaId, QuotaSpec, ReservationId, Scope, Settlement, Totals,
    UsageFact, ViewModel, WindowKind, decide, plan_check, window_at,
};

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

// ───────────────────────────── windows ─────────────────────────────

const ZONES: [Tz; 9] = [
    Tz::UTC,
    chrono_tz::America::New_York,
    chrono_tz::Europe::London,
    chrono_tz::Australia::Lord_Howe,
    chrono_tz::America::Santiago,
    chrono_tz::Asia::Kolkata,
    chrono_tz::Asia::Kathmandu,
    chrono_tz::Pacific::Chatham,
    // Clocks jump at midnight both ways: a day starting at 01:00, and a
    // midnight that happens twice.
    chrono_tz::America::Havana,
];

const YEAR_2000: i64 = 946_684_800; // 2000-01-01T00:00:00Z
const YEAR_2041: i64 = 2_240_524_800; // 2041-01-01T00:00:00Z

fn offset_at(tz: Tz, t: i64) -> i32 {
    let at = DateTime::<Utc>::from_timestamp(t, 0).expect("in range");
    tz.offset_from_utc_datetime(&at.naive_utc()).fix().local_minus_utc()
}

/// Every UTC-offset change of every zone in 2000–2040, to the second: a
/// daily scan (changes are months apart) refined by bisection.
static TRANSITIONS: LazyLock<Vec<(Tz, i64)>> = LazyLock::new(|| {
    let mut out = Vec::new();
    for tz in ZONES {
        let mut t = YEAR_2000;
        while t < YEAR_2041 {
            let next = t + 86_400;
            if offset_at(tz, t) != offset_at(tz, next) {
                let (mut lo, mut hi) = (t, next);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if offset_at(tz, mid) == offset_at(tz, lo) {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                out.push((tz, hi));
            }
            t = next;
        }
    }
    out
});

fn instant(secs: i64, nanos: u32) -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp(secs, nanos).expect("in range")
}

/// The window laws for one instant in one zone, every flow kind.
fn check_window_laws(tz: Tz, at: DateTime<Utc>) -> Result<(), TestCaseError> {
    let ns = Duration::nanoseconds(1);
    for kind in WindowKind::FLOW {
        let w = window_at(kind, tz, at);
        let ctx = format!("{kind} in {tz} at {at}: {w:?}");
        prop_assert_eq!(w.kind, kind, "{}", ctx);
        let resets = w.resets_at.ok_or_else(|| TestCaseError::fail(format!("no reset: {ctx}")))?;
        prop_assert!(w.start <= at && at < resets, "containment: {}", ctx);

        // The same window from its first and its last instant.
        prop_assert_eq!(&window_at(kind, tz, w.start), &w, "from start: {}", ctx);
        prop_assert_eq!(&window_at(kind, tz, resets - ns), &w, "from last ns: {}", ctx);
        prop_assert_eq!(&window_at(kind, tz, resets - Duration::seconds(1)).key, &w.key, "last s: {}", ctx);

        // The next window starts where this one resets, with a later key.
        let next = window_at(kind, tz, resets);
        prop_assert_ne!(&next.key, &w.key, "next key: {}", ctx);
        prop_assert!(next.key > w.key, "keys sort by time: {} then {}", w.key, next.key);
        prop_assert_eq!(next.start, resets, "tiling forward: {}", ctx);
        // And the previous one resets where this one starts.
        let prev = window_at(kind, tz, w.start - ns);
        prop_assert_eq!(prev.resets_at, Some(w.start), "tiling backward: {}", ctx);
        prop_assert!(prev.key < w.key, "previous key: {}", ctx);

        // Lengths and key shapes.
        let len = resets - w.start;
        let local = at.with_timezone(&tz);
        match kind {
            WindowKind::Rolling1m => prop_assert_eq!(len, Duration::minutes(1)),
            WindowKind::Rolling1h => prop_assert_eq!(len, Duration::hours(1)),
            WindowKind::Rolling24h => prop_assert_eq!(len, Duration::days(1)),
            WindowKind::Day => {
                prop_assert!(len >= Duration::hours(23) && len <= Duration::hours(25), "day length: {}", ctx);
                prop_assert_eq!(&w.key, &local.format("%Y-%m-%d").to_string());
            }
            WindowKind::CalendarMonth => {
                prop_assert!(
                    len >= Duration::days(28) - Duration::hours(1) && len <= Duration::days(31) + Duration::hours(1),
                    "month length: {}",
                    ctx
                );
                prop_assert_eq!(&w.key, &local.format("%Y-%m").to_string());
            }
            WindowKind::Current => unreachable!("not a flow window"),
        }
        if matches!(kind, WindowKind::Rolling1m | WindowKind::Rolling1h | WindowKind::Rolling24h) {
            // Rolling windows ignore the zone.
            prop_assert_eq!(&window_at(kind, Tz::UTC, at), &w, "rolling is zone-free: {}", ctx);
        }
        prop_assert!(w.retry_after_secs(at).expect("resets") >= 1);
    }
    Ok(())
}

proptest! {
    #[test]
    fn windows_contain_their_instant_and_tile(
        secs in YEAR_2000..YEAR_2041,
        nanos in 0u32..1_000_000_000,
    ) {
        let at = instant(secs, nanos);
        for tz in ZONES {
            check_window_laws(tz, at)?;
        }
    }

    #[test]
    fn windows_tile_around_every_offset_change(
        which in any::<prop::sample::Index>(),
        delta in -3 * 86_400i64..3 * 86_400,
        nanos in prop_oneof![Just(0u32), 0u32..1_000_000_000],
    ) {
        let (tz, t) = *which.get(TRANSITIONS.as_slice());
        check_window_laws(tz, instant(t + delta, nanos))?;
    }

    #[test]
    fn two_instants_share_a_key_exactly_when_they_share_a_window(
        tz in select(ZONES.to_vec()),
        a in YEAR_2000..YEAR_2041,
        gap in prop_oneof![0i64..120, 0i64..100_000, 0i64..5_000_000],
    ) {
        let (x, y) = (instant(a, 0), instant(a + gap, 0));
        for kind in WindowKind::FLOW {
            let (wx, wy) = (window_at(kind, tz, x), window_at(kind, tz, y));
            let same_window = y < wx.resets_at.expect("flow window resets");
            prop_assert_eq!(wx.key == wy.key, same_window, "{} {} {} {}", kind, tz, x, y);
        }
    }
}

#[test]
fn the_transition_table_is_what_the_zones_say() {
    let count = |zone: Tz| TRANSITIONS.iter().filter(|(tz, _)| *tz == zone).count();
    assert_eq!(count(Tz::UTC), 0);
    assert_eq!(count(chrono_tz::Asia::Kathmandu), 0, "Nepal has no DST since 1986");
    assert_eq!(count(chrono_tz::Asia::Kolkata), 0);
    // Two changes a year for 41 years.
    for tz in [chrono_tz::America::New_York, chrono_tz::Europe::London, chrono_tz::Australia::Lord_Howe] {
        assert_eq!(count(tz), 82, "{tz}");
    }
    assert!(count(chrono_tz::America::Santiago) > 60);
    assert!(count(chrono_tz::Pacific::Chatham) > 60);
}

fn day(tz: Tz, at: &str) -> (String, DateTime<Utc>, DateTime<Utc>) {
    let w = window_at(WindowKind::Day, tz, utc(at));
    (w.key, w.start, w.resets_at.expect("day resets"))
}

fn month(tz: Tz, at: &str) -> (String, DateTime<Utc>, DateTime<Utc>) {
    let w = window_at(WindowKind::CalendarMonth, tz, utc(at));
    (w.key, w.start, w.resets_at.expect("month resets"))
}

#[test]
fn new_york_spring_forward_2026_03_08() {
    let ny = chrono_tz::America::New_York;
    // 01:59:59 EST and 03:00 EDT are the same local day, which lasts 23 hours.
    let (key, start, resets) = day(ny, "2026-03-08T06:59:59Z");
    assert_eq!(key, "2026-03-08");
    assert_eq!(start, utc("2026-03-08T05:00:00Z"));
    assert_eq!(resets, utc("2026-03-09T04:00:00Z"));
    assert_eq!(day(ny, "2026-03-08T07:00:00Z").0, "2026-03-08");
    assert_eq!(day(ny, "2026-03-09T03:59:59Z").0, "2026-03-08");
    assert_eq!(day(ny, "2026-03-09T04:00:00Z").0, "2026-03-09");
    // The day before is a plain 24 hours of EST, the day after of EDT.
    assert_eq!(day(ny, "2026-03-07T12:00:00Z").1, utc("2026-03-07T05:00:00Z"));
    assert_eq!(day(ny, "2026-03-09T12:00:00Z").2, utc("2026-03-10T04:00:00Z"));

    let (key, start, resets) = month(ny, "2026-03-08T07:00:00Z");
    assert_eq!(key, "2026-03");
    assert_eq!(start, utc("2026-03-01T05:00:00Z"));
    assert_eq!(resets, utc("2026-04-01T04:00:00Z"));
    assert_eq!(month(ny, "2026-03-01T04:59:59Z").0, "2026-02");
    assert_eq!(month(ny, "2026-04-01T03:59:59Z").0, "2026-03");
}

#[test]
fn new_york_fall_back_2026_11_01() {
    let ny = chrono_tz::America::New_York;
    // 01:30 EDT and 01:30 EST are both on 1 November, a 25-hour day.
    let first = day(ny, "2026-11-01T05:30:00Z");
    let second = day(ny, "2026-11-01T06:30:00Z");
    assert_eq!(first, second);
    assert_eq!(first.0, "2026-11-01");
    assert_eq!(first.1, utc("2026-11-01T04:00:00Z"));
    assert_eq!(first.2, utc("2026-11-02T05:00:00Z"));
    assert_eq!(day(ny, "2026-11-02T04:59:59Z").0, "2026-11-01");
    assert_eq!(day(ny, "2026-11-02T05:00:00Z").0, "2026-11-02");

    let (key, start, resets) = month(ny, "2026-11-01T06:30:00Z");
    assert_eq!(key, "2026-11");
    assert_eq!(start, utc("2026-11-01T04:00:00Z"));
    assert_eq!(resets, utc("2026-12-01T05:00:00Z"));
    let (key, _, resets) = month(ny, "2026-11-01T03:59:59Z");
    assert_eq!(key, "2026-10");
    assert_eq!(resets, utc("2026-11-01T04:00:00Z"));
}

#[test]
fn london_2026_03_29_and_10_25() {
    let london = chrono_tz::Europe::London;
    // Clocks go forward at 01:00 UTC: the day is 23 hours.
    let (key, start, resets) = day(london, "2026-03-29T00:59:59Z");
    assert_eq!(key, "2026-03-29");
    assert_eq!(start, utc("2026-03-29T00:00:00Z"));
    assert_eq!(resets, utc("2026-03-29T23:00:00Z"));
    assert_eq!(day(london, "2026-03-29T01:00:00Z").0, "2026-03-29");
    assert_eq!(day(london, "2026-03-29T23:00:00Z").0, "2026-03-30");
    let (key, start, resets) = month(london, "2026-03-29T12:00:00Z");
    assert_eq!(key, "2026-03");
    assert_eq!(start, utc("2026-03-01T00:00:00Z"));
    assert_eq!(resets, utc("2026-03-31T23:00:00Z"));

    // Clocks go back at 01:00 UTC: the day is 25 hours and starts in BST.
    let (key, start, resets) = day(london, "2026-10-25T01:30:00Z");
    assert_eq!(key, "2026-10-25");
    assert_eq!(start, utc("2026-10-24T23:00:00Z"));
    assert_eq!(resets, utc("2026-10-26T00:00:00Z"));
    assert_eq!(day(london, "2026-10-25T00:30:00Z"), day(london, "2026-10-25T01:30:00Z"));
    assert_eq!(day(london, "2026-10-24T22:59:59Z").0, "2026-10-24");
    let (key, start, resets) = month(london, "2026-10-25T01:30:00Z");
    assert_eq!(key, "2026-10");
    assert_eq!(start, utc("2026-09-30T23:00:00Z"));
    assert_eq!(resets, utc("2026-11-01T00:00:00Z"));
}

#[test]
fn santiago_day_starts_at_one_when_midnight_is_skipped() {
    let santiago = chrono_tz::America::Santiago;
    // 2026-09-06: local midnight (-04) does not exist; clocks jump to 01:00 -03.
    let (key, start, resets) = day(santiago, "2026-09-06T12:00:00Z");
    assert_eq!(key, "2026-09-06");
    assert_eq!(start, utc("2026-09-06T04:00:00Z"));
    assert_eq!(resets, utc("2026-09-07T03:00:00Z"));
    let (key, _, resets) = day(santiago, "2026-09-06T03:59:59Z");
    assert_eq!(key, "2026-09-05");
    assert_eq!(resets, utc("2026-09-06T04:00:00Z"));
    // 2026-04-05: midnight -03 becomes 23:00 -04 on the 4th, a 25-hour day.
    let (key, start, resets) = day(santiago, "2026-04-05T03:30:00Z");
    assert_eq!(key, "2026-04-04");
    assert_eq!(start, utc("2026-04-04T03:00:00Z"));
    assert_eq!(resets, utc("2026-04-05T04:00:00Z"));
}

#[test]
fn havana_day_starts_at_the_first_of_two_midnights() {
    let havana = chrono_tz::America::Havana;
    // 2026-11-01: 01:00 CDT goes back to 00:00 CST, so 00:xx happens twice.
    let (key, start, resets) = day(havana, "2026-11-01T05:30:00Z");
    assert_eq!(key, "2026-11-01");
    assert_eq!(start, utc("2026-11-01T04:00:00Z"));
    assert_eq!(resets, utc("2026-11-02T05:00:00Z"));
    assert_eq!(day(havana, "2026-11-01T04:30:00Z").1, start);
    assert_eq!(day(havana, "2026-11-01T03:59:59Z").0, "2026-10-31");
    // 2026-03-08: 00:00 CST jumps to 01:00 CDT, so the day starts at 01:00.
    let (key, start, resets) = day(havana, "2026-03-08T12:00:00Z");
    assert_eq!(key, "2026-03-08");
    assert_eq!(start, utc("2026-03-08T05:00:00Z"));
    assert_eq!(resets, utc("2026-03-09T04:00:00Z"));
}

#[test]
fn odd_offsets_and_half_hour_dst() {
    // Chatham is +12:45 in winter and +13:45 in summer (from late September).
    let chatham = chrono_tz::Pacific::Chatham;
    let (key, start, resets) = day(chatham, "2026-07-07T12:00:00Z");
    assert_eq!(key, "2026-07-08");
    assert_eq!(start, utc("2026-07-07T11:15:00Z"));
    assert_eq!(resets, utc("2026-07-08T11:15:00Z"));
    let (key, start, _) = day(chatham, "2026-01-15T12:00:00Z");
    assert_eq!(key, "2026-01-16");
    assert_eq!(start, utc("2026-01-15T10:15:00Z"));
    // Kolkata: +05:30 all year.
    let (key, start, _) = day(chrono_tz::Asia::Kolkata, "2026-07-07T18:29:59Z");
    assert_eq!(key, "2026-07-07");
    assert_eq!(start, utc("2026-07-06T18:30:00Z"));
    // Lord Howe: +10:30, +11:00 in summer (DST is 30 minutes), so its days
    // around the changes last 23.5 and 24.5 hours.
    let lh = chrono_tz::Australia::Lord_Howe;
    let (key, start, resets) = day(lh, "2026-04-05T06:00:00Z");
    assert_eq!(key, "2026-04-05");
    assert_eq!((resets - start).num_minutes(), 24 * 60 + 30);
    let (key, start, resets) = day(lh, "2026-10-04T06:00:00Z");
    assert_eq!(key, "2026-10-04");
    assert_eq!((resets - start).num_minutes(), 23 * 60 + 30);
}

// ───────────────────────────── the fold ─────────────────────────────

fn zone_of(project: &ProjectId) -> Tz {
    match project.as_str() {
        "p1" => chrono_tz::America::New_York,
        "p2" => chrono_tz::Asia::Kathmandu,
        _ => Tz::UTC,
    }
}

fn fact_strategy() -> impl Strategy<Value = UsageFact> {
    // Two days around New York's spring-forward, so day windows vary in length.
    let base = utc("2026-03-07T00:00:00Z").timestamp();
    (
        select(vec!["p1", "p2", "p3"]),
        0u8..12,
        prop::option::of(select(vec!["k1", "k2"])),
        prop::option::of(select(vec!["u1", "u2", "u3"])),
        prop_oneof![Just(EventKind::Request), Just(EventKind::Call)],
        prop_oneof![3 => Just(Outcome::Success), 1 => Just(Outcome::Failure)],
        0u64..1000,
        0i64..(3 * 86_400),
        0u32..1_000_000,
    )
        .prop_map(move |(p, id, key, actor, kind, outcome, rows, secs, micros)| UsageFact {
            api_key_id: key.map(|k| ApiKeyId::parse(k).expect("id")),
            actor_id: actor.map(str::to_owned),
            outcome,
            // A request event carries no rows (`check_fact` refuses it).
            rows: if kind == EventKind::Request { 0 } else { rows },
            gateway: "g1".to_owned(),
            ..UsageFact::new(
                EventId::parse(format!("e{id}")).expect("id"),
                ProjectId::parse(p).expect("id"),
                kind,
                instant(base + secs, micros * 1000),
            )
        })
}

/// Resends of one event carry the same content: every fact with an id
/// already seen is replaced by the first fact with that id.
fn as_resends(facts: Vec<UsageFact>) -> Vec<UsageFact> {
    let mut first: BTreeMap<(ProjectId, EventId), UsageFact> = BTreeMap::new();
    facts.into_iter().map(|f| first.entry((f.project_id.clone(), f.id.clone())).or_insert(f).clone()).collect()
}

type FoldTotals = Vec<(ProjectId, CounterKey, Option<DateTime<Utc>>, Totals)>;
type ByCounter = BTreeMap<(ProjectId, CounterKey), (Option<DateTime<Utc>>, Totals)>;

fn fold_all<'a>(fold: &mut Fold, facts: impl IntoIterator<Item = &'a UsageFact>) {
    for f in facts {
        fold.apply(f, zone_of(&f.project_id), &PriceBook::default());
    }
}

fn totals_of(fold: &Fold) -> FoldTotals {
    fold.totals().map(|(p, c, t)| (p.clone(), c.key, c.resets_at, t)).collect()
}

fn folded(facts: &[UsageFact]) -> FoldTotals {
    let mut fold = Fold::new();
    fold_all(&mut fold, facts);
    totals_of(&fold)
}

/// The fold written the naive way, from DESIGN §3, without `counters_for`.
fn reference(facts: &[UsageFact]) -> FoldTotals {
    let mut seen = HashSet::new();
    let mut out: ByCounter = BTreeMap::new();
    for f in facts {
        if !seen.insert((f.project_id.clone(), f.id.clone())) {
            continue; // counted at most once per (project, event id)
        }
        let delta = match (f.kind, f.outcome) {
            (EventKind::Request, _) => Totals { requests: 1, ..Totals::default() },
            (EventKind::Call, Outcome::Success) => Totals { calls: 1, rows: f.rows, ..Totals::default() },
            _ => continue,
        };
        let mut dims = vec![Dimension::Project];
        if let Some(k) = &f.api_key_id {
            dims.push(Dimension::AllApiKeys);
            dims.push(Dimension::ApiKey(k.clone()));
        }
        if let (Some(a), EventKind::Call) = (&f.actor_id, f.kind) {
            dims.push(Dimension::Actor(a.clone()));
        }
        for dimension in dims {
            for kind in WindowKind::FLOW {
                let w = window_at(kind, zone_of(&f.project_id), f.occurred_at);
                let key = CounterKey { dimension: dimension.clone(), window: kind, window_key: w.key };
                let e = out.entry((f.project_id.clone(), key)).or_insert((w.resets_at, Totals::default()));
                e.1.requests += delta.requests;
                e.1.calls += delta.calls;
                e.1.rows += delta.rows;
            }
        }
    }
    out.into_iter().map(|((p, k), (r, t))| (p, k, r, t)).collect()
}

fn resends_and_shuffle() -> impl Strategy<Value = (Vec<UsageFact>, Vec<UsageFact>)> {
    prop::collection::vec(fact_strategy(), 0..60).prop_flat_map(|facts| {
        let facts = as_resends(facts);
        (Just(facts.clone()), Just(facts).prop_shuffle())
    })
}

proptest! {
    #[test]
    fn fold_is_order_insensitive((facts, shuffled) in resends_and_shuffle()) {
        prop_assert_eq!(folded(&facts), folded(&shuffled));
        let mut reversed = facts.clone();
        reversed.reverse();
        prop_assert_eq!(folded(&facts), folded(&reversed));
    }

    #[test]
    fn fold_is_idempotent_per_event_id(facts in prop::collection::vec(fact_strategy(), 0..60)) {
        let mut once = Fold::new();
        fold_all(&mut once, &facts);
        let mut twice = once.clone();
        for f in &facts {
            prop_assert!(!twice.apply(f, zone_of(&f.project_id), &PriceBook::default()), "a second apply of {} counted", f.id);
        }
        prop_assert_eq!(&twice, &once);
        let distinct: HashSet<_> = facts.iter().map(|f| (&f.project_id, &f.id)).collect();
        prop_assert_eq!(once.events(), distinct.len());
        // Folding the list twice over, in one go, is the same again.
        let doubled: Vec<_> = facts.iter().chain(&facts).cloned().collect();
        prop_assert_eq!(folded(&doubled), totals_of(&once));
    }

    #[test]
    fn fold_matches_the_reference_model(facts in prop::collection::vec(fact_strategy(), 0..60)) {
        // Facts that reuse an id with different content: the first one wins.
        prop_assert_eq!(folded(&facts), reference(&facts));
    }

    #[test]
    fn fold_adds_up_over_batches_with_disjoint_ids(
        facts in prop::collection::vec(fact_strategy(), 0..60),
        split in any::<prop::sample::Index>(),
    ) {
        // Dedup first (as the store does across batches), then split.
        let mut seen = HashSet::new();
        let facts: Vec<_> =
            facts.into_iter().filter(|f| seen.insert((f.project_id.clone(), f.id.clone()))).collect();
        let at = if facts.is_empty() { 0 } else { split.index(facts.len() + 1) };
        let (a, b) = facts.split_at(at);
        let mut sum: ByCounter = BTreeMap::new();
        for (p, k, r, t) in folded(a).into_iter().chain(folded(b)) {
            let e = sum.entry((p, k)).or_insert((r, Totals::default()));
            prop_assert_eq!(e.0, r, "one counter, one reset");
            e.1.add(t);
        }
        let sum: FoldTotals = sum.into_iter().map(|((p, k), (r, t))| (p, k, r, t)).collect();
        prop_assert_eq!(sum, folded(&facts));
    }
}

// ───────────────────────────── admission ─────────────────────────────

const MAX_ROWS: u64 = 7;
const KEYS: [&str; 2] = ["k1", "k2"];
const ACTORS: [&str; 3] = ["u1", "u2", "u3"];

#[derive(Debug, Clone)]
struct QuotaGen {
    metric: Metric,
    scope: Scope,
    scope_ref: Option<&'static str>,
    window: WindowKind,
    limit: u64,
    monitor: bool,
}

fn quota_gen() -> impl Strategy<Value = QuotaGen> {
    (
        select(vec![Metric::Requests, Metric::Calls, Metric::Rows]),
        select(vec![Scope::Project, Scope::ApiKey, Scope::Actor]),
        prop::option::of(0usize..2),
        prop_oneof![
            1 => Just(WindowKind::Rolling1m),
            1 => Just(WindowKind::Rolling1h),
            1 => Just(WindowKind::Rolling24h),
            2 => Just(WindowKind::Day),
            2 => Just(WindowKind::CalendarMonth),
        ],
        1u64..=20,
        prop::bool::weighted(0.25),
    )
        .prop_map(|(metric, scope, r, window, limit, monitor)| {
            // Requests cannot be scoped to actors: narrow it to a key instead.
            let scope = if metric == Metric::Requests && scope == Scope::Actor { Scope::ApiKey } else { scope };
            let scope_ref = match scope {
                Scope::Project => None,
                Scope::ApiKey => r.map(|i| KEYS[i]),
                _ => r.map(|i| ACTORS[i]),
            };
            QuotaGen { metric, scope, scope_ref, window, limit, monitor }
        })
}

/// Valid quotas with distinct identities (the store refuses duplicates).
fn quotas_from(gens: Vec<QuotaGen>, all_monitor: bool) -> Vec<Quota> {
    let t0 = utc("2026-01-01T00:00:00Z");
    let mut identities = BTreeSet::new();
    let mut out = Vec::new();
    for g in gens {
        if meter::quota::check_combination(g.metric, g.scope, g.window).is_err() {
            continue;
        }
        if !identities.insert((g.scope, g.scope_ref, g.metric, g.window)) {
            continue;
        }
        out.push(Quota {
            id: QuotaId::parse(format!("q{}", out.len())).expect("id"),
            spec: QuotaSpec {
                project_id: ProjectId::parse("p1").expect("id"),
                scope: g.scope,
                scope_ref: g.scope_ref.map(str::to_owned),
                metric: g.metric,
                window: g.window,
                limit: g.limit,
                mode: if g.monitor || all_monitor { Mode::Monitor } else { Mode::Enforce },
                meter_type: None,
                on_unpriced: None,
            },
            created_at: t0,
            updated_at: t0,
        });
    }
    out
}

/// Whether a quota counts on a counter, by the rules of DESIGN §3.
fn governs(q: &Quota, key: &CounterKey) -> bool {
    if q.spec.window != key.window {
        return false;
    }
    match (q.spec.scope, q.spec.scope_ref.as_deref(), &key.dimension) {
        (Scope::Project, None, Dimension::Project) => true,
        (Scope::ApiKey, None, Dimension::AllApiKeys) => true,
        (Scope::ApiKey, Some(r), Dimension::ApiKey(k)) => r == k.as_str(),
        (Scope::Actor, None, Dimension::Actor(_)) => true,
        (Scope::Actor, Some(r), Dimension::Actor(a)) => r == a,
        _ => false,
    }
}

#[derive(Debug, Clone)]
enum Step {
    Check { key: usize, actor: Option<usize>, advance_secs: i64 },
    Finish { which: prop::sample::Index, success: bool, rows: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0usize..2, prop::option::of(0usize..3), prop_oneof![3 => Just(0i64), 1 => 0i64..90])
            .prop_map(|(key, actor, advance_secs)| Step::Check { key, actor, advance_secs }),
        2 => (any::<prop::sample::Index>(), prop::bool::weighted(0.8), 0u64..=MAX_ROWS)
            .prop_map(|(which, success, rows)| Step::Finish { which, success, rows }),
    ]
}

/// What the view holds on a counter, as the laws read it: durable +
/// pending, and the live reservations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    requests: u64,
    calls: u64,
    rows: u64,
    reserved: u64,
}

impl Held {
    fn of(u: CounterUsage) -> Held {
        Held {
            requests: u.durable.requests + u.pending.requests,
            calls: u.durable.calls + u.pending.calls,
            rows: u.durable.rows + u.pending.rows,
            reserved: u.reserved_calls,
        }
    }
}

/// An admitted call not yet finished.
struct InFlight {
    hold: Hold,
    reserved: Vec<CounterKey>,
    counters: Vec<CounterKey>,
    fact: UsageFact,
}

/// The view the laws run against: the reference model of the view
/// (`meter::ViewModel`, which `MemoryView` runs and `RedisView`'s scripts are
/// checked against), with what the laws keep beside it.
struct Harness {
    view: ViewModel,
    project: ProjectId,
    /// Every counter a plan or a settle named, so the laws can read them all.
    seen: BTreeSet<CounterKey>,
    in_flight: Vec<InFlight>,
    /// Admitted checks per counter a requests quota counts on.
    admitted_requests: BTreeMap<CounterKey, u64>,
    /// Rows a counter can still reach: rows at its last admission plus the
    /// most the calls then in flight can add (guarantee 5).
    rows_bound: BTreeMap<CounterKey, u64>,
    next_event: u64,
}

impl Harness {
    fn new(at: DateTime<Utc>) -> Harness {
        let project = ProjectId::parse("p1").expect("id");
        let mut view = ViewModel::new();
        view.seed(&project, &meter::Seed::default(), at);
        Harness {
            view,
            project,
            seen: BTreeSet::new(),
            in_flight: Vec::new(),
            admitted_requests: BTreeMap::new(),
            rows_bound: BTreeMap::new(),
            next_event: 0,
        }
    }

    /// What the view holds on every counter seen so far.
    fn held(&mut self, at: DateTime<Utc>) -> BTreeMap<CounterKey, Held> {
        let keys: Vec<CounterKey> = self.seen.iter().cloned().collect();
        keys.into_iter()
            .map(|k| {
                let u = self.view.usage(&self.project, &k, at).expect("the project is seeded");
                (k, Held::of(u))
            })
            .collect()
    }
}

fn run_admission(quotas: &[Quota], steps: &[Step]) -> Result<(), TestCaseError> {
    let tz = chrono_tz::America::New_York;
    let mut at = utc("2026-03-08T06:55:00Z"); // five minutes before the clocks jump
    let mut view = Harness::new(at);
    for s in steps {
        match s {
            Step::Check { key, actor, advance_secs } => {
                at += Duration::seconds(*advance_secs);
                let api_key = ApiKeyId::parse(KEYS[*key]).expect("id");
                let actor = actor.map(|a| ACTORS[a]);
                let plan = plan_check(
                    quotas,
                    tz,
                    &CheckInput { caller: Caller::key(&api_key, actor), storage_delta: None, ..Default::default() },
                    at,
                );

                // The plan is what the rules say: each limit on a counter its quota governs.
                for l in &plan.limits {
                    let q = &quotas[l.quota];
                    let c = &plan.counters[l.counter];
                    prop_assert!(governs(q, &c.key), "{:?} planned on {:?}", q.spec, c.key);
                    prop_assert_eq!(c.key.window_key.clone(), window_at(q.spec.window, tz, at).key);
                    prop_assert_eq!(l.reserve, q.spec.metric == Metric::Calls && q.spec.mode == Mode::Enforce);
                }

                view.seen.extend(plan.counters.iter().map(|c| c.key.clone()));
                let before = view.held(at);
                view.next_event += 1;
                let hold = Hold {
                    reservation: ReservationId::parse(format!("r{}", view.next_event)).expect("id"),
                    request_event: EventId::parse(format!("req{}", view.next_event)).expect("id"),
                    // Calls hold their slot until they finish.
                    lease_until: at + Duration::days(1),
                };
                let outcome = view.view.check(&view.project, &plan, &hold, at).expect("a valid plan").expect("seeded");

                // The view kept the contract of `meter::admission`: it counted
                // the request, read each limit's usage, admitted iff no enforce
                // limit has `used + need > limit`, and reserved on every
                // reserving counter or on none.
                let mut counted = before.clone();
                for &c in &plan.count_request {
                    counted.entry(plan.counters[c].key.clone()).or_default().requests += 1;
                }
                let expected_used: Vec<u64> = plan
                    .limits
                    .iter()
                    .map(|l| {
                        let h = counted.get(&plan.counters[l.counter].key).copied().unwrap_or_default();
                        match l.metric {
                            Metric::Requests => h.requests,
                            Metric::Calls => h.calls + h.reserved,
                            _ => h.rows,
                        }
                    })
                    .collect();
                prop_assert_eq!(&outcome.used, &expected_used, "what the view read");
                let used = outcome.used.clone();
                let over = |li: usize| used[li] + plan.limits[li].need > plan.limits[li].limit;
                let admitted = !(0..plan.limits.len()).any(|li| plan.limits[li].enforce && over(li));
                prop_assert_eq!(outcome.admitted, admitted, "all or nothing");
                let after = view.held(at);
                let mut expected = counted.clone();
                if admitted {
                    for c in plan.reserved_counters() {
                        expected.entry(plan.counters[c].key.clone()).or_default().reserved += 1;
                    }
                }
                prop_assert_eq!(&after, &expected, "what the check changed");
                let verdict = decide(quotas, &plan, &outcome, at);

                prop_assert_eq!(verdict.admitted(), admitted);
                // Monitor quotas never refuse; each one over its limit is reported.
                let monitors_over: Vec<QuotaId> = (0..plan.limits.len())
                    .filter(|&li| !plan.limits[li].enforce && over(li))
                    .map(|li| quotas[plan.limits[li].quota].id.clone())
                    .collect();
                prop_assert_eq!(&verdict.monitor_breaches, &monitors_over);
                match &verdict.breach {
                    None => prop_assert!(admitted),
                    Some(b) => {
                        let breaching: Vec<usize> =
                            (0..plan.limits.len()).filter(|&li| plan.limits[li].enforce && over(li)).collect();
                        let q = quotas.iter().find(|q| q.id == b.quota_id).expect("a known quota");
                        prop_assert_eq!(q.spec.mode, Mode::Enforce, "a monitor quota refused");
                        prop_assert!(breaching.iter().any(|&li| quotas[plan.limits[li].quota].id == b.quota_id));
                        let most_specific = breaching
                            .iter()
                            .map(|&li| quotas[plan.limits[li].quota].spec.scope)
                            .max()
                            .expect("a breach");
                        prop_assert_eq!(b.scope, most_specific);
                        let latest_reset = breaching
                            .iter()
                            .filter(|&&li| quotas[plan.limits[li].quota].spec.scope == most_specific)
                            .map(|&li| plan.window_of(li).and_then(|w| w.resets_at))
                            .max()
                            .expect("a breach");
                        prop_assert_eq!(b.resets_at, latest_reset);
                        prop_assert_eq!(
                            b.retry_after_secs,
                            b.resets_at.map(|r| {
                                let ms = (r - at).num_milliseconds();
                                (((ms + 999) / 1000).max(1)) as u64
                            })
                        );
                    }
                }
                if !admitted {
                    // Refused: only the request was counted; nothing is held.
                    prop_assert_eq!(&after, &counted);
                }
                // Headers: what is left on the tightest enforce limit, as the view now holds it.
                for (metric, reported) in
                    [(Metric::Calls, verdict.remaining_calls), (Metric::Rows, verdict.remaining_rows)]
                {
                    let left = plan
                        .limits
                        .iter()
                        .filter(|l| l.enforce && l.metric == metric)
                        .map(|l| {
                            let h = after.get(&plan.counters[l.counter].key).copied().unwrap_or_default();
                            let u = if metric == Metric::Calls { h.calls + h.reserved } else { h.rows };
                            l.limit.saturating_sub(u)
                        })
                        .min();
                    prop_assert_eq!(reported, left, "remaining {}", metric);
                }

                if admitted {
                    for (li, l) in plan.limits.iter().enumerate() {
                        let key = &plan.counters[l.counter].key;
                        if l.enforce && l.metric == Metric::Requests {
                            *view.admitted_requests.entry(key.clone()).or_default() += 1;
                        }
                        if l.enforce && l.metric == Metric::Rows {
                            prop_assert!(used[li] < l.limit);
                        }
                    }
                    view.in_flight.push(InFlight {
                        hold,
                        reserved: plan.reserved_counters().iter().map(|&c| plan.counters[c].key.clone()).collect(),
                        counters: plan.counters.iter().map(|c| c.key.clone()).collect(),
                        fact: UsageFact {
                            api_key_id: Some(api_key),
                            actor_id: actor.map(str::to_owned),
                            gateway: "g1".to_owned(),
                            ..UsageFact::new(
                                EventId::parse(format!("call{}", view.next_event)).expect("id"),
                                ProjectId::parse("p1").expect("id"),
                                EventKind::Call,
                                at,
                            )
                        },
                    });
                    for c in &plan.counters {
                        let rows_now = after.get(&c.key).map_or(0, |h| h.rows);
                        let in_flight = view.in_flight.iter().filter(|f| f.counters.contains(&c.key)).count() as u64;
                        view.rows_bound.insert(c.key.clone(), rows_now + MAX_ROWS * in_flight);
                    }
                }
            }
            Step::Finish { which, success, rows } => {
                if view.in_flight.is_empty() {
                    continue;
                }
                let done = view.in_flight.remove(which.index(view.in_flight.len()));
                let before = view.held(at);
                for key in &done.reserved {
                    let h = before.get(key).expect("a reserved counter was seen");
                    prop_assert!(h.reserved > 0);
                }
                let fact = UsageFact {
                    outcome: if *success { Outcome::Success } else { Outcome::Failure },
                    rows: *rows,
                    ..done.fact
                };
                // The gateway settles the call: its deltas replace its reservation.
                let deltas = counters_for(&fact, tz, &PriceBook::default());
                view.seen.extend(deltas.iter().map(|(c, _)| c.key.clone()));
                let mut expected = view.held(at);
                for key in &done.reserved {
                    expected.entry(key.clone()).or_default().reserved -= 1;
                }
                for (counter, delta) in &deltas {
                    let h = expected.entry(counter.key.clone()).or_default();
                    h.calls += delta.calls;
                    h.rows += delta.rows;
                }
                let settlement =
                    Settlement { event: fact.id.clone(), reservation: Some(done.hold.reservation.clone()), deltas };
                view.view.settle(&view.project, &[settlement], at);
                prop_assert_eq!(&view.held(at), &expected, "what the settle changed");
            }
        }

        // Invariants after every step, for every enforce quota.
        let held = view.held(at);
        for q in quotas.iter().filter(|q| q.spec.mode == Mode::Enforce) {
            for (key, h) in held.iter().filter(|(k, _)| governs(q, k)) {
                match q.spec.metric {
                    Metric::Calls => prop_assert!(
                        h.calls + h.reserved <= q.spec.limit,
                        "calls overshoot on {:?}: {:?} for {:?}",
                        key,
                        h,
                        q.spec
                    ),
                    Metric::Requests => {
                        let admitted = view.admitted_requests.get(key).copied().unwrap_or(0);
                        prop_assert!(admitted <= q.spec.limit, "admitted {} requests on {:?}", admitted, key);
                    }
                    Metric::Rows => {
                        let bound = view.rows_bound.get(key).copied().unwrap_or(0);
                        prop_assert!(h.rows <= bound, "rows {} beyond in-flight bound {} on {:?}", h.rows, bound, key);
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn admission_matches_the_model(
        gens in prop::collection::vec(quota_gen(), 1..8),
        steps in prop::collection::vec(step(), 1..80),
    ) {
        run_admission(&quotas_from(gens, false), &steps)?;
    }

    #[test]
    fn monitor_quotas_never_refuse(
        gens in prop::collection::vec(quota_gen(), 1..8),
        key in 0usize..2,
        actor in prop::option::of(0usize..3),
        used in prop::collection::vec(0u64..40, 8),
    ) {
        let quotas = quotas_from(gens, true);
        let at = utc("2026-07-07T12:00:00Z");
        let api_key = ApiKeyId::parse(KEYS[key]).expect("id");
        let plan = plan_check(&quotas, Tz::UTC, &CheckInput { caller: Caller::key(&api_key, actor.map(|a| ACTORS[a])), storage_delta: None, ..Default::default() }, at);
        prop_assert!(plan.reserved_counters().is_empty(), "a monitor quota reserved");
        let used = used[..plan.limits.len()].to_vec();
        let verdict = decide(&quotas, &plan, &CheckOutcome::of(true, used), at);
        prop_assert!(verdict.admitted());
        prop_assert_eq!(verdict.remaining_calls, None);
        prop_assert_eq!(verdict.remaining_rows, None);
    }
}
