//! The log in one local SQLite file, for `tollgate dev` (no broker).
//!
//! [`SqliteLog`] and [`SqliteLogReader`] are [`KafkaLog`](crate::KafkaLog)
//! and [`KafkaReader`](crate::KafkaReader) without a server, in tables of a
//! SQLite file (`tollgate dev` keeps them in a file of their own beside the
//! store's, so the log's commits and the fold's do not take turns at one
//! write lock; any pool works, the store's too), checked by the same
//! conformance suite (`store/tests/log_conformance.rs`).
//!
//! - Records are usage facts, Avro single-object encoded by
//!   [`schemas::encode_usage`], keyed by project id, in `log_records`; the
//!   audit topic (`<prefix>audit`, [`AuditLog`]) is in the same table,
//!   entries encoded by [`schemas::encode_audit`], appended by a writer of
//!   its own. A topic
//!   has one partition, `0`, so its order is total (one project's facts are
//!   in order a fortiori).
//! - **Group commit.** One writer per log (shared by its clones, on a
//!   thread of its own, below) makes every append: [`Log::publish`] hands
//!   its encoded records to the writer over a channel and waits for the
//!   answer. The writer takes whatever is
//!   queued, whole publishes in arrival order, up to [`MAX_BATCH_RECORDS`]
//!   (a single larger publish is never split), inserts them in order in ONE
//!   `BEGIN IMMEDIATE` transaction, commits, then answers every publish of
//!   the batch.
//!   A batch is what queued while the previous one committed, so a lone
//!   publish costs one transaction as before, and a busy log pays one write
//!   lock and one fsync per batch instead of per publish (SQLite has one
//!   writer at a time, and a connection that finds the lock taken sleeps in
//!   the busy handler for 1, 2, 5, 10… ms between retries).
//! - **Linger under load.** After a batch of at least [`LOADED_BATCH`]
//!   publishes (many callers waiting at once), the writer waits [`LINGER`]
//!   once it has the next publish, then takes whatever queued meanwhile: a
//!   busy log commits fewer, larger batches, and so spends less of the
//!   machine per publish on commits, syncs and waking its readers. After a
//!   smaller batch (one caller at a time, or a few) it does not wait, so a
//!   publish that has the log to itself is not delayed; one that comes
//!   after a busy spell waits at most [`LINGER`] more.
//! - A publish's records are all in one transaction, so they are all on the
//!   log or none is, and contiguous: no other publish's record falls between
//!   them. If the transaction fails, **every** publish of the batch gets the
//!   error and nothing of the batch is visible; retrying is the publisher's
//!   business, as with Kafka. A publish dropped after handing its records
//!   over may still be committed (like a Kafka send already queued).
//! - Offsets are the table's `AUTOINCREMENT` row ids: increasing within a
//!   topic, not contiguous (topics share the sequence), never reused. Each
//!   batch is one `BEGIN IMMEDIATE` transaction, and SQLite has one writer
//!   at a time, so ids are handed out in commit order, also across several
//!   [`SqliteLog`] values or processes on one file: a reader never sees
//!   offset `n` and later a smaller one appear. Reading from a stored
//!   position `p` (last offset read + 1) therefore resumes exactly after the
//!   last record read, as with Kafka.
//! - [`Log::publish`] goes through the [`outbox`](crate::outbox), as
//!   [`KafkaLog`](crate::KafkaLog)'s does: it is acknowledged once the
//!   transaction holding its records has committed; when that fails
//!   transiently (the file is locked past the busy timeout, the disk is
//!   full, the writer is gone) or takes longer than the publish timeout, the
//!   publish answers `Transient` and the records stay queued and are appended
//!   again until they commit ([`Log::flush`] waits for them). A permanent
//!   failure is answered as such and not retried. Each attempt of a queued
//!   publish is a publish handed to the writer as below, so the
//!   all-or-nothing and contiguity rules hold per attempt.
//! - A publish returns once the transaction holding its records has
//!   committed. Whether a commit survives a crash is the pool's business:
//!   open the file the way [`SqliteStore::open`](crate::SqliteStore::open)
//!   does (WAL journal, `synchronous = FULL`, a busy timeout), and a returned
//!   publish survives a `kill -9` of the process (and a power cut, as far as
//!   fsync holds).
//! - The writer runs on a thread of its own (`tollgate-log`), started by
//!   the first publish, and ends when the last clone of the log is dropped.
//!   It writes through a connection of its own (rusqlite), opened on the
//!   pool's file with the pool's `synchronous` level and busy timeout, and
//!   makes a batch's transaction in place: through the pool, each of its
//!   statements was a round trip to sqlx's SQLite thread, and as a task of
//!   the runtime serving requests the writer also waited behind them for a
//!   worker at each one, while every call waits for its commit. A
//!   [`SqliteLogReader`] reads records through a connection of its own
//!   too, in place (through the pool, sqlx's thread handed every row over
//!   on its own): in WAL mode a read does not wait for the writer, and
//!   reads at most the `max` records asked for. Everything else (a
//!   project's tail, dead letters, the schema) goes through the pool. A
//!   publish works from any thread, inside a tokio runtime or not. If the writer is
//!   gone, a publish waiting on it gets [`PortError::Transient`] (its records
//!   may or may not have committed), and the next publish starts a new one.
//! - [`LogReader::poll`] waits for the first record without a broker to push
//!   it: a [`Notify`] per topic, shared by a log and the readers it made
//!   of that topic ([`SqliteLog::reader`], [`SqliteLog::audit_reader`]),
//!   wakes them as soon as a batch of that topic commits (a usage commit
//!   wakes no audit reader); writers in other processes (or other
//!   [`SqliteLog`] values) are noticed by re-reading every
//!   [`POLL_INTERVAL`].
//! - Every record carries its append time (`appended_at`, set by the
//!   writer, one for each transaction, to the millisecond, like a broker's
//!   log-append timestamp of a batch): the [`LogRecord::timestamp`] the
//!   projector takes as the receipt of a fact the gateway did not stamp. Records of a file written
//!   before the column existed have none.
//! - Dead letters go to `log_dead_letters`: the original key and bytes, the
//!   reason, and the source topic, partition and offset, under the
//!   `<prefix>dlq` topic name, **at most once per source record**: the
//!   insert is skipped if a letter of the same source is there (one
//!   statement, and SQLite has one writer at a time). The topic's mark is
//!   the next letter id ([`LogReader::dead_letter_mark`]).
//!
//! [`SqliteLog::ensure_schema`] creates the tables (`CREATE TABLE IF NOT
//! EXISTS`), so the log does not depend on the store's migrations.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use meter::{
    AuditEntry, AuditLog, DlqMark, Log, LogReader, LogRecord, LogTail, PortError, PortResult, ProjectId, UsageFact,
};
use sqlx::Row;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tracing::{Instrument, info_span};

