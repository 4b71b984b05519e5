//! The `ExportStore` conformance suite (billing exports, issue 11 item 3):
//! each case is one async fn over a store that is every store port and the
//! export store; `suite!` stamps every one out as a test per backend, with
//! the fixtures of `store_conformance.rs`:
//!
//! - `pg::*` runs against a real PostgreSQL, a database of its own per test
//!   (`TOLLGATE_TEST_DATABASE_URL`, default
//!   `postgres://postgres@127.0.0.1:5432/test`); skipped when it does not
//!   answer, unless `TOLLGATE_REQUIRE_SERVICES` is set.
//! - `sqlite::*` runs against the embedded store, a fresh file per test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use meter::export::{
    Amounts, Cadence, Check, CustomerKind, Destination, DimRange, ExportRun, ExportSchedule, ExportSpec, ExportedLine,
    Format, Grace, Item, Mark, Projects, Reconciliation, RunStatus,
};
use meter::{
    ApiKeyId, AuditAction, AuditDetail, AuditEntry, AuditId, Dimension, Endpoint, EventId, EventKind, EventTypes,
    ExportStore, FoldBatch, OffsetMove, PortError, Principal, Project, ProjectId, Store, TokenUsage, UsageFact,
    WebhookId, WindowKind,
};
use store::{PgStore, SqliteStore};

/// A store that is every store port and the export store.
trait Both: Store + ExportStore {}

impl<T: Store + ExportStore> Both for T {}

macro_rules! suite {
    ($fixture:expr) => {
        suite!(@each $fixture;
            a_run_round_trips_every_field,
            two_runs_add_per_line_and_a_line_summing_to_zero_is_left_out,
            only_the_lines_of_runs_that_ended_complete_or_partial_count,
            exported_lines_are_read_by_a_range_of_customers,
            exported_periods_are_every_period_written_in_order,
            runs_are_listed_newest_first_by_project,
            a_project_runs_one_export_at_a_time,
            a_failing_finish_changes_nothing,
            a_cut_sees_the_fold_as_of_when_it_was_opened,
            window_models_return_every_dimensions_rows,
            a_period_is_read_in_bytewise_slices_of_customers,
            storage_facts_respect_before_and_their_order,
            a_schedule_round_trips_pages_changes_and_deletes_audited,
            a_due_schedule_is_held_by_one_claimant_until_its_claim_lapses,
            concurrent_claimants_take_a_due_schedule_once,
            a_runs_end_is_notified_once_to_the_endpoints_that_want_it,
        );
    };
    (@each $fixture:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $test() {
                let Some(db) = $fixture.await else { return };
                super::$test(&db.store).await;
            }
        )*
    };
}

mod pg {
    use super::*;

    suite!(PgDb::new());
}

mod sqlite {
    use super::*;

    suite!(SqliteDb::new());
}

// --- Fixtures (as store_conformance.rs) ---------------------------------------

/// A directory of its own under the system's temporary one, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("tollgate-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh, migrated SQLite file; the store drops before its directory.
struct SqliteDb {
    store: SqliteStore,
    _dir: TempDir,
}

impl SqliteDb {
    async fn new() -> Option<SqliteDb> {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.0.join("tollgate.db")).await.expect("open the test file");
        store.migrate().await.expect("migrate");
        Some(SqliteDb { store, _dir: dir })
    }
}

/// A fresh, migrated PostgreSQL database, dropped on drop; `None`, and the
/// test skipped, when PostgreSQL does not answer.
struct PgDb {
    store: PgStore,
    _db: testkit::TestDb,
}

impl PgDb {
    async fn new() -> Option<PgDb> {
        if !testkit::available(&[testkit::Service::Postgres]) {
            return None;
        }
        let db = testkit::TestDb::new("tg").await;
        let store = PgStore::connect(&db.url).await.expect("connect to the test database");
        store.migrate().await.expect("migrate");
        Some(PgDb { store, _db: db })
    }
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

fn pid(s: &str) -> ProjectId {
    ProjectId::parse(s).expect("project id")
}

async fn create_project(s: &dyn Both, id: &str) {
    let p = Project {
        id: pid(id),
        name: format!("project {id}"),
        timezone: Tz::UTC,
        created_at: utc("2026-01-01T00:00:00Z"),
    };
    s.create_project(&p).await.expect("create project");
}

fn fact(project: &str, id: &str, kind: EventKind, at: &str) -> UsageFact {
    UsageFact {
        gateway: "gw-test".into(),
        ..UsageFact::new(EventId::parse(id).expect("event id"), pid(project), kind, utc(at))
    }
}

fn call(project: &str, id: &str, at: &str, rows: u64) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse("key_1").expect("key id")),
        actor_id: Some("user_1".into()),
        rows,
        ..fact(project, id, EventKind::Call, at)
    }
}

/// A tokens event of agent `agent_1` and actor `user_1`.
fn tokens(project: &str, id: &str, at: &str, model: &str, input: u64) -> UsageFact {
    UsageFact {
        agent_id: Some("agent_1".into()),
        actor_id: Some("user_1".into()),
        tokens: vec![TokenUsage { provider: "openai".into(), model: model.into(), input, ..TokenUsage::default() }],
        ..fact(project, id, EventKind::Tokens, at)
    }
}

fn storage(project: &str, id: &str, kind: EventKind, at: &str, bytes: i64) -> UsageFact {
    UsageFact { storage_bytes: Some(bytes), ..fact(project, id, kind, at) }
}

const CONSUMER: &str = "projector";
const TOPIC: &str = "tollgate.usage";

fn batch(from: i64, to: i64, facts: Vec<UsageFact>) -> FoldBatch {
    FoldBatch {
        consumer: CONSUMER.into(),
        topic: TOPIC.into(),
        offsets: vec![OffsetMove { partition: 0, from, to }],
        facts,
        dead_letters: Vec::new(),
        sources: BTreeMap::new(),
        horizon: None,
    }
}

fn spec(project: &str, period: WindowKind, dims: &[CustomerKind]) -> ExportSpec {
    ExportSpec::new(
        pid(project),
        period,
        dims.iter().copied().collect(),
        Grace::new(Duration::from_secs(5400)).expect("grace"),
    )
    .expect("spec")
}

