//! Quota bodies: a quota to create (`POST /v1/quotas`), a change to one
//! (`PATCH /v1/quotas/{id}`), a project's whole set (`PUT
//! /v1/projects/{id}/quotas`, and the file `tollgate apply -f` reads), and
//! a quota, a list of them and a plan as the API shows them.
//!
//! The scope × metric × window rules are `meter`'s ([`meter::quota::validate`],
//! [`meter::apply::plan`]); these bodies only carry what the caller wrote to
//! them, type-checked.

use chrono::{DateTime, Utc};
use meter::apply::{DesiredQuota, QuotaPlan};
use meter::{FieldError, Metric, Mode, Quota, QuotaDraft, QuotaSpec, Usd};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{LimitValue, List, Text, nullable};
use crate::service::quotas::{CurrentUsage, Detail, Document, Edit, LimitInput, Listed};

/// A limit as the API shows it: a whole number, or for `cost_usd` dollars
/// as a decimal string (`"0.01"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum LimitView {
    Whole(u64),
    Dollars(String),
}

impl LimitView {
    /// A value in the metric's unit (picodollars for money).
    pub fn of(metric: Metric, v: u64) -> LimitView {
        if metric.is_money() {
            LimitView::Dollars(Usd(i64::try_from(v).unwrap_or(i64::MAX)).to_string())
        } else {
            LimitView::Whole(v)
        }
    }
}

impl From<LimitValue> for LimitInput {
    fn from(v: LimitValue) -> Self {
        match v {
            LimitValue::Whole(n) => LimitInput::Whole(n),
            LimitValue::Decimal(d) => LimitInput::Decimal(d),
        }
    }
}

fn text(v: Option<Text>) -> Option<String> {
    v.map(|Text(s)| s)
}

/// `POST /v1/quotas`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "proj_0197a3c2", "scope": "api_key", "scope_ref": "key_0197a3c3",
                          "metric": "calls", "window": "day", "limit": 1000}))]
pub struct QuotaBody {
    #[schema(value_type = String)]
    pub project_id: Option<Text>,
    /// `project`, `api_key`, `agent` or `actor` (which the metric allows).
    #[schema(value_type = String)]
    pub scope: Option<Text>,
    /// The key, agent or actor; `null` for the whole project, all keys or
    /// all agents, or one budget per actor.
    #[schema(value_type = Option<String>)]
    pub scope_ref: Option<Text>,
    /// `requests`, `calls`, `rows`, `tokens`, `cost_usd` or `storage_bytes`.
    #[schema(value_type = String)]
    pub metric: Option<Text>,
    /// `rolling_1m`, `rolling_1h`, `rolling_24h`, `day`, `calendar_month`,
    /// or `current` (`storage_bytes` only, and only it).
    #[schema(value_type = String)]
    pub window: Option<Text>,
    /// A whole number > 0; for `cost_usd`, dollars (a number, or a decimal
    /// string with up to 12 places).
    #[schema(value_type = LimitView)]
    pub limit: Option<LimitValue>,
    /// `enforce` (default) or `monitor`.
    #[schema(value_type = Option<String>)]
    pub mode: Option<Text>,
    /// `cost_usd` only: `llm_tokens`, `compute_execution`, `api_request` or
    /// `storage`; `null` for every priced meter.
    #[schema(value_type = Option<String>)]
    pub meter_type: Option<Text>,
    /// `cost_usd` only: `block` (default) or `allow` over a pricing blackout.
    #[schema(value_type = Option<String>)]
    pub on_unpriced: Option<Text>,
}

impl TryFrom<QuotaBody> for QuotaSpec {
    type Error = FieldError;
    fn try_from(b: QuotaBody) -> Result<QuotaSpec, FieldError> {
        let (limit, limit_decimal) = match b.limit {
            None => (None, None),
            Some(LimitValue::Whole(n)) => (Some(n), None),
            Some(LimitValue::Decimal(d)) => (None, Some(d)),
        };
        meter::quota::validate(&QuotaDraft {
            project_id: text(b.project_id),
            scope: text(b.scope),
            scope_ref: text(b.scope_ref),
            metric: text(b.metric),
            window: text(b.window),
            limit,
            limit_decimal,
            mode: text(b.mode),
            meter_type: text(b.meter_type),
            on_unpriced: text(b.on_unpriced),
        })
    }
}

