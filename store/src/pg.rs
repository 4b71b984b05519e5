//! The store on PostgreSQL: [`PgStore`], the shared SQL store
//! ([`crate::sql`]) over PostgreSQL, and what PostgreSQL brings to it.
//!
//! - Instants are `timestamptz` (microseconds), JSON documents `jsonb`.
//! - A batch of rows is one typed array per column, unpacked by `UNNEST`.
//! - A plan of quotas holds its project's row `FOR NO KEY UPDATE`, which
//!   leaves foreign-key checks of other tables (a new key, an audit entry)
//!   unblocked.
//! - A dropped connection, a serialisation failure, a deadlock, exhausted
//!   resources or an operator intervention (shutdown, statement timeout)
//!   are worth retrying.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use meter::PortResult;
use serde::de::DeserializeOwned;
use sqlx::migrate::MigrateError;
use sqlx::postgres::{PgArguments, PgConnection, PgPoolOptions, PgRow};
use sqlx::query::Query;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Pool, Postgres, Row, Transaction};

use crate::sql::{Arg, Backend, Col, SqlStore, Stmt, error};

/// The PostgreSQL store; cheap to clone (it is a pool handle).
pub type PgStore = SqlStore<Postgres>;

impl SqlStore<Postgres> {
    /// Connects a pool to `url` (`postgres://user@host:port/db`).
    pub async fn connect(url: &str) -> PortResult<PgStore> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .map_err(error::<Postgres>)?;
        Ok(PgStore::from_pool(pool))
    }
}

/// `stmt` as a query: its SQL with `{rows}` as `UNNEST` of one array per
/// column, and every parameter bound.
fn query(stmt: Stmt) -> Query<'static, Postgres, PgArguments> {
    let sql = stmt.render(|rows, first| {
        let arrays: Vec<String> = rows
            .cols
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let ty = match c {
                    Col::Text(_) => "text",
                    Col::Int(_) => "bigint",
                    Col::Bool(_) => "bool",
                    Col::Time(_) | Col::OptTime(_) => "timestamptz",
                    Col::Bytes(_) | Col::OptBytes(_) => "bytea",
                };
                format!("${}::{ty}[]", first + i)
            })
            .collect();
        let names: Vec<String> = rows.names.iter().map(|n| format!("\"{n}\"")).collect();
        format!("(SELECT * FROM UNNEST({}) AS r({}))", arrays.join(", "), names.join(", "))
    });
    let mut q = sqlx::query(AssertSqlSafe(sql));
    for a in stmt.args {
        q = match a {
            Arg::Text(v) => q.bind(v),
            Arg::OptText(v) => q.bind(v),
            Arg::Int(v) => q.bind(v),
            Arg::Bool(v) => q.bind(v),
            Arg::Time(v) => q.bind(v),
            Arg::OptTime(v) => q.bind(v),
            Arg::OptInt(v) => q.bind(v),
            Arg::Json(v) => q.bind(Json(v)),
            Arg::OptJson(v) => q.bind(v.map(Json)),
        };
    }
    for c in stmt.rows.map(|r| r.cols).unwrap_or_default() {
        q = match c {
            Col::Text(v) => q.bind(v),
            Col::Int(v) => q.bind(v),
            Col::Bool(v) => q.bind(v),
            Col::Time(v) => q.bind(v),
            Col::OptTime(v) => q.bind(v),
            Col::Bytes(v) => q.bind(v),
            Col::OptBytes(v) => q.bind(v),
        };
    }
    q
}

impl Backend for Postgres {
    const SPAN_DB: &'static str = "postgres";
    const LOCK_PROJECT: &'static str = " FOR NO KEY UPDATE";
    const SNAPSHOT_BEGIN: &'static str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";
    const BYTEWISE: &'static str = r#" COLLATE "C""#;
    const LOCK_ROWS: &'static str = " FOR UPDATE";
    // Conflicts with itself and with every write, not with reads (the fold's).
    const LOCK_PRICE_BOOK: Option<&'static str> = Some("LOCK TABLE prices IN SHARE ROW EXCLUSIVE MODE");
    const LIST_TABLES: &'static str = "SELECT CAST(table_name AS text) AS name FROM information_schema.tables \
                                       WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'";

    fn transient(code: &str) -> bool {
        // Connection exceptions, insufficient resources, operator
        // intervention; serialization failure, deadlock.
        ["08", "53", "57"].iter().any(|class| code.starts_with(class)) || code == "40001" || code == "40P01"
    }

    fn begin(
        pool: &Pool<Postgres>,
    ) -> impl Future<Output = Result<Transaction<'static, Postgres>, sqlx::Error>> + Send {
        pool.begin()
    }

    fn begin_snapshot(
        pool: &Pool<Postgres>,
    ) -> impl Future<Output = Result<Transaction<'static, Postgres>, sqlx::Error>> + Send {
        pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    }

    async fn migrate(pool: &Pool<Postgres>) -> Result<(), MigrateError> {
        sqlx::migrate!("../migrations").run(pool).await
    }

    fn fetch<'c>(conn: &'c mut PgConnection, stmt: Stmt) -> impl Future<Output = PortResult<Vec<PgRow>>> + Send + 'c {
        let q = query(stmt);
        async move { q.fetch_all(conn).await.map_err(error::<Postgres>) }
    }

    fn execute<'c>(conn: &'c mut PgConnection, stmt: Stmt) -> impl Future<Output = PortResult<u64>> + Send + 'c {
        let q = query(stmt);
        async move { Ok(q.execute(conn).await.map_err(error::<Postgres>)?.rows_affected()) }
    }

    fn opt_time(row: &PgRow, column: &str) -> PortResult<Option<DateTime<Utc>>> {
        row.try_get(column).map_err(error::<Postgres>)
    }

    fn opt_json<T: DeserializeOwned>(row: &PgRow, column: &str) -> PortResult<Option<T>> {
        row.try_get::<Option<Json<T>>, _>(column).map(|j| j.map(|j| j.0)).map_err(error::<Postgres>)
    }
}
