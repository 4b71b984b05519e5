//! The store in one local SQLite file, for `tollgate dev`.
//!
//! [`SqliteStore`] is [`PgStore`](crate::PgStore) without a server: the same
//! tables (`migrations/sqlite/`), the same observable behaviour, checked by
//! the same conformance suite (`store/tests/store_conformance.rs`).
//!
//! - [`Store::fold_batch`] is **one transaction**, begun `IMMEDIATE` so two
//!   writers queue on the file's write lock (within `busy_timeout`) instead of
//!   failing on a stale snapshot. It fences on the offsets exactly like
//!   PostgreSQL, records the new event ids in `processed_events` and upserts
//!   the aggregates, with a fixed number of statements per batch (one per
//!   partition for the fence, one for the time zones, one for the dedup set,
//!   one upsert). Lists travel as one JSON array bound to one parameter and
//!   unpacked by `json_each`, the way PostgreSQL's `UNNEST` does it, so a
//!   batch of any size stays far from SQLite's bind-parameter limit.
//! - Opened with [`SqliteStore::open`], the file is in WAL mode with
//!   `synchronous = FULL`: a fold whose commit returned survives a crash or a
//!   `kill -9` of the process (and a power cut, as far as fsync holds).
//! - Timestamps are stored as text in one fixed form, RFC 3339 UTC with six
//!   fractional digits, so the text compares and sorts like the instants.
//!   Precision is the microsecond, like PostgreSQL's `timestamptz`.
//! - A quota's identity treats NULLs as equal (PostgreSQL's `NULLS NOT
//!   DISTINCT`) through a unique index over `ifnull(x, '')` and `x IS NULL`.
//!
//! Driver errors are sorted into transient, permanent and conflict in one
//! place, [`db_err`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Datelike, Utc};
use chrono_tz::Tz;
use meter::{
    ApiKey, ApiKeyId, AuditAction, AuditDetail, AuditEntry, AuditId, Counter, CounterKey, Dimension, EventId, Fold,
    FoldBatch, FoldReport, Grants, Metric, Mode, OnUnpriced, PortError, PortResult, Principal, Project, ProjectId,
    Quota, QuotaId, QuotaPatch, QuotaPlan, QuotaSpec, Scope, Store, Totals, UsageFact, WindowKind,
};
use sqlx::Row;
use sqlx::error::ErrorKind;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};

/// How long a statement waits for another connection's lock before it fails
/// (as [`PortError::Transient`]).
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The embedded store; cheap to clone (it is a pool handle).
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating it if missing) the database file at `path`: WAL
    /// journal, `synchronous = FULL`, foreign keys on, a busy timeout. The
    /// directory must exist. Call [`SqliteStore::migrate`] next.
    pub async fn open(path: &Path) -> PortResult<SqliteStore> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(db_err)?;
        Ok(SqliteStore::from_pool(pool))
    }

    /// Wraps an existing pool. Its connect options are the caller's: the
    /// durability and locking described above need those of [`SqliteStore::open`].
    pub fn from_pool(pool: SqlitePool) -> SqliteStore {
        SqliteStore { pool }
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Applies the migrations in `migrations/sqlite/` (idempotent).
    pub async fn migrate(&self) -> PortResult<()> {
        sqlx::migrate!("../migrations/sqlite").run(&self.pool).await.map_err(|e| match e {
            sqlx::migrate::MigrateError::Execute(e) => db_err(e),
            other => PortError::Permanent(format!("migrating: {other}")),
        })
    }

    /// Forgets folded event ids that occurred before `before` (the dedup
    /// horizon, as [`PgStore::purge_processed_before`](crate::PgStore::purge_processed_before)).
    /// Returns how many were removed.
    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "purge_processed_before")
    )]
    pub async fn purge_processed_before(&self, before: DateTime<Utc>) -> PortResult<u64> {
        let done = sqlx::query("DELETE FROM processed_events WHERE occurred_at < ?1")
            .bind(ts(before)?)
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(done.rows_affected())
    }
}

