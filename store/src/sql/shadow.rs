//! The shadow of a replay: a second copy of the fold's tables that
//! `tollgate replay` rebuilds from offset 0 next to the live ones (a schema
//! of the same PostgreSQL database, or a second SQLite file), then compares
//! with them row by row, and may swap in.
//!
//! - **What the fold writes** is listed once, in [`FOLD_TABLES`]: the
//!   durable totals, the breakdown by model, the unpriced rows, the storage
//!   facts, the dedup set (with what each event counts now, which
//!   corrections amend), the dead letters, the offsets and the newest
//!   receipt. Those are compared and swapped; columns that are delivery
//!   bookkeeping (a dead letter's mark, claim and whether it was published)
//!   are neither compared nor swapped.
//! - **What the fold reads** and does not write — projects (their time
//!   zones) and the append-only price book with every recorded version — is
//!   copied from the live store into the shadow
//!   ([`SqlStore::copy_fold_inputs`]) before each stretch the replay folds, after
//!   reading where that stretch ends: every record before that end was on
//!   the log, so received, before the copy, and a price recorded after the
//!   copy is newer than its receipt (the fold would not use it anyway).
//! - **The audit log** ([`AUDIT_TABLES`]) is the audit folder's, not the
//!   fold's: a replay rebuilds it from the audit topic and compares it, but
//!   never swaps it. The shadow's fold writes the entries it makes
//!   (corrections, monitor breaches) to the shadow's audit outbox, which
//!   nothing relays: a replay publishes nothing.
//! - **A consistent cut of the live side**: [`SqlStore::snapshot`] opens a
//!   read-only snapshot (PostgreSQL `REPEATABLE READ`, a SQLite read
//!   transaction) in which the live offsets and every live table are read
//!   as of one instant, while the live projector goes on; the replay folds
//!   the shadow to exactly those offsets before it compares.
//! - **The dedup set is compared as a purge leaves it**: ids that occurred
//!   before the purge cutoff of the newest receipt folded may or may not
//!   still be there on either side (purges run by the clock), so only those
//!   at or after it are compared.
//! - **Swapping** ([`SqlStore::swap_in_pg`], [`SqlStore::swap_in_sqlite`]) copies the shadow's rows
//!   over the live ones in one transaction that first holds the live
//!   offsets still (PostgreSQL `FOR UPDATE` on their rows, which the live
//!   projector's fence must update; SQLite's write lock) and checks that
//!   the shadow stands at the same offsets. Copying, not renaming schemas:
//!   running gateways and projectors hold prepared statements bound to the
//!   live tables, and a rename would leave them writing into the tables
//!   swapped out. A dead letter both sides hold keeps its live delivery
//!   state (it is not published again); one only the shadow holds is
//!   pending, so the live projector publishes it once.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use chrono::{DateTime, Utc};
use meter::{PortError, PortResult};
use sqlx::Transaction;

use super::prices::PRICE_COLUMNS;
use super::{Backend, Rec, Rows, SqlStore, Stmt, corrupt, each, error};

/// The type of a compared column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    Text,
    OptText,
    /// A JSON document, compared as the database prints it.
    Json,
    Int,
    Bool,
    Time,
    OptTime,
    Bytes,
    OptBytes,
}

/// Which rows of a table belong to the replayed fold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every row (the table is the fold's alone).
    All,
    /// The rows of the replayed consumer and topic.
    Consumer,
    /// The dedup set's rows at or after the purge cutoff.
    Since,
}

/// A table the fold writes: its key columns and its compared value columns.
#[derive(Debug)]
pub struct FoldTable {
    pub name: &'static str,
    pub key: &'static [(&'static str, Ty)],
    pub values: &'static [(&'static str, Ty)],
    pub scope: Scope,
}

use Ty::*;

const TOTALS: &[(&str, Ty)] = &[
    ("resets_at", OptTime),
    ("requests", Int),
    ("calls", Int),
    ("rows", Int),
    ("tokens", Int),
    ("cost_llm_tokens", Int),
    ("cost_compute_execution", Int),
    ("cost_api_request", Int),
    ("cost_storage", Int),
    ("llm_events", Int),
    ("llm_priced", Int),
    ("llm_unpriced", Int),
    ("storage_events", Int),
    ("storage", Int),
];