use crate::outbox::{OutRecord, Outbox, PublishOptions, Transport};

/// How often a waiting reader re-reads the table, for writers it cannot hear.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The writer stops adding publishes to a batch once it holds this many
/// records (a publish is never split, so one larger publish is a batch alone).
pub const MAX_BATCH_RECORDS: usize = 5_000;

/// How long the writer waits for more publishes after a batch of at least
/// [`LOADED_BATCH`] publishes (see "Linger under load" above).
pub const LINGER: Duration = Duration::from_micros(300);

/// A batch of this many publishes or more means the log is busy: the next
/// batch lingers.
pub const LOADED_BATCH: usize = 4;

/// How long the writer lingers before taking its next batch, after one of
/// `last` publishes.
fn linger_after(last: usize) -> Option<Duration> {
    (last >= LOADED_BATCH).then_some(LINGER)
}

/// Publishes waiting for the writer before `publish` itself waits for room.
const QUEUE_DEPTH: usize = 4_096;

/// The writer's one statement, prepared once per connection: `?1` is the
/// topic, `?2` the partition, `?5` the append time, one for the whole
/// transaction (as a Kafka batch has one log-append time), written as the
/// column's default writes it: the default's `strftime` per row was a
/// twelfth of the writer's time.
const INSERT: &str =
    r#"INSERT INTO log_records (topic, "partition", key, payload, appended_at) VALUES (?1, ?2, ?3, ?4, ?5)"#;

/// [`INSERT`]'s append time: the system's clock, as SQLite's `'now'`, in
/// the column default's format (`%Y-%m-%dT%H:%M:%fZ`: RFC 3339 in UTC with
/// milliseconds, which compares as text).
fn append_stamp(at: chrono::DateTime<chrono::Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A partition's records from an offset on ([`read_records`]).
const READ: &str = r#"SELECT "offset", key, payload, appended_at FROM log_records
    WHERE topic = ?1 AND "partition" = ?2 AND "offset" >= ?3
    ORDER BY "offset""#;

/// The one partition of every topic.
const PARTITION: i32 = 0;
const SCHEMA: [&str; 4] = [
    r#"CREATE TABLE IF NOT EXISTS log_records (
        "offset"    INTEGER PRIMARY KEY AUTOINCREMENT,
        topic       TEXT    NOT NULL,
        "partition" INTEGER NOT NULL,
        key         BLOB,
        payload     BLOB    NOT NULL,
        appended_at TEXT    DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
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
    r#"CREATE INDEX IF NOT EXISTS log_dead_letters_by_source
        ON log_dead_letters (topic, source_topic, source_partition, source_offset)"#,
];

/// Publishes usage facts into the SQLite file; cheap to clone (clones share
/// one writer and one queue).
#[derive(Debug, Clone)]
pub struct SqliteLog {
    appender: Appender,
    /// Appends to the audit topic (its own writer; not queued).
    audit: Appender,
    dlq_topic: String,
    outbox: Outbox<Appender>,
}

/// What makes every append: the file, the topic, and the queue to the
/// writer once a publish has started it.
#[derive(Debug, Clone)]
struct Appender {
    pool: SqlitePool,
    topic: String,
    published: Arc<Notify>,
    writer: Arc<Mutex<Option<mpsc::Sender<Append>>>>,
}

/// One publish handed to the writer: its records (key, payload) in order,
/// and where to answer once their transaction has ended.
#[derive(Debug)]
struct Append {
    records: Vec<(Vec<u8>, Vec<u8>)>,
    done: oneshot::Sender<PortResult<()>>,
}

impl SqliteLog {
    /// A log over `pool`, with topics `<topic_prefix>usage` and
    /// `<topic_prefix>dlq` and the default [`PublishOptions`]. Call
    /// [`SqliteLog::ensure_schema`] before use. Needs no runtime: the writer
    /// starts with the first publish.
    pub fn new(pool: SqlitePool, topic_prefix: &str) -> SqliteLog {
        SqliteLog::with_options(pool, topic_prefix, PublishOptions::default())
    }

    /// [`SqliteLog::new`] with how publishes wait and queue.
    pub fn with_options(pool: SqlitePool, topic_prefix: &str, options: PublishOptions) -> SqliteLog {
        let appender = Appender {
            pool: pool.clone(),
            topic: format!("{topic_prefix}usage"),
            published: Arc::new(Notify::new()),
            writer: Arc::new(Mutex::new(None)),
        };
        // A notify of its own: a usage commit (one per group commit, under
        // load thousands a second) does not wake the audit folder to read
        // an audit topic nothing was appended to.
        let audit = Appender {
            pool,
            topic: format!("{topic_prefix}audit"),
            published: Arc::new(Notify::new()),
            writer: Arc::new(Mutex::new(None)),
        };
        SqliteLog {
            outbox: Outbox::new(appender.clone(), options),
            appender,
            audit,
            dlq_topic: format!("{topic_prefix}dlq"),
        }
    }

    /// Creates the log's tables if they are missing, and adds the append
    /// time to a table made before it existed (SQLite cannot add a column
    /// with a computed default, so records appended to such a file later
    /// have none either; their receipt is `received_at`, which every
    /// gateway stamps).
    pub async fn ensure_schema(&self) -> PortResult<()> {
        for statement in SCHEMA {
            sqlx::query(statement).execute(&self.appender.pool).await.map_err(log_err)?;
        }
        let columns: Vec<String> = sqlx::query_scalar("SELECT name FROM pragma_table_info('log_records')")
            .fetch_all(&self.appender.pool)
            .await
            .map_err(log_err)?;
        if !columns.iter().any(|c| c == "appended_at") {
            sqlx::query("ALTER TABLE log_records ADD COLUMN appended_at TEXT")
                .execute(&self.appender.pool)
                .await
                .map_err(log_err)?;
        }
        Ok(())
    }

    /// Moves the log of the SQLite file at `old` into this log's file (a
    /// store file from before the embedded log had a file of its own): its
    /// records and dead letters, **offsets and ids kept**, so the positions
    /// a projector stored against them still name the same records. Returns
    /// the records moved; a file without the log's tables moves nothing.
    ///
    /// Two steps, each one transaction on one file: the copy into this file
    /// (only what is past this file's last offset and letter id, so a second
    /// run after a crash between the steps copies nothing twice), then the
    /// drop of the old tables. Call it after [`SqliteLog::ensure_schema`],
    /// before anything publishes to this log.
    pub async fn take_over(&self, old: &std::path::Path) -> PortResult<u64> {
        let mut conn = self.appender.pool.acquire().await.map_err(log_err)?;
        let path = old.to_str().ok_or_else(|| PortError::Permanent(format!("{} is not UTF-8", old.display())))?;
        sqlx::query("ATTACH DATABASE ?1 AS prior").bind(path).execute(&mut *conn).await.map_err(log_err)?;
        let moved = take_over_attached(&mut conn).await;
        let detached = sqlx::query("DETACH DATABASE prior").execute(&mut *conn).await.map_err(log_err);
        let moved = moved?;
        detached?;
        Ok(moved)
    }

    /// A reader of the usage topic, woken by this log's publishes. Before any
    /// [`LogReader::seek`] it reads partition 0 from the start.
    pub fn reader(&self) -> SqliteLogReader {
        SqliteLogReader {
            pool: self.appender.pool.clone(),
            topic: self.appender.topic.clone(),
            dlq_topic: self.dlq_topic.clone(),
            published: Arc::clone(&self.appender.published),
            positions: BTreeMap::from([(PARTITION, 0)]),
            conn: Mutex::new(None),
            reads: 0,
        }
    }

    pub fn usage_topic(&self) -> &str {
        &self.appender.topic
    }

    /// A reader of the audit topic (the audit folder's), woken by this
    /// log's audit publishes; its dead letters go to the same DLQ topic,
    /// naming the audit topic as their source.
    pub fn audit_reader(&self) -> SqliteLogReader {
        SqliteLogReader {
            topic: self.audit.topic.clone(),
            published: Arc::clone(&self.audit.published),
            ..self.reader()
        }
    }

    pub fn audit_topic(&self) -> &str {
        &self.audit.topic
    }

    pub fn dlq_topic(&self) -> &str {
        &self.dlq_topic
    }

    /// Records queued and not yet committed.
    pub fn queued(&self) -> usize {
        self.outbox.queued()
    }

    /// Publishes raw bytes under a key (tests use it to put malformed
    /// records on the log); not queued: one attempt, waited for.
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) -> PortResult<()> {
        self.appender.append(vec![(key.as_bytes().to_vec(), payload.to_vec())]).await
    }

    /// Every dead letter of this log's DLQ topic, oldest first, as
    /// (original payload, reason).
    pub async fn dead_letters(&self) -> PortResult<Vec<(Vec<u8>, String)>> {
        let rows = sqlx::query("SELECT payload, reason FROM log_dead_letters WHERE topic = ?1 ORDER BY id")
            .bind(&self.dlq_topic)
            .fetch_all(&self.appender.pool)
            .await
            .map_err(log_err)?;
        rows.iter()
            .map(|r| Ok((r.try_get("payload").map_err(log_err)?, r.try_get("reason").map_err(log_err)?)))
            .collect()
    }
}

