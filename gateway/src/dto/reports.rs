//! Read-side bodies: usage reports (`GET /v1/usage`) and the audit log
//! (`GET /v1/audit`). Money is exact: picodollar sums printed as decimal
//! dollar strings (`"0.0025"`), never floats.

use chrono::{DateTime, Utc};
use meter::{AuditEntry, AuditId, FieldError, ModelUsageRow, ProjectId, Totals, Usd, WindowKind};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::timestamp;
use crate::service::Page;
use crate::service::audit::{AuditQuery, AuditScope, MAX_PAGE, MAX_PAGED_ROWS};
use crate::service::usage::{GroupBy, Member, Report, Rows, UsageQuery};

fn project(raw: Option<String>) -> Result<ProjectId, FieldError> {
    let raw = raw.ok_or_else(|| FieldError::new("project_id", "is required"))?;
    ProjectId::parse(raw).map_err(|e| FieldError::new("project_id", e.to_string()))
}

/// `GET /v1/usage` parameters.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UsageParams {
    /// The project.
    #[param(value_type = String)]
    pub project_id: Option<String>,
    /// `model`, `actor`, `agent` or `api_key`.
    #[param(value_type = String)]
    pub group_by: Option<String>,
    /// `day` or `calendar_month` (default), in the project's time zone.
    pub window: Option<String>,
    /// RFC 3339: report the window containing this instant (default now).
    #[param(value_type = Option<DateTime<Utc>>)]
    pub at: Option<String>,
}

impl TryFrom<UsageParams> for UsageQuery {
    type Error = FieldError;
    fn try_from(p: UsageParams) -> Result<UsageQuery, FieldError> {
        let project_id = project(p.project_id)?;
        let group_by = p.group_by.ok_or_else(|| FieldError::new("group_by", "is required"))?;
        let group_by = group_by.parse::<GroupBy>().map_err(|_| {
            FieldError::new("group_by", format!("must be one of model, actor, agent, api_key; got {group_by:?}"))
        })?;
        let window = match p.window.as_deref() {
            None | Some("calendar_month") => WindowKind::CalendarMonth,
            Some("day") => WindowKind::Day,
            Some(w) => return Err(FieldError::new("window", format!("must be day or calendar_month; got {w:?}"))),
        };
        let at =
            p.at.map(|t| {
                timestamp(&t, "at")
                    .map_err(|_| FieldError::new("at", format!("must be an RFC 3339 timestamp; got {t:?}")))
            })
            .transpose()?;
        Ok(UsageQuery { project_id, group_by, window, at })
    }
}

/// Token usage of one (provider, model, component, meter, embedding).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelUsageView {
    pub provider: String,
    pub model: String,
    pub component: String,
    pub meter_type: String,
    pub embedding: bool,
    pub priced_quantity: u64,
    pub unpriced_quantity: u64,
    /// Dollars, a decimal string.
    pub cost_usd: String,
}

impl From<&ModelUsageRow> for ModelUsageView {
    fn from(r: &ModelUsageRow) -> Self {
        ModelUsageView {
            provider: r.key.provider.clone(),
            model: r.key.model.clone(),
            component: r.key.component.as_str().to_owned(),
            meter_type: r.meter.as_str().to_owned(),
            embedding: r.embedding,
            priced_quantity: r.priced_quantity,
            unpriced_quantity: r.unpriced_quantity,
            cost_usd: r.cost.to_string(),
        }
    }
}

/// One actor, agent or key: its counts and its priced cost on every meter.
/// Exactly one of the ids is present, by `group_by`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MemberUsageView {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actor_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_id: Option<String>,
    pub requests: u64,
    pub calls: u64,
    pub rows: u64,
    pub tokens: u64,
    /// Dollars over every meter, a decimal string.
    pub cost_usd: String,
}

impl MemberUsageView {
    fn of(field: &str, id: String, t: &Totals) -> Self {
        let cost = Usd(i64::try_from(t.cost(None)).unwrap_or(i64::MAX));
        let mut v = MemberUsageView {
            actor_id: None,
            agent_id: None,
            api_key_id: None,
            requests: t.requests,
            calls: t.calls,
            rows: t.rows,
            tokens: t.tokens,
            cost_usd: cost.to_string(),
        };
        match field {
            "actor_id" => v.actor_id = Some(id),
            "agent_id" => v.agent_id = Some(id),
            _ => v.api_key_id = Some(id),
        }
        v
    }
}

impl From<&Member> for MemberUsageView {
    fn from(m: &Member) -> Self {
        MemberUsageView::of(m.field, m.id.clone(), &m.totals)
    }
}

/// A row of a report: by model, or by member.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum UsageRow {
    Model(ModelUsageView),
    Member(MemberUsageView),
}

