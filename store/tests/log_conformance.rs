//! The `Log` + `LogReader` conformance suite. Each behaviour is one async fn
//! over a [`Harness`] (a `&dyn Log`, fresh `Box<dyn LogReader>`s, raw
//! publishing and the dead letters); `conformance!` stamps every one out as a
//! test per backend:
//!
//! - `kafka::*` runs against a real Kafka-protocol broker
//!   (`TOLLGATE_TEST_KAFKA`, default `127.0.0.1:9092`; skipped when it does
//!   not answer, unless `TOLLGATE_REQUIRE_SERVICES` is set), with topics of its
//!   own per test (a unique prefix), one partition each so the order is
//!   total. Readers poll until they have what they expect or a deadline
//!   passes: the first fetch after an assignment can take a second.
//! - `sqlite::*` runs against the embedded log, in a fresh file (also holding
//!   the migrated embedded store) in a temporary directory per test.
//!
//! The outage suite (`outage!`) runs on an [`OutageHarness`]: a log that can
//! be made to stop answering and then mended — a `testkit::Tansu` broker of
//! the test's own, frozen (`SIGSTOP`) or killed and restarted on the same
//! file, and a SQLite file whose write lock another connection holds. It
//! proves the write side's contract under faults: a publish answers within
//! its timeout (and at once once the log is known to be down) with a
//! transient error, keeps its facts queued, and every one of them is on the
//! log after the outage (`flush`); a full queue refuses and queues nothing.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    ApiKeyId, AuditAction, AuditDetail, AuditEntry, AuditId, AuditLog, EventId, EventKind, Log, LogReader, LogRecord,
    Outcome, PortError, Principal, ProjectId, UsageFact,
};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use store::{
    KafkaAuditLog, KafkaConfig, KafkaLog, KafkaReader, PublishOptions, SqliteLog, SqliteLogReader, SqliteStore,
};

/// How long a test waits for records it knows are there.
const DEADLINE: Duration = Duration::from_secs(30);

/// One backend under test.
#[async_trait]
trait Harness: Send + Sync {
    fn log(&self) -> &dyn Log;
    /// A new reader of the usage topic (not yet positioned).
    async fn reader(&self) -> Box<dyn LogReader>;
    /// Puts bytes on the usage topic as they are.
    async fn publish_raw(&self, key: &str, payload: &[u8]);
    /// The dead letters as (original payload, reason), once `expected` of
    /// them are there (or the deadline passed).
    async fn dead_letters(&self, expected: usize) -> Vec<(Vec<u8>, String)>;
    /// The audit topic's writer (the suites' harnesses; not the outage ones').
    fn audit_log(&self) -> &dyn AuditLog {
        unreachable!("this harness has no audit topic")
    }
    /// A new reader of the audit topic (not yet positioned).
    async fn audit_reader(&self) -> Box<dyn LogReader> {
        unreachable!("this harness has no audit topic")
    }
}

macro_rules! conformance {
    ($fixture:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                let Some(harness) = $fixture.await else { return };
                super::$name(&harness).await;
            }
        )*
    };
}

macro_rules! suite {
    ($fixture:expr) => {
        conformance!($fixture;
            published_facts_read_back_in_order,
            seeking_to_a_stored_offset_resumes_exactly_there,
            polling_an_empty_log_returns_nothing_after_the_wait,
            a_waiting_poll_returns_a_record_published_meanwhile,
            a_dead_letter_keeps_the_original_bytes_and_the_reason,
            facts_of_one_project_stay_in_order,
            many_concurrent_publishers_are_each_read_back_once,
            every_record_carries_the_logs_timestamp,
            the_dlq_tells_which_records_it_holds_past_a_mark,
            audit_entries_read_back_from_their_own_topic,
        );
    };
}

macro_rules! outage {
    ($fixture:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(mut harness) = $fixture.await else { return };
                crate::$name(&mut harness).await;
            }
        )*
    };
}

macro_rules! outage_suite {
    ($fixture:expr) => {
        outage!($fixture;
            publishes_during_an_outage_answer_promptly_and_are_on_the_log_after_it,
            a_full_queue_refuses_a_publish_and_queues_nothing_of_it,
        );
    };
}

mod kafka {
    suite!(super::KafkaHarness::new());

    mod frozen {
        outage_suite!(crate::KafkaOutage::start(crate::Fault::Freeze));
    }

    mod killed {
        outage_suite!(crate::KafkaOutage::start(crate::Fault::Kill));
    }

    #[tokio::test]
    async fn a_producer_knows_at_once_that_its_broker_is_gone() {
        super::a_producer_knows_at_once_that_its_broker_is_gone().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_eager_producer_gets_its_id_and_queued_facts_reach_the_log() {
        super::the_eager_producer_gets_its_id_and_queued_facts_reach_the_log().await;
    }

    #[tokio::test]
    async fn waiting_for_the_producer_ids_ends_when_both_have_theirs() {
        super::waiting_for_the_producer_ids_ends_when_both_have_theirs().await;
    }

    #[tokio::test]
    async fn waiting_for_the_producer_ids_with_no_broker_gives_up_in_time() {
        super::waiting_for_the_producer_ids_with_no_broker_gives_up_in_time().await;
    }
}

mod sqlite {
    suite!(async { Some(super::SqliteHarness::new().await) });

    mod locked {
        outage_suite!(async { Some(crate::SqliteOutage::new().await) });
    }

    // Beyond the port: what only the embedded log promises.

    #[tokio::test]
    async fn a_publish_wakes_a_reader_of_the_same_log_at_once() {
        let h = super::SqliteHarness::new().await;
        super::a_publish_wakes_a_reader_at_once(&h.log, h.log.reader(), std::time::Duration::from_millis(50)).await;
    }

    #[tokio::test]
    async fn a_reader_of_another_log_value_sees_publishes_by_polling() {
        let h = super::SqliteHarness::new().await;
        // Same file, no shared `Notify`: like a writer in another process.
        let other = store::SqliteLog::new(h.pool(), "tollgate.");
        super::a_publish_wakes_a_reader_at_once(&h.log, other.reader(), std::time::Duration::from_millis(250)).await;
    }

    #[tokio::test]
    async fn a_dead_letter_records_its_source() {
        super::a_dead_letter_records_its_source(&super::SqliteHarness::new().await).await;
    }

    #[tokio::test]
    async fn a_record_is_dead_lettered_at_most_once() {
        super::a_record_is_dead_lettered_at_most_once(&super::SqliteHarness::new().await).await;
    }

    #[tokio::test]
    async fn a_log_made_before_append_times_gains_them() {
        super::a_log_made_before_append_times_gains_them().await;
    }

