//! The typed form of `tollgate.UsageEvent`, and its conversions to and from
//! the domain's [`UsageFact`].
//!
//! Why it exists: the schema carries more than this release meters (token
//! components, storage bytes, meter types), and its field types are Avro's
//! (`long`, strings) rather than the domain's (`u64`, parsed ids). This
//! struct is the schema, field for field; the conversions are the one place
//! where wire values are checked into domain values ("parse, don't
//! validate").
//!
//! What it guarantees:
//!
//! - `UsageFact::try_from(UsageEvent::from(&fact)) == Ok(fact)` for every fact
//!   whose rows fit in an Avro `long` and whose time is whole microseconds.
//! - A conversion error names the schema field at fault.
//! - `calls` is derived from the fact (1 for a successful call, else 0, the
//!   rule of [`meter::usage::delta_of`]); on decode, a request or call event
//!   whose `calls` disagrees is refused rather than counted either way.
//! - The check's estimate (since v4) is written per component, zero as null
//!   (so "nothing estimated" costs no bytes and reads the same as an event of
//!   an older version), and read back with null as zero.
//! - Token quantities and estimates must not be negative and `meter_type`
//!   must be one of the meters; the rules beyond types (which kind carries what) are
//!   [`meter::usage::check_fact`]'s, which the projector applies after this.

use chrono::{DateTime, Utc};
use meter::usage::delta_of;
use meter::{
    ApiKeyId, Counter, CounterKey, Estimate, EventId, EventKind, IdError, LoggedBreach, MeterType, Outcome, ProjectId,
    QuotaId, ReservationId, UsageFact,
};
use serde::{Deserialize, Serialize};

use crate::SchemaError;

/// One `tollgate.UsageEvent` record, as the schema spells it.
///
/// Serde maps it to and from Avro values (`apache_avro::to_value` /
/// `from_value`): field names and enum symbols are the schema's.
///
/// Its strings are `S`: owned (`String`, the default) as read off the log,
/// or borrowed from the fact (`&str`, [`UsageEvent::of`]) when written, so
/// encoding a fact on a check's path copies none of its ids and names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageEvent<S = String> {
    pub id: S,
    pub project_id: S,
    pub api_key_id: Option<S>,
    pub agent_id: Option<S>,
    pub actor_id: Option<S>,
    #[serde(default)]
    pub user_id: Option<S>,
    /// Event time in microseconds since the Unix epoch (`timestamp-micros`).
    pub occurred_at: i64,
    pub kind: EventKind,
    pub outcome: Outcome,
    /// 1 for a successful call event, 0 otherwise.
    pub calls: i64,
    pub rows: i64,
    pub tokens: Option<Vec<TokenUsage<S>>>,
    pub storage_bytes: Option<i64>,
    pub meter_type: Option<S>,
    pub reservation_id: Option<S>,
    pub gateway: S,
    /// When the gateway accepted the event (`timestamp-micros`), since v3.
    #[serde(default)]
    pub received_at: Option<i64>,
    #[serde(default)]
    pub admitted: Option<bool>,
    #[serde(default)]
    pub lease_until: Option<i64>,
    #[serde(default)]
    pub held: Option<Vec<HeldCounter>>,
    #[serde(default)]
    pub breaches: Option<Vec<QuotaBreach<S>>>,
    #[serde(default)]
    pub corrects: Option<S>,
    #[serde(default)]
    pub void: bool,
    /// The billable tokens an admitted request's reservation holds on each
    /// held counter besides one call, since v4; null for none.
    #[serde(default)]
    pub estimate_tokens: Option<i64>,
    /// The same estimate's cost in picodollars on the `llm_tokens` meter,
    /// since v4; null for none.
    #[serde(default)]
    pub estimate_cost: Option<i64>,
}

/// A counter a reservation holds (`tollgate.HeldCounter`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldCounter {
    /// [`meter::CounterKey::encode`].
    pub counter: String,
    pub resets_at: Option<i64>,
}

/// A quota a check found over its limit (`tollgate.QuotaBreach`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaBreach<S = String> {
    pub quota_id: S,
    pub window_key: S,
    pub limit: i64,
    pub observed: i64,
    pub enforce: bool,
}