// SQLite primary result codes (the low byte of an extended code).
const SQLITE_NOMEM: i32 = 7;
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;

/// Sorts a driver error, once: a uniqueness violation is a conflict; a
/// lock held too long, an I/O error, a full disk, an exhausted pool is worth
/// retrying; the rest (a foreign key or check violation, a bad file) is
/// permanent.
fn db_err(e: sqlx::Error) -> PortError {
    match &e {
        sqlx::Error::Database(d) => {
            if d.kind() == ErrorKind::UniqueViolation {
                return PortError::Conflict(d.message().to_owned());
            }
            let code = d.code().and_then(|c| c.parse::<i32>().ok()).unwrap_or(0);
            match code & 0xff {
                SQLITE_BUSY | SQLITE_LOCKED | SQLITE_NOMEM | SQLITE_IOERR | SQLITE_FULL => {
                    PortError::Transient(e.to_string())
                }
                _ => PortError::Permanent(e.to_string()),
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => PortError::Transient(e.to_string()),
        _ => PortError::Permanent(e.to_string()),
    }
}

fn corrupt(what: &str, value: &str) -> PortError {
    PortError::Permanent(format!("stored {what} {value:?} is not valid"))
}

fn parse<T: FromStr>(what: &str, value: &str) -> PortResult<T> {
    value.parse().map_err(|_| corrupt(what, value))
}

fn get<'r, T>(row: &'r SqliteRow, column: &str) -> PortResult<T>
where
    T: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
{
    row.try_get(column).map_err(db_err)
}

/// An instant as stored: `YYYY-MM-DDTHH:MM:SS.ffffffZ`, truncated to the
/// microsecond. Only four-digit years keep the text sortable.
fn ts(at: DateTime<Utc>) -> PortResult<String> {
    if !(0..=9999).contains(&at.year()) {
        return Err(PortError::Permanent(format!("instant {at} is outside the years 0 to 9999")));
    }
    Ok(at.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string())
}

fn parse_ts(what: &str, value: &str) -> PortResult<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(value).map(|d| d.with_timezone(&Utc)).map_err(|_| corrupt(what, value))
}

fn get_ts(row: &SqliteRow, column: &str) -> PortResult<DateTime<Utc>> {
    let s: String = get(row, column)?;
    parse_ts(column, &s)
}

fn get_opt_ts(row: &SqliteRow, column: &str) -> PortResult<Option<DateTime<Utc>>> {
    let s: Option<String> = get(row, column)?;
    s.as_deref().map(|s| parse_ts(column, s)).transpose()
}

fn to_i64(what: &str, v: u64) -> PortResult<i64> {
    i64::try_from(v).map_err(|_| PortError::Permanent(format!("{what} {v} does not fit a 64-bit integer")))
}

fn to_u64(what: &str, v: i64) -> PortResult<u64> {
    u64::try_from(v).map_err(|_| corrupt(what, &v.to_string()))
}

/// A list as one JSON array, for `json_each(?)`.
fn json_list<T: serde::Serialize>(items: &T) -> PortResult<String> {
    serde_json::to_string(items).map_err(|e| PortError::Permanent(format!("encoding a batch: {e}")))
}

// OnUnpriced has no as_str/FromStr in meter; these mirror its serde names.
fn on_unpriced_str(o: OnUnpriced) -> &'static str {
    match o {
        OnUnpriced::Block => "block",
        OnUnpriced::Allow => "allow",
    }
}

fn parse_on_unpriced(s: &str) -> PortResult<OnUnpriced> {
    match s {
        "block" => Ok(OnUnpriced::Block),
        "allow" => Ok(OnUnpriced::Allow),
        _ => Err(corrupt("on_unpriced", s)),
    }
}