/// A run as it starts.
fn started(id: &str, spec: ExportSpec, at: &str) -> ExportRun {
    ExportRun {
        id: id.into(),
        spec,
        format: Format::Csv,
        status: RunStatus::Running,
        mark: None,
        watermark: BTreeMap::new(),
        receipt_bound: None,
        started_at: utc(at),
        finished_at: None,
        rows: 0,
        bytes: 0,
        file: None,
        reconciliation: None,
        error: None,
        schedule_id: None,
    }
}

/// The same run as it ended, every field set.
fn finished(run: &ExportRun, at: &str) -> ExportRun {
    ExportRun {
        status: RunStatus::Partial,
        mark: Some(Mark::Rows),
        watermark: BTreeMap::from([(0, 1234), (3, 9)]),
        receipt_bound: Some(utc("2026-07-07T11:59:58.123456Z")),
        finished_at: Some(utc(at)),
        rows: 42,
        bytes: 4096,
        file: Some("/var/exports/proj_1/exr_1.csv".into()),
        reconciliation: Some(Reconciliation {
            fold: Check { lines: 7, differing: 0, differences: Vec::new() },
            log: Some(Check { lines: 7, differing: 1, differences: vec!["line x: expected 1 found 2".into()] }),
        }),
        error: Some("stopped at the row bound".into()),
        ..run.clone()
    }
}

/// A run that wrote `lines` and ended as `ended` (its status, at its time).
async fn ran(s: &dyn Both, run: &ExportRun, lines: &[ExportedLine], ended: &ExportRun) {
    s.create_export_run(run).await.expect("create run");
    s.record_export_lines(&run.id, &run.spec.key(), lines).await.expect("record lines");
    s.finish_export_run(ended, &[]).await.expect("finish");
}

fn all() -> DimRange {
    DimRange::all()
}

fn metric(name: &str) -> Item {
    Item::Metric(name.into())
}

fn model_item(model: &str) -> Item {
    Item::Model { provider: "openai".into(), model: model.into(), component: "input_tokens".into() }
}

fn line(period: &str, dimension: Dimension, item: Item, a: (i128, i128, i128, i128)) -> ExportedLine {
    ExportedLine {
        period_key: period.into(),
        dimension,
        item,
        amounts: Amounts { consumed: a.0, priced: a.1, unpriced: a.2, cost: a.3 },
    }
}

fn entry(id: &str, project: &str) -> AuditEntry {
    meter::admin_change(
        AuditId::parse(id).expect("audit id"),
        &pid(project),
        AuditAction::RunExport,
        "exr_1",
        AuditDetail::WebhookEndpointDisabled { url: "https://example.test".into(), reason: "test".into() },
        &Principal::new("admin", "test"),
        utc("2026-07-07T12:00:00Z"),
    )
}

// --- Runs ----------------------------------------------------------------------

async fn a_run_round_trips_every_field(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let run = started(
        "exr_1",
        spec("proj_1", WindowKind::CalendarMonth, &[CustomerKind::ApiKey, CustomerKind::User]),
        "2026-07-07T12:00:00.000001Z",
    );
    s.create_export_run(&run).await.expect("create run");
    assert_eq!(s.export_run("exr_1").await.expect("read run"), Some(run.clone()));
    assert!(matches!(s.create_export_run(&run).await, Err(PortError::Conflict(_))), "a run id is unique");

    let done = finished(&run, "2026-07-07T12:00:03.5Z");
    let audit = entry("aud_0001", "proj_1");
    s.finish_export_run(&done, std::slice::from_ref(&audit)).await.expect("finish");
    assert_eq!(s.export_run("exr_1").await.expect("read run"), Some(done.clone()));
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![audit], "the audit entry is in the outbox");

    let rec = Reconciliation { fold: Check { lines: 3, differing: 1, differences: vec!["a".into()] }, log: None };
    let at = utc("2026-07-07T12:00:04Z");
    assert!(s.set_reconciliation("exr_1", &rec, at).await.expect("set reconciliation"));
    let read = s.export_run("exr_1").await.expect("read run").expect("the run");
    assert_eq!(read, ExportRun { reconciliation: Some(rec.clone()), ..done });
    assert!(!s.set_reconciliation("exr_none", &rec, at).await.expect("set on nothing"));
    assert_eq!(s.export_run("exr_none").await.expect("read nothing"), None);

    // A run of every period and format reads back as written.
    let day = ExportRun {
        format: Format::Parquet,
        ..started("exr_2", spec("proj_1", WindowKind::Day, &CustomerKind::ALL), "2026-07-08T00:00:00Z")
    };
    s.create_export_run(&day).await.expect("create day run");
    assert_eq!(s.export_run("exr_2").await.expect("read run"), Some(day.clone()));
    // A scheduled run names its schedule.
    let scheduled = ExportRun {
        schedule_id: Some("exs_1".into()),
        ..started("exr_3", spec("proj_1", WindowKind::Day, &[CustomerKind::Project]), "2026-07-09T00:00:00Z")
    };
    s.finish_export_run(&finished(&day, "2026-07-08T00:00:01Z"), &[]).await.expect("finish the day run");
    s.create_export_run(&scheduled).await.expect("create scheduled run");
    assert_eq!(s.export_run("exr_3").await.expect("read run"), Some(scheduled));
}

