//! The fold of one batch, as a durable store persists it.
//!
//! A store's [`Ledger::fold_batch`](crate::ports::Ledger::fold_batch) only
//! does I/O: it fences the offsets, asks its dedup set which ids are new,
//! reads what the arithmetic needs (time zones, the prices of the batch's
//! models, what it holds of each touched project's storage footprint) and
//! writes what this module computed. Everything in between is here, once for
//! every database:
//!
//! 1. [`BatchFold::new`] takes the batch's facts. Within a batch the first
//!    occurrence of a (project, event id) wins; [`BatchFold::candidates`]
//!    lists those in (project, id) order, the order a store offers them to
//!    its dedup set (so concurrent writers take row locks alike). The store's
//!    `INSERT … ON CONFLICT DO NOTHING RETURNING` stays the judge of which
//!    ids it never folded.
//! 2. [`BatchFold::post`], given those new ids, each project's time zone and
//!    the slice of the price book the batch names ([`BatchFold::price_keys`];
//!    every version of it, each fact priced by the book as of its receipt),
//!    returns a [`Posting`]: one [`FactOutcome`] per fact, the sums to add to
//!    each counter (with its reset), the unpriced rows, the token breakdown by
//!    model for the day and month, the storage facts to keep, and what to read
//!    of each touched project's stored footprint ([`FootprintRead`]).
//! 3. [`Posting::footprints`], given what the store read
//!    ([`StoredFootprint`]) and which storage facts it actually kept, returns
//!    each touched project's new [`Footprint`]: the store sets it, never adds.
//!
//! Guarantees (property-tested in `meter/tests/ledger.rs` against a model
//! store): folding facts batch by batch, in any split and any order, with any
//! redelivery, adds up to one [`Fold`] of the distinct facts, and leaves each
//! project's footprint equal to the [`Footprint`] of all its storage facts; a
//! batch folded again adds nothing.
//!
//! Outcomes are per fact, not one verdict for the batch, so that a fold can
//! later refuse or saturate one record and fold the rest.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, SubsecRound, TimeDelta, Utc};
use chrono_tz::Tz;

use crate::audit::AuditEntry;
use crate::correction::{self, Counted, Delta, ModelKey as CorrectionModelKey, Target};
use crate::error::{FieldError, named};
use crate::fold::{Fold, FoldReport};
use crate::ids::{EventId, ProjectId};
use crate::price::{MeterType, PriceBook, PriceKey, Usd};
use crate::report::{ModelUsageRow, UnpricedRow};
use crate::usage::{
    Counter, CounterKey, Dimension, EventKind, Footprint, Totals, UsageFact, component_usage, counters_for,
    dimensions_of, priced,
};
use crate::window::{WindowKind, window_at};

/// A counter's reset and a signed change to it.
type CounterChange = (Option<DateTime<Utc>>, Delta);

/// The windows the token breakdown by model is kept for.
pub const MODEL_USAGE_WINDOWS: [WindowKind; 2] = [WindowKind::Day, WindowKind::CalendarMonth];

/// What became of one fact of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FactOutcome {
    /// New: added to the aggregates.
    Folded,
    /// Its id was folded before, in an earlier batch or earlier in this
    /// one: it adds nothing.
    Duplicate,
    /// A correction the fold refuses (see [`crate::correction`]): it adds
    /// nothing, its id is forgotten, and its record is dead-lettered with
    /// the reason [`Posting::refusals`] gives.
    Refused,
}

/// A fact of a project the store does not know: a bug upstream (the
/// projector dead-letters those), so the batch fails and changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("project {project_id} of event {event_id} does not exist")]
pub struct UnknownProject {
    pub project_id: ProjectId,
    pub event_id: EventId,
}

/// The two kinds of storage fact, as a store keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StorageKind {
    Delta,
    Snapshot,
}

impl StorageKind {
    pub const ALL: [StorageKind; 2] = [StorageKind::Delta, StorageKind::Snapshot];

    pub fn as_str(self) -> &'static str {
        match self {
            StorageKind::Delta => "delta",
            StorageKind::Snapshot => "snapshot",
        }
    }

    pub fn event_kind(self) -> EventKind {
        match self {
            StorageKind::Delta => EventKind::StorageDelta,
            StorageKind::Snapshot => EventKind::StorageSnapshot,
        }
    }
}

named!(StorageKind, "storage kind", StorageKind::ALL);

/// One storage fact a store keeps, the source its footprints are folded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageFact {
    pub project_id: ProjectId,
    pub event_id: EventId,
    pub kind: StorageKind,
    /// To the microsecond: stores keep (and compare) instants so, and the
    /// footprint must order the batch's facts exactly as the stored ones.
    pub occurred_at: DateTime<Utc>,
    /// Added (> 0) or removed (< 0) by a delta; held by a snapshot.
    pub bytes: i64,
}

impl StorageFact {
    /// The storage fact of a `storage_delta` or `storage_snapshot` fact.
    pub fn of(fact: &UsageFact) -> Option<StorageFact> {
        let kind = match fact.kind {
            EventKind::StorageDelta => StorageKind::Delta,
            EventKind::StorageSnapshot => StorageKind::Snapshot,
            _ => return None,
        };
        Some(StorageFact {
            project_id: fact.project_id.clone(),
            event_id: fact.id.clone(),
            kind,
            occurred_at: fact.occurred_at.trunc_subsecs(6),
            bytes: fact.storage_bytes.unwrap_or(0),
        })
    }
}