/// Tokens consumed from one model of one provider (`tollgate.TokenUsage`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage<S = String> {
    pub provider: S,
    pub model: S,
    pub input: i64,
    pub output: i64,
    pub cached: i64,
    pub reasoning: i64,
    pub embedding: bool,
}

impl<'a> UsageEvent<&'a str> {
    /// The wire form of a fact, its strings borrowed from it. Sub-microsecond
    /// precision is truncated, and rows above `i64::MAX` saturate;
    /// [`crate::encode_usage`] refuses such rows instead of writing a wrong
    /// count. Token quantities and estimate components above `i64::MAX`
    /// saturate instead: the admitted event is still written (losing it
    /// would lose its reservation on a reseed), and `i64::MAX` is as much as
    /// any limit a `long` can hold, so the reseeded view still holds at
    /// least a full limit.
    pub fn of(fact: &'a UsageFact) -> Self {
        UsageEvent {
            id: fact.id.as_str(),
            project_id: fact.project_id.as_str(),
            api_key_id: fact.api_key_id.as_ref().map(ApiKeyId::as_str),
            agent_id: fact.agent_id.as_deref(),
            actor_id: fact.actor_id.as_deref(),
            user_id: fact.user_id.as_deref(),
            occurred_at: fact.occurred_at.timestamp_micros(),
            kind: fact.kind,
            outcome: fact.outcome,
            calls: i64::try_from(delta_of(fact, &meter::PriceBook::default()).calls).unwrap_or(i64::MAX),
            rows: i64::try_from(fact.rows).unwrap_or(i64::MAX),
            tokens: (!fact.tokens.is_empty()).then(|| {
                fact.tokens
                    .iter()
                    .map(|t| TokenUsage {
                        provider: t.provider.as_str(),
                        model: t.model.as_str(),
                        input: long(t.input),
                        output: long(t.output),
                        cached: long(t.cached),
                        reasoning: long(t.reasoning),
                        embedding: t.embedding,
                    })
                    .collect()
            }),
            storage_bytes: fact.storage_bytes,
            meter_type: fact.meter_type.map(MeterType::as_str),
            reservation_id: fact.reservation_id.as_ref().map(ReservationId::as_str),
            gateway: fact.gateway.as_str(),
            received_at: fact.received_at.map(|t| t.timestamp_micros()),
            admitted: fact.admitted,
            lease_until: fact.lease_until.map(|t| t.timestamp_micros()),
            held: (!fact.held.is_empty()).then(|| {
                fact.held
                    .iter()
                    .map(|c| HeldCounter {
                        counter: c.key.encode(),
                        resets_at: c.resets_at.map(|t| t.timestamp_micros()),
                    })
                    .collect()
            }),
            breaches: (!fact.breaches.is_empty()).then(|| {
                fact.breaches
                    .iter()
                    .map(|b| QuotaBreach {
                        quota_id: b.quota_id.as_str(),
                        window_key: b.window_key.as_str(),
                        limit: long(b.limit),
                        observed: long(b.observed),
                        enforce: b.enforce,
                    })
                    .collect()
            }),
            corrects: fact.corrects.as_ref().map(EventId::as_str),
            void: fact.void,
            estimate_tokens: estimated(fact.estimate.tokens),
            estimate_cost: estimated(fact.estimate.cost),
        }
    }
}