/// Every table the fold writes, compared and swapped by a replay. A
/// migration that adds one adds it here.
pub const FOLD_TABLES: &[FoldTable] = &[
    FoldTable {
        name: "usage_aggregates",
        key: &[("project_id", Text), ("dimension", Text), ("window_kind", Text), ("window_key", Text)],
        values: TOTALS,
        scope: Scope::All,
    },
    FoldTable {
        name: "model_usage",
        key: &[
            ("project_id", Text),
            ("dimension", Text),
            ("window_kind", Text),
            ("window_key", Text),
            ("provider", Text),
            ("model", Text),
            ("component", Text),
            ("meter_type", Text),
            ("embedding", Bool),
        ],
        values: &[("priced_quantity", Int), ("unpriced_quantity", Int), ("cost_picos", Int)],
        scope: Scope::All,
    },
    FoldTable {
        name: "unpriced_rows",
        key: &[
            ("project_id", Text),
            ("dimension", Text),
            ("window_kind", Text),
            ("window_key", Text),
            ("provider", Text),
            ("model", Text),
            ("component", Text),
        ],
        values: &[("resets_at", OptTime)],
        scope: Scope::All,
    },
    FoldTable {
        name: "storage_facts",
        key: &[("project_id", Text), ("event_id", Text)],
        values: &[("kind", Text), ("occurred_at", Time), ("bytes", Int)],
        scope: Scope::All,
    },
    FoldTable {
        name: "processed_events",
        key: &[("project_id", Text), ("event_id", Text)],
        // What each call and tokens event counts now (migration 0008): what
        // a later correction of it reads.
        values: &[("occurred_at", Time), ("counted", Text)],
        scope: Scope::Since,
    },
    FoldTable {
        name: "dead_letters",
        key: &[("consumer", Text), ("topic", Text), ("partition", Int), ("offset", Int)],
        values: &[("key", OptBytes), ("payload", Bytes), ("reason", Text)],
        scope: Scope::Consumer,
    },
    FoldTable {
        name: "consumer_offsets",
        key: &[("consumer", Text), ("topic", Text), ("partition", Int)],
        values: &[("next_offset", Int)],
        scope: Scope::Consumer,
    },
    FoldTable {
        name: "fold_receipts",
        key: &[("consumer", Text), ("topic", Text)],
        values: &[("newest_receipt", Time)],
        scope: Scope::Consumer,
    },
];

/// The audit log, which the audit folder writes from the audit topic: a
/// replay rebuilds it in the shadow from that topic, to the live audit
/// folder's offsets, and compares it. It is never swapped: the live folder
/// already wrote every entry the topic holds, idempotently, and a swap
/// would have to hold the audit folder's offsets too.
pub const AUDIT_TABLES: &[FoldTable] = &[FoldTable {
    name: "audit_log",
    key: &[("id", Text)],
    values: &[
        // Null for an installation-wide entry (a write of prices).
        ("project_id", OptText),
        ("action", Text),
        ("principal_type", OptText),
        ("principal_id", OptText),
        ("resource", Text),
        ("detail", Json),
        ("once_key", OptText),
        ("created_at", Time),
    ],
    scope: Scope::All,
}];

/// Tables the fold reads and never writes, copied into the shadow.
pub const INPUT_TABLES: &[&str] = &["projects", "prices", "quotas"];

/// The notification outbox and its delivery state. The shadow's fold
/// enqueues into the shadow's outbox, which has no endpoints, so a replay
/// sends nothing; the replay compares the two sets of dedup keys
/// ([`Snapshot::notification_keys`]) and reports them, never as a
/// difference of the aggregates (which notifications a fold makes depends on
/// the quotas as they stood when it ran, which are not on the log). A swap
/// leaves the live outbox as it is: every notification the live fold made
/// keeps its dedup key and delivery state, so the live fold after the swap
/// enqueues none of them again, and nothing only the shadow made is sent.
pub const NOTIFICATION_TABLES: &[&str] =
    &["notification_messages", "webhook_endpoints", "webhook_deliveries", "webhook_attempts"];

/// The dedup keys of the quota notifications a store holds (test messages
/// have none).
fn notification_keys_stmt() -> Stmt {
    Stmt::new("SELECT dedup_key FROM notification_messages WHERE dedup_key IS NOT NULL")
}

