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
//!   one for the prices its tokens events need, one upsert, one for their
//!   unpriced rows, one for their breakdown by model (`model_usage`), three
//!   for the storage footprint, recomputed from the
//!   kept storage facts as [`meter::usage::Footprint`] defines it). Lists
//!   travel as one JSON array bound to one parameter and unpacked by
//!   `json_each`, the way PostgreSQL's `UNNEST` does it, so a batch of any
//!   size stays far from SQLite's bind-parameter limit.
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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Datelike, SubsecRound, Utc};
use chrono_tz::Tz;
use meter::usage::{component_usage, counters_for, priced};
use meter::{
    ApiKey, ApiKeyId, AuditAction, AuditDetail, AuditEntry, AuditId, Component, Counter, CounterKey, Dimension,
    EventId, EventKind, Field, Fold, FoldBatch, FoldReport, Grants, MeterType, Metric, Mode, ModelUsageRow, OnUnpriced,
    Population, PortError, PortResult, Price, PriceBook, PriceKey, Principal, Project, ProjectId, Quota, QuotaId,
    QuotaPlan, QuotaSpec, Role, RoleId, RoleQuota, Scope, Totals, UnpricedException, UnpricedRow, UsageFact, Usd,
    WindowKind, window_at,
};
use meter::{AuditStore, Ledger, PriceStore, QuotaStore, ReportStore, TenantStore};
use serde_json::Value;
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
        "id, project_id, name, prefix, grants, role_id, created_at"
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
        role_id: {
            let r: Option<String> = get(row, "role_id")?;
            r.map(|r| RoleId::parse(&r).map_err(|_| corrupt("role id", &r))).transpose()?
        },
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

/// The `usage_aggregates` column of each field of [`Totals`] (the match is
/// exhaustive, so a new field does not compile until it has a column).
fn column(f: Field) -> &'static str {
    match f {
        Field::Requests => "requests",
        Field::Calls => "calls",
        Field::Rows => "rows",
        Field::Tokens => "tokens",
        Field::CostLlmTokens => "cost_llm_tokens",
        Field::CostComputeExecution => "cost_compute_execution",
        Field::CostApiRequest => "cost_api_request",
        Field::CostStorage => "cost_storage",
        Field::LlmEvents => "llm_events",
        Field::LlmPriced => "llm_priced",
        Field::LlmUnpriced => "llm_unpriced",
        Field::StorageEvents => "storage_events",
        Field::Storage => "storage",
    }
}

// Every field of Totals, in `Field::ALL` order, as SQL.
macro_rules! totals_columns {
    () => {
        r#"requests, calls, "rows", tokens, cost_llm_tokens, cost_compute_execution, cost_api_request,
           cost_storage, llm_events, llm_priced, llm_unpriced, storage_events, storage"#
    };
}

