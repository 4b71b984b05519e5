//! Provisioning: projects, API keys and roles.
//!
//! A key's secret is made here, shown once (in [`IssuedKey`]) and stored
//! only as its hash. A key may take a role of its own project; its limits
//! are its grants narrowed by the role's. [`provision`] is the "project, a
//! key, and a quota on that key" that `tollgate dev`'s demo, the examples,
//! the tests and the benchmarks start from, written once, through the same
//! operations the admin API runs.
//!
//! A key created or deleted and a role created are audited as whoever made
//! the change: the entry is written to the audit outbox in the change's own
//! transaction (see `meter::audit`), and reaches `GET /v1/audit` through the
//! audit topic.

use chrono_tz::Tz;
use meter::{
    ApiKey, ApiKeyId, AuditAction, AuditDetail, CounterKey, Dimension, Grants, KeyView, Metric, Mode, OnUnpriced,
    Principal, Project, ProjectId, Quota, QuotaSpec, Role, RoleId, RoleQuota, RoleView, Scope, WindowKind,
    admin_change,
};

use super::{Error, Result, now_micros, quotas};
use crate::state::{AppState, hash_secret, new_api_key_id, new_audit_id, new_project_id, new_role_id, random_token};

/// A project to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewProject {
    pub name: String,
    /// Its calendar windows' zone.
    pub timezone: Tz,
}

/// An API key to create in a project.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewApiKey {
    pub name: String,
    /// A role of the same project, whose grants narrow the key's and whose
    /// quota applies to it.
    pub role_id: Option<RoleId>,
    pub grants: Grants,
}

/// A created key and its secret, which is never shown again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedKey {
    pub key: ApiKey,
    pub secret: String,
}

/// A role to create in a project.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewRole {
    pub name: String,
    pub grants: Grants,
    pub quota: Option<RoleQuota>,
    /// An administrators' (or break-glass) role: its callers are never
    /// limited or counted.
    pub exempt: bool,
}

/// A key with what applies to it: its effective limits, its role's quota,
/// and its usage this period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDetail {
    pub key: ApiKey,
    /// The key's grants narrowed by its role's.
    pub effective: Grants,
    /// The bounds its calls run under: the server's, narrowed by `effective`.
    pub bounds: meter::Bounds,
    /// The quota its role gives it, if any.
    pub quota: Option<RoleQuota>,
    /// The period: the role quota's window if it has one, else the month.
    pub period: meter::Window,
    /// Calls (settled and reserved) and rows this period.
    pub calls: u64,
    pub rows: u64,
}

pub async fn create_project(s: &AppState, new: NewProject) -> Result<Project> {
    let project = Project { id: new_project_id(), name: new.name, timezone: new.timezone, created_at: s.clock.now() };
    s.stores.tenants.create_project(&project).await?;
    Ok(project)
}

/// A project (404 if there is none).
pub async fn project(s: &AppState, id: &ProjectId) -> Result<Project> {
    s.stores.tenants.project(id).await?.ok_or_else(|| Error::not_found("project", id.as_str()))
}

/// Creates a key in a project (404 if there is no such project; its role,
/// if it names one, must be the project's), audited as `by`.
pub async fn create_api_key(s: &AppState, project_id: &ProjectId, new: NewApiKey, by: &Principal) -> Result<IssuedKey> {
    project(s, project_id).await?;
    if let Some(rid) = &new.role_id {
        match s.stores.tenants.role(rid).await? {
            Some(role) if &role.project_id == project_id => {}
            _ => return Err(Error::invalid("role_id", format!("no role {rid} in project {project_id}"))),
        }
    }
    let secret = format!("tg_{}", random_token(40));
    let key = ApiKey {
        id: new_api_key_id(),
        project_id: project_id.clone(),
        name: new.name,
        prefix: secret[..10].to_owned(),
        grants: new.grants,
        role_id: new.role_id,
        created_at: now_micros(s.clock.as_ref()),
    };
    let entry = admin_change(
        new_audit_id(),
        project_id,
        AuditAction::CreateApiKey,
        key.id.as_str(),
        AuditDetail::ApiKeyChange { before: None, after: Some(KeyView::from(&key)) },
        by,
        key.created_at,
    );
    s.stores.tenants.create_api_key(&key, &hash_secret(&secret), &[entry]).await?;
    Ok(IssuedKey { key, secret })
}

