//! `POST /v1/events`: the usage facts a gateway reports.
//!
//! An event is read into a [`UsageFact`] here, its types and `meter`'s
//! rules for a fact checked ([`meter::usage::check_fact`]); what needs the
//! clock or the store (its time within the horizon, its project and key
//! existing) is the service's, which also stamps the gateway's name.

use meter::{
    ApiKeyId, EventId, EventKind, FieldError, MeterType, Outcome, PermitId, ProjectId, ReservationId, TokenUsage,
    UsageFact,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Count, Flag, List, Text, Whole, opt_id, required, timestamp};
use crate::service::recording::{Accepted, MAX_EVENTS};

/// Token counts of one model.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"provider": "openai", "model": "gpt-4o", "input": 1000, "output": 200, "reasoning": 5}))]
pub struct TokenBody {
    #[schema(value_type = String)]
    pub provider: Option<Text>,
    #[schema(value_type = String)]
    pub model: Option<Text>,
    /// Uncached input tokens.
    #[schema(value_type = Option<u64>, minimum = 0)]
    pub input: Option<Count>,
    #[schema(value_type = Option<u64>, minimum = 0)]
    pub output: Option<Count>,
    /// Input tokens served from the provider's cache.
    #[schema(value_type = Option<u64>, minimum = 0)]
    pub cached: Option<Count>,
    /// Reasoning tokens: a detail, never billed or priced.
    #[schema(value_type = Option<u64>, minimum = 0)]
    pub reasoning: Option<Count>,
    /// True for an embedding model's tokens.
    #[schema(value_type = Option<bool>)]
    pub embedding: Option<Flag>,
}

impl TryFrom<TokenBody> for TokenUsage {
    type Error = FieldError;
    fn try_from(t: TokenBody) -> Result<TokenUsage, FieldError> {
        let count = |c: Option<Count>| c.map_or(0, |Count(n)| n);
        Ok(TokenUsage {
            provider: required(t.provider, "provider")?.0,
            model: required(t.model, "model")?.0,
            input: count(t.input),
            output: count(t.output),
            cached: count(t.cached),
            reasoning: count(t.reasoning),
            embedding: t.embedding.is_some_and(|Flag(e)| e),
        })
    }
}

/// One usage event.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "evt_1", "type": "call", "project_id": "proj_0197a3c2", "api_key_id": "key_0197a3c3",
    "occurred_at": "2026-07-07T12:00:00Z", "reservation_id": "res_0197a3c6", "outcome": "success", "rows": 3}))]
pub struct EventBody {
    /// The event's id: the same id sent again is counted once.
    #[schema(value_type = String)]
    pub id: Option<Text>,
    /// `call`, `tokens`, `storage_delta`, `storage_snapshot` or
    /// `correction` (`request` events are the check's own).
    #[serde(rename = "type")]
    #[schema(value_type = String)]
    pub kind: Option<Text>,
    #[schema(value_type = String)]
    pub project_id: Option<Text>,
    /// A key of the project.
    #[schema(value_type = Option<String>)]
    pub api_key_id: Option<Text>,
    #[schema(value_type = Option<String>)]
    pub agent_id: Option<Text>,
    #[schema(value_type = Option<String>)]
    pub actor_id: Option<Text>,
    /// A signed-in user (`user:<subject>`).
    #[schema(value_type = Option<String>)]
    pub user: Option<Text>,
    /// RFC 3339 event time: within the dedup horizon, at most 5 minutes ahead.
    #[schema(value_type = DateTime<Utc>)]
    pub occurred_at: Option<Text>,
    /// The check this call settles.
    #[schema(value_type = Option<String>)]
    pub reservation_id: Option<Text>,
    /// On a `call` or `tokens` event: the permit its check took, released
    /// once the event is recorded (the call has ended). Not on the log: a
    /// permit is the gateway's, not a usage fact.
    #[schema(value_type = Option<String>)]
    pub permit_id: Option<Text>,
    /// `success` (default) or `failure`.
    #[schema(value_type = Option<String>)]
    pub outcome: Option<Text>,
    /// Rows a `call` returned.
    #[schema(value_type = Option<u64>, minimum = 0)]
    pub rows: Option<Count>,
    /// A `tokens` event's counts, per model.
    #[schema(value_type = Option<Vec<TokenBody>>)]
    pub tokens: Option<List<TokenBody>>,
    /// Bytes a `storage_delta` adds (negative: removes) or a
    /// `storage_snapshot` holds.
    #[schema(value_type = Option<i64>)]
    pub storage_bytes: Option<Whole>,
    /// `llm_tokens`, `compute_execution`, `api_request` or `storage`.
    #[schema(value_type = Option<String>)]
    pub meter_type: Option<Text>,
    /// On a `correction`: the id of the earlier `call` or `tokens` event
    /// of the same project it amends (with its corrected `rows` or
    /// `tokens`: the new truth) or voids.
    #[schema(value_type = Option<String>)]
    pub corrects: Option<Text>,
    /// On a `correction`: void the event (it counts for nothing) instead of
    /// amending it.
    #[schema(value_type = Option<bool>)]
    pub void: Option<Flag>,
}

