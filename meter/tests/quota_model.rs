//! The full quota model: the validity table, token and cost pricing, the
//! unpriced verdict, storage, actors, precedence and calendar months.
//!
//! The expectations are written out from the quotas reference and DESIGN §3,
//! independently of how `meter` encodes them.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;

use meter::price::{MAX_UNPRICED_ROWS, price_tokens};
use meter::quota::{QuotaDraft, validate};
use meter::usage::{Footprint, counters_for};
use meter::{
    ApiKeyId, BreachKind, Caller, CheckInput, Component, CounterKey, Dimension, EventId, EventKind, Field, Fold, Hold,
    MeterType, Metric, Mode, Price, PriceBook, PriceKey, ProjectId, Quota, QuotaId, QuotaSpec, ReservationId, Scope,
    TokenUsage, UsageFact, Usd, ViewModel, WindowKind, decide, plan_check, window_at,
};

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

// ---------------------------------------------------------------- validity

/// The reference's table: metric → valid scopes; `current` only for storage.
fn valid(metric: &str, scope: &str, window: &str) -> bool {
    let scopes: &[&str] = match metric {
        "requests" => &["project", "api_key"],
        "calls" | "rows" => &["project", "api_key", "actor"],
        "tokens" | "cost_usd" => &["project", "agent", "actor"],
        "storage_bytes" => &["project"],
        _ => &[],
    };
    scopes.contains(&scope) && ((metric == "storage_bytes") == (window == "current"))
}

const METRICS: [&str; 6] = ["requests", "calls", "rows", "tokens", "cost_usd", "storage_bytes"];
const SCOPES: [&str; 4] = ["project", "api_key", "agent", "actor"];
const WINDOWS: [&str; 6] = ["rolling_1m", "rolling_1h", "rolling_24h", "day", "calendar_month", "current"];

fn draft(metric: &str, scope: &str, window: &str) -> QuotaDraft {
    QuotaDraft {
        project_id: Some("proj_1".into()),
        scope: Some(scope.into()),
        scope_ref: (scope != "project").then(|| "ref_1".to_owned()),
        metric: Some(metric.into()),
        window: Some(window.into()),
        limit: Some(10),
        ..QuotaDraft::default()
    }
}

#[test]
fn the_validity_table_exhaustively() {
    let mut accepted = 0;
    for m in METRICS {
        for s in SCOPES {
            for w in WINDOWS {
                let got = validate(&draft(m, s, w));
                if valid(m, s, w) {
                    let spec = got.unwrap_or_else(|e| panic!("{m}/{s}/{w} refused: {e}"));
                    assert_eq!(spec.on_unpriced.is_some(), m == "cost_usd", "on_unpriced defaults on cost_usd only");
                    accepted += 1;
                } else {
                    let e = got.expect_err("outside the table");
                    // A wrong scope is named first; a scope that fits with the wrong window names the window.
                    let scope_ok = match m {
                        "requests" => ["project", "api_key"].contains(&s),
                        "calls" | "rows" => s != "agent",
                        "tokens" | "cost_usd" => s != "api_key",
                        _ => s == "project",
                    };
                    assert_eq!(e.field, if scope_ok { "window" } else { "scope" }, "{m}/{s}/{w}: {e}");
                }
            }
        }
    }
    // requests 2×5, calls 3×5, rows 3×5, tokens 3×5, cost 3×5, storage 1×1.
    assert_eq!(accepted, 10 + 15 + 15 + 15 + 15 + 1);
}

#[test]
fn meter_type_and_on_unpriced_only_on_cost() {
    for m in METRICS {
        let (s, w) = if m == "storage_bytes" { ("project", "current") } else { ("project", "day") };
        for (field, value) in [("meter_type", "llm_tokens"), ("on_unpriced", "allow")] {
            let mut d = draft(m, s, w);
            if field == "meter_type" {
                d.meter_type = Some(value.into());
            } else {
                d.on_unpriced = Some(value.into());
            }
            let got = validate(&d);
            if m == "cost_usd" {
                assert!(got.is_ok(), "{m} {field}: {got:?}");
            } else {
                assert_eq!(got.expect_err("refused").field, field, "{m}");
            }
        }
    }
    let mut d = draft("cost_usd", "project", "day");
    d.meter_type = Some("gpu_hours".into());
    assert_eq!(validate(&d).expect_err("unknown meter").field, "meter_type");
    d.meter_type = None;
    d.on_unpriced = Some("maybe".into());
    assert_eq!(validate(&d).expect_err("unknown posture").field, "on_unpriced");
}