/// What a store must read of one project's stored footprint, before it keeps
/// the batch's storage facts: a [`StoredFootprint`] with `after_cut` taken
/// at `cut`, the instant of the batch's newest new snapshot (if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FootprintRead {
    pub project_id: ProjectId,
    pub cut: Option<DateTime<Utc>>,
}

/// What a store holds of one project's storage facts, as much as a fold
/// needs, whatever their number: one row per project.
///
/// It is enough because no new snapshot is newer than the read's cut: the
/// footprint's newest snapshot is then either the stored one (and the stored
/// deltas that count are `after_snapshot`) or a new one at the cut (and they
/// are `after_cut`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredFootprint {
    /// The newest stored snapshot by (occurred_at, event id): when, its id
    /// and its bytes.
    pub snapshot: Option<(DateTime<Utc>, EventId, i64)>,
    /// The sum of the stored deltas strictly after that snapshot; of all of
    /// them if there is none. Exact (128 bits), so a footprint is the same
    /// whatever batches its facts came in, saturating only at the end.
    pub after_snapshot: i128,
    /// The sum of the stored deltas strictly after the read's cut (0 if it
    /// has none).
    pub after_cut: i128,
    /// How many storage facts are stored (snapshots and deltas).
    pub events: u64,
}

impl StoredFootprint {
    /// The stored footprint as a [`Footprint`] new facts can be applied to:
    /// the stored deltas enter as (at most) two sums, placed so that each
    /// counts exactly when its deltas would. `cut` is the read's.
    fn resume(&self, cut: Option<DateTime<Utc>>) -> Footprint {
        // Stored instants are whole microseconds, so nothing lies between
        // an instant and the next nanosecond.
        let just_after = |t: DateTime<Utc>| t.checked_add_signed(TimeDelta::nanoseconds(1)).unwrap_or(t);
        let at = self.snapshot.as_ref().map(|(t, _, _)| *t);
        let deltas = match (at, cut) {
            // Up to the cut: count unless a new snapshot at the cut wins.
            // After it: count whichever snapshot wins.
            (at, Some(c)) if at.is_none_or(|s| s < c) => {
                vec![(c, self.after_snapshot - self.after_cut), (just_after(c), self.after_cut)]
            }
            // The stored snapshot is at or after every new one: the newest
            // is at its instant, and every delta after it counts.
            (Some(s), _) => vec![(just_after(s), self.after_snapshot)],
            // No snapshot at all: every delta counts.
            (None, _) => vec![(DateTime::<Utc>::MIN_UTC, self.after_snapshot)],
        };
        Footprint::resume(self.snapshot.clone(), deltas, self.events)
    }
}

/// What a batch adds to one (provider, model, component, meter) of the
/// token breakdown, in one window of a project, for one of the dimensions
/// the tokens land in ([`crate::usage::dimensions_of`]: the project, the
/// agent, the actor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelUsageAdd {
    pub project_id: ProjectId,
    pub dimension: Dimension,
    pub window: WindowKind,
    pub window_key: String,
    pub row: ModelUsageRow,
}

/// One batch's facts, deduplicated within the batch.
#[derive(Debug, Clone)]
pub struct BatchFold<'a> {
    facts: &'a [UsageFact],
    /// Whether each fact is the first of its (project, id) in the batch.
    first: Vec<bool>,
}

impl<'a> BatchFold<'a> {
    pub fn new(facts: &'a [UsageFact]) -> BatchFold<'a> {
        let mut seen: HashSet<(&ProjectId, &EventId)> = HashSet::with_capacity(facts.len());
        let first = facts.iter().map(|f| seen.insert((&f.project_id, &f.id))).collect();
        BatchFold { facts, first }
    }

    /// The batch's projects, distinct and ordered: whose zones to read.
    pub fn projects(&self) -> Vec<&'a ProjectId> {
        let set: BTreeSet<&ProjectId> = self.facts.iter().map(|f| &f.project_id).collect();
        set.into_iter().collect()
    }

    fn firsts(&self) -> impl Iterator<Item = &'a UsageFact> + '_ {
        self.facts.iter().zip(&self.first).filter(|(_, first)| **first).map(|(f, _)| f)
    }

