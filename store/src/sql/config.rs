//! Configuration over SQL: projects, API keys and roles, quotas (changed
//! only by a plan, with its audit entries, in one transaction), and the
//! audit trail: its outbox (`audit_outbox`, which every writer fills through
//! [`insert_audit`] in its own transaction and the audit relay publishes to
//! the audit topic) and the audit log (`audit_log`, which only the audit
//! folder writes, from that topic, and `GET /v1/audit` reads).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    ApiKey, ApiKeyId, AuditBatch, AuditEntry, AuditId, AuditStore, PortError, PortResult, Principal, Project,
    ProjectId, Quota, QuotaId, QuotaPlan, QuotaSpec, QuotaStore, Role, RoleId, TenantStore,
};
use meter::{OnUnpriced, Scope};

use super::{Backend, Rec, Rows, SqlStore, Stmt, each, to_i64};

const PROJECT_COLUMNS: &str = "id, name, timezone, created_at";
const API_KEY_COLUMNS: &str = "id, project_id, name, prefix, grants, role_id, created_at";
const ROLE_COLUMNS: &str = "id, project_id, name, grants, quota, exempt, created_at";
pub(crate) const QUOTA_COLUMNS: &str = r#"id, project_id, scope, scope_ref, metric, "window", "limit", mode, meter_type, on_unpriced, created_at, updated_at"#;
const AUDIT_COLUMNS: &str = "id, project_id, action, principal_type, principal_id, resource, detail, created_at";

fn project<B: Backend>(r: &Rec<'_, B>) -> PortResult<Project> {
    Ok(Project {
        id: r.id("id")?,
        name: r.text("name")?,
        timezone: r.parse("timezone")?,
        created_at: r.time("created_at")?,
    })
}

fn api_key<B: Backend>(r: &Rec<'_, B>) -> PortResult<ApiKey> {
    Ok(ApiKey {
        id: r.id("id")?,
        project_id: r.id("project_id")?,
        name: r.text("name")?,
        prefix: r.text("prefix")?,
        role_id: r.opt_id("role_id")?,
        grants: r.json("grants")?,
        created_at: r.time("created_at")?,
    })
}

fn role<B: Backend>(r: &Rec<'_, B>) -> PortResult<Role> {
    Ok(Role {
        id: r.id("id")?,
        project_id: r.id("project_id")?,
        name: r.text("name")?,
        grants: r.json("grants")?,
        quota: r.opt_json("quota")?,
        exempt: r.get("exempt")?,
        created_at: r.time("created_at")?,
    })
}

// OnUnpriced has no as_str/FromStr in meter; these mirror its serde names.
fn on_unpriced_str(o: OnUnpriced) -> &'static str {
    match o {
        OnUnpriced::Block => "block",
        OnUnpriced::Allow => "allow",
    }
}

pub(crate) fn quota<B: Backend>(r: &Rec<'_, B>) -> PortResult<Quota> {
    let on_unpriced = match r.get::<Option<String>>("on_unpriced")?.as_deref() {
        None => None,
        Some("block") => Some(OnUnpriced::Block),
        Some("allow") => Some(OnUnpriced::Allow),
        Some(other) => return Err(super::corrupt("on_unpriced", other)),
    };
    Ok(Quota {
        id: r.id("id")?,
        spec: QuotaSpec {
            project_id: r.id("project_id")?,
            scope: r.parse::<Scope>("scope")?,
            scope_ref: r.get("scope_ref")?,
            metric: r.parse("metric")?,
            window: r.parse("window")?,
            limit: r.count("limit")?,
            mode: r.parse("mode")?,
            meter_type: r.get("meter_type")?,
            on_unpriced,
        },
        created_at: r.time("created_at")?,
        updated_at: r.time("updated_at")?,
    })
}

fn audit<B: Backend>(r: &Rec<'_, B>) -> PortResult<AuditEntry> {
    let principal = match (r.get::<Option<String>>("principal_type")?, r.get::<Option<String>>("principal_id")?) {
        (Some(kind), Some(id)) => Some(Principal { kind, id }),
        _ => None,
    };
    Ok(AuditEntry {
        id: r.id("id")?,
        project_id: r.opt_id("project_id")?,
        action: r.parse("action")?,
        principal,
        resource: r.text("resource")?,
        detail: r.json("detail")?,
        created_at: r.time("created_at")?,
    })
}