fn keys<B: Backend>(rows: &[B::Row]) -> PortResult<BTreeSet<String>> {
    Ok(each(rows, |r: &Rec<'_, B>| r.text("dedup_key"))?.into_iter().collect())
}

/// The audit tables are read whole: no consumer or cutoff applies.
fn audit_cut() -> Cut {
    Cut { consumer: String::new(), topic: String::new(), processed_since: DateTime::<Utc>::UNIX_EPOCH }
}

/// One compared value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cell {
    Null,
    Text(String),
    Int(i64),
    Bool(bool),
    Time(DateTime<Utc>),
    Bytes(Vec<u8>),
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cell::Null => f.write_str("NULL"),
            Cell::Text(s) => write!(f, "{s:?}"),
            Cell::Int(i) => write!(f, "{i}"),
            Cell::Bool(b) => write!(f, "{b}"),
            Cell::Time(t) => write!(f, "{}", t.format("%Y-%m-%dT%H:%M:%S%.6fZ")),
            Cell::Bytes(b) if b.len() > 24 => write!(f, "{} bytes {}…", b.len(), hex(&b[..24])),
            Cell::Bytes(b) => write!(f, "{}", hex(b)),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The rows of one table: key → values.
pub type TableRows = BTreeMap<Vec<Cell>, Vec<Cell>>;

/// Every fold table of one side, as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FoldState {
    pub tables: BTreeMap<&'static str, TableRows>,
}

impl FoldState {
    /// Rows in all tables.
    pub fn rows(&self) -> usize {
        self.tables.values().map(BTreeMap::len).sum()
    }
}

/// What a replay compares: which consumer and topic, and the dedup set's cutoff.
#[derive(Debug, Clone)]
pub struct Cut {
    pub consumer: String,
    pub topic: String,
    /// Dedup ids that occurred before this are not compared.
    pub processed_since: DateTime<Utc>,
}

/// One row that differs between the live tables and the shadow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub table: &'static str,
    /// `column=value` of the key.
    pub key: String,
    pub what: Diff,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Diff {
    /// Only the live tables hold the row (its values).
    OnlyLive(String),
    /// Only the shadow holds it.
    OnlyShadow(String),
    /// Both do, with these columns apart: (column, live, shadow).
    Values(Vec<(&'static str, String, String)>),
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.what {
            Diff::OnlyLive(v) => write!(f, "{} [{}]: only live ({v})", self.table, self.key),
            Diff::OnlyShadow(v) => write!(f, "{} [{}]: only in the shadow ({v})", self.table, self.key),
            Diff::Values(cols) => {
                let cols: Vec<String> = cols.iter().map(|(c, l, s)| format!("{c}: live {l}, shadow {s}")).collect();
                write!(f, "{} [{}]: {}", self.table, self.key, cols.join("; "))
            }
        }
    }
}

fn render(cols: &[(&str, Ty)], cells: &[Cell]) -> String {
    cols.iter().zip(cells).map(|((c, _), v)| format!("{c}={v}")).collect::<Vec<_>>().join(", ")
}

/// Row by row, every difference between the live state and the shadow's.
pub fn diff(live: &FoldState, shadow: &FoldState) -> Vec<Difference> {
    diff_in(FOLD_TABLES, live, shadow)
}

/// [`diff`] over the given tables ([`FOLD_TABLES`], [`AUDIT_TABLES`]).
pub fn diff_in(tables: &'static [FoldTable], live: &FoldState, shadow: &FoldState) -> Vec<Difference> {
    let empty = TableRows::new();
    let mut out = Vec::new();
    for t in tables {
        let l = live.tables.get(t.name).unwrap_or(&empty);
        let s = shadow.tables.get(t.name).unwrap_or(&empty);
        let keys: BTreeSet<&Vec<Cell>> = l.keys().chain(s.keys()).collect();
        for k in keys {
            let what = match (l.get(k), s.get(k)) {
                (Some(lv), None) => Diff::OnlyLive(render(t.values, lv)),
                (None, Some(sv)) => Diff::OnlyShadow(render(t.values, sv)),
                (Some(lv), Some(sv)) if lv != sv => Diff::Values(
                    t.values
                        .iter()
                        .zip(lv.iter().zip(sv))
                        .filter(|(_, (a, b))| a != b)
                        .map(|((c, _), (a, b))| (*c, a.to_string(), b.to_string()))
                        .collect(),
                ),
                _ => continue,
            };
            out.push(Difference { table: t.name, key: render(t.key, k), what });
        }
    }
    out
}

/// The SELECT of a fold table's compared columns, in scope.
fn select(t: &FoldTable, cut: &Cut) -> Stmt {
    let cols: Vec<String> = t
        .key
        .iter()
        .chain(t.values)
        .map(|(c, ty)| match ty {
            Int => format!("CAST(\"{c}\" AS BIGINT) AS \"{c}\""),
            Json => format!("CAST(\"{c}\" AS TEXT) AS \"{c}\""),
            _ => format!("\"{c}\""),
        })
        .collect();
    let sql = format!("SELECT {} FROM {}", cols.join(", "), t.name);
    match t.scope {
        Scope::All => Stmt::new(sql),
        Scope::Consumer => {
            Stmt::new(format!("{sql} WHERE consumer = $1 AND topic = $2")).text(&cut.consumer).text(&cut.topic)
        }
        Scope::Since => Stmt::new(format!("{sql} WHERE occurred_at >= $1")).time(cut.processed_since),
    }
}

fn cell<B: Backend>(r: &Rec<'_, B>, column: &str, ty: Ty) -> PortResult<Cell> {
    Ok(match ty {
        Text | Json => Cell::Text(r.text(column)?),
        OptText => r.get::<Option<String>>(column)?.map_or(Cell::Null, Cell::Text),
        Int => Cell::Int(r.int(column)?),
        Bool => Cell::Bool(r.get(column)?),
        Time => Cell::Time(r.time(column)?),
        OptTime => r.opt_time(column)?.map_or(Cell::Null, Cell::Time),
        Bytes => Cell::Bytes(r.get(column)?),
        OptBytes => r.get::<Option<Vec<u8>>>(column)?.map_or(Cell::Null, Cell::Bytes),
    })
}

async fn read_state<B: Backend>(c: &mut B::Connection, cut: &Cut) -> PortResult<FoldState> {
    read_tables::<B>(c, FOLD_TABLES, cut).await
}

async fn read_tables<B: Backend>(
    c: &mut B::Connection,
    tables: &'static [FoldTable],
    cut: &Cut,
) -> PortResult<FoldState> {
    let mut state = FoldState::default();
    for t in tables {
        let rows = B::fetch(&mut *c, select(t, cut)).await?;
        let decoded = each(&rows, |r: &Rec<'_, B>| {
            let key = t.key.iter().map(|(c, ty)| cell(r, c, *ty)).collect::<PortResult<Vec<_>>>()?;
            let values = t.values.iter().map(|(c, ty)| cell(r, c, *ty)).collect::<PortResult<Vec<_>>>()?;
            Ok((key, values))
        })?;
        state.tables.insert(t.name, decoded.into_iter().collect());
    }
    Ok(state)
}

async fn read_offsets<B: Backend>(
    c: &mut B::Connection,
    consumer: &str,
    topic: &str,
) -> PortResult<BTreeMap<i32, i64>> {
    let stmt = Stmt::new(format!(
        r#"SELECT CAST("partition" AS BIGINT) AS "partition", next_offset FROM consumer_offsets
           WHERE consumer = $1 AND topic = $2{}"#,
        B::LOCK_ROWS
    ))
    .text(consumer)
    .text(topic);
    let rows = each(&B::fetch(c, stmt).await?, |r: &Rec<'_, B>| {
        let p = r.int("partition")?;
        Ok((i32::try_from(p).map_err(|_| corrupt("partition", &p.to_string()))?, r.int("next_offset")?))
    })?;
    Ok(rows.into_iter().collect())
}

