//! Laws of corrections (`meter::correction`, folded by `meter::ledger`),
//! checked against a model store kept here that persists a posting the way
//! the SQL stores do (a dedup set holding what each call and tokens event
//! counts now, signed sums floored at zero, the breakdown by model):
//!
//! - an amend gives what folding the amended original would have given;
//! - amend then void ≡ void ≡ the original never sent;
//! - a correction sent twice (in one batch or two) counts once;
//! - how the events are split into batches, and how the chains of unrelated
//!   originals interleave, changes nothing;
//! - what is refused (unknown, voided, uncorrectable, later on the log,
//!   past the horizon) changes nothing and is forgotten.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use meter::correction::Counted;
use meter::{
    ApiKeyId, AuditAction, AuditDetail, BatchFold, Component, CounterKey, Dimension, EventId, EventKind, FactOutcome,
    Field, MeterType, Price, PriceBook, PriceKey, ProjectId, Target, TokenUsage, UsageFact, Usd, WindowKind,
};
use proptest::prelude::*;

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

fn pid(s: &str) -> ProjectId {
    ProjectId::parse(s).expect("project id")
}

fn eid(s: &str) -> EventId {
    EventId::parse(s).expect("event id")
}

fn zones() -> HashMap<ProjectId, Tz> {
    HashMap::from([(pid("p1"), Tz::UTC), (pid("p2"), chrono_tz::Asia::Kathmandu)])
}

/// `alpha`'s input priced from the start; its output only by a row put at
/// 13:00 (so what was received before is unpriced, and stays so).
fn book() -> PriceBook {
    let key = |component| PriceKey { provider: "openai".into(), model: "alpha".into(), component };
    let mut book = PriceBook::new([Price {
        key: key(Component::InputTokens),
        unit_price_usd: Usd(3),
        effective_from: utc("2026-01-01T00:00:00Z"),
    }]);
    book.insert_version(
        Price {
            key: key(Component::OutputTokens),
            unit_price_usd: Usd(7),
            effective_from: utc("2026-01-01T00:00:00Z"),
        },
        utc("2026-07-07T13:00:00Z"),
    );
    book
}

const AT: &str = "2026-07-07T12:31:00Z";

fn call(project: &str, id: &str, rows: u64) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse("k1").expect("key")),
        actor_id: Some("u1".into()),
        rows,
        received_at: Some(utc(AT)),
        gateway: "g1".into(),
        ..UsageFact::new(eid(id), pid(project), EventKind::Call, utc(AT))
    }
}

fn entry(input: u64, output: u64) -> TokenUsage {
    TokenUsage { provider: "openai".into(), model: "alpha".into(), input, output, ..TokenUsage::default() }
}

fn tokens(project: &str, id: &str, input: u64, output: u64) -> UsageFact {
    UsageFact {
        agent_id: Some("bot".into()),
        actor_id: Some("u1".into()),
        tokens: vec![entry(input, output)],
        received_at: Some(utc(AT)),
        gateway: "g1".into(),
        ..UsageFact::new(eid(id), pid(project), EventKind::Tokens, utc(AT))
    }
}

fn correction(project: &str, id: &str, of: &str) -> UsageFact {
    UsageFact {
        corrects: Some(eid(of)),
        received_at: Some(utc("2026-07-08T09:00:00Z")),
        gateway: "g2".into(),
        ..UsageFact::new(eid(id), pid(project), EventKind::Correction, utc("2026-07-08T09:00:00Z"))
    }
}

fn void(project: &str, id: &str, of: &str) -> UsageFact {
    UsageFact { void: true, ..correction(project, id, of) }
}

fn amend_rows(project: &str, id: &str, of: &str, rows: u64) -> UsageFact {
    UsageFact { rows, ..correction(project, id, of) }
}

fn amend_tokens(project: &str, id: &str, of: &str, input: u64, output: u64) -> UsageFact {
    UsageFact { tokens: vec![entry(input, output)], ..correction(project, id, of) }
}

type Sums = BTreeMap<(ProjectId, CounterKey), [i64; 13]>;
type Models = BTreeMap<(ProjectId, Dimension, WindowKind, String, PriceKey, MeterType, bool), [i64; 3]>;