    #[tokio::test]
    async fn published_records_survive_reopening_the_file() {
        super::published_records_survive_reopening_the_file().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_publishes_stay_whole_and_contiguous() {
        let h = super::SqliteHarness::new().await;
        let sent = super::publishers_publishes();
        // One task per publisher, on four worker threads: the writer's queue
        // is fed from several threads at once.
        let tasks: Vec<_> = sent
            .iter()
            .cloned()
            .map(|publishes| {
                let log = h.log.clone();
                tokio::spawn(async move {
                    for facts in &publishes {
                        meter::Log::publish(&log, facts).await.expect("publish");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("a publisher task");
        }
        super::assert_each_publish_read_back_once(&h, &sent, super::Contiguity::Contiguous).await;
    }

    #[tokio::test]
    async fn a_failed_publish_fails_its_whole_batch_and_leaves_nothing() {
        super::a_failed_publish_fails_its_whole_batch_and_leaves_nothing(&super::SqliteHarness::new().await).await;
    }

    #[test]
    fn a_log_outlives_the_runtime_that_started_its_writer() {
        super::a_log_outlives_the_runtime_that_started_its_writer();
    }
}

// ---------------------------------------------------------------- helpers

fn at() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-07-07T12:31:00.123456Z").expect("ts").with_timezone(&Utc)
}

/// A distinct, fully populated fact.
fn fact(project: &str, n: usize) -> UsageFact {
    UsageFact {
        id: EventId::parse(format!("{project}-e{n}")).expect("event id"),
        project_id: ProjectId::parse(project).expect("project id"),
        api_key_id: Some(ApiKeyId::parse(format!("{project}-k1")).expect("key id")),
        agent_id: Some(format!("agent-{n}")),
        actor_id: None,
        user_id: (n % 4 == 1).then(|| format!("user:u{n}")),
        occurred_at: at() + chrono::Duration::milliseconds(n as i64),
        kind: EventKind::ALL[n % EventKind::ALL.len()],
        outcome: if n.is_multiple_of(3) { Outcome::Failure } else { Outcome::Success },
        rows: n as u64 * 7,
        tokens: if n % 5 == 2 {
            vec![meter::TokenUsage {
                provider: "openai".into(),
                model: format!("m{n}"),
                input: n as u64,
                ..Default::default()
            }]
        } else {
            Vec::new()
        },
        storage_bytes: (n % 6 == 3).then_some(n as i64 - 100),
        meter_type: None,
        reservation_id: None,
        gateway: "gw-test".into(),
        received_at: Some(at() + chrono::Duration::milliseconds(n as i64 + 3)),
        ..UsageFact::new(
            EventId::parse(format!("{project}-e{n}")).expect("event id"),
            ProjectId::parse(project).expect("project id"),
            EventKind::Request,
            at(),
        )
    }
}

/// Facts of three projects, interleaved.
fn facts(n: usize) -> Vec<UsageFact> {
    (0..n).map(|i| fact(["pa", "pb", "pc"][i % 3], i)).collect()
}

fn decode(records: &[LogRecord]) -> Vec<UsageFact> {
    records.iter().map(|r| schemas::decode_usage(&r.payload).expect("a published fact decodes")).collect()
}

/// A reader positioned at `at` on every partition.
async fn reader_at(h: &dyn Harness, at: i64) -> Box<dyn LogReader> {
    let mut reader = h.reader().await;
    let partitions = reader.partitions().await.expect("partitions");
    assert!(!partitions.is_empty(), "a usage topic has partitions");
    let positions: BTreeMap<i32, i64> = partitions.into_iter().map(|p| (p, at)).collect();
    reader.seek(&positions).await.expect("seek");
    reader
}

/// Polls until `n` records arrived; fails the test at the deadline.
async fn read_n(reader: &mut dyn LogReader, n: usize) -> Vec<LogRecord> {
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n {
        assert!(started.elapsed() < DEADLINE, "only {} of {n} records within {DEADLINE:?}", out.len());
        let batch = reader.poll(n - out.len(), Duration::from_millis(500)).await.expect("poll");
        assert!(out.len() + batch.len() <= n, "poll returned more than asked for");
        out.extend(batch);
    }
    out
}

/// Asserts nothing more is on the log after the reader's position.
async fn assert_nothing_more(reader: &mut dyn LogReader) {
    let extra = reader.poll(100, Duration::from_millis(300)).await.expect("poll");
    assert!(extra.is_empty(), "unexpected records: {:?}", extra.iter().map(|r| r.offset).collect::<Vec<_>>());
}

fn assert_increasing(records: &[LogRecord]) {
    for w in records.windows(2) {
        assert_eq!(w[0].partition, w[1].partition, "one partition");
        assert!(w[0].offset < w[1].offset, "offsets increase: {} then {}", w[0].offset, w[1].offset);
    }
}

// ---------------------------------------------------------------- the suite

async fn published_facts_read_back_in_order(h: &dyn Harness) {
    let sent = facts(60);
    h.log().publish(&sent[..25]).await.expect("publish");
    h.log().publish(&sent[25..]).await.expect("publish");
    h.log().publish(&[]).await.expect("publishing nothing is fine");

    let mut reader = reader_at(h, 0).await;
    let got = read_n(reader.as_mut(), sent.len()).await;
    assert_eq!(decode(&got), sent);
    assert_increasing(&got);
    for (r, f) in got.iter().zip(&sent) {
        assert_eq!(r.key.as_deref(), Some(f.project_id.as_str().as_bytes()), "keyed by project");
        assert_eq!(r.payload, schemas::encode_usage(f).expect("encode"), "the bytes as encoded");
    }
    assert_nothing_more(reader.as_mut()).await;
}

/// Audit entries go to the audit topic, read back in order with their
/// project as the key (`installation` for an installation-wide one), and
/// usage facts stay on theirs: neither reader sees the other's records.
async fn audit_entries_read_back_from_their_own_topic(h: &dyn Harness) {
    let at = at();
    let entries: Vec<AuditEntry> = (0..5)
        .map(|n| AuditEntry {
            id: AuditId::parse(format!("aud_{n:04}")).expect("id"),
            // The last is installation-wide (a write of prices).
            project_id: (n < 4).then(|| ProjectId::parse(if n % 2 == 0 { "pa" } else { "pb" }).expect("id")),
            action: AuditAction::CreateQuota,
            principal: Some(Principal::new("admin", "api")),
            resource: format!("quota_{n}"),
            detail: AuditDetail::QuotaChange { before: None, after: None },
            created_at: at + chrono::Duration::microseconds(n),
        })
        .collect();
    let usage = facts(3);
    h.log().publish(&usage).await.expect("publish usage");
    h.audit_log().publish_audit(&entries[..2]).await.expect("publish audit");
    h.audit_log().publish_audit(&entries[2..]).await.expect("publish audit");
    h.audit_log().publish_audit(&[]).await.expect("publishing nothing is fine");

    let mut audit = h.audit_reader().await;
    let partitions = audit.partitions().await.expect("partitions");
    audit.seek(&partitions.into_iter().map(|p| (p, 0)).collect()).await.expect("seek");
    let got = read_n(audit.as_mut(), entries.len()).await;
    let decoded: Vec<AuditEntry> = got.iter().map(|r| schemas::decode_audit(&r.payload).expect("an entry")).collect();
    assert_eq!(decoded, entries);
    let keys: Vec<&[u8]> = got.iter().map(|r| r.key.as_deref().expect("a key")).collect();
    assert_eq!(keys, [&b"pa"[..], b"pb", b"pa", b"pb", b"installation"], "keyed by project, or installation");
    assert_nothing_more(audit.as_mut()).await;

    let mut reader = reader_at(h, 0).await;
    assert_eq!(decode(&read_n(reader.as_mut(), usage.len()).await), usage);
    assert_nothing_more(reader.as_mut()).await;
}

async fn seeking_to_a_stored_offset_resumes_exactly_there(h: &dyn Harness) {
    let sent = facts(20);
    h.log().publish(&sent).await.expect("publish");
    let mut first = reader_at(h, 0).await;
    let all = read_n(first.as_mut(), sent.len()).await;

    // What a projector stores after folding the first 7: last offset + 1.
    let k = 7;
    let stored = all[k - 1].offset + 1;
    let partition = all[k - 1].partition;

    // A new reader resumes there…
    let mut second = h.reader().await;
    second.seek(&BTreeMap::from([(partition, stored)])).await.expect("seek");
    let rest = read_n(second.as_mut(), sent.len() - k).await;
    assert_eq!(rest, all[k..], "exactly the records after the stored offset");
    assert_nothing_more(second.as_mut()).await;

    // …and so does the first one, sent back.
    first.seek(&BTreeMap::from([(partition, stored)])).await.expect("seek back");
    let again = read_n(first.as_mut(), sent.len() - k).await;
    assert_eq!(again, all[k..]);
    assert_nothing_more(first.as_mut()).await;

    // Records published later continue after the resumed ones, and the
    // ones before the stored offset never come back.
    let later: Vec<UsageFact> = (100..105).map(|i| fact("pd", i)).collect();
    h.log().publish(&later).await.expect("publish");
    let more = read_n(second.as_mut(), later.len()).await;
    assert_eq!(decode(&more), later);
    assert!(more.iter().all(|r| r.offset > all[sent.len() - 1].offset));
    assert_nothing_more(second.as_mut()).await;
}

async fn polling_an_empty_log_returns_nothing_after_the_wait(h: &dyn Harness) {
    let mut reader = reader_at(h, 0).await;
    let wait = Duration::from_millis(400);
    let started = Instant::now();
    let got = reader.poll(10, wait).await.expect("poll");
    let took = started.elapsed();
    assert!(got.is_empty());
    assert!(took >= wait - Duration::from_millis(50), "returned after {took:?}, before the wait");
    assert!(took < wait + Duration::from_secs(3), "returned after {took:?}, long after the wait");

    let started = Instant::now();
    assert!(reader.poll(10, Duration::ZERO).await.expect("poll").is_empty());
    assert!(started.elapsed() < Duration::from_secs(3), "a zero wait does not wait");
}

async fn a_waiting_poll_returns_a_record_published_meanwhile(h: &dyn Harness) {
    let mut reader = reader_at(h, 0).await;
    let sent = fact("pa", 1);
    let started = Instant::now();
    let publish = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        h.log().publish(std::slice::from_ref(&sent)).await.expect("publish");
    };
    let poll = async {
        let mut got = Vec::new();
        while got.is_empty() && started.elapsed() < DEADLINE {
            got = reader.poll(10, Duration::from_secs(10)).await.expect("poll");
        }
        (got, started.elapsed())
    };
    let ((got, took), ()) = tokio::join!(poll, publish);
    assert_eq!(decode(&got), [sent]);
    assert!(took < Duration::from_secs(10), "the poll waited its whole wait ({took:?})");
}

async fn a_dead_letter_keeps_the_original_bytes_and_the_reason(h: &dyn Harness) {
    let garbage = b"\xc3\x01not avro at all".to_vec();
    assert!(schemas::decode_usage(&garbage).is_err());
    h.publish_raw("pa", &garbage).await;
    h.log().publish(&[fact("pa", 1)]).await.expect("publish");

    let mut reader = reader_at(h, 0).await;
    let got = read_n(reader.as_mut(), 2).await;
    assert_eq!(got[0].payload, garbage);
    assert_eq!(got[0].key.as_deref(), Some(&b"pa"[..]));
    let reason = "malformed: not a single-object encoded usage event";
    reader.dead_letter(&got[0], reason).await.expect("dead letter");

    assert_eq!(h.dead_letters(1).await, [(garbage, reason.to_owned())]);
    // The dead letter is not on the usage topic.
    assert_nothing_more(reader.as_mut()).await;
}

async fn every_record_carries_the_logs_timestamp(h: &dyn Harness) {
    let before = Utc::now() - chrono::Duration::seconds(5);
    h.log().publish(&facts(3)).await.expect("publish");
    h.publish_raw("pa", b"raw bytes").await;
    let after = Utc::now() + chrono::Duration::seconds(5);
    let mut reader = reader_at(h, 0).await;
    let got = read_n(reader.as_mut(), 4).await;
    for r in &got {
        let t = r.timestamp.unwrap_or_else(|| panic!("record {} has no timestamp", r.offset));
        assert!(before <= t && t <= after, "record {} stamped {t}, outside [{before}, {after}]", r.offset);
        assert_eq!(t.timestamp_subsec_micros() % 1000, 0, "to the millisecond");
    }
    // Read again, a record has the same timestamp.
    let mut again = reader_at(h, 0).await;
    assert_eq!(read_n(again.as_mut(), 4).await, got);
}

async fn the_dlq_tells_which_records_it_holds_past_a_mark(h: &dyn Harness) {
    h.log().publish(&facts(4)).await.expect("publish");
    let mut reader = reader_at(h, 0).await;
    let got = read_n(reader.as_mut(), 4).await;
    let empty = reader.dead_letter_mark().await.expect("mark of an empty DLQ");
    assert!(reader.dead_lettered_since(&empty).await.expect("since").is_empty());
    reader.dead_letter(&got[0], "invalid: first").await.expect("dead letter");
    let mark = reader.dead_letter_mark().await.expect("mark");
    assert_ne!(mark, empty, "the mark moved");
    reader.dead_letter(&got[2], "invalid: third").await.expect("dead letter");
    reader.dead_letter(&got[3], "invalid: fourth").await.expect("dead letter");
    let at = |r: &LogRecord| (r.partition, r.offset);
    assert_eq!(
        reader.dead_lettered_since(&mark).await.expect("since the mark"),
        [at(&got[2]), at(&got[3])].into_iter().collect(),
        "only what is past the mark"
    );
    assert_eq!(reader.dead_lettered_since(&empty).await.expect("since the start").len(), 3);
    let end = reader.dead_letter_mark().await.expect("mark at the end");
    assert!(reader.dead_lettered_since(&end).await.expect("since the end").is_empty());
    // Another reader of the same topics sees the same.
    let mut other = reader_at(h, 0).await;
    assert_eq!(other.dead_lettered_since(&mark).await.expect("since").len(), 2);
    assert_eq!(h.dead_letters(3).await.len(), 3);
}

async fn facts_of_one_project_stay_in_order(h: &dyn Harness) {
    // Three publishers at once, each publishing its project's facts one
    // small batch at a time.
    let projects = ["pa", "pb", "pc"];
    let per_project = 12;
    let sent: BTreeMap<&str, Vec<UsageFact>> =
        projects.iter().map(|p| (*p, (0..per_project).map(|i| fact(p, i)).collect())).collect();
    futures::future::join_all(sent.values().map(|facts| async move {
        for chunk in facts.chunks(2) {
            h.log().publish(chunk).await.expect("publish");
        }
    }))
    .await;

    let mut reader = reader_at(h, 0).await;
    let got = read_n(reader.as_mut(), projects.len() * per_project).await;
    assert_increasing(&got);
    let mut seen: BTreeMap<String, Vec<UsageFact>> = BTreeMap::new();
    for (r, f) in got.iter().zip(decode(&got)) {
        assert_eq!(r.key.as_deref(), Some(f.project_id.as_str().as_bytes()));
        seen.entry(f.project_id.as_str().to_owned()).or_default().push(f);
    }
    for (project, facts) in &sent {
        assert_eq!(seen.get(*project), Some(facts), "the facts of {project}, in order");
    }
}

/// Concurrent publishers of the `many_concurrent_publishers…` tests.
const PUBLISHERS: usize = 64;
/// Publishes each of them makes, one after the other.
const PUBLISHES_EACH: usize = 50;

/// What each publisher publishes, in order: [`PUBLISHES_EACH`] publishes of
/// 1–3 facts of one project (`pa`, `pb` or `pc`), every fact distinct.
fn publishers_publishes() -> Vec<Vec<Vec<UsageFact>>> {
    (0..PUBLISHERS)
        .map(|t| {
            (0..PUBLISHES_EACH)
                .map(|i| {
                    let project = ["pa", "pb", "pc"][(t + i) % 3];
                    (0..1 + (t * 7 + i) % 3).map(|j| fact(project, t * 1_000 + i * 10 + j)).collect()
                })
                .collect()
        })
        .collect()
}

/// Whether one publish's facts must be next to each other on the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contiguity {
    /// Only in order: the port does not promise more (a Kafka publish is
    /// several sends, and another producer's record may fall between them).
    InOrder,
    /// In order with nothing between them (the SQLite log: one publish is in
    /// one transaction).
    Contiguous,
}

async fn many_concurrent_publishers_are_each_read_back_once(h: &dyn Harness) {
    let sent = publishers_publishes();
    // All publishers at once on this task: while one publish waits for its
    // acknowledgement the others queue theirs.
    futures::future::join_all(sent.iter().map(|publishes| async move {
        for facts in publishes {
            h.log().publish(facts).await.expect("publish");
        }
    }))
    .await;
    assert_each_publish_read_back_once(h, &sent, Contiguity::InOrder).await;
}

/// Every acknowledged fact is on the log exactly once, as sent, keyed by its
/// project; one publish's facts are in order (and contiguous if asked), and
/// one publisher's publishes are in the order it made them.
async fn assert_each_publish_read_back_once(h: &dyn Harness, sent: &[Vec<Vec<UsageFact>>], contiguity: Contiguity) {
    let total: usize = sent.iter().flatten().map(Vec::len).sum();
    let mut reader = reader_at(h, 0).await;
    let got = read_n(reader.as_mut(), total).await;
    assert_nothing_more(reader.as_mut()).await;
    assert_increasing(&got);
    let read = decode(&got);

    let mut position: HashMap<EventId, usize> = HashMap::new();
    for (k, (r, f)) in got.iter().zip(&read).enumerate() {
        assert_eq!(r.key.as_deref(), Some(f.project_id.as_str().as_bytes()), "keyed by project");
        assert!(position.insert(f.id.clone(), k).is_none(), "fact {} read twice", f.id);
    }
    for (t, publishes) in sent.iter().enumerate() {
        let mut previous_end = None;
        for (i, facts) in publishes.iter().enumerate() {
            let at: Vec<usize> = facts
                .iter()
                .map(|f| *position.get(&f.id).unwrap_or_else(|| panic!("acknowledged fact {} not on the log", f.id)))
                .collect();
            for (f, &k) in facts.iter().zip(&at) {
                assert_eq!(&read[k], f, "fact {} read back as sent", f.id);
            }
            for w in at.windows(2) {
                match contiguity {
                    Contiguity::Contiguous => {
                        assert_eq!(w[1], w[0] + 1, "publish {i} of publisher {t} is contiguous: {at:?}")
                    }
                    Contiguity::InOrder => assert!(w[0] < w[1], "publish {i} of publisher {t} in order: {at:?}"),
                }
            }
            if let (Some(end), Some(&start)) = (previous_end, at.first()) {
                assert!(end < start, "publisher {t}: publish {i} after publish {}", i - 1);
            }
            previous_end = at.last().copied();
        }
    }
}

// ---------------------------------------------------------------- Kafka

struct KafkaHarness {
    config: KafkaConfig,
    log: KafkaLog,
    audit: KafkaAuditLog,
}

impl KafkaHarness {
    /// `None`, and the test skipped, when the broker does not answer.
    async fn new() -> Option<KafkaHarness> {
        if !testkit::available(&[testkit::Service::Kafka]) {
            return None;
        }
        let mut config = KafkaConfig::new(testkit::env::kafka(), testkit::topic_prefix("tg-logconf"));
        config.partitions = 1;
        // Not an outage suite: a busy shared broker can take longer than the
        // 2 s default to acknowledge, which is not what these tests are about.
        config.publish = PublishOptions { timeout: Duration::from_secs(30), ..PublishOptions::default() };
        config.ensure_topics().await.expect("create the test topics");
        let log = KafkaLog::new(&config).expect("producer");
        let audit = KafkaAuditLog::new(&config).expect("audit producer");
        Some(KafkaHarness { config, log, audit })
    }
}

#[async_trait]
impl Harness for KafkaHarness {
    fn log(&self) -> &dyn Log {
        &self.log
    }

    async fn reader(&self) -> Box<dyn LogReader> {
        let group = format!("{}reader-{}", self.config.topic_prefix, uuid::Uuid::new_v4().simple());
        Box::new(KafkaReader::new(&self.config, &group).expect("consumer"))
    }

    fn audit_log(&self) -> &dyn AuditLog {
        &self.audit
    }

    async fn audit_reader(&self) -> Box<dyn LogReader> {
        let group = format!("{}audit-{}", self.config.topic_prefix, uuid::Uuid::new_v4().simple());
        Box::new(KafkaReader::audit(&self.config, &group).expect("consumer"))
    }

    async fn publish_raw(&self, key: &str, payload: &[u8]) {
        self.log.publish_raw(key, payload).await.expect("publish raw");
    }

    async fn dead_letters(&self, expected: usize) -> Vec<(Vec<u8>, String)> {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.config.brokers)
            .set("broker.address.family", "v4")
            .set("group.id", format!("{}dlq-check", self.config.topic_prefix))
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", "20")
            .create()
            .expect("dlq consumer");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.config.dlq_topic(), 0, Offset::Beginning).expect("partition");
        consumer.assign(&tpl).expect("assign");
        let started = Instant::now();
        let mut out = Vec::new();
        while out.len() < expected && started.elapsed() < DEADLINE {
            let Ok(m) = tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await else {
                continue;
            };
            let m = m.expect("read the dlq");
            let reason = m
                .headers()
                .and_then(|hs| hs.iter().find(|h| h.key == "tollgate-reason").and_then(|h| h.value))
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            out.push((m.payload().unwrap_or_default().to_vec(), reason));
        }
        out
    }
}

// ---------------------------------------------------------------- SQLite

/// A directory removed when the test ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("tollgate-logtest-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The log in the embedded store's file. Fields drop in order: the log
/// (a pool handle), then the directory.
struct SqliteHarness {
    log: SqliteLog,
    pool: sqlx::SqlitePool,
    _dir: TempDir,
}

impl SqliteHarness {
    async fn new() -> SqliteHarness {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.0.join("tollgate.db")).await.expect("open the test file");
        store.migrate().await.expect("migrate the store");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        log.ensure_schema().await.expect("log schema");
        log.ensure_schema().await.expect("ensuring the schema twice is harmless");
        SqliteHarness { log, pool: store.pool().clone(), _dir: dir }
    }
}