async fn read_newest_receipt<B: Backend>(
    c: &mut B::Connection,
    consumer: &str,
    topic: &str,
) -> PortResult<Option<DateTime<Utc>>> {
    let stmt = Stmt::new("SELECT newest_receipt FROM fold_receipts WHERE consumer = $1 AND topic = $2")
        .text(consumer)
        .text(topic);
    match B::fetch(c, stmt).await?.first() {
        Some(row) => Ok(Some(Rec::<B>(row).time("newest_receipt")?)),
        None => Ok(None),
    }
}

/// A read-only snapshot of a store: everything read through it is as of
/// one instant, whatever commits meanwhile.
pub struct Snapshot<B: Backend> {
    tx: Transaction<'static, B>,
}

impl<B: Backend> Snapshot<B> {
    /// The consumer's offsets as of the snapshot.
    pub async fn offsets(&mut self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>> {
        let stmt = Stmt::new(
            r#"SELECT CAST("partition" AS BIGINT) AS "partition", next_offset FROM consumer_offsets
               WHERE consumer = $1 AND topic = $2"#,
        )
        .text(consumer)
        .text(topic);
        let rows = each(&B::fetch(&mut *self.tx, stmt).await?, |r: &Rec<'_, B>| {
            let p = r.int("partition")?;
            Ok((i32::try_from(p).map_err(|_| corrupt("partition", &p.to_string()))?, r.int("next_offset")?))
        })?;
        Ok(rows.into_iter().collect())
    }