#[test]
fn cost_limits_are_decimal_dollars() {
    let mut d = draft("cost_usd", "project", "calendar_month");
    d.limit = Some(25);
    assert_eq!(validate(&d).expect("whole dollars").limit, 25_000_000_000_000);
    d.limit = None;
    d.limit_decimal = Some("2.50".into());
    assert_eq!(validate(&d).expect("a decimal").limit, 2_500_000_000_000);
    d.limit_decimal = Some("0.0000000000001".into());
    assert_eq!(validate(&d).expect_err("13 places").field, "limit");
    d.limit_decimal = Some("-1".into());
    assert_eq!(validate(&d).expect_err("negative").field, "limit");
    // Other metrics count whole things.
    let mut d = draft("tokens", "project", "day");
    d.limit = None;
    d.limit_decimal = Some("2.5".into());
    assert_eq!(validate(&d).expect_err("fraction of a token").field, "limit");
}

// ------------------------------------------------------------ the verdict

fn quota(id: &str, scope: Scope, scope_ref: Option<&str>, metric: Metric, window: WindowKind, limit: u64) -> Quota {
    let t0 = utc("2026-01-01T00:00:00Z");
    let draft = QuotaDraft {
        project_id: Some("p1".into()),
        scope: Some(scope.as_str().into()),
        scope_ref: scope_ref.map(str::to_owned),
        metric: Some(metric.as_str().into()),
        window: Some(window.as_str().into()),
        limit: Some(1),
        ..QuotaDraft::default()
    };
    let mut spec: QuotaSpec = validate(&draft).expect("a valid quota");
    spec.limit = limit;
    Quota { id: QuotaId::parse(id).expect("id"), spec, created_at: t0, updated_at: t0 }
}

/// A tiny view: facts folded into durable totals by counter, and checked by
/// the reference model of the view (`meter::ViewModel`) as the real views
/// check them.
struct Counters {
    totals: BTreeMap<CounterKey, meter::Totals>,
    view: RefCell<ViewModel>,
    checks: Cell<u32>,
}

impl Default for Counters {
    fn default() -> Self {
        let mut view = ViewModel::new();
        view.seed(&project(), &meter::Seed::default(), utc("2026-01-01T00:00:00Z"));
        Counters { totals: BTreeMap::new(), view: RefCell::new(view), checks: Cell::new(0) }
    }
}

fn project() -> ProjectId {
    ProjectId::parse("p1").expect("id")
}

impl Counters {
    /// Folds a fact, as the projector does: the counters' new totals go to the view.
    fn fold(&mut self, fact: &UsageFact, tz: Tz, book: &PriceBook) {
        let mut folded = Vec::new();
        for (c, d) in counters_for(fact, tz, book) {
            let t = self.totals.entry(c.key.clone()).or_default();
            t.add(d);
            folded.push((c, *t));
        }
        self.view.get_mut().apply_fold(&project(), &folded, std::slice::from_ref(&fact.id), fact.occurred_at);
    }

    fn check(&self, quotas: &[Quota], tz: Tz, input: &CheckInput, at: DateTime<Utc>) -> meter::Verdict {
        let plan = plan_check(quotas, tz, input, at);
        let n = self.checks.get() + 1;
        self.checks.set(n);
        let hold = Hold {
            reservation: ReservationId::parse(format!("r{n}")).expect("id"),
            request_event: EventId::parse(format!("req{n}")).expect("id"),
            lease_until: at + chrono::Duration::seconds(30),
        };
        let outcome =
            self.view.borrow_mut().check(&project(), &plan, &hold, at).expect("a valid plan").expect("seeded");
        decide(quotas, &plan, &outcome, at)
    }
}

fn caller(actor: Option<&str>, agent: Option<&str>) -> CheckInput {
    CheckInput {
        caller: Caller {
            api_key: Some(ApiKeyId::parse("k1").expect("id")),
            agent: agent.map(str::to_owned),
            actor: actor.map(str::to_owned),
            user: None,
        },
        storage_delta: None,
        ..CheckInput::default()
    }
}