impl TryFrom<EventBody> for UsageFact {
    type Error = FieldError;
    /// Errors name the field within the event (`rows`); the gateway is left
    /// empty for the service to stamp.
    fn try_from(e: EventBody) -> Result<UsageFact, FieldError> {
        let id = EventId::parse(required(e.id, "id")?.0).map_err(|err| FieldError::new("id", err.to_string()))?;
        let kind = required(e.kind, "type")?.0.parse::<EventKind>().map_err(|_| {
            FieldError::new("type", "must be one of request, call, tokens, storage_delta, storage_snapshot, correction")
        })?;
        let project_id = ProjectId::parse(required(e.project_id, "project_id")?.0)
            .map_err(|err| FieldError::new("project_id", err.to_string()))?;
        let api_key_id = opt_id(e.api_key_id, "api_key_id")?
            .map(|k| ApiKeyId::parse(k).map_err(|err| FieldError::new("api_key_id", err.to_string())))
            .transpose()?;
        let occurred_at = timestamp(&required(e.occurred_at, "occurred_at")?.0, "occurred_at")?;
        let outcome = match e.outcome {
            None => Outcome::Success,
            Some(Text(o)) => {
                o.parse::<Outcome>().map_err(|_| FieldError::new("outcome", "must be success or failure"))?
            }
        };
        let rows = e.rows.map_or(0, |Count(r)| r);
        let reservation_id = opt_id(e.reservation_id, "reservation_id")?
            .map(|r| ReservationId::parse(r).map_err(|err| FieldError::new("reservation_id", err.to_string())))
            .transpose()?;
        let meter_type = match e.meter_type {
            None => None,
            Some(Text(m)) => Some(m.parse::<MeterType>().map_err(|_| {
                FieldError::new("meter_type", "must be one of llm_tokens, compute_execution, api_request, storage")
            })?),
        };
        let corrects = opt_id(e.corrects, "corrects")?
            .map(|c| EventId::parse(c).map_err(|err| FieldError::new("corrects", err.to_string())))
            .transpose()?;
        let agent_id = opt_id(e.agent_id, "agent_id")?;
        let actor_id = opt_id(e.actor_id, "actor_id")?;
        let tokens = match e.tokens {
            None => Vec::new(),
            Some(List(list)) => list
                .into_iter()
                .enumerate()
                .map(|(j, t)| TokenUsage::try_from(t).map_err(|err| err.under(&format!("tokens[{j}]."))))
                .collect::<Result<_, _>>()?,
        };
        let fact = UsageFact {
            api_key_id,
            agent_id,
            actor_id,
            user_id: e.user.map(|Text(u)| u),
            occurred_at,
            kind,
            outcome,
            rows,
            tokens,
            storage_bytes: e.storage_bytes.map(|Whole(b)| b),
            meter_type,
            reservation_id,
            corrects,
            void: e.void.is_some_and(|Flag(v)| v),
            // The service stamps the instance and the receipt time.
            ..UsageFact::new(id, project_id, kind, occurred_at)
        };
        meter::usage::check_fact(&fact)?;
        Ok(fact)
    }
}