impl<S: AsRef<str>> UsageEvent<S> {
    /// The same event with owned strings.
    pub fn to_owned_strings(&self) -> UsageEvent {
        let own = |s: &S| s.as_ref().to_owned();
        UsageEvent {
            id: own(&self.id),
            project_id: own(&self.project_id),
            api_key_id: self.api_key_id.as_ref().map(own),
            agent_id: self.agent_id.as_ref().map(own),
            actor_id: self.actor_id.as_ref().map(own),
            user_id: self.user_id.as_ref().map(own),
            occurred_at: self.occurred_at,
            kind: self.kind,
            outcome: self.outcome,
            calls: self.calls,
            rows: self.rows,
            tokens: self.tokens.as_ref().map(|list| {
                list.iter()
                    .map(|t| TokenUsage {
                        provider: own(&t.provider),
                        model: own(&t.model),
                        input: t.input,
                        output: t.output,
                        cached: t.cached,
                        reasoning: t.reasoning,
                        embedding: t.embedding,
                    })
                    .collect()
            }),
            storage_bytes: self.storage_bytes,
            meter_type: self.meter_type.as_ref().map(own),
            reservation_id: self.reservation_id.as_ref().map(own),
            gateway: own(&self.gateway),
            received_at: self.received_at,
            admitted: self.admitted,
            lease_until: self.lease_until,
            held: self.held.clone(),
            breaches: self.breaches.as_ref().map(|list| {
                list.iter()
                    .map(|b| QuotaBreach {
                        quota_id: own(&b.quota_id),
                        window_key: own(&b.window_key),
                        limit: b.limit,
                        observed: b.observed,
                        enforce: b.enforce,
                    })
                    .collect()
            }),
            corrects: self.corrects.as_ref().map(own),
            void: self.void,
            estimate_tokens: self.estimate_tokens,
            estimate_cost: self.estimate_cost,
        }
    }
}

impl From<&UsageFact> for UsageEvent {
    /// [`UsageEvent::of`], with owned strings.
    fn from(fact: &UsageFact) -> Self {
        UsageEvent::of(fact).to_owned_strings()
    }
}

fn instant(field: &str, micros: i64) -> Result<DateTime<Utc>, SchemaError> {
    DateTime::<Utc>::from_timestamp_micros(micros).ok_or_else(|| {
        SchemaError::invalid(field, format!("{micros} microseconds is outside the representable time range"))
    })
}

/// From owned strings or strings borrowed from the record's bytes
/// ([`crate::decode_usage`]): ids are parsed from them either way, and only
/// free text (names, the gateway) is copied.
impl<S: AsRef<str> + Into<String>> TryFrom<UsageEvent<S>> for UsageFact {
    type Error = SchemaError;

    fn try_from(event: UsageEvent<S>) -> Result<Self, SchemaError> {
        let rows = u64::try_from(event.rows)
            .map_err(|_| SchemaError::invalid("rows", format!("must not be negative, got {}", event.rows)))?;
        let occurred_at = instant("occurred_at", event.occurred_at)?;
        let mut tokens = Vec::new();
        for (i, t) in event.tokens.unwrap_or_default().into_iter().enumerate() {
            let q = |name: &str, v: i64| {
                u64::try_from(v).map_err(|_| {
                    SchemaError::invalid(&format!("tokens[{i}].{name}"), format!("must not be negative, got {v}"))
                })
            };
            tokens.push(meter::TokenUsage {
                input: q("input", t.input)?,
                output: q("output", t.output)?,
                cached: q("cached", t.cached)?,
                reasoning: q("reasoning", t.reasoning)?,
                provider: t.provider.into(),
                model: t.model.into(),
                embedding: t.embedding,
            });
        }
        let meter_type = match event.meter_type {
            None => None,
            Some(m) => Some(m.as_ref().parse::<MeterType>().map_err(|_| {
                SchemaError::invalid(
                    "meter_type",
                    format!("{:?} is not one of llm_tokens, compute_execution, api_request, storage", m.as_ref()),
                )
            })?),
        };
        let fact = UsageFact {
            id: parse_id("id", event.id, EventId::parse)?,
            project_id: parse_id("project_id", event.project_id, ProjectId::parse)?,
            api_key_id: event.api_key_id.map(|s| parse_id("api_key_id", s, ApiKeyId::parse)).transpose()?,
            agent_id: event.agent_id.map(Into::into),
            actor_id: event.actor_id.map(Into::into),
            user_id: event.user_id.map(Into::into),
            occurred_at,
            kind: event.kind,
            outcome: event.outcome,
            rows,
            tokens,
            storage_bytes: event.storage_bytes,
            meter_type,
            reservation_id: event
                .reservation_id
                .map(|s| parse_id("reservation_id", s, ReservationId::parse))
                .transpose()?,
            gateway: event.gateway.into(),
            received_at: event.received_at.map(|t| instant("received_at", t)).transpose()?,
            admitted: event.admitted,
            lease_until: event.lease_until.map(|t| instant("lease_until", t)).transpose()?,
            held: held(event.held.unwrap_or_default())?,
            breaches: breaches(event.breaches.unwrap_or_default())?,
            corrects: event.corrects.map(|s| parse_id("corrects", s, EventId::parse)).transpose()?,
            void: event.void,
            estimate: Estimate {
                tokens: estimate("estimate_tokens", event.estimate_tokens)?,
                cost: estimate("estimate_cost", event.estimate_cost)?,
            },
        };
        if fact.kind.is_folded() {
            let expected = delta_of(&fact, &meter::PriceBook::default()).calls;
            if u64::try_from(event.calls).ok() != Some(expected) {
                return Err(SchemaError::invalid(
                    "calls",
                    format!(
                        "is {} but a {} event with outcome {} counts {expected}",
                        event.calls,
                        fact.kind,
                        fact.outcome.as_str()
                    ),
                ));
            }
        }
        Ok(fact)
    }
}