fn tokens_fact(id: &str, at: DateTime<Utc>, actor: Option<&str>, model: &str, input: u64, output: u64) -> UsageFact {
    UsageFact {
        actor_id: actor.map(str::to_owned),
        agent_id: Some("bot".into()),
        tokens: vec![TokenUsage {
            provider: "openai".into(),
            model: model.into(),
            input,
            output,
            ..TokenUsage::default()
        }],
        ..UsageFact::new(EventId::parse(id).expect("id"), ProjectId::parse("p1").expect("id"), EventKind::Tokens, at)
    }
}

fn book() -> PriceBook {
    let from = utc("2026-01-01T00:00:00Z");
    let price = |model: &str, c: Component, usd: &str| Price {
        key: PriceKey { provider: "openai".into(), model: model.into(), component: c },
        unit_price_usd: Usd::parse(usd).expect("price"),
        effective_from: from,
    };
    PriceBook::new([
        price("gpt-4o", Component::InputTokens, "0.0000025"),
        price("gpt-4o", Component::OutputTokens, "0.00001"),
    ])
}

#[test]
fn two_actors_have_independent_budgets_under_one_null_ref_quota() {
    let q = quota("q_actor", Scope::Actor, None, Metric::Tokens, WindowKind::Day, 1000);
    let at = utc("2026-07-07T12:00:00Z");
    let mut view = Counters::default();
    view.fold(&tokens_fact("e1", at, Some("alice"), "gpt-4o", 800, 200), Tz::UTC, &book());
    let alice = view.check(std::slice::from_ref(&q), Tz::UTC, &caller(Some("alice"), None), at);
    let b = alice.breach.expect("alice spent her 1,000 tokens");
    assert_eq!((b.kind, b.metric, b.used), (BreachKind::Exceeded, Metric::Tokens, 1000));
    assert_eq!(b.counter.dimension, Dimension::Actor("alice".into()));
    let bob = view.check(std::slice::from_ref(&q), Tz::UTC, &caller(Some("bob"), None), at);
    assert!(bob.admitted(), "bob's budget is his own");
    // No actor behind the call: an actor quota does not apply at all.
    assert!(view.check(std::slice::from_ref(&q), Tz::UTC, &caller(None, None), at).admitted());
}

#[test]
fn when_project_and_actor_quotas_both_breach_the_actor_is_reported() {
    let project = quota("q_project", Scope::Project, None, Metric::CostUsd, WindowKind::CalendarMonth, 1);
    let actor = quota("q_actor", Scope::Actor, None, Metric::CostUsd, WindowKind::Day, 1);
    let at = utc("2026-07-07T12:00:00Z");
    let mut view = Counters::default();
    // $0.0025 + $0.002 = $0.0045 spent; both limits are 1 picodollar.
    view.fold(&tokens_fact("e1", at, Some("alice"), "gpt-4o", 1000, 200), Tz::UTC, &book());
    for quotas in [vec![project.clone(), actor.clone()], vec![actor.clone(), project.clone()]] {
        let v = view.check(&quotas, Tz::UTC, &caller(Some("alice"), None), at);
        let b = v.breach.expect("both breach");
        assert_eq!((b.quota_id.as_str(), b.scope), ("q_actor", Scope::Actor));
        assert_eq!(b.used, 4_500_000_000, "picodollars");
    }
}