impl Appender {
    /// Appends `records` (one publish) through the writer and waits until
    /// the transaction holding them has committed or failed.
    async fn append(&self, records: Vec<(Vec<u8>, Vec<u8>)>) -> PortResult<()> {
        if records.is_empty() {
            return Ok(());
        }
        submit(&self.queue()?, records).await
    }

    /// The queue to a running writer, starting one on a thread of its own if
    /// there is none yet or the last one is gone.
    fn queue(&self) -> PortResult<mpsc::Sender<Append>> {
        // The slot is only ever replaced whole, so a poisoned lock still
        // holds a usable value.
        let mut slot = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(queue) = slot.as_ref().filter(|q| !q.is_closed()) {
            return Ok(queue.clone());
        }
        let cannot = |e: std::io::Error| PortError::Transient(format!("the SQLite log writer cannot start: {e}"));
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(cannot)?;
        let (queue, inbox) = mpsc::channel(QUEUE_DEPTH);
        let writer = Writer::new(self);
        std::thread::Builder::new()
            .name("tollgate-log".into())
            .spawn(move || runtime.block_on(writer.run(inbox)))
            .map_err(cannot)?;
        *slot = Some(queue.clone());
        Ok(queue)
    }
}

#[async_trait]
impl Transport for Appender {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    /// One publish handed to the writer: all of it commits or none does.
    async fn send(&self, records: &[OutRecord]) -> Vec<PortResult<()>> {
        let rows = records.iter().map(|r| (r.key.clone(), r.payload.clone())).collect();
        let outcome = self.append(rows).await;
        records.iter().map(|_| outcome.clone()).collect()
    }
}

#[async_trait]
impl Log for SqliteLog {
    async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
        let records = crate::outbox::usage_records(facts)?;
        self.outbox.publish(records).await
    }

    fn queue(&self, facts: &[UsageFact]) -> Option<PortResult<()>> {
        Some(crate::outbox::usage_records(facts).and_then(|records| self.outbox.queue(records)))
    }

    async fn flush(&self, timeout: Duration) -> PortResult<()> {
        self.outbox.flush(timeout).await
    }
}

/// The audit topic in the same file: one publish is one transaction of the
/// audit topic's writer (all of it or none), not queued: the audit relay
/// publishes from the store's outbox again after a failure.
#[async_trait]
impl AuditLog for SqliteLog {
    async fn publish_audit(&self, entries: &[AuditEntry]) -> PortResult<()> {
        let mut records = Vec::with_capacity(entries.len());
        for e in entries {
            let payload = schemas::encode_audit(e).map_err(|e| PortError::Permanent(e.to_string()))?;
            records.push((e.log_key().as_bytes().to_vec(), payload));
        }
        self.audit.append(records).await
    }
}

/// Hands one publish to the writer behind `queue` and waits for its answer.
/// A writer that is gone, or drops the publish unanswered, is transient.
async fn submit(queue: &mpsc::Sender<Append>, records: Vec<(Vec<u8>, Vec<u8>)>) -> PortResult<()> {
    let (done, answer) = oneshot::channel();
    queue
        .send(Append { records, done })
        .await
        .map_err(|_| PortError::Transient("the SQLite log writer has stopped; nothing was appended".into()))?;
    answer.await.unwrap_or_else(|_| {
        Err(PortError::Transient(
            "the SQLite log writer stopped before answering; the records may or may not be on the log".into(),
        ))
    })
}