#[async_trait]
impl Harness for SqliteHarness {
    fn log(&self) -> &dyn Log {
        &self.log
    }

    async fn reader(&self) -> Box<dyn LogReader> {
        Box::new(self.log.reader())
    }

    fn audit_log(&self) -> &dyn AuditLog {
        &self.log
    }

    async fn audit_reader(&self) -> Box<dyn LogReader> {
        Box::new(self.log.audit_reader())
    }

    async fn publish_raw(&self, key: &str, payload: &[u8]) {
        self.log.publish_raw(key, payload).await.expect("publish raw");
    }

    async fn dead_letters(&self, _expected: usize) -> Vec<(Vec<u8>, String)> {
        self.log.dead_letters().await.expect("dead letters")
    }
}

impl SqliteHarness {
    fn pool(&self) -> sqlx::SqlitePool {
        self.pool.clone()
    }
}

/// A reader waiting on an empty log gets a record within `slack` of its
/// publish, far sooner than its wait.
async fn a_publish_wakes_a_reader_at_once(log: &SqliteLog, reader: SqliteLogReader, slack: Duration) {
    let mut reader = reader;
    assert!(reader.poll(10, Duration::ZERO).await.expect("poll").is_empty());
    let published_at = std::sync::Mutex::new(None);
    let publish = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        log.publish(&[fact("pa", 1)]).await.expect("publish");
        *published_at.lock().expect("lock") = Some(Instant::now());
    };
    let poll = async {
        let got = reader.poll(10, Duration::from_secs(5)).await.expect("poll");
        (got, Instant::now())
    };
    let ((got, woke), ()) = tokio::join!(poll, publish);
    assert_eq!(decode(&got), [fact("pa", 1)]);
    let published_at = published_at.lock().expect("lock").expect("published");
    let late = woke.saturating_duration_since(published_at);
    assert!(late <= slack, "woke {late:?} after the publish (allowed {slack:?})");
}

