//! The projector over the embedded store and log (SQLite, a file per test)
//! and the in-memory view, driven step by step with a clock set by hand:
//!
//! - lateness is judged by each record's receipt, never by the projector's
//!   clock;
//! - a record the store refuses is isolated (the batch bisected) and
//!   dead-lettered with the store's reason, the rest folded; a store that
//!   refuses everything stops the projector instead;
//! - a dead letter reaches the DLQ once, through a DLQ that fails, a
//!   projector that dies mid-publish, and two projectors racing (a fake DLQ
//!   here that keeps every write, duplicates included, as Kafka would);
//! - the dedup set is purged from the fold's position.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    ApiKeyId, Clock, DlqMark, EventId, EventKind, Ledger, LogReader, LogRecord, ManualClock, PortError, PortResult,
    Project, ProjectId, TenantStore, UsageFact,
};
use projector::{Projector, ProjectorConfig};
use store::{MemoryView, SqliteLog, SqliteLogReader, SqliteStore};

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

fn pid() -> ProjectId {
    ProjectId::parse("p1").expect("id")
}

/// A successful call of `p1`, with the receipt given (or none).
fn call(id: &str, occurred: DateTime<Utc>, received: Option<DateTime<Utc>>) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse("k1").expect("id")),
        rows: 2,
        gateway: "gw".into(),
        received_at: received,
        ..UsageFact::new(EventId::parse(id).expect("id"), pid(), EventKind::Call, occurred)
    }
}

/// What a DLQ holds: the source (partition, offset) and the reason of each write.
type Letters = Arc<Mutex<Vec<((i32, i64), String)>>>;

/// A DLQ that keeps every write, duplicates included (as Kafka would), and
/// can be told to fail.
#[derive(Clone, Default)]
struct Dlq {
    letters: Letters,
    /// Writes to refuse before they happen.
    fail_before: Arc<AtomicUsize>,
    /// Writes to make and then hang on (an attempt cut short by a kill).
    hang_after: Arc<AtomicUsize>,
}

impl Dlq {
    fn letters(&self) -> Vec<((i32, i64), String)> {
        self.letters.lock().expect("lock").clone()
    }

    fn distinct(&self) -> BTreeSet<(i32, i64)> {
        self.letters().into_iter().map(|(at, _)| at).collect()
    }
}

/// The embedded reader, dead-lettering into a [`Dlq`].
struct Reader {
    inner: SqliteLogReader,
    dlq: Dlq,
}

fn take(n: &AtomicUsize) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1)).is_ok()
}

#[async_trait]
impl LogReader for Reader {
    async fn partitions(&mut self) -> PortResult<Vec<i32>> {
        self.inner.partitions().await
    }