/// What makes every append of one log (and its clones), on its own thread.
struct Writer {
    /// This process's turn at the file's write lock, shared with the fold
    /// ([`crate::sqlite_store::write_gate`]).
    gate: crate::sql::WriteGate,
    pool: SqlitePool,
    topic: String,
    published: Arc<Notify>,
    /// The writer's own connection to the file, opened by the first batch
    /// and again after a failed one.
    conn: Option<rusqlite::Connection>,
}

impl Writer {
    fn new(appender: &Appender) -> Writer {
        Writer {
            gate: crate::sqlite_store::write_gate(&appender.pool),
            pool: appender.pool.clone(),
            topic: appender.topic.clone(),
            published: Arc::clone(&appender.published),
            conn: None,
        }
    }

    /// Commits batches until every queue handle is dropped (the log and its
    /// clones are gone) and the queue is empty.
    async fn run(mut self, mut inbox: mpsc::Receiver<Append>) {
        let mut batch = Vec::new();
        let mut last = 0;
        while let Some(first) = inbox.recv().await {
            if let Some(linger) = linger_after(last) {
                // This thread runs the writer alone: sleeping holds up
                // nothing but the batch it is gathering.
                std::thread::sleep(linger);
            }
            let mut records = first.records.len();
            batch.push(first);
            while records < MAX_BATCH_RECORDS {
                let Ok(next) = inbox.try_recv() else { break };
                records += next.records.len();
                batch.push(next);
            }
            last = batch.len();
            self.write(&mut batch).await;
        }
    }

    /// The writer's one step: appends every publish of `batch` in one
    /// transaction, in order, wakes this process's readers if it committed,
    /// and answers every publish with the outcome (each publisher logs its
    /// own error, so the writer does not). Leaves `batch` empty.
    async fn write(&mut self, batch: &mut Vec<Append>) {
        let records: usize = batch.iter().map(|a| a.records.len()).sum();
        let span = info_span!("datastore", op = "sqlite.publish", n = records, publishes = batch.len());
        let outcome = self.commit(batch).instrument(span).await;
        if outcome.is_ok() {
            self.published.notify_waiters();
        } else {
            // A connection that failed is not trusted with the next batch.
            self.conn = None;
        }
        for append in batch.drain(..) {
            // A publisher that stopped waiting does not need the answer.
            let _ = append.done.send(outcome.clone());
        }
    }

    /// One transaction holding every record of `batch`. On any error it is
    /// dropped before commit, which rolls it back: nothing of the batch stays.
    async fn commit(&mut self, batch: &[Append]) -> PortResult<()> {
        if self.conn.is_none() {
            self.conn = Some(connect_like(&self.pool).await?);
        }
        // This process's turn first, so a fold's commit hands the lock
        // straight over.
        let _turn = self.gate.lock().await;
        let conn = self.conn.as_mut().ok_or_else(|| PortError::Transient("no connection to the log's file".into()))?;
        // IMMEDIATE takes the write lock up front: offsets are then handed
        // out in commit order (see the module doc).
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(conn_err)?;
        {
            let mut insert = tx.prepare_cached(INSERT).map_err(conn_err)?;
            let at = append_stamp(chrono::Utc::now());
            for (key, payload) in batch.iter().flat_map(|a| &a.records) {
                insert.execute(rusqlite::params![self.topic, PARTITION, key, payload, at]).map_err(conn_err)?;
            }
        }
        tx.commit().map_err(conn_err)
    }
}

