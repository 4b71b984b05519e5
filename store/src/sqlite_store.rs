//! The store in one local SQLite file, for `tollgate dev`: [`SqliteStore`],
//! the shared SQL store ([`crate::sql`]) over SQLite, with the same tables
//! (`migrations/sqlite/`) and the same observable behaviour as
//! [`PgStore`](crate::PgStore), checked by the same conformance suite
//! (`store/tests/store_conformance.rs`). What SQLite brings to it:
//!
//! - A writing transaction (a fold, a plan of quotas) begins `IMMEDIATE`, so
//!   two writers queue on the file's write lock (within `busy_timeout`)
//!   instead of failing on a stale snapshot; that lock is also what holds a
//!   project's quotas still during a plan.
//! - Opened with [`SqliteStore::open`], the file is in WAL mode with
//!   `synchronous = FULL`: a fold whose commit returned survives a crash or a
//!   `kill -9` of the process (and a power cut, as far as fsync holds).
//! - Timestamps are stored as text in one fixed form, RFC 3339 UTC with six
//!   fractional digits, so the text compares and sorts like the instants.
//!   Precision is the microsecond, like PostgreSQL's `timestamptz`. JSON
//!   documents are text.
//! - A batch of rows travels as one JSON array bound to one parameter and
//!   unpacked by `jsonb_each`, so a batch of any size stays far from SQLite's
//!   bind-parameter limit.
//! - A quota's identity treats NULLs as equal (PostgreSQL's `NULLS NOT
//!   DISTINCT`) through a unique index over `ifnull(x, '')` and `x IS NULL`.
//! - A lock held too long, an I/O error, a full disk or exhausted memory is
//!   worth retrying.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use chrono::{DateTime, Datelike, Utc};
use meter::{PortError, PortResult};
use serde::de::DeserializeOwned;
use serde::ser::{Serialize, SerializeSeq, Serializer};
use sqlx::migrate::MigrateError;
use sqlx::query::Query;
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Pool, Row, Sqlite, Transaction};

use crate::sql::{Arg, Backend, Col, Rows, SqlStore, Stmt, WriteGate, corrupt, error};

/// How long a statement waits for another connection's lock before it fails
/// (as [`PortError::Transient`]).
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The embedded store; cheap to clone (it is a pool handle). Wrapping a
/// pool of your own ([`SqlStore::from_pool`]) keeps its connect options:
/// the durability and locking described in [`crate::sqlite_store`] need
/// those of [`SqliteStore::open`].
pub type SqliteStore = SqlStore<Sqlite>;

impl SqlStore<Sqlite> {
    /// Opens (creating it if missing) the database file at `path`: WAL
    /// journal, `synchronous = FULL`, foreign keys on, a busy timeout. The
    /// directory must exist. Call [`SqlStore::migrate`] next.
    pub async fn open(path: &Path) -> PortResult<SqliteStore> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        // A connection to a local file does not go stale the way a socket
        // does: no round trip to test it each time it leaves the pool.
        let pool = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(error::<Sqlite>)?;
        Ok(SqliteStore::from_pool(pool))
    }
}

