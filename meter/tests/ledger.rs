//! Laws of `meter::ledger`, the fold of a batch as a store persists it,
//! checked with proptest against a model store kept in this file (a dedup
//! set, sums, unpriced rows, the breakdown by model, and the storage facts,
//! read back exactly as `StoredFootprint` asks):
//!
//! - folding facts batch by batch, in any split and any order, gives what
//!   one batch of them gives, and that is one `Fold` of the distinct facts
//!   and, per project, the `Footprint` of all its storage facts;
//! - a batch folded again adds nothing and reports only duplicates;
//! - a storage fact refolded after its id left the dedup set (purged) is
//!   not counted twice in the footprint.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use proptest::prelude::*;
use proptest::sample::select;

use meter::{
    ApiKeyId, BatchFold, Component, CounterKey, Dimension, EventId, EventKind, FactOutcome, Fold, Footprint, MeterType,
    Outcome, Price, PriceBook, PriceKey, ProjectId, StorageFact, StorageKind, StoredFootprint, TokenUsage, Totals,
    UsageFact, Usd, WindowKind,
};

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

fn zones() -> HashMap<ProjectId, Tz> {
    HashMap::from([
        (ProjectId::parse("p1").expect("id"), Tz::UTC),
        (ProjectId::parse("p2").expect("id"), chrono_tz::Asia::Kathmandu),
    ])
}

/// Prices `alpha`'s input and output from the start, and `beta`'s input
/// only from the second hour of the facts' span.
fn book() -> PriceBook {
    let price = |model: &str, component, picos, from| Price {
        key: PriceKey { provider: "openai".into(), model: model.into(), component },
        unit_price_usd: Usd(picos),
        effective_from: utc(from),
    };
    PriceBook::new([
        price("alpha", Component::InputTokens, 3, "2026-01-01T00:00:00Z"),
        price("alpha", Component::OutputTokens, 7, "2026-01-01T00:00:00Z"),
        price("beta", Component::InputTokens, 5, "2026-07-07T23:00:00Z"),
    ])
}

fn fact_strategy() -> impl Strategy<Value = UsageFact> {
    // Three hours across midnight UTC (Kathmandu's day changes at 18:15),
    // in whole seconds half the time so that instants tie.
    let base = utc("2026-07-07T22:00:00Z").timestamp();
    let kind = prop_oneof![
        1 => Just(EventKind::Request),
        1 => Just(EventKind::Call),
        1 => Just(EventKind::Tokens),
        2 => Just(EventKind::StorageDelta),
        1 => Just(EventKind::StorageSnapshot),
    ];
    let entry = (select(vec!["alpha", "beta"]), 0u64..50, 0u64..50, 0u64..5, any::<bool>()).prop_map(
        |(model, input, output, cached, embedding)| TokenUsage {
            provider: "openai".into(),
            model: model.into(),
            input,
            output,
            cached,
            embedding: embedding && model == "beta",
            ..TokenUsage::default()
        },
    );
    (
        select(vec!["p1", "p2"]),
        0u8..24,
        kind,
        prop_oneof![3 => Just(Outcome::Success), 1 => Just(Outcome::Failure)],
        0u64..100,
        0i64..(3 * 3600),
        prop_oneof![Just(0u32), 0u32..1_000_000],
        prop::collection::vec(entry, 1..3),
        -500i64..2000,
    )
        .prop_map(move |(p, id, kind, outcome, rows, secs, micros, tokens, bytes)| {
            let at = DateTime::<Utc>::from_timestamp(base + secs / 60 * 60, micros * 1000).expect("in range");
            let storage = matches!(kind, EventKind::StorageDelta | EventKind::StorageSnapshot);
            UsageFact {
                api_key_id: Some(ApiKeyId::parse("k1").expect("id")),
                actor_id: Some("u1".into()),
                agent_id: Some("bot".into()),
                outcome,
                rows: if kind == EventKind::Call { rows } else { 0 },
                tokens: if kind == EventKind::Tokens { tokens } else { Vec::new() },
                storage_bytes: storage.then_some(if kind == EventKind::StorageSnapshot { bytes.abs() } else { bytes }),
                gateway: "g1".into(),
                ..UsageFact::new(
                    EventId::parse(format!("e{id}")).expect("id"),
                    ProjectId::parse(p).expect("id"),
                    kind,
                    at,
                )
            }
        })
}