/// A connection of its own to `pool`'s file (rusqlite), made as the pool
/// makes its own: the same `synchronous` level (what a commit survives) and
/// busy timeout, read from one of the pool's connections. The writer appends
/// through one, each reader reads through one.
async fn connect_like(pool: &SqlitePool) -> PortResult<rusqlite::Connection> {
    let (synchronous, busy_ms): (i64, i64) =
        sqlx::query_as("SELECT s.synchronous, b.timeout FROM pragma_synchronous() s, pragma_busy_timeout() b")
            .fetch_one(pool)
            .await
            .map_err(log_err)?;
    let path = pool.connect_options().get_filename().to_path_buf();
    let conn = rusqlite::Connection::open_with_flags(
        &path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(conn_err)?;
    conn.pragma_update(None, "synchronous", synchronous).map_err(conn_err)?;
    conn.busy_timeout(Duration::from_millis(u64::try_from(busy_ms).unwrap_or(0))).map_err(conn_err)?;
    Ok(conn)
}

/// Where `topic` ends: offsets are row ids, not contiguous, so the end is
/// past the last one.
async fn topic_end(pool: &SqlitePool, topic: &str) -> PortResult<BTreeMap<i32, i64>> {
    let next: i64 = sqlx::query_scalar(
        r#"SELECT COALESCE(MAX("offset"), -1) + 1 FROM log_records WHERE topic = ?1 AND "partition" = ?2"#,
    )
    .bind(topic)
    .bind(PARTITION)
    .fetch_one(pool)
    .await
    .map_err(log_err)?;
    Ok(BTreeMap::from([(PARTITION, next)]))
}

/// A project's tail of the embedded log, for a reseed of the view.
#[async_trait]
impl LogTail for SqliteLog {
    async fn ends(&self) -> PortResult<BTreeMap<i32, i64>> {
        topic_end(&self.appender.pool, &self.appender.topic).await
    }

    async fn tail(
        &self,
        project: &ProjectId,
        from: &BTreeMap<i32, i64>,
        since: chrono::DateTime<chrono::Utc>,
    ) -> PortResult<Vec<LogRecord>> {
        let start = from.get(&PARTITION).copied().unwrap_or(0);
        // One statement: the end is where the log stands when it runs. The
        // append times are RFC 3339 in UTC with milliseconds, so they compare
        // as text.
        let rows = sqlx::query(
            r#"SELECT "offset", key, payload, appended_at FROM log_records
               WHERE topic = ?1 AND "partition" = ?2 AND key = ?4
                 AND ("offset" >= ?3 OR appended_at >= ?5)
               ORDER BY "offset""#,
        )
        .bind(&self.appender.topic)
        .bind(PARTITION)
        .bind(start)
        .bind(project.as_str().as_bytes())
        .bind(since.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .fetch_all(&self.appender.pool)
        .instrument(info_span!("datastore", op = "sqlite.tail"))
        .await
        .map_err(log_err)?;
        rows.iter().map(|row| record_of(PARTITION, row)).collect()
    }
}

/// Reads the usage topic (or the audit topic, [`SqliteLog::audit_reader`])
/// from explicit offsets, and dead-letters what cannot be folded.
#[derive(Debug)]
pub struct SqliteLogReader {
    pool: SqlitePool,
    topic: String,
    dlq_topic: String,
    published: Arc<Notify>,
    /// The next offset to read, per partition.
    positions: BTreeMap<i32, i64>,
    /// The reader's own connection to the file, for its reads of records
    /// (through the pool, sqlx's thread hands every row over on its own),
    /// opened by the first read and again after a failed one. Only ever
    /// reached through `&mut self` (the mutex makes the reader `Sync`, as
    /// a connection is not, and is never locked).
    conn: Mutex<Option<rusqlite::Connection>>,
    /// Reads of the file made so far (what a wake-up costs, for tests).
    reads: u64,
}

impl SqliteLogReader {
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Up to `max` records at or after the current positions, without
    /// waiting: one statement per partition on the reader's own connection,
    /// on the calling thread (a read of the local file that waits for no
    /// lock in WAL mode; handing it to a blocking thread cost more CPU per
    /// call than the read, see BENCHMARKS.md).
    async fn read(&mut self, max: usize) -> PortResult<Vec<LogRecord>> {
        self.reads += 1;
        let slot = self.conn.get_mut().unwrap_or_else(PoisonError::into_inner);
        let conn = match slot {
            Some(conn) => conn,
            None => slot.insert(connect_like(&self.pool).await?),
        };
        let read = info_span!("datastore", op = "sqlite.poll")
            .in_scope(|| read_records(conn, &self.topic, &self.positions, max));
        // A connection that failed is not trusted with the next read.
        if read.is_err() {
            *slot = None;
        }
        read
    }
}

/// The records of `topic` from `positions` on, up to `max`, in offset order
/// within each partition.
///
/// The statement has no `LIMIT`: the rows come in the index's order and the
/// loop stops at `max`. A bound `LIMIT` made SQLite plan the statement for
/// its value, so every read with another `max` than the last (the linger's
/// second read of a step, for one) parsed and planned it again.
fn read_records(
    conn: &rusqlite::Connection,
    topic: &str,
    positions: &BTreeMap<i32, i64>,
    max: usize,
) -> PortResult<Vec<LogRecord>> {
    let mut select = conn.prepare_cached(READ).map_err(conn_err)?;
    let mut out = Vec::new();
    for (&partition, &from) in positions {
        if out.len() >= max {
            break;
        }
        let mut rows = select.query(rusqlite::params![topic, partition, from]).map_err(conn_err)?;
        while out.len() < max
            && let Some(row) = rows.next().map_err(conn_err)?
        {
            out.push(LogRecord {
                partition,
                offset: row.get(0).map_err(conn_err)?,
                key: row.get(1).map_err(conn_err)?,
                payload: row.get(2).map_err(conn_err)?,
                timestamp: append_time(row.get(3).map_err(conn_err)?),
            });
        }
    }
    Ok(out)
}

#[async_trait]
impl LogReader for SqliteLogReader {
    async fn partitions(&mut self) -> PortResult<Vec<i32>> {
        Ok(vec![PARTITION])
    }

    async fn ends(&mut self) -> PortResult<BTreeMap<i32, i64>> {
        topic_end(&self.pool, &self.topic).await
    }

    async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()> {
        self.positions = positions.clone();
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> PortResult<Vec<LogRecord>> {
        // Like Kafka's reader, a poll returns at least one record if any is there.
        let max = max.max(1);
        let deadline = Instant::now() + wait;
        let notify = Arc::clone(&self.published);
        loop {
            // Registered before the read, so a publish that commits between
            // the read and the wait still wakes us (`notify_waiters` reaches
            // every `Notified` created before it).
            let published = notify.notified();
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
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7
             WHERE NOT EXISTS (SELECT 1 FROM log_dead_letters
                               WHERE topic = ?1 AND source_topic = ?2 AND source_partition = ?3 AND source_offset = ?4)",
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

    async fn dead_letter_mark(&mut self) -> PortResult<DlqMark> {
        let next: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(id), 0) + 1 FROM log_dead_letters")
            .fetch_one(&self.pool)
            .await
            .map_err(log_err)?;
        Ok(DlqMark::from([(PARTITION, next)]))
    }

    async fn dead_lettered_since(&mut self, mark: &DlqMark) -> PortResult<BTreeSet<(i32, i64)>> {
        let from = mark.get(&PARTITION).copied().unwrap_or(0);
        let rows: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT source_partition, source_offset FROM log_dead_letters
             WHERE topic = ?1 AND source_topic = ?2 AND id >= ?3",
        )
        .bind(&self.dlq_topic)
        .bind(&self.topic)
        .bind(from)
        .fetch_all(&self.pool)
        .await
        .map_err(log_err)?;
        rows.into_iter()
            .map(|(p, o)| {
                i32::try_from(p)
                    .map(|p| (p, o))
                    .map_err(|_| PortError::Permanent(format!("dead letter of partition {p} out of range")))
            })
            .collect()
    }
}

fn record_of(partition: i32, row: &SqliteRow) -> PortResult<LogRecord> {
    Ok(LogRecord {
        partition,
        offset: row.try_get("offset").map_err(log_err)?,
        key: row.try_get("key").map_err(log_err)?,
        payload: row.try_get("payload").map_err(log_err)?,
        timestamp: append_time(row.try_get("appended_at").map_err(log_err)?),
    })
}

/// A record's append time as stored; a stamp that does not parse is as good
/// as none.
fn append_time(stored: Option<String>) -> Option<chrono::DateTime<chrono::Utc>> {
    stored.and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok()).map(|t| t.with_timezone(&chrono::Utc))
}

/// [`SqliteLog::take_over`] with the old file attached as `prior`.
async fn take_over_attached(conn: &mut sqlx::SqliteConnection) -> PortResult<u64> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM prior.sqlite_master WHERE type = 'table' AND name IN ('log_records', 'log_dead_letters')",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(log_err)?;
    if !tables.iter().any(|t| t == "log_records") {
        return Ok(0);
    }
    let columns: Vec<String> = sqlx::query("PRAGMA prior.table_info(log_records)")
        .fetch_all(&mut *conn)
        .await
        .map_err(log_err)?
        .iter()
        .map(|r| r.try_get::<String, _>("name"))
        .collect::<Result<_, _>>()
        .map_err(log_err)?;
    // A file from before the append time has none to move.
    let appended_at = if columns.iter().any(|c| c == "appended_at") { "appended_at" } else { "NULL" };
    let mut copy = vec![format!(
        r#"INSERT INTO main.log_records ("offset", topic, "partition", key, payload, appended_at)
           SELECT "offset", topic, "partition", key, payload, {appended_at} FROM prior.log_records
           WHERE "offset" > (SELECT COALESCE(MAX("offset"), 0) FROM main.log_records) ORDER BY "offset""#
    )];
    let mut drop = vec!["DROP TABLE prior.log_records".to_owned()];
    if tables.iter().any(|t| t == "log_dead_letters") {
        copy.push(
            "INSERT INTO main.log_dead_letters (id, topic, source_topic, source_partition, source_offset, key, \
             payload, reason, dead_lettered_at) \
             SELECT id, topic, source_topic, source_partition, source_offset, key, payload, reason, dead_lettered_at \
             FROM prior.log_dead_letters WHERE id > (SELECT COALESCE(MAX(id), 0) FROM main.log_dead_letters) \
             ORDER BY id"
                .to_owned(),
        );
        drop.push("DROP TABLE prior.log_dead_letters".to_owned());
    }
    let mut moved = 0;
    for (step, statements) in [copy, drop].into_iter().enumerate() {
        sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await.map_err(log_err)?;
        let mut done = Ok(());
        for (i, sql) in statements.into_iter().enumerate() {
            match sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut *conn).await {
                // The records' copy comes first.
                Ok(r) if step == 0 && i == 0 => moved = r.rows_affected(),
                Ok(_) => {}
                Err(e) => {
                    done = Err(log_err(e));
                    break;
                }
            }
        }
        let end = if done.is_ok() { "COMMIT" } else { "ROLLBACK" };
        let ended = sqlx::query(end).execute(&mut *conn).await.map_err(log_err);
        done?;
        ended?;
    }
    Ok(moved)
}

