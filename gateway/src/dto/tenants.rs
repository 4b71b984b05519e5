//! Tenant bodies: projects, API keys (with their grants) and roles.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use meter::{FieldError, Grants, Per, Project, Role, RoleId, RoleQuota};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Count, Flag, Object, Text, name, required};
use crate::service::provisioning::{IssuedKey, KeyDetail, KeyGrants, NewApiKey, NewProject, NewRole};

/// `POST /v1/projects`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "acme", "timezone": "Asia/Kathmandu"}))]
pub struct ProjectBody {
    /// 1–200 characters.
    #[schema(value_type = String)]
    pub name: Option<Text>,
    /// An IANA time zone, for calendar windows (default `UTC`); fixed once created.
    #[schema(value_type = Option<String>)]
    pub timezone: Option<Text>,
}

impl TryFrom<ProjectBody> for NewProject {
    type Error = FieldError;
    fn try_from(b: ProjectBody) -> Result<NewProject, FieldError> {
        let name = name(b.name)?;
        let timezone = match b.timezone {
            None => Tz::UTC,
            Some(Text(t)) => {
                Tz::from_str(&t).map_err(|_| FieldError::new("timezone", format!("{t:?} is not an IANA time zone")))?
            }
        };
        Ok(NewProject { name, timezone })
    }
}

/// A project.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "proj_0197a3c2", "name": "acme", "timezone": "Asia/Kathmandu",
                          "created_at": "2026-07-07T12:00:00Z"}))]
pub struct ProjectView {
    pub id: String,
    pub name: String,
    pub timezone: String,
    pub created_at: DateTime<Utc>,
}

impl From<&Project> for ProjectView {
    fn from(p: &Project) -> Self {
        ProjectView {
            id: p.id.to_string(),
            name: p.name.clone(),
            timezone: p.timezone.name().to_owned(),
            created_at: p.created_at,
        }
    }
}

/// Per-key limits (ADR-0011): they only narrow; the effective value is the
/// smallest of key, role and server.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"max_concurrent": 4, "query_timeout": 30, "max_rows": 500}))]
pub struct GrantsBody {
    /// Concurrent permits, 1–1000.
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    pub max_concurrent: Option<Count>,
    /// Seconds, > 0.
    #[schema(value_type = Option<u64>, minimum = 1)]
    pub query_timeout: Option<Count>,
    /// Rows per call, > 0.
    #[schema(value_type = Option<u64>, minimum = 1)]
    pub max_rows: Option<Count>,
}

impl TryFrom<GrantsBody> for Grants {
    type Error = FieldError;
    /// Errors name the field within the grants (`max_rows`).
    fn try_from(b: GrantsBody) -> Result<Grants, FieldError> {
        let max_concurrent = b.max_concurrent.map(|Count(c)| c);
        if let Some(c) = max_concurrent
            && !(1..=1000).contains(&c)
        {
            return Err(FieldError::new("max_concurrent", "must be between 1 and 1000"));
        }
        let (query_timeout, max_rows) = (b.query_timeout.map(|Count(c)| c), b.max_rows.map(|Count(c)| c));
        for (f, v) in [("query_timeout", query_timeout), ("max_rows", max_rows)] {
            if v == Some(0) {
                return Err(FieldError::new(f, "must be greater than 0"));
            }
        }
        Ok(Grants { max_concurrent: max_concurrent.map(|c| c as u32), query_timeout, max_rows })
    }
}

fn grants(g: Option<Object<GrantsBody>>) -> Result<Grants, FieldError> {
    match g {
        None => Ok(Grants::default()),
        Some(Object(g)) => Grants::try_from(g).map_err(|e| e.under("grants.")),
    }
}

/// Grants as shown: only those set.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantsView {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_timeout: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u64>,
}

impl From<&Grants> for GrantsView {
    fn from(g: &Grants) -> Self {
        GrantsView { max_concurrent: g.max_concurrent, query_timeout: g.query_timeout, max_rows: g.max_rows }
    }
}