/// A key with its effective limits and usage this period (404 if it does
/// not exist, or was deleted).
pub async fn api_key(s: &AppState, id: &ApiKeyId) -> Result<KeyDetail> {
    let key = s.stores.tenants.api_key(id).await?.ok_or_else(|| Error::not_found("api key", id.as_str()))?;
    let project = project(s, &key.project_id).await?;
    let now = s.clock.now();
    let role = match &key.role_id {
        Some(r) => s.stores.tenants.role(r).await?,
        None => None,
    };
    let quota = role.as_ref().and_then(|r| r.quota);
    let period = meter::window_at(quota.map_or(WindowKind::CalendarMonth, |q| q.per.window()), project.timezone, now);
    let counter =
        CounterKey { dimension: Dimension::ApiKey(id.clone()), window: period.kind, window_key: period.key.clone() };
    let (u, reserved) = super::usage::live_count(s, &project.id, &counter, now).await?;
    let effective = meter::role::effective_grants(&key.grants, role.as_ref());
    let bounds = s.settings.bounds().narrowed(&effective);
    Ok(KeyDetail { key, effective, bounds, quota, period, calls: u.calls + reserved, rows: u.rows })
}

/// A project with how many live keys and quotas it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectSummary {
    pub project: Project,
    pub keys: usize,
    pub quotas: usize,
}

/// Every project, by id, with its counts of keys and quotas.
pub async fn projects(s: &AppState) -> Result<Vec<ProjectSummary>> {
    let mut out = Vec::new();
    for project in s.stores.tenants.projects().await? {
        let keys = s.stores.tenants.api_keys(&project.id).await?.len();
        let quotas = s.stores.quotas.quotas(&project.id).await?.len();
        out.push(ProjectSummary { project, keys, quotas });
    }
    Ok(out)
}

/// A project's live keys, by id (404 if there is no such project).
pub async fn api_keys(s: &AppState, project_id: &ProjectId) -> Result<Vec<ApiKey>> {
    project(s, project_id).await?;
    Ok(s.stores.tenants.api_keys(project_id).await?)
}

/// A project's roles, by id (404 if there is no such project).
pub async fn roles(s: &AppState, project_id: &ProjectId) -> Result<Vec<Role>> {
    project(s, project_id).await?;
    Ok(s.stores.tenants.roles(project_id).await?)
}

/// What a key is granted: its own limits and its role.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyGrants {
    pub role_id: Option<RoleId>,
    pub grants: Grants,
}

/// Replaces a key's grants and role (the role, if one is named, must be
/// its project's, as on creation), audited as `by`; answers the key as it
/// is now (404 if there is no live key with this id). Its cached lookups
/// are forgotten, so this instance's next check runs under the new grants.
pub async fn set_grants(s: &AppState, id: &ApiKeyId, change: KeyGrants, by: &Principal) -> Result<KeyDetail> {
    let key = s.stores.tenants.api_key(id).await?.ok_or_else(|| Error::not_found("api key", id.as_str()))?;
    if let Some(rid) = &change.role_id {
        match s.stores.tenants.role(rid).await? {
            Some(role) if role.project_id == key.project_id => {}
            _ => return Err(Error::invalid("role_id", format!("no role {rid} in project {}", key.project_id))),
        }
    }
    let after = ApiKey { grants: change.grants, role_id: change.role_id, ..key.clone() };
    let entry = admin_change(
        new_audit_id(),
        &key.project_id,
        AuditAction::UpdateApiKey,
        id.as_str(),
        AuditDetail::ApiKeyChange { before: Some(KeyView::from(&key)), after: Some(KeyView::from(&after)) },
        by,
        now_micros(s.clock.as_ref()),
    );
    // Deleted meanwhile by someone else.
    if !s.stores.tenants.update_api_key(&after, &[entry]).await? {
        return Err(Error::not_found("api key", id.as_str()));
    }
    s.invalidate_key(id);
    api_key(s, id).await
}

