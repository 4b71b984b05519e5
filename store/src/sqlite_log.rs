//! The log in one local SQLite file, for `tollgate dev` (no broker).
//!
//! [`SqliteLog`] and [`SqliteLogReader`] are [`KafkaLog`](crate::KafkaLog)
//! and [`KafkaReader`](crate::KafkaReader) without a server, in tables of the
//! same file the embedded store uses, checked by the same conformance suite
//! (`store/tests/log_conformance.rs`).
//!
//! - Records are usage facts, Avro single-object encoded by
//!   [`schemas::encode_usage`], keyed by project id, in `log_records`. A topic
//!   has one partition, `0`, so its order is total (one project's facts are
//!   in order a fortiori).
//! - Offsets are the table's `AUTOINCREMENT` row ids: increasing within a
//!   topic, not contiguous (topics share the sequence), never reused. Every
//!   publish is one `BEGIN IMMEDIATE` transaction, and SQLite has one writer
//!   at a time, so ids are handed out in commit order: a reader never sees
//!   offset `n` and later a smaller one appear. Reading from a stored
//!   position `p` (last offset read + 1) therefore resumes exactly after the
//!   last record read, as with Kafka.
//! - [`Log::publish`] returns once its transaction has committed. Whether a
//!   commit survives a crash is the pool's business: open the file the way
//!   [`SqliteStore::open`](crate::SqliteStore::open) does (WAL journal,
//!   `synchronous = FULL`, a busy timeout), and a returned publish survives
//!   a `kill -9` of the process (and a power cut, as far as fsync holds).
//! - [`LogReader::poll`] waits for the first record without a broker to push
//!   it: a [`Notify`] shared by a log and the readers made by
//!   [`SqliteLog::reader`] wakes readers of the same process as soon as a
//!   publish commits; writers in other processes (or other [`SqliteLog`]
//!   values) are noticed by re-reading every [`POLL_INTERVAL`].
//! - Dead letters go to `log_dead_letters`: the original key and bytes, the
//!   reason, and the source topic, partition and offset, under the
//!   `<prefix>dlq` topic name.
//!
//! [`SqliteLog::ensure_schema`] creates the tables (`CREATE TABLE IF NOT
//! EXISTS`), so the log does not depend on the store's migrations.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use meter::{Log, LogReader, LogRecord, PortError, PortResult, UsageFact};
use sqlx::Row;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{Instrument, info_span};

/// How often a waiting reader re-reads the table, for writers it cannot hear.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The one partition of every topic.
const PARTITION: i32 = 0;

const SCHEMA: [&str; 3] = [
    r#"CREATE TABLE IF NOT EXISTS log_records (
        "offset"    INTEGER PRIMARY KEY AUTOINCREMENT,
        topic       TEXT    NOT NULL,
        "partition" INTEGER NOT NULL,
        key         BLOB,
        payload     BLOB    NOT NULL
    )"#,
    r#"CREATE INDEX IF NOT EXISTS log_records_by_position
        ON log_records (topic, "partition", "offset")"#,
    r#"CREATE TABLE IF NOT EXISTS log_dead_letters (
        id               INTEGER PRIMARY KEY AUTOINCREMENT,
        topic            TEXT    NOT NULL,
        source_topic     TEXT    NOT NULL,
        source_partition INTEGER NOT NULL,
        source_offset    INTEGER NOT NULL,
        key              BLOB,
        payload          BLOB    NOT NULL,
        reason           TEXT    NOT NULL,
        dead_lettered_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
    )"#,
];

/// Publishes usage facts into the SQLite file; cheap to clone.
#[derive(Debug, Clone)]
pub struct SqliteLog {
    pool: SqlitePool,
    topic: String,
    dlq_topic: String,
    published: Arc<Notify>,
}

impl SqliteLog {
    /// A log over `pool`, with topics `<topic_prefix>usage` and
    /// `<topic_prefix>dlq`. Call [`SqliteLog::ensure_schema`] before use.
    pub fn new(pool: SqlitePool, topic_prefix: &str) -> SqliteLog {
        SqliteLog {
            pool,
            topic: format!("{topic_prefix}usage"),
            dlq_topic: format!("{topic_prefix}dlq"),
            published: Arc::new(Notify::new()),
        }
    }

    /// Creates the log's tables if they are missing.
    pub async fn ensure_schema(&self) -> PortResult<()> {
        for statement in SCHEMA {
            sqlx::query(statement).execute(&self.pool).await.map_err(log_err)?;
        }
        Ok(())
    }

    /// A reader of the usage topic, woken by this log's publishes. Before any
    /// [`LogReader::seek`] it reads partition 0 from the start.
    pub fn reader(&self) -> SqliteLogReader {
        SqliteLogReader {
            pool: self.pool.clone(),
            topic: self.topic.clone(),
            dlq_topic: self.dlq_topic.clone(),
            published: Arc::clone(&self.published),
            positions: BTreeMap::from([(PARTITION, 0)]),
        }
    }

    pub fn usage_topic(&self) -> &str {
        &self.topic
    }

    pub fn dlq_topic(&self) -> &str {
        &self.dlq_topic
    }