fn totals_from_row(row: &SqliteRow) -> PortResult<Totals> {
    let mut t = Totals::default();
    for f in Field::ALL {
        let v: i64 = get(row, column(f))?;
        // Every field is a sum but the footprint, which deltas before any
        // snapshot can take below zero.
        if v < 0 && f != Field::Storage {
            return Err(corrupt(column(f), &v.to_string()));
        }
        t.set(f, v);
    }
    Ok(t)
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

/// A row of `usage_aggregates` with its project, as a fold reports it.
fn aggregate_from_row(row: &SqliteRow) -> PortResult<(ProjectId, Counter, Totals)> {
    let project: String = get(row, "project_id")?;
    let project = ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?;
    let (counter, totals) = counter_from_row(row)?;
    Ok((project, counter, totals))
}

fn price_from_row(row: &SqliteRow) -> PortResult<Price> {
    let component: String = get(row, "component")?;
    Ok(Price {
        key: PriceKey {
            provider: get(row, "provider")?,
            model: get(row, "model")?,
            component: parse::<Component>("price component", &component)?,
        },
        unit_price_usd: Usd(get(row, "unit_price_picos")?),
        effective_from: get_ts(row, "effective_from")?,
    })
}

/// The part of the price book that can price `facts`: the rows of the
/// (provider, model) pairs their token entries name. A price is looked up by
/// its key only, so the rest of the book cannot change a cost. Empty (no
/// statement) when no fact is a tokens event.
async fn price_book_for<'e, E>(ex: E, facts: &[(&UsageFact, Tz)]) -> PortResult<PriceBook>
where
    E: sqlx::SqliteExecutor<'e>,
{
    let pairs: BTreeSet<(&str, &str)> = facts
        .iter()
        .filter(|(f, _)| f.kind == EventKind::Tokens)
        .flat_map(|(f, _)| f.tokens.iter().map(|t| (t.provider.as_str(), t.model.as_str())))
        .collect();
    if pairs.is_empty() {
        return Ok(PriceBook::default());
    }
    let pairs: Vec<(&str, &str)> = pairs.into_iter().collect();
    let rows = sqlx::query(
        "SELECT provider, model, component, effective_from, unit_price_picos FROM prices \
         WHERE (provider, model) IN (SELECT value ->> 0, value ->> 1 FROM json_each(?1))",
    )
    .bind(json_list(&pairs)?)
    .fetch_all(ex)
    .await
    .map_err(db_err)?;
    Ok(PriceBook::new(rows.iter().map(price_from_row).collect::<PortResult<Vec<_>>>()?))
}

/// Unpriced rows to remember, deduplicated and in key order: `(project,
/// counter, price key)` to the counter's reset.
type UnpricedSet = BTreeMap<(ProjectId, CounterKey, PriceKey), Option<DateTime<Utc>>>;

/// Inserts unpriced rows in one statement; rows already known are skipped.
async fn insert_unpriced<'e, E>(ex: E, rows: &UnpricedSet) -> PortResult<()>
where
    E: sqlx::SqliteExecutor<'e>,
{
    if rows.is_empty() {
        return Ok(());
    }
    let list = rows
        .iter()
        .map(|((project, counter, key), resets_at)| {
            Ok((
                project.as_str(),
                counter.dimension.encode(),
                counter.window.as_str(),
                counter.window_key.as_str(),
                resets_at.map(ts).transpose()?,
                key.provider.as_str(),
                key.model.as_str(),
                key.component.as_str(),
            ))
        })
        .collect::<PortResult<Vec<_>>>()?;
    // `WHERE true` keeps SQLite from reading ON CONFLICT as a join's ON.
    sqlx::query(
        "INSERT INTO unpriced_rows \
             (project_id, dimension, window_kind, window_key, resets_at, provider, model, component) \
         SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, \
                value ->> 5, value ->> 6, value ->> 7 \
         FROM json_each(?1) WHERE true \
         ON CONFLICT DO NOTHING",
    )
    .bind(json_list(&list)?)
    .execute(ex)
    .await
    .map_err(db_err)?;
    Ok(())
}

// A component's rank in meter's `Component` order (input, output, cached),
// which is not the order of its names: `unpriced_rows` reads back in
// `PriceKey` order.
macro_rules! component_rank {
    () => {
        "CASE component WHEN 'input_tokens' THEN 0 WHEN 'output_tokens' THEN 1 \
         WHEN 'cached_tokens' THEN 2 ELSE 3 END"
    };
}

macro_rules! exception_columns {
    () => {
        r#"quota_id, project_id, "limit", window_key, llm_events, unpriced_events, unpriced_rows,
           occurrence_count, first_seen, last_seen"#
    };
}

fn exception_from_row(row: &SqliteRow) -> PortResult<UnpricedException> {
    let quota: String = get(row, "quota_id")?;
    let project: String = get(row, "project_id")?;
    let rows: String = get(row, "unpriced_rows")?;
    Ok(UnpricedException {
        project_id: ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?,
        quota_id: QuotaId::parse(&quota).map_err(|_| corrupt("quota id", &quota))?,
        limit: to_u64("limit", get(row, "limit")?)?,
        window_key: get(row, "window_key")?,
        llm_events: to_u64("llm_events", get(row, "llm_events")?)?,
        unpriced_events: to_u64("unpriced_events", get(row, "unpriced_events")?)?,
        unpriced_rows: serde_json::from_str::<Vec<PriceKey>>(&rows).map_err(|_| corrupt("unpriced rows", &rows))?,
        occurrence_count: to_u64("occurrence_count", get(row, "occurrence_count")?)?,
        first_seen: get_ts(row, "first_seen")?,
        last_seen: get_ts(row, "last_seen")?,
    })
}

fn storage_kind(kind: EventKind) -> Option<&'static str> {
    match kind {
        EventKind::StorageDelta => Some("delta"),
        EventKind::StorageSnapshot => Some("snapshot"),
        _ => None,
    }
}

