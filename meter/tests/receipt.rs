//! Laws of the fold as of receipt (guarantee 7: the fold is a pure function
//! of the log records and of the append-only price book as of each record's
//! receipt), checked with proptest:
//!
//! - a fact priced by the whole book costs what it cost priced by the book
//!   as it stood at its receipt: versions recorded later (back-dated rows,
//!   replacements) change nothing, so a live fold and a replay agree;
//! - a book is the same whatever order its versions were recorded in;
//! - the current book (what `GET /v1/prices` shows) is, of each row, its
//!   latest version.

use chrono::{DateTime, Duration, Utc};
use proptest::prelude::*;
use proptest::sample::select;

use meter::{
    Component, EventId, EventKind, Price, PriceBook, PriceKey, PriceVersion, ProjectId, TokenUsage, UsageFact, Usd,
};

fn base() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-07-07T00:00:00Z").expect("ts").with_timezone(&Utc)
}

fn key(model: &str, component: Component) -> PriceKey {
    PriceKey { provider: "openai".into(), model: model.into(), component }
}

/// Versions over two days, in effect and recorded at whole hours (so that
/// they tie with each other and with receipts).
fn version_strategy() -> impl Strategy<Value = PriceVersion> {
    (select(vec!["alpha", "beta"]), select(Component::ALL.to_vec()), 0i64..48, 0i64..48, 0i64..100).prop_map(
        |(model, component, from, recorded, picos)| PriceVersion {
            price: Price {
                key: key(model, component),
                unit_price_usd: Usd(picos),
                effective_from: base() + Duration::hours(from),
            },
            recorded_at: base() + Duration::hours(recorded),
        },
    )
}

fn fact_strategy() -> impl Strategy<Value = UsageFact> {
    let entry =
        (select(vec!["alpha", "beta"]), 0u64..50, 0u64..50, 0u64..5).prop_map(|(model, input, output, cached)| {
            TokenUsage {
                provider: "openai".into(),
                model: model.into(),
                input,
                output,
                cached,
                ..TokenUsage::default()
            }
        });
    (0u32..1000, 0i64..48, 0i64..60, prop::collection::vec(entry, 1..3)).prop_map(|(id, at, late, tokens)| {
        let occurred_at = base() + Duration::hours(at);
        UsageFact {
            tokens,
            received_at: Some(occurred_at + Duration::minutes(late * 10)),
            ..UsageFact::new(
                EventId::parse(format!("e{id}")).expect("id"),
                ProjectId::parse("p1").expect("id"),
                EventKind::Tokens,
                occurred_at,
            )
        }
    })
}

proptest! {
    #[test]
    fn versions_recorded_after_a_receipt_do_not_change_its_price(
        versions in prop::collection::vec(version_strategy(), 0..24),
        facts in prop::collection::vec(fact_strategy(), 1..12),
    ) {
        let whole = PriceBook::with_versions(versions.clone());
        for f in &facts {
            let then = PriceBook::with_versions(versions.iter().filter(|v| v.recorded_at <= f.receipt()).cloned());
            prop_assert_eq!(meter::usage::priced(f, &whole), meter::usage::priced(f, &then), "fact {}", f.id);
            prop_assert_eq!(
                meter::usage::component_usage(f, &whole),
                meter::usage::component_usage(f, &then),
                "breakdown of {}", f.id
            );
        }
    }

    #[test]
    fn a_book_does_not_depend_on_the_order_its_versions_came_in(
        versions in prop::collection::vec(version_strategy(), 0..24),
    ) {
        // Distinct (key, effective_from, recorded_at): a tie is a replacement,
        // where the order does matter, by definition.
        let mut seen = std::collections::BTreeSet::new();
        let distinct: Vec<PriceVersion> = versions
            .into_iter()
            .filter(|v| seen.insert((v.price.key.clone(), v.price.effective_from, v.recorded_at)))
            .collect();
        let forward = PriceBook::with_versions(distinct.clone());
        let backward = PriceBook::with_versions(distinct.iter().rev().cloned());
        prop_assert_eq!(&forward, &backward);

        // The current book: of each (key, effective_from) its latest version.
        let mut latest: std::collections::BTreeMap<(PriceKey, DateTime<Utc>), (DateTime<Utc>, Usd)> =
            std::collections::BTreeMap::new();
        for v in &distinct {
            let e = latest.entry((v.price.key.clone(), v.price.effective_from)).or_insert((v.recorded_at, v.price.unit_price_usd));
            if v.recorded_at > e.0 {
                *e = (v.recorded_at, v.price.unit_price_usd);
            }
        }
        let current: Vec<Price> = forward.prices().collect();
        let expected: Vec<Price> = latest
            .into_iter()
            .map(|((key, effective_from), (_, unit_price_usd))| Price { key, unit_price_usd, effective_from })
            .collect();
        prop_assert_eq!(current, expected);
    }
}