async fn two_runs_add_per_line_and_a_line_summing_to_zero_is_left_out(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let sp = spec("proj_1", WindowKind::Day, &[CustomerKind::Project, CustomerKind::Actor]);
    let key = sp.key();
    let actor = Dimension::Actor("user_1".into());
    let first = started("exr_1", sp.clone(), "2026-07-07T12:00:00Z");
    let written = [
        line("2026-07-07", Dimension::Project, metric("calls"), (5, 0, 0, 0)),
        line("2026-07-07", actor.clone(), model_item("gpt-4o"), (10, 6, 4, 1_000_000)),
        line("2026-07-07", actor.clone(), metric("calls"), (3, 0, 0, 0)),
    ];
    ran(s, &first, &written, &finished(&first, "2026-07-07T12:00:01Z")).await;
    let mut expected = written.to_vec();
    expected.sort_by(|a, b| (&a.dimension, &a.item).cmp(&(&b.dimension, &b.item)));
    assert_eq!(s.exported_lines(&key, "2026-07-07", &all()).await.expect("lines"), expected);

    let second = started("exr_2", sp.clone(), "2026-07-07T13:00:00Z");
    let more = [
        line("2026-07-07", Dimension::Project, metric("calls"), (2, 0, 0, 0)),
        // A correction takes the actor's calls back to nothing.
        line("2026-07-07", actor.clone(), metric("calls"), (-3, 0, 0, 0)),
        line("2026-07-07", actor.clone(), model_item("gpt-4o"), (-1, -1, 0, -250_000)),
    ];
    let complete = ExportRun { status: RunStatus::Complete, mark: None, ..finished(&second, "2026-07-07T13:00:01Z") };
    ran(s, &second, &more, &complete).await;
    assert_eq!(
        s.exported_lines(&key, "2026-07-07", &all()).await.expect("lines"),
        vec![
            line("2026-07-07", Dimension::Project, metric("calls"), (7, 0, 0, 0)),
            line("2026-07-07", actor, model_item("gpt-4o"), (9, 5, 4, 750_000)),
        ],
        "summed per line over a partial and a complete run, the zero line left out"
    );
    assert!(s.exported_lines(&key, "2026-07-08", &all()).await.expect("lines").is_empty(), "another period");
    let other = spec("proj_1", WindowKind::Day, &[CustomerKind::Project]).key();
    assert!(s.exported_lines(&other, "2026-07-07", &all()).await.expect("lines").is_empty(), "another export");
}

async fn only_the_lines_of_runs_that_ended_complete_or_partial_count(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let sp = spec("proj_1", WindowKind::Day, &[CustomerKind::Project]);
    let key = sp.key();
    let calls = |n| [line("2026-07-07", Dimension::Project, metric("calls"), (n, 0, 0, 0))];
    // Recorded while running: not counted yet.
    let first = started("exr_1", sp.clone(), "2026-07-07T12:00:00Z");
    s.create_export_run(&first).await.expect("create run");
    s.record_export_lines("exr_1", &key, &calls(5)).await.expect("record");
    assert!(s.exported_lines(&key, "2026-07-07", &all()).await.expect("lines").is_empty(), "still running");
    assert!(s.exported_periods(&key).await.expect("periods").is_empty(), "still running");
    // It fails: its lines never count, and are gone.
    let failed = ExportRun {
        status: RunStatus::Failed,
        mark: None,
        error: Some("disk full".into()),
        ..finished(&first, "2026-07-07T12:00:01Z")
    };
    s.finish_export_run(&failed, &[]).await.expect("finish failed");
    assert!(s.exported_lines(&key, "2026-07-07", &all()).await.expect("lines").is_empty(), "a failed run");
    // One that dies running, abandoned later: never counted either.
    let dead = started("exr_2", sp.clone(), "2026-07-07T12:10:00Z");
    s.create_export_run(&dead).await.expect("create run");
    s.record_export_lines("exr_2", &key, &calls(6)).await.expect("record");
    let at = utc("2026-07-07T14:00:00Z");
    assert_eq!(s.abandon_export_runs(&pid("proj_1"), utc("2026-07-07T13:00:00Z"), at).await.expect("abandon"), 1);
    assert!(s.exported_lines(&key, "2026-07-07", &all()).await.expect("lines").is_empty(), "an abandoned run");
    // A complete one counts, from its end on.
    let third = started("exr_3", sp.clone(), "2026-07-07T14:00:00Z");
    let complete = ExportRun { status: RunStatus::Complete, mark: None, ..finished(&third, "2026-07-07T14:00:01Z") };
    ran(s, &third, &calls(7), &complete).await;
    assert_eq!(s.exported_lines(&key, "2026-07-07", &all()).await.expect("lines"), calls(7).to_vec());
    assert_eq!(s.exported_periods(&key).await.expect("periods"), ["2026-07-07"]);
}

async fn exported_lines_are_read_by_a_range_of_customers(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let sp = spec("proj_1", WindowKind::Day, &[CustomerKind::Project, CustomerKind::Actor]);
    let key = sp.key();
    // Bytewise, `a:B` < `a:a` < `a:b` < `p` (a case-folding collation would
    // put `a:B` after `a:a`).
    let who = ["a:a", "a:B", "p", "a:b"];
    let lines: Vec<ExportedLine> = who
        .iter()
        .map(|d| line("2026-07-07", Dimension::decode(d).expect("dimension"), metric("calls"), (1, 0, 0, 0)))
        .collect();
    let run = started("exr_1", sp.clone(), "2026-07-07T12:00:00Z");
    let complete = ExportRun { status: RunStatus::Complete, mark: None, ..finished(&run, "2026-07-07T12:00:01Z") };
    ran(s, &run, &lines, &complete).await;
    let key = key.as_str();
    let read = |after: Option<&str>, through: Option<&str>| {
        let range = DimRange { after: after.map(str::to_owned), through: through.map(str::to_owned) };
        async move {
            let mut got: Vec<String> = s
                .exported_lines(key, "2026-07-07", &range)
                .await
                .expect("lines")
                .into_iter()
                .map(|l| l.dimension.encode())
                .collect();
            got.sort();
            got
        }
    };
    assert_eq!(read(None, Some("a:B")).await, ["a:B"]);
    assert_eq!(read(Some("a:B"), Some("a:b")).await, ["a:a", "a:b"]);
    assert_eq!(read(Some("a:b"), None).await, ["p"]);
    assert_eq!(read(None, None).await.len(), 4);
}