/// Writing an entry to the audit outbox, in the caller's transaction: the
/// one way an audit entry is made (admin changes, the fold's corrections and
/// monitor breaches, a disabled endpoint). One whose once-key or id is there
/// already is skipped, published or not, so "once" holds before the log.
pub(crate) fn insert_audit(entry: &AuditEntry) -> PortResult<Stmt> {
    into_audit_table("audit_outbox", entry)
}

/// An `INSERT … ON CONFLICT DO NOTHING` of an entry (with its once-key)
/// into the outbox or the folded log: any uniqueness hit (id, once-key)
/// skips it.
fn into_audit_table(table: &str, entry: &AuditEntry) -> PortResult<Stmt> {
    Ok(Stmt::new(format!(
        "INSERT INTO {table} ({AUDIT_COLUMNS}, once_key) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
         ON CONFLICT DO NOTHING"
    ))
    .text(entry.id.as_str())
    .opt_text(entry.project_id.as_ref().map(ProjectId::as_str))
    .text(entry.action.as_str())
    .opt_text(entry.principal.as_ref().map(|p| p.kind.as_str()))
    .opt_text(entry.principal.as_ref().map(|p| p.id.as_str()))
    .text(&entry.resource)
    .json(&entry.detail)?
    .time(entry.created_at)
    .opt_text(entry.once_key()))
}

#[async_trait]
impl<B: Backend> TenantStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "create_project"))]
    async fn create_project(&self, project: &Project) -> PortResult<()> {
        let stmt = Stmt::new(format!("INSERT INTO projects ({PROJECT_COLUMNS}) VALUES ($1, $2, $3, $4)"))
            .text(project.id.as_str())
            .text(&project.name)
            .text(project.timezone.name())
            .time(project.created_at);
        self.run(stmt).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "project"))]
    async fn project(&self, id: &ProjectId) -> PortResult<Option<Project>> {
        let stmt = Stmt::new(format!("SELECT {PROJECT_COLUMNS} FROM projects WHERE id = $1")).text(id.as_str());
        self.opt(stmt).await?.as_ref().map(|r| project(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "projects"))]
    async fn projects(&self) -> PortResult<Vec<Project>> {
        let stmt = Stmt::new(format!("SELECT {PROJECT_COLUMNS} FROM projects ORDER BY id"));
        each(&self.all(stmt).await?, project::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "create_api_key"))]
    async fn create_api_key(&self, key: &ApiKey, secret_hash: &str, audit: &[AuditEntry]) -> PortResult<()> {
        let stmt = Stmt::new(format!(
            "INSERT INTO api_keys ({API_KEY_COLUMNS}, secret_hash) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
        ))
        .text(key.id.as_str())
        .text(key.project_id.as_str())
        .text(&key.name)
        .text(&key.prefix)
        .json(&key.grants)?
        .opt_text(key.role_id.as_ref().map(RoleId::as_str))
        .time(key.created_at)
        .text(secret_hash);
        self.run_audited(stmt, audit).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "api_key"))]
    async fn api_key(&self, id: &ApiKeyId) -> PortResult<Option<ApiKey>> {
        let stmt = Stmt::new(format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE id = $1 AND deleted_at IS NULL"))
            .text(id.as_str());
        self.opt(stmt).await?.as_ref().map(|r| api_key(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "api_key_by_secret_hash"))]
    async fn api_key_by_secret_hash(&self, hash: &str) -> PortResult<Option<ApiKey>> {
        let stmt =
            Stmt::new(format!("SELECT {API_KEY_COLUMNS} FROM api_keys WHERE secret_hash = $1 AND deleted_at IS NULL"))
                .text(hash);
        self.opt(stmt).await?.as_ref().map(|r| api_key(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "delete_api_key"))]
    async fn delete_api_key(&self, id: &ApiKeyId, at: DateTime<Utc>, audit: &[AuditEntry]) -> PortResult<bool> {
        let stmt = Stmt::new("UPDATE api_keys SET deleted_at = $2 WHERE id = $1 AND deleted_at IS NULL")
            .text(id.as_str())
            .time(at);
        Ok(self.run_audited(stmt, audit).await? > 0)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "api_keys"))]
    async fn api_keys(&self, project: &ProjectId) -> PortResult<Vec<ApiKey>> {
        let stmt = Stmt::new(format!(
            "SELECT {API_KEY_COLUMNS} FROM api_keys WHERE project_id = $1 AND deleted_at IS NULL ORDER BY id"
        ))
        .text(project.as_str());
        each(&self.all(stmt).await?, api_key::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "update_api_key"))]
    async fn update_api_key(&self, key: &ApiKey, audit: &[AuditEntry]) -> PortResult<bool> {
        let stmt = Stmt::new("UPDATE api_keys SET grants = $2, role_id = $3 WHERE id = $1 AND deleted_at IS NULL")
            .text(key.id.as_str())
            .json(&key.grants)?
            .opt_text(key.role_id.as_ref().map(RoleId::as_str));
        Ok(self.run_audited(stmt, audit).await? > 0)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "create_role"))]
    async fn create_role(&self, role: &Role, audit: &[AuditEntry]) -> PortResult<()> {
        let stmt = Stmt::new(format!("INSERT INTO roles ({ROLE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"))
            .text(role.id.as_str())
            .text(role.project_id.as_str())
            .text(&role.name)
            .json(&role.grants)?
            .opt_json(role.quota.as_ref())?
            .flag(role.exempt)
            .time(role.created_at);
        self.run_audited(stmt, audit).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "role"))]
    async fn role(&self, id: &RoleId) -> PortResult<Option<Role>> {
        let stmt = Stmt::new(format!("SELECT {ROLE_COLUMNS} FROM roles WHERE id = $1")).text(id.as_str());
        self.opt(stmt).await?.as_ref().map(|r| role(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "roles"))]
    async fn roles(&self, project: &ProjectId) -> PortResult<Vec<Role>> {
        let stmt = Stmt::new(format!("SELECT {ROLE_COLUMNS} FROM roles WHERE project_id = $1 ORDER BY id"))
            .text(project.as_str());
        each(&self.all(stmt).await?, role::<B>)
    }
}