#[test]
fn blackout_needs_three_unpriced_llm_events_and_none_priced() {
    let q = quota("q_cost", Scope::Project, None, Metric::CostUsd, WindowKind::Day, 25_000_000_000_000);
    let at = utc("2026-07-07T12:00:00Z");
    let mut view = Counters::default();
    let check = |view: &Counters| view.check(std::slice::from_ref(&q), Tz::UTC, &caller(None, None), at);
    view.fold(&tokens_fact("e1", at, None, "mystery", 10, 10), Tz::UTC, &book());
    view.fold(&tokens_fact("e2", at, None, "mystery", 10, 10), Tz::UTC, &book());
    let v = check(&view);
    assert!(v.admitted(), "two all-unpriced events pass");
    assert_eq!(v.unpriced.len(), 1, "but the exception files from the first");
    assert_eq!((v.unpriced[0].llm_events, v.unpriced[0].unpriced_events), (2, 2));
    view.fold(&tokens_fact("e3", at, None, "mystery", 10, 10), Tz::UTC, &book());
    let b = check(&view).breach.expect("three and none priced is a blackout");
    assert_eq!(b.kind, BreachKind::Unenforceable);
    assert_eq!(b.retry_after_secs, None, "waiting is no remedy");
    // One priced event lifts it; the window stays reported.
    view.fold(&tokens_fact("e4", at, None, "gpt-4o", 10, 0), Tz::UTC, &book());
    let v = check(&view);
    assert!(v.admitted(), "a partly priced window passes");
    assert_eq!((v.unpriced[0].llm_events, v.unpriced[0].unpriced_events), (4, 3));

    // allow, monitor, and a platform-meter quota never refuse on a blackout.
    let mut blackout = Counters::default();
    for id in ["b1", "b2", "b3"] {
        blackout.fold(&tokens_fact(id, at, None, "mystery", 10, 10), Tz::UTC, &book());
    }
    let mut allow = q.clone();
    allow.spec.on_unpriced = Some(meter::OnUnpriced::Allow);
    let mut monitor = q.clone();
    monitor.spec.mode = Mode::Monitor;
    let mut compute = q.clone();
    compute.spec.meter_type = Some("compute_execution".into());
    for q in [allow, monitor, compute.clone()] {
        assert!(blackout.check(std::slice::from_ref(&q), Tz::UTC, &caller(None, None), at).admitted());
    }
    assert!(
        blackout.check(std::slice::from_ref(&compute), Tz::UTC, &caller(None, None), at).unpriced.is_empty(),
        "a platform-meter quota has no pricing verdict"
    );
}

#[test]
fn embeddings_stay_out_of_the_verdict() {
    let q = quota("q_cost", Scope::Project, None, Metric::CostUsd, WindowKind::Day, 25_000_000_000_000);
    let at = utc("2026-07-07T12:00:00Z");
    let mut view = Counters::default();
    for id in ["e1", "e2", "e3", "e4"] {
        let mut f = tokens_fact(id, at, None, "text-embedding-3", 100, 0);
        f.tokens[0].embedding = true;
        view.fold(&f, Tz::UTC, &book());
    }
    let v = view.check(std::slice::from_ref(&q), Tz::UTC, &caller(None, None), at);
    assert!(v.admitted() && v.unpriced.is_empty());
}

#[test]
fn storage_refuses_past_the_exact_byte_and_never_refuses_a_delete() {
    let q = quota("q_store", Scope::Project, None, Metric::StorageBytes, WindowKind::Current, 1000);
    let at = utc("2026-07-07T12:00:00Z");
    let mut view = Counters::default();
    let snap = UsageFact {
        storage_bytes: Some(600),
        ..UsageFact::new(
            EventId::parse("s1").expect("id"),
            ProjectId::parse("p1").expect("id"),
            EventKind::StorageDelta,
            at,
        )
    };
    view.fold(&snap, Tz::UTC, &PriceBook::default());
    let write = |delta: i64| CheckInput { storage_delta: Some(delta), ..caller(None, None) };
    assert!(view.check(std::slice::from_ref(&q), Tz::UTC, &write(400), at).admitted(), "600 + 400 = the limit");
    let b = view.check(std::slice::from_ref(&q), Tz::UTC, &write(401), at).breach.expect("one byte over");
    assert_eq!((b.kind, b.used, b.retry_after_secs, b.resets_at), (BreachKind::Storage, 600, None, None));
    // A delete, or a check that writes nothing, is never a storage check.
    view.fold(
        &UsageFact {
            storage_bytes: Some(5000),
            ..UsageFact::new(
                EventId::parse("s2").expect("id"),
                ProjectId::parse("p1").expect("id"),
                EventKind::StorageDelta,
                at,
            )
        },
        Tz::UTC,
        &PriceBook::default(),
    );
    assert!(view.check(std::slice::from_ref(&q), Tz::UTC, &write(-100), at).admitted());
    assert!(view.check(std::slice::from_ref(&q), Tz::UTC, &caller(None, None), at).admitted());
}

#[test]
fn the_agent_scope_with_a_null_ref_is_the_whole_project() {
    let all = quota("q_agents", Scope::Agent, None, Metric::Tokens, WindowKind::Day, 100);
    let one = quota("q_bot", Scope::Agent, Some("bot"), Metric::Tokens, WindowKind::Day, 100);
    let at = utc("2026-07-07T12:00:00Z");
    let plan = plan_check(&[all, one], Tz::UTC, &caller(None, Some("bot")), at);
    let dims: Vec<_> = plan.counters.iter().map(|c| c.key.dimension.clone()).collect();
    assert_eq!(dims, vec![Dimension::Project, Dimension::Agent("bot".into())]);
    let plan = plan_check(
        &[quota("q_bot", Scope::Agent, Some("bot"), Metric::Tokens, WindowKind::Day, 100)],
        Tz::UTC,
        &caller(None, Some("other")),
        at,
    );
    assert!(plan.limits.is_empty());
}