async fn exported_periods_are_every_period_written_in_order(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let sp = spec("proj_1", WindowKind::CalendarMonth, &[CustomerKind::Project]);
    assert!(s.exported_periods(&sp.key()).await.expect("periods").is_empty());
    let run = started("exr_1", sp.clone(), "2026-09-01T00:00:00Z");
    let written = [
        line("2026-08", Dimension::Project, metric("calls"), (1, 0, 0, 0)),
        line("2026-06", Dimension::Project, metric("calls"), (1, 0, 0, 0)),
        line("2026-06", Dimension::Project, metric("rows"), (4, 0, 0, 0)),
        line("2026-07", Dimension::Project, metric("calls"), (2, 0, 0, 0)),
    ];
    ran(s, &run, &written, &finished(&run, "2026-09-01T00:00:01Z")).await;
    assert_eq!(s.exported_periods(&sp.key()).await.expect("periods"), vec!["2026-06", "2026-07", "2026-08"]);
    let other = spec("proj_1", WindowKind::Day, &[CustomerKind::Project]);
    assert!(s.exported_periods(&other.key()).await.expect("periods").is_empty(), "another export");
}

async fn runs_are_listed_newest_first_by_project(s: &dyn Both) {
    create_project(s, "proj_1").await;
    create_project(s, "proj_2").await;
    let sp = spec("proj_1", WindowKind::Day, &[CustomerKind::Project]);
    let runs = [
        started("exr_a", sp.clone(), "2026-07-01T00:00:00Z"),
        started("exr_d", sp.clone(), "2026-07-02T00:00:00Z"),
        started("exr_b", sp.clone(), "2026-07-03T00:00:00Z"),
        // The same instant: the greater id first.
        started("exr_c", sp.clone(), "2026-07-03T00:00:00Z"),
        started("exr_e", spec("proj_2", WindowKind::Day, &[CustomerKind::Project]), "2026-07-04T00:00:00Z"),
    ];
    // Ended runs: a project has one running at most.
    let runs = runs.map(|r| ExportRun { status: RunStatus::Complete, ..r });
    for r in &runs {
        s.create_export_run(r).await.expect("create run");
    }
    let ids = |runs: Vec<ExportRun>| runs.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(ids(s.export_runs(&pid("proj_1"), 10).await.expect("runs")), ["exr_c", "exr_b", "exr_d", "exr_a"]);
    assert_eq!(ids(s.export_runs(&pid("proj_1"), 2).await.expect("runs")), ["exr_c", "exr_b"]);
    assert_eq!(s.export_runs(&pid("proj_2"), 10).await.expect("runs"), vec![runs[4].clone()]);
    assert!(s.export_runs(&pid("proj_3"), 10).await.expect("runs").is_empty());
    let t = |s: &str| DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc);
    assert_eq!(s.last_complete_run(&sp.key()).await.expect("last"), Some(t("2026-07-03T00:00:00Z")));
    assert_eq!(s.last_complete_run("proj_3/day/project").await.expect("last"), None);
}

async fn a_project_runs_one_export_at_a_time(s: &dyn Both) {
    create_project(s, "proj_1").await;
    create_project(s, "proj_2").await;
    let first = started("exr_1", spec("proj_1", WindowKind::Day, &[CustomerKind::Project]), "2026-07-07T12:00:00Z");
    s.create_export_run(&first).await.expect("create run");
    // Another export of the same project, while the first runs: refused.
    let other = started("exr_2", spec("proj_1", WindowKind::Day, &[CustomerKind::Actor]), "2026-07-07T12:00:01Z");
    assert!(matches!(s.create_export_run(&other).await, Err(PortError::Conflict(_))));
    // Another project's is not.
    let elsewhere = started("exr_3", spec("proj_2", WindowKind::Day, &[CustomerKind::Project]), "2026-07-07T12:00:01Z");
    s.create_export_run(&elsewhere).await.expect("another project's run");
    // Abandoning runs started before the first changes nothing; after it,
    // the first is failed and the project free.
    let t = |s: &str| DateTime::parse_from_rfc3339(s).expect("ts").with_timezone(&Utc);
    let at = t("2026-07-07T13:00:00Z");
    assert_eq!(s.abandon_export_runs(&pid("proj_1"), t("2026-07-07T12:00:00Z"), at).await.expect("abandon"), 0);
    assert_eq!(s.abandon_export_runs(&pid("proj_1"), t("2026-07-07T12:30:00Z"), at).await.expect("abandon"), 1);
    let read = s.export_run("exr_1").await.expect("read").expect("the run");
    assert_eq!((read.status, read.finished_at), (RunStatus::Failed, Some(at)));
    assert!(read.error.is_some_and(|e| e.contains("abandoned")));
    assert_eq!(s.export_run("exr_3").await.expect("read").map(|r| r.status), Some(RunStatus::Running));
    s.create_export_run(&other).await.expect("the project is free");
}

async fn a_failing_finish_changes_nothing(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let sp = spec("proj_1", WindowKind::Day, &[CustomerKind::Project]);
    let run = started("exr_1", sp.clone(), "2026-07-07T12:00:00Z");
    s.create_export_run(&run).await.expect("create run");

    // One amount beyond a 64-bit integer: refused, not wrapped, and the
    // other line of the same record is not written either.
    let written = [
        line("2026-07-07", Dimension::Project, metric("calls"), (5, 0, 0, 0)),
        line("2026-07-07", Dimension::Project, model_item("gpt-4o"), (1, 1, 0, i128::from(i64::MAX) + 1)),
    ];
    let e = s.record_export_lines("exr_1", &sp.key(), &written).await;
    assert!(matches!(e, Err(PortError::Permanent(_))), "{e:?}");

    // A run that was never created cannot finish: its audit entry is not written.
    let ghost = finished(&started("exr_ghost", sp.clone(), "2026-07-07T12:00:00Z"), "2026-07-07T12:00:01Z");
    let e = s.finish_export_run(&ghost, &[entry("aud_0002", "proj_1")]).await;
    assert!(e.is_err(), "{e:?}");
    assert_eq!(s.export_run("exr_ghost").await.expect("read run"), None);
    assert!(s.unpublished_audit(10).await.expect("outbox").is_empty());

    // The first run ends: nothing of the refused record counts.
    s.finish_export_run(&finished(&run, "2026-07-07T12:00:01Z"), &[]).await.expect("finish");
    assert!(s.exported_lines(&sp.key(), "2026-07-07", &all()).await.expect("lines").is_empty());
    assert!(s.exported_periods(&sp.key()).await.expect("periods").is_empty());

    // The same lines without the bad one go through.
    let again = started("exr_2", sp.clone(), "2026-07-07T13:00:00Z");
    ran(s, &again, &written[..1], &finished(&again, "2026-07-07T13:00:01Z")).await;
    assert_eq!(s.exported_lines(&sp.key(), "2026-07-07", &all()).await.expect("lines"), written[..1].to_vec());
}

