//! The export [`Scheduler`]'s steps under a clock the test sets, over the
//! embedded store: a schedule runs only once due, then on its cadence; a
//! busy project is retried a minute later; two schedulers never run one
//! schedule twice; a schedule of every project takes the projects there
//! are when it runs.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use gateway::service::export_schedules::{self, NewSchedule, RETRY, Scheduler};
use gateway::state::ExportSettings;
use gateway::{AppState, Settings};
use meter::export::{Cadence, CustomerKind, Destination, ExportRun, Format, Grace, Projects, RunStatus};
use meter::{
    ApiKeyId, Clock, EventId, EventKind, ExportStore, FoldBatch, Ledger, ManualClock, OffsetMove, Principal, Project,
    ProjectId, TenantStore, UsageFact, WindowKind,
};
use store::{MemoryView, SqliteLog, SqliteStore};

fn t(s: &str) -> DateTime<Utc> {
    s.parse().expect("an instant")
}

struct World {
    state: AppState,
    store: Arc<SqliteStore>,
    clock: ManualClock,
    settings: ExportSettings,
    dir: std::path::PathBuf,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl World {
    /// Two projects in Kathmandu and UTC, calls folded for the first, the
    /// clock at `at`.
    async fn new(at: &str) -> World {
        let dir = std::env::temp_dir().join(format!("tollgate-sched-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        log.ensure_schema().await.expect("log schema");
        let clock = ManualClock::new(t(at));
        for (id, tz) in [("proj_1", chrono_tz::Asia::Kathmandu), ("proj_2", chrono_tz::UTC)] {
            let p = Project { id: pid(id), name: id.into(), timezone: tz, created_at: t(at) };
            store.create_project(&p).await.expect("project");
        }
        let facts: Vec<UsageFact> = (0..3)
            .map(|i| UsageFact {
                api_key_id: Some(ApiKeyId::parse("key_1").expect("key")),
                ..UsageFact::new(
                    EventId::parse(format!("c{i}")).expect("id"),
                    pid("proj_1"),
                    EventKind::Call,
                    t(at) - Duration::hours(1),
                )
            })
            .collect();
        let batch = FoldBatch {
            consumer: "projector".into(),
            topic: "tollgate.usage".into(),
            offsets: vec![OffsetMove { partition: 0, from: 0, to: 3 }],
            facts,
            dead_letters: Vec::new(),
            sources: BTreeMap::new(),
            horizon: None,
        };
        store.fold_batch(&batch).await.expect("fold");
        let settings = ExportSettings {
            dir: dir.join("exports"),
            consumer: "projector".into(),
            topic: "tollgate.usage".into(),
            ..ExportSettings::default()
        };
        let mut s = Settings::new("adm", "gw");
        s.exports = settings.clone();
        let store = Arc::new(store);
        let state =
            AppState::new(store.clone(), Arc::new(MemoryView::new()), Arc::new(log), Arc::new(clock.clone()), s);
        World { state, store, clock, settings, dir }
    }

    fn scheduler(&self, name: &str) -> Scheduler {
        Scheduler::new(
            self.store.clone(),
            self.store.clone(),
            self.store.clone(),
            Arc::new(self.clock.clone()),
            self.settings.clone(),
            name,
        )
    }
}

fn pid(s: &str) -> ProjectId {
    ProjectId::parse(s).expect("project id")
}

fn new_schedule(projects: Projects, cadence: Cadence) -> NewSchedule {
    NewSchedule {
        projects,
        period: WindowKind::Day,
        dimensions: [CustomerKind::ApiKey].into(),
        grace: Grace::DEFAULT,
        format: Format::Jsonl,
        destination: Destination::parse("daily").expect("destination"),
        cadence,
        timezone: None,
        enabled: true,
    }
}

fn admin() -> Principal {
    Principal::new("admin", "test")
}

#[tokio::test]
async fn a_schedule_runs_once_due_and_then_on_its_cadence() {
    let w = World::new("2026-07-07T12:00:00Z").await;
    let made =
        export_schedules::create(&w.state, new_schedule(Projects::Some(vec![pid("proj_1")]), Cadence::Daily), &admin())
            .await
            .expect("create");
    // The project's zone: midnight in Kathmandu (18:15 UTC) plus the 1 h grace.
    assert_eq!(made.timezone, chrono_tz::Asia::Kathmandu);
    assert_eq!(made.next_run_at, t("2026-07-07T19:15:00Z"));
    let sched = w.scheduler("a");
    assert_eq!(sched.step().await.expect("step"), None, "not due");
    w.clock.set(t("2026-07-07T19:15:00Z"));
    let step = sched.step().await.expect("step").expect("due");
    assert_eq!(step.runs.len(), 1);
    let run = &step.runs[0];
    assert_eq!((run.status, run.rows, run.schedule_id.as_deref()), (RunStatus::Complete, 1, Some(made.id.as_str())));
    assert!(run.file.as_deref().is_some_and(|f| f.ends_with("exports/daily")), "{:?}", run.file);
    let part = w.settings.dir.join("daily/project=proj_1/period=2026-07-07").join(format!("part-{}.jsonl", run.id));
    let text = std::fs::read_to_string(&part).expect("the run's file");
    assert!(text.contains("\"consumed_quantity\":\"3\"") || text.contains("\"consumed_quantity\":3"), "{text}");
    assert_eq!(step.next_run_at, t("2026-07-08T19:15:00Z"), "a day later");
    assert_eq!(sched.step().await.expect("step"), None, "ran: not due again until tomorrow");
    let read = export_schedules::get(&w.state, &made.id).await.expect("get");
    assert_eq!(
        (read.schedule.last_run_at, read.schedule.next_run_at),
        (Some(t("2026-07-07T19:15:00Z")), t("2026-07-08T19:15:00Z"))
    );
    assert_eq!(read.runs.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [run.id.as_str()]);

    // A notifier down for three days runs it once, then on its cadence.
    w.clock.set(t("2026-07-11T03:00:00Z"));
    let late = sched.step().await.expect("step").expect("due");
    assert_eq!(late.next_run_at, t("2026-07-11T19:15:00Z"));
    assert_eq!(late.runs[0].rows, 0, "nothing folded since");
    assert_eq!(sched.step().await.expect("step"), None);
}

#[tokio::test]
async fn a_busy_project_is_retried_and_a_schedule_runs_once_whoever_steps() {
    let w = World::new("2026-07-07T12:00:00Z").await;
    let made = export_schedules::create(&w.state, new_schedule(Projects::All, Cadence::Hourly), &admin())
        .await
        .expect("create");
    assert_eq!((made.timezone, made.next_run_at), (chrono_tz::UTC, t("2026-07-07T13:00:00Z")), "of all: UTC");
    // An export of proj_2 is running (through the API, say).
    let spec =
        meter::export::ExportSpec::new(pid("proj_2"), WindowKind::Day, [CustomerKind::Project].into(), Grace::DEFAULT)
            .expect("spec");
    let running = ExportRun {
        id: "exr_busy".into(),
        spec,
        format: Format::Csv,
        status: RunStatus::Running,
        mark: None,
        watermark: BTreeMap::new(),
        receipt_bound: None,
        started_at: t("2026-07-07T12:59:00Z"),
        finished_at: None,
        rows: 0,
        bytes: 0,
        file: None,
        reconciliation: None,
        error: None,
        schedule_id: None,
    };
    w.store.create_export_run(&running).await.expect("a running export");
    w.clock.set(t("2026-07-07T13:00:00Z"));
    let (a, b) = (w.scheduler("a"), w.scheduler("b"));
    let (ra, rb) = tokio::join!(a.step(), b.step());
    let steps: Vec<_> = [ra.expect("step a"), rb.expect("step b")].into_iter().flatten().collect();
    assert_eq!(steps.len(), 1, "one scheduler ran it: {steps:?}");
    let step = &steps[0];
    assert_eq!(step.runs.iter().map(|r| r.spec.project_id.to_string()).collect::<Vec<_>>(), ["proj_1"]);
    assert_eq!(step.busy, ["proj_2"]);
    let retry = t("2026-07-07T13:00:00Z") + Duration::from_std(RETRY).expect("retry");
    assert_eq!(step.next_run_at, retry, "due again soon, not at the next hour");
    // A project created meanwhile is in the next run of a schedule of all.
    let p3 = Project { id: pid("proj_3"), name: "p3".into(), timezone: chrono_tz::UTC, created_at: w.clock.now() };
    w.store.create_project(&p3).await.expect("project");
    let spec = running.spec.clone();
    w.store
        .finish_export_run(
            &ExportRun { status: RunStatus::Complete, finished_at: Some(w.clock.now()), spec, ..running },
            &[],
        )
        .await
        .expect("the other export ends");
    w.clock.set(retry);
    let again = a.step().await.expect("step").expect("due again");
    let mut projects: Vec<String> = again.runs.iter().map(|r| r.spec.project_id.to_string()).collect();
    projects.sort();
    assert_eq!(projects, ["proj_1", "proj_2", "proj_3"]);
    assert!(again.busy.is_empty());
    assert_eq!(again.next_run_at, t("2026-07-07T14:00:00Z"), "back on the hour");
}

#[tokio::test]
async fn a_disabled_schedule_never_runs_and_enabling_it_waits_for_the_next_boundary() {
    let w = World::new("2026-07-07T12:00:00Z").await;
    let mut new = new_schedule(Projects::Some(vec![pid("proj_2")]), Cadence::Hourly);
    new.enabled = false;
    let made = export_schedules::create(&w.state, new, &admin()).await.expect("create");
    let sched = w.scheduler("a");
    w.clock.set(t("2026-07-07T20:30:00Z"));
    assert_eq!(sched.step().await.expect("step"), None, "disabled");
    let e = export_schedules::run_now(&w.state, &made.id, &admin()).await.expect_err("disabled");
    assert!(matches!(e, gateway::service::Error::Invalid(ref f) if f.field == "enabled"), "{e:?}");
    let patch = export_schedules::SchedulePatch { enabled: Some(true), ..Default::default() };
    let on = export_schedules::update(&w.state, &made.id, patch, &admin()).await.expect("enable");
    assert_eq!(on.next_run_at, t("2026-07-07T21:00:00Z"), "the missed hours are not run");
    assert_eq!(sched.step().await.expect("step"), None);
    let now = export_schedules::run_now(&w.state, &made.id, &admin()).await.expect("run now");
    assert_eq!(now.next_run_at, t("2026-07-07T20:30:00Z"));
    let step = sched.step().await.expect("step").expect("run now");
    assert_eq!(step.runs.len(), 1);
    assert_eq!(step.next_run_at, t("2026-07-07T21:00:00Z"));
}