    /// Publishes raw bytes under a key (tests use it to put malformed records on the log).
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) -> PortResult<()> {
        self.append(&[(key.as_bytes(), payload)]).await
    }

    /// Every dead letter of this log's DLQ topic, oldest first, as
    /// (original payload, reason).
    pub async fn dead_letters(&self) -> PortResult<Vec<(Vec<u8>, String)>> {
        let rows = sqlx::query("SELECT payload, reason FROM log_dead_letters WHERE topic = ?1 ORDER BY id")
            .bind(&self.dlq_topic)
            .fetch_all(&self.pool)
            .await
            .map_err(log_err)?;
        rows.iter()
            .map(|r| Ok((r.try_get("payload").map_err(log_err)?, r.try_get("reason").map_err(log_err)?)))
            .collect()
    }

    /// Appends records in one transaction, then wakes this process's readers.
    async fn append(&self, records: &[(&[u8], &[u8])]) -> PortResult<()> {
        if records.is_empty() {
            return Ok(());
        }
        let span = info_span!("datastore", op = "sqlite.publish", n = records.len());
        async {
            // IMMEDIATE takes the write lock up front: offsets are then
            // handed out in commit order (see the module doc).
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(log_err)?;
            for (key, payload) in records {
                sqlx::query(r#"INSERT INTO log_records (topic, "partition", key, payload) VALUES (?1, ?2, ?3, ?4)"#)
                    .bind(&self.topic)
                    .bind(PARTITION)
                    .bind(*key)
                    .bind(*payload)
                    .execute(&mut *tx)
                    .await
                    .map_err(log_err)?;
            }
            tx.commit().await.map_err(log_err)
        }
        .instrument(span)
        .await?;
        self.published.notify_waiters();
        Ok(())
    }
}

#[async_trait]
impl Log for SqliteLog {
    async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
        let mut encoded = Vec::with_capacity(facts.len());
        for f in facts {
            let bytes = schemas::encode_usage(f).map_err(|e| PortError::Permanent(e.to_string()))?;
            encoded.push((f.project_id.as_str().as_bytes(), bytes));
        }
        let records: Vec<(&[u8], &[u8])> = encoded.iter().map(|(k, p)| (*k, p.as_slice())).collect();
        self.append(&records).await
    }
}

/// Reads the usage topic from explicit offsets, and dead-letters what cannot be folded.
#[derive(Debug)]
pub struct SqliteLogReader {
    pool: SqlitePool,
    topic: String,
    dlq_topic: String,
    published: Arc<Notify>,
    /// The next offset to read, per partition.
    positions: BTreeMap<i32, i64>,
}

impl SqliteLogReader {
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Up to `max` records at or after the current positions, without waiting.
    async fn read(&self, max: usize) -> PortResult<Vec<LogRecord>> {
        let mut out = Vec::new();
        for (&partition, &from) in &self.positions {
            let left = max.saturating_sub(out.len());
            if left == 0 {
                break;
            }
            let rows = sqlx::query(
                r#"SELECT "offset", key, payload FROM log_records
                   WHERE topic = ?1 AND "partition" = ?2 AND "offset" >= ?3
                   ORDER BY "offset" LIMIT ?4"#,
            )
            .bind(&self.topic)
            .bind(partition)
            .bind(from)
            .bind(i64::try_from(left).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .instrument(info_span!("datastore", op = "sqlite.poll", partition))
            .await
            .map_err(log_err)?;
            for row in &rows {
                out.push(record_of(partition, row)?);
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl LogReader for SqliteLogReader {
    async fn partitions(&mut self) -> PortResult<Vec<i32>> {
        Ok(vec![PARTITION])
    }

    async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()> {
        self.positions = positions.clone();
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> PortResult<Vec<LogRecord>> {
        // Like Kafka's reader, a poll returns at least one record if any is there.
        let max = max.max(1);
        let deadline = Instant::now() + wait;
        loop {
            // Registered before the read, so a publish that commits between
            // the read and the wait still wakes us (`notify_waiters` reaches
            // every `Notified` created before it).
            let published = self.published.notified();
            let records = self.read(max).await?;
            if !records.is_empty() {
                for r in &records {
                    self.positions.insert(r.partition, r.offset + 1);
                }
                return Ok(records);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(records);
            }
            let nap = (deadline - now).min(POLL_INTERVAL);
            tokio::select! {
                _ = published => {}
                _ = tokio::time::sleep(nap) => {}
            }
        }
    }

    async fn dead_letter(&mut self, record: &LogRecord, reason: &str) -> PortResult<()> {
        sqlx::query(
            "INSERT INTO log_dead_letters
                 (topic, source_topic, source_partition, source_offset, key, payload, reason)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )
        .bind(&self.dlq_topic)
        .bind(&self.topic)
        .bind(record.partition)
        .bind(record.offset)
        .bind(record.key.as_deref())
        .bind(record.payload.as_slice())
        .bind(reason)
        .execute(&self.pool)
        .instrument(info_span!("datastore", op = "sqlite.dead_letter"))
        .await
        .map(|_| ())
        .map_err(log_err)
    }
}

fn record_of(partition: i32, row: &SqliteRow) -> PortResult<LogRecord> {
    Ok(LogRecord {
        partition,
        offset: row.try_get("offset").map_err(log_err)?,
        key: row.try_get("key").map_err(log_err)?,
        payload: row.try_get("payload").map_err(log_err)?,
    })
}

// Primary result codes (the low byte of an extended code) worth retrying.
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_NOMEM: i32 = 7;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;

/// Sorts a driver error into transient or permanent, once for this adapter.
fn log_err(e: sqlx::Error) -> PortError {
    match &e {
        sqlx::Error::Database(d) => {
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