/// The windows the token usage breakdown (`model_usage`) is kept for.
const MODEL_USAGE_WINDOWS: [WindowKind; 2] = [WindowKind::Day, WindowKind::CalendarMonth];

/// The token usage breakdown a batch adds, summed within the batch and in key
/// order: `(project, window, window key, price key, meter, embedding)` to
/// (priced quantity, unpriced quantity, cost).
type ModelUsageSet = BTreeMap<(ProjectId, WindowKind, String, PriceKey, MeterType, bool), (u64, u64, Usd)>;

/// Adds a new fact's breakdown by (provider, model, component), priced
/// against `book`, to its day and month in the project's zone `tz`. Adds
/// nothing for a fact that is not a tokens event.
fn add_model_usage(set: &mut ModelUsageSet, fact: &UsageFact, tz: Tz, book: &PriceBook) {
    let rows = component_usage(fact, book);
    if rows.is_empty() {
        return;
    }
    for kind in MODEL_USAGE_WINDOWS {
        let window_key = window_at(kind, tz, fact.occurred_at).key;
        for r in &rows {
            let (priced, unpriced, cost) = set
                .entry((fact.project_id.clone(), kind, window_key.clone(), r.key.clone(), r.meter, r.embedding))
                .or_default();
            *priced = priced.saturating_add(r.priced_quantity);
            *unpriced = unpriced.saturating_add(r.unpriced_quantity);
            *cost = cost.saturating_add(r.cost);
        }
    }
}

/// Adds a batch's breakdown to `model_usage` in one upsert.
async fn insert_model_usage<'e, E>(ex: E, rows: &ModelUsageSet) -> PortResult<()>
where
    E: sqlx::SqliteExecutor<'e>,
{
    if rows.is_empty() {
        return Ok(());
    }
    let list = rows
        .iter()
        .map(|((project, kind, window_key, key, meter, embedding), (priced, unpriced, cost))| {
            Ok((
                project.as_str(),
                kind.as_str(),
                window_key.as_str(),
                key.provider.as_str(),
                key.model.as_str(),
                key.component.as_str(),
                meter.as_str(),
                *embedding,
                to_i64("priced quantity", *priced)?,
                to_i64("unpriced quantity", *unpriced)?,
                cost.picos(),
            ))
        })
        .collect::<PortResult<Vec<_>>>()?;
    // `WHERE true` keeps SQLite from reading ON CONFLICT as a join's ON; a
    // JSON `true` reads back as 1.
    sqlx::query(
        "INSERT INTO model_usage \
             (project_id, window_kind, window_key, provider, model, component, meter_type, embedding, \
              priced_quantity, unpriced_quantity, cost_picos) \
         SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4, value ->> 5, value ->> 6, \
                value ->> 7, value ->> 8, value ->> 9, value ->> 10 \
         FROM json_each(?1) WHERE true \
         ON CONFLICT (project_id, window_kind, window_key, provider, model, component, meter_type, embedding) \
         DO UPDATE SET priced_quantity = priced_quantity + excluded.priced_quantity, \
                       unpriced_quantity = unpriced_quantity + excluded.unpriced_quantity, \
                       cost_picos = cost_picos + excluded.cost_picos",
    )
    .bind(json_list(&list)?)
    .execute(ex)
    .await
    .map_err(db_err)?;
    Ok(())
}