fn held(list: Vec<HeldCounter>) -> Result<Vec<Counter>, SchemaError> {
    list.into_iter()
        .enumerate()
        .map(|(i, h)| {
            let key = CounterKey::decode(&h.counter).ok_or_else(|| {
                SchemaError::invalid(&format!("held[{i}].counter"), format!("{:?} is not a counter key", h.counter))
            })?;
            let resets_at = h.resets_at.map(|t| instant(&format!("held[{i}].resets_at"), t)).transpose()?;
            Ok(Counter { key, resets_at })
        })
        .collect()
}

fn breaches<S: AsRef<str> + Into<String>>(list: Vec<QuotaBreach<S>>) -> Result<Vec<LoggedBreach>, SchemaError> {
    list.into_iter()
        .enumerate()
        .map(|(i, b)| {
            let count = |name: &str, v: i64| {
                u64::try_from(v).map_err(|_| {
                    SchemaError::invalid(&format!("breaches[{i}].{name}"), format!("must not be negative, got {v}"))
                })
            };
            Ok(LoggedBreach {
                quota_id: parse_id(&format!("breaches[{i}].quota_id"), b.quota_id, QuotaId::parse)?,
                window_key: b.window_key.into(),
                limit: count("limit", b.limit)?,
                observed: count("observed", b.observed)?,
                enforce: b.enforce,
            })
        })
        .collect()
}