/// The limits that apply: the key's grants narrowed by its role's and by
/// the server's bounds (a grant wider than the server's is shown in
/// `grants` and narrowed here); `max_concurrent` is `null` when none applies.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EffectiveLimits {
    pub max_concurrent: Option<u32>,
    /// Seconds (rounded up).
    pub query_timeout: u64,
    /// The rows of one page.
    pub max_rows: u64,
    /// The rows of one streamed response.
    pub stream_max_rows: u64,
}

/// `POST /v1/projects/{id}/api-keys`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "partner", "role_id": "role_0197a3c5", "grants": {"max_rows": 1000}}))]
pub struct ApiKeyBody {
    /// 1–200 characters.
    #[schema(value_type = String)]
    pub name: Option<Text>,
    #[schema(value_type = Option<GrantsBody>)]
    pub grants: Option<Object<GrantsBody>>,
    /// A role of the same project.
    #[schema(value_type = Option<String>)]
    pub role_id: Option<Text>,
}

impl TryFrom<ApiKeyBody> for NewApiKey {
    type Error = FieldError;
    fn try_from(b: ApiKeyBody) -> Result<NewApiKey, FieldError> {
        let name = name(b.name)?;
        let KeyGrants { role_id, grants } = KeyGrantsBody { grants: b.grants, role_id: b.role_id }.try_into()?;
        Ok(NewApiKey { name, role_id, grants })
    }
}

/// `PUT /v1/api-keys/{id}/grants`: what the key is granted from now on,
/// replacing what it had (a limit left out is no grant of that limit; no
/// `role_id`, no role).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"role_id": "role_0197a3c5", "grants": {"max_concurrent": 4, "max_rows": 500}}))]
pub struct KeyGrantsBody {
    #[schema(value_type = Option<GrantsBody>)]
    pub grants: Option<Object<GrantsBody>>,
    /// A role of the key's project.
    #[schema(value_type = Option<String>)]
    pub role_id: Option<Text>,
}

impl TryFrom<KeyGrantsBody> for KeyGrants {
    type Error = FieldError;
    fn try_from(b: KeyGrantsBody) -> Result<KeyGrants, FieldError> {
        let role_id = b
            .role_id
            .map(|Text(r)| RoleId::parse(r).map_err(|e| FieldError::new("role_id", e.to_string())))
            .transpose()?;
        Ok(KeyGrants { role_id, grants: grants(b.grants)? })
    }
}

/// A created key, with its secret shown this once.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "key_0197a3c3", "project_id": "proj_0197a3c2", "name": "partner",
    "prefix": "tg_8fK2xQp", "grants": {"max_rows": 1000}, "role_id": null, "created_at": "2026-07-07T12:00:00Z",
    "secret": "tg_8fK2xQpLr0d9WmZt3cVb7nYh1sEa4uJi6oKf5gHq"}))]
pub struct IssuedKeyView {
    pub id: String,
    pub project_id: String,
    pub name: String,
    /// The first characters of the secret, to recognise it by.
    pub prefix: String,
    pub grants: GrantsView,
    pub role_id: Option<String>,
    pub created_at: DateTime<Utc>,
    /// Never shown again.
    pub secret: String,
}

impl From<&IssuedKey> for IssuedKeyView {
    fn from(i: &IssuedKey) -> Self {
        let k = &i.key;
        IssuedKeyView {
            id: k.id.to_string(),
            project_id: k.project_id.to_string(),
            name: k.name.clone(),
            prefix: k.prefix.clone(),
            grants: GrantsView::from(&k.grants),
            role_id: k.role_id.as_ref().map(ToString::to_string),
            created_at: k.created_at,
            secret: i.secret.clone(),
        }
    }
}

/// The quota a key takes from its role.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyQuotaView {
    pub calls: Option<u64>,
    pub rows: Option<u64>,
    /// `day` or `month`.
    pub per: String,
    pub from_role: Option<String>,
}

/// A key's calls (settled and reserved) and rows this period.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PeriodUsage {
    pub calls: u64,
    pub rows: u64,
    pub period_start: DateTime<Utc>,
    pub resets_at: Option<DateTime<Utc>>,
}