// --- The cut of the fold ---------------------------------------------------------

async fn a_cut_sees_the_fold_as_of_when_it_was_opened(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let p = pid("proj_1");
    s.fold_batch(&batch(
        0,
        2,
        vec![call("proj_1", "e1", "2026-07-08T10:00:00Z", 5), call("proj_1", "e2", "2026-07-07T10:00:00Z", 1)],
    ))
    .await
    .expect("fold");
    let receipt = newest_receipt_of(s, CONSUMER, TOPIC).await;
    let mut cut = s.fold_cut().await.expect("open a cut");
    // Folded after the cut was opened: the cut does not see it.
    s.fold_batch(&batch(
        2,
        4,
        vec![
            call("proj_1", "e3", "2026-07-08T11:00:00Z", 2),
            tokens("proj_1", "e4", "2026-07-09T10:00:00Z", "gpt-4o", 10),
        ],
    ))
    .await
    .expect("fold after the cut");

    assert_eq!(cut.offsets(CONSUMER, TOPIC).await.expect("offsets"), BTreeMap::from([(0, 2)]));
    assert_eq!(cut.newest_receipt(CONSUMER, TOPIC).await.expect("receipt"), receipt);
    assert_eq!(cut.window_keys(&p, WindowKind::Day).await.expect("keys"), ["2026-07-07", "2026-07-08"]);
    assert_eq!(cut.window_keys(&p, WindowKind::CalendarMonth).await.expect("keys"), ["2026-07"]);
    let day = cut.window_totals(&p, WindowKind::Day, "2026-07-08", None, 100).await.expect("totals");
    let project = day.iter().find(|(k, _)| k.dimension == Dimension::Project).expect("the project's counter");
    assert_eq!((project.1.calls, project.1.rows), (1, 5));
    assert!(day.iter().all(|(k, _)| k.window == WindowKind::Day && k.window_key == "2026-07-08"));
    let dims: BTreeSet<Dimension> = day.iter().map(|(k, _)| k.dimension.clone()).collect();
    assert!(dims.contains(&Dimension::ApiKey(ApiKeyId::parse("key_1").expect("key id"))), "every dimension: {dims:?}");
    assert!(dims.contains(&Dimension::Actor("user_1".into())), "every dimension: {dims:?}");
    assert!(cut.window_models(&p, WindowKind::Day, "2026-07-09", &all()).await.expect("models").is_empty());
    cut.close().await.expect("close the cut");

    // A new cut sees it.
    let mut cut = s.fold_cut().await.expect("open a cut");
    assert_eq!(cut.offsets(CONSUMER, TOPIC).await.expect("offsets"), BTreeMap::from([(0, 4)]));
    assert_eq!(cut.window_keys(&p, WindowKind::Day).await.expect("keys"), ["2026-07-07", "2026-07-08", "2026-07-09"]);
    let day = cut.window_totals(&p, WindowKind::Day, "2026-07-08", None, 100).await.expect("totals");
    let project = day.iter().find(|(k, _)| k.dimension == Dimension::Project).expect("the project's counter");
    assert_eq!((project.1.calls, project.1.rows), (2, 7));
    assert!(!cut.window_models(&p, WindowKind::Day, "2026-07-09", &all()).await.expect("models").is_empty());
    assert!(
        cut.window_totals(&pid("proj_2"), WindowKind::Day, "2026-07-08", None, 100).await.expect("totals").is_empty()
    );
    cut.close().await.expect("close the cut");
}

async fn window_models_return_every_dimensions_rows(s: &dyn Both) {
    create_project(s, "proj_1").await;
    create_project(s, "proj_2").await;
    s.fold_batch(&batch(
        0,
        3,
        vec![
            tokens("proj_1", "e1", "2026-07-07T10:00:00Z", "gpt-4o", 10),
            tokens("proj_1", "e2", "2026-07-07T11:00:00Z", "gpt-4o", 5),
            tokens("proj_2", "e3", "2026-07-07T11:00:00Z", "gpt-4o", 7),
        ],
    ))
    .await
    .expect("fold");
    let mut cut = s.fold_cut().await.expect("open a cut");
    let rows = cut.window_models(&pid("proj_1"), WindowKind::Day, "2026-07-07", &all()).await.expect("models");
    let dims: Vec<String> = rows.iter().map(|(d, _)| d.encode()).collect();
    // By the dimension's encoding, bytewise (the order of a slice).
    assert_eq!(
        dims,
        [Dimension::Project, Dimension::Agent("agent_1".into()), Dimension::Actor("user_1".into())]
            .iter()
            .map(Dimension::encode)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>(),
        "one row per dimension, in order"
    );
    for (d, row) in &rows {
        assert_eq!(row.key.model, "gpt-4o", "{d:?}");
        assert_eq!(row.priced_quantity + row.unpriced_quantity, 15, "{d:?}: both events of proj_1");
    }
    assert_eq!(
        cut.window_models(&pid("proj_1"), WindowKind::CalendarMonth, "2026-07", &all()).await.expect("models").len(),
        rows.len()
    );
    assert!(cut.window_models(&pid("proj_1"), WindowKind::Day, "2026-07-08", &all()).await.expect("models").is_empty());
    cut.close().await.expect("close the cut");
}