// Primary result codes (the low byte of an extended code) worth retrying.
const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_NOMEM: i32 = 7;
const SQLITE_IOERR: i32 = 10;
const SQLITE_FULL: i32 = 13;

/// [`log_err`] for the writer's and the readers' own connections: the same
/// classes of SQLite result codes are transient.
fn conn_err(e: rusqlite::Error) -> PortError {
    match e.sqlite_error().map(|f| f.extended_code) {
        Some(code) => by_result_code(code, e.to_string()),
        None => PortError::Permanent(e.to_string()),
    }
}

/// Sorts a driver error into transient or permanent, once for this adapter.
fn log_err(e: sqlx::Error) -> PortError {
    match &e {
        sqlx::Error::Database(d) => {
            by_result_code(d.code().and_then(|c| c.parse::<i32>().ok()).unwrap_or(0), e.to_string())
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => PortError::Transient(e.to_string()),
        _ => PortError::Permanent(e.to_string()),
    }
}

/// An error with an SQLite (extended) result code: transient when its
/// primary code is worth retrying.
fn by_result_code(code: i32, message: String) -> PortError {
    match code & 0xff {
        SQLITE_BUSY | SQLITE_LOCKED | SQLITE_NOMEM | SQLITE_IOERR | SQLITE_FULL => PortError::Transient(message),
        _ => PortError::Permanent(message),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use chrono::Timelike;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

    use super::*;

    /// A fresh file with the log's tables, and its directory to remove.
    async fn log_in_temp_file() -> (SqliteLog, PathBuf) {
        log_in_temp_file_with(|o| o).await
    }

    /// [`log_in_temp_file`], its pool's options changed by `options`.
    async fn log_in_temp_file_with(
        options: impl FnOnce(SqliteConnectOptions) -> SqliteConnectOptions,
    ) -> (SqliteLog, PathBuf) {
        let dir = std::env::temp_dir().join(format!("tollgate-logunit-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        let options = options(
            SqliteConnectOptions::new()
                .filename(dir.join("log.db"))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(10)),
        );
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(options).await.expect("open");
        let log = SqliteLog::new(pool, "t.");
        log.ensure_schema().await.expect("schema");
        (log, dir)
    }

    /// One caller at a time, or a few, never wait for the writer's linger;
    /// after a batch of many publishes, the next batch lingers.
    #[test]
    fn the_writer_lingers_only_after_a_loaded_batch() {
        for last in 0..LOADED_BATCH {
            assert_eq!(linger_after(last), None, "after a batch of {last}");
        }
        for last in [LOADED_BATCH, LOADED_BATCH + 1, 64, MAX_BATCH_RECORDS] {
            assert_eq!(linger_after(last), Some(LINGER), "after a batch of {last}");
        }
        assert_eq!(linger_after(1), None, "a lone publish after a lone publish would wait");
        // A linger of a millisecond or more would be a call's whole budget.
        const { assert!(LINGER.as_micros() < 1_000) };
    }

    /// The writer stamps records as the column's default does: the same
    /// text for the same instant, so stamps of both kinds compare in order.
    #[test]
    fn the_append_stamp_is_the_column_defaults_text() {
        let conn = rusqlite::Connection::open_in_memory().expect("open");
        for at in ["2026-12-05T20:45:01.123456Z", "2026-01-01T00:00:00Z", "1999-12-31T23:59:59.999Z"] {
            let at = chrono::DateTime::parse_from_rfc3339(at).expect("time").with_timezone(&chrono::Utc);
            let sqlite: String = conn
                .query_row(
                    "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', ?1)",
                    [at.format("%Y-%m-%d %H:%M:%S%.3f").to_string()],
                    |r| r.get(0),
                )
                .expect("strftime");
            assert_eq!(append_stamp(at), sqlite);
            assert_eq!(
                append_time(Some(append_stamp(at))),
                Some(at.with_nanosecond(at.nanosecond() / 1_000_000 * 1_000_000).expect("ms"))
            );
        }
    }

    fn writer_of(log: &SqliteLog) -> Writer {
        Writer::new(&log.appender)
    }

    fn append(keys: &[&str]) -> (Append, oneshot::Receiver<PortResult<()>>) {
        let (done, answer) = oneshot::channel();
        let records = keys.iter().map(|k| (k.as_bytes().to_vec(), format!("payload of {k}").into_bytes())).collect();
        (Append { records, done }, answer)
    }

    async fn keys_on_the_log(log: &SqliteLog) -> Vec<Vec<u8>> {
        sqlx::query_scalar(r#"SELECT key FROM log_records ORDER BY "offset""#)
            .fetch_all(&log.appender.pool)
            .await
            .expect("read the log")
    }

    #[tokio::test]
    async fn a_failed_batch_answers_every_publish_with_the_error_and_keeps_none_of_it() {
        let (log, dir) = log_in_temp_file().await;
        sqlx::query(
            "CREATE TRIGGER poison BEFORE INSERT ON log_records WHEN NEW.key = X'706f69736f6e'
             BEGIN SELECT RAISE(ABORT, 'poisoned record'); END",
        )
        .execute(&log.appender.pool)
        .await
        .expect("trigger");
        let mut writer = writer_of(&log);

        let (a, a_answer) = append(&["a1"]);
        let (b, b_answer) = append(&["b1", "poison", "b3"]);
        let (c, c_answer) = append(&["c1", "c2"]);
        let mut batch = vec![a, b, c];
        writer.write(&mut batch).await;
        assert!(batch.is_empty(), "the step leaves the batch empty");
        for answer in [a_answer, b_answer, c_answer] {
            match answer.await.expect("answered") {
                Err(PortError::Permanent(why)) => assert!(why.contains("poisoned record"), "{why}"),
                other => panic!("expected the batch's error, got {other:?}"),
            }
        }
        assert!(keys_on_the_log(&log).await.is_empty(), "nothing of a failed batch is on the log");

        // The writer goes on: the next batch commits, in arrival order.
        let (d, d_answer) = append(&["d1", "d2"]);
        let (e, e_answer) = append(&["e1"]);
        let mut batch = vec![d, e];
        writer.write(&mut batch).await;
        assert_eq!(d_answer.await.expect("answered"), Ok(()));
        assert_eq!(e_answer.await.expect("answered"), Ok(()));
        assert_eq!(keys_on_the_log(&log).await, [b"d1".to_vec(), b"d2".to_vec(), b"e1".to_vec()]);

        log.appender.pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Reads of any size, from any offset, run the statement as it was
    /// prepared once: none is parsed and planned again (a bound `LIMIT` did
    /// that at every read whose size differed from the last).
    #[tokio::test]
    async fn reads_of_any_size_reuse_the_prepared_statement() {
        let (log, dir) = log_in_temp_file().await;
        let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
        for k in &keys {
            log.appender.append(vec![(k.as_bytes().to_vec(), b"p".to_vec())]).await.expect("append");
        }
        let conn = connect_like(&log.appender.pool).await.expect("connect");
        let topic = log.usage_topic().to_owned();
        // Offsets are row ids: 1 to 20.
        for (from, max) in [(0_i64, 5000_usize), (0, 3), (5, 7), (1, 1), (0, 20), (12, 4999)] {
            let records = read_records(&conn, &topic, &BTreeMap::from([(PARTITION, from)]), max).expect("read");
            let offsets: Vec<i64> = records.iter().map(|r| r.offset).collect();
            let end = (from.max(1) + i64::try_from(max).expect("max")).min(21);
            assert_eq!(offsets, (from.max(1)..end).collect::<Vec<_>>(), "from {from}, at most {max}");
        }
        let select = conn.prepare_cached(READ).expect("cached");
        assert_eq!(select.get_status(rusqlite::StatementStatus::RePrepare), 0, "re-prepared");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_batch_goes_in_in_arrival_order() {
        let (log, dir) = log_in_temp_file().await;
        let sizes = [1, 70, 5, 64, 63];
        let names: Vec<Vec<String>> =
            sizes.iter().enumerate().map(|(p, &n)| (0..n).map(|r| format!("p{p}r{r}")).collect()).collect();
        let mut batch = Vec::new();
        let mut answers = Vec::new();
        for publish in &names {
            let keys: Vec<&str> = publish.iter().map(String::as_str).collect();
            let (a, answer) = append(&keys);
            batch.push(a);
            answers.push(answer);
        }
        writer_of(&log).write(&mut batch).await;
        for answer in answers {
            assert_eq!(answer.await.expect("answered"), Ok(()));
        }
        let expected: Vec<Vec<u8>> = names.iter().flatten().map(|k| k.as_bytes().to_vec()).collect();
        assert_eq!(expected.len(), 203);
        assert_eq!(keys_on_the_log(&log).await, expected, "in arrival order, by offset");
        let payloads: Vec<(Vec<u8>, Vec<u8>)> =
            sqlx::query_as(r#"SELECT key, payload FROM log_records ORDER BY "offset""#)
                .fetch_all(&log.appender.pool)
                .await
                .expect("read the log");
        assert!(
            payloads.iter().all(|(k, p)| *p == [b"payload of ".as_slice(), k].concat()),
            "each payload with its key"
        );
        log.appender.pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A reader waiting on the audit topic is not woken by the usage
    /// topic's commits (under load thousands a second, each of which made
    /// it read the file for nothing), and reads the audit topic's.
    #[tokio::test]
    async fn a_reader_is_woken_by_its_own_topics_commits_only() {
        let (log, dir) = log_in_temp_file().await;
        let mut audit = log.audit_reader();
        let wait = Duration::from_millis(400);
        let commits = 100;
        let (empty, ()) = tokio::join!(audit.poll(10, wait), async {
            for i in 0..commits {
                log.publish_raw(&format!("k{i}"), b"usage").await.expect("publish");
            }
        });
        assert_eq!(empty.expect("poll"), Vec::new(), "nothing on the audit topic");
        // The first read and its own re-reads (every POLL_INTERVAL, for
        // other processes' writers): about 21 in 400 ms, where one per
        // usage commit made 100 more.
        let most = 2 + u64::try_from(wait.as_millis() / POLL_INTERVAL.as_millis()).expect("small");
        assert!(audit.reads <= most, "{} reads in {wait:?} with {commits} usage commits", audit.reads);

        // Its own topic's records it reads.
        let entry = meter::admin_change(
            meter::AuditId::parse("aud_1").expect("id"),
            &ProjectId::parse("proj_1").expect("id"),
            meter::AuditAction::RunExport,
            "exr_1",
            meter::AuditDetail::WebhookEndpointDisabled { url: "https://example.test".into(), reason: "test".into() },
            &meter::Principal::new("admin", "test"),
            chrono::Utc::now(),
        );
        let started = Instant::now();
        let (got, published) = tokio::join!(audit.poll(10, Duration::from_secs(10)), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            log.publish_audit(std::slice::from_ref(&entry)).await
        });
        published.expect("publish the audit entry");
        assert_eq!(got.expect("poll").len(), 1, "the audit entry");
        assert!(started.elapsed() < Duration::from_secs(5), "read before the poll's end");
        log.appender.pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn the_writers_connection_commits_as_durably_as_the_pool_and_waits_as_long() {
        for (level, code) in
            [(SqliteSynchronous::Normal, 1), (SqliteSynchronous::Full, 2), (SqliteSynchronous::Extra, 3)]
        {
            let (log, dir) =
                log_in_temp_file_with(|o| o.synchronous(level).busy_timeout(Duration::from_millis(1_234))).await;
            let mut writer = writer_of(&log);
            let (a, answer) = append(&["k"]);
            writer.write(&mut vec![a]).await;
            assert_eq!(answer.await.expect("answered"), Ok(()));
            let conn = writer.conn.as_ref().expect("the writer's connection is open");
            let synchronous: i64 = conn.pragma_query_value(None, "synchronous", |r| r.get(0)).expect("synchronous");
            assert_eq!(synchronous, code, "{level:?}");
            let busy: i64 = conn.pragma_query_value(None, "busy_timeout", |r| r.get(0)).expect("busy_timeout");
            assert_eq!(busy, 1_234);
            assert_eq!(keys_on_the_log(&log).await, [b"k".to_vec()]);
            log.appender.pool.close().await;
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    #[tokio::test]
    async fn a_writer_that_is_gone_is_transient() {
        let record = || vec![(b"k".to_vec(), b"v".to_vec())];

        // Gone before the publish: nothing sent.
        let (queue, inbox) = mpsc::channel(1);
        drop(inbox);
        assert!(matches!(submit(&queue, record()).await, Err(PortError::Transient(_))));

        // Gone after taking the publish, without answering.
        let (queue, mut inbox) = mpsc::channel::<Append>(1);
        let writer = tokio::spawn(async move {
            let taken = inbox.recv().await;
            drop(taken);
        });
        assert!(matches!(submit(&queue, record()).await, Err(PortError::Transient(_))));
        writer.await.expect("the fake writer ends");
    }

    #[test]
    fn the_writer_needs_no_runtime_of_the_publisher_and_outlives_the_one_that_started_it() {
        let first = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let (log, dir) = first.block_on(log_in_temp_file());
        first.block_on(log.publish_raw("a", b"bytes")).expect("inside a runtime");
        // The runtime that started the writer is gone; the writer is not.
        drop(first);
        futures::executor::block_on(log.publish_raw("b", b"bytes")).expect("outside any tokio runtime");
        let second = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        second.block_on(async {
            assert_eq!(keys_on_the_log(&log).await, [b"a".to_vec(), b"b".to_vec()]);
            log.appender.pool.close().await;
        });
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Every record of the file (offset, topic, key, payload, append time),
    /// and every dead letter (id, source offset, reason).
    type Rows = (Vec<(i64, String, Vec<u8>, Vec<u8>, Option<String>)>, Vec<(i64, i64, String)>);

    async fn rows_of(pool: &SqlitePool) -> Rows {
        let records =
            sqlx::query_as(r#"SELECT "offset", topic, key, payload, appended_at FROM log_records ORDER BY "offset""#)
                .fetch_all(pool)
                .await
                .expect("records");
        let letters = sqlx::query_as("SELECT id, source_offset, reason FROM log_dead_letters ORDER BY id")
            .fetch_all(pool)
            .await
            .expect("letters");
        (records, letters)
    }

    /// An old data file's log moves into the log's own file with its offsets
    /// and letter ids, leaves the old file without the log's tables, moves
    /// nothing the second time, and the next publish gets an offset past
    /// every moved one.
    #[tokio::test]
    async fn take_over_moves_an_old_files_log_with_its_offsets() {
        let (old, dir) = log_in_temp_file().await;
        // Two topics share the offsets' sequence: the usage topic's have gaps.
        for i in 0..5 {
            old.publish_raw(&format!("k{i}"), format!("usage {i}").as_bytes()).await.expect("publish");
            old.audit.append(vec![(b"a".to_vec(), format!("audit {i}").into_bytes())]).await.expect("audit");
        }
        // A gap in the offsets, so a copy that renumbered them would show.
        sqlx::query(r#"DELETE FROM log_records WHERE "offset" = (SELECT MIN("offset") FROM log_records WHERE topic = 't.audit')"#)
            .execute(&old.appender.pool)
            .await
            .expect("a gap");
        let mut reader = old.reader();
        let first = reader.poll(10, Duration::from_secs(1)).await.expect("poll");
        reader.dead_letter(&first[0], "a reason").await.expect("dead letter");
        let before = rows_of(&old.appender.pool).await;
        assert_eq!(before.0.len(), 9);
        assert_eq!(before.1.len(), 1);

        let options = SqliteConnectOptions::new()
            .filename(dir.join("log-own.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let pool = SqlitePoolOptions::new().max_connections(2).connect_with(options).await.expect("open");
        let new = SqliteLog::new(pool, "t.");
        new.ensure_schema().await.expect("schema");
        assert_eq!(new.take_over(&dir.join("log.db")).await.expect("take over"), 9);
        assert_eq!(rows_of(&new.appender.pool).await, before, "the same records, offsets and letters");
        let left: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('log_records', 'log_dead_letters')")
                .fetch_one(&old.appender.pool)
                .await
                .expect("tables");
        assert_eq!(left, 0, "the old file keeps no log");
        assert_eq!(new.take_over(&dir.join("log.db")).await.expect("again"), 0);

        new.publish_raw("next", b"after").await.expect("publish");
        let after = rows_of(&new.appender.pool).await.0;
        let last_moved = before.0.last().map(|r| r.0).expect("moved");
        assert_eq!(after.len(), 10);
        assert!(after[9].0 > last_moved, "a new offset is past the moved ones");
        let mut reader = new.reader();
        let read = reader.poll(100, Duration::from_secs(1)).await.expect("poll");
        let offsets: Vec<i64> = read.iter().map(|r| r.offset).collect();
        let usage: Vec<i64> = before.0.iter().filter(|r| r.1 == "t.usage").map(|r| r.0).chain([after[9].0]).collect();
        assert_eq!(offsets, usage, "a reader of the new file reads the usage topic at the old offsets");
        old.appender.pool.close().await;
        new.appender.pool.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