    /// The newest receipt the consumer folded, as of the snapshot.
    pub async fn newest_receipt(&mut self, consumer: &str, topic: &str) -> PortResult<Option<DateTime<Utc>>> {
        read_newest_receipt::<B>(&mut self.tx, consumer, topic).await
    }

    /// Every fold table in scope, as of the snapshot.
    pub async fn fold_state(&mut self, cut: &Cut) -> PortResult<FoldState> {
        read_state::<B>(&mut self.tx, cut).await
    }

    /// The dedup keys of the quota notifications, as of the snapshot.
    pub async fn notification_keys(&mut self) -> PortResult<BTreeSet<String>> {
        keys::<B>(&B::fetch(&mut *self.tx, notification_keys_stmt()).await?)
    }

    /// The audit log ([`AUDIT_TABLES`]), as of the snapshot.
    pub async fn audit_state(&mut self) -> PortResult<FoldState> {
        read_tables::<B>(&mut self.tx, AUDIT_TABLES, &audit_cut()).await
    }

    /// Ends the snapshot.
    pub async fn close(self) -> PortResult<()> {
        self.tx.rollback().await.map_err(error::<B>)
    }
}

impl<B: Backend> SqlStore<B> {
    /// Opens a read-only snapshot of this store (see [`Snapshot`]).
    pub async fn snapshot(&self) -> PortResult<Snapshot<B>> {
        let tx = self.pool.begin_with(B::SNAPSHOT_BEGIN).await.map_err(error::<B>)?;
        Ok(Snapshot { tx })
    }

    /// Every fold table in scope, as it stands (read statement by statement:
    /// for a store nothing else writes, the shadow).
    pub async fn fold_state(&self, cut: &Cut) -> PortResult<FoldState> {
        read_state::<B>(&mut *self.conn().await?, cut).await
    }

    /// The dedup keys of the quota notifications this store holds.
    pub async fn notification_keys(&self) -> PortResult<BTreeSet<String>> {
        keys::<B>(&self.all(notification_keys_stmt()).await?)
    }

    /// The audit log ([`AUDIT_TABLES`]), as it stands.
    pub async fn audit_state(&self) -> PortResult<FoldState> {
        read_tables::<B>(&mut *self.conn().await?, AUDIT_TABLES, &audit_cut()).await
    }

    /// The newest receipt a consumer folded.
    pub async fn newest_receipt(&self, consumer: &str, topic: &str) -> PortResult<Option<DateTime<Utc>>> {
        read_newest_receipt::<B>(&mut *self.conn().await?, consumer, topic).await
    }