/// This process's turn at the write lock of `pool`'s file: one per file,
/// shared by every pool of this process on it.
///
/// SQLite has one writer per file; a connection that finds the lock taken
/// sleeps in SQLite's busy handler (1, 2, 5, 10… up to 100 ms between
/// tries) however soon the lock is free again. The log's writer and the
/// fold take this turn first, so in one process they queue in order and the
/// next one starts the moment the other commits. Writers in other processes,
/// and this process's rare writers (configuration, exports), still meet at
/// SQLite's lock and its busy timeout as before.
pub fn write_gate(pool: &Pool<Sqlite>) -> WriteGate {
    type Gates = HashMap<PathBuf, Weak<tokio::sync::Mutex<()>>>;
    static GATES: OnceLock<StdMutex<Gates>> = OnceLock::new();
    let name = pool.connect_options().get_filename().to_path_buf();
    let file = std::fs::canonicalize(&name).unwrap_or(name);
    // Every update leaves the map consistent before it could panic.
    let mut gates = GATES.get_or_init(Default::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(gate) = gates.get(&file).and_then(Weak::upgrade) {
        return gate;
    }
    gates.retain(|_, g| g.strong_count() > 0);
    let gate = WriteGate::default();
    gates.insert(file, Arc::downgrade(&gate));
    gate
}

// SQLite primary result codes (the low byte of an extended code).
const SQLITE_NOMEM: i32 = 7;
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;

/// An instant as stored: `YYYY-MM-DDTHH:MM:SS.ffffffZ`, truncated to the
/// microsecond. Only four-digit years keep the text sortable. Written by
/// chrono's RFC 3339 writer, the same text as the strftime pattern
/// `%Y-%m-%dT%H:%M:%S%.6fZ` without parsing that pattern at each of the
/// fold's instants.
fn ts(at: DateTime<Utc>) -> PortResult<String> {
    if !(0..=9999).contains(&at.year()) {
        return Err(PortError::Permanent(format!("instant {at} is outside the years 0 to 9999")));
    }
    Ok(at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
}

/// A batch as one JSON array of rows, each an array of its cells, written
/// straight from its columns (no JSON value built per cell: the fold binds
/// a few of these per batch). A column shorter or longer than the others is
/// an error, not a row cut short.
fn json_rows(rows: &Rows) -> PortResult<String> {
    let n = rows.len();
    if let Some((name, _)) = rows.names.iter().zip(&rows.cols).find(|(_, c)| c.len() != n) {
        return Err(PortError::Permanent(format!("a batch's column {name} does not have its {n} rows")));
    }
    let cols = rows
        .cols
        .iter()
        .map(|c| {
            Ok(match c {
                Col::Text(v) => Cells::Text(v),
                Col::Int(v) => Cells::Int(v),
                // A JSON `true` reads back as 1.
                Col::Bool(v) => Cells::Bool(v),
                Col::Time(v) => Cells::Owned(v.iter().map(|t| ts(*t)).collect::<PortResult<_>>()?),
                Col::OptTime(v) => Cells::OptOwned(v.iter().map(|t| t.map(ts).transpose()).collect::<PortResult<_>>()?),
                // JSON has no bytes: hex, which the query unpacks with `unhex`.
                Col::Bytes(v) => Cells::Owned(v.iter().map(|b| hex(b)).collect()),
                Col::OptBytes(v) => Cells::OptOwned(v.iter().map(|b| b.as_deref().map(hex)).collect()),
            })
        })
        .collect::<PortResult<Vec<_>>>()?;
    serde_json::to_string(&Table(&cols, n)).map_err(|e| PortError::Permanent(format!("encoding a batch: {e}")))
}

/// One column of a batch as [`json_rows`] writes it.
enum Cells<'a> {
    Text(&'a [String]),
    Int(&'a [i64]),
    Bool(&'a [bool]),
    Owned(Vec<String>),
    OptOwned(Vec<Option<String>>),
}

/// The batch's `n` rows, each the array of its cells (every column has
/// `n`, checked by [`json_rows`]).
struct Table<'a>(&'a [Cells<'a>], usize);

/// Row `i` of a batch.
struct BatchRow<'a>(&'a [Cells<'a>], usize);

impl Serialize for Table<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.1))?;
        for i in 0..self.1 {
            seq.serialize_element(&BatchRow(self.0, i))?;
        }
        seq.end()
    }
}

impl Serialize for BatchRow<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let i = self.1;
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for col in self.0 {
            match col {
                Cells::Text(v) => seq.serialize_element(&v.get(i))?,
                Cells::Int(v) => seq.serialize_element(&v.get(i))?,
                Cells::Bool(v) => seq.serialize_element(&v.get(i))?,
                Cells::Owned(v) => seq.serialize_element(&v.get(i))?,
                Cells::OptOwned(v) => seq.serialize_element(&v.get(i).and_then(Option::as_ref))?,
            }
        }
        seq.end()
    }
}

/// Bytes as lowercase hex, for a batch's JSON.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `stmt` as a query: its SQL with `{rows}` as `jsonb_each` of one JSON
/// parameter, and every parameter bound.
fn query(stmt: Stmt) -> PortResult<Query<'static, Sqlite, SqliteArguments>> {
    let sql = stmt.render(|rows, first| {
        let cells: Vec<String> = rows
            .names
            .iter()
            .zip(&rows.cols)
            .enumerate()
            .map(|(i, (n, c))| match c {
                Col::Bytes(_) | Col::OptBytes(_) => format!("unhex(value ->> {i}) AS \"{n}\""),
                _ => format!("value ->> {i} AS \"{n}\""),
            })
            .collect();
        // `jsonb_each`: each row's array comes as JSONB, which `->>` reads
        // as it is; `json_each` gave it as text, which every row's `->>`
        // then parsed again (a fifth of a call's instructions in the
        // embedded fold, session 33).
        format!("(SELECT {} FROM jsonb_each(${first}))", cells.join(", "))
    });
    let mut q = sqlx::query(AssertSqlSafe(sql));
    for a in stmt.args {
        q = match a {
            Arg::Text(v) => q.bind(v),
            Arg::OptText(v) => q.bind(v),
            Arg::Int(v) => q.bind(v),
            Arg::Bool(v) => q.bind(v),
            Arg::Time(v) => q.bind(ts(v)?),
            Arg::OptTime(v) => q.bind(v.map(ts).transpose()?),
            Arg::OptInt(v) => q.bind(v),
            Arg::Json(v) => q.bind(v.to_string()),
            Arg::OptJson(v) => q.bind(v.map(|v| v.to_string())),
        };
    }
    if let Some(rows) = &stmt.rows {
        q = q.bind(json_rows(rows)?);
    }
    Ok(q)
}

