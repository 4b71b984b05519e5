//! Folding facts into per-counter totals.
//!
//! The fold is a sum keyed by (project, counter), so it is associative and
//! commutative: any order of the same facts gives the same totals. It is
//! idempotent per event id: a fact whose id was already applied adds nothing.
//! A store folds each batch with it ([`crate::ledger`]), after its dedup set
//! has filtered out the ids it saw in earlier batches, and upserts the result
//! in one statement.

use std::collections::{BTreeMap, HashSet};

use chrono_tz::Tz;

use crate::ids::{EventId, ProjectId};
use crate::price::PriceBook;
use crate::usage::{Counter, CounterKey, Dimension, Totals, UsageFact, each_counter};
use crate::window::WindowKind;

/// The offsets one batch moves, partition by partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetMove {
    pub partition: i32,
    /// Where the batch started: the stored offset must still be this.
    pub from: i64,
    /// The next offset to read after the batch.
    pub to: i64,
}

/// One batch for the store to fold, atomically with its offsets.
///
/// Every record the offsets move past is either one of `facts` (folded or a
/// duplicate) or one of `dead_letters`: none is skipped. The store keeps the
/// dead letters in the fold's transaction (its dead-letter outbox), and the
/// projector publishes them to the dead-letter topic from there, once.
#[derive(Debug, Clone, Default)]
pub struct FoldBatch {
    pub consumer: String,
    pub topic: String,
    pub offsets: Vec<OffsetMove>,
    pub facts: Vec<UsageFact>,
    pub dead_letters: Vec<DeadLetter>,
    /// Where facts came from on the log, by their index in `facts`: the
    /// record a refused correction is dead-lettered as. A store refuses the
    /// batch ([`crate::PortError::Permanent`]) for a refused correction
    /// with no source here.
    pub sources: BTreeMap<usize, FactSource>,
    /// The dedup horizon (`None`: [`crate::usage::DEFAULT_DEDUP_HORIZON`]):
    /// an original a correction names must be within it at the
    /// correction's receipt.
    pub horizon: Option<chrono::Duration>,
}

/// A record of the log a fact was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FactSource {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

impl FoldBatch {
    /// The newest receipt of the batch's facts ([`UsageFact::receipt`]):
    /// how far the fold has come in receipt time, which is what the dedup
    /// set's purge is measured from (never a wall clock).
    pub fn newest_receipt(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        self.facts.iter().map(UsageFact::receipt).max()
    }
}

/// A record of the log that is not folded, with why: what the dead-letter
/// topic gets (the original key and bytes, the reason, the source position).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// `malformed: …`, `invalid: …`, `out of range: …` or `refused by the
    /// store: …`.
    pub reason: String,
}

/// Where the dead-letter topic ended, partition by partition (the next
/// offset of each), before a publish of dead letters: a publisher that may
/// have written them already looks for them only past it.
pub type DlqMark = BTreeMap<i32, i64>;

/// A dead letter the store holds that is not known to be on the dead-letter
/// topic yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingDeadLetter {
    pub letter: DeadLetter,
    /// Set before the first attempt to publish it: the topic's end then. A
    /// letter with a mark may be on the topic already (the attempt's outcome
    /// was not recorded), so it is looked for past the mark before it is
    /// published again.
    pub mark: Option<DlqMark>,
}

/// What a fold did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FoldReport {
    pub folded: Vec<(ProjectId, EventId)>,
    pub duplicates: Vec<(ProjectId, EventId)>,
    /// The new durable totals of every counter the batch touched.
    pub totals: Vec<(ProjectId, Counter, Totals)>,
    /// Corrections the fold refused, with why (`corrects: …`): the store
    /// dead-letters their records in the fold's transaction.
    pub refused: Vec<(ProjectId, EventId, String)>,
    /// Of `totals`, those a correction took usage back from: the view
    /// lowers them ([`crate::View::lower_totals`]; a fold only raises).
    pub lowered: Vec<(ProjectId, Counter, Totals)>,
}

/// A counter's folded totals and when its window resets.
type Entry = (Totals, Option<chrono::DateTime<chrono::Utc>>);

/// A project's counters: by dimension, then window kind, then window key.
type Counters = BTreeMap<Dimension, BTreeMap<WindowKind, BTreeMap<String, Entry>>>;

/// Totals folded so far, by project and counter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fold {
    seen: HashSet<(ProjectId, EventId)>,
    /// By project, then counter (its dimension, window kind and window key,
    /// nested in [`CounterKey`]'s order), so that adding to a counter
    /// already held looks it up by borrowed parts and copies no name: only
    /// a project, dimension or window key seen for the first time is copied.
    totals: BTreeMap<ProjectId, Counters>,
}