    /// Copies what the fold reads from `live` into this store (the shadow):
    /// every project (its time zone), every version of every price, and the
    /// quotas as they stand (what the fold's quota alerts judge by).
    /// Idempotent; rows copied before are brought up to date, quotas deleted
    /// live are deleted.
    pub async fn copy_fold_inputs(&self, live: &SqlStore<B>) -> PortResult<()> {
        let projects = live.all(Stmt::new("SELECT id, name, timezone, created_at FROM projects")).await?;
        let projects = each(&projects, |r: &Rec<'_, B>| {
            Ok((r.text("id")?, r.text("name")?, r.text("timezone")?, r.time("created_at")?))
        })?;
        let prices = live.all(Stmt::new(format!("SELECT {PRICE_COLUMNS} FROM prices"))).await?;
        let prices = each(&prices, |r: &Rec<'_, B>| {
            Ok((
                r.text("provider")?,
                r.text("model")?,
                r.text("component")?,
                r.time("effective_from")?,
                r.int("unit_price_picos")?,
                r.time("recorded_at")?,
            ))
        })?;
        let quotas = live.all(Stmt::new(format!("SELECT {} FROM quotas", super::config::QUOTA_COLUMNS))).await?;
        let quotas = each(&quotas, super::config::quota::<B>)?;
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        if !projects.is_empty() {
            let rows = Rows::new()
                .text("id", projects.iter().map(|p| p.0.as_str()))
                .text("name", projects.iter().map(|p| p.1.as_str()))
                .text("timezone", projects.iter().map(|p| p.2.as_str()))
                .time("created_at", projects.iter().map(|p| p.3));
            let stmt = Stmt::new(
                "INSERT INTO projects (id, name, timezone, created_at) SELECT * FROM {rows} AS t WHERE true \
                 ON CONFLICT (id) DO UPDATE SET name = excluded.name, timezone = excluded.timezone",
            )
            .rows(rows);
            B::execute(&mut *tx, stmt).await?;
        }
        if !prices.is_empty() {
            let rows = Rows::new()
                .text("provider", prices.iter().map(|p| p.0.as_str()))
                .text("model", prices.iter().map(|p| p.1.as_str()))
                .text("component", prices.iter().map(|p| p.2.as_str()))
                .time("effective_from", prices.iter().map(|p| p.3))
                .int("unit_price_picos", prices.iter().map(|p| p.4))
                .time("recorded_at", prices.iter().map(|p| p.5));
            let stmt = Stmt::new(format!(
                "INSERT INTO prices ({PRICE_COLUMNS}) SELECT * FROM {{rows}} AS t WHERE true \
                 ON CONFLICT (provider, model, component, effective_from, recorded_at) \
                 DO UPDATE SET unit_price_picos = excluded.unit_price_picos"
            ))
            .rows(rows);
            B::execute(&mut *tx, stmt).await?;
        }
        B::execute(&mut *tx, Stmt::new("DELETE FROM quotas")).await?;
        for q in &quotas {
            B::execute(&mut *tx, super::config::insert_quota(q)?).await?;
        }
        tx.commit().await.map_err(error::<B>)
    }

    /// The names of this store's tables that are neither fold tables nor
    /// inputs of the fold nor known configuration: a table a migration
    /// added that a replay does not compare (worth a warning).
    pub async fn uncompared_tables(&self) -> PortResult<Vec<String>> {
        let rows = self.all(Stmt::new(B::LIST_TABLES)).await?;
        let names = each(&rows, |r: &Rec<'_, B>| r.text("name"))?;
        Ok(names
            .into_iter()
            .filter(|n| {
                !FOLD_TABLES.iter().any(|t| t.name == n)
                    && !INPUT_TABLES.contains(&n.as_str())
                    && !CONFIG_TABLES.contains(&n.as_str())
                    && !NOTIFICATION_TABLES.contains(&n.as_str())
            })
            .collect())
    }
}

/// Tables of configuration, of the hot path and of billing exports (the
/// runs and what they wrote, `migrations/0015_exports.sql`, which export
/// runs write and the fold never does): not the fold's, never compared or
/// swapped.
const CONFIG_TABLES: &[&str] = &[
    "api_keys",
    "export_runs",
    "export_lines",
    "roles",
    "audit_log",
    "audit_outbox",
    "quota_exceptions",
    "_sqlx_migrations",
    "log_records",
    "log_dead_letters",
    "sqlite_sequence",
];