/// A store in memory that persists a posting the way the SQL stores do.
#[derive(Debug, Default, Clone)]
struct ModelStore {
    processed: HashMap<(ProjectId, EventId), String>,
    sums: Sums,
    models: Models,
    unpriced: BTreeSet<(ProjectId, CounterKey, PriceKey)>,
    audit: Vec<meter::AuditEntry>,
    refused: Vec<(ProjectId, EventId, String)>,
}

impl ModelStore {
    fn fold(&mut self, facts: &[UsageFact]) -> Vec<FactOutcome> {
        let plan = BatchFold::new(facts);
        let zones = zones();
        let mut new = HashSet::new();
        for f in plan.candidates() {
            let key = (f.project_id.clone(), f.id.clone());
            if !self.processed.contains_key(&key) {
                let tz = zones[&f.project_id];
                self.processed.insert(key.clone(), Counted::encode(Counted::of(f, tz).as_ref()));
                new.insert(key);
            }
        }
        let targets: HashMap<_, _> = plan
            .correction_targets()
            .into_iter()
            .filter_map(|k| self.processed.get(&k).map(|s| (k, Target::decode(s).expect("stored"))))
            .collect();
        let posting = plan.post_with(&new, &zones, &book(), &targets, Duration::days(35)).expect("post");
        for (p, c, d) in posting.counter_changes() {
            let e = self.sums.entry((p, c.key)).or_default();
            for f in Field::ALL {
                let i = f.index();
                let v = e[i].saturating_add(d[i]);
                e[i] = if f == Field::Storage { v } else { v.max(0) };
            }
        }
        for m in posting.model_changes() {
            let key = (m.project_id, m.dimension, m.window, m.window_key, m.key, m.meter, m.embedding);
            let e = self.models.entry(key).or_default();
            for (x, d) in e.iter_mut().zip([m.priced_quantity, m.unpriced_quantity, m.cost_picos]) {
                *x = x.saturating_add(d).max(0);
            }
        }
        for (p, r) in &posting.unpriced {
            self.unpriced.insert((p.clone(), r.counter.key.clone(), r.key.clone()));
        }
        for (p, e, c) in &posting.recounts {
            self.processed.insert((p.clone(), e.clone()), Counted::encode(Some(c)));
        }
        for (f, _) in posting.refused() {
            self.processed.remove(&(f.project_id.clone(), f.id.clone()));
        }
        self.audit.extend(posting.audit.iter().cloned());
        self.refused.extend(posting.report().refused);
        posting.outcomes
    }

    /// The aggregates without the rows that hold nothing (a voided event
    /// leaves its counters at zero, where it never came leaves none).
    fn totals(&self) -> (Sums, Models) {
        let sums = self.sums.iter().filter(|(_, v)| v.iter().any(|x| *x != 0)).map(|(k, v)| (k.clone(), *v)).collect();
        let models =
            self.models.iter().filter(|(_, v)| v.iter().any(|x| *x != 0)).map(|(k, v)| (k.clone(), *v)).collect();
        (sums, models)
    }
}

fn folded(batches: &[&[UsageFact]]) -> ModelStore {
    let mut s = ModelStore::default();
    for b in batches {
        s.fold(b);
    }
    s
}

fn calls_of(s: &ModelStore, project: &str) -> (i64, i64) {
    let day = s
        .sums
        .iter()
        .find(|((p, k), _)| p == &pid(project) && k.dimension == Dimension::Project && k.window == WindowKind::Day)
        .map(|(_, v)| *v)
        .unwrap_or_default();
    (day[Field::Calls.index()], day[Field::Rows.index()])
}

/// What the dedup set keeps of a call, as rows written before the stored
/// form left out its empty parts spell it: every part, `null`, `[]`,
/// `false` and a zero estimate included.
const SPELLED_OUT: &str = r#"{"fact":{"id":"c1","project_id":"p2","api_key_id":"k1","agent_id":null,"actor_id":"u1","user_id":null,"occurred_at":"2026-07-07T12:31:00Z","kind":"call","outcome":"success","rows":10,"tokens":[],"storage_bytes":null,"meter_type":null,"reservation_id":null,"gateway":"","received_at":"2026-07-07T12:31:00Z","admitted":null,"lease_until":null,"held":[],"estimate":{"tokens":0,"cost":0},"breaches":[],"corrects":null,"void":false},"tz":"Asia/Kathmandu","voided":false,"corrected_by":null}"#;