/// `PATCH /v1/quotas/{id}`: only `limit` and `mode` change; an identity
/// field may be restated at its current value.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"limit": 2000, "mode": "monitor"}))]
pub struct QuotaPatchBody {
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub project_id: Option<Option<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub scope: Option<Option<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub scope_ref: Option<Option<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub metric: Option<Option<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub window: Option<Option<String>>,
    /// The new limit (as on creation).
    #[schema(value_type = Option<LimitView>)]
    pub limit: Option<LimitValue>,
    /// The new mode: `enforce` or `monitor`.
    #[schema(value_type = Option<String>)]
    pub mode: Option<Text>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub meter_type: Option<Option<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub on_unpriced: Option<Option<String>>,
}

impl TryFrom<QuotaPatchBody> for Edit {
    type Error = FieldError;
    fn try_from(b: QuotaPatchBody) -> Result<Edit, FieldError> {
        // In meter::quota::IMMUTABLE_FIELDS order.
        let restated = [
            ("project_id", b.project_id),
            ("scope", b.scope),
            ("scope_ref", b.scope_ref),
            ("metric", b.metric),
            ("window", b.window),
            ("meter_type", b.meter_type),
            ("on_unpriced", b.on_unpriced),
        ]
        .into_iter()
        .filter_map(|(f, v)| v.map(|v| (f, v)))
        .collect();
        let mode = match b.mode {
            None => None,
            Some(Text(m)) => {
                Some(m.parse::<Mode>().map_err(|_| FieldError::new("mode", "must be enforce or monitor"))?)
            }
        };
        Ok(Edit { restated, limit: b.limit.map(LimitInput::from), mode })
    }
}

/// One entry of a project's desired quota set. Without `id`, an entry
/// matches the stored quota of the same identity, if any.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"scope": "api_key", "scope_ref": "key_0197a3c3", "metric": "calls", "window": "day", "limit": 1000}))]
pub struct DesiredQuotaBody {
    /// Pins the entry to a stored quota of the project.
    #[schema(value_type = Option<String>)]
    pub id: Option<Text>,
    #[schema(value_type = String)]
    pub scope: Option<Text>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub scope_ref: Option<Option<String>>,
    #[schema(value_type = String)]
    pub metric: Option<Text>,
    #[schema(value_type = String)]
    pub window: Option<Text>,
    #[schema(value_type = LimitView)]
    pub limit: Option<LimitValue>,
    #[schema(value_type = Option<String>)]
    pub mode: Option<Text>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub meter_type: Option<Option<String>>,
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub on_unpriced: Option<Option<String>>,
}

impl From<DesiredQuotaBody> for DesiredQuota {
    fn from(b: DesiredQuotaBody) -> Self {
        let (limit, limit_decimal) = match b.limit {
            None => (None, None),
            Some(LimitValue::Whole(n)) => (Some(n), None),
            Some(LimitValue::Decimal(d)) => (None, Some(d)),
        };
        DesiredQuota {
            id: text(b.id),
            scope: text(b.scope),
            scope_ref: b.scope_ref,
            metric: text(b.metric),
            window: text(b.window),
            limit,
            limit_decimal,
            mode: text(b.mode),
            meter_type: b.meter_type,
            on_unpriced: b.on_unpriced,
        }
    }
}

/// A project's whole quota set (`PUT /v1/projects/{id}/quotas`; the same
/// shape, in YAML, for `tollgate apply -f quotas.yaml`).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "proj_0197a3c2", "quotas": [
    {"scope": "project", "metric": "calls", "window": "day", "limit": 100},
    {"scope": "api_key", "scope_ref": "key_0197a3c3", "metric": "requests", "window": "rolling_1m", "limit": 60, "mode": "monitor"},
]}))]
pub struct QuotaDocumentBody {
    /// The project; if given, it must be the one the document is applied to.
    #[schema(value_type = Option<String>)]
    pub project_id: Option<Text>,
    /// Every quota the project is to have: an empty list deletes them all.
    #[schema(value_type = Vec<DesiredQuotaBody>)]
    pub quotas: Option<List<DesiredQuotaBody>>,
}

impl TryFrom<QuotaDocumentBody> for Document {
    type Error = FieldError;
    fn try_from(b: QuotaDocumentBody) -> Result<Document, FieldError> {
        let List(list) = b.quotas.ok_or_else(|| {
            FieldError::new("quotas", "is required (an empty list deletes every quota of the project)")
        })?;
        if list.len() > meter::apply::MAX_ENTRIES {
            return Err(FieldError::new("quotas", format!("must hold at most {} entries", meter::apply::MAX_ENTRIES)));
        }
        Ok(Document { project_id: text(b.project_id), quotas: list.into_iter().map(DesiredQuota::from).collect() })
    }
}

/// `?dry_run=true`: plan only, change nothing.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DryRunParams {
    /// `true` or `false` (default).
    #[param(value_type = Option<bool>)]
    pub dry_run: Option<String>,
}