/// A key with what applies to it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "key_0197a3c3", "project_id": "proj_0197a3c2", "name": "partner",
    "prefix": "tg_8fK2xQp", "grants": {"max_rows": 1000}, "role_id": "role_0197a3c5",
    "created_at": "2026-07-07T12:00:00Z",
    "effective_limits": {"max_concurrent": null, "query_timeout": 30, "max_rows": 500, "stream_max_rows": 500},
    "quota": {"calls": 2, "rows": null, "per": "day", "from_role": "role_0197a3c5"},
    "usage_this_period": {"calls": 1, "rows": 3, "period_start": "2026-07-07T00:00:00Z",
                          "resets_at": "2026-07-08T00:00:00Z"}}))]
pub struct KeyDetailView {
    pub id: String,
    pub project_id: String,
    pub name: String,
    pub prefix: String,
    /// What the key itself was granted.
    pub grants: GrantsView,
    pub role_id: Option<String>,
    pub created_at: DateTime<Utc>,
    /// Its grants narrowed by its role's.
    pub effective_limits: EffectiveLimits,
    /// Its role's quota, if the role has one.
    pub quota: Option<KeyQuotaView>,
    /// The period is the role quota's, else the calendar month.
    pub usage_this_period: PeriodUsage,
}

impl From<&KeyDetail> for KeyDetailView {
    fn from(d: &KeyDetail) -> Self {
        let k = &d.key;
        KeyDetailView {
            id: k.id.to_string(),
            project_id: k.project_id.to_string(),
            name: k.name.clone(),
            prefix: k.prefix.clone(),
            grants: GrantsView::from(&k.grants),
            role_id: k.role_id.as_ref().map(ToString::to_string),
            created_at: k.created_at,
            effective_limits: EffectiveLimits {
                max_concurrent: d.effective.max_concurrent,
                query_timeout: crate::dto::check::whole_secs(d.bounds.query_timeout),
                max_rows: d.bounds.max_rows,
                stream_max_rows: d.bounds.stream_max_rows,
            },
            quota: d.quota.map(|q| KeyQuotaView {
                calls: q.calls,
                rows: q.rows,
                per: q.per.as_str().to_owned(),
                from_role: k.role_id.as_ref().map(ToString::to_string),
            }),
            usage_this_period: PeriodUsage {
                calls: d.calls,
                rows: d.rows,
                period_start: d.period.start,
                resets_at: d.period.resets_at,
            },
        }
    }
}

/// A role's quota: `{"calls", "rows", "per": "day" | "month"}`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RoleQuotaBody {
    #[schema(value_type = Option<u64>, minimum = 1)]
    pub calls: Option<Count>,
    #[schema(value_type = Option<u64>, minimum = 1)]
    pub rows: Option<Count>,
    /// `day` or `month`.
    #[schema(value_type = String)]
    pub per: Option<Text>,
}

impl TryFrom<RoleQuotaBody> for RoleQuota {
    type Error = FieldError;
    /// Errors name the field in full (`quota.per`), as [`RoleQuota::check`] does.
    fn try_from(b: RoleQuotaBody) -> Result<RoleQuota, FieldError> {
        let per = match required(b.per, "quota.per")?.0.as_str() {
            "day" => Per::Day,
            "month" => Per::Month,
            _ => return Err(FieldError::new("quota.per", "must be day or month")),
        };
        let q = RoleQuota { calls: b.calls.map(|Count(c)| c), rows: b.rows.map(|Count(c)| c), per };
        q.check()?;
        Ok(q)
    }
}

/// `POST /v1/projects/{id}/roles`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "analyst", "grants": {"max_rows": 500, "query_timeout": 30},
                          "quota": {"calls": 2, "per": "day"}}))]