#[test]
fn the_stored_form_leaves_out_empty_parts_and_reads_rows_that_spell_them_out() {
    let tz = chrono_tz::Asia::Kathmandu;
    let counted = Counted::of(&call("p2", "c1", 10), tz);
    let stored = Counted::encode(counted.as_ref());
    for empty in ["null", "[]", "false", "\"gateway\"", "\"estimate\""] {
        assert!(!stored.contains(empty), "{empty} in {stored}");
    }
    assert!(stored.len() * 2 < SPELLED_OUT.len(), "{} bytes: {stored}", stored.len());
    assert_eq!(Counted::decode(&stored).expect("compact"), counted);
    assert_eq!(Counted::decode(SPELLED_OUT).expect("spelled out"), counted);
    // What is not empty is kept, a void and its correction included.
    let full = Counted {
        voided: true,
        corrected_by: Some(eid("x1")),
        fact: UsageFact {
            user_id: Some("user:ann".into()),
            storage_bytes: Some(-4),
            meter_type: Some(MeterType::LlmTokens),
            admitted: Some(false),
            lease_until: Some(utc(AT)),
            estimate: meter::Estimate { tokens: 7, cost: 9 },
            corrects: Some(eid("c0")),
            void: true,
            gateway: "g1".into(),
            ..tokens("p2", "t1", 5, 6)
        },
        ..Counted::of(&tokens("p2", "t1", 5, 6), tz).expect("tokens events are counted")
    };
    assert_eq!(Counted::decode(&Counted::encode(Some(&full))).expect("full"), Some(full));
}

#[test]
fn an_amend_replaces_the_quantities_and_a_void_takes_everything_back() {
    let base = [call("p1", "c1", 10), call("p1", "c2", 5)];
    let s = folded(&[&base, &[amend_rows("p1", "x1", "c1", 3)]]);
    assert_eq!(calls_of(&s, "p1"), (2, 8));
    assert_eq!(s.totals(), folded(&[&[call("p1", "c1", 3), call("p1", "c2", 5)]]).totals());
    // Amends in sequence: the newest is the truth.
    let s = folded(&[&base, &[amend_rows("p1", "x1", "c1", 3), amend_rows("p1", "x2", "c1", 40)]]);
    assert_eq!(calls_of(&s, "p1"), (2, 45));
    // A void: the call and its rows are gone from every counter.
    let s = folded(&[&base, &[void("p1", "x1", "c1")]]);
    assert_eq!(calls_of(&s, "p1"), (1, 5));
    assert_eq!(s.totals(), folded(&[&[call("p1", "c2", 5)]]).totals());
}

#[test]
fn a_tokens_amend_is_priced_as_of_the_originals_receipt() {
    // Received at 12:31, before the output price was put: output unpriced,
    // and the amend (received the next day) reprices nothing.
    let s = folded(&[&[tokens("p1", "t1", 100, 10)], &[amend_tokens("p1", "x1", "t1", 50, 20)]]);
    assert_eq!(s.totals(), folded(&[&[tokens("p1", "t1", 50, 20)]]).totals());
    let day = s
        .sums
        .iter()
        .find(|((_, k), _)| k.dimension == Dimension::Project && k.window == WindowKind::Day)
        .map(|(_, v)| *v)
        .expect("day");
    assert_eq!(day[Field::Tokens.index()], 70);
    assert_eq!(day[Field::CostLlmTokens.index()], 150, "50 input tokens at 3 picodollars; output unpriced");
    assert_eq!((day[Field::LlmEvents.index()], day[Field::LlmUnpriced.index()]), (1, 1));
    // Voided: the cost, the counts and the breakdown by model go back to zero.
    let s = folded(&[&[tokens("p1", "t1", 100, 10)], &[void("p1", "x1", "t1")]]);
    assert_eq!(s.totals(), (Sums::new(), Models::new()));
}