async fn storage_facts_respect_before_and_their_order(s: &dyn Both) {
    create_project(s, "proj_1").await;
    create_project(s, "proj_2").await;
    s.fold_batch(&batch(
        0,
        5,
        vec![
            storage("proj_1", "d2", EventKind::StorageDelta, "2026-07-07T10:00:02Z", -30),
            storage("proj_1", "s1", EventKind::StorageSnapshot, "2026-07-07T10:00:01Z", 1000),
            storage("proj_1", "d1", EventKind::StorageDelta, "2026-07-07T10:00:01Z", 50),
            storage("proj_1", "d3", EventKind::StorageDelta, "2026-07-07T10:00:05Z", 7),
            storage("proj_2", "d9", EventKind::StorageDelta, "2026-07-07T10:00:00Z", 9),
        ],
    ))
    .await
    .expect("fold");
    let mut cut = s.fold_cut().await.expect("open a cut");
    let facts = cut.storage_facts(&pid("proj_1"), utc("2026-07-07T10:00:05Z")).await.expect("facts");
    let got: Vec<(String, bool, DateTime<Utc>, i64)> =
        facts.into_iter().map(|f| (f.event_id.as_str().to_owned(), f.snapshot, f.occurred_at, f.bytes)).collect();
    assert_eq!(
        got,
        vec![
            ("d1".to_owned(), false, utc("2026-07-07T10:00:01Z"), 50),
            ("s1".to_owned(), true, utc("2026-07-07T10:00:01Z"), 1000),
            ("d2".to_owned(), false, utc("2026-07-07T10:00:02Z"), -30),
        ],
        "before the bound (not at it), by time then id"
    );
    assert_eq!(cut.storage_facts(&pid("proj_1"), utc("2026-07-08T00:00:00Z")).await.expect("facts").len(), 4);
    assert!(cut.storage_facts(&pid("proj_1"), utc("2026-07-07T10:00:01Z")).await.expect("facts").is_empty());
    cut.close().await.expect("close the cut");
}

/// The newest receipt a consumer folded, through a cut of its own.
async fn newest_receipt_of(s: &dyn Both, consumer: &str, topic: &str) -> Option<DateTime<Utc>> {
    let mut cut = s.fold_cut().await.expect("open a cut");
    let r = cut.newest_receipt(consumer, topic).await.expect("receipt");
    cut.close().await.expect("close the cut");
    r
}

async fn a_period_is_read_in_bytewise_slices_of_customers(s: &dyn Both) {
    create_project(s, "proj_1").await;
    // Actors whose order differs bytewise and case-folded; each call also
    // counts for the project and key `key_1`; each tokens event for its
    // actor, agent `agent_1` and the project.
    let actors = ["B", "a", "b", "A"];
    let mut facts = Vec::new();
    for (i, a) in actors.iter().enumerate() {
        facts.push(UsageFact {
            actor_id: Some((*a).into()),
            ..call("proj_1", &format!("c{i}"), "2026-07-07T10:00:00Z", 1)
        });
        facts.push(UsageFact {
            actor_id: Some((*a).into()),
            ..tokens("proj_1", &format!("t{i}"), "2026-07-07T10:00:00Z", "gpt-4o", 10)
        });
    }
    s.fold_batch(&batch(0, 8, facts)).await.expect("fold");
    let p = pid("proj_1");
    let mut cut = s.fold_cut().await.expect("open a cut");
    // Pages of two counters, each after the last one's dimension.
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = cut.window_totals(&p, WindowKind::Day, "2026-07-07", after.as_deref(), 2).await.expect("totals");
        let dims: Vec<String> = page.iter().map(|(k, _)| k.dimension.encode()).collect();
        if dims.is_empty() {
            break;
        }
        after = dims.last().cloned();
        pages.push(dims);
    }
    let want: Vec<Vec<String>> = [["a:A", "a:B"], ["a:a", "a:b"], ["g:agent_1", "k*"], ["k:key_1", "p"]]
        .iter()
        .map(|p| p.iter().map(|d| (*d).to_owned()).collect())
        .collect();
    assert_eq!(pages, want, "bytewise, two at a time, every dimension once");
    // The breakdown by model of a range: its customers' rows, bytewise.
    let range = DimRange { after: Some("a:B".into()), through: Some("g:agent_1".into()) };
    let models = cut.window_models(&p, WindowKind::Day, "2026-07-07", &range).await.expect("models");
    let dims: Vec<String> = models.iter().map(|(d, _)| d.encode()).collect();
    assert_eq!(dims, ["a:a", "a:b", "g:agent_1"]);
    assert!(models.iter().all(|(d, r)| r.priced_quantity + r.unpriced_quantity
        == if *d == Dimension::Agent("agent_1".into()) { 40 } else { 10 }));
    cut.close().await.expect("close the cut");
}

// --- Schedules ---------------------------------------------------------------------

fn schedule(id: &str, projects: Projects, next: &str) -> ExportSchedule {
    ExportSchedule {
        id: id.into(),
        projects,
        period: WindowKind::Day,
        dimensions: BTreeSet::from([CustomerKind::ApiKey, CustomerKind::Actor]),
        grace: Grace::new(Duration::from_secs(7200)).expect("grace"),
        format: Format::Parquet,
        destination: Destination::parse("finance/daily").expect("destination"),
        cadence: Cadence::Daily,
        timezone: "Asia/Kathmandu".parse().expect("zone"),
        enabled: true,
        next_run_at: utc(next),
        last_run_at: None,
        created_at: utc("2026-07-01T00:00:00.000001Z"),
        updated_at: utc("2026-07-01T00:00:00.000001Z"),
    }
}

fn schedule_entry(id: &str, action: AuditAction, sched: &ExportSchedule) -> AuditEntry {
    AuditEntry {
        id: AuditId::parse(id).expect("audit id"),
        project_id: None,
        action,
        principal: Some(Principal::new("admin", "test")),
        resource: sched.id.clone(),
        detail: AuditDetail::ExportScheduleChange { before: None, after: Some(sched.into()) },
        created_at: utc("2026-07-01T00:00:00Z"),
    }
}