    /// The first occurrence of each (project, id), in (project, id) order:
    /// what to offer the dedup set.
    pub fn candidates(&self) -> Vec<&'a UsageFact> {
        let mut out: Vec<&UsageFact> = self.firsts().collect();
        out.sort_unstable_by(|a, b| (&a.project_id, &a.id).cmp(&(&b.project_id, &b.id)));
        out
    }

    /// The (provider, model) pairs the candidates' token entries name: the
    /// rows of the price book that can price them (a price is looked up by
    /// its key only, so the rest of the book cannot change a cost). Empty
    /// when no candidate is a tokens event.
    pub fn price_keys(&self) -> BTreeSet<(&'a str, &'a str)> {
        self.firsts()
            .filter(|f| matches!(f.kind, EventKind::Tokens | EventKind::Correction))
            .flat_map(|f| f.tokens.iter().map(|t| (t.provider.as_str(), t.model.as_str())))
            .collect()
    }

    /// [`BatchFold::price_keys`] and those of the corrected originals'
    /// tokens (`targets`, as the store read them): a correction reprices
    /// what the original counts.
    pub fn price_keys_with(&self, targets: &HashMap<(ProjectId, EventId), Target>) -> BTreeSet<(String, String)> {
        let mut keys: BTreeSet<(String, String)> =
            self.price_keys().into_iter().map(|(p, m)| (p.to_owned(), m.to_owned())).collect();
        for t in targets.values() {
            if let Target::Counted(c) = t {
                keys.extend(c.fact.tokens.iter().map(|t| (t.provider.clone(), t.model.clone())));
            }
        }
        keys
    }

    /// The events the candidate corrections name, distinct and in order:
    /// what a store reads of its dedup set ([`Target`]) before it posts.
    pub fn correction_targets(&self) -> Vec<(ProjectId, EventId)> {
        let set: BTreeSet<(ProjectId, EventId)> = self
            .firsts()
            .filter(|f| f.kind == EventKind::Correction)
            .filter_map(|f| f.corrects.as_ref().map(|o| (f.project_id.clone(), o.clone())))
            .collect();
        set.into_iter().collect()
    }

    /// Folds the facts whose ids are `new` (the first occurrence of each):
    /// everything a store writes but the footprints. Tokens events are
    /// priced at their event time against `book` as it stood at their
    /// receipt ([`UsageFact::receipt`]); every fact's project must have a
    /// zone in `zones`.
    pub fn post(
        &self,
        new: &HashSet<(ProjectId, EventId)>,
        zones: &HashMap<ProjectId, Tz>,
        book: &PriceBook,
    ) -> Result<Posting<'a>, UnknownProject> {
        self.post_with(new, zones, book, &HashMap::new(), crate::usage::DEFAULT_DEDUP_HORIZON)
    }

    /// [`BatchFold::post`] with corrections: `targets` is what the store's
    /// dedup set holds of the events the batch's corrections name
    /// ([`BatchFold::correction_targets`]; an event missing there is not
    /// folded, or is past the horizon), `horizon` the dedup horizon. The
    /// corrections are applied in the batch's order, an original folded
    /// earlier in the batch included (one later in it is not folded yet:
    /// its correction is refused).
    pub fn post_with(
        &self,
        new: &HashSet<(ProjectId, EventId)>,
        zones: &HashMap<ProjectId, Tz>,
        book: &PriceBook,
        targets: &HashMap<(ProjectId, EventId), Target>,
        horizon: chrono::Duration,
    ) -> Result<Posting<'a>, UnknownProject> {
        if let Some(f) = self.facts.iter().find(|f| !zones.contains_key(&f.project_id)) {
            return Err(UnknownProject { project_id: f.project_id.clone(), event_id: f.id.clone() });
        }
        let footprint = CounterKey::footprint();
        let mut outcomes = Vec::with_capacity(self.facts.len());
        let mut fold = Fold::new();
        let mut unpriced: BTreeMap<(ProjectId, CounterKey, PriceKey), Option<DateTime<Utc>>> = BTreeMap::new();
        type ModelKey = (ProjectId, Dimension, WindowKind, String, PriceKey, MeterType, bool);
        let mut models: BTreeMap<ModelKey, (u64, u64, Usd)> = BTreeMap::new();
        let mut storage = Vec::new();
        let mut cuts: BTreeMap<ProjectId, Option<DateTime<Utc>>> = BTreeMap::new();
        // Corrections: the originals they name as this batch leaves them.
        let wanted: HashSet<(ProjectId, EventId)> = self.correction_targets().into_iter().collect();
        let mut local: HashMap<(ProjectId, EventId), Target> = HashMap::new();
        let mut adjustments: BTreeMap<(ProjectId, CounterKey), CounterChange> = BTreeMap::new();
        let mut model_adjustments: BTreeMap<(ProjectId, CorrectionModelKey), [i64; 3]> = BTreeMap::new();
        let mut recounts: BTreeMap<(ProjectId, EventId), Counted> = BTreeMap::new();
        let mut refusals = Vec::new();
        let mut audit = Vec::new();
        for (i, (fact, first)) in self.facts.iter().zip(&self.first).enumerate() {
            let key = (fact.project_id.clone(), fact.id.clone());
            if !*first || !new.contains(&key) {
                outcomes.push(FactOutcome::Duplicate);
                continue;
            }
            // Invariant: every fact's zone was checked above.
            let tz = zones.get(&fact.project_id).copied().unwrap_or(Tz::UTC);
            if wanted.contains(&key) {
                local
                    .insert(key.clone(), Counted::of(fact, tz).map_or(Target::Other, |c| Target::Counted(Box::new(c))));
            }
            if fact.kind == EventKind::Correction {
                let Some(original) = fact.corrects.clone() else {
                    refusals.push((i, FieldError::new("corrects", "a correction names the event it corrects")));
                    outcomes.push(FactOutcome::Refused);
                    continue;
                };
                let target_key = (fact.project_id.clone(), original);
                let target = match local.get(&target_key) {
                    Some(t) => Some(t),
                    // New in this batch but not yet met: later on the log.
                    None if new.contains(&target_key) => None,
                    None => targets.get(&target_key),
                };
                match correction::apply_correction(fact, target, horizon) {
                    Err(e) => {
                        refusals.push((i, e));
                        outcomes.push(FactOutcome::Refused);
                    }
                    Ok(next) => {
                        let Some(Target::Counted(before)) = target else {
                            unreachable!("apply_correction accepts only a counted target")
                        };
                        let after = correction::contribution(&next, book);
                        let diff = correction::difference(&correction::contribution(before, book), &after);
                        for (counter, (resets_at, d)) in diff.counters {
                            let e =
                                adjustments.entry((fact.project_id.clone(), counter)).or_insert((resets_at, [0; 13]));
                            correction::add_delta(&mut e.1, &d);
                        }
                        for (k, d) in diff.models {
                            correction::add_delta(
                                model_adjustments.entry((fact.project_id.clone(), k)).or_default(),
                                &d,
                            );
                        }
                        for (counter, k) in &diff.unpriced {
                            let r = after.counters.get(counter).and_then(|(r, _)| *r);
                            unpriced.insert((fact.project_id.clone(), counter.clone(), k.clone()), r);
                        }
                        audit.push(correction::audit_entry(fact, before, &next));
                        local.insert(target_key.clone(), Target::Counted(Box::new(next.clone())));
                        recounts.insert(target_key, next);
                        outcomes.push(FactOutcome::Folded);
                    }
                }
                fold.apply(fact, tz, book);
                continue;
            }
            outcomes.push(FactOutcome::Folded);
            fold.apply(fact, tz, book);
            if let Some(s) = StorageFact::of(fact) {
                let cut = cuts.entry(s.project_id.clone()).or_default();
                if s.kind == StorageKind::Snapshot && cut.is_none_or(|c| c < s.occurred_at) {
                    *cut = Some(s.occurred_at);
                }
                storage.push(s);
            }
            if fact.kind != EventKind::Tokens {
                continue;
            }
            // The breakdown by model, for the day and month of the fact, on
            // each dimension it lands in.
            let rows = component_usage(fact, book);
            for dimension in dimensions_of(fact) {
                for kind in MODEL_USAGE_WINDOWS {
                    let window_key = window_at(kind, tz, fact.occurred_at).key;
                    for r in &rows {
                        let key = (
                            fact.project_id.clone(),
                            dimension.clone(),
                            kind,
                            window_key.clone(),
                            r.key.clone(),
                            r.meter,
                            r.embedding,
                        );
                        let (priced, unpriced, cost) = models.entry(key).or_default();
                        *priced = priced.saturating_add(r.priced_quantity);
                        *unpriced = unpriced.saturating_add(r.unpriced_quantity);
                        *cost = cost.saturating_add(r.cost);
                    }
                }
            }
            // Unpriced components are remembered on every counter the fact lands in.
            let keys = priced(fact, book).unpriced_rows;
            if keys.is_empty() {
                continue;
            }
            for (counter, _) in counters_for(fact, tz, book) {
                if counter.key == footprint {
                    continue;
                }
                for k in &keys {
                    unpriced.insert((fact.project_id.clone(), counter.key.clone(), k.clone()), counter.resets_at);
                }
            }
        }
        storage.sort_unstable_by(|a: &StorageFact, b| (&a.project_id, &a.event_id).cmp(&(&b.project_id, &b.event_id)));
        Ok(Posting {
            facts: self.facts,
            outcomes,
            sums: fold.totals().filter(|(_, c, _)| c.key != footprint).map(|(p, c, t)| (p.clone(), c, t)).collect(),
            unpriced: unpriced
                .into_iter()
                .map(|((p, key, k), resets_at)| (p, UnpricedRow { counter: Counter { key, resets_at }, key: k }))
                .collect(),
            model_usage: models
                .into_iter()
                .map(
                    |((project_id, dimension, window, window_key, key, meter, embedding), (priced, unpriced, cost))| {
                        ModelUsageAdd {
                            project_id,
                            dimension,
                            window,
                            window_key,
                            row: ModelUsageRow {
                                key,
                                meter,
                                embedding,
                                priced_quantity: priced,
                                unpriced_quantity: unpriced,
                                cost,
                            },
                        }
                    },
                )
                .collect(),
            storage,
            footprint_reads: cuts.into_iter().map(|(project_id, cut)| FootprintRead { project_id, cut }).collect(),
            adjustments: adjustments
                .into_iter()
                .map(|((p, key), (resets_at, d))| (p, Counter { key, resets_at }, d))
                .collect(),
            model_adjustments: model_adjustments.into_iter().collect(),
            recounts: recounts.into_iter().map(|((p, e), c)| (p, e, c)).collect(),
            refusals,
            audit,
        })
    }
}