pub struct RoleBody {
    /// 1–200 characters.
    #[schema(value_type = String)]
    pub name: Option<Text>,
    #[schema(value_type = Option<GrantsBody>)]
    pub grants: Option<Object<GrantsBody>>,
    /// Each caller's own allowance.
    #[schema(value_type = Option<RoleQuotaBody>)]
    pub quota: Option<Object<RoleQuotaBody>>,
    /// An administrators' (or break-glass) role: never limited or counted.
    #[schema(value_type = Option<bool>)]
    pub exempt: Option<Flag>,
}

impl TryFrom<RoleBody> for NewRole {
    type Error = FieldError;
    fn try_from(b: RoleBody) -> Result<NewRole, FieldError> {
        let name = name(b.name)?;
        let exempt = b.exempt.is_some_and(|Flag(e)| e);
        let grants = grants(b.grants)?;
        let quota = b.quota.map(|Object(q)| RoleQuota::try_from(q)).transpose()?;
        Ok(NewRole { name, grants, quota, exempt })
    }
}

/// A role's quota as shown.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RoleQuotaView {
    pub calls: Option<u64>,
    pub rows: Option<u64>,
    pub per: String,
}

/// A role.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "role_0197a3c5", "project_id": "proj_0197a3c2", "name": "analyst",
    "grants": {"max_rows": 500, "query_timeout": 30}, "quota": {"calls": 2, "rows": null, "per": "day"},
    "exempt": false, "created_at": "2026-07-07T12:00:00Z"}))]
pub struct RoleView {
    pub id: String,
    pub project_id: String,
    pub name: String,
    pub grants: GrantsView,
    pub quota: Option<RoleQuotaView>,
    pub exempt: bool,
    pub created_at: DateTime<Utc>,
}

impl From<&Role> for RoleView {
    fn from(r: &Role) -> Self {
        RoleView {
            id: r.id.to_string(),
            project_id: r.project_id.to_string(),
            name: r.name.clone(),
            grants: GrantsView::from(&r.grants),
            quota: r.quota.map(|q| RoleQuotaView { calls: q.calls, rows: q.rows, per: q.per.as_str().to_owned() }),
            exempt: r.exempt,
            created_at: r.created_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::dto::from_value;

    fn role_field(v: serde_json::Value) -> String {
        match from_value::<RoleBody>(v) {
            Err(e) => e.field,
            Ok(b) => NewRole::try_from(b).expect_err("refused").field,
        }
    }

    fn key_field(v: serde_json::Value) -> String {
        match from_value::<ApiKeyBody>(v) {
            Err(e) => e.field,
            Ok(b) => NewApiKey::try_from(b).expect_err("refused").field,
        }
    }

    #[test]
    fn grants_and_role_quotas_are_named_in_full() {
        assert_eq!(role_field(json!({"name": "x", "quota": {"per": "day"}})), "quota");
        assert_eq!(role_field(json!({"name": "x", "quota": {"calls": 0, "per": "day"}})), "quota.calls");
        assert_eq!(role_field(json!({"name": "x", "quota": {"calls": 5, "per": "week"}})), "quota.per");
        assert_eq!(role_field(json!({"name": "x", "quota": {"calls": 5}})), "quota.per");
        assert_eq!(role_field(json!({"name": "x", "exempt": "yes"})), "exempt");
        assert_eq!(role_field(json!({"name": " "})), "name");
        assert_eq!(key_field(json!({"name": "k", "grants": {"max_rows": 0}})), "grants.max_rows");
        assert_eq!(key_field(json!({"name": "k", "grants": {"max_concurrent": 1001}})), "grants.max_concurrent");
        assert_eq!(key_field(json!({"name": "k", "grants": {"colour": 1}})), "grants.colour");
        assert_eq!(key_field(json!({"name": "k", "grants": 5})), "grants");
        assert_eq!(key_field(json!({"name": "k", "role_id": "a b"})), "role_id");
        assert_eq!(key_field(json!({})), "name");
        let k = NewApiKey::try_from(
            from_value::<ApiKeyBody>(json!({"name": "k", "grants": {"max_rows": 9}})).expect("typed"),
        )
        .expect("valid");
        assert_eq!(k.grants, Grants { max_rows: Some(9), ..Grants::default() });
    }
}