fn model_usage_from_row(row: &SqliteRow) -> PortResult<ModelUsageRow> {
    let component: String = get(row, "component")?;
    let meter: String = get(row, "meter_type")?;
    let cost: i64 = get(row, "cost_picos")?;
    if cost < 0 {
        return Err(corrupt("cost_picos", &cost.to_string()));
    }
    Ok(ModelUsageRow {
        key: PriceKey {
            provider: get(row, "provider")?,
            model: get(row, "model")?,
            component: parse::<Component>("price component", &component)?,
        },
        meter: parse::<MeterType>("meter type", &meter)?,
        embedding: get(row, "embedding")?,
        priced_quantity: to_u64("priced_quantity", get(row, "priced_quantity")?)?,
        unpriced_quantity: to_u64("unpriced_quantity", get(row, "unpriced_quantity")?)?,
        cost: Usd(cost),
    })
}

#[async_trait]
impl TenantStore for SqliteStore {
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
            "INSERT INTO api_keys (id, project_id, name, prefix, secret_hash, grants, created_at, role_id) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )
        .bind(key.id.as_str())
        .bind(key.project_id.as_str())
        .bind(&key.name)
        .bind(&key.prefix)
        .bind(secret_hash)
        .bind(grants)
        .bind(ts(key.created_at)?)
        .bind(key.role_id.as_ref().map(|r| r.as_str()))
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "create_role"))]
    async fn create_role(&self, role: &Role) -> PortResult<()> {
        let grants =
            serde_json::to_string(&role.grants).map_err(|e| PortError::Permanent(format!("encoding grants: {e}")))?;
        let quota = role
            .quota
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| PortError::Permanent(format!("encoding a role quota: {e}")))?;
        sqlx::query(
            "INSERT INTO roles (id, project_id, name, grants, quota, exempt, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .bind(role.id.as_str())
        .bind(role.project_id.as_str())
        .bind(&role.name)
        .bind(grants)
        .bind(quota)
        .bind(role.exempt)
        .bind(ts(role.created_at)?)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "role"))]
    async fn role(&self, id: &RoleId) -> PortResult<Option<Role>> {
        let Some(row) =
            sqlx::query("SELECT id, project_id, name, grants, quota, exempt, created_at FROM roles WHERE id = ?1")
                .bind(id.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(db_err)?
        else {
            return Ok(None);
        };
        let rid: String = get(&row, "id")?;
        let project: String = get(&row, "project_id")?;
        let grants: String = get(&row, "grants")?;
        let quota: Option<String> = get(&row, "quota")?;
        Ok(Some(Role {
            id: RoleId::parse(&rid).map_err(|_| corrupt("role id", &rid))?,
            project_id: ProjectId::parse(&project).map_err(|_| corrupt("project id", &project))?,
            name: get(&row, "name")?,
            grants: serde_json::from_str::<Grants>(&grants).map_err(|_| corrupt("grants", &grants))?,
            quota: quota
                .map(|q| serde_json::from_str::<RoleQuota>(&q).map_err(|_| corrupt("role quota", &q)))
                .transpose()?,
            exempt: get(&row, "exempt")?,
            created_at: get_ts(&row, "created_at")?,
        }))
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
}

#[async_trait]
impl QuotaStore for SqliteStore {
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
}

#[async_trait]
impl AuditStore for SqliteStore {
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
}

#[async_trait]
impl PriceStore for SqliteStore {
    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "put_prices", prices = prices.len())
    )]
    async fn put_prices(&self, prices: &[Price]) -> PortResult<()> {
        // One row per key and instant, the last one winning as in
        // `PriceBook::insert`; the instant is keyed as stored, to the
        // microsecond.
        let mut unique: BTreeMap<(&PriceKey, DateTime<Utc>), Usd> = BTreeMap::new();
        for p in prices {
            unique.insert((&p.key, p.effective_from.trunc_subsecs(6)), p.unit_price_usd);
        }
        if unique.is_empty() {
            return Ok(());
        }
        let list = unique
            .into_iter()
            .map(|((key, at), price)| {
                Ok((key.provider.as_str(), key.model.as_str(), key.component.as_str(), ts(at)?, price.picos()))
            })
            .collect::<PortResult<Vec<_>>>()?;
        // One statement: all the rows or none.
        sqlx::query(
            "INSERT INTO prices (provider, model, component, effective_from, unit_price_picos) \
             SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4 FROM json_each(?1) WHERE true \
             ON CONFLICT (provider, model, component, effective_from) \
             DO UPDATE SET unit_price_picos = excluded.unit_price_picos",
        )
        .bind(json_list(&list)?)
        .execute(&self.pool)
        .await
        .map_err(db_err)?;
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "prices"))]
    async fn prices(&self) -> PortResult<Vec<Price>> {
        let rows = sqlx::query("SELECT provider, model, component, effective_from, unit_price_picos FROM prices")
            .fetch_all(&self.pool)
            .await
            .map_err(db_err)?;
        // The book orders by key (meter's order of components, not their
        // names') then effective_from.
        let book = PriceBook::new(rows.iter().map(price_from_row).collect::<PortResult<Vec<_>>>()?);
        Ok(book.prices().collect())
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "record_unpriced", rows = rows.len())
    )]
    async fn record_unpriced(&self, project: &ProjectId, rows: &[UnpricedRow]) -> PortResult<()> {
        let set: UnpricedSet = rows
            .iter()
            .map(|r| ((project.clone(), r.counter.key.clone(), r.key.clone()), r.counter.resets_at))
            .collect();
        insert_unpriced(&self.pool, &set).await
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "unpriced_rows"))]
    async fn unpriced_rows(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        limit: usize,
    ) -> PortResult<Vec<PriceKey>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(concat!(
            "SELECT provider, model, component FROM unpriced_rows \
             WHERE project_id = ?1 AND dimension = ?2 AND window_kind = ?3 AND window_key = ?4 \
             ORDER BY provider, model, ",
            component_rank!(),
            " LIMIT ?5"
        ))
        .bind(project.as_str())
        .bind(counter.dimension.encode())
        .bind(counter.window.as_str())
        .bind(&counter.window_key)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        rows.iter()
            .map(|row| {
                let component: String = get(row, "component")?;
                Ok(PriceKey {
                    provider: get(row, "provider")?,
                    model: get(row, "model")?,
                    component: parse::<Component>("price component", &component)?,
                })
            })
            .collect()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "file_exception"))]
    async fn file_exception(&self, exception: &UnpricedException) -> PortResult<UnpricedException> {
        let e = exception;
        let rows = serde_json::to_string(&e.unpriced_rows)
            .map_err(|err| PortError::Permanent(format!("encoding unpriced rows: {err}")))?;
        // One upsert. The project is part of the match: a quota id filed
        // under another project is a bug, not a recurrence.
        let row = sqlx::query(concat!(
            r#"INSERT INTO quota_exceptions
                   (quota_id, project_id, "limit", window_key, llm_events, unpriced_events, unpriced_rows,
                    occurrence_count, first_seen, last_seen)
               VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 1, ?8, ?9)
               ON CONFLICT (quota_id) DO UPDATE SET
                   "limit" = excluded."limit",
                   window_key = excluded.window_key,
                   llm_events = excluded.llm_events,
                   unpriced_events = excluded.unpriced_events,
                   unpriced_rows = excluded.unpriced_rows,
                   occurrence_count = occurrence_count + 1,
                   last_seen = excluded.last_seen
               WHERE project_id = excluded.project_id
               RETURNING "#,
            exception_columns!()
        ))
        .bind(e.quota_id.as_str())
        .bind(e.project_id.as_str())
        .bind(to_i64("limit", e.limit)?)
        .bind(&e.window_key)
        .bind(to_i64("llm_events", e.llm_events)?)
        .bind(to_i64("unpriced_events", e.unpriced_events)?)
        .bind(rows)
        .bind(ts(e.first_seen)?)
        .bind(ts(e.last_seen)?)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_err)?;
        match row {
            Some(row) => exception_from_row(&row),
            None => Err(PortError::Permanent(format!(
                "quota {} has an exception filed under another project than {}",
                e.quota_id, e.project_id
            ))),
        }
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "exceptions"))]
    async fn exceptions(
        &self,
        project: &ProjectId,
        after: Option<&QuotaId>,
        limit: usize,
    ) -> PortResult<Vec<UnpricedException>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        sqlx::query(concat!(
            "SELECT ",
            exception_columns!(),
            " FROM quota_exceptions WHERE project_id = ?1 AND (?2 IS NULL OR quota_id > ?2) ORDER BY quota_id LIMIT ?3"
        ))
        .bind(project.as_str())
        .bind(after.map(QuotaId::as_str))
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?
        .iter()
        .map(exception_from_row)
        .collect()
    }
}

