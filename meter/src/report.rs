//! What the store reports back about folded usage: the finance breakdown
//! by model, the unpriced rows of a counter, `quota_unpriced` exceptions,
//! and the populations a usage report can be grouped by.

use chrono::{DateTime, Utc};

use crate::error::named;
use crate::ids::{ProjectId, QuotaId};
use crate::price::{MeterType, PriceKey, Usd};
use crate::usage::{Counter, Dimension};

/// One `quota_unpriced` exception: a cost cap whose window held AI usage no
/// price covered. Deduplicated on the quota; `occurrence_count` is how many
/// checks ran under it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpricedException {
    pub project_id: ProjectId,
    pub quota_id: QuotaId,
    /// The quota's limit when last filed (picodollars).
    pub limit: u64,
    pub window_key: String,
    /// LLM events the window metered, and how many had an unpriced component.
    pub llm_events: u64,
    pub unpriced_events: u64,
    /// At most [`crate::price::MAX_UNPRICED_ROWS`].
    pub unpriced_rows: Vec<PriceKey>,
    pub occurrence_count: u64,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
}

/// An unpriced (provider, model, component) seen in a counter's window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpricedRow {
    pub counter: Counter,
    pub key: PriceKey,
}

/// Token usage of one (provider, model, component, meter) in one window of a
/// project, priced and unpriced quantities apart (the finance breakdown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelUsageRow {
    pub key: PriceKey,
    pub meter: MeterType,
    pub embedding: bool,
    pub priced_quantity: u64,
    pub unpriced_quantity: u64,
    pub cost: Usd,
}

/// A population of counters a usage report lists one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Population {
    ApiKeys,
    Agents,
    Actors,
    Users,
}

impl Population {
    pub const ALL: [Population; 4] = [Population::ApiKeys, Population::Agents, Population::Actors, Population::Users];

    pub fn as_str(self) -> &'static str {
        match self {
            Population::ApiKeys => "api_key",
            Population::Agents => "agent",
            Population::Actors => "actor",
            Population::Users => "user",
        }
    }

    /// What [`Dimension::encode`] of every member starts with (and of no
    /// other dimension): how a store selects a population's counters.
    pub fn encoded_prefix(self) -> &'static str {
        match self {
            Population::ApiKeys => "k:",
            Population::Agents => "g:",
            Population::Actors => "a:",
            Population::Users => "u:",
        }
    }

    /// Whether a counter's dimension is one member of this population.
    pub fn contains(self, d: &Dimension) -> bool {
        matches!(
            (self, d),
            (Population::ApiKeys, Dimension::ApiKey(_))
                | (Population::Agents, Dimension::Agent(_))
                | (Population::Actors, Dimension::Actor(_))
                | (Population::Users, Dimension::User(_))
        )
    }
}

named!(Population, "population", Population::ALL);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::ApiKeyId;

    #[test]
    fn a_population_is_exactly_the_dimensions_its_prefix_encodes() {
        let dims = [
            Dimension::Project,
            Dimension::AllApiKeys,
            Dimension::ApiKey(ApiKeyId::parse("k1").expect("id")),
            Dimension::Agent("bot".into()),
            Dimension::Actor("u1".into()),
            Dimension::User("user:alice".into()),
        ];
        for p in Population::ALL {
            for d in &dims {
                assert_eq!(p.contains(d), d.encode().starts_with(p.encoded_prefix()), "{p} {d:?}");
            }
            assert_eq!(p.as_str().parse::<Population>(), Ok(p));
        }
        assert!("model".parse::<Population>().is_err());
    }
}