/// The statements that copy the shadow's fold tables (`shadow.t`) over the
/// live ones (`live.t`) for a consumer (`$1`) and topic (`$2`), offsets
/// aside (the swap checks they are equal). `live` and `shadow` are SQL
/// qualifiers (a schema, an attached database).
fn swap_statements(live: &str, shadow: &str, consumer: &str, topic: &str) -> Vec<Stmt> {
    let mut out = Vec::new();
    let scoped = |sql: String| Stmt::new(sql).text(consumer).text(topic);
    for t in FOLD_TABLES {
        let cols: Vec<String> = t.key.iter().chain(t.values).map(|(c, _)| format!("\"{c}\"")).collect();
        let cols = cols.join(", ");
        let keys: Vec<String> = t.key.iter().map(|(c, _)| format!("\"{c}\"")).collect();
        let keys = keys.join(", ");
        match t.name {
            "consumer_offsets" => {}
            "dead_letters" => {
                // Gone from the shadow: gone.
                out.push(scoped(format!(
                    "DELETE FROM {live}.dead_letters WHERE consumer = $1 AND topic = $2 AND ({keys}) NOT IN \
                     (SELECT {keys} FROM {shadow}.dead_letters WHERE consumer = $1 AND topic = $2)"
                )));
                // Held by both: the shadow's content, the live delivery state.
                out.push(scoped(format!(
                    "UPDATE {live}.dead_letters AS d SET key = s.key, payload = s.payload, reason = s.reason \
                     FROM {shadow}.dead_letters AS s WHERE s.consumer = $1 AND s.topic = $2 \
                     AND d.consumer = $1 AND d.topic = $2 \
                     AND d.\"partition\" = s.\"partition\" AND d.\"offset\" = s.\"offset\""
                )));
                // New: pending, so the live projector publishes it once.
                out.push(scoped(format!(
                    "INSERT INTO {live}.dead_letters ({cols}) SELECT {cols} FROM {shadow}.dead_letters \
                     WHERE consumer = $1 AND topic = $2 AND ({keys}) NOT IN \
                     (SELECT {keys} FROM {live}.dead_letters WHERE consumer = $1 AND topic = $2)"
                )));
            }
            _ if t.scope == Scope::Consumer => {
                out.push(scoped(format!("DELETE FROM {live}.{n} WHERE consumer = $1 AND topic = $2", n = t.name)));
                out.push(scoped(format!(
                    "INSERT INTO {live}.{n} ({cols}) SELECT {cols} FROM {shadow}.{n} \
                     WHERE consumer = $1 AND topic = $2",
                    n = t.name
                )));
            }
            _ => {
                out.push(Stmt::new(format!("DELETE FROM {live}.{n}", n = t.name)));
                out.push(Stmt::new(format!(
                    "INSERT INTO {live}.{n} ({cols}) SELECT {cols} FROM {shadow}.{n}",
                    n = t.name
                )));
            }
        }
    }
    out
}

/// Whether a swap happened, or why not yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Swap {
    /// The shadow's rows are live.
    Done,
    /// The live projector moved past the shadow before the lock was taken:
    /// fold the shadow to these offsets and try again.
    Moved(BTreeMap<i32, i64>),
}

/// Runs the swap on one connection of the live store whose session sees
/// the shadow as `shadow`: begins with `begin`, holds the live offsets,
/// compares them with `expected` (where the shadow stands), and copies.
async fn swap_on<B: Backend>(
    c: &mut B::Connection,
    begin: &'static str,
    live: &str,
    shadow: &str,
    consumer: &str,
    topic: &str,
    expected: &BTreeMap<i32, i64>,
) -> PortResult<Swap> {
    B::execute(&mut *c, Stmt::new(begin)).await?;
    let outcome = async {
        let now = read_offsets::<B>(&mut *c, consumer, topic).await?;
        if &now != expected {
            return Ok(Swap::Moved(now));
        }
        for stmt in swap_statements(live, shadow, consumer, topic) {
            B::execute(&mut *c, stmt).await?;
        }
        Ok(Swap::Done)
    }
    .await;
    let end = match outcome {
        Ok(Swap::Done) => "COMMIT",
        _ => "ROLLBACK",
    };
    B::execute(&mut *c, Stmt::new(end)).await?;
    outcome
}