/// A project's folded usage in one window.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "proj_0197a3c2", "window": "calendar_month", "window_key": "2026-08",
    "group_by": "model", "data": [{"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
    "meter_type": "llm_tokens", "embedding": false, "priced_quantity": 1000, "unpriced_quantity": 0,
    "cost_usd": "0.0025"}]}))]
pub struct UsageReport {
    pub project_id: String,
    pub window: String,
    pub window_key: String,
    pub group_by: String,
    /// By model: one row per (provider, model, component, meter_type,
    /// embedding); otherwise one per actor_id, agent_id or api_key_id.
    pub data: Vec<UsageRow>,
}

impl From<&Report> for UsageReport {
    fn from(r: &Report) -> Self {
        let data = match &r.rows {
            Rows::Models(rows) => rows.iter().map(|m| UsageRow::Model(m.into())).collect(),
            Rows::Members(rows) => rows.iter().map(|m| UsageRow::Member(m.into())).collect(),
        };
        UsageReport {
            project_id: r.project.id.to_string(),
            window: r.window.kind.as_str().to_owned(),
            window_key: r.window.key.clone(),
            group_by: r.group_by.as_str().to_owned(),
            data,
        }
    }
}

/// `GET /v1/audit` parameters.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditParams {
    /// `project` (default): one project's entries, named by `project_id`;
    /// `installation`: the installation-wide entries (writes of the price
    /// book, which belongs to no project), without a `project_id`.
    #[param(value_type = Option<String>, example = "installation")]
    pub scope: Option<String>,
    /// The project; required with `scope=project`, refused with
    /// `scope=installation`.
    #[param(value_type = Option<String>)]
    pub project_id: Option<String>,
    /// Cursor: the `next` of the previous page.
    pub after: Option<String>,
    /// Entries per page, 1–1000 (default 100).
    #[param(value_type = Option<u64>)]
    pub limit: Option<String>,
    /// Page number from 1, only while page × limit ≤ 10,000; use `after` beyond.
    #[param(value_type = Option<u64>)]
    pub page: Option<String>,
}

fn whole(raw: Option<&str>, name: &str) -> Result<Option<u64>, FieldError> {
    raw.map(|v| v.parse::<u64>().map_err(|_| FieldError::new(name, format!("must be a whole number; got {v:?}"))))
        .transpose()
}

impl TryFrom<AuditParams> for AuditQuery {
    type Error = FieldError;
    fn try_from(p: AuditParams) -> Result<AuditQuery, FieldError> {
        let scope = match p.scope.as_deref() {
            None | Some("project") => AuditScope::Project(project(p.project_id)?),
            Some("installation") => match p.project_id {
                None => AuditScope::Installation,
                Some(_) => {
                    return Err(FieldError::new(
                        "project_id",
                        "must not be given with scope=installation: installation-wide entries belong to no project",
                    ));
                }
            },
            Some(other) => {
                return Err(FieldError::new("scope", format!("must be project or installation; got {other:?}")));
            }
        };
        let limit = whole(p.limit.as_deref(), "limit")?.unwrap_or(100);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(FieldError::new("limit", format!("must be between 1 and {MAX_PAGE}")));
        }
        let after =
            p.after.map(|a| AuditId::parse(a).map_err(|e| FieldError::new("after", e.to_string()))).transpose()?;
        let skip = match whole(p.page.as_deref(), "page")? {
            None => 0,
            Some(_) if after.is_some() => {
                return Err(FieldError::new("page", "cannot be combined with after; page by cursor with after alone"));
            }
            Some(0) => return Err(FieldError::new("page", "must be 1 or more")),
            Some(n) if n.saturating_mul(limit) > MAX_PAGED_ROWS => {
                return Err(FieldError::new(
                    "page",
                    "page × limit must stay within 10,000 rows; page by cursor instead: pass after=<the next of the previous page>",
                ));
            }
            Some(n) => (n - 1) * limit,
        };
        Ok(AuditQuery { scope, after, limit, skip })
    }
}

/// An audit entry: an admin change, a monitor breach…
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AuditEntryView {
    pub id: String,
    /// The project, or `null` for an installation-wide entry (`scope=installation`).
    pub project_id: Option<String>,
    /// `quotas:CreateQuota`, `quotas:UpdateQuota`, `quotas:DeleteQuota`, `quotas:MonitorBreach`,
    /// `keys:CreateApiKey`, `keys:UpdateApiKey` (grants changed: `PUT /v1/api-keys/{id}/grants`, the console), `keys:DeleteApiKey`,
    /// `roles:CreateRole`, `webhooks:CreateEndpoint`,
    /// `webhooks:UpdateEndpoint`, `webhooks:DeleteEndpoint`, `webhooks:RotateSecret`,
    /// `events:CorrectEvent`, `webhook.endpoint_disabled`; installation-wide: `prices:PutPrices`.
    pub action: String,
    /// `admin`, or `null` for what the system recorded itself.
    pub principal_type: Option<String>,
    pub principal_id: Option<String>,
    /// What the entry is about: a quota, key, role, webhook endpoint or event id, or `prices`.
    pub resource: String,
    /// What happened, tagged by `kind`.
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
    pub created_at: DateTime<Utc>,
}