async fn a_schedule_round_trips_pages_changes_and_deletes_audited(s: &dyn Both) {
    create_project(s, "proj_1").await;
    create_project(s, "proj_2").await;
    let some = schedule("exs_b", Projects::Some(vec![pid("proj_2"), pid("proj_1")]), "2026-07-02T02:00:00Z");
    let every = ExportSchedule {
        enabled: false,
        cadence: Cadence::Monthly,
        timezone: Tz::UTC,
        format: Format::Csv,
        ..schedule("exs_a", Projects::All, "2026-08-01T02:00:00Z")
    };
    let created = schedule_entry("aud_0001", AuditAction::CreateExportSchedule, &some);
    s.create_schedule(&some, std::slice::from_ref(&created)).await.expect("create");
    s.create_schedule(&every, &[]).await.expect("create");
    assert!(matches!(s.create_schedule(&every, &[]).await, Err(PortError::Conflict(_))), "an id is unique");
    assert_eq!(s.schedule("exs_b").await.expect("read"), Some(some.clone()));
    assert_eq!(s.schedule("exs_a").await.expect("read"), Some(every.clone()));
    assert_eq!(s.schedule("exs_none").await.expect("read"), None);
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![created]);
    // Pages by id.
    assert_eq!(s.schedules(None, 10).await.expect("list"), vec![every.clone(), some.clone()]);
    assert_eq!(s.schedules(None, 1).await.expect("list"), vec![every.clone()]);
    assert_eq!(s.schedules(Some("exs_a"), 10).await.expect("list"), vec![some.clone()]);
    // An admin's change: what may change does, and nothing else.
    let changed = ExportSchedule {
        enabled: false,
        cadence: Cadence::Hourly,
        format: Format::Jsonl,
        destination: Destination::parse("elsewhere").expect("destination"),
        next_run_at: utc("2026-07-01T13:00:00Z"),
        updated_at: utc("2026-07-01T12:00:00Z"),
        ..some.clone()
    };
    assert!(s.update_schedule(&changed, &[]).await.expect("update"));
    assert_eq!(s.schedule("exs_b").await.expect("read"), Some(changed.clone()));
    assert!(!s.update_schedule(&schedule("exs_none", Projects::All, "2026-07-02T00:00:00Z"), &[]).await.expect("none"));
    let deleted = schedule_entry("aud_0002", AuditAction::DeleteExportSchedule, &changed);
    assert!(s.delete_schedule("exs_b", std::slice::from_ref(&deleted)).await.expect("delete"));
    assert!(!s.delete_schedule("exs_b", &[]).await.expect("delete again"));
    assert_eq!(s.schedules(None, 10).await.expect("list"), vec![every]);
    assert_eq!(s.unpublished_audit(10).await.expect("outbox").len(), 2, "the deletion is audited");
}

async fn a_due_schedule_is_held_by_one_claimant_until_its_claim_lapses(s: &dyn Both) {
    create_project(s, "proj_1").await;
    let due = schedule("exs_1", Projects::Some(vec![pid("proj_1")]), "2026-07-02T02:00:00Z");
    let later = schedule("exs_2", Projects::All, "2026-07-02T03:00:00Z");
    let off = ExportSchedule { enabled: false, ..schedule("exs_0", Projects::All, "2026-07-01T00:00:00Z") };
    for x in [&due, &later, &off] {
        s.create_schedule(x, &[]).await.expect("create");
    }
    let (a, b) = ("notifier-a", "notifier-b");
    // Not due yet; a disabled one never is.
    assert_eq!(
        s.claim_due_schedule(a, utc("2026-07-02T01:59:59Z"), utc("2026-07-02T02:10:00Z")).await.expect("claim"),
        None
    );
    // Due: the soonest is claimed, by one claimant.
    let at = utc("2026-07-02T03:30:00Z");
    let until = utc("2026-07-02T03:40:00Z");
    let got = s.claim_due_schedule(a, at, until).await.expect("claim").expect("due");
    assert_eq!(got, due);
    let next = s.claim_due_schedule(b, at, until).await.expect("claim").expect("the other due one");
    assert_eq!(next.id, "exs_2");
    assert_eq!(s.claim_due_schedule(b, at, until).await.expect("claim"), None, "both are held");
    assert!(s.extend_schedule_claim("exs_1", a, utc("2026-07-02T03:50:00Z")).await.expect("extend"));
    assert!(!s.extend_schedule_claim("exs_1", b, utc("2026-07-02T03:50:00Z")).await.expect("not b's"));
    // The claim lapses: another claimant takes it, and the first has lost it.
    let lapsed = utc("2026-07-02T03:50:01Z");
    assert_eq!(
        s.claim_due_schedule(b, lapsed, utc("2026-07-02T04:00:00Z")).await.expect("claim").map(|x| x.id),
        Some("exs_1".into())
    );
    assert!(!s.extend_schedule_claim("exs_1", a, utc("2026-07-02T04:10:00Z")).await.expect("lost"));
    assert!(!s.finish_schedule_run("exs_1", a, at, utc("2026-07-03T02:00:00Z")).await.expect("lost"));
    // The holder finishes: the next run is set, the claim released.
    assert!(s.finish_schedule_run("exs_1", b, lapsed, utc("2026-07-03T02:00:00Z")).await.expect("finish"));
    let read = s.schedule("exs_1").await.expect("read").expect("there");
    assert_eq!((read.last_run_at, read.next_run_at), (Some(lapsed), utc("2026-07-03T02:00:00Z")));
    assert_eq!(
        s.claim_due_schedule(a, utc("2026-07-03T01:59:59Z"), utc("2026-07-03T03:00:00Z"))
            .await
            .expect("claim")
            .map(|x| x.id),
        Some("exs_2".into()),
        "exs_2's claim lapsed; exs_1 is not due"
    );
    assert_eq!(
        s.claim_due_schedule(a, utc("2026-07-03T02:00:00Z"), utc("2026-07-03T03:00:00Z"))
            .await
            .expect("claim")
            .map(|x| x.id),
        Some("exs_1".into())
    );
}