async fn a_dead_letter_records_its_source(h: &SqliteHarness) {
    h.log.publish(&[fact("pa", 1), fact("pb", 2)]).await.expect("publish");
    let mut reader = h.log.reader();
    let got = read_n(&mut reader, 2).await;
    reader.dead_letter(&got[1], "invalid: unknown project pb").await.expect("dead letter");
    let row: (String, String, i64, i64, Option<Vec<u8>>, Vec<u8>, String) = sqlx::query_as(
        "SELECT topic, source_topic, source_partition, source_offset, key, payload, reason FROM log_dead_letters",
    )
    .fetch_one(&h.pool())
    .await
    .expect("one dead letter");
    assert_eq!(
        row,
        (
            "tollgate.dlq".to_owned(),
            "tollgate.usage".to_owned(),
            i64::from(got[1].partition),
            got[1].offset,
            Some(b"pb".to_vec()),
            got[1].payload.clone(),
            "invalid: unknown project pb".to_owned(),
        )
    );
}

async fn a_record_is_dead_lettered_at_most_once(h: &SqliteHarness) {
    h.log.publish(&facts(2)).await.expect("publish");
    let mut reader = h.log.reader();
    let got = read_n(&mut reader, 2).await;
    reader.dead_letter(&got[1], "invalid: once").await.expect("dead letter");
    reader.dead_letter(&got[1], "invalid: twice").await.expect("the same record again is harmless");
    let mut other = h.log.reader();
    other.dead_letter(&got[1], "invalid: from another reader").await.expect("and from another reader");
    assert_eq!(h.dead_letters(1).await, [(got[1].payload.clone(), "invalid: once".to_owned())]);
}

