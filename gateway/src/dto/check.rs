//! `POST /v1/check`: who is calling, and what the check granted.
//!
//! The body is parsed in one allocation-light pass straight into typed
//! fields: the hot path pays for the strings it keeps and nothing else.

use chrono::{DateTime, Utc};
use meter::{ApiKeyId, FieldError, Permit, RoleId};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::events::TokenBody;
use super::{Count, DecimalText, Flag, List, Object, Text, Whole, opt_id};
use crate::service::admission::{CheckRequest, EstimateAsk, KeyRef, Who};

/// A check names its caller by one of: an API key's secret (`api_key`), its
/// id (`api_key_id`), a signed-in user with a role (`user` + `role_id`), or
/// `break_glass`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"api_key": "tg_8fK2xQpLr0d9WmZt3cVb7nYh1sEa4uJi6oKf5gHq", "agent_id": "support-bot",
                          "actor_id": "alice"}))]
pub struct CheckBody {
    /// The caller's API key secret.
    #[schema(value_type = Option<String>)]
    pub api_key: Option<Text>,
    /// The caller's API key, by id.
    #[schema(value_type = Option<String>)]
    pub api_key_id: Option<Text>,
    /// A signed-in user, `user:<subject>`, checked against `role_id`'s quota.
    #[schema(value_type = Option<String>, example = "user:alice")]
    pub user: Option<Text>,
    /// The role of a signed-in `user` (a key's role is its own).
    #[schema(value_type = Option<String>)]
    pub role_id: Option<Text>,
    /// The break-glass caller: never limited or counted.
    #[schema(value_type = Option<bool>)]
    pub break_glass: Option<Flag>,
    /// The caller's project, if the gateway knows it: it must be the key's (or role's).
    #[schema(value_type = Option<String>)]
    pub project_id: Option<Text>,
    /// The agent making the call, for `agent` quotas and attribution.
    #[schema(value_type = Option<String>)]
    pub agent_id: Option<Text>,
    /// The end user, for `actor` quotas and attribution.
    #[schema(value_type = Option<String>)]
    pub actor_id: Option<Text>,
    /// Bytes the call will store (negative: delete), for `storage_bytes` quotas.
    #[schema(value_type = Option<i64>)]
    pub storage_bytes_delta: Option<Whole>,
    /// Take a concurrency permit with the reservation (both or neither),
    /// for a caller with `max_concurrent` (its key's or role's): held until
    /// `DELETE /v1/permits/{id}`, the settle of an event naming it
    /// (`permit_id`), or its lease lapses (renew it with `POST
    /// /v1/permits/{id}/renew`). Over the cap: 429 `TOO_MANY_CONCURRENT`.
    /// A caller with no `max_concurrent`, an exempt role's and the
    /// break-glass caller take none.
    #[schema(value_type = Option<bool>)]
    pub permit: Option<Flag>,
    /// Answer every quota and limit the check evaluated (`explain`): in the
    /// 200 body, or beside the `error` of a refusal, whose `error` is
    /// unchanged. From the same read the verdict came from.
    #[schema(value_type = Option<bool>)]
    pub explain: Option<Flag>,
    /// What the call is expected to use, reserved on the caller's enforce
    /// `tokens` and `cost_usd` quotas as a call is on `calls` (all or
    /// nothing: refused when used + reserved + estimate > limit), replaced
    /// by the actual usage when the call's event settles the reservation,
    /// freed when its lease lapses. A caller with no such quota, an exempt
    /// role's and the break-glass caller reserve nothing (it is still
    /// validated).
    #[schema(value_type = Option<EstimateBody>)]
    pub estimate: Option<Object<EstimateBody>>,
}

/// A check's estimate: the amounts (`tokens`, `cost_usd`), or the tokens of
/// each model (`models`, as a `tokens` event reports them), from which the
/// billable tokens are counted and the cost priced by the price book at the
/// check (a model without a price adds no cost: the check then reserves its
/// tokens only, and cost quotas read it as an unestimated call).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"models": [{"provider": "openai", "model": "gpt-4o", "input": 1000, "output": 500}]}))]
pub struct EstimateBody {
    /// Billable tokens (input + output + cached).
    #[schema(value_type = Option<u64>, minimum = 0)]
    pub tokens: Option<Count>,
    /// Dollars on the `llm_tokens` meter, up to 12 decimal places: a
    /// decimal string or a number taken as written.
    #[schema(value_type = Option<String>, example = "0.05")]
    pub cost_usd: Option<DecimalText>,
    /// Token counts per model, priced from the price book.
    #[schema(value_type = Option<Vec<TokenBody>>)]
    pub models: Option<List<TokenBody>>,
}