pub(crate) fn insert_quota(q: &Quota) -> PortResult<Stmt> {
    let s = &q.spec;
    Ok(Stmt::new(format!(
        "INSERT INTO quotas ({QUOTA_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
    ))
    .text(q.id.as_str())
    .text(s.project_id.as_str())
    .text(s.scope.as_str())
    .opt_text(s.scope_ref.as_deref())
    .text(s.metric.as_str())
    .text(s.window.as_str())
    .int(to_i64("limit", s.limit)?)
    .text(s.mode.as_str())
    .opt_text(s.meter_type.as_deref())
    .opt_text(s.on_unpriced.map(on_unpriced_str))
    .time(q.created_at)
    .time(q.updated_at))
}

#[async_trait]
impl<B: Backend> QuotaStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "quota"))]
    async fn quota(&self, id: &QuotaId) -> PortResult<Option<Quota>> {
        let stmt = Stmt::new(format!("SELECT {QUOTA_COLUMNS} FROM quotas WHERE id = $1")).text(id.as_str());
        self.opt(stmt).await?.as_ref().map(|r| quota(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "quotas"))]
    async fn quotas(&self, project: &ProjectId) -> PortResult<Vec<Quota>> {
        let stmt =
            Stmt::new(format!("SELECT {QUOTA_COLUMNS} FROM quotas WHERE project_id = $1 ORDER BY created_at, id"))
                .text(project.as_str());
        each(&self.all(stmt).await?, quota::<B>)
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = B::SPAN_DB, op = "apply_quotas", creates = plan.creates.len(),
               updates = plan.updates.len(), deletes = plan.deletes.len())
    )]
    async fn apply_quotas(&self, plan: &QuotaPlan, audit: &[AuditEntry]) -> PortResult<()> {
        // Dropping `tx` without committing rolls everything back, so every
        // early return below changes nothing.
        let mut tx = B::begin(&self.pool).await.map_err(super::error::<B>)?;
        let project = plan.project_id.as_str();

        // The backend's lock (PostgreSQL: the project's row, FOR NO KEY
        // UPDATE, which leaves foreign-key checks of other tables unblocked;
        // SQLite: the file's write lock, taken by BEGIN IMMEDIATE) serialises
        // every plan of one project, so the set read below cannot move
        // before the commit.
        let lock = Stmt::new(format!("SELECT id FROM projects WHERE id = $1{}", B::LOCK_PROJECT)).text(project);
        if B::fetch(&mut *tx, lock).await?.is_empty() {
            return Err(PortError::Permanent(format!("project {project} does not exist")));
        }
        if let Some(expected) = &plan.based_on {
            let stmt = Stmt::new(format!("SELECT {QUOTA_COLUMNS} FROM quotas WHERE project_id = $1")).text(project);
            let mut now = each(&B::fetch(&mut *tx, stmt).await?, quota::<B>)?;
            let mut expected = expected.clone();
            now.sort_by(|a, b| a.id.cmp(&b.id));
            expected.sort_by(|a, b| a.id.cmp(&b.id));
            if now != expected {
                return Err(PortError::Fenced(format!(
                    "the quotas of project {project} changed since the plan was made"
                )));
            }
        }

        if !plan.deletes.is_empty() {
            let ids = Rows::new().text("id", plan.deletes.iter().map(|q| q.id.as_str()));
            let want = ids.len() as u64;
            let stmt = Stmt::new("DELETE FROM quotas WHERE project_id = $1 AND id IN (SELECT id FROM {rows} AS t)")
                .text(project)
                .rows(ids);
            let gone = B::execute(&mut *tx, stmt).await?;
            if gone != want {
                return Err(PortError::Conflict(format!("{} of {want} quotas to delete no longer exist", want - gone)));
            }
        }
        for u in &plan.updates {
            let stmt = Stmt::new(
                r#"UPDATE quotas SET "limit" = $3, mode = $4, updated_at = $5 WHERE id = $1 AND project_id = $2"#,
            )
            .text(u.before.id.as_str())
            .text(project)
            .int(to_i64("limit", u.after.spec.limit)?)
            .text(u.after.spec.mode.as_str())
            .time(u.after.updated_at);
            if B::execute(&mut *tx, stmt).await? != 1 {
                return Err(PortError::Conflict(format!("quota {} no longer exists", u.before.id)));
            }
        }
        for c in &plan.creates {
            if c.quota.spec.project_id != plan.project_id {
                return Err(PortError::Permanent(format!("quota {} is not of project {project}", c.quota.id)));
            }
            B::execute(&mut *tx, insert_quota(&c.quota)?).await?;
        }
        for entry in audit {
            B::execute(&mut *tx, insert_audit(entry)?).await?;
        }
        tx.commit().await.map_err(super::error::<B>)
    }
}