/// A file whose log table predates the append time: records already there
/// have none, and the table gains the column.
async fn a_log_made_before_append_times_gains_them() {
    let dir = TempDir::new();
    let store = SqliteStore::open(&dir.0.join("tollgate.db")).await.expect("open");
    sqlx::query(
        r#"CREATE TABLE log_records ("offset" INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL,
           "partition" INTEGER NOT NULL, key BLOB, payload BLOB NOT NULL)"#,
    )
    .execute(store.pool())
    .await
    .expect("an old log table");
    sqlx::query(
        r#"INSERT INTO log_records (topic, "partition", key, payload) VALUES ('tollgate.usage', 0, x'7061', x'00')"#,
    )
    .execute(store.pool())
    .await
    .expect("an old record");
    let log = SqliteLog::new(store.pool().clone(), "tollgate.");
    log.ensure_schema().await.expect("schema");
    log.ensure_schema().await.expect("schema twice");
    let mut reader = log.reader();
    let got = read_n(&mut reader, 1).await;
    assert_eq!((got[0].payload.as_slice(), got[0].timestamp), (&b"\x00"[..], None));
    store.pool().close().await;
}

async fn published_records_survive_reopening_the_file() {
    let dir = TempDir::new();
    let path = dir.0.join("tollgate.db");
    let sent = facts(10);
    {
        let store = SqliteStore::open(&path).await.expect("open");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        log.ensure_schema().await.expect("schema");
        log.publish(&sent).await.expect("publish");
        store.pool().close().await;
    }
    let store = SqliteStore::open(&path).await.expect("reopen");
    let log = SqliteLog::new(store.pool().clone(), "tollgate.");
    log.ensure_schema().await.expect("schema again");
    let mut reader = log.reader();
    let got = read_n(&mut reader, sent.len()).await;
    assert_eq!(decode(&got), sent);
    store.pool().close().await;
}