// ------------------------------------------------------- calendar months

#[test]
fn calendar_months_in_new_york_across_dst_and_in_kathmandu() {
    let ny = chrono_tz::America::New_York;
    // March 2026 starts in EST (UTC−5) and ends in EDT (UTC−4): 31 days minus an hour.
    let w = window_at(WindowKind::CalendarMonth, ny, utc("2026-03-08T07:30:00Z"));
    assert_eq!(w.key, "2026-03");
    assert_eq!(w.start, utc("2026-03-01T05:00:00Z"));
    assert_eq!(w.resets_at, Some(utc("2026-04-01T04:00:00Z")));
    // November 2026 starts in EDT and ends in EST.
    let w = window_at(WindowKind::CalendarMonth, ny, utc("2026-11-01T06:30:00Z"));
    assert_eq!(
        (w.key.as_str(), w.start, w.resets_at),
        ("2026-11", utc("2026-11-01T04:00:00Z"), Some(utc("2026-12-01T05:00:00Z")))
    );
    // Late on the last evening in New York is still the old month.
    assert_eq!(window_at(WindowKind::CalendarMonth, ny, utc("2026-04-01T03:59:59Z")).key, "2026-03");
    // Kathmandu is UTC+05:45: its months begin at 18:15 UTC the day before.
    let ktm = chrono_tz::Asia::Kathmandu;
    let w = window_at(WindowKind::CalendarMonth, ktm, utc("2026-06-30T18:15:00Z"));
    assert_eq!(
        (w.key.as_str(), w.start, w.resets_at),
        ("2026-07", utc("2026-06-30T18:15:00Z"), Some(utc("2026-07-31T18:15:00Z")))
    );
    assert_eq!(window_at(WindowKind::CalendarMonth, ktm, utc("2026-06-30T18:14:59Z")).key, "2026-06");
}

// ------------------------------------------------------ pricing, replay

fn token_fact() -> impl Strategy<Value = UsageFact> {
    let base = utc("2026-07-01T00:00:00Z").timestamp();
    (
        Just(0u16),
        prop::sample::select(vec!["gpt-4o", "mystery"]),
        0u64..50_000,
        0u64..50_000,
        0u64..50_000,
        0i64..(40 * 86_400),
        prop::option::of(prop::sample::select(vec!["alice", "bob"])),
    )
        .prop_map(move |(id, model, input, output, cached, secs, actor)| UsageFact {
            actor_id: actor.map(str::to_owned),
            tokens: vec![TokenUsage {
                provider: "openai".into(),
                model: model.into(),
                input,
                output,
                cached,
                reasoning: 7,
                embedding: false,
            }],
            ..UsageFact::new(
                EventId::parse(format!("t{id}")).expect("id"),
                ProjectId::parse("p1").expect("id"),
                EventKind::Tokens,
                DateTime::from_timestamp(base + secs, 0).expect("time"),
            )
        })
}

/// A price change on July 15th: events before keep the old price.
fn changing_book() -> PriceBook {
    let mut b = book();
    b.insert(Price {
        key: PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: Component::InputTokens },
        unit_price_usd: Usd::parse("0.000002").expect("price"),
        effective_from: utc("2026-07-15T00:00:00Z"),
    });
    b
}

