//! The store over SQL, written once for PostgreSQL and SQLite.
//!
//! [`SqlStore`] implements every store port (`TenantStore`, `QuotaStore`,
//! `AuditStore`, `PriceStore`, `Ledger`, `ReportStore`) over either
//! database; [`PgStore`](crate::PgStore) and
//! [`SqliteStore`](crate::SqliteStore) are its two instances. The queries,
//! the row decoding, the column lists and the sorting of driver errors are
//! here, once. What differs between the databases is a [`Backend`], one per
//! database in its own module (`pg.rs`, `sqlite_store.rs`):
//!
//! - how values are bound: instants are `timestamptz` on PostgreSQL and
//!   RFC 3339 text with six fractional digits on SQLite (so text order is
//!   time order); JSON is `jsonb` or text;
//! - how a batch of rows is bound ([`Rows`], written `{rows}` in a query): one
//!   array per column unpacked by `UNNEST` on PostgreSQL, one JSON array
//!   unpacked by `jsonb_each` on SQLite, so a batch of any size is a fixed
//!   number of parameters;
//! - how a writing transaction begins (SQLite's `BEGIN IMMEDIATE` takes the
//!   file's write lock at once) and what serialises plans of one project
//!   (PostgreSQL's `FOR NO KEY UPDATE` on its row);
//! - which driver codes are worth retrying, and the migrations.
//!
//! Queries are built at run time with binds (no `query!` macros, so building
//! needs no database); placeholders are `$1`, `$2`… on both (sqlx's SQLite
//! driver reads `$NNN` as `?NNN`), and a query's batch, if any, takes the
//! numbers after its scalar parameters. The fold's arithmetic is not here:
//! `meter::ledger` computes what a batch writes, and [`SqlStore`] only reads
//! what it needs and persists the result.

mod config;
mod exports;
mod ledger;
mod prices;
mod schedules;
pub mod shadow;
mod shares;
mod webhooks;

use std::borrow::Cow;
use std::future::Future;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use meter::{PortError, PortResult};
use serde::de::DeserializeOwned;
use sqlx::error::ErrorKind;
use sqlx::migrate::MigrateError;
use sqlx::{ColumnIndex, Database, Decode, Pool, Row, Transaction, Type};

/// What one database brings to [`SqlStore`]: the dialect and the driver.
/// Implemented for [`sqlx::Postgres`] (in `pg.rs`) and [`sqlx::Sqlite`] (in
/// `sqlite_store.rs`).
pub trait Backend:
    Database
    + Decodes<String>
    + Decodes<Option<String>>
    + Decodes<i64>
    + Decodes<Option<i64>>
    + Decodes<bool>
    + Decodes<Vec<u8>>
    + Decodes<Option<Vec<u8>>>
{
    /// The `db` field of every `datastore` span.
    const SPAN_DB: &'static str;
    /// What follows `SELECT … FROM projects WHERE id = $1` to hold the
    /// project's quotas still until the transaction ends.
    const LOCK_PROJECT: &'static str;

    /// What begins a read-only transaction that reads one snapshot.
    const SNAPSHOT_BEGIN: &'static str;
    /// What follows a text column to compare and order it bytewise (the
    /// order of Rust's `str`), whatever the database's collation.
    const BYTEWISE: &'static str;
    /// What follows a `SELECT` of rows to hold them still until the
    /// transaction ends (SQLite: nothing; its write lock holds everything).
    const LOCK_ROWS: &'static str;
    /// A query of the names (`name`) of the store's tables.
    const LIST_TABLES: &'static str;
    /// What a writing transaction runs first to hold the price book still
    /// until it ends, against other writers only (`None`: nothing to run,
    /// SQLite's write lock holds everything already).
    const LOCK_PRICE_BOOK: Option<&'static str>;

    /// Whether a database error code is worth retrying.
    fn transient(code: &str) -> bool;
    /// Begins a transaction that will write.
    fn begin(pool: &Pool<Self>) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;
    /// Begins a read-only transaction whose statements all see one snapshot.
    fn begin_snapshot(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;
    /// Applies this database's migrations (idempotent).
    fn migrate(pool: &Pool<Self>) -> impl Future<Output = Result<(), MigrateError>> + Send;
    /// The in-process turn this database's busiest writers take before they
    /// begin (SQLite: one per file, see [`crate::sqlite_store::write_gate`];
    /// `None`: the database queues its writers well itself).
    fn write_gate(_pool: &Pool<Self>) -> Option<WriteGate> {
        None
    }
    /// Runs a statement, returning its rows.
    fn fetch<'c>(
        conn: &'c mut Self::Connection,
        stmt: Stmt,
    ) -> impl Future<Output = PortResult<Vec<Self::Row>>> + Send + 'c;
    /// Runs a statement, returning how many rows it changed.
    fn execute<'c>(conn: &'c mut Self::Connection, stmt: Stmt) -> impl Future<Output = PortResult<u64>> + Send + 'c;
    /// An instant, as this database stores it.
    fn opt_time(row: &Self::Row, column: &str) -> PortResult<Option<DateTime<Utc>>>;
    /// A JSON document, as this database stores it.
    fn opt_json<T: DeserializeOwned>(row: &Self::Row, column: &str) -> PortResult<Option<T>>;
}