    async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()> {
        self.inner.seek(positions).await
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> PortResult<Vec<LogRecord>> {
        self.inner.poll(max, wait).await
    }

    async fn dead_letter(&mut self, record: &LogRecord, reason: &str) -> PortResult<()> {
        if take(&self.dlq.fail_before) {
            return Err(PortError::Transient("the DLQ is down".into()));
        }
        self.dlq.letters.lock().expect("lock").push(((record.partition, record.offset), reason.to_owned()));
        if take(&self.dlq.hang_after) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn dead_letter_mark(&mut self) -> PortResult<DlqMark> {
        let n = self.dlq.letters.lock().expect("lock").len();
        Ok(DlqMark::from([(0, i64::try_from(n).expect("small"))]))
    }

    async fn dead_lettered_since(&mut self, mark: &DlqMark) -> PortResult<BTreeSet<(i32, i64)>> {
        let from = usize::try_from(mark.get(&0).copied().unwrap_or(0)).expect("small");
        Ok(self.dlq.letters.lock().expect("lock").iter().skip(from).map(|(at, _)| *at).collect())
    }
}

/// A store and a log in one fresh file, with project `p1`.
struct Rig {
    store: SqliteStore,
    log: SqliteLog,
    view: MemoryView,
    clock: ManualClock,
    dlq: Dlq,
    dir: PathBuf,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Rig {
    async fn new() -> Rig {
        let dir = std::env::temp_dir().join(format!("tollgate-projector-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let store = SqliteStore::open(&dir.join("tollgate.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        log.ensure_schema().await.expect("log schema");
        let project = Project {
            id: pid(),
            name: "p".into(),
            timezone: chrono_tz::Tz::UTC,
            created_at: utc("2026-01-01T00:00:00Z"),
        };
        store.create_project(&project).await.expect("project");
        // The projector's clock is far from every receipt: it must not matter.
        let clock = ManualClock::new(utc("2031-03-03T03:03:03Z"));
        Rig { store, log, view: MemoryView::new(), clock, dlq: Dlq::default(), dir }
    }

    fn config(&self) -> ProjectorConfig {
        let mut c = ProjectorConfig::new(self.log.usage_topic());
        c.poll_wait = Duration::from_millis(50);
        c
    }

    async fn projector(&self, config: ProjectorConfig) -> Projector<Reader> {
        let reader = Reader { inner: self.log.reader(), dlq: self.dlq.clone() };
        let mut p = Projector::new(
            reader,
            Arc::new(self.store.clone()),
            Arc::new(self.view.clone()),
            Arc::new(self.clock.clone()),
            config,
        );
        p.start().await.expect("start");
        p
    }

    async fn publish(&self, facts: &[UsageFact]) {
        meter::Log::publish(&self.log, facts).await.expect("publish");
    }

    /// Durable calls of `p1` in all its day windows.
    async fn calls(&self) -> i64 {
        sqlx::query_scalar("SELECT CAST(COALESCE(SUM(calls), 0) AS INTEGER) FROM usage_aggregates WHERE project_id = 'p1' AND dimension = 'p' AND window_kind = 'day'")
            .fetch_one(self.store.pool())
            .await
            .expect("calls")
    }

    async fn next_offset(&self) -> i64 {
        let offsets = self.store.offsets("tollgate-projector", self.log.usage_topic()).await.expect("offsets");
        offsets.get(&0).copied().unwrap_or(0)
    }

    async fn last_offset(&self) -> i64 {
        sqlx::query_scalar(r#"SELECT MAX("offset") FROM log_records"#)
            .fetch_one(self.store.pool())
            .await
            .expect("offset")
    }

    /// The dead letters the store holds, not yet published, as (offset, reason).
    async fn pending_dead_letters(&self) -> Vec<(i64, String)> {
        let far = self.clock.now() + chrono::Duration::days(365);
        let pending = self
            .store
            .claim_dead_letters("tollgate-projector", self.log.usage_topic(), "probe", far, far, 1000)
            .await
            .expect("claim");
        pending.into_iter().map(|p| (p.letter.offset, p.letter.reason)).collect()
    }

    /// Every record the log holds was folded or dead-lettered, once.
    async fn assert_accounted(&self) {
        let offsets: Vec<i64> = sqlx::query_scalar(r#"SELECT "offset" FROM log_records ORDER BY "offset""#)
            .fetch_all(self.store.pool())
            .await
            .expect("log");
        let folded: BTreeSet<String> = sqlx::query_scalar("SELECT event_id FROM processed_events")
            .fetch_all(self.store.pool())
            .await
            .expect("dedup set")
            .into_iter()
            .collect();
        let mut reader = self.log.reader();
        let records = reader.poll(10_000, Duration::from_millis(100)).await.expect("read the log");
        assert_eq!(records.len(), offsets.len());
        let dead = self.dlq.distinct();
        assert_eq!(dead.len(), self.dlq.letters().len(), "a dead letter written twice: {:?}", self.dlq.letters());
        for r in &records {
            let in_fold = schemas::decode_usage(&r.payload).is_ok_and(|f| folded.contains(f.id.as_str()));
            let in_dlq = dead.contains(&(r.partition, r.offset));
            assert!(in_fold ^ in_dlq, "record {} folded: {in_fold}, dead-lettered: {in_dlq}", r.offset);
        }
    }
}

async fn drain(p: &mut Projector<Reader>) {
    for _ in 0..100 {
        if p.step().await.expect("step").read == 0 {
            return;
        }
    }
    panic!("the projector did not catch up");
}

#[tokio::test]
async fn lateness_is_judged_by_receipt_never_by_the_projectors_clock() {
    let rig = Rig::new().await;
    let now = Utc::now();
    let day = chrono::Duration::days(1);
    let facts = vec![
        // Received on time months before the projector's clock: folded.
        call("on-time", utc("2026-07-01T00:00:00Z"), Some(utc("2026-07-01T00:00:01Z"))),
        // Late, but inside the horizon at its receipt: folded.
        call("late", utc("2026-07-01T00:00:00Z"), Some(utc("2026-08-01T00:00:00Z"))),
        // 61 days old at its receipt: out of range.
        call("too-old", utc("2026-05-01T00:00:00Z"), Some(utc("2026-07-01T00:00:00Z"))),
        // Ten minutes ahead of its receipt: out of range.
        call("future", utc("2026-07-01T00:10:00Z"), Some(utc("2026-07-01T00:00:00Z"))),
        // Unstamped: the log's append time (now) is its receipt.
        call("unstamped-old", now - day * 40, None),
        call("unstamped-new", now - chrono::Duration::minutes(1), None),
    ];
    rig.publish(&facts).await;
    // Keep every id (the July ones are far behind the newest receipt, now),
    // so the accounting below can find them in the dedup set.
    let mut config = rig.config();
    config.receipt_disorder = chrono::Duration::days(3650);
    let mut p = rig.projector(config).await;
    let r = p.step().await.expect("step");
    assert_eq!((r.read, r.folded, r.dead_lettered), (6, 3, 3), "{r:?}");
    assert_eq!(rig.calls().await, 3);
    let reasons: BTreeMap<i64, String> = rig.dlq.letters().into_iter().map(|((_, o), why)| (o, why)).collect();
    let first = rig.last_offset().await - 5;
    assert!(
        reasons[&(first + 2)].starts_with("out of range: occurred_at: is older than the dedup horizon"),
        "{reasons:?}"
    );
    assert!(
        reasons[&(first + 3)].starts_with("out of range: occurred_at: is more than 5 minutes in the future"),
        "{reasons:?}"
    );
    assert!(reasons[&(first + 4)].starts_with("out of range: occurred_at: is older"), "{reasons:?}");
    rig.assert_accounted().await;

    // The same log, folded again from offset 0 into a fresh store by a
    // projector whose clock is years later (a replay): the same verdicts.
    let shadow = Rig::new().await;
    shadow.clock.set(utc("2040-01-01T00:00:00Z"));
    let mut config = rig.config();
    config.publish_dead_letters = false;
    let reader = Reader { inner: rig.log.reader(), dlq: Dlq::default() };
    let mut replay = Projector::new(
        reader,
        Arc::new(shadow.store.clone()),
        Arc::new(shadow.view.clone()),
        Arc::new(shadow.clock.clone()),
        config,
    );
    replay.start().await.expect("start");
    let r = replay.step().await.expect("replay");
    assert_eq!((r.folded, r.duplicates, r.dead_lettered), (3, 0, 3), "{r:?}");
    assert_eq!(shadow.calls().await, 3);
    let pending = shadow.pending_dead_letters().await;
    assert_eq!(pending, rig.dlq.letters().into_iter().map(|((_, o), why)| (o, why)).collect::<Vec<_>>());
}

/// Makes the store refuse to fold the events whose id starts with `poison`.
async fn poison(rig: &Rig, prefix: &str) {
    let sql = format!(
        "CREATE TRIGGER poison BEFORE INSERT ON processed_events WHEN NEW.event_id LIKE '{prefix}%' \
         BEGIN SELECT RAISE(ABORT, 'poisoned record'); END"
    );
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(rig.store.pool()).await.expect("trigger");
}

#[tokio::test]
async fn a_record_the_store_refuses_is_isolated_and_the_rest_is_folded() {
    let rig = Rig::new().await;
    poison(&rig, "poison").await;
    let now = Utc::now();
    let mut facts: Vec<UsageFact> = (0..40).map(|i| call(&format!("e{i}"), now, Some(now))).collect();
    facts[7] = call("poison-1", now, Some(now));
    facts[31] = call("poison-2", now, Some(now));
    rig.publish(&facts[..20]).await;
    rig.log.publish_raw("p1", b"not avro").await.expect("raw");
    rig.publish(&facts[20..]).await;

    let mut p = rig.projector(rig.config()).await;
    let r = p.step().await.expect("step");
    assert_eq!((r.read, r.folded, r.dead_lettered, r.refused), (41, 38, 3, 2), "{r:?}");
    assert!(r.commits > 2, "bisected: {r:?}");
    assert_eq!(rig.calls().await, 38);
    assert_eq!(rig.next_offset().await, rig.last_offset().await + 1, "the offsets moved past every record");
    let reasons: Vec<String> = rig.dlq.letters().into_iter().map(|(_, why)| why).collect();
    assert_eq!(
        reasons.iter().filter(|r| r.starts_with("refused by the store: ") && r.contains("poisoned record")).count(),
        2,
        "{reasons:?}"
    );
    assert_eq!(reasons.iter().filter(|r| r.starts_with("malformed")).count(), 1, "{reasons:?}");
    rig.assert_accounted().await;

    // The projector goes on with what comes next.
    rig.publish(&[call("after", now, Some(now))]).await;
    drain(&mut p).await;
    assert_eq!(rig.calls().await, 39);
}

#[tokio::test]
async fn a_store_that_refuses_everything_stops_the_projector_before_it_dead_letters_the_log() {
    let rig = Rig::new().await;
    poison(&rig, "").await;
    let now = Utc::now();
    rig.publish(&(0..10).map(|i| call(&format!("e{i}"), now, Some(now))).collect::<Vec<_>>()).await;
    let mut config = rig.config();
    config.max_store_refusals = 3;
    let p = rig.projector(config).await;
    let outcome = tokio::time::timeout(Duration::from_secs(30), p.run(std::future::pending())).await.expect("it stops");
    match outcome {
        Err(PortError::Permanent(why)) => {
            assert!(why.contains("taken to be at fault") && why.contains("poisoned record"), "{why}")
        }
        other => panic!("expected the projector to stop, got {other:?}"),
    }
    let kept = rig.pending_dead_letters().await;
    assert_eq!(kept.len(), 2, "only the refusals before the third: {kept:?}");
    assert!(kept.iter().all(|(_, why)| why.starts_with("refused by the store")), "{kept:?}");
    assert_eq!(rig.next_offset().await, rig.last_offset().await - 7, "the rest is still to fold");
}

#[tokio::test]
async fn a_dlq_that_fails_is_retried_and_each_letter_is_written_once() {
    let rig = Rig::new().await;
    rig.dlq.fail_before.store(3, Ordering::SeqCst);
    rig.log.publish_raw("p1", b"garbage one").await.expect("raw");
    rig.log.publish_raw("p1", b"garbage two").await.expect("raw");
    let now = Utc::now();
    rig.publish(&[call("good", now, Some(now))]).await;
    let mut p = rig.projector(rig.config()).await;
    let r = p.step().await.expect("the step waits for the DLQ, it does not fail");
    assert_eq!((r.folded, r.dead_lettered), (1, 2), "{r:?}");
    assert_eq!(rig.dlq.fail_before.load(Ordering::SeqCst), 0, "it was retried");
    assert_eq!(rig.dlq.letters().len(), 2);
    rig.assert_accounted().await;
}

#[tokio::test]
async fn a_projector_killed_mid_publish_leaves_the_letter_to_the_next_without_a_second_copy() {
    let rig = Rig::new().await;
    rig.log.publish_raw("p1", b"garbage").await.expect("raw");
    // The write lands, then the projector hangs and is killed before it
    // records the letter as published.
    rig.dlq.hang_after.store(1, Ordering::SeqCst);
    let mut first = rig.projector(rig.config()).await;
    assert!(tokio::time::timeout(Duration::from_secs(2), first.step()).await.is_err(), "it hangs");
    drop(first);
    assert_eq!(rig.dlq.letters().len(), 1);
    assert_eq!(rig.next_offset().await, rig.last_offset().await + 1, "the fold had committed");

    // A new projector: the dead one's claim holds the letter until it lapses.
    let mut second = rig.projector(rig.config()).await;
    second.step().await.expect("step");
    rig.clock.advance(rig.config().dead_letter_lease + chrono::Duration::seconds(1));
    second.step().await.expect("step after the lease");
    assert_eq!(rig.dlq.letters().len(), 1, "found on the DLQ past its mark, not written again");
    let pending = rig
        .store
        .claim_dead_letters(
            "tollgate-projector",
            rig.log.usage_topic(),
            "probe",
            rig.clock.now() + chrono::Duration::days(1),
            rig.clock.now() + chrono::Duration::days(2),
            10,
        )
        .await
        .expect("claim");
    assert!(pending.is_empty(), "recorded as published: {pending:?}");
    rig.assert_accounted().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_projectors_racing_on_one_consumer_fold_and_dead_letter_once() {
    let rig = Rig::new().await;
    let mut config = rig.config();
    config.max_batch = 7;
    let (a, b) = (rig.projector(config.clone()).await, rig.projector(config).await);
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let (stop_b, stopped_b) = tokio::sync::oneshot::channel::<()>();
    let ta = tokio::spawn(a.run(async move {
        let _ = stopped_a.await;
    }));
    let tb = tokio::spawn(b.run(async move {
        let _ = stopped_b.await;
    }));
    let now = Utc::now();
    for round in 0..20 {
        let facts: Vec<UsageFact> = (0..5).map(|i| call(&format!("r{round}-{i}"), now, Some(now))).collect();
        rig.publish(&facts).await;
        // A resend of an earlier event, and a bad record.
        rig.publish(&[call(&format!("r{}-0", round / 2), now, Some(now))]).await;
        rig.log.publish_raw("p1", format!("garbage {round}").as_bytes()).await.expect("raw");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let last = rig.last_offset().await;
    for _ in 0..300 {
        if rig.next_offset().await > last && rig.dlq.letters().len() >= 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = (stop_a.send(()), stop_b.send(()));
    ta.await.expect("task a").expect("projector a");
    tb.await.expect("task b").expect("projector b");
    assert_eq!(rig.calls().await, 100, "every distinct event once");
    assert_eq!(rig.dlq.letters().len(), 20, "every bad record once");
    rig.assert_accounted().await;
}

#[tokio::test]
async fn the_dedup_set_is_purged_from_the_folds_position_whatever_the_clock() {
    let rig = Rig::new().await;
    let old = utc("2026-03-01T00:00:00Z");
    let new = utc("2026-06-01T00:00:00Z");
    rig.publish(&[call("march", old, Some(old)), call("june", new, Some(new))]).await;
    let mut p = rig.projector(rig.config()).await;
    drain(&mut p).await;
    let ids: Vec<String> = sqlx::query_scalar("SELECT event_id FROM processed_events ORDER BY event_id")
        .fetch_all(rig.store.pool())
        .await
        .expect("dedup set");
    // The clock says 2031; the fold is at 1 June: March is past 35 + 7 days before it, June is not.
    assert_eq!(ids, ["june"]);
}

/// A view whose fold updates fail while `down` (Redis unreachable).
struct FlakyView {
    inner: MemoryView,
    down: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait]
impl meter::View for FlakyView {
    async fn check(
        &self,
        project: &ProjectId,
        plan: &meter::CheckPlan,
        hold: &meter::Hold,
        at: DateTime<Utc>,
    ) -> PortResult<Option<meter::CheckOutcome>> {
        self.inner.check(project, plan, hold, at).await
    }
    async fn seed(&self, project: &ProjectId, seed: &meter::Seed, at: DateTime<Utc>) -> PortResult<()> {
        self.inner.seed(project, seed, at).await
    }
    async fn settle(&self, project: &ProjectId, s: &[meter::Settlement], at: DateTime<Utc>) -> PortResult<()> {
        self.inner.settle(project, s, at).await
    }
    async fn unsettle(&self, project: &ProjectId, events: &[EventId]) -> PortResult<()> {
        self.inner.unsettle(project, events).await
    }
    async fn release(
        &self,
        project: &ProjectId,
        reservation: &meter::ReservationId,
        at: DateTime<Utc>,
    ) -> PortResult<()> {
        self.inner.release(project, reservation, at).await
    }
    async fn apply_fold(
        &self,
        project: &ProjectId,
        totals: &[(meter::Counter, meter::Totals)],
        events: &[EventId],
        at: DateTime<Utc>,
    ) -> PortResult<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(PortError::Transient("the view is down".into()));
        }
        self.inner.apply_fold(project, totals, events, at).await
    }
    async fn lower_totals(&self, project: &ProjectId, totals: &[(meter::Counter, meter::Totals)]) -> PortResult<()> {
        self.inner.lower_totals(project, totals).await
    }
    async fn usage(
        &self,
        project: &ProjectId,
        counter: &meter::CounterKey,
        at: DateTime<Utc>,
    ) -> PortResult<Option<meter::CounterUsage>> {
        self.inner.usage(project, counter, at).await
    }
}

/// A view update that fails (many times) is kept and applied once the view
/// answers again, also with nothing new on the log: the settled event's
/// pending delta is dropped, never counted twice (DESIGN §10).
#[tokio::test]
async fn a_failed_view_update_is_retried_until_its_pending_deltas_are_dropped() {
    use meter::View;
    let rig = Rig::new().await;
    let at = utc("2031-03-03T03:00:00Z");
    let fact = call("c1", at, Some(at));
    let deltas = meter::usage::counters_for(&fact, chrono_tz::Tz::UTC, &meter::PriceBook::default());
    let day = deltas
        .iter()
        .find(|(c, _)| c.key.dimension == meter::Dimension::Project && c.key.window == meter::WindowKind::Day)
        .map(|(c, _)| c.clone())
        .expect("the project's day counter");
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let view = Arc::new(FlakyView { inner: rig.view.clone(), down: down.clone() });
    view.seed(&pid(), &meter::Seed::default(), at).await.expect("seed");
    let s = meter::Settlement { event: fact.id.clone(), reservation: None, deltas };
    view.settle(&pid(), std::slice::from_ref(&s), at).await.expect("settle");
    rig.publish(std::slice::from_ref(&fact)).await;

    let reader = Reader { inner: rig.log.reader(), dlq: rig.dlq.clone() };
    let mut p =
        Projector::new(reader, Arc::new(rig.store.clone()), view.clone(), Arc::new(rig.clock.clone()), rig.config());
    p.start().await.expect("start");
    let r = p.step().await.expect("step");
    assert_eq!(r.folded, 1);
    for _ in 0..7 {
        p.step().await.expect("an idle step, the view still down");
    }
    let read = |v: Arc<FlakyView>, c: meter::CounterKey| async move {
        let u = v.usage(&pid(), &c, at).await.expect("usage").expect("seeded");
        (u.durable.calls, u.pending.calls)
    };
    assert_eq!(read(view.clone(), day.key.clone()).await, (0, 1), "the view missed the fold");
    down.store(false, Ordering::SeqCst);
    p.step().await.expect("an idle step, the view back");
    assert_eq!(read(view.clone(), day.key.clone()).await, (1, 0), "durable, and the pending delta dropped");
    // A late settle of the folded event adds nothing (the fold's tombstone).
    view.settle(&pid(), std::slice::from_ref(&s), at).await.expect("late settle");
    assert_eq!(read(view, day.key).await, (1, 0));
}

/// Two projectors on one clock (one process, a clock held still) never
/// share a claim: while the first holds its claim on a letter (its DLQ
/// write failing and retried), the second leaves the letter alone until
/// that claim lapses, then publishes it once.
#[tokio::test]
async fn a_second_projector_on_the_same_clock_leaves_the_first_ones_claim_alone() {
    let rig = Rig::new().await;
    rig.log.publish_raw("p1", b"garbage").await.expect("raw");
    rig.dlq.fail_before.store(1_000_000, Ordering::SeqCst);
    let mut first = rig.projector(rig.config()).await;
    // It folds the record, claims its letter and keeps retrying the DLQ.
    let _ = tokio::time::timeout(Duration::from_millis(500), first.step()).await;
    rig.dlq.fail_before.store(0, Ordering::SeqCst);
    let mut second = rig.projector(rig.config()).await;
    second.step().await.expect("step");
    assert!(rig.dlq.letters().is_empty(), "the first one's claim was taken: {:?}", rig.dlq.letters());
    rig.clock.advance(rig.config().dead_letter_lease + chrono::Duration::seconds(1));
    second.step().await.expect("step after the lease");
    assert_eq!(rig.dlq.letters().len(), 1, "published once the claim lapsed");
}