#[async_trait]
impl Ledger for SqliteStore {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "totals"))]
    async fn totals(&self, project: &ProjectId, counters: &[CounterKey]) -> PortResult<Vec<(CounterKey, Totals)>> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: Vec<(String, &str, &str)> =
            counters.iter().map(|c| (c.dimension.encode(), c.window.as_str(), c.window_key.as_str())).collect();
        let rows = sqlx::query(concat!(
            "SELECT dimension, window_kind, window_key, ",
            totals_columns!(),
            " FROM usage_aggregates
               WHERE project_id = ?1
                 AND (dimension, window_kind, window_key) IN
                     (SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?2))"
        ))
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
        // `resets_at IS NULL` keeps the windows that never reset: the
        // storage footprint.
        sqlx::query(concat!(
            "SELECT dimension, window_kind, window_key, resets_at, ",
            totals_columns!(),
            " FROM usage_aggregates
               WHERE project_id = ?1 AND (resets_at IS NULL OR resets_at > ?2)
               ORDER BY dimension, window_kind, window_key"
        ))
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

        // (4) The new facts, each with its project's time zone.
        let mut report = FoldReport::default();
        let mut fresh: Vec<(&UsageFact, Tz)> = Vec::with_capacity(new_ids.len());
        for (fact, first) in batch.facts.iter().zip(first) {
            let id = (fact.project_id.clone(), fact.id.clone());
            if first && new_ids.contains(&id) {
                // Invariant: every fact's zone was checked above.
                let tz = zones.get(fact.project_id.as_str()).copied().unwrap_or(Tz::UTC);
                fresh.push((fact, tz));
                report.folded.push(id);
            } else {
                report.duplicates.push(id);
            }
        }

        // (5) Fold them. Tokens events are priced at their event time
        // against the book as this transaction reads it, and their unpriced
        // components are remembered on every counter they land in.
        let book = price_book_for(&mut *tx, &fresh).await?;
        let footprint = CounterKey::footprint();
        let mut fold = Fold::new();
        let mut unpriced = UnpricedSet::new();
        let mut models = ModelUsageSet::new();
        for (fact, tz) in &fresh {
            fold.apply(fact, *tz, &book);
            if fact.kind != EventKind::Tokens {
                continue;
            }
            // The breakdown by model, for the day and month of the fact.
            add_model_usage(&mut models, fact, *tz, &book);
            let keys = priced(fact, &book).unpriced_rows;
            if keys.is_empty() {
                continue;
            }
            for (counter, _) in counters_for(fact, *tz, &book) {
                if counter.key == footprint {
                    continue;
                }
                for k in &keys {
                    unpriced.insert((fact.project_id.clone(), counter.key.clone(), k.clone()), counter.resets_at);
                }
            }
        }

        // (6) Add the folded sums in one upsert; it returns the new absolute
        // totals of every counter it touched. The footprint is not a sum:
        // (8) sets it.
        let sums: Vec<(&ProjectId, Counter, Totals)> = fold.totals().filter(|(_, c, _)| c.key != footprint).collect();
        if !sums.is_empty() {
            // Each row: the counter, then every field in `Field::ALL` order
            // (more than serde's largest tuple, hence JSON values).
            let list = sums
                .into_iter()
                .map(|(project, counter, t)| {
                    let mut row = vec![
                        Value::from(project.as_str()),
                        Value::from(counter.key.dimension.encode()),
                        Value::from(counter.key.window.as_str()),
                        Value::from(counter.key.window_key),
                        Value::from(counter.resets_at.map(ts).transpose()?),
                    ];
                    row.extend(t.values().map(Value::from));
                    Ok(row)
                })
                .collect::<PortResult<Vec<_>>>()?;
            let rows = sqlx::query(concat!(
                "INSERT INTO usage_aggregates (project_id, dimension, window_kind, window_key, resets_at, ",
                totals_columns!(),
                r#")
                   SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4,
                          value ->> 5, value ->> 6, value ->> 7, value ->> 8, value ->> 9, value ->> 10,
                          value ->> 11, value ->> 12, value ->> 13, value ->> 14, value ->> 15, value ->> 16,
                          value ->> 17
                   FROM json_each(?1) WHERE true
                   ON CONFLICT (project_id, dimension, window_kind, window_key) DO UPDATE SET
                       requests = requests + excluded.requests,
                       calls = calls + excluded.calls,
                       "rows" = "rows" + excluded."rows",
                       tokens = tokens + excluded.tokens,
                       cost_llm_tokens = cost_llm_tokens + excluded.cost_llm_tokens,
                       cost_compute_execution = cost_compute_execution + excluded.cost_compute_execution,
                       cost_api_request = cost_api_request + excluded.cost_api_request,
                       cost_storage = cost_storage + excluded.cost_storage,
                       llm_events = llm_events + excluded.llm_events,
                       llm_priced = llm_priced + excluded.llm_priced,
                       llm_unpriced = llm_unpriced + excluded.llm_unpriced,
                       storage_events = storage_events + excluded.storage_events,
                       storage = storage + excluded.storage
                   RETURNING project_id, dimension, window_kind, window_key, resets_at, "#,
                totals_columns!()
            ))
            .bind(json_list(&list)?)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
            for row in &rows {
                report.totals.push(aggregate_from_row(row)?);
            }
        }

        // (7) The unpriced rows, in one statement.
        insert_unpriced(&mut *tx, &unpriced).await?;

        // (7b) The token usage breakdown by model, in one upsert.
        insert_model_usage(&mut *tx, &models).await?;

        // (8) The footprint of every project with new storage facts. The
        // write lock taken by IMMEDIATE already serialises folds, so the
        // recompute below sees every committed fact.
        let storage: Vec<(&UsageFact, &str)> =
            fresh.iter().filter_map(|(f, _)| storage_kind(f.kind).map(|kind| (*f, kind))).collect();
        if !storage.is_empty() {
            let mut touched: Vec<&str> = storage.iter().map(|(f, _)| f.project_id.as_str()).collect();
            touched.sort_unstable();
            touched.dedup();
            let touched = json_list(&touched)?;
            let dimension = footprint.dimension.encode();

            // (a) The footprint rows, created if need be.
            sqlx::query(
                "INSERT INTO usage_aggregates (project_id, dimension, window_kind, window_key) \
                 SELECT value, ?2, ?3, ?4 FROM json_each(?1) WHERE true ON CONFLICT DO NOTHING",
            )
            .bind(&touched)
            .bind(&dimension)
            .bind(footprint.window.as_str())
            .bind(&footprint.window_key)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?;

            // (b) Keep the facts: the footprint is recomputed from all of them.
            let list = storage
                .iter()
                .map(|(f, kind)| {
                    Ok((f.project_id.as_str(), f.id.as_str(), *kind, ts(f.occurred_at)?, f.storage_bytes.unwrap_or(0)))
                })
                .collect::<PortResult<Vec<_>>>()?;
            sqlx::query(
                "INSERT INTO storage_facts (project_id, event_id, kind, occurred_at, bytes) \
                 SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3, value ->> 4 FROM json_each(?1) WHERE true \
                 ON CONFLICT DO NOTHING",
            )
            .bind(json_list(&list)?)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?;

            // (c) Set (not add) each footprint: meter's `Footprint` in SQL,
            // the newest snapshot by (occurred_at, event_id) plus the deltas
            // strictly after it, or all the deltas if there is no snapshot;
            // `storage_events` is how many storage facts it reflects.
            let rows = sqlx::query(concat!(
                "WITH t(p) AS (SELECT value FROM json_each(?1)),
                 s AS (
                     SELECT project_id, occurred_at, bytes,
                            row_number() OVER (PARTITION BY project_id ORDER BY occurred_at DESC, event_id DESC) AS n
                     FROM storage_facts
                     WHERE kind = 'snapshot' AND project_id IN (SELECT p FROM t)
                 ),
                 f AS (
                     SELECT t.p AS fp_project,
                            ifnull(s.bytes, 0) + ifnull(
                                (SELECT sum(d.bytes) FROM storage_facts d
                                 WHERE d.project_id = t.p AND d.kind = 'delta'
                                   AND (s.occurred_at IS NULL OR d.occurred_at > s.occurred_at)),
                                0) AS fp_bytes,
                            (SELECT count(*) FROM storage_facts c WHERE c.project_id = t.p) AS fp_events
                     FROM t LEFT JOIN s ON s.project_id = t.p AND s.n = 1
                 )
                 UPDATE usage_aggregates SET storage = f.fp_bytes, storage_events = f.fp_events
                 FROM f
                 WHERE usage_aggregates.project_id = f.fp_project AND dimension = ?2 AND window_kind = ?3
                   AND window_key = ?4
                 RETURNING project_id, dimension, window_kind, window_key, resets_at, ",
                totals_columns!()
            ))
            .bind(&touched)
            .bind(&dimension)
            .bind(footprint.window.as_str())
            .bind(&footprint.window_key)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_err)?;
            for row in &rows {
                report.totals.push(aggregate_from_row(row)?);
            }
        }
        report.totals.sort_by(|a, b| (&a.0, &a.1.key).cmp(&(&b.0, &b.1.key)));

        tx.commit().await.map_err(db_err)?;
        Ok(report)
    }
}

