//! The audit relay and folder (`projector::audit`) over the embedded store
//! and log (SQLite, a file per test) and over PostgreSQL and the
//! Kafka-protocol broker (a database and topics per test; skipped when they
//! do not answer, unless `TOLLGATE_REQUIRE_SERVICES` is set):
//!
//! - entries written to the outbox reach the audit topic and the audit log;
//! - a relay killed between its publish and its mark publishes again, and
//!   the log keeps one entry of each (the topic holds two);
//! - a fresh store folds the topic into the same audit log, entry for entry;
//! - a record of the audit topic that is not an audit entry is
//!   dead-lettered with its reason, and the rest folded.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use meter::{
    AuditAction, AuditDetail, AuditEntry, AuditId, AuditLog, Clock, LogReader, ManualClock, MonitorBreach, Principal,
    ProjectId, QuotaId, Store, WindowKind,
};
use projector::audit::{AuditConfig, AuditFolder, AuditRelay};
use store::{KafkaAuditLog, KafkaConfig, KafkaReader, PgStore, SqliteLog, SqliteStore};

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

fn pid() -> ProjectId {
    ProjectId::parse("proj_1").expect("id")
}

/// Three entries of three kinds, in id (time) order.
fn entries() -> Vec<AuditEntry> {
    let at = utc("2026-07-07T12:31:10.123456Z");
    let breach = MonitorBreach {
        quota_id: QuotaId::parse("quota_1").expect("id"),
        project_id: pid(),
        metric: meter::Metric::Calls,
        meter_type: None,
        window: WindowKind::Day,
        window_key: "2026-07-07".into(),
        limit: 5,
        observed_value: 6,
    };
    let change = AuditEntry {
        id: AuditId::parse("aud_0001").expect("id"),
        project_id: Some(pid()),
        action: AuditAction::DeleteQuota,
        principal: Some(Principal::new("admin", "api")),
        resource: "quota_1".into(),
        detail: AuditDetail::QuotaChange { before: None, after: None },
        created_at: at,
    };
    let disabled = AuditEntry {
        id: AuditId::parse("aud_0003").expect("id"),
        action: AuditAction::WebhookEndpointDisabled,
        principal: None,
        resource: "wh_1".into(),
        detail: AuditDetail::WebhookEndpointDisabled { url: "https://example.com/h".into(), reason: "410".into() },
        ..change.clone()
    };
    vec![change, breach.entry(AuditId::parse("aud_0002").expect("id"), at), disabled]
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One backend: a store, the audit topic's writer, a way to make readers
/// of it, and fresh stores of the same kind.
struct Backend<R: LogReader> {
    store: Arc<dyn Store>,
    log: Arc<dyn AuditLog>,
    topic: String,
    reader: Box<dyn Fn(&str) -> R>,
    _keep: Vec<Box<dyn std::any::Any>>,
}

async fn sqlite_store(dir: &std::path::Path, name: &str) -> SqliteStore {
    let s = SqliteStore::open(&dir.join(name)).await.expect("open");
    s.migrate().await.expect("migrate");
    s
}

async fn sqlite() -> (Backend<store::SqliteLogReader>, SqliteLog, sqlx::SqlitePool) {
    let dir = std::env::temp_dir().join(format!("tollgate-audit-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let s = sqlite_store(&dir, "t.db").await;
    let log = SqliteLog::new(s.pool().clone(), "tollgate.");
    log.ensure_schema().await.expect("log schema");
    let readers = log.clone();
    let pool = s.pool().clone();
    let b = Backend {
        store: Arc::new(s),
        log: Arc::new(log.clone()),
        topic: log.audit_topic().to_owned(),
        reader: Box::new(move |_| readers.audit_reader()),
        _keep: vec![Box::new(TempDir(dir))],
    };
    (b, log, pool)
}

async fn kafka() -> Option<(Backend<KafkaReader>, KafkaConfig)> {
    if !testkit::available(&[testkit::Service::Postgres, testkit::Service::Kafka]) {
        return None;
    }
    let db = testkit::TestDb::new("tga").await;
    let s = PgStore::connect(&db.url).await.expect("connect");
    s.migrate().await.expect("migrate");
    let config = KafkaConfig::new(testkit::env::kafka(), testkit::topic_prefix("tga"));
    config.ensure_topics().await.expect("topics");
    let readers = config.clone();
    let b = Backend {
        store: Arc::new(s),
        log: Arc::new(KafkaAuditLog::new(&config).expect("producer")),
        topic: config.audit_topic(),
        reader: Box::new(move |group| KafkaReader::audit(&readers, group).expect("consumer")),
        _keep: vec![Box::new(db)],
    };
    Some((b, config))
}

/// A fresh PostgreSQL database, migrated, kept alive by the second value.
async fn fresh_pg() -> (Arc<dyn Store>, testkit::TestDb) {
    let db = testkit::TestDb::new("tga").await;
    let s = PgStore::connect(&db.url).await.expect("connect");
    s.migrate().await.expect("migrate");
    (Arc::new(s), db)
}

fn config(topic: &str) -> AuditConfig {
    let mut c = AuditConfig::new(topic);
    c.poll_wait = Duration::from_millis(100);
    c
}

/// Every record of the audit topic, decoded, in offset order per partition.
async fn on_topic<R: LogReader>(mut r: R) -> Vec<AuditEntry> {
    let ends = r.ends().await.expect("ends");
    let start: BTreeMap<i32, i64> = r.partitions().await.expect("partitions").into_iter().map(|p| (p, 0)).collect();
    r.seek(&start).await.expect("seek");
    let (mut seen, mut out) = (start, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.iter().any(|(p, o)| *o < ends.get(p).copied().unwrap_or(0)) {
        assert!(Instant::now() < deadline, "reading the audit topic to {ends:?} took over 30 s");
        for rec in r.poll(100, Duration::from_millis(200)).await.expect("poll") {
            seen.insert(rec.partition, rec.offset + 1);
            out.push(schemas::decode_audit(&rec.payload).expect("an audit entry"));
        }
    }
    out
}

/// Folder steps until `want` records are read (folded, duplicates or dead
/// letters), at most 30 s; the totals.
async fn fold_until<R: LogReader>(folder: &mut AuditFolder<R>, want: usize) -> (usize, usize, usize) {
    let (mut read, mut folded, mut duplicates, mut dead) = (0, 0, 0, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while read < want {
        assert!(Instant::now() < deadline, "the folder read {read} of {want} records in 30 s");
        let r = folder.step().await.expect("fold step");
        (read, folded, duplicates, dead) =
            (read + r.read, folded + r.folded, duplicates + r.duplicates, dead + r.dead_lettered);
    }
    (folded, duplicates, dead)
}

/// The relay publishes, and is killed before it marks the entries
/// published; the next relay finds them pending and publishes them again.
/// The topic holds each twice; the audit log, one of each.
async fn a_relay_killed_between_publish_and_mark_leaves_one_entry<R: LogReader>(b: &Backend<R>) {
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(utc("2026-07-07T12:32:00Z")));
    let written = entries();
    for e in &written {
        assert!(b.store.record_audit(e).await.expect("record"));
    }
    // The first relay's publish, then its death.
    let pending = b.store.unpublished_audit(100).await.expect("outbox");
    assert_eq!(pending, written, "the outbox in write order");
    b.log.publish_audit(&pending).await.expect("publish");
    // The next relay: the same entries again, then marked.
    let relay = AuditRelay::new(b.store.clone(), b.log.clone(), clock.clone(), 100);
    assert_eq!(relay.step().await.expect("relay"), 3);
    assert!(b.store.unpublished_audit(100).await.expect("outbox").is_empty(), "marked published");
    assert_eq!(relay.step().await.expect("relay"), 0, "nothing more to publish");

    let mut copies: BTreeMap<String, usize> = BTreeMap::new();
    for e in on_topic((b.reader)("tg-audit-check")).await {
        let want = written.iter().find(|w| w.id == e.id).expect("an entry written");
        assert_eq!(&e, want, "the topic holds the entry as written");
        *copies.entry(e.id.to_string()).or_default() += 1;
    }
    assert_eq!(copies.values().copied().collect::<Vec<_>>(), vec![2, 2, 2], "each published twice: {copies:?}");

    let mut folder = AuditFolder::new((b.reader)("tg-audit"), b.store.clone(), config(&b.topic));
    folder.start().await.expect("start");
    assert_eq!(fold_until(&mut folder, 6).await, (3, 3, 0), "three entries, three duplicates");
    assert_eq!(b.store.audit(Some(&pid()), None, 100).await.expect("log"), written);
    // A folder started again resumes past them: nothing read twice.
    let mut again = AuditFolder::new((b.reader)("tg-audit"), b.store.clone(), config(&b.topic));
    again.start().await.expect("start");
    assert_eq!(again.step().await.expect("step").read, 0);
}

/// The topic folded into a fresh store (no project, no outbox) gives the
/// same audit log, entry for entry, the installation-wide ones included.
async fn a_fresh_store_rebuilds_the_same_audit_log<R: LogReader>(b: &Backend<R>, fresh: Arc<dyn Store>) {
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(utc("2026-07-07T12:32:00Z")));
    for e in entries() {
        assert!(b.store.record_audit(&e).await.expect("record"));
    }
    // A write of prices: an entry of no project.
    let prices = AuditEntry {
        id: AuditId::parse("aud_0004").expect("id"),
        project_id: None,
        action: AuditAction::PutPrices,
        resource: "prices".into(),
        detail: AuditDetail::PriceChange { prices: vec![] },
        ..entries()[0].clone()
    };
    assert!(b.store.record_audit(&prices).await.expect("record"));
    let relay = AuditRelay::new(b.store.clone(), b.log.clone(), clock, 2);
    assert_eq!(relay.drain().await.expect("drain"), 4, "two steps of at most two");
    let mut folder = AuditFolder::new((b.reader)("tg-audit"), b.store.clone(), config(&b.topic));
    folder.start().await.expect("start");
    fold_until(&mut folder, 4).await;
    let live = b.store.audit(Some(&pid()), None, 100).await.expect("log");
    assert_eq!(live, entries());
    assert_eq!(b.store.audit(None, None, 100).await.expect("log"), vec![prices.clone()], "the installation's");

    assert!(fresh.audit(Some(&pid()), None, 100).await.expect("log").is_empty());
    let mut rebuild = AuditFolder::new((b.reader)("tg-audit-rebuild"), fresh.clone(), config(&b.topic));
    rebuild.start().await.expect("start");
    assert_eq!(fold_until(&mut rebuild, 4).await, (4, 0, 0));
    assert_eq!(fresh.audit(Some(&pid()), None, 100).await.expect("log"), live, "the same entries");
    assert_eq!(fresh.audit(None, None, 100).await.expect("log"), vec![prices], "the installation's too");
    assert!(fresh.unpublished_audit(10).await.expect("outbox").is_empty(), "a rebuild publishes nothing");
}

#[tokio::test]
async fn sqlite_a_relay_killed_between_publish_and_mark_leaves_one_entry() {
    let (b, ..) = sqlite().await;
    a_relay_killed_between_publish_and_mark_leaves_one_entry(&b).await;
}

#[tokio::test]
async fn kafka_a_relay_killed_between_publish_and_mark_leaves_one_entry() {
    let Some((b, _)) = kafka().await else { return };
    a_relay_killed_between_publish_and_mark_leaves_one_entry(&b).await;
}

#[tokio::test]
async fn sqlite_a_fresh_store_rebuilds_the_same_audit_log() {
    let (b, ..) = sqlite().await;
    let dir = std::env::temp_dir().join(format!("tollgate-audit-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let _keep = TempDir(dir.clone());
    // The fresh store is another file; the topic stays in the first one.
    let fresh = Arc::new(sqlite_store(&dir, "fresh.db").await);
    a_fresh_store_rebuilds_the_same_audit_log(&b, fresh).await;
}

#[tokio::test]
async fn kafka_a_fresh_store_rebuilds_the_same_audit_log() {
    let Some((b, _)) = kafka().await else { return };
    let (fresh, _db) = fresh_pg().await;
    a_fresh_store_rebuilds_the_same_audit_log(&b, fresh).await;
}

/// A record of the audit topic that is no audit entry goes to the DLQ with
/// its reason, naming the audit topic as its source; the entries around it
/// are folded and the offsets move past all of them.
#[tokio::test]
async fn sqlite_a_record_that_is_no_audit_entry_is_dead_lettered() {
    let (b, log, pool) = sqlite().await;
    let [first, second, third] = <[AuditEntry; 3]>::try_from(entries()).expect("three");
    b.log.publish_audit(std::slice::from_ref(&first)).await.expect("publish");
    sqlx::query(r#"INSERT INTO log_records (topic, "partition", key, payload) VALUES (?1, 0, ?2, ?3)"#)
        .bind(log.audit_topic())
        .bind(b"proj_1".as_slice())
        .bind(b"not avro".as_slice())
        .execute(&pool)
        .await
        .expect("a bad record");
    b.log.publish_audit(&[second.clone(), third.clone()]).await.expect("publish");
    let mut folder = AuditFolder::new((b.reader)("tg-audit"), b.store.clone(), config(&b.topic));
    folder.start().await.expect("start");
    assert_eq!(fold_until(&mut folder, 4).await, (3, 0, 1));
    assert_eq!(b.store.audit(Some(&pid()), None, 100).await.expect("log"), vec![first, second, third]);
    let letters: Vec<(String, String)> =
        sqlx::query_as("SELECT source_topic, reason FROM log_dead_letters WHERE topic = 'tollgate.dlq'")
            .fetch_all(&pool)
            .await
            .expect("dead letters");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].0, log.audit_topic());
    assert!(letters[0].1.contains("single-object"), "{letters:?}");
    let ends = (b.reader)("x").ends().await.expect("ends");
    assert_eq!(b.store.offsets("tollgate-audit", &b.topic).await.expect("offsets"), ends, "past every record");
}