impl From<&AuditEntry> for AuditEntryView {
    fn from(e: &AuditEntry) -> Self {
        AuditEntryView {
            id: e.id.to_string(),
            project_id: e.project_id.as_ref().map(ToString::to_string),
            action: e.action.as_str().to_owned(),
            principal_type: e.principal.as_ref().map(|p| p.kind.clone()),
            principal_id: e.principal.as_ref().map(|p| p.id.clone()),
            resource: e.resource.clone(),
            detail: serde_json::to_value(&e.detail).unwrap_or(serde_json::Value::Null),
            created_at: e.created_at,
        }
    }
}

/// A page of the audit log, in time order.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"data": [{"id": "aud_0197a3c7", "project_id": "proj_0197a3c2",
    "action": "quotas:MonitorBreach", "principal_type": null, "principal_id": null, "resource": "quota_0197a3c4",
    "detail": {"kind": "quota_monitor_breach", "metric": "requests", "meter_type": null, "window": "day",
               "window_key": "2026-07-07", "limit": 2, "observed_value": 3},
    "created_at": "2026-07-07T12:00:00Z"}], "next": "aud_0197a3c7"}))]
pub struct AuditPage {
    pub data: Vec<AuditEntryView>,
    /// The cursor of the next page (`after`), or `null` on the last.
    pub next: Option<String>,
}

impl From<&Page<AuditEntry>> for AuditPage {
    fn from(p: &Page<AuditEntry>) -> Self {
        AuditPage { data: p.items.iter().map(AuditEntryView::from).collect(), next: p.next.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dto::from_query;

    fn usage(q: &str) -> Result<UsageQuery, FieldError> {
        UsageQuery::try_from(from_query::<UsageParams>(q)?)
    }

    #[test]
    fn a_query_defaults_to_the_current_month() {
        let q = usage("project_id=proj_1&group_by=actor").expect("valid");
        assert_eq!((q.group_by, q.window, q.at), (GroupBy::Actor, WindowKind::CalendarMonth, None));
        let q = usage("project_id=proj_1&group_by=api_key&window=day&at=2026-07-07T12:00:00%2B05:45").expect("valid");
        assert_eq!(q.window, WindowKind::Day);
        assert_eq!(q.at.map(|t| t.to_rfc3339()), Some("2026-07-07T06:15:00+00:00".to_owned()));
    }

    #[test]
    fn a_bad_parameter_is_named() {
        let cases = [
            ("group_by=model", "project_id"),
            ("project_id=proj_1", "group_by"),
            ("project_id=proj_1&group_by=user", "group_by"),
            ("project_id=proj_1&group_by=model&window=rolling_1h", "window"),
            ("project_id=proj_1&group_by=model&at=yesterday", "at"),
            ("project_id=proj_1&group_by=model&limit=10", "limit"),
        ];
        for (q, name) in cases {
            assert_eq!(usage(q).expect_err(name).field, name);
        }
    }

    #[test]
    fn a_member_costs_every_meter_exactly() {
        let t = Totals { calls: 2, cost_llm_tokens: 2_500_000_000, cost_storage: 1, ..Totals::default() };
        assert_eq!(MemberUsageView::of("actor_id", "u".into(), &t).cost_usd, "0.002500000001");
    }

    #[test]
    fn audit_pages_stay_within_the_paged_rows() {
        let audit = |q: &str| AuditQuery::try_from(from_query::<AuditParams>(q).expect("typed"));
        for (q, field) in [
            ("project_id=p&limit=1000&page=11", "page"),
            ("project_id=p&limit=0", "limit"),
            ("project_id=p&limit=ten", "limit"),
            ("project_id=p&page=0", "page"),
            ("project_id=p&page=1&after=aud_1", "page"),
            ("project_id=p&after=a%20b", "after"),
            ("limit=5", "project_id"),
            ("scope=project", "project_id"),
            ("scope=installation&project_id=p", "project_id"),
            ("scope=everything", "scope"),
            ("scope=installation&page=0", "page"),
            ("scope=installation&limit=1000&page=11", "page"),
        ] {
            assert_eq!(audit(q).expect_err(q).field, field, "{q}");
        }
        assert_eq!(audit("project_id=p&limit=10&page=3").expect("valid").skip, 20);
        assert_eq!(
            audit("project_id=p").expect("valid").scope,
            AuditScope::Project(ProjectId::parse("p").expect("id"))
        );
        assert_eq!(
            audit("scope=project&project_id=p").expect("valid").scope,
            audit("project_id=p").expect("valid").scope
        );
        let q = audit("scope=installation&limit=10&page=2").expect("valid");
        assert_eq!((q.scope, q.skip), (AuditScope::Installation, 10));
    }
}