/// Decoding a column into `T`, for any database whose driver decodes it
/// (what lets [`Backend`] name the types both databases read alike).
pub trait Decodes<T>: Database {
    fn decode(row: &Self::Row, column: &str) -> Result<T, sqlx::Error>;
}

impl<DB, T> Decodes<T> for DB
where
    DB: Database,
    T: for<'r> Decode<'r, DB> + Type<DB>,
    for<'c> &'c str: ColumnIndex<DB::Row>,
{
    fn decode(row: &DB::Row, column: &str) -> Result<T, sqlx::Error> {
        row.try_get(column)
    }
}

/// A turn at a database's write lock, taken in this process before asking
/// the database for it (see [`Backend::write_gate`]).
pub type WriteGate = std::sync::Arc<tokio::sync::Mutex<()>>;

/// The store over one SQL database; cheap to clone (it is a pool handle).
pub struct SqlStore<B: Database> {
    pool: Pool<B>,
    gate: Option<WriteGate>,
}

impl<B: Database> Clone for SqlStore<B> {
    fn clone(&self) -> Self {
        SqlStore { pool: self.pool.clone(), gate: self.gate.clone() }
    }
}

impl<B: Database> std::fmt::Debug for SqlStore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore").field("pool", &self.pool).finish()
    }
}

impl<B: Backend> SqlStore<B> {
    /// Wraps an existing pool.
    pub fn from_pool(pool: Pool<B>) -> SqlStore<B> {
        let gate = B::write_gate(&pool);
        SqlStore { pool, gate }
    }

    /// Waits for this process's turn at the write lock, where the database
    /// has one ([`Backend::write_gate`]); held until the guard drops.
    pub(crate) async fn write_turn(&self) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        match &self.gate {
            Some(g) => Some(std::sync::Arc::clone(g).lock_owned().await),
            None => None,
        }
    }

    pub fn pool(&self) -> &Pool<B> {
        &self.pool
    }

    /// Applies the migrations (`migrations/`, or `migrations/sqlite/`);
    /// idempotent, and concurrent callers are serialised.
    pub async fn migrate(&self) -> PortResult<()> {
        B::migrate(&self.pool).await.map_err(|e| match e {
            MigrateError::Execute(e) => error::<B>(e),
            other => PortError::Permanent(format!("migrating: {other}")),
        })
    }

    /// Forgets folded event ids that occurred before `before`, whatever the
    /// fold's position (housekeeping by hand; the projector purges with
    /// [`Ledger::purge_processed`](meter::Ledger::purge_processed), whose
    /// cutoff comes from the fold itself). Returns how many were removed.
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "purge_processed_before"))]
    pub async fn purge_processed_before(&self, before: DateTime<Utc>) -> PortResult<u64> {
        self.run(Stmt::new("DELETE FROM processed_events WHERE occurred_at < $1").time(before)).await
    }

    async fn conn(&self) -> PortResult<sqlx::pool::PoolConnection<B>> {
        self.pool.acquire().await.map_err(error::<B>)
    }

    /// Runs a statement outside a transaction; its rows.
    async fn all(&self, stmt: Stmt) -> PortResult<Vec<B::Row>> {
        B::fetch(&mut *self.conn().await?, stmt).await
    }

    /// Runs a statement outside a transaction; its first row.
    async fn opt(&self, stmt: Stmt) -> PortResult<Option<B::Row>> {
        Ok(self.all(stmt).await?.into_iter().next())
    }

    /// Runs a statement outside a transaction; how many rows it changed.
    async fn run(&self, stmt: Stmt) -> PortResult<u64> {
        B::execute(&mut *self.conn().await?, stmt).await
    }

    /// Runs a statement and, if it changed a row, writes `audit` to the
    /// audit outbox, in one transaction: the change and its audit entries
    /// commit together or not at all. How many rows it changed.
    async fn run_audited(&self, stmt: Stmt, audit: &[meter::AuditEntry]) -> PortResult<u64> {
        // Dropping `tx` without committing rolls everything back.
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        let changed = B::execute(&mut *tx, stmt).await?;
        if changed > 0 {
            for entry in audit {
                B::execute(&mut *tx, config::insert_audit(entry)?).await?;
            }
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(changed)
    }
}