async fn concurrent_claimants_take_a_due_schedule_once(s: &dyn Both) {
    for i in 0..5 {
        s.create_schedule(&schedule(&format!("exs_{i}"), Projects::All, "2026-07-02T02:00:00Z"), &[])
            .await
            .expect("create");
    }
    let at = utc("2026-07-02T02:00:00Z");
    let until = utc("2026-07-02T02:10:00Z");
    let names: Vec<String> = (0..12).map(|i| format!("notifier-{i}")).collect();
    let claims = futures::future::join_all(names.iter().map(|n| s.claim_due_schedule(n, at, until))).await;
    let mut got: Vec<String> = claims.into_iter().filter_map(|c| c.expect("claim")).map(|x| x.id).collect();
    got.sort();
    assert_eq!(got, ["exs_0", "exs_1", "exs_2", "exs_3", "exs_4"], "each schedule once, to one claimant");
}

fn export_endpoint(id: &str, project: &str, types: &[&str]) -> Endpoint {
    Endpoint {
        id: WebhookId::parse(id).expect("id"),
        project_id: pid(project),
        url: format!("http://127.0.0.1:9/{id}"),
        event_types: EventTypes::parse(types.iter().map(|t| t.to_string()).collect(), "event_types").expect("types"),
        description: None,
        enabled: true,
        disabled_reason: None,
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
        previous_secret: None,
        failing_since: None,
        created_at: utc("2026-07-01T00:00:00Z"),
        updated_at: utc("2026-07-01T00:00:00Z"),
    }
}

/// The event types and run ids of what an endpoint was sent.
async fn sent(s: &dyn Both, endpoint: &str) -> Vec<(String, String)> {
    let log = s.deliveries(&WebhookId::parse(endpoint).expect("id"), None, 100).await.expect("deliveries");
    log.into_iter()
        .map(|d| {
            let body: serde_json::Value = serde_json::from_str(&d.message.body).expect("json");
            (d.message.event_type, body["data"]["run_id"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

async fn a_runs_end_is_notified_once_to_the_endpoints_that_want_it(s: &dyn Both) {
    create_project(s, "proj_1").await;
    create_project(s, "proj_2").await;
    s.create_endpoint(&export_endpoint("wh_exports", "proj_1", &["export.*"]), &[]).await.expect("endpoint");
    s.create_endpoint(&export_endpoint("wh_failed", "proj_1", &["export.failed"]), &[]).await.expect("endpoint");
    s.create_endpoint(&export_endpoint("wh_quota", "proj_1", &["quota.*"]), &[]).await.expect("endpoint");
    s.create_endpoint(&export_endpoint("wh_other", "proj_2", &["*"]), &[]).await.expect("endpoint");
    let sp = spec("proj_1", WindowKind::Day, &[CustomerKind::Project]);
    let done = |r: &ExportRun, status: RunStatus| ExportRun {
        status,
        finished_at: Some(r.started_at + chrono::Duration::seconds(1)),
        ..r.clone()
    };
    // A partial run is notified as it ends.
    let partial =
        ExportRun { schedule_id: Some("exs_1".into()), ..started("exr_1", sp.clone(), "2026-07-07T12:00:00Z") };
    s.create_export_run(&partial).await.expect("create");
    s.finish_export_run(&ExportRun { mark: Some(Mark::Time), ..done(&partial, RunStatus::Partial) }, &[])
        .await
        .expect("finish");
    // A complete run once reconciled, once however often it is reconciled.
    let complete = started("exr_2", sp.clone(), "2026-07-07T13:00:00Z");
    s.create_export_run(&complete).await.expect("create");
    s.finish_export_run(&done(&complete, RunStatus::Complete), &[]).await.expect("finish");
    assert_eq!(
        sent(s, "wh_exports").await,
        [("export.completed".to_owned(), "exr_1".to_owned())],
        "not before its reconciliation"
    );
    let rec = Reconciliation::default();
    assert!(s.set_reconciliation("exr_2", &rec, utc("2026-07-07T13:00:02Z")).await.expect("reconcile"));
    assert!(s.set_reconciliation("exr_2", &rec, utc("2026-07-07T13:00:09Z")).await.expect("again"));
    // A failed run, and one abandoned.
    let failed = started("exr_3", sp.clone(), "2026-07-07T14:00:00Z");
    s.create_export_run(&failed).await.expect("create");
    s.finish_export_run(&ExportRun { error: Some("disk full".into()), ..done(&failed, RunStatus::Failed) }, &[])
        .await
        .expect("finish");
    let dead = started("exr_4", sp.clone(), "2026-07-07T15:00:00Z");
    s.create_export_run(&dead).await.expect("create");
    assert_eq!(
        s.abandon_export_runs(&pid("proj_1"), utc("2026-07-07T16:00:00Z"), utc("2026-07-07T16:00:00Z"))
            .await
            .expect("abandon"),
        1
    );
    let pair = |t: &str, r: &str| (t.to_owned(), r.to_owned());
    let mut all = sent(s, "wh_exports").await;
    all.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(
        all,
        [
            pair("export.completed", "exr_1"),
            pair("export.completed", "exr_2"),
            pair("export.failed", "exr_3"),
            pair("export.failed", "exr_4")
        ]
    );
    let mut failures = sent(s, "wh_failed").await;
    failures.sort();
    assert_eq!(failures, [pair("export.failed", "exr_3"), pair("export.failed", "exr_4")]);
    assert!(sent(s, "wh_quota").await.is_empty(), "a quota subscriber gets no export news");
    assert!(sent(s, "wh_other").await.is_empty(), "another project's endpoint gets none");
    // The body says what the run did.
    let log = s.deliveries(&WebhookId::parse("wh_exports").expect("id"), None, 100).await.expect("deliveries");
    let first = log.iter().find(|d| d.message.body.contains("exr_1")).expect("exr_1's message");
    let body: serde_json::Value = serde_json::from_str(&first.message.body).expect("json");
    assert_eq!((body["data"]["status"].as_str(), body["data"]["mark"].as_str()), (Some("partial"), Some("TIME")));
    assert_eq!(body["data"]["schedule_id"], "exs_1");
    // Scheduled runs are listed by their schedule.
    let ids: Vec<String> = s.schedule_runs("exs_1", 10).await.expect("runs").into_iter().map(|r| r.id).collect();
    assert_eq!(ids, ["exr_1"]);
    assert!(s.schedule_runs("exs_2", 10).await.expect("runs").is_empty());
}