impl TryFrom<EstimateBody> for EstimateAsk {
    type Error = FieldError;
    fn try_from(b: EstimateBody) -> Result<EstimateAsk, FieldError> {
        if let Some(List(models)) = b.models {
            if b.tokens.is_some() || b.cost_usd.is_some() {
                return Err(FieldError::new("models", "give tokens and cost_usd, or models, not both"));
            }
            if models.is_empty() {
                return Err(FieldError::new("models", "must name at least one model"));
            }
            let models = models
                .into_iter()
                .enumerate()
                .map(|(j, t)| meter::TokenUsage::try_from(t).map_err(|e| e.under(&format!("models[{j}]."))))
                .collect::<Result<Vec<_>, _>>()?;
            // The rules of a tokens event's counts, so an estimate prices
            // exactly as the event that settles it will.
            meter::usage::check_token_usage("models", &models)?;
            return Ok(EstimateAsk::Models(models));
        }
        let tokens = b.tokens.map_or(0, |Count(t)| t);
        if tokens > meter::usage::MAX_QUANTITY {
            return Err(FieldError::new("tokens", format!("is more than 2^53 ({})", meter::usage::MAX_QUANTITY)));
        }
        let cost = match b.cost_usd {
            None => 0,
            Some(DecimalText(d)) => {
                let usd = meter::Usd::parse(&d).map_err(|m| FieldError::new("cost_usd", m))?;
                u64::try_from(usd.picos()).map_err(|_| FieldError::new("cost_usd", "must be ≥ 0"))?
            }
        };
        if tokens == 0 && cost == 0 {
            return Err(FieldError::new("tokens", "an estimate names tokens > 0, cost_usd > 0 or models"));
        }
        Ok(EstimateAsk::Amounts(meter::Estimate { tokens, cost }))
    }
}

impl TryFrom<CheckBody> for CheckRequest {
    type Error = FieldError;
    fn try_from(b: CheckBody) -> Result<CheckRequest, FieldError> {
        let agent = opt_id(b.agent_id, "agent_id")?;
        let actor = opt_id(b.actor_id, "actor_id")?;
        let storage_delta = b.storage_bytes_delta.map(|Whole(d)| d);
        let project = b.project_id.map(|Text(p)| p);
        let permit = b.permit.is_some_and(|Flag(p)| p);
        let explain = b.explain.is_some_and(|Flag(e)| e);
        let estimate = match b.estimate {
            None => EstimateAsk::None,
            Some(Object(e)) => EstimateAsk::try_from(e).map_err(|e| e.under("estimate."))?,
        };
        let req = |who| CheckRequest { who, project, agent, actor, storage_delta, permit, explain, estimate };
        // The break-glass caller is never limited or counted (ADR-0011).
        if b.break_glass.is_some_and(|Flag(f)| f) {
            return Ok(req(Who::BreakGlass));
        }
        if let Some(Text(user)) = b.user {
            if b.api_key.is_some() || b.api_key_id.is_some() {
                return Err(FieldError::new("user", "give api_key, api_key_id or user, not several"));
            }
            meter::usage::check_user(&user).map_err(|m| FieldError::new("user", m))?;
            let role = opt_id(b.role_id, "role_id")?.ok_or_else(|| {
                FieldError::new("role_id", "a signed-in user is checked against its role: role_id is required")
            })?;
            let role = RoleId::parse(role).map_err(|e| FieldError::new("role_id", e.to_string()))?;
            return Ok(req(Who::User { user, role }));
        }
        if b.role_id.is_some() {
            return Err(FieldError::new("role_id", "a key's role is its own; role_id goes with user"));
        }
        let id = opt_id(b.api_key_id, "api_key_id")?;
        let key = match (b.api_key, id) {
            (Some(_), Some(_)) => return Err(FieldError::new("api_key", "give api_key or api_key_id, not both")),
            (Some(Text(secret)), None) => KeyRef::Secret(secret),
            (None, Some(id)) => {
                KeyRef::Id(ApiKeyId::parse(id).map_err(|e| FieldError::new("api_key_id", e.to_string()))?)
            }
            (None, None) => return Err(FieldError::new("api_key", "api_key or api_key_id is required")),
        };
        Ok(req(Who::Key(key)))
    }
}