#[async_trait]
impl<B: Backend> AuditStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "record_audit"))]
    async fn record_audit(&self, entry: &AuditEntry) -> PortResult<bool> {
        Ok(self.run(insert_audit(entry)?).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "audit"))]
    async fn audit(
        &self,
        project: Option<&ProjectId>,
        after: Option<&AuditId>,
        limit: usize,
    ) -> PortResult<Vec<AuditEntry>> {
        // `project_id IS NULL` spelled out rather than `IS NOT DISTINCT
        // FROM`, so that each reads its index (audit_log_project_idx, or
        // audit_log_installation_idx for the entries of no project).
        let of = match project {
            Some(_) => "project_id = $3",
            None => "project_id IS NULL AND CAST($3 AS TEXT) IS NULL",
        };
        let stmt = Stmt::new(format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_log \
             WHERE {of} AND (CAST($1 AS TEXT) IS NULL OR id > $1) ORDER BY id LIMIT $2"
        ))
        .opt_text(after.map(AuditId::as_str))
        .int(super::limit(limit))
        .opt_text(project.map(ProjectId::as_str));
        each(&self.all(stmt).await?, audit::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "unpublished_audit"))]
    async fn unpublished_audit(&self, limit: usize) -> PortResult<Vec<AuditEntry>> {
        let stmt = Stmt::new(format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_outbox WHERE published_at IS NULL ORDER BY seq LIMIT $1"
        ))
        .int(super::limit(limit));
        each(&self.all(stmt).await?, audit::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "audit_published", n = ids.len()))]
    async fn audit_published(&self, ids: &[AuditId], at: DateTime<Utc>) -> PortResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let rows = Rows::new().text("id", ids.iter().map(AuditId::as_str));
        let stmt = Stmt::new(
            "UPDATE audit_outbox SET published_at = $1 \
             WHERE published_at IS NULL AND id IN (SELECT id FROM {rows} AS t)",
        )
        .time(at)
        .rows(rows);
        self.run(stmt).await.map(drop)
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = B::SPAN_DB, op = "fold_audit", entries = batch.entries.len(), partitions = batch.offsets.len())
    )]
    async fn fold_audit(&self, batch: &AuditBatch) -> PortResult<usize> {
        // Dropping `tx` without committing rolls everything back.
        let mut tx = B::begin(&self.pool).await.map_err(super::error::<B>)?;
        super::ledger::fence_offsets::<B>(&mut *tx, &batch.consumer, &batch.topic, &batch.offsets).await?;
        let mut new = 0;
        // One statement per entry: the audit topic carries admin changes
        // and breaches, a few a second at most, not usage.
        for entry in &batch.entries {
            new += B::execute(&mut *tx, into_audit_table("audit_log", entry)?).await? as usize;
        }
        tx.commit().await.map_err(super::error::<B>)?;
        Ok(new)
    }
}