#[async_trait]
impl ReportStore for SqliteStore {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = "sqlite", op = "model_usage"))]
    async fn model_usage(
        &self,
        project: &ProjectId,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<ModelUsageRow>> {
        let rows = sqlx::query(
            "SELECT provider, model, component, meter_type, embedding, priced_quantity, unpriced_quantity, cost_picos \
             FROM model_usage WHERE project_id = ?1 AND window_kind = ?2 AND window_key = ?3",
        )
        .bind(project.as_str())
        .bind(window.as_str())
        .bind(window_key)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        let mut out = rows.iter().map(model_usage_from_row).collect::<PortResult<Vec<_>>>()?;
        // meter's orders (components and meters are not in name order).
        out.sort_by(|a, b| (&a.key, a.meter, a.embedding).cmp(&(&b.key, b.meter, b.embedding)));
        Ok(out)
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = "sqlite", op = "population_totals")
    )]
    async fn population_totals(
        &self,
        project: &ProjectId,
        population: Population,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<(CounterKey, Totals)>> {
        let prefix = population.encoded_prefix();
        // A comparison of the leading characters, not LIKE: the prefix is
        // text, never a pattern (and LIKE ignores ASCII case).
        let rows = sqlx::query(concat!(
            "SELECT dimension, window_kind, window_key, ",
            totals_columns!(),
            " FROM usage_aggregates
               WHERE project_id = ?1 AND window_kind = ?2 AND window_key = ?3
                 AND substr(dimension, 1, length(?4)) = ?4"
        ))
        .bind(project.as_str())
        .bind(window.as_str())
        .bind(window_key)
        .bind(prefix)
        .fetch_all(&self.pool)
        .await
        .map_err(db_err)?;
        let mut out = rows
            .iter()
            .map(|row| Ok((counter_key_from_row(row)?, totals_from_row(row)?)))
            .collect::<PortResult<Vec<_>>>()?;
        out.sort_by(|a, b| a.0.dimension.cmp(&b.0.dimension));
        Ok(out)
    }
}