/// The bounds an admitted call runs under: the server's
/// (`TOLLGATE_QUERY_TIMEOUT`, `TOLLGATE_MAX_PAGE_SIZE`,
/// `TOLLGATE_STREAM_MAX_ROWS`) narrowed by the key's and role's grants.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CallLimits {
    /// Seconds (rounded up).
    pub query_timeout: u64,
    /// The rows of one page.
    pub max_rows: u64,
    /// The rows of one streamed response.
    pub stream_max_rows: u64,
}

impl From<meter::Bounds> for CallLimits {
    fn from(b: meter::Bounds) -> Self {
        CallLimits {
            query_timeout: whole_secs(b.query_timeout),
            max_rows: b.max_rows,
            stream_max_rows: b.stream_max_rows,
        }
    }
}

/// Seconds, rounded up (a bound of 1.5 s is shown as 2).
pub fn whole_secs(d: std::time::Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// A concurrency permit held: free it with `DELETE /v1/permits/{id}` (or
/// name it as `permit_id` on the call's event), keep it with `POST
/// /v1/permits/{id}/renew`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "pmt_0197a3c7", "expires_at": "2026-07-07T12:01:00Z", "fencing_token": 42}))]
pub struct PermitView {
    pub id: String,
    /// When its lease lapses unless renewed: the effective `query_timeout` + 30 s after the check (or renewal).
    pub expires_at: DateTime<Utc>,
    /// Greater than every permit's granted before it: what the permit
    /// guards can refuse a holder whose lease lapsed and whose slot went to
    /// a later one.
    pub fencing_token: u64,
}

impl From<&Permit> for PermitView {
    fn from(p: &Permit) -> Self {
        PermitView { id: p.id.to_string(), expires_at: p.expires_at, fencing_token: p.token }
    }
}

/// An admitted check. Settle it with the call's event (its
/// `reservation_id`); an exempt caller has nothing to settle.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"allowed": true, "reservation_id": "res_0197a3c6",
                          "limits": {"query_timeout": 30, "max_rows": 500, "stream_max_rows": 500}}))]
pub struct CheckResponse {
    /// Always true: a refusal is an error answer.
    pub allowed: bool,
    /// Present (true) for an exempt or break-glass caller.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exempt: Option<bool>,
    /// `null` for an exempt caller.
    pub reservation_id: Option<String>,
    /// The permit taken, for a check that asked for one from a caller with
    /// `max_concurrent`; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permit: Option<PermitView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<CallLimits>,
    /// Present (true) when the view was unreachable and policy admitted the
    /// call uncounted (it is still metered on the log).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded: Option<bool>,
    /// Every quota and limit the check evaluated, for a check that asked
    /// (`"explain": true`); empty when the view was not reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<ExplainedView>>,
}

/// One quota limit a check evaluated, as the view read it in the check's
/// one step.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"quota_id": "quota_0197a3c4", "scope": "api_key", "scope_ref": "key_0197a3c3", "metric": "calls",
    "kind": "cap", "window": "day", "window_key": "2026-07-07", "durable": 990, "settled": 6, "reserved": 3, "used": 999,
    "limit": 1000, "need": 1, "verdict": "within", "reported": false}))]
pub struct ExplainedView {
    pub quota_id: String,
    pub scope: String,
    pub scope_ref: Option<String>,
    pub metric: String,
    /// `cap` (used + need against the limit), `blackout` (the window's LLM
    /// events while none is priced), or `probe` (read only: unpriced usage).
    pub kind: String,
    pub window: String,
    pub window_key: String,
    /// Folded into the durable totals. The amounts of a `cost_usd` cap are
    /// dollars as decimal strings, like its limit; every other is a count.
    #[schema(value_type = Amount)]
    pub durable: Amount,
    /// Settled but not folded yet (negative when a correction takes some back).
    #[schema(value_type = Amount)]
    pub settled: Amount,
    /// What other checks' live reservations hold: a call each (a `calls`
    /// limit), their estimates (a `tokens` or `cost_usd` limit).
    #[schema(value_type = Amount)]
    pub reserved: Amount,
    /// What the limit compared: durable + settled + reserved for a cap.
    #[schema(value_type = Amount)]
    pub used: Amount,
    #[schema(value_type = Amount)]
    pub limit: Amount,
    /// What this check adds before comparing: 1 for a call (and a tokens
    /// or cost limit without an estimate), its estimate (a tokens or cost
    /// limit), 0 for requests.
    #[schema(value_type = Amount)]
    pub need: Amount,
    /// `within`, `refused` (over, an enforce quota), `over` (a monitor
    /// quota) or `read` (a probe).
    pub verdict: String,
    /// The one a refusal reports.
    pub reported: bool,
}