async fn a_failed_publish_fails_its_whole_batch_and_leaves_nothing(h: &SqliteHarness) {
    // A record keyed `poison` cannot be inserted: its publish fails inside
    // the writer's transaction.
    sqlx::query(
        "CREATE TRIGGER poison BEFORE INSERT ON log_records WHEN NEW.key = CAST('poison' AS BLOB)
         BEGIN SELECT RAISE(ABORT, 'poisoned record'); END",
    )
    .execute(&h.pool())
    .await
    .expect("create the trigger");

    let publishes: Vec<Vec<UsageFact>> = (0..10)
        .map(|i| {
            if i == 5 {
                vec![fact("pa", 50), fact("poison", 51), fact("pa", 52)]
            } else {
                vec![fact("pa", i * 10), fact("pb", i * 10 + 1)]
            }
        })
        .collect();
    // The ten publishes are made one batch: this process's turn at the
    // file's write lock is held while a first publish keeps the writer
    // waiting for it, and all ten are queued before the turn is let go.
    let gate = store::sqlite_store::write_gate(&h.pool());
    let turn = gate.lock().await;
    let first = vec![fact("pz", 1)];
    let (first_outcome, outcomes) = tokio::join!(h.log.publish(&first), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut all = std::pin::pin!(futures::future::join_all(publishes.iter().map(|facts| h.log.publish(facts))));
        assert!(futures::poll!(&mut all).is_pending(), "the writer is held, so nothing is answered yet");
        drop(turn);
        all.await
    });
    first_outcome.expect("the first publish was a batch of its own");
    for (i, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Err(meter::PortError::Permanent(why)) => assert!(why.contains("poisoned record"), "publish {i}: {why}"),
            other => panic!("publish {i} shares the poisoned batch, so its error: got {other:?}"),
        }
    }
    let mut reader = reader_at(h, 0).await;
    assert_eq!(decode(&read_n(reader.as_mut(), 1).await), first);
    assert_nothing_more(reader.as_mut()).await;

    // The writer goes on; what failed never appears.
    let later = vec![fact("pc", 100), fact("pc", 101)];
    h.log.publish(&later).await.expect("a clean publish after the failed batch");
    let got = read_n(reader.as_mut(), later.len()).await;
    assert_eq!(decode(&got), later);
    assert_nothing_more(reader.as_mut()).await;
}

/// The writer runs on a thread of its own: the runtime of the log's first
/// publish can go, and a publish on another runtime is appended.
fn a_log_outlives_the_runtime_that_started_its_writer() {
    let runtime = || tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let sent = facts(6);
    let first = runtime();
    let h = first.block_on(SqliteHarness::new());
    first.block_on(h.log.publish(&sent[..3])).expect("publish on the first runtime");
    drop(first);

    let second = runtime();
    second.block_on(async {
        h.log.publish(&sent[3..]).await.expect("publish on the second runtime");
        let mut reader = reader_at(&h, 0).await;
        let got = read_n(reader.as_mut(), sent.len()).await;
        assert_eq!(decode(&got), sent);
        assert_nothing_more(reader.as_mut()).await;
    });
}

// ---------------------------------------------------------------- outages

/// The publish timeout of the outage suite's logs.
const PUBLISH_TIMEOUT: Duration = Duration::from_millis(1000);
/// What a publish may take beyond its bound (scheduling on a busy machine).
const SLACK: Duration = Duration::from_millis(500);

/// A log that can be made to stop answering, and mended.
#[async_trait]
trait OutageHarness: Harness {
    /// The log stops acknowledging (publishes hang or fail).
    async fn break_log(&mut self);
    /// The log answers again.
    async fn mend_log(&mut self);
    /// How long after [`OutageHarness::break_log`] the log is surely known
    /// to be down (a failed attempt was reported).
    fn known_down_after(&self) -> Duration;
    /// A log over the same backend whose queue holds at most `queue` records.
    fn log_with_queue(&self, queue: usize) -> Box<dyn Log>;
}

/// Polls until every fact in `sent` is on the log (at least once; a fact
/// sent again after a lost acknowledgement may be there twice), and nothing
/// else is; fails the test at the deadline.
async fn assert_all_on_the_log(h: &dyn Harness, sent: &[UsageFact]) {
    let want: std::collections::BTreeSet<&EventId> = sent.iter().map(|f| &f.id).collect();
    let mut reader = reader_at(h, 0).await;
    let started = Instant::now();
    let mut got: Vec<UsageFact> = Vec::new();
    loop {
        let seen: std::collections::BTreeSet<&EventId> = got.iter().map(|f| &f.id).collect();
        if seen == want {
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "after {DEADLINE:?} the log holds {} of {} facts",
            seen.intersection(&want).count(),
            want.len()
        );
        got.extend(decode(&reader.poll(1000, Duration::from_millis(300)).await.expect("poll")));
    }
    for f in &got {
        let original = sent.iter().find(|s| s.id == f.id).expect("only facts that were sent");
        assert_eq!(f, original, "fact {} read back as sent", f.id);
    }
    assert!(got.len() <= 2 * sent.len(), "{} records for {} facts", got.len(), sent.len());
}