#[test]
fn what_is_refused_changes_nothing_and_says_why() {
    let base = [call("p1", "c1", 10), call("p2", "c9", 1), UsageFact { ..call("p1", "r1", 0) }];
    let request = UsageFact { rows: 0, ..UsageFact::new(eid("q1"), pid("p1"), EventKind::Request, utc(AT)) };
    let mut s = folded(&[&base, &[request], &[void("p1", "x0", "c1")]]);
    let before = s.totals();
    let cases = [
        (amend_rows("p1", "x1", "nope", 1), "no event nope of project p1 is folded"),
        (amend_rows("p1", "x2", "c9", 1), "no event c9 of project p1 is folded"),
        (amend_rows("p1", "x3", "c1", 1), "already voided"),
        (void("p1", "x4", "q1"), "not a call or tokens event"),
        (void("p1", "x5", "x0"), "not a call or tokens event"),
        (amend_tokens("p1", "x6", "r1", 1, 1), "is a call"),
    ];
    for (c, why) in cases {
        assert_eq!(s.fold(std::slice::from_ref(&c)), vec![FactOutcome::Refused], "{why}");
        let (_, id, reason) = s.refused.last().expect("refused").clone();
        assert_eq!(id, c.id);
        assert!(reason.contains(why), "{reason}");
        assert!(!s.processed.contains_key(&(c.project_id.clone(), c.id.clone())), "a refused id is forgotten");
    }
    assert_eq!(s.totals(), before);
    // Past the horizon at the correction's receipt.
    let late = UsageFact { received_at: Some(utc(AT) + Duration::days(36)), ..amend_rows("p1", "x7", "r1", 2) };
    assert_eq!(s.fold(&[late]), vec![FactOutcome::Refused]);
    assert!(s.refused.last().expect("refused").2.contains("dedup horizon"));
    assert_eq!(s.totals(), before);
}

#[test]
fn a_correction_before_its_original_in_one_batch_is_refused_after_it_folded() {
    let s = folded(&[&[amend_rows("p1", "x1", "c1", 1), call("p1", "c1", 10), amend_rows("p1", "x2", "c1", 4)]]);
    assert_eq!(s.refused.len(), 1);
    assert_eq!(s.refused[0].1, eid("x1"));
    assert_eq!(calls_of(&s, "p1"), (1, 4));
    // Forgotten, so the same correction can come again once the original is folded.
    let mut s = s;
    assert_eq!(s.fold(&[amend_rows("p1", "x1", "c1", 7)]), vec![FactOutcome::Folded]);
    assert_eq!(calls_of(&s, "p1"), (1, 7));
}