/// Deletes a key: it no longer authenticates, and quotas naming it go
/// inert (404 if there is no live key with this id); audited as `by`.
pub async fn delete_api_key(s: &AppState, id: &ApiKeyId, by: &Principal) -> Result<()> {
    let key = s.stores.tenants.api_key(id).await?.ok_or_else(|| Error::not_found("api key", id.as_str()))?;
    let at = now_micros(s.clock.as_ref());
    let entry = admin_change(
        new_audit_id(),
        &key.project_id,
        AuditAction::DeleteApiKey,
        id.as_str(),
        AuditDetail::ApiKeyChange { before: Some(KeyView::from(&key)), after: None },
        by,
        at,
    );
    // Deleted meanwhile by someone else: theirs is the entry, this is a 404.
    if !s.stores.tenants.delete_api_key(id, at, &[entry]).await? {
        return Err(Error::not_found("api key", id.as_str()));
    }
    s.invalidate_key(id);
    Ok(())
}

/// Creates a role in a project (404 if there is no such project), audited as `by`.
pub async fn create_role(s: &AppState, project_id: &ProjectId, new: NewRole, by: &Principal) -> Result<Role> {
    project(s, project_id).await?;
    let role = Role {
        id: new_role_id(),
        project_id: project_id.clone(),
        name: new.name,
        grants: new.grants,
        quota: new.quota,
        exempt: new.exempt,
        created_at: now_micros(s.clock.as_ref()),
    };
    let entry = admin_change(
        new_audit_id(),
        project_id,
        AuditAction::CreateRole,
        role.id.as_str(),
        AuditDetail::RoleChange { before: None, after: Some(RoleView::from(&role)) },
        by,
        role.created_at,
    );
    s.stores.tenants.create_role(&role, &[entry]).await?;
    Ok(role)
}

/// A role (404 if there is none).
pub async fn role(s: &AppState, id: &RoleId) -> Result<Role> {
    s.stores.tenants.role(id).await?.ok_or_else(|| Error::not_found("role", id.as_str()))
}

/// A starting point: a project, one key in it, and optionally one enforce
/// quota on that key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Starter {
    pub project: NewProject,
    pub key: NewApiKey,
    pub quota: Option<KeyQuota>,
}

/// An enforce quota on a starter's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyQuota {
    pub metric: Metric,
    pub window: WindowKind,
    pub limit: u64,
}

/// What [`provision`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provisioned {
    pub project: Project,
    pub key: ApiKey,
    /// The key's secret, shown this once.
    pub secret: String,
    pub quota: Option<Quota>,
}

/// Creates a starter's project, key and quota, the key and quota audited as `by`.
pub async fn provision(s: &AppState, starter: Starter, by: &Principal) -> Result<Provisioned> {
    let project = create_project(s, starter.project).await?;
    let IssuedKey { key, secret } = create_api_key(s, &project.id, starter.key, by).await?;
    let quota = match starter.quota {
        None => None,
        Some(q) => Some(key_quota(s, &key, q, by).await?),
    };
    Ok(Provisioned { project, key, secret, quota })
}

/// Creates an enforce quota on one key, audited as `by`.
pub async fn key_quota(s: &AppState, key: &ApiKey, q: KeyQuota, by: &Principal) -> Result<Quota> {
    let spec = QuotaSpec {
        project_id: key.project_id.clone(),
        scope: Scope::ApiKey,
        scope_ref: Some(key.id.to_string()),
        metric: q.metric,
        window: q.window,
        limit: q.limit,
        mode: Mode::Enforce,
        meter_type: None,
        on_unpriced: (q.metric == Metric::CostUsd).then_some(OnUnpriced::Block),
    };
    meter::quota::check_combination(spec.metric, spec.scope, spec.window)?;
    if spec.limit == 0 || spec.limit > meter::quota::MAX_LIMIT as u64 {
        return Err(Error::invalid("limit", "must be a whole number greater than 0"));
    }
    quotas::create(s, spec, by).await
}