async fn publishes_during_an_outage_answer_promptly_and_are_on_the_log_after_it(h: &mut dyn OutageHarness) {
    let before = facts(3);
    // A new producer's first publish may take longer than the timeout
    // (connecting, getting a producer id): not yet part of the test.
    let started = Instant::now();
    while let Err(e) = h.log().publish(&before).await {
        assert!(started.elapsed() < DEADLINE, "the log never answered before the outage: {e}");
    }

    h.break_log().await;
    let broke = Instant::now();
    let mut during = Vec::new();
    let mut n = 100;
    // Publishes until the log is surely known to be down, and a few more.
    let mut after_known = 0;
    while after_known < 3 {
        let known = broke.elapsed() > h.known_down_after();
        let facts: Vec<UsageFact> = (0..2).map(|_| fact("pa", next(&mut n))).collect();
        let started = Instant::now();
        let outcome = h.log().publish(&facts).await;
        let took = started.elapsed();
        match outcome {
            Err(PortError::Transient(_)) => {}
            other => panic!("a publish during the outage answered {other:?}"),
        }
        assert!(took <= PUBLISH_TIMEOUT + SLACK, "a publish during the outage took {took:?}");
        if known {
            assert!(took <= Duration::from_millis(100) + SLACK, "the log is known down, yet a publish took {took:?}");
            after_known += 1;
        }
        // A client retrying with the same facts: not queued twice.
        assert!(h.log().publish(&facts).await.is_err(), "a retry during the outage is not acknowledged either");
        during.extend(facts);
        assert!(broke.elapsed() < DEADLINE, "the log was never known to be down");
    }
    let e = h.log().flush(Duration::from_millis(200)).await.expect_err("nothing can be flushed during the outage");
    assert!(e.is_transient(), "{e}");

    h.mend_log().await;
    h.log().flush(DEADLINE).await.expect("everything queued reaches the log after the outage");
    let after = vec![fact("pb", next(&mut n))];
    let started = Instant::now();
    loop {
        match h.log().publish(&after).await {
            Ok(()) => break,
            Err(e) => {
                assert!(e.is_transient(), "{e}");
                assert!(started.elapsed() < DEADLINE, "the log never acknowledged again: {e}");
            }
        }
    }
    let all: Vec<UsageFact> = before.into_iter().chain(during).chain(after).collect();
    assert_all_on_the_log(h, &all).await;
}

async fn a_full_queue_refuses_a_publish_and_queues_nothing_of_it(h: &mut dyn OutageHarness) {
    let log = h.log_with_queue(3);
    h.break_log().await;
    let queued = vec![fact("pa", 1), fact("pa", 2)];
    assert!(log.publish(&queued).await.expect_err("the log is down").is_transient());
    let refused = vec![fact("pa", 3), fact("pa", 4)];
    let e = log.publish(&refused).await.expect_err("the queue is full");
    assert!(e.is_transient() && e.to_string().contains("queue is full"), "{e}");
    // A queued fact does not count again: one more fits.
    let last = vec![fact("pa", 1), fact("pa", 5)];
    let e = log.publish(&last).await.expect_err("the log is down");
    assert!(!e.to_string().contains("queue is full"), "{e}");

    h.mend_log().await;
    log.flush(DEADLINE).await.expect("the queued facts reach the log");
    assert_all_on_the_log(h, &[fact("pa", 1), fact("pa", 2), fact("pa", 5)]).await;
}

fn next(n: &mut usize) -> usize {
    *n += 1;
    *n
}

/// How a [`KafkaOutage`] takes its broker down.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// `SIGSTOP`: connections stay up, nothing answers.
    Freeze,
    /// `SIGKILL`, then a restart on the same file and port.
    Kill,
}

/// A broker of the test's own, and a log on it with short timeouts.
struct KafkaOutage {
    tansu: testkit::Tansu,
    fault: Fault,
    config: KafkaConfig,
    log: KafkaLog,
}