fn long(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// One component of the check's estimate on the wire: zero is "nothing
/// estimated", written as null like the absent field of an older version.
fn estimated(v: u64) -> Option<i64> {
    (v != 0).then(|| long(v))
}

/// One component of the check's estimate read back: null (an older version,
/// or nothing estimated) is zero; a negative count is not a quantity.
fn estimate(field: &str, v: Option<i64>) -> Result<u64, SchemaError> {
    match v {
        None => Ok(0),
        Some(v) => u64::try_from(v).map_err(|_| SchemaError::invalid(field, format!("must not be negative, got {v}"))),
    }
}

fn parse_id<T, S>(field: &str, s: S, parse: fn(S) -> Result<T, IdError>) -> Result<T, SchemaError> {
    parse(s).map_err(|e| SchemaError::invalid(field, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> UsageEvent {
        UsageEvent {
            id: "e1".into(),
            project_id: "p1".into(),
            api_key_id: Some("k1".into()),
            agent_id: None,
            actor_id: Some("u1".into()),
            user_id: None,
            occurred_at: 1_780_000_000_123_456,
            kind: EventKind::Call,
            outcome: Outcome::Success,
            calls: 1,
            rows: 7,
            tokens: None,
            storage_bytes: None,
            meter_type: None,
            reservation_id: Some("r1".into()),
            gateway: "gw".into(),
            received_at: Some(1_780_000_000_223_456),
            admitted: None,
            lease_until: None,
            held: None,
            breaches: None,
            corrects: None,
            void: false,
            estimate_tokens: None,
            estimate_cost: None,
        }
    }

    #[test]
    fn a_valid_event_converts_and_back() {
        let fact = UsageFact::try_from(event()).expect("valid");
        assert_eq!(fact.rows, 7);
        assert_eq!(fact.occurred_at.timestamp_micros(), 1_780_000_000_123_456);
        assert_eq!(UsageEvent::from(&fact), event());
    }

    #[test]
    fn each_bad_field_is_named() {
        type Break = fn(&mut UsageEvent);
        let cases: [(&str, Break); 11] = [
            ("id", |e| e.id = String::new()),
            ("project_id", |e| e.project_id = "a b".into()),
            ("api_key_id", |e| e.api_key_id = Some("{k}".into())),
            ("reservation_id", |e| e.reservation_id = Some("x".repeat(129))),
            ("rows", |e| e.rows = -1),
            ("occurred_at", |e| e.occurred_at = i64::MAX),
            ("calls", |e| e.calls = 0),
            ("calls", |e| e.outcome = Outcome::Failure),
            ("calls", |e| e.kind = EventKind::Request),
            ("estimate_tokens", |e| e.estimate_tokens = Some(-1)),
            ("estimate_cost", |e| e.estimate_cost = Some(i64::MIN)),
        ];
        for (field, break_it) in cases {
            let mut e = event();
            break_it(&mut e);
            match UsageFact::try_from(e) {
                Err(SchemaError::Invalid { field: f, message }) => {
                    assert_eq!(f, field, "{message}");
                    assert!(!message.is_empty());
                }
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
    }

    #[test]
    fn quantities_of_unfolded_kinds_are_not_checked_here() {
        let mut e = event();
        e.kind = EventKind::Tokens;
        e.calls = 0;
        e.tokens = Some(vec![TokenUsage {
            provider: "openai".into(),
            model: "gpt".into(),
            input: 10,
            output: 5,
            cached: 0,
            reasoning: 0,
            embedding: false,
        }]);
        assert_eq!(UsageFact::try_from(e).expect("valid").kind, EventKind::Tokens);
    }

    #[test]
    fn an_estimate_is_written_per_component_with_zero_as_null() {
        let mut fact = UsageFact::try_from(event()).expect("valid");
        assert_eq!(fact.estimate, Estimate::default(), "null reads as nothing estimated");
        fact.estimate = Estimate { tokens: 4096, cost: 0 };
        let e = UsageEvent::from(&fact);
        assert_eq!((e.estimate_tokens, e.estimate_cost), (Some(4096), None));
        assert_eq!(UsageFact::try_from(e).expect("valid"), fact);
        fact.estimate = Estimate { tokens: 0, cost: 12_500_000 };
        let e = UsageEvent::from(&fact);
        assert_eq!((e.estimate_tokens, e.estimate_cost), (None, Some(12_500_000)));
        assert_eq!(UsageFact::try_from(e).expect("valid"), fact);
        // A writer that spells zero out reads the same as one that leaves it null.
        let mut e = event();
        e.estimate_tokens = Some(0);
        e.estimate_cost = Some(0);
        assert_eq!(UsageFact::try_from(e).expect("valid").estimate, Estimate::default());
    }

    #[test]
    fn an_estimate_beyond_an_avro_long_saturates() {
        let mut fact = UsageFact::try_from(event()).expect("valid");
        fact.estimate = Estimate { tokens: u64::MAX, cost: i64::MAX as u64 + 1 };
        let e = UsageEvent::from(&fact);
        assert_eq!((e.estimate_tokens, e.estimate_cost), (Some(i64::MAX), Some(i64::MAX)));
        let back = UsageFact::try_from(e).expect("valid");
        assert_eq!(back.estimate, Estimate { tokens: i64::MAX as u64, cost: i64::MAX as u64 });
    }

    #[test]
    fn the_error_reads_as_a_dlq_reason() {
        let mut e = event();
        e.rows = -3;
        let err = UsageFact::try_from(e).expect_err("negative rows");
        assert_eq!(err.to_string(), "invalid rows: must not be negative, got -3");
        let mut e = event();
        e.estimate_cost = Some(-7);
        let err = UsageFact::try_from(e).expect_err("negative estimate");
        assert_eq!(err.to_string(), "invalid estimate_cost: must not be negative, got -7");
    }
}