/// `POST /v1/events`: 1 to 5000 events, all recorded or none.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"events": [
    {"id": "evt_1", "type": "call", "project_id": "proj_0197a3c2", "api_key_id": "key_0197a3c3",
     "occurred_at": "2026-07-07T12:00:00Z", "reservation_id": "res_0197a3c6", "outcome": "success", "rows": 3},
    {"id": "evt_2", "type": "tokens", "project_id": "proj_0197a3c2", "agent_id": "support-bot",
     "occurred_at": "2026-07-07T12:00:01Z", "tokens": [{"provider": "openai", "model": "gpt-4o", "input": 1000, "output": 200}]},
]}))]
pub struct EventsBody {
    #[schema(value_type = Vec<EventBody>)]
    pub events: Option<List<EventBody>>,
}

/// What a `/v1/events` reports: the facts, and the permits its events
/// name (each once).
#[derive(Debug, Clone, PartialEq)]
pub struct Reported {
    pub facts: Vec<UsageFact>,
    pub permits: Vec<PermitId>,
}

impl TryFrom<EventsBody> for Reported {
    type Error = FieldError;
    fn try_from(b: EventsBody) -> Result<Reported, FieldError> {
        let List(list) = b.events.ok_or_else(|| FieldError::new("events", "must be a list"))?;
        if list.is_empty() || list.len() > MAX_EVENTS {
            return Err(FieldError::new("events", format!("must hold 1 to {MAX_EVENTS} events")));
        }
        let mut permits: Vec<PermitId> = Vec::new();
        let mut facts = Vec::with_capacity(list.len());
        for (i, mut e) in list.into_iter().enumerate() {
            let at = |err: FieldError| err.under(&format!("events[{i}]."));
            let permit = opt_id(e.permit_id.take(), "permit_id")
                .and_then(|p| {
                    p.map(PermitId::parse).transpose().map_err(|err| FieldError::new("permit_id", err.to_string()))
                })
                .map_err(at)?;
            let fact = UsageFact::try_from(e).map_err(at)?;
            if let Some(p) = permit {
                if !matches!(fact.kind, EventKind::Call | EventKind::Tokens) {
                    return Err(at(FieldError::new(
                        "permit_id",
                        "goes on the call or tokens event of the permit's check",
                    )));
                }
                if !permits.contains(&p) {
                    permits.push(p);
                }
            }
            facts.push(fact);
        }
        Ok(Reported { facts, permits })
    }
}

impl TryFrom<EventsBody> for Vec<UsageFact> {
    type Error = FieldError;
    fn try_from(b: EventsBody) -> Result<Vec<UsageFact>, FieldError> {
        Reported::try_from(b).map(|r| r.facts)
    }
}

/// Every event is on the log.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"accepted": 2, "duplicates": 0}))]
pub struct EventsAccepted {
    /// Events recorded.
    pub accepted: usize,
    /// Events left out as repeats of an earlier one of the same request.
    pub duplicates: usize,
    /// Present when events named permits (`permit_id`): how many of them
    /// were held and are now released (one released before, or lapsed,
    /// is not counted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permits_released: Option<usize>,
}