#[cfg(feature = "postgres")]
impl SqlStore<sqlx::Postgres> {
    /// Connects to the database at `url` with `schema` first on the search
    /// path, creating the schema afresh (dropping one of that name) and
    /// running the migrations into it: the shadow of a replay.
    pub async fn create_shadow_schema(url: &str, schema: &str) -> PortResult<SqlStore<sqlx::Postgres>> {
        use sqlx::ConnectOptions;
        use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
        valid_schema(schema)?;
        let options: PgConnectOptions = url.parse().map_err(error::<sqlx::Postgres>)?;
        let mut admin = options.connect().await.map_err(error::<sqlx::Postgres>)?;
        // Never the live schema (or a system one): it is about to be dropped.
        let live: Option<String> = sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(&mut admin)
            .await
            .map_err(error::<sqlx::Postgres>)?;
        if live.as_deref() == Some(schema) || schema.starts_with("pg_") || schema == "information_schema" {
            return Err(PortError::Permanent(format!(
                "the shadow schema {schema:?} cannot be the live one or a system schema"
            )));
        }
        let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&mut admin).await.map_err(error::<sqlx::Postgres>)?;
        let create = format!("CREATE SCHEMA \"{schema}\"");
        sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&mut admin).await.map_err(error::<sqlx::Postgres>)?;
        let _ = sqlx::Connection::close(admin).await;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(options.options([("search_path", schema)]))
            .await
            .map_err(error::<sqlx::Postgres>)?;
        let store = SqlStore::from_pool(pool);
        store.migrate().await?;
        Ok(store)
    }

    /// Copies the shadow schema's fold tables over this store's (see the
    /// module doc), if the live offsets still stand at `expected`.
    pub async fn swap_in_pg(
        &self,
        shadow_schema: &str,
        consumer: &str,
        topic: &str,
        expected: &BTreeMap<i32, i64>,
    ) -> PortResult<Swap> {
        valid_schema(shadow_schema)?;
        let mut c = self.pool.acquire().await.map_err(error::<sqlx::Postgres>)?.detach();
        let live: String =
            sqlx::query_scalar("SELECT current_schema()").fetch_one(&mut c).await.map_err(error::<sqlx::Postgres>)?;
        valid_schema(&live)?;
        let (live, shadow) = (format!("\"{live}\""), format!("\"{shadow_schema}\""));
        swap_on::<sqlx::Postgres>(&mut c, "BEGIN", &live, &shadow, consumer, topic, expected).await
    }
}

/// A schema name Tollgate quotes into SQL: letters, digits and `_` only.
#[cfg(feature = "postgres")]
fn valid_schema(schema: &str) -> PortResult<()> {
    if schema.is_empty() || schema.len() > 63 || !schema.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(PortError::Permanent(format!(
            "schema name {schema:?} must be 1 to 63 letters, digits or underscores"
        )));
    }
    Ok(())
}

#[cfg(feature = "embedded")]
impl SqlStore<sqlx::Sqlite> {
    /// Creates the shadow file at `path` afresh (removing one there) and
    /// migrates it.
    pub async fn create_shadow_file(path: &std::path::Path) -> PortResult<SqlStore<sqlx::Sqlite>> {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = path.as_os_str().to_owned();
            p.push(suffix);
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(PortError::Permanent(format!("removing {}: {e}", path.display()))),
            }
        }
        let store = SqlStore::<sqlx::Sqlite>::open(path).await?;
        store.migrate().await?;
        Ok(store)
    }

    /// Copies the shadow file's fold tables over this store's (see the
    /// module doc), if the live offsets still stand at `expected`. The
    /// shadow is attached to one connection of the live file, whose write
    /// lock (`BEGIN IMMEDIATE`) holds the live projector still meanwhile.
    pub async fn swap_in_sqlite(
        &self,
        shadow: &std::path::Path,
        consumer: &str,
        topic: &str,
        expected: &BTreeMap<i32, i64>,
    ) -> PortResult<Swap> {
        let mut c = self.pool.acquire().await.map_err(error::<sqlx::Sqlite>)?.detach();
        let path = shadow.to_str().ok_or_else(|| PortError::Permanent(format!("{} is not UTF-8", shadow.display())))?;
        <sqlx::Sqlite as Backend>::execute(&mut c, Stmt::new("ATTACH DATABASE $1 AS shadow").text(path)).await?;
        let out = swap_on::<sqlx::Sqlite>(&mut c, "BEGIN IMMEDIATE", "main", "shadow", consumer, topic, expected).await;
        let _ = <sqlx::Sqlite as Backend>::execute(&mut c, Stmt::new("DETACH DATABASE shadow")).await;
        out
    }
}