fn project_from_row(row: &SqliteRow) -> PortResult<Project> {
    let id: String = get(row, "id")?;
    let tz: String = get(row, "timezone")?;
    Ok(Project {
        id: ProjectId::parse(&id).map_err(|_| corrupt("project id", &id))?,
        name: get(row, "name")?,
        timezone: parse("time zone", &tz)?,
        created_at: get_ts(row, "created_at")?,
    })
}

// Column lists as macros, so `concat!` builds `&'static str` queries.
macro_rules! api_key_columns {
    () => {
        "id, project_id, name, prefix, grants, created_at"
    };
}

fn api_key_from_row(row: &SqliteRow) -> PortResult<ApiKey> {
    let id: String = get(row, "id")?;
    let project: String = get(row, "project_id")?;
    let grants: String = get(row, "grants")?;
    Ok(ApiKey {
        id: ApiKeyId::parse(&id).map_err(|_| corrupt("api key id", &id))?,
        project_id: ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?,
        name: get(row, "name")?,
        prefix: get(row, "prefix")?,
        grants: serde_json::from_str::<Grants>(&grants).map_err(|_| corrupt("grants", &grants))?,
        created_at: get_ts(row, "created_at")?,
    })
}

macro_rules! quota_columns {
    () => {
        r#"id, project_id, scope, scope_ref, metric, "window", "limit", mode, meter_type, on_unpriced, created_at, updated_at"#
    };
}

fn quota_from_row(row: &SqliteRow) -> PortResult<Quota> {
    let id: String = get(row, "id")?;
    let project: String = get(row, "project_id")?;
    let scope: String = get(row, "scope")?;
    let metric: String = get(row, "metric")?;
    let window: String = get(row, "window")?;
    let mode: String = get(row, "mode")?;
    let on_unpriced: Option<String> = get(row, "on_unpriced")?;
    Ok(Quota {
        id: QuotaId::parse(&id).map_err(|_| corrupt("quota id", &id))?,
        spec: QuotaSpec {
            project_id: ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?,
            scope: parse::<Scope>("scope", &scope)?,
            scope_ref: get(row, "scope_ref")?,
            metric: parse::<Metric>("metric", &metric)?,
            window: parse::<WindowKind>("window", &window)?,
            limit: to_u64("limit", get(row, "limit")?)?,
            mode: parse::<Mode>("mode", &mode)?,
            meter_type: get(row, "meter_type")?,
            on_unpriced: on_unpriced.as_deref().map(parse_on_unpriced).transpose()?,
        },
        created_at: get_ts(row, "created_at")?,
        updated_at: get_ts(row, "updated_at")?,
    })
}

macro_rules! audit_columns {
    () => {
        "id, project_id, action, principal_type, principal_id, resource, detail, created_at"
    };
}

fn audit_from_row(row: &SqliteRow) -> PortResult<AuditEntry> {
    let id: String = get(row, "id")?;
    let project: String = get(row, "project_id")?;
    let action: String = get(row, "action")?;
    let principal_type: Option<String> = get(row, "principal_type")?;
    let principal_id: Option<String> = get(row, "principal_id")?;
    let detail: String = get(row, "detail")?;
    Ok(AuditEntry {
        id: AuditId::parse(&id).map_err(|_| corrupt("audit id", &id))?,
        project_id: ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?,
        action: parse::<AuditAction>("audit action", &action)?,
        principal: match (principal_type, principal_id) {
            (Some(kind), Some(id)) => Some(Principal { kind, id }),
            _ => None,
        },
        resource: get(row, "resource")?,
        detail: serde_json::from_str::<AuditDetail>(&detail).map_err(|_| corrupt("audit detail", &detail))?,
        created_at: get_ts(row, "created_at")?,
    })
}