/// Resends of one event carry the same content: every fact with an id
/// already seen is replaced by the first fact with that id.
fn as_resends(facts: Vec<UsageFact>) -> Vec<UsageFact> {
    let mut first: BTreeMap<(ProjectId, EventId), UsageFact> = BTreeMap::new();
    facts.into_iter().map(|f| first.entry((f.project_id.clone(), f.id.clone())).or_insert(f).clone()).collect()
}

type ModelKey = (ProjectId, Dimension, WindowKind, String, PriceKey, MeterType, bool);
type Sums = BTreeMap<(ProjectId, CounterKey), (Option<DateTime<Utc>>, Totals)>;

/// A store in memory that persists a posting the way the SQL stores do.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct ModelStore {
    processed: HashSet<(ProjectId, EventId)>,
    sums: Sums,
    unpriced: BTreeSet<(ProjectId, CounterKey, PriceKey)>,
    models: BTreeMap<ModelKey, (u64, u64, Usd)>,
    storage: BTreeMap<(ProjectId, EventId), StorageFact>,
    footprints: BTreeMap<ProjectId, (i64, u64)>,
}

impl ModelStore {
    /// What `StoredFootprint` asks a store to read: the newest snapshot,
    /// the deltas after it and after the cut, summed, and the count.
    fn read(&self, project: &ProjectId, cut: Option<DateTime<Utc>>) -> StoredFootprint {
        let facts: Vec<&StorageFact> = self.storage.values().filter(|s| &s.project_id == project).collect();
        let snapshot = facts
            .iter()
            .filter(|s| s.kind == StorageKind::Snapshot)
            .max_by(|a, b| (a.occurred_at, &a.event_id).cmp(&(b.occurred_at, &b.event_id)))
            .map(|s| (s.occurred_at, s.event_id.clone(), s.bytes));
        let after = |t: Option<DateTime<Utc>>| -> i128 {
            facts
                .iter()
                .filter(|s| s.kind == StorageKind::Delta && t.is_none_or(|t| s.occurred_at > t))
                .map(|s| i128::from(s.bytes))
                .sum()
        };
        StoredFootprint {
            after_snapshot: after(snapshot.as_ref().map(|s| s.0)),
            after_cut: cut.map(|c| after(Some(c))).unwrap_or(0),
            snapshot,
            events: facts.len() as u64,
        }
    }

    fn fold(&mut self, facts: &[UsageFact]) -> Vec<FactOutcome> {
        let batch = BatchFold::new(facts);
        let new: HashSet<(ProjectId, EventId)> = batch
            .candidates()
            .into_iter()
            .map(|f| (f.project_id.clone(), f.id.clone()))
            .filter(|id| self.processed.insert(id.clone()))
            .collect();
        let posting = batch.post(&new, &zones(), &book()).expect("every project has a zone");
        for (p, c, t) in &posting.sums {
            self.sums.entry((p.clone(), c.key.clone())).or_insert((c.resets_at, Totals::default())).1.add(*t);
        }
        for (p, r) in &posting.unpriced {
            self.unpriced.insert((p.clone(), r.counter.key.clone(), r.key.clone()));
        }
        for m in &posting.model_usage {
            let key = (
                m.project_id.clone(),
                m.dimension.clone(),
                m.window,
                m.window_key.clone(),
                m.row.key.clone(),
                m.row.meter,
                m.row.embedding,
            );
            let e = self.models.entry(key).or_default();
            e.0 += m.row.priced_quantity;
            e.1 += m.row.unpriced_quantity;
            e.2 = e.2.saturating_add(m.row.cost);
        }
        // Read before keeping the batch's facts, as the stores do.
        let stored: BTreeMap<ProjectId, StoredFootprint> =
            posting.footprint_reads.iter().map(|r| (r.project_id.clone(), self.read(&r.project_id, r.cut))).collect();
        let mut kept = HashSet::new();
        for s in &posting.storage {
            let id = (s.project_id.clone(), s.event_id.clone());
            if !self.storage.contains_key(&id) {
                self.storage.insert(id.clone(), s.clone());
                kept.insert(id);
            }
        }
        for (p, fp) in posting.footprints(&stored, &kept) {
            self.footprints.insert(p, (fp.bytes(), fp.events()));
        }
        posting.outcomes
    }
}