impl Fold {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one fact, priced against `book`; returns false (and adds
    /// nothing) for an id already applied. On the footprint counter the
    /// `storage` sum is of deltas only: the store turns it into the footprint
    /// ([`crate::usage::Footprint`]).
    pub fn apply(&mut self, fact: &UsageFact, tz: Tz, book: &PriceBook) -> bool {
        if !self.seen.insert((fact.project_id.clone(), fact.id.clone())) {
            return false;
        }
        let totals = &mut self.totals;
        each_counter(
            fact,
            tz,
            book,
            |_, _| true,
            |dimension, window, delta| {
                // Found again per counter (a lookup, where a new entry would
                // copy the id): a fact that lands nowhere adds no project.
                if !totals.contains_key(&fact.project_id) {
                    totals.insert(fact.project_id.clone(), BTreeMap::new());
                }
                let Some(counters) = totals.get_mut(&fact.project_id) else { return };
                if !counters.contains_key(dimension) {
                    counters.insert(dimension.clone(), BTreeMap::new());
                }
                let Some(windows) = counters.get_mut(dimension) else { return };
                let keys = windows.entry(window.kind).or_default();
                match keys.get_mut(window.key.as_str()) {
                    Some(entry) => entry.0.add(delta),
                    None => {
                        let mut totals = Totals::default();
                        totals.add(delta);
                        keys.insert(window.key.clone(), (totals, window.resets_at));
                    }
                }
            },
        );
        true
    }

    /// The folded totals, ordered by project then counter.
    pub fn totals(&self) -> impl Iterator<Item = (&ProjectId, Counter, Totals)> + '_ {
        self.totals.iter().flat_map(|(p, dimensions)| {
            dimensions.iter().flat_map(move |(dimension, windows)| {
                windows.iter().flat_map(move |(&window, keys)| {
                    keys.iter().map(move |(window_key, (t, resets_at))| {
                        let key = CounterKey { dimension: dimension.clone(), window, window_key: window_key.clone() };
                        (p, Counter { key, resets_at: *resets_at }, *t)
                    })
                })
            })
        })
    }

    pub fn is_empty(&self) -> bool {
        self.totals.is_empty()
    }

    /// The number of distinct events applied.
    pub fn events(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Utc};

    use super::*;
    use crate::ids::ApiKeyId;
    use crate::usage::{Dimension, EventKind, Outcome};
    use crate::window::WindowKind;

    fn fact(project: &str, id: &str, kind: EventKind, outcome: Outcome, rows: u64) -> UsageFact {
        UsageFact {
            api_key_id: Some(ApiKeyId::parse("k1").expect("key id")),
            actor_id: Some("u1".into()),
            outcome,
            rows,
            gateway: "g1".into(),
            ..UsageFact::new(
                EventId::parse(id).expect("event id"),
                ProjectId::parse(project).expect("project id"),
                kind,
                DateTime::parse_from_rfc3339("2026-07-07T12:31:00Z").expect("ts").with_timezone(&Utc),
            )
        }
    }

    fn project_day(fold: &Fold, project: &str) -> Option<Totals> {
        fold.totals()
            .find(|(p, c, _)| {
                p.as_str() == project && c.key.dimension == Dimension::Project && c.key.window == WindowKind::Day
            })
            .map(|(_, _, t)| t)
    }

    #[test]
    fn an_event_id_counts_once_per_project() {
        let mut fold = Fold::new();
        let call = fact("p1", "e1", EventKind::Call, Outcome::Success, 7);
        assert!(fold.apply(&call, Tz::UTC, &PriceBook::default()));
        assert!(!fold.apply(&call, Tz::UTC, &PriceBook::default()), "a resend adds nothing");
        // Even with other content: the id decides.
        assert!(!fold.apply(&fact("p1", "e1", EventKind::Call, Outcome::Success, 99), Tz::UTC, &PriceBook::default()));
        assert_eq!(project_day(&fold, "p1"), Some(Totals { calls: 1, rows: 7, ..Totals::default() }));
        // The same id in another project is another event.
        assert!(fold.apply(&fact("p2", "e1", EventKind::Request, Outcome::Success, 0), Tz::UTC, &PriceBook::default()));
        assert_eq!(project_day(&fold, "p2"), Some(Totals { requests: 1, ..Totals::default() }));
        assert_eq!(fold.events(), 2);
    }

    #[test]
    fn a_failed_call_is_seen_but_adds_no_counter() {
        let mut fold = Fold::new();
        assert!(fold.apply(&fact("p1", "e1", EventKind::Call, Outcome::Failure, 5), Tz::UTC, &PriceBook::default()));
        assert!(fold.is_empty());
        assert_eq!(fold.events(), 1);
        assert!(!fold.apply(&fact("p1", "e1", EventKind::Call, Outcome::Success, 5), Tz::UTC, &PriceBook::default()));
        assert!(fold.is_empty());
    }

    #[test]
    fn a_batch_knows_its_newest_receipt() {
        let mut a = fact("p1", "e1", EventKind::Call, Outcome::Success, 1);
        let b = fact("p1", "e2", EventKind::Call, Outcome::Success, 1);
        a.received_at = Some(a.occurred_at + chrono::Duration::minutes(3));
        let batch = FoldBatch { facts: vec![a.clone(), b], ..FoldBatch::default() };
        assert_eq!(batch.newest_receipt(), a.received_at);
        assert_eq!(FoldBatch::default().newest_receipt(), None);
    }

    #[test]
    fn totals_are_ordered_and_carry_their_reset() {
        let mut fold = Fold::new();
        fold.apply(&fact("p2", "e1", EventKind::Call, Outcome::Success, 1), Tz::UTC, &PriceBook::default());
        fold.apply(&fact("p1", "e2", EventKind::Call, Outcome::Success, 1), Tz::UTC, &PriceBook::default());
        let rows: Vec<_> = fold.totals().map(|(p, c, _)| (p.clone(), c)).collect();
        assert_eq!(rows.len(), 2 * 4 * 5, "two projects, four dimensions, five windows");
        assert!(rows.windows(2).all(|w| (&w[0].0, &w[0].1.key) < (&w[1].0, &w[1].1.key)));
        assert!(rows.iter().all(|(_, c)| c.resets_at.is_some()));
    }
}