/// One row of the breakdown by model to change, signed (a correction can
/// take usage back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelUsageChange {
    pub project_id: ProjectId,
    pub dimension: Dimension,
    pub window: WindowKind,
    pub window_key: String,
    pub key: PriceKey,
    pub meter: MeterType,
    pub embedding: bool,
    pub priced_quantity: i64,
    pub unpriced_quantity: i64,
    pub cost_picos: i64,
}

/// Everything a store writes for one batch, computed. Every list is in key
/// order, so concurrent writers take row locks alike.
#[derive(Debug, Clone)]
pub struct Posting<'a> {
    facts: &'a [UsageFact],
    /// One per fact of the batch, in the batch's order.
    pub outcomes: Vec<FactOutcome>,
    /// What to add to each counter the new facts touched (with its reset),
    /// by project then counter. Never the footprint: see [`Posting::footprints`].
    pub sums: Vec<(ProjectId, Counter, Totals)>,
    /// The distinct unpriced (provider, model, component) of each counter
    /// the new tokens facts landed in.
    pub unpriced: Vec<(ProjectId, UnpricedRow)>,
    /// The new tokens facts broken down by model, summed per day and month.
    pub model_usage: Vec<ModelUsageAdd>,
    /// The new storage facts, in (project, event id) order.
    pub storage: Vec<StorageFact>,
    /// Per project with new storage facts: what to read of its footprint.
    pub footprint_reads: Vec<FootprintRead>,
    /// What the corrections change on each counter (signed, in
    /// [`crate::Field::ALL`] order), by project then counter.
    pub adjustments: Vec<(ProjectId, Counter, Delta)>,
    /// What they change in the breakdown by model (priced, unpriced, cost).
    pub model_adjustments: Vec<((ProjectId, CorrectionModelKey), [i64; 3])>,
    /// The corrected originals as they count now, to keep in the dedup set.
    pub recounts: Vec<(ProjectId, EventId, Counted)>,
    /// The refused corrections (by index in the batch) and why.
    pub refusals: Vec<(usize, FieldError)>,
    /// One audit entry per correction folded.
    pub audit: Vec<AuditEntry>,
}