/// Inserts an entry; one whose once-key is already there is skipped.
async fn insert_audit<'e, E>(ex: E, entry: &AuditEntry) -> PortResult<bool>
where
    E: sqlx::SqliteExecutor<'e>,
{
    let detail = serde_json::to_string(&entry.detail)
        .map_err(|e| PortError::Permanent(format!("encoding an audit detail: {e}")))?;
    let done = sqlx::query(
        "INSERT INTO audit_log (id, project_id, action, principal_type, principal_id, resource, detail, \
                                once_key, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT (once_key) DO NOTHING",
    )
    .bind(entry.id.as_str())
    .bind(entry.project_id.as_str())
    .bind(entry.action.as_str())
    .bind(entry.principal.as_ref().map(|p| p.kind.as_str()))
    .bind(entry.principal.as_ref().map(|p| p.id.as_str()))
    .bind(&entry.resource)
    .bind(detail)
    .bind(entry.once_key())
    .bind(ts(entry.created_at)?)
    .execute(ex)
    .await
    .map_err(db_err)?;
    Ok(done.rows_affected() == 1)
}

async fn insert_quota<'e, E>(ex: E, quota: &Quota) -> PortResult<()>
where
    E: sqlx::SqliteExecutor<'e>,
{
    let s = &quota.spec;
    sqlx::query(
        r#"INSERT INTO quotas (id, project_id, scope, scope_ref, metric, "window", "limit", mode,
                               meter_type, on_unpriced, created_at, updated_at)
           VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"#,
    )
    .bind(quota.id.as_str())
    .bind(s.project_id.as_str())
    .bind(s.scope.as_str())
    .bind(s.scope_ref.as_deref())
    .bind(s.metric.as_str())
    .bind(s.window.as_str())
    .bind(to_i64("limit", s.limit)?)
    .bind(s.mode.as_str())
    .bind(s.meter_type.as_deref())
    .bind(s.on_unpriced.map(on_unpriced_str))
    .bind(ts(quota.created_at)?)
    .bind(ts(quota.updated_at)?)
    .execute(ex)
    .await
    .map_err(db_err)?;
    Ok(())
}

fn totals_from_row(row: &SqliteRow) -> PortResult<Totals> {
    Ok(Totals {
        requests: to_u64("requests", get(row, "requests")?)?,
        calls: to_u64("calls", get(row, "calls")?)?,
        rows: to_u64("rows", get(row, "rows")?)?,
    })
}

fn counter_key_from_row(row: &SqliteRow) -> PortResult<CounterKey> {
    let dimension: String = get(row, "dimension")?;
    let window: String = get(row, "window_kind")?;
    Ok(CounterKey {
        dimension: Dimension::decode(&dimension).ok_or_else(|| corrupt("dimension", &dimension))?,
        window: parse::<WindowKind>("window kind", &window)?,
        window_key: get(row, "window_key")?,
    })
}

fn counter_from_row(row: &SqliteRow) -> PortResult<(Counter, Totals)> {
    let key = counter_key_from_row(row)?;
    let counter = Counter { key, resets_at: get_opt_ts(row, "resets_at")? };
    Ok((counter, totals_from_row(row)?))
}