/// An amount in an explained limit: a count, or dollars as a decimal
/// string (`"0.0105"`) on a `cost_usd` cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(untagged)]
#[schema(example = json!("0.0105"))]
pub enum Amount {
    Count(i64),
    Dollars(String),
}

impl Amount {
    /// `v` in the limit's unit: picodollars shown as dollars when `money`.
    fn of(money: bool, v: i64) -> Amount {
        if money { Amount::Dollars(meter::Usd(v).to_string()) } else { Amount::Count(v) }
    }
}

impl From<&meter::Explained> for ExplainedView {
    fn from(e: &meter::Explained) -> Self {
        // A blackout and a probe of a cost quota count LLM events.
        let money = e.metric.is_money() && e.kind == meter::LimitKind::Cap;
        let amount = |v: u64| Amount::of(money, i64::try_from(v).unwrap_or(i64::MAX));
        ExplainedView {
            quota_id: e.quota_id.to_string(),
            scope: e.scope.as_str().to_owned(),
            scope_ref: e.scope_ref.clone(),
            metric: e.metric.as_str().to_owned(),
            kind: match e.kind {
                meter::LimitKind::Cap => "cap",
                meter::LimitKind::Blackout => "blackout",
                meter::LimitKind::Probe => "probe",
            }
            .to_owned(),
            window: e.window.as_str().to_owned(),
            window_key: e.window_key.clone(),
            durable: amount(e.parts.durable),
            settled: Amount::of(money, e.parts.settled),
            reserved: amount(e.parts.reserved),
            used: amount(e.used),
            limit: amount(e.limit),
            need: amount(e.need),
            verdict: e.verdict.as_str().to_owned(),
            reported: e.reported,
        }
    }
}

/// The explain list as the API shows it.
pub fn explained(list: &[meter::Explained]) -> Vec<ExplainedView> {
    list.iter().map(ExplainedView::from).collect()
}

impl CheckResponse {
    pub fn exempt() -> Self {
        CheckResponse {
            allowed: true,
            exempt: Some(true),
            reservation_id: None,
            permit: None,
            limits: None,
            degraded: None,
            explain: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::dto::from_value;

    fn parse(v: serde_json::Value) -> Result<CheckRequest, FieldError> {
        CheckRequest::try_from(from_value::<CheckBody>(v)?)
    }

    #[test]
    fn a_check_names_one_caller() {
        let r = parse(json!({"api_key": "tg_x", "actor_id": "alice", "permit": true})).expect("valid");
        assert_eq!(
            (r.who, r.actor.as_deref(), r.permit),
            (Who::Key(KeyRef::Secret("tg_x".into())), Some("alice"), true)
        );
        assert!(!parse(json!({"api_key": "tg_x", "permit": false})).expect("valid").permit);
        assert!(!parse(json!({"api_key": "tg_x"})).expect("valid").permit);
        assert_eq!(parse(json!({"break_glass": true, "user": "alice"})).expect("valid").who, Who::BreakGlass);
        for (body, field) in [
            (json!({}), "api_key"),
            (json!({"api_key": "a", "api_key_id": "key_1"}), "api_key"),
            (json!({"api_key_id": "a b"}), "api_key_id"),
            (json!({"api_key": "a", "role_id": "role_1"}), "role_id"),
            (json!({"user": "alice", "role_id": "role_1"}), "user"),
            (json!({"user": "user:alice"}), "role_id"),
            (json!({"user": "user:alice", "api_key": "a", "role_id": "r"}), "user"),
            (json!({"api_key": "a", "actor_id": ""}), "actor_id"),
            (json!({"api_key": "a", "storage_bytes_delta": 1.5}), "storage_bytes_delta"),
            (json!({"api_key": "a", "break_glass": "yes"}), "break_glass"),
            (json!({"api_key": "a", "permit": "yes"}), "permit"),
            (json!({"api_key": "a", "permit": 1}), "permit"),
            (json!({"api_key": "a", "explain": "yes"}), "explain"),
            (json!({"api_key": "a", "colour": "red"}), "colour"),
        ] {
            assert_eq!(parse(body.clone()).expect_err("refused").field, field, "{body}");
        }
    }
}