impl Posting<'_> {
    /// The folded and duplicate ids, in the batch's order; no totals yet
    /// (the store reports the absolute ones it wrote).
    pub fn report(&self) -> FoldReport {
        let mut report = FoldReport::default();
        for (fact, outcome) in self.facts.iter().zip(&self.outcomes) {
            let id = (fact.project_id.clone(), fact.id.clone());
            match outcome {
                FactOutcome::Folded => report.folded.push(id),
                FactOutcome::Duplicate => report.duplicates.push(id),
                FactOutcome::Refused => {}
            }
        }
        report.refused = self.refused().map(|(f, e)| (f.project_id.clone(), f.id.clone(), e.to_string())).collect();
        report
    }

    /// The facts this batch folded for the first time, corrections aside,
    /// in the batch's (the log's) order: what quota alerts walk.
    pub fn new_facts(&self) -> Vec<&UsageFact> {
        self.facts
            .iter()
            .zip(&self.outcomes)
            .filter(|(f, o)| **o == FactOutcome::Folded && f.kind != EventKind::Correction)
            .map(|(f, _)| f)
            .collect()
    }

    /// The refused corrections and why, in the batch's order.
    pub fn refused(&self) -> impl Iterator<Item = (&UsageFact, &FieldError)> + '_ {
        self.refusals.iter().filter_map(|(i, e)| self.facts.get(*i).map(|f| (f, e)))
    }

    /// What to add to each counter, new facts and corrections together
    /// (signed, in [`crate::Field::ALL`] order): one row per counter, by
    /// project then counter. A store adds each, saturating, and floors the
    /// sums at zero.
    pub fn counter_changes(&self) -> Vec<(ProjectId, Counter, Delta)> {
        let mut out: BTreeMap<(ProjectId, CounterKey), CounterChange> = BTreeMap::new();
        for (p, c, t) in &self.sums {
            out.insert((p.clone(), c.key.clone()), (c.resets_at, t.values()));
        }
        for (p, c, d) in &self.adjustments {
            let e = out.entry((p.clone(), c.key.clone())).or_insert((c.resets_at, [0; 13]));
            correction::add_delta(&mut e.1, d);
        }
        out.into_iter().map(|((p, key), (resets_at, d))| (p, Counter { key, resets_at }, d)).collect()
    }

    /// What to add to the breakdown by model, new facts and corrections
    /// together, one row per key, in key order.
    pub fn model_changes(&self) -> Vec<ModelUsageChange> {
        let mut out: BTreeMap<(ProjectId, CorrectionModelKey), [i64; 3]> = BTreeMap::new();
        for m in &self.model_usage {
            let key = (
                m.project_id.clone(),
                (m.dimension.clone(), m.window, m.window_key.clone(), m.row.key.clone(), m.row.meter, m.row.embedding),
            );
            let q = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let e = out.entry(key).or_default();
            correction::add_delta(e, &[q(m.row.priced_quantity), q(m.row.unpriced_quantity), m.row.cost.picos()]);
        }
        for (key, d) in &self.model_adjustments {
            correction::add_delta(out.entry(key.clone()).or_default(), d);
        }
        out.into_iter()
            .map(|((project_id, (dimension, window, window_key, key, meter, embedding)), [priced, unpriced, cost])| {
                ModelUsageChange {
                    project_id,
                    dimension,
                    window,
                    window_key,
                    key,
                    meter,
                    embedding,
                    priced_quantity: priced,
                    unpriced_quantity: unpriced,
                    cost_picos: cost,
                }
            })
            .collect()
    }

    /// The new footprint of every project of [`Posting::footprint_reads`]:
    /// what the store read of it (`stored`; a project missing there holds
    /// nothing) plus the storage facts it kept of [`Posting::storage`]
    /// (`kept`, by its `INSERT … ON CONFLICT DO NOTHING RETURNING`; a fact it
    /// already held is in `stored`).
    pub fn footprints(
        &self,
        stored: &BTreeMap<ProjectId, StoredFootprint>,
        kept: &HashSet<(ProjectId, EventId)>,
    ) -> Vec<(ProjectId, Footprint)> {
        let mut out: BTreeMap<&ProjectId, Footprint> = self
            .footprint_reads
            .iter()
            .map(|r| (&r.project_id, stored.get(&r.project_id).cloned().unwrap_or_default().resume(r.cut)))
            .collect();
        for s in &self.storage {
            if !kept.contains(&(s.project_id.clone(), s.event_id.clone())) {
                continue;
            }
            if let Some(fp) = out.get_mut(&s.project_id) {
                fp.add(s.kind.event_kind(), s.occurred_at, &s.event_id, s.bytes);
            }
        }
        out.into_iter().map(|(p, fp)| (p.clone(), fp)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ApiKeyId;
    use crate::price::{Component, Price, TokenUsage};
    use crate::usage::{Dimension, Outcome};

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
    }

    fn pid(s: &str) -> ProjectId {
        ProjectId::parse(s).expect("project id")
    }

    fn eid(s: &str) -> EventId {
        EventId::parse(s).expect("event id")
    }

    fn fact(project: &str, id: &str, kind: EventKind, at: &str) -> UsageFact {
        UsageFact { gateway: "g1".into(), ..UsageFact::new(eid(id), pid(project), kind, utc(at)) }
    }

    fn call(project: &str, id: &str, rows: u64) -> UsageFact {
        UsageFact {
            api_key_id: Some(ApiKeyId::parse("k1").expect("key id")),
            rows,
            ..fact(project, id, EventKind::Call, "2026-07-07T12:31:00Z")
        }
    }

    fn storage(id: &str, kind: EventKind, at: &str, bytes: i64) -> UsageFact {
        UsageFact { storage_bytes: Some(bytes), ..fact("p1", id, kind, at) }
    }

    fn zones(projects: &[&str]) -> HashMap<ProjectId, Tz> {
        projects.iter().map(|p| (pid(p), Tz::UTC)).collect()
    }

    /// Every candidate is new.
    fn all_new(batch: &BatchFold<'_>) -> HashSet<(ProjectId, EventId)> {
        batch.candidates().into_iter().map(|f| (f.project_id.clone(), f.id.clone())).collect()
    }

    #[test]
    fn the_first_occurrence_of_an_id_wins_and_the_store_decides_what_is_new() {
        let facts = vec![call("p2", "e1", 1), call("p1", "e2", 2), call("p1", "e2", 50), call("p1", "e3", 3)];
        let batch = BatchFold::new(&facts);
        assert_eq!(batch.projects(), vec![&pid("p1"), &pid("p2")]);
        let candidates: Vec<_> = batch.candidates().into_iter().map(|f| (f.project_id.as_str(), f.rows)).collect();
        assert_eq!(candidates, vec![("p1", 2), ("p1", 3), ("p2", 1)], "first occurrences, in (project, id) order");

        // The store already folded e3.
        let new: HashSet<_> = [(pid("p2"), eid("e1")), (pid("p1"), eid("e2"))].into();
        let posting = batch.post(&new, &zones(&["p1", "p2"]), &PriceBook::default()).expect("post");
        use FactOutcome::{Duplicate, Folded};
        assert_eq!(posting.outcomes, vec![Folded, Folded, Duplicate, Duplicate]);
        let report = posting.report();
        assert_eq!(report.folded, vec![(pid("p2"), eid("e1")), (pid("p1"), eid("e2"))]);
        assert_eq!(report.duplicates, vec![(pid("p1"), eid("e2")), (pid("p1"), eid("e3"))]);
        let day = |p: &str| {
            posting
                .sums
                .iter()
                .find(|(q, c, _)| {
                    q == &pid(p) && c.key.dimension == Dimension::Project && c.key.window == WindowKind::Day
                })
                .map(|(_, _, t)| *t)
        };
        assert_eq!(day("p1"), Some(Totals { calls: 1, rows: 2, ..Totals::default() }), "the first copy of e2 only");
        assert_eq!(day("p2"), Some(Totals { calls: 1, rows: 1, ..Totals::default() }));
        assert!(posting.sums.windows(2).all(|w| (&w[0].0, &w[0].1.key) < (&w[1].0, &w[1].1.key)));
        assert!(posting.storage.is_empty() && posting.footprint_reads.is_empty());
    }

    #[test]
    fn a_fact_of_an_unknown_project_is_refused_by_name() {
        let facts = vec![call("p1", "e1", 1), call("ghost", "e2", 1)];
        let batch = BatchFold::new(&facts);
        let e = batch.post(&all_new(&batch), &zones(&["p1"]), &PriceBook::default()).expect_err("unknown project");
        assert_eq!(e.to_string(), "project ghost of event e2 does not exist");
    }

    #[test]
    fn tokens_facts_give_their_breakdown_and_unpriced_rows() {
        let book = PriceBook::new([Price {
            key: PriceKey { provider: "openai".into(), model: "alpha".into(), component: Component::InputTokens },
            unit_price_usd: Usd(2),
            effective_from: utc("2026-01-01T00:00:00Z"),
        }]);
        let entry =
            TokenUsage { provider: "openai".into(), model: "alpha".into(), input: 10, output: 4, ..Default::default() };
        let tokens = |id: &str| UsageFact {
            tokens: vec![entry.clone()],
            ..fact("p1", id, EventKind::Tokens, "2026-07-07T12:31:00Z")
        };
        // The second is a customer's (an actor's).
        let facts = vec![tokens("t1"), UsageFact { actor_id: Some("cust_7".into()), ..tokens("t2") }];
        let batch = BatchFold::new(&facts);
        assert_eq!(batch.price_keys(), BTreeSet::from([("openai", "alpha")]));
        let posting = batch.post(&all_new(&batch), &zones(&["p1"]), &book).expect("post");

        // Input priced, output not: two rows per window and dimension, the
        // project's summed over both facts, the actor's of its own.
        assert_eq!(posting.model_usage.len(), 2 * 2 * MODEL_USAGE_WINDOWS.len());
        let input = |d: &Dimension| {
            posting
                .model_usage
                .iter()
                .find(|m| {
                    &m.dimension == d && m.window == WindowKind::Day && m.row.key.component == Component::InputTokens
                })
                .map(|m| (m.window_key.as_str(), m.row.priced_quantity, m.row.cost))
        };
        assert_eq!(input(&Dimension::Project), Some(("2026-07-07", 20, Usd(40))));
        assert_eq!(input(&Dimension::Actor("cust_7".into())), Some(("2026-07-07", 10, Usd(20))));
        // The unpriced output lands on every counter of the facts, once.
        assert_eq!(posting.unpriced.len(), 2 * WindowKind::FLOW.len());
        assert!(posting.unpriced.iter().all(|(_, r)| r.key.component == Component::OutputTokens));
    }

    #[test]
    fn a_tokens_fact_is_priced_by_the_book_as_of_its_receipt() {
        let k = PriceKey { provider: "openai".into(), model: "alpha".into(), component: Component::InputTokens };
        let mut book = PriceBook::default();
        // In effect since January, but put only at 13:00 on the fact's day.
        book.insert_version(
            Price { key: k, unit_price_usd: Usd(2), effective_from: utc("2026-01-01T00:00:00Z") },
            utc("2026-07-07T13:00:00Z"),
        );
        let entry = TokenUsage { provider: "openai".into(), model: "alpha".into(), input: 10, ..Default::default() };
        let tokens = |id: &str, received: &str| UsageFact {
            tokens: vec![entry.clone()],
            received_at: Some(utc(received)),
            ..fact("p1", id, EventKind::Tokens, "2026-07-07T12:31:00Z")
        };
        // Received before the row was put, and after: folded in one batch, whenever.
        let facts = vec![tokens("t1", "2026-07-07T12:31:01Z"), tokens("t2", "2026-07-07T13:00:00Z")];
        let batch = BatchFold::new(&facts);
        let posting = batch.post(&all_new(&batch), &zones(&["p1"]), &book).expect("post");
        let day = posting
            .sums
            .iter()
            .find(|(_, c, _)| c.key.dimension == Dimension::Project && c.key.window == WindowKind::Day)
            .map(|(_, _, t)| *t)
            .expect("day");
        assert_eq!((day.cost_llm_tokens, day.llm_priced, day.llm_unpriced), (20, 1, 1));
        let input = |m: &&ModelUsageAdd| m.window == WindowKind::Day;
        let row = posting.model_usage.iter().find(input).expect("row");
        assert_eq!((row.row.priced_quantity, row.row.unpriced_quantity, row.row.cost), (10, 10, Usd(20)));
        assert_eq!(posting.unpriced.len(), WindowKind::FLOW.len(), "t1's input is unpriced on its counters");
    }

    fn footprint_of(facts: &[UsageFact]) -> (i64, u64) {
        let mut f = Footprint::default();
        facts.iter().for_each(|fact| f.apply(fact));
        (f.bytes(), f.events())
    }

    /// A store holding `held` (a [`StoredFootprint`] read at `cut`).
    fn stored(held: &[UsageFact], cut: Option<DateTime<Utc>>) -> StoredFootprint {
        let mut fp = Footprint::default();
        held.iter().for_each(|f| fp.apply(f));
        let snapshot = held
            .iter()
            .filter(|f| f.kind == EventKind::StorageSnapshot)
            .max_by(|a, b| (a.occurred_at, &a.id).cmp(&(b.occurred_at, &b.id)))
            .map(|s| (s.occurred_at, s.id.clone(), s.storage_bytes.unwrap_or(0)));
        let sum_after = |t: Option<DateTime<Utc>>| -> i128 {
            held.iter()
                .filter(|f| f.kind == EventKind::StorageDelta && t.is_none_or(|t| f.occurred_at > t))
                .map(|f| i128::from(f.storage_bytes.unwrap_or(0)))
                .sum()
        };
        StoredFootprint {
            after_snapshot: sum_after(snapshot.as_ref().map(|s| s.0)),
            after_cut: cut.map(|c| sum_after(Some(c))).unwrap_or(0),
            snapshot,
            events: fp.events(),
        }
    }

    /// Folds `batch` over a store holding `held`, every fact kept.
    fn fold_over(held: &[UsageFact], batch: &[UsageFact]) -> (i64, u64) {
        let plan = BatchFold::new(batch);
        let posting = plan.post(&all_new(&plan), &zones(&["p1"]), &PriceBook::default()).expect("post");
        let reads: BTreeMap<_, _> =
            posting.footprint_reads.iter().map(|r| (r.project_id.clone(), stored(held, r.cut))).collect();
        let kept = posting.storage.iter().map(|s| (s.project_id.clone(), s.event_id.clone())).collect();
        let fps = posting.footprints(&reads, &kept);
        assert_eq!(fps.len(), 1);
        (fps[0].1.bytes(), fps[0].1.events())
    }

    #[test]
    fn a_footprint_is_the_footprint_of_the_stored_and_the_new_facts() {
        use EventKind::{StorageDelta as D, StorageSnapshot as S};
        let held = vec![
            storage("d1", D, "2026-07-07T12:00:00Z", 100),
            storage("s1", S, "2026-07-07T12:05:00Z", 1000),
            storage("d2", D, "2026-07-07T12:06:00Z", 10),
            storage("d3", D, "2026-07-07T12:20:00Z", 5),
        ];
        let cases: [&[UsageFact]; 6] = [
            // Deltas only: after the stored snapshot or not.
            &[storage("d4", D, "2026-07-07T12:30:00Z", 1), storage("d5", D, "2026-07-07T12:01:00Z", 7)],
            // A late snapshot, between stored deltas.
            &[storage("s2", S, "2026-07-07T12:10:00Z", 500)],
            // An older one: only the count moves.
            &[storage("s0", S, "2026-07-07T11:00:00Z", 1)],
            // At the stored snapshot's instant: the greater id wins either way.
            &[storage("s0", S, "2026-07-07T12:05:00Z", 3), storage("s9", S, "2026-07-07T12:05:00Z", 4)],
            // At a stored delta's instant: the delta is in it.
            &[storage("s2", S, "2026-07-07T12:20:00Z", 50), storage("d6", D, "2026-07-07T12:20:00Z", 9)],
            // Newer than everything, with deltas around it.
            &[
                storage("d7", D, "2026-07-07T12:59:00Z", 2),
                storage("s3", S, "2026-07-07T13:00:00Z", 70),
                storage("d8", D, "2026-07-07T13:01:00Z", 3),
            ],
        ];
        for batch in cases {
            let all: Vec<UsageFact> = held.iter().chain(batch).cloned().collect();
            assert_eq!(fold_over(&held, batch), footprint_of(&all), "{batch:?}");
            // Over a store that holds nothing, or only deltas.
            assert_eq!(fold_over(&[], batch), footprint_of(batch), "{batch:?}");
            let deltas: Vec<UsageFact> = held.iter().filter(|f| f.kind == D).cloned().collect();
            let all: Vec<UsageFact> = deltas.iter().chain(batch).cloned().collect();
            assert_eq!(fold_over(&deltas, batch), footprint_of(&all), "{batch:?}");
        }
    }

    #[test]
    fn a_storage_fact_the_store_already_held_is_not_counted_twice() {
        let held = vec![storage("d1", EventKind::StorageDelta, "2026-07-07T12:00:00Z", 100)];
        let batch = [held[0].clone(), storage("d2", EventKind::StorageDelta, "2026-07-07T12:01:00Z", 5)];
        let plan = BatchFold::new(&batch);
        // Its id left the dedup set (purged), but the store kept the fact.
        let posting = plan.post(&all_new(&plan), &zones(&["p1"]), &PriceBook::default()).expect("post");
        let reads = BTreeMap::from([(pid("p1"), stored(&held, posting.footprint_reads[0].cut))]);
        let kept = HashSet::from([(pid("p1"), eid("d2"))]);
        let fps = posting.footprints(&reads, &kept);
        assert_eq!((fps[0].1.bytes(), fps[0].1.events()), (105, 2));
    }

    #[test]
    fn storage_facts_are_kept_to_the_microsecond_and_cut_at_the_newest_new_snapshot() {
        let facts = vec![
            storage("s1", EventKind::StorageSnapshot, "2026-07-07T12:00:00.123456789Z", 1),
            storage("s2", EventKind::StorageSnapshot, "2026-07-07T11:00:00Z", 1),
            UsageFact {
                outcome: Outcome::Failure,
                ..storage("d1", EventKind::StorageDelta, "2026-07-07T13:00:00Z", 5)
            },
        ];
        let plan = BatchFold::new(&facts);
        let posting = plan.post(&all_new(&plan), &zones(&["p1"]), &PriceBook::default()).expect("post");
        assert_eq!(posting.storage.len(), 3, "a storage fact's outcome does not matter");
        assert_eq!(posting.storage[1].occurred_at, utc("2026-07-07T12:00:00.123456Z"));
        assert_eq!(
            posting.footprint_reads,
            vec![FootprintRead { project_id: pid("p1"), cut: Some(utc("2026-07-07T12:00:00.123456Z")) }]
        );
        assert!(posting.sums.is_empty(), "the footprint is set, never added");
        assert_eq!("snapshot".parse::<StorageKind>(), Ok(StorageKind::Snapshot));
    }
}