impl From<Accepted> for EventsAccepted {
    fn from(a: Accepted) -> Self {
        EventsAccepted { accepted: a.accepted, duplicates: a.duplicates, permits_released: a.permits_released }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::dto::from_value;

    fn field(events: serde_json::Value) -> String {
        match from_value::<EventsBody>(json!({ "events": events })) {
            Err(e) => e.field,
            Ok(b) => Vec::<UsageFact>::try_from(b).expect_err("refused").field,
        }
    }

    fn call(rows: serde_json::Value) -> serde_json::Value {
        json!({"id": "e1", "type": "call", "project_id": "proj_1", "occurred_at": "2026-07-07T12:00:00Z", "rows": rows})
    }

    #[test]
    fn a_bad_event_is_named_by_its_index_and_field() {
        assert_eq!(field(json!([call(json!(1)), call(json!(-3))])), "events[1].rows");
        assert_eq!(field(json!([call(json!("3"))])), "events[0].rows");
        assert_eq!(field(json!([])), "events");
        assert_eq!(field(json!({})), "events");
        assert_eq!(field(json!([5])), "events[0]");
        let mut e = call(json!(1));
        e["colour"] = json!("red");
        assert_eq!(field(json!([e])), "events[0].colour");
        let tokens = |t: serde_json::Value| json!([{"id": "e1", "type": "tokens", "project_id": "proj_1", "occurred_at": "2026-07-07T12:00:00Z", "tokens": t}]);
        assert_eq!(
            field(tokens(json!([{"provider": "openai", "model": "m", "input": -1}]))),
            "events[0].tokens[0].input"
        );
        assert_eq!(field(tokens(json!([{"model": "m"}]))), "events[0].tokens[0].provider");
        assert_eq!(field(tokens(json!([]))), "events[0].tokens");
        assert_eq!(field(tokens(json!({}))), "events[0].tokens");
        let storage = json!([{"id": "s", "type": "storage_snapshot", "project_id": "proj_1",
                              "occurred_at": "2026-07-07T12:00:00Z", "storage_bytes": -1}]);
        assert_eq!(field(storage), "events[0].storage_bytes");
        let mut e = call(json!(1));
        e["occurred_at"] = json!("yesterday");
        assert_eq!(field(json!([e])), "events[0].occurred_at");
        let mut e = call(json!(1));
        e["type"] = json!("refund");
        assert_eq!(field(json!([e])), "events[0].type");
        // A correction names its original, carries no attribution, and a void no quantity.
        let mut e = call(json!(1));
        e["type"] = json!("correction");
        assert_eq!(field(json!([e])), "events[0].corrects");
        let correction = |extra: serde_json::Value| {
            let mut e = json!({"id": "x1", "type": "correction", "project_id": "proj_1",
                               "occurred_at": "2026-07-07T12:00:00Z", "corrects": "e1"});
            if let (Some(e), Some(x)) = (e.as_object_mut(), extra.as_object()) {
                e.extend(x.clone());
            }
            json!([e])
        };
        assert_eq!(field(correction(json!({"void": true, "rows": 2}))), "events[0].rows");
        assert_eq!(field(correction(json!({"actor_id": "u1"}))), "events[0].actor_id");
        assert_eq!(field(correction(json!({"corrects": "a b"}))), "events[0].corrects");
        assert_eq!(field(correction(json!({"void": "yes"}))), "events[0].void");
        // A permit goes on the call (or tokens) event of its check, by a valid id.
        let mut e = call(json!(1));
        e["permit_id"] = json!("a b");
        assert_eq!(field(json!([e])), "events[0].permit_id");
        assert_eq!(field(correction(json!({"permit_id": "pmt_1", "rows": 3}))), "events[0].permit_id");
        let (mut a, mut b) = (call(json!(1)), call(json!(2)));
        a["permit_id"] = json!("pmt_1");
        b["id"] = json!("e2");
        b["permit_id"] = json!("pmt_1");
        let r = Reported::try_from(from_value::<EventsBody>(json!({"events": [a, b]})).expect("body")).expect("valid");
        assert_eq!((r.facts.len(), r.permits), (2, vec![PermitId::parse("pmt_1").expect("id")]));
        let ok: EventsBody = serde_json::from_value(json!({"events": correction(json!({"rows": 3}))})).expect("body");
        let facts = Vec::<UsageFact>::try_from(ok).expect("a valid amend");
        assert_eq!(
            (facts[0].corrects.as_ref().map(|c| c.as_str()), facts[0].rows, facts[0].void),
            (Some("e1"), 3, false)
        );
    }
}