impl Backend for Sqlite {
    const SPAN_DB: &'static str = "sqlite";
    // BEGIN IMMEDIATE already holds the file's write lock.
    const LOCK_PROJECT: &'static str = "";
    // A read transaction of a WAL file reads one snapshot from its first read.
    const SNAPSHOT_BEGIN: &'static str = "BEGIN DEFERRED";
    const BYTEWISE: &'static str = "";
    const LOCK_ROWS: &'static str = "";
    const LOCK_PRICE_BOOK: Option<&'static str> = None;
    const LIST_TABLES: &'static str = "SELECT name FROM sqlite_master WHERE type = 'table'";

    fn transient(code: &str) -> bool {
        code.parse::<i32>()
            .is_ok_and(|c| matches!(c & 0xff, SQLITE_BUSY | SQLITE_LOCKED | SQLITE_NOMEM | SQLITE_IOERR | SQLITE_FULL))
    }

    fn begin(pool: &Pool<Sqlite>) -> impl Future<Output = Result<Transaction<'static, Sqlite>, sqlx::Error>> + Send {
        pool.begin_with("BEGIN IMMEDIATE")
    }

    fn write_gate(pool: &Pool<Sqlite>) -> Option<WriteGate> {
        Some(write_gate(pool))
    }

    fn begin_snapshot(
        pool: &Pool<Sqlite>,
    ) -> impl Future<Output = Result<Transaction<'static, Sqlite>, sqlx::Error>> + Send {
        // A deferred transaction reads one snapshot from its first read on
        // (WAL), or holds the shared lock that keeps writers out.
        pool.begin_with("BEGIN")
    }

    async fn migrate(pool: &Pool<Sqlite>) -> Result<(), MigrateError> {
        sqlx::migrate!("../migrations/sqlite").run(pool).await
    }

    fn fetch<'c>(
        conn: &'c mut SqliteConnection,
        stmt: Stmt,
    ) -> impl Future<Output = PortResult<Vec<SqliteRow>>> + Send + 'c {
        let q = query(stmt);
        async move { q?.fetch_all(conn).await.map_err(error::<Sqlite>) }
    }

    fn execute<'c>(conn: &'c mut SqliteConnection, stmt: Stmt) -> impl Future<Output = PortResult<u64>> + Send + 'c {
        let q = query(stmt);
        async move { Ok(q?.execute(conn).await.map_err(error::<Sqlite>)?.rows_affected()) }
    }

    fn opt_time(row: &SqliteRow, column: &str) -> PortResult<Option<DateTime<Utc>>> {
        let s: Option<String> = row.try_get(column).map_err(error::<Sqlite>)?;
        s.map(|s| DateTime::parse_from_rfc3339(&s).map(|d| d.with_timezone(&Utc)).map_err(|_| corrupt(column, &s)))
            .transpose()
    }

    fn opt_json<T: DeserializeOwned>(row: &SqliteRow, column: &str) -> PortResult<Option<T>> {
        let s: Option<String> = row.try_get(column).map_err(error::<Sqlite>)?;
        s.map(|s| serde_json::from_str(&s).map_err(|_| corrupt(column, &s))).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_written_row_by_row_with_every_kind_of_cell() {
        let at = DateTime::parse_from_rfc3339("2026-12-05T18:30:00.1234567Z").expect("instant").with_timezone(&Utc);
        let rows = Rows::new()
            .text("t", ["a\"b", "c"])
            .int("i", [-1, i64::MAX])
            .flag("f", [true, false])
            .time("at", [at, at])
            .opt_time("maybe", [None, Some(at)])
            .bytes("b", [vec![0, 255], vec![]])
            .opt_bytes("ob", [Some(vec![16]), None]);
        assert_eq!(
            json_rows(&rows).expect("batch"),
            r#"[["a\"b",-1,true,"2026-12-05T18:30:00.123456Z",null,"00ff","10"],["c",9223372036854775807,false,"2026-12-05T18:30:00.123456Z","2026-12-05T18:30:00.123456Z","",null]]"#
        );
        assert_eq!(json_rows(&Rows::new()).expect("no columns"), "[]");
        let ragged = Rows::new().text("t", ["a", "b"]).int("i", [1]);
        let err = json_rows(&ragged).expect_err("a column short of a row");
        assert!(err.to_string().contains("column i"), "{err}");
    }

    #[test]
    fn an_instant_is_stored_as_the_strftime_pattern_wrote_it() {
        let pattern = "%Y-%m-%dT%H:%M:%S%.6fZ";
        for (secs, nanos) in
            [(0, 0), (1_796_000_000, 999_999_999), (1_796_000_000, 1_000), (-62_167_219_200, 5), (253_402_300_799, 1)]
        {
            let at = DateTime::from_timestamp(secs, nanos).expect("instant");
            assert_eq!(ts(at).expect("in range"), at.format(pattern).to_string(), "{secs} s {nanos} ns");
        }
        let leap = DateTime::from_timestamp(1_483_228_799, 1_500_000_000).expect("a leap second");
        assert_eq!(ts(leap).expect("in range"), leap.format(pattern).to_string());
        let past = DateTime::from_timestamp(253_402_300_800, 0).expect("year 10000");
        assert!(ts(past).is_err());
    }
}