impl DryRunParams {
    pub fn dry_run(&self) -> Result<bool, FieldError> {
        match self.dry_run.as_deref() {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(_) => Err(FieldError::new("dry_run", "must be true or false")),
        }
    }
}

/// `GET /v1/quotas?project_id=`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuotasParams {
    /// The project.
    #[param(value_type = String)]
    pub project_id: Option<String>,
}

impl TryFrom<ListQuotasParams> for meter::ProjectId {
    type Error = FieldError;
    fn try_from(p: ListQuotasParams) -> Result<meter::ProjectId, FieldError> {
        let raw = p.project_id.ok_or_else(|| FieldError::new("project_id", "is required"))?;
        meter::ProjectId::parse(raw).map_err(|e| FieldError::new("project_id", e.to_string()))
    }
}

/// A quota's count in its current window: what a check compares, durable +
/// settled + reserved.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CurrentUsageView {
    #[schema(example = "2026-07-07")]
    pub window_key: String,
    /// In the metric's unit; dollars as a decimal string for `cost_usd`.
    pub count: LimitView,
    /// `null` for `current`, which never resets.
    pub resets_at: Option<DateTime<Utc>>,
}

impl CurrentUsageView {
    fn of(metric: Metric, u: CurrentUsage) -> Self {
        CurrentUsageView { window_key: u.window_key, count: LimitView::of(metric, u.count), resets_at: u.resets_at }
    }
}

/// A quota.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "quota_0197a3c4", "project_id": "proj_0197a3c2", "scope": "api_key",
    "scope_ref": "key_0197a3c3", "metric": "calls", "window": "day", "limit": 1000, "mode": "enforce",
    "meter_type": null, "on_unpriced": null, "created_at": "2026-07-07T12:00:00Z",
    "updated_at": "2026-07-07T12:00:00Z", "inert": false}))]
pub struct QuotaView {
    pub id: String,
    pub project_id: String,
    pub scope: String,
    pub scope_ref: Option<String>,
    pub metric: String,
    pub window: String,
    pub limit: LimitView,
    pub mode: String,
    pub meter_type: Option<String>,
    pub on_unpriced: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// True when its `scope_ref` names a deleted key: it matches nothing
    /// any more (on the quota routes; not in a plan).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inert: Option<bool>,
    /// Its current window's count (`GET /v1/quotas/{id}`; `null` in a list,
    /// and for a quota with no single counter: inert, or one budget per actor).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<CurrentUsageView>)]
    pub current_usage: Option<Option<CurrentUsageView>>,
}

impl From<&Quota> for QuotaView {
    fn from(q: &Quota) -> Self {
        let sp = &q.spec;
        QuotaView {
            id: q.id.to_string(),
            project_id: sp.project_id.to_string(),
            scope: sp.scope.as_str().to_owned(),
            scope_ref: sp.scope_ref.clone(),
            metric: sp.metric.as_str().to_owned(),
            window: sp.window.as_str().to_owned(),
            limit: LimitView::of(sp.metric, sp.limit),
            mode: sp.mode.as_str().to_owned(),
            meter_type: sp.meter_type.clone(),
            on_unpriced: sp.on_unpriced.map(|o| o.as_str().to_owned()),
            created_at: q.created_at,
            updated_at: q.updated_at,
            inert: None,
            current_usage: None,
        }
    }
}

impl From<&Listed> for QuotaView {
    fn from(l: &Listed) -> Self {
        QuotaView { inert: Some(l.inert), ..QuotaView::from(&l.quota) }
    }
}

impl From<Detail> for QuotaView {
    fn from(d: Detail) -> Self {
        let metric = d.quota.spec.metric;
        QuotaView {
            inert: Some(d.inert),
            current_usage: Some(d.current_usage.map(|u| CurrentUsageView::of(metric, u))),
            ..QuotaView::from(&d.quota)
        }
    }
}

/// A project's quotas.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QuotaList {
    pub data: Vec<QuotaView>,
    /// Always `null`: a project's quotas come in one page.
    #[schema(value_type = Option<String>)]
    pub next: Option<String>,
}

impl From<&[Listed]> for QuotaList {
    fn from(list: &[Listed]) -> Self {
        QuotaList {
            data: list.iter().map(|l| QuotaView { current_usage: Some(None), ..QuotaView::from(l) }).collect(),
            next: None,
        }
    }
}

/// What an update changed from.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Before {
    pub limit: LimitView,
    pub mode: String,
}

/// One change of a plan.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// `create`, `update` or `delete`.
    pub action: String,
    pub quota: QuotaView,
    /// An update's limit and mode before it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before: Option<Before>,
}