impl KafkaOutage {
    /// Always `Some`: the broker is the test's own (`testkit::Tansu`
    /// panics, naming the binary, when tansu is not installed).
    async fn start(fault: Fault) -> Option<KafkaOutage> {
        let tansu = testkit::Tansu::start().await;
        let mut config = KafkaConfig::new(tansu.brokers(), testkit::topic_prefix("tg-outage"));
        config.partitions = 1;
        config.publish = PublishOptions { timeout: PUBLISH_TIMEOUT, ..PublishOptions::default() };
        let started = Instant::now();
        while let Err(e) = config.ensure_topics().await {
            assert!(started.elapsed() < DEADLINE, "create the test topics: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let log = KafkaLog::new(&config).expect("producer");
        Some(KafkaOutage { tansu, fault, config, log })
    }
}

#[async_trait]
impl Harness for KafkaOutage {
    fn log(&self) -> &dyn Log {
        &self.log
    }

    async fn reader(&self) -> Box<dyn LogReader> {
        let group = format!("{}reader-{}", self.config.topic_prefix, uuid::Uuid::new_v4().simple());
        Box::new(KafkaReader::new(&self.config, &group).expect("consumer"))
    }

    async fn publish_raw(&self, key: &str, payload: &[u8]) {
        self.log.publish_raw(key, payload).await.expect("publish raw");
    }

    async fn dead_letters(&self, _expected: usize) -> Vec<(Vec<u8>, String)> {
        unreachable!("the outage suite reads no dead letters")
    }
}

#[async_trait]
impl OutageHarness for KafkaOutage {
    async fn break_log(&mut self) {
        match self.fault {
            Fault::Freeze => self.tansu.freeze(),
            Fault::Kill => self.tansu.stop(),
        }
    }

    async fn mend_log(&mut self) {
        match self.fault {
            Fault::Freeze => self.tansu.thaw(),
            Fault::Kill => self.tansu.restart().await,
        }
    }

    fn known_down_after(&self) -> Duration {
        // A frozen broker shows when a publish waited its whole timeout; a
        // killed one as soon as librdkafka finds its connection refused.
        PUBLISH_TIMEOUT + Duration::from_millis(500)
    }

    fn log_with_queue(&self, queue: usize) -> Box<dyn Log> {
        let mut config = self.config.clone();
        config.publish.queue = queue;
        Box::new(KafkaLog::new(&config).expect("producer"))
    }
}

/// A KafkaLog on a port nothing listens on: once librdkafka finds every
/// broker down (connection refused; no record has timed out, none ever
/// will) the producer knows, and a publish answers at once.
async fn a_producer_knows_at_once_that_its_broker_is_gone() {
    let mut config = KafkaConfig::new(format!("127.0.0.1:{}", testkit::free_port()), "tg-gone.");
    config.publish = PublishOptions { timeout: PUBLISH_TIMEOUT, ..PublishOptions::default() };
    let log = KafkaLog::new(&config).expect("producer");
    let started = Instant::now();
    let e = log.publish(&[fact("pa", 1)]).await.expect_err("nothing listens");
    assert!(e.is_transient(), "{e}");
    assert!(started.elapsed() <= PUBLISH_TIMEOUT + SLACK, "took {:?}", started.elapsed());
    while log.state().down().is_none() {
        assert!(started.elapsed() < Duration::from_secs(10), "the producer never noticed its broker is gone");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let why = log.state().down().expect("down");
    assert!(why.contains("all brokers down"), "{why}");
    let started = Instant::now();
    let e = log.publish(&[fact("pa", 2)]).await.expect_err("still nothing listens");
    assert!(e.to_string().contains("log unavailable"), "{e}");
    assert!(started.elapsed() <= Duration::from_millis(100) + SLACK, "took {:?}", started.elapsed());
    assert_eq!(log.queued(), 2, "both facts stay queued");
}

/// The producer that takes the pump's small attempts (no linger) says
/// when it has its producer id (its statistics): facts queued before then
/// go on the other producer, and those queued after on it, and all reach
/// the log.
async fn the_eager_producer_gets_its_id_and_queued_facts_reach_the_log() {
    let Some(h) = KafkaHarness::new().await else { return };
    let log = KafkaLog::new(&h.config).expect("a fresh producer");
    assert!(log.queue(&[fact("pe", 0)]).is_some_and(|r| r.is_ok()), "queued");
    let started = Instant::now();
    while !log.eager_has_id() {
        assert!(started.elapsed() < Duration::from_secs(10), "the eager producer never said it has its id");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in 1..4 {
        assert!(log.queue(&[fact("pe", n)]).is_some_and(|r| r.is_ok()), "queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    log.flush(Duration::from_secs(30)).await.expect("every queued fact acknowledged");
    let mut reader = reader_at(&h, 0).await;
    let mut ids: Vec<String> =
        decode(&read_n(reader.as_mut(), 4).await).into_iter().map(|f| f.id.as_str().to_owned()).collect();
    assert_nothing_more(reader.as_mut()).await;
    ids.sort();
    assert_eq!(ids, ["pe-e0", "pe-e1", "pe-e2", "pe-e3"]);
}

/// A fresh log's producers have no producer id at first (librdkafka asks
/// for it half a second after a producer is made, and its first
/// statistics come after 100 ms); `wait_for_ids` returns once both have
/// theirs, and a fact published then is on the log.
async fn waiting_for_the_producer_ids_ends_when_both_have_theirs() {
    let Some(h) = KafkaHarness::new().await else { return };
    let log = KafkaLog::new(&h.config).expect("a fresh producer");
    assert!(!log.has_ids(), "no statistics yet, so no id known");
    let started = Instant::now();
    assert!(log.wait_for_ids(Duration::from_secs(10)).await, "both producers got their ids");
    assert!(log.has_ids() && log.eager_has_id());
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(100), "returned before any statistics: {waited:?}");
    log.publish(&[fact("pw", 0)]).await.expect("published");
    let mut reader = reader_at(&h, 0).await;
    let ids: Vec<String> =
        decode(&read_n(reader.as_mut(), 1).await).into_iter().map(|f| f.id.as_str().to_owned()).collect();
    assert_eq!(ids, ["pw-e0"]);
}

/// With nothing listening, the producers never get their ids: the wait
/// gives up after the time it was given, not before and not much after.
async fn waiting_for_the_producer_ids_with_no_broker_gives_up_in_time() {
    let config = KafkaConfig::new(format!("127.0.0.1:{}", testkit::free_port()), "tg-noid.");
    let log = KafkaLog::new(&config).expect("producer");
    let started = Instant::now();
    assert!(!log.wait_for_ids(Duration::from_millis(800)).await, "no broker, no id");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(800) && waited < Duration::from_millis(800) + SLACK, "{waited:?}");
    assert!(!log.has_ids());
}

/// The embedded log on a file whose write lock another connection can hold.
struct SqliteOutage {
    log: SqliteLog,
    pool: sqlx::SqlitePool,
    path: PathBuf,
    holder: Option<sqlx::SqliteConnection>,
    _dir: TempDir,
}

impl SqliteOutage {
    /// The log's connections give up on the lock after 300 ms, so a held
    /// lock shows as a failed (transient) attempt within the publish timeout.
    const BUSY: Duration = Duration::from_millis(300);

    async fn new() -> SqliteOutage {
        let dir = TempDir::new();
        let path = dir.0.join("log.db");
        let pool = Self::pool(&path).await;
        let log = SqliteLog::with_options(
            pool.clone(),
            "tollgate.",
            PublishOptions { timeout: PUBLISH_TIMEOUT, ..PublishOptions::default() },
        );
        log.ensure_schema().await.expect("log schema");
        SqliteOutage { log, pool, path, holder: None, _dir: dir }
    }

    async fn pool(path: &std::path::Path) -> sqlx::SqlitePool {
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .busy_timeout(Self::BUSY);
        sqlx::sqlite::SqlitePoolOptions::new().max_connections(4).connect_with(options).await.expect("open")
    }
}

#[async_trait]
impl Harness for SqliteOutage {
    fn log(&self) -> &dyn Log {
        &self.log
    }

    async fn reader(&self) -> Box<dyn LogReader> {
        Box::new(self.log.reader())
    }

    async fn publish_raw(&self, key: &str, payload: &[u8]) {
        self.log.publish_raw(key, payload).await.expect("publish raw");
    }

    async fn dead_letters(&self, _expected: usize) -> Vec<(Vec<u8>, String)> {
        self.log.dead_letters().await.expect("dead letters")
    }
}

#[async_trait]
impl OutageHarness for SqliteOutage {
    async fn break_log(&mut self) {
        use sqlx::Connection;
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&self.path);
        let mut holder = sqlx::SqliteConnection::connect_with(&options).await.expect("a second connection");
        sqlx::query("BEGIN IMMEDIATE").execute(&mut holder).await.expect("take the write lock");
        self.holder = Some(holder);
    }

    async fn mend_log(&mut self) {
        if let Some(mut holder) = self.holder.take() {
            sqlx::query("ROLLBACK").execute(&mut holder).await.expect("release the write lock");
        }
    }

    fn known_down_after(&self) -> Duration {
        Self::BUSY + Duration::from_millis(500)
    }

    fn log_with_queue(&self, queue: usize) -> Box<dyn Log> {
        Box::new(SqliteLog::with_options(
            self.pool.clone(),
            "tollgate.",
            PublishOptions { timeout: PUBLISH_TIMEOUT, queue },
        ))
    }
}
