//! Folding facts into per-counter totals.
//!
//! The fold is a sum keyed by (project, counter), so it is associative and
//! commutative: any order of the same facts gives the same totals. It is
//! idempotent per event id: a fact whose id was already applied adds nothing.
//! The projector uses it per batch, after PostgreSQL has filtered out the ids
//! it saw in earlier batches, and upserts the result in one statement.

use std::collections::{BTreeMap, HashSet};

use chrono_tz::Tz;

use crate::ids::{EventId, ProjectId};
use crate::usage::{Counter, CounterKey, Totals, UsageFact, counters_for};

/// Totals folded so far, by project and counter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fold {
    seen: HashSet<(ProjectId, EventId)>,
    totals: BTreeMap<(ProjectId, CounterKey), (Totals, Option<chrono::DateTime<chrono::Utc>>)>,
}

impl Fold {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one fact; returns false (and adds nothing) for an id already applied.
    pub fn apply(&mut self, fact: &UsageFact, tz: Tz) -> bool {
        if !self.seen.insert((fact.project_id.clone(), fact.id.clone())) {
            return false;
        }
        for (counter, delta) in counters_for(fact, tz) {
            let Counter { key, resets_at } = counter;
            let entry = self
                .totals
                .entry((fact.project_id.clone(), key))
                .or_insert((Totals::default(), resets_at));
            entry.0.add(delta);
        }
        true
    }

    /// The folded totals, ordered by project then counter.
    pub fn totals(&self) -> impl Iterator<Item = (&ProjectId, Counter, Totals)> + '_ {
        self.totals.iter().map(|((p, key), (t, resets_at))| {
            (p, Counter { key: key.clone(), resets_at: *resets_at }, *t)
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