/// What a declarative apply changed (or, on a dry run, would change).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "proj_0197a3c2", "dry_run": false, "created": 0, "updated": 1,
    "deleted": 0, "unchanged": 1, "changes": [{"action": "update", "quota": {"id": "quota_0197a3c4",
    "project_id": "proj_0197a3c2", "scope": "project", "scope_ref": null, "metric": "calls", "window": "day",
    "limit": 300, "mode": "enforce", "meter_type": null, "on_unpriced": null,
    "created_at": "2026-07-07T12:00:00Z", "updated_at": "2026-07-07T13:00:00Z"},
    "before": {"limit": 100, "mode": "enforce"}}]}))]
pub struct PlanView {
    pub project_id: String,
    pub dry_run: bool,
    pub created: usize,
    pub updated: usize,
    pub deleted: usize,
    pub unchanged: usize,
    /// Deletes, then updates, then creates.
    pub changes: Vec<Change>,
}

impl PlanView {
    pub fn of(plan: &QuotaPlan, dry_run: bool) -> Self {
        let mut changes = Vec::with_capacity(plan.deletes.len() + plan.updates.len() + plan.creates.len());
        for q in &plan.deletes {
            changes.push(Change { action: "delete".into(), quota: QuotaView::from(q), before: None });
        }
        for u in &plan.updates {
            changes.push(Change {
                action: "update".into(),
                quota: QuotaView::from(&u.after),
                before: Some(Before {
                    limit: LimitView::of(u.before.spec.metric, u.before.spec.limit),
                    mode: u.before.spec.mode.as_str().to_owned(),
                }),
            });
        }
        for c in &plan.creates {
            changes.push(Change { action: "create".into(), quota: QuotaView::from(&c.quota), before: None });
        }
        PlanView {
            project_id: plan.project_id.to_string(),
            dry_run,
            created: plan.creates.len(),
            updated: plan.updates.len(),
            deleted: plan.deletes.len(),
            unchanged: plan.unchanged,
            changes,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::dto::from_value;

    fn document(v: Value) -> Result<Document, FieldError> {
        Document::try_from(from_value::<QuotaDocumentBody>(v)?)
    }

    fn field(v: Value) -> String {
        document(v).expect_err("refused").field
    }

    #[test]
    fn documents_are_read_field_by_field() {
        let doc = document(json!({
            "project_id": "proj_1",
            "quotas": [
                {"scope": "api_key", "scope_ref": "key_1", "metric": "calls", "window": "day", "limit": 5},
                {"scope": "actor", "scope_ref": null, "metric": "rows", "window": "day", "limit": 9, "mode": "monitor", "id": "q_1"},
            ]
        }))
        .expect("valid");
        assert_eq!(doc.project_id.as_deref(), Some("proj_1"));
        assert_eq!(doc.quotas[0].scope_ref, Some(Some("key_1".into())));
        assert_eq!(doc.quotas[1].scope_ref, Some(None), "an explicit null");
        assert_eq!(doc.quotas[0].meter_type, None, "not supplied");
        assert_eq!(doc.quotas[1].id.as_deref(), Some("q_1"));

        assert_eq!(field(json!({"quotas": [], "colour": "red"})), "colour");
        assert_eq!(field(json!({"project_id": "p"})), "quotas");
        assert_eq!(field(json!({"quotas": {}})), "quotas");
        assert_eq!(field(json!({"quotas": [1]})), "quotas[0]");
        assert_eq!(field(json!({"quotas": [{"scope": "project", "window": "day", "colour": 1}]})), "quotas[0].colour");
        assert_eq!(field(json!({"quotas": [{}, {"window": 5}]})), "quotas[1].window");
        assert_eq!(field(json!({"quotas": [{"limit": true}]})), "quotas[0].limit");
        assert_eq!(field(json!({"quotas": [{"limit": [5]}]})), "quotas[0].limit");
        assert_eq!(field(json!({"quotas": [{"scope_ref": 7}]})), "quotas[0].scope_ref");
        assert_eq!(field(json!([])), "body");
    }

    #[test]
    fn a_patch_restates_identity_fields_in_order() {
        let body: QuotaPatchBody =
            from_value(json!({"window": "day", "scope_ref": null, "limit": 5, "mode": "monitor"})).expect("valid");
        let edit = Edit::try_from(body).expect("valid");
        assert_eq!(edit.restated, vec![("scope_ref", None), ("window", Some("day".to_owned()))]);
        assert_eq!((edit.limit, edit.mode), (Some(LimitInput::Whole(5)), Some(Mode::Monitor)));
        let body: QuotaPatchBody = from_value(json!({"mode": "loud"})).expect("typed");
        assert_eq!(Edit::try_from(body).expect_err("refused").field, "mode");
    }
}