#[test]
fn each_correction_folded_writes_one_audit_entry_naming_both_events() {
    let s = folded(&[&[call("p1", "c1", 10)], &[amend_rows("p1", "x1", "c1", 3), void("p1", "x2", "c1")]]);
    assert_eq!(s.audit.len(), 2);
    let e = &s.audit[0];
    assert_eq!(
        (e.action, e.resource.as_str(), e.action.as_str()),
        (AuditAction::CorrectEvent, "c1", "events:CorrectEvent")
    );
    match &e.detail {
        AuditDetail::EventCorrection { original_id, correction_id, void, before, after, .. } => {
            assert_eq!((original_id.as_str(), correction_id.as_str(), *void), ("c1", "x1", false));
            assert_eq!((before.rows, after.rows), (10, 3));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(e.once_key().as_deref(), Some("correction/p1/x1"));
    assert_eq!(e.principal.as_ref().map(|p| p.id.as_str()), Some("g2"));
    // The same entry whoever folds it: the id comes from the correction.
    let again = folded(&[&[call("p1", "c1", 10)], &[amend_rows("p1", "x1", "c1", 3)]]);
    assert_eq!(again.audit[0], s.audit[0]);
    assert!(e.id.as_str().starts_with("aud_") && e.id.as_str().len() == 36);
}

#[test]
fn a_counter_is_never_taken_below_zero() {
    // A counter saturated (or written otherwise): the difference floors at zero.
    let mut s = folded(&[&[call("p1", "c1", 10)]]);
    for v in s.sums.values_mut() {
        v[Field::Rows.index()] = 4;
    }
    s.fold(&[void("p1", "x1", "c1")]);
    assert_eq!(calls_of(&s, "p1"), (0, 0));
}

/// One original and what happens to it: amends (Some(rows or input tokens))
/// and voids (None), in order.
#[derive(Debug, Clone)]
struct Chain {
    project: &'static str,
    tokens: bool,
    quantity: u64,
    corrections: Vec<Option<u64>>,
}

fn chain_strategy() -> impl Strategy<Value = Chain> {
    (
        prop::sample::select(vec!["p1", "p2"]),
        any::<bool>(),
        0u64..100,
        prop::collection::vec(prop::option::weighted(0.8, 0u64..100), 0..4),
    )
        .prop_map(|(project, tokens, quantity, corrections)| Chain { project, tokens, quantity, corrections })
}

impl Chain {
    fn original(&self, i: usize) -> UsageFact {
        let id = format!("o{i}");
        if self.tokens { tokens(self.project, &id, self.quantity, 3) } else { call(self.project, &id, self.quantity) }
    }

    fn events(&self, i: usize) -> Vec<UsageFact> {
        let of = format!("o{i}");
        let mut out = vec![self.original(i)];
        for (j, c) in self.corrections.iter().enumerate() {
            let id = format!("x{i}-{j}");
            out.push(match (c, self.tokens) {
                (None, _) => void(self.project, &id, &of),
                (Some(q), true) => amend_tokens(self.project, &id, &of, *q, 3),
                (Some(q), false) => amend_rows(self.project, &id, &of, *q),
            });
        }
        out
    }

    /// What the original comes to: nothing if voided (later corrections of
    /// it are refused), else its last amend.
    fn truth(&self, i: usize) -> Option<UsageFact> {
        let mut fact = self.original(i);
        for c in &self.corrections {
            match c {
                None => return None,
                Some(q) if self.tokens => fact.tokens = vec![entry(*q, 3)],
                Some(q) => fact.rows = *q,
            }
        }
        Some(fact)
    }
}

/// The chains' events interleaved as `order` says (a chain's own events
/// stay in order), split into batches at `cuts`.
fn interleave(chains: &[Chain], order: &[usize]) -> Vec<UsageFact> {
    let mut queues: Vec<std::collections::VecDeque<UsageFact>> =
        chains.iter().enumerate().map(|(i, c)| c.events(i).into()).collect();
    let mut out = Vec::new();
    for pick in order {
        let n = queues.len();
        if let Some(q) = (0..n).map(|k| (pick + k) % n).find(|k| !queues[*k].is_empty()) {
            out.extend(queues[q].pop_front());
        }
    }
    for q in &mut queues {
        out.extend(q.drain(..));
    }
    out
}

fn split(facts: &[UsageFact], cuts: &[prop::sample::Index]) -> Vec<Vec<UsageFact>> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c.index(facts.len() + 1)).collect();
    at.push(0);
    at.push(facts.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| facts[w[0]..w[1]].to_vec()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn corrections_fold_to_the_truth_in_any_batches_and_interleaving(
        chains in prop::collection::vec(chain_strategy(), 1..5),
        order in prop::collection::vec(0usize..5, 0..24),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..5),
    ) {
        let events = interleave(&chains, &order);
        let mut s = ModelStore::default();
        for b in split(&events, &cuts) {
            s.fold(&b);
        }
        let truth: Vec<UsageFact> = chains.iter().enumerate().filter_map(|(i, c)| c.truth(i)).collect();
        prop_assert_eq!(s.totals(), folded(&[&truth]).totals());
        // Every correction folded or refused (after a void), none skipped.
        let corrections: usize = chains.iter().map(|c| c.corrections.len()).sum();
        prop_assert_eq!(s.audit.len() + s.refused.len(), corrections);
    }

    #[test]
    fn amend_then_void_is_void_and_a_correction_resent_counts_once(
        chains in prop::collection::vec(chain_strategy(), 1..4),
        amend in 0u64..100,
        resend_in_batch in any::<bool>(),
    ) {
        let base: Vec<UsageFact> = chains.iter().enumerate().map(|(i, c)| c.original(i)).collect();
        let amended = amend_rows(chains[0].project, "a", "o0", amend);
        let amended = if chains[0].tokens { amend_tokens(chains[0].project, "a", "o0", amend, 3) } else { amended };
        let voided = void(chains[0].project, "v", "o0");
        let amend_void = folded(&[&base, std::slice::from_ref(&amended), std::slice::from_ref(&voided)]);
        let just_void = folded(&[&base, std::slice::from_ref(&voided)]);
        prop_assert_eq!(amend_void.totals(), just_void.totals());
        prop_assert_eq!(just_void.totals(), folded(&[&base[1..]]).totals());

        let once = folded(&[&base, std::slice::from_ref(&amended)]);
        let twice = if resend_in_batch {
            folded(&[&base, &[amended.clone(), amended.clone()]])
        } else {
            folded(&[&base, std::slice::from_ref(&amended), std::slice::from_ref(&amended)])
        };
        prop_assert_eq!(twice.totals(), once.totals());
        prop_assert_eq!(twice.audit.len(), 1);
    }
}