/// Sorts a driver error, once: a uniqueness violation is a conflict; a
/// dropped connection, an exhausted pool or a code the backend calls
/// transient (a deadlock, a lock held too long, a full disk…) is worth
/// retrying; the rest (a foreign key or check violation, a bad schema) is
/// permanent.
pub(crate) fn error<B: Backend>(e: sqlx::Error) -> PortError {
    match &e {
        sqlx::Error::Database(d) if d.kind() == ErrorKind::UniqueViolation => {
            PortError::Conflict(match d.constraint() {
                Some(c) => format!("{c}: {}", d.message()),
                None => d.message().to_owned(),
            })
        }
        sqlx::Error::Database(d) if d.code().is_some_and(|c| B::transient(&c)) => PortError::Transient(e.to_string()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => PortError::Transient(e.to_string()),
        _ => PortError::Permanent(e.to_string()),
    }
}

pub(crate) fn corrupt(what: &str, value: &str) -> PortError {
    PortError::Permanent(format!("stored {what} {value:?} is not valid"))
}

pub(crate) fn to_i64(what: &str, v: u64) -> PortResult<i64> {
    i64::try_from(v).map_err(|_| PortError::Permanent(format!("{what} {v} does not fit a 64-bit integer")))
}

/// A page size as SQL's `LIMIT`.
fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// One scalar parameter.
#[derive(Debug, Clone)]
pub enum Arg {
    Text(String),
    OptText(Option<String>),
    Int(i64),
    Bool(bool),
    Time(DateTime<Utc>),
    OptTime(Option<DateTime<Utc>>),
    OptInt(Option<i64>),
    Json(serde_json::Value),
    OptJson(Option<serde_json::Value>),
}

/// One column of a batch.
#[derive(Debug, Clone)]
pub enum Col {
    Text(Vec<String>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
    Time(Vec<DateTime<Utc>>),
    OptTime(Vec<Option<DateTime<Utc>>>),
    Bytes(Vec<Vec<u8>>),
    OptBytes(Vec<Option<Vec<u8>>>),
}

impl Col {
    /// How many cells it has.
    pub fn len(&self) -> usize {
        match self {
            Col::Text(v) => v.len(),
            Col::Int(v) => v.len(),
            Col::Bool(v) => v.len(),
            Col::Time(v) => v.len(),
            Col::OptTime(v) => v.len(),
            Col::Bytes(v) => v.len(),
            Col::OptBytes(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A batch of rows bound as a table: `{rows}` in a query is a subquery
/// whose columns have these names. Built column by column.
#[derive(Debug, Clone, Default)]
pub struct Rows {
    pub(crate) names: Vec<&'static str>,
    pub(crate) cols: Vec<Col>,
}

impl Rows {
    pub fn new() -> Rows {
        Rows::default()
    }

    fn with(mut self, name: &'static str, col: Col) -> Rows {
        self.names.push(name);
        self.cols.push(col);
        self
    }

    pub fn text<S: Into<String>>(self, name: &'static str, values: impl IntoIterator<Item = S>) -> Rows {
        self.with(name, Col::Text(values.into_iter().map(Into::into).collect()))
    }

    pub fn int(self, name: &'static str, values: impl IntoIterator<Item = i64>) -> Rows {
        self.with(name, Col::Int(values.into_iter().collect()))
    }

    pub fn flag(self, name: &'static str, values: impl IntoIterator<Item = bool>) -> Rows {
        self.with(name, Col::Bool(values.into_iter().collect()))
    }

    pub fn time(self, name: &'static str, values: impl IntoIterator<Item = DateTime<Utc>>) -> Rows {
        self.with(name, Col::Time(values.into_iter().collect()))
    }

    pub fn opt_time(self, name: &'static str, values: impl IntoIterator<Item = Option<DateTime<Utc>>>) -> Rows {
        self.with(name, Col::OptTime(values.into_iter().collect()))
    }

    pub fn bytes(self, name: &'static str, values: impl IntoIterator<Item = Vec<u8>>) -> Rows {
        self.with(name, Col::Bytes(values.into_iter().collect()))
    }

    pub fn opt_bytes(self, name: &'static str, values: impl IntoIterator<Item = Option<Vec<u8>>>) -> Rows {
        self.with(name, Col::OptBytes(values.into_iter().collect()))
    }

    /// How many rows (every column has as many).
    pub fn len(&self) -> usize {
        self.cols.first().map_or(0, Col::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One statement: SQL with `$n` placeholders for its scalar parameters and,
/// at most once, `{rows}` for a batch.
#[derive(Debug, Clone)]
pub struct Stmt {
    pub(crate) sql: Cow<'static, str>,
    pub(crate) args: Vec<Arg>,
    pub(crate) rows: Option<Rows>,
}

impl Stmt {
    pub fn new(sql: impl Into<Cow<'static, str>>) -> Stmt {
        Stmt { sql: sql.into(), args: Vec::new(), rows: None }
    }

    fn arg(mut self, a: Arg) -> Stmt {
        self.args.push(a);
        self
    }

    pub fn text(self, v: impl Into<String>) -> Stmt {
        self.arg(Arg::Text(v.into()))
    }

    pub fn opt_text(self, v: Option<impl Into<String>>) -> Stmt {
        self.arg(Arg::OptText(v.map(Into::into)))
    }

    pub fn int(self, v: i64) -> Stmt {
        self.arg(Arg::Int(v))
    }

    pub fn flag(self, v: bool) -> Stmt {
        self.arg(Arg::Bool(v))
    }

    pub fn time(self, v: DateTime<Utc>) -> Stmt {
        self.arg(Arg::Time(v))
    }

    pub fn opt_time(self, v: Option<DateTime<Utc>>) -> Stmt {
        self.arg(Arg::OptTime(v))
    }

    pub fn opt_int(self, v: Option<i64>) -> Stmt {
        self.arg(Arg::OptInt(v))
    }

    pub fn json(self, v: &impl serde::Serialize) -> PortResult<Stmt> {
        Ok(self.arg(Arg::Json(to_json(v)?)))
    }

    pub fn opt_json(self, v: Option<&impl serde::Serialize>) -> PortResult<Stmt> {
        Ok(self.arg(Arg::OptJson(v.map(to_json).transpose()?)))
    }

    pub fn rows(mut self, rows: Rows) -> Stmt {
        self.rows = Some(rows);
        self
    }

    /// The SQL with `{rows}` replaced by what `source` renders for the
    /// batch, given the number of its first parameter.
    pub(crate) fn render(&self, source: impl FnOnce(&Rows, usize) -> String) -> Cow<'static, str> {
        match &self.rows {
            Some(rows) => Cow::Owned(self.sql.replacen("{rows}", &source(rows, self.args.len() + 1), 1)),
            None => self.sql.clone(),
        }
    }
}

fn to_json(v: &impl serde::Serialize) -> PortResult<serde_json::Value> {
    serde_json::to_value(v).map_err(|e| PortError::Permanent(format!("encoding a JSON document: {e}")))
}

/// A row as the queries read it, decoded through the backend.
pub(crate) struct Rec<'r, B: Backend>(pub(crate) &'r B::Row);

impl<B: Backend> Rec<'_, B> {
    pub(crate) fn get<T>(&self, column: &str) -> PortResult<T>
    where
        B: Decodes<T>,
    {
        <B as Decodes<T>>::decode(self.0, column).map_err(error::<B>)
    }

    pub(crate) fn text(&self, column: &str) -> PortResult<String> {
        self.get(column)
    }

    pub(crate) fn int(&self, column: &str) -> PortResult<i64> {
        self.get(column)
    }

    /// A count or quantity, never negative.
    pub(crate) fn count(&self, column: &str) -> PortResult<u64> {
        let v = self.int(column)?;
        u64::try_from(v).map_err(|_| corrupt(column, &v.to_string()))
    }

    /// A name of one of meter's closed sets (a metric, a window…).
    pub(crate) fn parse<T: FromStr>(&self, column: &str) -> PortResult<T> {
        let s = self.text(column)?;
        s.parse().map_err(|_| corrupt(column, &s))
    }

    /// An id of one of meter's id types.
    pub(crate) fn id<T: TryFrom<String>>(&self, column: &str) -> PortResult<T> {
        let s = self.text(column)?;
        T::try_from(s.clone()).map_err(|_| corrupt(column, &s))
    }

    pub(crate) fn opt_id<T: TryFrom<String>>(&self, column: &str) -> PortResult<Option<T>> {
        let Some(s) = self.get::<Option<String>>(column)? else { return Ok(None) };
        T::try_from(s.clone()).map(Some).map_err(|_| corrupt(column, &s))
    }

    pub(crate) fn opt_time(&self, column: &str) -> PortResult<Option<DateTime<Utc>>> {
        B::opt_time(self.0, column)
    }

    pub(crate) fn time(&self, column: &str) -> PortResult<DateTime<Utc>> {
        self.opt_time(column)?.ok_or_else(|| corrupt(column, "NULL"))
    }

    pub(crate) fn opt_json<T: DeserializeOwned>(&self, column: &str) -> PortResult<Option<T>> {
        B::opt_json(self.0, column)
    }

    pub(crate) fn json<T: DeserializeOwned>(&self, column: &str) -> PortResult<T> {
        self.opt_json(column)?.ok_or_else(|| corrupt(column, "NULL"))
    }
}

/// Decodes every row with `f`.
pub(crate) fn each<B: Backend, T>(rows: &[B::Row], f: impl Fn(&Rec<'_, B>) -> PortResult<T>) -> PortResult<Vec<T>> {
    rows.iter().map(|r| f(&Rec(r))).collect()
}