#[async_trait]
impl Store for SqliteStore {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "create_project"))]
    async fn create_project(&self, project: &Project) -> PortResult<()> {
        sqlx::query("INSERT INTO projects (id, name, timezone, created_at) VALUES (?1, ?2, ?3, ?4)")
            .bind(project.id.as_str())
            .bind(&project.name)
            .bind(project.timezone.name())
            .bind(ts(project.created_at)?)
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "project"))]
    async fn project(&self, id: &ProjectId) -> PortResult<Option<Project>> {
        sqlx::query("SELECT id, name, timezone, created_at FROM projects WHERE id = ?1")
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?
            .as_ref()
            .map(project_from_row)
            .transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "create_api_key"))]
    async fn create_api_key(&self, key: &ApiKey, secret_hash: &str) -> PortResult<()> {
        let grants =
            serde_json::to_string(&key.grants).map_err(|e| PortError::Permanent(format!("encoding grants: {e}")))?;
        sqlx::query(
            "INSERT INTO api_keys (id, project_id, name, prefix, secret_hash, grants, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .bind(key.id.as_str())
        .bind(key.project_id.as_str())
        .bind(&key.name)
        .bind(&key.prefix)
        .bind(secret_hash)
        .bind(grants)
        .bind(ts(key.created_at)?)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "api_key"))]
    async fn api_key(&self, id: &ApiKeyId) -> PortResult<Option<ApiKey>> {
        sqlx::query(concat!("SELECT ", api_key_columns!(), " FROM api_keys WHERE id = ?1 AND deleted_at IS NULL"))
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?
            .as_ref()
            .map(api_key_from_row)
            .transpose()
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "api_key_by_secret_hash")
    )]
    async fn api_key_by_secret_hash(&self, hash: &str) -> PortResult<Option<ApiKey>> {
        sqlx::query(concat!(
            "SELECT ",
            api_key_columns!(),
            " FROM api_keys WHERE secret_hash = ?1 AND deleted_at IS NULL"
        ))
        .bind(hash)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_err)?
        .as_ref()
        .map(api_key_from_row)
        .transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "create_quota"))]
    async fn create_quota(&self, quota: &Quota) -> PortResult<()> {
        insert_quota(&self.pool, quota).await
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "quota"))]
    async fn quota(&self, id: &QuotaId) -> PortResult<Option<Quota>> {
        sqlx::query(concat!("SELECT ", quota_columns!(), " FROM quotas WHERE id = ?1"))
            .bind(id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(db_err)?
            .as_ref()
            .map(quota_from_row)
            .transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "quotas"))]
    async fn quotas(&self, project: &ProjectId) -> PortResult<Vec<Quota>> {
        sqlx::query(concat!("SELECT ", quota_columns!(), " FROM quotas WHERE project_id = ?1 ORDER BY created_at, id"))
            .bind(project.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(db_err)?
            .iter()
            .map(quota_from_row)
            .collect()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "update_quota"))]
    async fn update_quota(&self, id: &QuotaId, patch: &QuotaPatch, at: DateTime<Utc>) -> PortResult<Option<Quota>> {
        let limit = patch.limit.map(|l| to_i64("limit", l)).transpose()?;
        sqlx::query(concat!(
            r#"UPDATE quotas SET "limit" = COALESCE(?2, "limit"), mode = COALESCE(?3, mode), updated_at = ?4 "#,
            "WHERE id = ?1 RETURNING ",
            quota_columns!()
        ))
        .bind(id.as_str())
        .bind(limit)
        .bind(patch.mode.map(Mode::as_str))
        .bind(ts(at)?)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_err)?
        .as_ref()
        .map(quota_from_row)
        .transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "delete_quota"))]
    async fn delete_quota(&self, id: &QuotaId) -> PortResult<bool> {
        let done = sqlx::query("DELETE FROM quotas WHERE id = ?1")
            .bind(id.as_str())
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(done.rows_affected() > 0)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "delete_api_key"))]
    async fn delete_api_key(&self, id: &ApiKeyId, at: DateTime<Utc>) -> PortResult<bool> {
        let done = sqlx::query("UPDATE api_keys SET deleted_at = ?2 WHERE id = ?1 AND deleted_at IS NULL")
            .bind(id.as_str())
            .bind(ts(at)?)
            .execute(&self.pool)
            .await
            .map_err(db_err)?;
        Ok(done.rows_affected() > 0)
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "apply_quotas", creates = plan.creates.len(),
               updates = plan.updates.len(), deletes = plan.deletes.len())
    )]
    async fn apply_quotas(&self, plan: &QuotaPlan, audit: &[AuditEntry]) -> PortResult<()> {
        // IMMEDIATE takes the file's write lock now, so the set read below
        // cannot move before the commit. Dropping `tx` without committing
        // rolls everything back, so every early return changes nothing.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(db_err)?;
        let project = plan.project_id.as_str();
        let found = sqlx::query("SELECT id FROM projects WHERE id = ?1")
            .bind(project)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_err)?;
        if found.is_none() {
            return Err(PortError::Permanent(format!("project {project} does not exist")));
        }
        if let Some(expected) = &plan.based_on {
            let mut now: Vec<Quota> =
                sqlx::query(concat!("SELECT ", quota_columns!(), " FROM quotas WHERE project_id = ?1"))
                    .bind(project)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_err)?
                    .iter()
                    .map(quota_from_row)
                    .collect::<PortResult<_>>()?;
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
            let ids: Vec<&str> = plan.deletes.iter().map(|q| q.id.as_str()).collect();
            let gone =
                sqlx::query("DELETE FROM quotas WHERE project_id = ?1 AND id IN (SELECT value FROM json_each(?2))")
                    .bind(project)
                    .bind(json_list(&ids)?)
                    .execute(&mut *tx)
                    .await
                    .map_err(db_err)?
                    .rows_affected();
            if gone != ids.len() as u64 {
                return Err(PortError::Conflict(format!(
                    "{} of {} quotas to delete no longer exist",
                    ids.len() as u64 - gone,
                    ids.len()
                )));
            }
        }
        for u in &plan.updates {
            let moved = sqlx::query(
                r#"UPDATE quotas SET "limit" = ?3, mode = ?4, updated_at = ?5 WHERE id = ?1 AND project_id = ?2"#,
            )
            .bind(u.before.id.as_str())
            .bind(project)
            .bind(to_i64("limit", u.after.spec.limit)?)
            .bind(u.after.spec.mode.as_str())
            .bind(ts(u.after.updated_at)?)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?
            .rows_affected();
            if moved != 1 {
                return Err(PortError::Conflict(format!("quota {} no longer exists", u.before.id)));
            }
        }
        for c in &plan.creates {
            if c.quota.spec.project_id != plan.project_id {
                return Err(PortError::Permanent(format!("quota {} is not of project {project}", c.quota.id)));
            }
            insert_quota(&mut *tx, &c.quota).await?;
        }
        for entry in audit {
            insert_audit(&mut *tx, entry).await?;
        }
        tx.commit().await.map_err(db_err)?;
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "record_audit"))]
    async fn record_audit(&self, entry: &AuditEntry) -> PortResult<bool> {
        insert_audit(&self.pool, entry).await
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "audit"))]
    async fn audit(&self, project: &ProjectId, after: Option<&AuditId>, limit: usize) -> PortResult<Vec<AuditEntry>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        sqlx::query(concat!(
            "SELECT ",
            audit_columns!(),
            " FROM audit_log WHERE project_id = ?1 AND (?2 IS NULL OR id > ?2) ORDER BY id LIMIT ?3"
        ))
        .bind(project.as_str())
        .bind(after.map(AuditId::as_str))
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?
        .iter()
        .map(audit_from_row)
        .collect()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "totals"))]
    async fn totals(&self, project: &ProjectId, counters: &[CounterKey]) -> PortResult<Vec<(CounterKey, Totals)>> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: Vec<(String, &str, &str)> =
            counters.iter().map(|c| (c.dimension.encode(), c.window.as_str(), c.window_key.as_str())).collect();
        let rows = sqlx::query(
            r#"SELECT dimension, window_kind, window_key, requests, calls, "rows"
               FROM usage_aggregates
               WHERE project_id = ?1
                 AND (dimension, window_kind, window_key) IN
                     (SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?2))"#,
        )
        .bind(project.as_str())
        .bind(json_list(&wanted)?)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        let mut found: HashMap<CounterKey, Totals> = HashMap::with_capacity(rows.len());
        for row in &rows {
            found.insert(counter_key_from_row(row)?, totals_from_row(row)?);
        }
        Ok(counters.iter().map(|c| (c.clone(), found.get(c).copied().unwrap_or_default())).collect())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "open_totals"))]
    async fn open_totals(&self, project: &ProjectId, at: DateTime<Utc>) -> PortResult<Vec<(Counter, Totals)>> {
        sqlx::query(
            r#"SELECT dimension, window_kind, window_key, resets_at, requests, calls, "rows"
               FROM usage_aggregates
               WHERE project_id = ?1 AND (resets_at IS NULL OR resets_at > ?2)
               ORDER BY dimension, window_kind, window_key"#,
        )
        .bind(project.as_str())
        .bind(ts(at)?)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?
        .iter()
        .map(counter_from_row)
        .collect()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "offsets"))]
    async fn offsets(&self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>> {
        let rows =
            sqlx::query(r#"SELECT "partition", next_offset FROM consumer_offsets WHERE consumer = ?1 AND topic = ?2"#)
                .bind(consumer)
                .bind(topic)
                .fetch_all(&self.pool)
                .await
                .map_err(db_err)?;
        rows.iter().map(|r| Ok((get::<i32>(r, "partition")?, get::<i64>(r, "next_offset")?))).collect()
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "fold_batch", facts = batch.facts.len(), partitions = batch.offsets.len())
    )]
    async fn fold_batch(&self, batch: &FoldBatch) -> PortResult<FoldReport> {
        // IMMEDIATE takes the write lock now, so a second writer waits here
        // (up to the busy timeout) and then reads the offsets this one wrote.
        // Dropping `tx` without committing rolls everything back, so every
        // early return below changes nothing.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(db_err)?;

        // (1) The fence: each partition must still be where the batch began.
        for m in &batch.offsets {
            if m.to < m.from {
                return Err(PortError::Permanent(format!(
                    "offsets of {}[{}] would move backwards from {} to {}",
                    batch.topic, m.partition, m.from, m.to
                )));
            }
            let moved = sqlx::query(
                r#"UPDATE consumer_offsets SET next_offset = ?5
                   WHERE consumer = ?1 AND topic = ?2 AND "partition" = ?3 AND next_offset = ?4"#,
            )
            .bind(&batch.consumer)
            .bind(&batch.topic)
            .bind(m.partition)
            .bind(m.from)
            .bind(m.to)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?
            .rows_affected();
            if moved == 1 {
                continue;
            }
            // No row at `from`: a fresh start may create it; anything else
            // means another consumer moved (or created) it first.
            let created = m.from == 0
                && sqlx::query(
                    r#"INSERT INTO consumer_offsets (consumer, topic, "partition", next_offset)
                       VALUES (?1, ?2, ?3, ?4) ON CONFLICT DO NOTHING"#,
                )
                .bind(&batch.consumer)
                .bind(&batch.topic)
                .bind(m.partition)
                .bind(m.to)
                .execute(&mut *tx)
                .await
                .map_err(db_err)?
                .rows_affected()
                    == 1;
            if !created {
                return Err(PortError::Fenced(format!(
                    "consumer {} on {}[{}] is no longer at offset {}",
                    batch.consumer, batch.topic, m.partition, m.from
                )));
            }
        }

        // (2) The time zones of the batch's projects; a fact of an unknown
        // project is a bug upstream (the projector dead-letters those).
        let mut project_ids: Vec<&str> = batch.facts.iter().map(|f| f.project_id.as_str()).collect();
        project_ids.sort_unstable();
        project_ids.dedup();
        let mut zones: HashMap<String, Tz> = HashMap::with_capacity(project_ids.len());
        if !project_ids.is_empty() {
            let rows = sqlx::query("SELECT id, timezone FROM projects WHERE id IN (SELECT value FROM json_each(?1))")
                .bind(json_list(&project_ids)?)
                .fetch_all(&mut *tx)
                .await
                .map_err(db_err)?;
            for row in &rows {
                let tz: String = get(row, "timezone")?;
                zones.insert(get(row, "id")?, parse("time zone", &tz)?);
            }
        }
        if let Some(f) = batch.facts.iter().find(|f| !zones.contains_key(f.project_id.as_str())) {
            return Err(PortError::Permanent(format!("project {} of event {} does not exist", f.project_id, f.id)));
        }

        // (3) The dedup set. Within the batch the first occurrence of an id
        // wins; the ids SQLite did not know yet are the ones to fold
        // (RETURNING reports only the rows actually inserted).
        let mut seen: HashSet<(&ProjectId, &EventId)> = HashSet::with_capacity(batch.facts.len());
        let first: Vec<bool> = batch.facts.iter().map(|f| seen.insert((&f.project_id, &f.id))).collect();
        let candidates: Vec<&UsageFact> =
            batch.facts.iter().zip(&first).filter(|(_, first)| **first).map(|(f, _)| f).collect();
        let mut new_ids: HashSet<(ProjectId, EventId)> = HashSet::with_capacity(candidates.len());
        if !candidates.is_empty() {
            let list = candidates
                .iter()
                .map(|f| Ok((f.project_id.as_str(), f.id.as_str(), ts(f.occurred_at)?)))
                .collect::<PortResult<Vec<_>>>()?;
            // `WHERE true` keeps SQLite from reading ON CONFLICT as a join's ON.
            let rows = sqlx::query(
                "INSERT INTO processed_events (project_id, event_id, occurred_at) \
                 SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?1) WHERE true \
                 ON CONFLICT DO NOTHING RETURNING project_id, event_id",
            )
            .bind(json_list(&list)?)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
            for row in &rows {
                let (p, e): (String, String) = (get(row, "project_id")?, get(row, "event_id")?);
                let p = ProjectId::parse(&p).map_err(|_| corrupt("project id", &p))?;
                let e = EventId::parse(&e).map_err(|_| corrupt("event id", &e))?;
                new_ids.insert((p, e));
            }
        }

        // (4) Fold the new facts in each project's time zone.
        let mut report = FoldReport::default();
        let mut fold = Fold::new();
        for (fact, first) in batch.facts.iter().zip(first) {
            let id = (fact.project_id.clone(), fact.id.clone());
            if first && new_ids.contains(&id) {
                // Invariant: every fact's zone was checked above.
                let tz = zones.get(fact.project_id.as_str()).copied().unwrap_or(Tz::UTC);
                fold.apply(fact, tz);
                report.folded.push(id);
            } else {
                report.duplicates.push(id);
            }
        }

        // (5) Add the folded totals in one upsert; it returns the new
        // absolute totals of every counter it touched.
        if !fold.is_empty() {
            let list = fold
                .totals()
                .map(|(project, counter, t)| {
                    Ok((
                        project.as_str(),
                        counter.key.dimension.encode(),
                        counter.key.window.as_str(),
                        counter.key.window_key,
                        counter.resets_at.map(ts).transpose()?,
                        to_i64("requests", t.requests)?,
                        to_i64("calls", t.calls)?,
                        to_i64("rows", t.rows)?,
                    ))
                })
                .collect::<PortResult<Vec<_>>>()?;
            let rows = sqlx::query(
                r#"INSERT INTO usage_aggregates
                       (project_id, dimension, window_kind, window_key, resets_at, requests, calls, "rows")
                   SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4,
                          value ->> 5, value ->> 6, value ->> 7
                   FROM json_each(?1) WHERE true
                   ON CONFLICT (project_id, dimension, window_kind, window_key) DO UPDATE SET
                       requests = requests + excluded.requests,
                       calls = calls + excluded.calls,
                       "rows" = "rows" + excluded."rows"
                   RETURNING project_id, dimension, window_kind, window_key, resets_at, requests, calls, "rows""#,
            )
            .bind(json_list(&list)?)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
            for row in &rows {
                let project: String = get(row, "project_id")?;
                let project = ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?;
                let (counter, totals) = counter_from_row(row)?;
                report.totals.push((project, counter, totals));
            }
            report.totals.sort_by(|a, b| (&a.0, &a.1.key).cmp(&(&b.0, &b.1.key)));
        }

        tx.commit().await.map_err(db_err)?;
        Ok(report)
    }
}