/// Splits `facts` into batches at the given points.
fn batches(facts: &[UsageFact], cuts: &[prop::sample::Index]) -> Vec<Vec<UsageFact>> {
    let mut at: Vec<usize> = cuts.iter().map(|i| i.index(facts.len() + 1)).collect();
    at.push(0);
    at.push(facts.len());
    at.sort_unstable();
    at.windows(2).map(|w| facts[w[0]..w[1]].to_vec()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn batches_in_any_order_add_up_to_one_fold_and_the_footprint(
        (facts, shuffled) in prop::collection::vec(fact_strategy(), 0..60)
            .prop_flat_map(|f| { let f = as_resends(f); (Just(f.clone()), Just(f).prop_shuffle()) }),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let mut one = ModelStore::default();
        one.fold(&facts);
        let mut many = ModelStore::default();
        for b in batches(&shuffled, &cuts) {
            many.fold(&b);
        }
        prop_assert_eq!(&many.sums, &one.sums);
        prop_assert_eq!(&many.unpriced, &one.unpriced);
        prop_assert_eq!(&many.models, &one.models);
        prop_assert_eq!(&many.footprints, &one.footprints);

        // The sums are one Fold of the facts (the footprint apart).
        let mut fold = Fold::new();
        for f in &facts {
            fold.apply(f, zones()[&f.project_id], &book());
        }
        let expected: BTreeMap<_, _> = fold
            .totals()
            .filter(|(_, c, _)| c.key != CounterKey::footprint())
            .map(|(p, c, t)| ((p.clone(), c.key), (c.resets_at, t)))
            .collect();
        prop_assert_eq!(&one.sums, &expected);

        // Each footprint is the Footprint of the project's distinct storage facts.
        let mut expected: BTreeMap<ProjectId, Footprint> = BTreeMap::new();
        let mut seen = HashSet::new();
        for f in &facts {
            let storage = matches!(f.kind, EventKind::StorageDelta | EventKind::StorageSnapshot);
            if storage && seen.insert((&f.project_id, &f.id)) {
                expected.entry(f.project_id.clone()).or_default().apply(f);
            }
        }
        let expected: BTreeMap<_, _> = expected.into_iter().map(|(p, fp)| (p, (fp.bytes(), fp.events()))).collect();
        prop_assert_eq!(&one.footprints, &expected);
    }

    #[test]
    fn a_batch_folded_again_adds_nothing(
        facts in prop::collection::vec(fact_strategy(), 0..60),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
    ) {
        let parts = batches(&facts, &cuts);
        let mut store = ModelStore::default();
        for b in &parts {
            store.fold(b);
        }
        let once = store.clone();
        for b in &parts {
            let outcomes = store.fold(b);
            prop_assert!(outcomes.iter().all(|o| *o == FactOutcome::Duplicate), "{:?}", outcomes);
        }
        prop_assert_eq!(&store, &once);
        // Every id folded once: as many Folded outcomes as distinct ids.
        let distinct: HashSet<_> = facts.iter().map(|f| (&f.project_id, &f.id)).collect();
        prop_assert_eq!(once.processed.len(), distinct.len());
    }

    #[test]
    fn a_storage_fact_refolded_after_a_purge_is_not_counted_twice(
        facts in prop::collection::vec(fact_strategy(), 1..40),
        forget in prop::collection::vec(any::<bool>(), 40),
    ) {
        let facts = as_resends(facts);
        let mut store = ModelStore::default();
        store.fold(&facts);
        let before = store.footprints.clone();
        // The dedup set forgets some ids; their storage facts stay kept.
        let ids: Vec<_> = store.processed.iter().cloned().collect();
        for (id, gone) in ids.iter().zip(&forget) {
            if *gone {
                store.processed.remove(id);
            }
        }
        store.fold(&facts);
        prop_assert_eq!(&store.footprints, &before);
    }
}