proptest! {
    #[test]
    fn replaying_the_same_token_events_gives_the_same_cost_to_the_last_picodollar(
        facts in prop::collection::vec(token_fact(), 0..60),
        seed in any::<u64>(),
    ) {
        // One id, one content: a resend is the same event.
        let facts: Vec<UsageFact> = facts.into_iter().enumerate()
            .map(|(i, f)| UsageFact { id: EventId::parse(format!("t{i}")).expect("id"), ..f })
            .collect();
        let tz = chrono_tz::America::New_York;
        let mut first = Fold::new();
        for f in &facts {
            first.apply(f, tz, &changing_book());
        }
        // A replay: another order, every event delivered twice.
        let mut replay = facts.clone();
        replay.extend(facts.iter().cloned());
        let n = replay.len();
        for i in 0..n {
            let j = (seed as usize).wrapping_mul(i + 1).wrapping_add(i) % n;
            replay.swap(i, j);
        }
        let mut second = Fold::new();
        for f in &replay {
            second.apply(f, tz, &changing_book());
        }
        let a: Vec<_> = first.totals().map(|(p, c, t)| (p.clone(), c.key, t)).collect();
        let b: Vec<_> = second.totals().map(|(p, c, t)| (p.clone(), c.key, t)).collect();
        prop_assert_eq!(&a, &b);
        // And the cost is the exact sum of quantity × the price at each event's time.
        let mut expected = 0i128;
        let mut seen = std::collections::HashSet::new();
        for f in &facts {
            if !seen.insert(f.id.clone()) { continue; }
            expected += i128::from(price_tokens(&f.tokens, MeterType::LlmTokens, f.occurred_at, &changing_book()).cost.picos());
        }
        let project_month_sum: i128 = a.iter()
            .filter(|(_, k, _)| k.dimension == Dimension::Project && k.window == WindowKind::CalendarMonth)
            .map(|(_, _, t)| i128::from(t.get(Field::CostLlmTokens)))
            .sum();
        prop_assert_eq!(project_month_sum, expected);
    }

    #[test]
    fn the_footprint_does_not_depend_on_the_order_facts_arrive_in(
        facts in prop::collection::vec((any::<bool>(), 0i64..1000, -500i64..5000), 0..30),
        seed in any::<u64>(),
    ) {
        let t0 = utc("2026-07-01T00:00:00Z");
        let facts: Vec<UsageFact> = facts.iter().enumerate().map(|(i, (snap, secs, bytes))| UsageFact {
            storage_bytes: Some(if *snap { bytes.abs() } else { *bytes }),
            ..UsageFact::new(
                EventId::parse(format!("s{i}")).expect("id"),
                ProjectId::parse("p1").expect("id"),
                if *snap { EventKind::StorageSnapshot } else { EventKind::StorageDelta },
                t0 + chrono::Duration::seconds(*secs),
            )
        }).collect();
        let mut a = Footprint::default();
        facts.iter().for_each(|f| a.apply(f));
        let mut shuffled = facts.clone();
        let n = shuffled.len().max(1);
        for i in 0..shuffled.len() {
            shuffled.swap(i, (seed as usize).wrapping_add(i * 7) % n);
        }
        let mut b = Footprint::default();
        shuffled.iter().for_each(|f| b.apply(f));
        prop_assert_eq!(a.bytes(), b.bytes());
        prop_assert_eq!(a.events(), facts.len() as u64);
        // The definition, written out: the newest snapshot plus the deltas after it.
        let newest = facts.iter().filter(|f| f.kind == EventKind::StorageSnapshot).max_by_key(|f| (f.occurred_at, f.id.clone()));
        let expected = match newest {
            None => facts.iter().map(|f| f.storage_bytes.unwrap_or(0)).sum::<i64>(),
            Some(s) => s.storage_bytes.unwrap_or(0) + facts.iter()
                .filter(|f| f.kind == EventKind::StorageDelta && f.occurred_at > s.occurred_at)
                .map(|f| f.storage_bytes.unwrap_or(0)).sum::<i64>(),
        };
        prop_assert_eq!(a.bytes(), expected);
    }
}

#[test]
fn unpriced_rows_are_per_component_and_capped_where_they_are_read() {
    let at = utc("2026-07-07T12:00:00Z");
    let usage: Vec<TokenUsage> = (0..12)
        .map(|i| TokenUsage {
            provider: "p".into(),
            model: format!("m{i:02}"),
            input: 1,
            output: 1,
            ..TokenUsage::default()
        })
        .collect();
    let p = price_tokens(&usage, MeterType::LlmTokens, at, &book());
    assert_eq!(p.unpriced_rows.len(), 24, "every (model, component) with a quantity");
    assert!(MAX_UNPRICED_ROWS < p.unpriced_rows.len(), "the store caps what a refusal lists");
    // A component that measured zero is left out.
    let p = price_tokens(
        &[TokenUsage { provider: "p".into(), model: "m".into(), input: 5, ..TokenUsage::default() }],
        MeterType::LlmTokens,
        at,
        &book(),
    );
    assert_eq!(p.unpriced_rows.into_iter().map(|k| k.component).collect::<Vec<_>>(), vec![Component::InputTokens]);
}
