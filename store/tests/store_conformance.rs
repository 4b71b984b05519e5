//! The `Store` conformance suite. Each behaviour is one async fn over
//! `&dyn Store`; `conformance!` stamps every one out as a test per backend:
//!
//! - `pg::*` runs against a real PostgreSQL. Each test gets a database of
//!   its own (`tg_<uuid>`), so the tests run in parallel; it is dropped when
//!   the test ends, even if it panics. `TOLLGATE_TEST_DATABASE_URL` names the
//!   server (default `postgres://postgres@127.0.0.1:5432/test`).
//! - `sqlite::*` runs against the embedded store, a fresh file in a temporary
//!   directory per test, removed when the test ends.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use meter::{
    ApiKey, ApiKeyId, AuditAction, AuditDetail, AuditEntry, AuditId, CounterKey, DesiredQuota,
    Dimension, EventId, EventKind, FoldBatch, Grants, Metric, MonitorBreach, Mode, OffsetMove,
    OnUnpriced, Outcome, PortError, Principal, Project, ProjectId, Quota, QuotaId, QuotaPatch,
    QuotaPlan, QuotaSpec, Scope, Store, Totals, UsageFact, WindowKind,
};
use sqlx::{Connection, PgConnection};
use store::{PgStore, SqliteStore};

/// Stamps out every suite test for one backend. `$fixture` is an expression
/// giving a future of a value with a `store` field (the backend's store,
/// migrated), kept alive for the test.
macro_rules! conformance {
    ($fixture:expr) => {
        conformance!(@plain $fixture;
            projects_and_api_keys_round_trip,
            quotas_crud,
            a_duplicate_quota_identity_is_a_conflict,
            fold_batch_folds_and_returns_the_new_totals,
            the_same_event_in_two_batches_counts_once,
            the_same_event_twice_in_one_batch_counts_once,
            a_fenced_batch_changes_nothing,
            two_projectors_racing_from_the_same_offset_fold_once,
            offsets_round_trip_per_consumer_and_topic,
            a_calendar_month_in_kathmandu_lands_in_the_local_month,
            an_event_of_an_unknown_project_fails_the_batch_and_changes_nothing,
            a_large_batch_folds_in_one_go,
            a_deleted_api_key_no_longer_reads_back,
            audit_entries_page_by_cursor_in_id_order,
            a_monitor_breach_is_written_once_per_quota_and_window,
            apply_quotas_carries_out_a_plan_with_its_audit_entries,
            a_failing_plan_changes_nothing,
            two_applies_racing_from_the_same_set_one_wins,
        );

        // `purge_processed_before` and `migrate` are inherent methods of
        // each store (not on the port), with the same signatures.
        #[tokio::test]
        async fn purging_the_dedup_set_forgets_old_ids_only() {
            let db = $fixture.await;
            let store = &db.store;
            super::purging_the_dedup_set_forgets_old_ids_only(store, async |before| {
                store.purge_processed_before(before).await.expect("purge")
            })
            .await;
        }

        #[tokio::test]
        async fn migrating_twice_is_harmless() {
            let db = $fixture.await;
            db.store.migrate().await.expect("second migrate");
        }
    };
    (@plain $fixture:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $test() {
                let db = $fixture.await;
                super::$test(&db.store).await;
            }
        )*
    };
}

mod pg {
    use super::*;

    conformance!(PgDb::new());
}

mod sqlite {
    use super::*;

    conformance!(SqliteDb::new());

    #[tokio::test]
    async fn a_committed_fold_survives_closing_and_reopening_the_file() {
        let dir = TempDir::new();
        let path = dir.0.join("tollgate.db");
        let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
        {
            let s = SqliteStore::open(&path).await.expect("open");
            s.migrate().await.expect("migrate");
            s.create_project(&project("proj_1", chrono_tz::Asia::Kathmandu))
                .await
                .expect("create project");
            s.fold_batch(&batch(
                0,
                2,
                vec![
                    call("proj_1", "e1", "2026-07-07T12:31:10Z", 5),
                    request("proj_1", "e2", "2026-07-07T12:31:20Z"),
                ],
            ))
            .await
            .expect("fold");
            s.pool().close().await;
        }

        let s = SqliteStore::open(&path).await.expect("reopen");
        s.migrate().await.expect("migrating an up-to-date file");
        assert_eq!(
            s.project(&pid("proj_1")).await.expect("project"),
            Some(project("proj_1", chrono_tz::Asia::Kathmandu))
        );
        assert_eq!(
            total(&s, "proj_1", minute).await,
            Totals {
                requests: 1,
                calls: 1,
                rows: 5
            }
        );
        assert_eq!(
            s.offsets("projector", "tollgate.usage").await.expect("offsets"),
            BTreeMap::from([(0, 2)])
        );
        // The fold's ids are still known: a redelivery counts nothing.
        let report = s
            .fold_batch(&batch(2, 3, vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5)]))
            .await
            .expect("fold after reopening");
        assert!(report.folded.is_empty());
        assert_eq!(report.duplicates.len(), 1);

        // What makes a commit survive a kill -9: WAL, fsync on commit.
        let (journal,): (String,) = sqlx::query_as("PRAGMA journal_mode")
            .fetch_one(s.pool())
            .await
            .expect("journal mode");
        assert_eq!(journal, "wal");
        let (synchronous,): (i64,) = sqlx::query_as("PRAGMA synchronous")
            .fetch_one(s.pool())
            .await
            .expect("synchronous");
        assert_eq!(synchronous, 2, "FULL");
        let (foreign_keys,): (i64,) = sqlx::query_as("PRAGMA foreign_keys")
            .fetch_one(s.pool())
            .await
            .expect("foreign keys");
        assert_eq!(foreign_keys, 1);
    }
}

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

/// A fresh, migrated SQLite file. Fields drop in order: the store, then the
/// directory.
struct SqliteDb {
    store: SqliteStore,
    _dir: TempDir,
}

impl SqliteDb {
    async fn new() -> SqliteDb {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.0.join("tollgate.db"))
            .await
            .expect("open the test file");
        store.migrate().await.expect("migrate");
        SqliteDb { store, _dir: dir }
    }
}

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

fn server_url() -> String {
    std::env::var("TOLLGATE_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// `url` with its database replaced by `db`.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    match query {
        Some(q) => format!("{host_part}/{db}?{q}"),
        None => format!("{host_part}/{db}"),
    }
}

/// A fresh, migrated PostgreSQL database, dropped on drop.
struct PgDb {
    name: String,
    store: PgStore,
}

impl PgDb {
    async fn new() -> PgDb {
        let server = server_url();
        let name = format!("tg_{}", uuid::Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(&server)
            .await
            .expect("connect to the test server");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create the test database");
        admin.close().await.expect("close the admin connection");
        let store = PgStore::connect(&with_database(&server, &name))
            .await
            .expect("connect to the test database");
        store.migrate().await.expect("migrate");
        PgDb { name, store }
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        // Best effort, on a thread of its own so it also runs while a test
        // panics inside the runtime.
        let name = self.name.clone();
        let server = server_url();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut admin)
                    .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s)
        .expect("test timestamp")
        .with_timezone(&Utc)
}

fn pid(s: &str) -> ProjectId {
    ProjectId::parse(s).expect("project id")
}

fn project(id: &str, tz: Tz) -> Project {
    Project {
        id: pid(id),
        name: format!("project {id}"),
        timezone: tz,
        created_at: utc("2026-01-01T00:00:00Z"),
    }
}

fn call(project: &str, id: &str, at: &str, rows: u64) -> UsageFact {
    UsageFact {
        id: EventId::parse(id).expect("event id"),
        project_id: pid(project),
        api_key_id: Some(ApiKeyId::parse("key_1").expect("key id")),
        agent_id: None,
        actor_id: Some("user_1".into()),
        occurred_at: utc(at),
        kind: EventKind::Call,
        outcome: Outcome::Success,
        rows,
        reservation_id: None,
        gateway: "gw-test".into(),
    }
}

fn request(project: &str, id: &str, at: &str) -> UsageFact {
    UsageFact {
        kind: EventKind::Request,
        rows: 0,
        api_key_id: None,
        ..call(project, id, at, 0)
    }
}

fn batch(from: i64, to: i64, facts: Vec<UsageFact>) -> FoldBatch {
    FoldBatch {
        consumer: "projector".into(),
        topic: "tollgate.usage".into(),
        offsets: vec![OffsetMove {
            partition: 0,
            from,
            to,
        }],
        facts,
    }
}

fn key(dimension: Dimension, window: WindowKind, window_key: &str) -> CounterKey {
    CounterKey {
        dimension,
        window,
        window_key: window_key.into(),
    }
}

async fn total(store: &dyn Store, project: &str, k: CounterKey) -> Totals {
    let got = store
        .totals(&pid(project), std::slice::from_ref(&k))
        .await
        .expect("totals");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, k);
    got[0].1
}

fn quota(
    id: &str,
    project: &str,
    scope: Scope,
    scope_ref: Option<&str>,
    window: WindowKind,
) -> Quota {
    Quota {
        id: QuotaId::parse(id).expect("quota id"),
        spec: QuotaSpec {
            project_id: pid(project),
            scope,
            scope_ref: scope_ref.map(str::to_owned),
            metric: Metric::Calls,
            window,
            limit: 100,
            mode: Mode::Enforce,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: utc("2026-02-01T10:00:00Z"),
        updated_at: utc("2026-02-01T10:00:00Z"),
    }
}

pub async fn projects_and_api_keys_round_trip(s: &dyn Store) {
    let p = project("proj_1", chrono_tz::Asia::Kathmandu);
    s.create_project(&p).await.expect("create project");
    assert_eq!(
        s.project(&p.id).await.expect("read project"),
        Some(p.clone())
    );
    assert_eq!(
        s.project(&pid("nope")).await.expect("read missing project"),
        None
    );
    assert!(
        matches!(s.create_project(&p).await, Err(PortError::Conflict(_))),
        "duplicate project id"
    );

    let k = ApiKey {
        id: ApiKeyId::parse("key_1").expect("key id"),
        project_id: p.id.clone(),
        name: "ci".into(),
        prefix: "tg_abc".into(),
        grants: Grants {
            max_concurrent: Some(5),
            query_timeout: None,
            max_rows: Some(1000),
        },
        created_at: utc("2026-01-02T03:04:05.123456Z"),
    };
    s.create_api_key(&k, "hash-1").await.expect("create key");
    assert_eq!(s.api_key(&k.id).await.expect("read key"), Some(k.clone()));
    assert_eq!(
        s.api_key_by_secret_hash("hash-1").await.expect("by hash"),
        Some(k.clone())
    );
    assert_eq!(
        s.api_key_by_secret_hash("hash-2")
            .await
            .expect("by unknown hash"),
        None
    );
    assert_eq!(
        s.api_key(&ApiKeyId::parse("key_2").expect("id"))
            .await
            .expect("missing key"),
        None
    );

    let other = ApiKey {
        id: ApiKeyId::parse("key_2").expect("id"),
        ..k.clone()
    };
    assert!(
        matches!(
            s.create_api_key(&other, "hash-1").await,
            Err(PortError::Conflict(_))
        ),
        "a secret hash is unique"
    );
    let orphan = ApiKey {
        id: ApiKeyId::parse("key_3").expect("id"),
        project_id: pid("nope"),
        ..k
    };
    assert!(
        matches!(
            s.create_api_key(&orphan, "hash-3").await,
            Err(PortError::Permanent(_))
        ),
        "a key needs its project"
    );
}

pub async fn quotas_crud(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let a = quota("q_a", "proj_1", Scope::Project, None, WindowKind::Day);
    let mut b = quota(
        "q_b",
        "proj_1",
        Scope::ApiKey,
        Some("key_1"),
        WindowKind::CalendarMonth,
    );
    b.created_at = utc("2026-02-01T11:00:00Z");
    b.spec.metric = Metric::Rows;
    b.spec.mode = Mode::Monitor;
    s.create_quota(&a).await.expect("create a");
    s.create_quota(&b).await.expect("create b");
    // The enums the validator refuses today still round-trip through storage.
    let mut c = quota("q_c", "proj_1", Scope::Agent, None, WindowKind::Rolling1h);
    c.created_at = utc("2026-02-01T12:00:00Z");
    c.spec.metric = Metric::CostUsd;
    c.spec.meter_type = Some("llm_tokens".into());
    c.spec.on_unpriced = Some(OnUnpriced::Allow);
    s.create_quota(&c).await.expect("create c");

    assert_eq!(s.quota(&a.id).await.expect("read a"), Some(a.clone()));
    assert_eq!(s.quota(&c.id).await.expect("read c"), Some(c.clone()));
    assert_eq!(
        s.quotas(&pid("proj_1")).await.expect("list"),
        vec![a.clone(), b.clone(), c.clone()]
    );
    assert!(
        s.quotas(&pid("proj_2"))
            .await
            .expect("list other")
            .is_empty()
    );

    let at = utc("2026-03-01T00:00:00Z");
    let patched = s
        .update_quota(
            &a.id,
            &QuotaPatch {
                limit: Some(7),
                mode: Some(Mode::Monitor),
            },
            at,
        )
        .await
        .expect("patch")
        .expect("a exists");
    assert_eq!(patched.spec.limit, 7);
    assert_eq!(patched.spec.mode, Mode::Monitor);
    assert_eq!(patched.updated_at, at);
    assert_eq!(patched.created_at, a.created_at);
    let only_limit = s
        .update_quota(
            &a.id,
            &QuotaPatch {
                limit: Some(9),
                mode: None,
            },
            at,
        )
        .await
        .expect("patch limit")
        .expect("a exists");
    assert_eq!(
        (only_limit.spec.limit, only_limit.spec.mode),
        (9, Mode::Monitor)
    );
    assert_eq!(s.quota(&a.id).await.expect("reread"), Some(only_limit));
    assert_eq!(
        s.update_quota(
            &QuotaId::parse("q_none").expect("id"),
            &QuotaPatch::default(),
            at
        )
        .await
        .expect("patch none"),
        None
    );

    assert!(s.delete_quota(&b.id).await.expect("delete b"));
    assert!(!s.delete_quota(&b.id).await.expect("delete b again"));
    assert_eq!(s.quota(&b.id).await.expect("read deleted"), None);
}

pub async fn a_duplicate_quota_identity_is_a_conflict(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");

    // scope_ref NULL on both: still the same identity.
    s.create_quota(&quota(
        "q_1",
        "proj_1",
        Scope::Project,
        None,
        WindowKind::Day,
    ))
    .await
    .expect("first");
    let e = s
        .create_quota(&quota(
            "q_2",
            "proj_1",
            Scope::Project,
            None,
            WindowKind::Day,
        ))
        .await;
    assert!(
        matches!(e, Err(PortError::Conflict(_))),
        "null scope_ref collides: {e:?}"
    );
    let e = s
        .create_quota(&quota(
            "q_3",
            "proj_1",
            Scope::ApiKey,
            None,
            WindowKind::Day,
        ))
        .await;
    assert!(e.is_ok(), "another scope is another identity: {e:?}");
    let e = s
        .create_quota(&quota(
            "q_4",
            "proj_1",
            Scope::ApiKey,
            None,
            WindowKind::Day,
        ))
        .await;
    assert!(
        matches!(e, Err(PortError::Conflict(_))),
        "all-keys quota twice: {e:?}"
    );

    s.create_quota(&quota(
        "q_5",
        "proj_1",
        Scope::ApiKey,
        Some("key_1"),
        WindowKind::Day,
    ))
    .await
    .expect("one key");
    let e = s
        .create_quota(&quota(
            "q_6",
            "proj_1",
            Scope::ApiKey,
            Some("key_1"),
            WindowKind::Day,
        ))
        .await;
    assert!(
        matches!(e, Err(PortError::Conflict(_))),
        "same key twice: {e:?}"
    );
    s.create_quota(&quota(
        "q_7",
        "proj_1",
        Scope::ApiKey,
        Some("key_2"),
        WindowKind::Day,
    ))
    .await
    .expect("other key");
    s.create_quota(&quota(
        "q_8",
        "proj_1",
        Scope::Project,
        None,
        WindowKind::Rolling1m,
    ))
    .await
    .expect("other window");

    // Only identity matters: a different limit or mode still collides.
    let mut q = quota("q_9", "proj_1", Scope::Project, None, WindowKind::Day);
    q.spec.limit = 5;
    q.spec.mode = Mode::Monitor;
    assert!(matches!(
        s.create_quota(&q).await,
        Err(PortError::Conflict(_))
    ));
    // The same id twice is a conflict too.
    let e = s
        .create_quota(&quota(
            "q_1",
            "proj_1",
            Scope::Project,
            None,
            WindowKind::Rolling1h,
        ))
        .await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "same id: {e:?}");

    assert_eq!(s.quotas(&pid("proj_1")).await.expect("list").len(), 5);
}

pub async fn fold_batch_folds_and_returns_the_new_totals(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    s.create_project(&project("proj_2", Tz::UTC))
        .await
        .expect("create project");

    let facts = vec![
        call("proj_1", "e1", "2026-07-07T12:31:10Z", 5),
        call("proj_1", "e2", "2026-07-07T12:31:50Z", 7),
        request("proj_1", "e3", "2026-07-07T12:31:55Z"),
        UsageFact {
            outcome: Outcome::Failure,
            ..call("proj_1", "e4", "2026-07-07T12:32:00Z", 3)
        },
        call("proj_2", "e1", "2026-07-07T12:31:10Z", 1),
    ];
    let report = s
        .fold_batch(&batch(0, 5, facts.clone()))
        .await
        .expect("fold");
    let ids: Vec<(ProjectId, EventId)> = facts
        .iter()
        .map(|f| (f.project_id.clone(), f.id.clone()))
        .collect();
    assert_eq!(
        report.folded, ids,
        "every id is new, the failed call included"
    );
    assert!(report.duplicates.is_empty());

    let minute = key(
        Dimension::Project,
        WindowKind::Rolling1m,
        "2026-07-07T12:31Z",
    );
    let by_counter: BTreeMap<(ProjectId, CounterKey), Totals> = report
        .totals
        .iter()
        .map(|(p, c, t)| ((p.clone(), c.key.clone()), *t))
        .collect();
    assert_eq!(by_counter.len(), report.totals.len(), "each counter once");
    assert_eq!(
        by_counter[&(pid("proj_1"), minute.clone())],
        Totals {
            requests: 1,
            calls: 2,
            rows: 12
        }
    );
    assert_eq!(
        by_counter[&(pid("proj_2"), minute.clone())],
        Totals {
            requests: 0,
            calls: 1,
            rows: 1
        }
    );
    let (_, c, _) = report
        .totals
        .iter()
        .find(|(p, c, _)| p == &pid("proj_1") && c.key == minute)
        .expect("minute counter reported");
    assert_eq!(c.resets_at, Some(utc("2026-07-07T12:32:00Z")));
    assert!(
        !by_counter.contains_key(&(
            pid("proj_1"),
            key(
                Dimension::Project,
                WindowKind::Rolling1m,
                "2026-07-07T12:32Z"
            )
        )),
        "a failed call touches no counter"
    );
    // The actor counts calls but not requests.
    assert_eq!(
        by_counter[&(
            pid("proj_1"),
            key(
                Dimension::Actor("user_1".into()),
                WindowKind::Day,
                "2026-07-07"
            )
        )],
        Totals {
            requests: 0,
            calls: 2,
            rows: 12
        }
    );

    // A second batch reports the new absolute totals.
    let report = s
        .fold_batch(&batch(
            5,
            6,
            vec![call("proj_1", "e5", "2026-07-07T12:31:59Z", 100)],
        ))
        .await
        .expect("fold again");
    let t = report
        .totals
        .iter()
        .find(|(p, c, _)| p == &pid("proj_1") && c.key == minute)
        .map(|(_, _, t)| *t)
        .expect("minute counter reported");
    assert_eq!(
        t,
        Totals {
            requests: 1,
            calls: 3,
            rows: 112
        }
    );
    assert_eq!(total(s, "proj_1", minute.clone()).await, t);
    assert_eq!(
        total(
            s,
            "proj_1",
            key(
                Dimension::ApiKey(ApiKeyId::parse("key_1").expect("id")),
                WindowKind::Rolling1h,
                "2026-07-07T12:00Z"
            )
        )
        .await,
        Totals {
            requests: 0,
            calls: 3,
            rows: 112
        }
    );
    assert_eq!(
        total(
            s,
            "proj_1",
            key(Dimension::Project, WindowKind::Day, "2026-07-08")
        )
        .await,
        Totals::default(),
        "a counter never written is zero"
    );

    // open_totals: at 12:31:30 every window is open; at 12:32 the minute closed.
    let open = s
        .open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z"))
        .await
        .expect("open totals");
    assert!(open.iter().any(|(c, _)| c.key == minute));
    let open = s
        .open_totals(&pid("proj_1"), utc("2026-07-07T12:32:00Z"))
        .await
        .expect("open totals");
    assert!(!open.iter().any(|(c, _)| c.key == minute));
    let (_, day) = open
        .iter()
        .find(|(c, _)| c.key == key(Dimension::Project, WindowKind::Day, "2026-07-07"))
        .expect("day still open");
    assert_eq!(
        *day,
        Totals {
            requests: 1,
            calls: 3,
            rows: 112
        }
    );
    assert!(
        s.open_totals(&pid("proj_1"), utc("2026-09-01T00:00:00Z"))
            .await
            .expect("later")
            .is_empty()
    );

    assert_eq!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets"),
        BTreeMap::from([(0, 6)])
    );
}

pub async fn the_same_event_in_two_batches_counts_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let minute = key(
        Dimension::Project,
        WindowKind::Rolling1m,
        "2026-07-07T12:31Z",
    );

    s.fold_batch(&batch(
        0,
        1,
        vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5)],
    ))
    .await
    .expect("first");
    // A client resent e1 (a new offset); e2 is new.
    let report = s
        .fold_batch(&batch(
            1,
            3,
            vec![
                call("proj_1", "e1", "2026-07-07T12:31:10Z", 5),
                call("proj_1", "e2", "2026-07-07T12:31:20Z", 1),
            ],
        ))
        .await
        .expect("second");
    assert_eq!(
        report.folded,
        vec![(pid("proj_1"), EventId::parse("e2").expect("id"))]
    );
    assert_eq!(
        report.duplicates,
        vec![(pid("proj_1"), EventId::parse("e1").expect("id"))]
    );
    assert_eq!(
        total(s, "proj_1", minute.clone()).await,
        Totals {
            requests: 0,
            calls: 2,
            rows: 6
        }
    );

    // A batch of nothing but duplicates still moves the offsets and touches no counter.
    let report = s
        .fold_batch(&batch(
            3,
            4,
            vec![call("proj_1", "e2", "2026-07-07T12:31:20Z", 1)],
        ))
        .await
        .expect("third");
    assert!(report.folded.is_empty());
    assert_eq!(report.duplicates.len(), 1);
    assert!(report.totals.is_empty());
    assert_eq!(
        total(s, "proj_1", minute).await,
        Totals {
            requests: 0,
            calls: 2,
            rows: 6
        }
    );
    assert_eq!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets"),
        BTreeMap::from([(0, 4)])
    );

    // The same id in another project is another event.
    s.create_project(&project("proj_2", Tz::UTC))
        .await
        .expect("create project");
    let report = s
        .fold_batch(&batch(
            4,
            5,
            vec![call("proj_2", "e1", "2026-07-07T12:31:10Z", 5)],
        ))
        .await
        .expect("other project");
    assert_eq!(report.folded.len(), 1);
}

pub async fn the_same_event_twice_in_one_batch_counts_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let first = call("proj_1", "e1", "2026-07-07T12:31:10Z", 5);
    // The second copy differs; the first one wins.
    let second = call("proj_1", "e1", "2026-07-07T12:31:10Z", 50);
    let report = s
        .fold_batch(&batch(
            0,
            3,
            vec![
                first,
                call("proj_1", "e2", "2026-07-07T12:31:11Z", 1),
                second,
            ],
        ))
        .await
        .expect("fold");
    let e = |id: &str| (pid("proj_1"), EventId::parse(id).expect("id"));
    assert_eq!(report.folded, vec![e("e1"), e("e2")]);
    assert_eq!(report.duplicates, vec![e("e1")]);
    let minute = key(
        Dimension::Project,
        WindowKind::Rolling1m,
        "2026-07-07T12:31Z",
    );
    assert_eq!(
        total(s, "proj_1", minute).await,
        Totals {
            requests: 0,
            calls: 2,
            rows: 6
        }
    );
}

pub async fn a_fenced_batch_changes_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let minute = key(
        Dimension::Project,
        WindowKind::Rolling1m,
        "2026-07-07T12:31Z",
    );
    s.fold_batch(&batch(
        0,
        2,
        vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5)],
    ))
    .await
    .expect("first");
    let before_offsets = s
        .offsets("projector", "tollgate.usage")
        .await
        .expect("offsets");
    let before_totals = s
        .open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z"))
        .await
        .expect("totals");

    // A stale projector replays from 0; another starts from a wrong offset.
    for from in [0, 1, 3] {
        let e = s
            .fold_batch(&batch(
                from,
                4,
                vec![call("proj_1", "e2", "2026-07-07T12:31:20Z", 9)],
            ))
            .await
            .expect_err("fenced");
        assert!(matches!(e, PortError::Fenced(_)), "from {from}: {e:?}");
    }
    // A two-partition batch whose second partition is stale changes the first one neither.
    let mut two = batch(2, 3, vec![call("proj_1", "e3", "2026-07-07T12:31:30Z", 1)]);
    two.offsets.push(OffsetMove {
        partition: 1,
        from: 5,
        to: 6,
    });
    assert!(matches!(
        s.fold_batch(&two).await,
        Err(PortError::Fenced(_))
    ));

    assert_eq!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets"),
        before_offsets
    );
    assert_eq!(
        s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z"))
            .await
            .expect("totals"),
        before_totals
    );
    assert_eq!(
        total(s, "proj_1", minute.clone()).await,
        Totals {
            requests: 0,
            calls: 1,
            rows: 5
        }
    );

    // The fenced events were not marked as seen: the right batch folds them.
    let report = s
        .fold_batch(&batch(
            2,
            4,
            vec![call("proj_1", "e2", "2026-07-07T12:31:20Z", 9)],
        ))
        .await
        .expect("in order");
    assert_eq!(report.folded.len(), 1);
    assert_eq!(
        total(s, "proj_1", minute).await,
        Totals {
            requests: 0,
            calls: 2,
            rows: 14
        }
    );
}

pub async fn two_projectors_racing_from_the_same_offset_fold_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    for (from, to) in [(0, 1), (1, 2)] {
        let b = batch(
            from,
            to,
            vec![call(
                "proj_1",
                &format!("e{from}"),
                "2026-07-07T12:31:10Z",
                1,
            )],
        );
        let (a, b2) = tokio::join!(s.fold_batch(&b), s.fold_batch(&b));
        let results = [a, b2];
        assert_eq!(
            results.iter().filter(|r| r.is_ok()).count(),
            1,
            "from {from}: {results:?}"
        );
        assert!(
            results
                .iter()
                .any(|r| matches!(r, Err(PortError::Fenced(_)))),
            "from {from}: {results:?}"
        );
    }
    let minute = key(
        Dimension::Project,
        WindowKind::Rolling1m,
        "2026-07-07T12:31Z",
    );
    assert_eq!(
        total(s, "proj_1", minute).await,
        Totals {
            requests: 0,
            calls: 2,
            rows: 2
        }
    );
}

pub async fn offsets_round_trip_per_consumer_and_topic(s: &dyn Store) {
    assert!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("none yet")
            .is_empty()
    );
    let mut b = batch(0, 10, Vec::new());
    b.offsets.push(OffsetMove {
        partition: 2,
        from: 0,
        to: 3,
    });
    s.fold_batch(&b)
        .await
        .expect("move two partitions without facts");
    let mut b = batch(10, 12, Vec::new());
    b.offsets.push(OffsetMove {
        partition: 1,
        from: 0,
        to: 1,
    });
    s.fold_batch(&b).await.expect("a new partition joins");
    assert_eq!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets"),
        BTreeMap::from([(0, 12), (1, 1), (2, 3)])
    );
    // Another consumer, or another topic, has offsets of its own.
    assert!(
        s.offsets("replay", "tollgate.usage")
            .await
            .expect("other consumer")
            .is_empty()
    );
    assert!(
        s.offsets("projector", "other.usage")
            .await
            .expect("other topic")
            .is_empty()
    );
    let mut other = batch(0, 4, Vec::new());
    other.consumer = "replay".into();
    s.fold_batch(&other)
        .await
        .expect("other consumer starts fresh");
    assert_eq!(
        s.offsets("replay", "tollgate.usage").await.expect("replay"),
        BTreeMap::from([(0, 4)])
    );
    assert_eq!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets")
            .get(&0),
        Some(&12)
    );

    // A fresh partition must start at 0.
    let mut late = batch(0, 1, Vec::new());
    late.offsets = vec![OffsetMove {
        partition: 7,
        from: 5,
        to: 6,
    }];
    let e = s.fold_batch(&late).await;
    assert!(matches!(e, Err(PortError::Fenced(_))), "{e:?}");
    assert!(
        !s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets")
            .contains_key(&7)
    );
}

pub async fn a_calendar_month_in_kathmandu_lands_in_the_local_month(s: &dyn Store) {
    s.create_project(&project("proj_ktm", chrono_tz::Asia::Kathmandu))
        .await
        .expect("create project");
    s.create_project(&project("proj_utc", Tz::UTC))
        .await
        .expect("create project");
    // 18:20 UTC on 31 July is 00:05 on 1 August in Kathmandu (+05:45).
    let at = "2026-07-31T18:20:00Z";
    let report = s
        .fold_batch(&batch(
            0,
            2,
            vec![call("proj_ktm", "e1", at, 3), call("proj_utc", "e1", at, 3)],
        ))
        .await
        .expect("fold");

    let august = key(Dimension::Project, WindowKind::CalendarMonth, "2026-08");
    let july = key(Dimension::Project, WindowKind::CalendarMonth, "2026-07");
    assert_eq!(
        total(s, "proj_ktm", august.clone()).await,
        Totals {
            requests: 0,
            calls: 1,
            rows: 3
        }
    );
    assert_eq!(total(s, "proj_ktm", july.clone()).await, Totals::default());
    assert_eq!(
        total(s, "proj_utc", july.clone()).await,
        Totals {
            requests: 0,
            calls: 1,
            rows: 3
        }
    );
    assert_eq!(
        total(s, "proj_utc", august.clone()).await,
        Totals::default()
    );

    let (_, month, _) = report
        .totals
        .iter()
        .find(|(p, c, _)| p == &pid("proj_ktm") && c.key == august)
        .expect("august reported");
    assert_eq!(month.resets_at, Some(utc("2026-08-31T18:15:00Z")));
    let day = key(Dimension::Project, WindowKind::Day, "2026-08-01");
    assert_eq!(total(s, "proj_ktm", day).await.calls, 1);
    // Rolling windows stay in UTC.
    let hour = key(
        Dimension::Project,
        WindowKind::Rolling1h,
        "2026-07-31T18:00Z",
    );
    assert_eq!(total(s, "proj_ktm", hour).await.calls, 1);

    // The month's row is open until its local end.
    let open = s
        .open_totals(&pid("proj_ktm"), utc("2026-08-31T18:14:59Z"))
        .await
        .expect("open");
    assert!(open.iter().any(|(c, _)| c.key == august));
    let open = s
        .open_totals(&pid("proj_ktm"), utc("2026-08-31T18:15:00Z"))
        .await
        .expect("open");
    assert!(!open.iter().any(|(c, _)| c.key == august));
}

pub async fn an_event_of_an_unknown_project_fails_the_batch_and_changes_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let e = s
        .fold_batch(&batch(
            0,
            2,
            vec![
                call("proj_1", "e1", "2026-07-07T12:31:10Z", 1),
                call("ghost", "e2", "2026-07-07T12:31:10Z", 1),
            ],
        ))
        .await
        .expect_err("unknown project");
    match e {
        PortError::Permanent(m) => assert!(m.contains("ghost"), "names the project: {m}"),
        other => panic!("expected permanent, got {other:?}"),
    }
    assert!(
        s.offsets("projector", "tollgate.usage")
            .await
            .expect("offsets")
            .is_empty()
    );
    assert!(
        s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z"))
            .await
            .expect("totals")
            .is_empty()
    );
}

pub async fn purging_the_dedup_set_forgets_old_ids_only(s: &dyn Store, purge: impl AsyncFn(DateTime<Utc>) -> u64) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    s.fold_batch(&batch(
        0,
        2,
        vec![
            call("proj_1", "old", "2026-05-01T00:00:00Z", 1),
            call("proj_1", "new", "2026-07-01T00:00:00Z", 1),
        ],
    ))
    .await
    .expect("fold");
    let purged = purge(utc("2026-07-01T00:00:00Z") - Duration::days(35)).await;
    assert_eq!(purged, 1);
    let report = s
        .fold_batch(&batch(
            2,
            4,
            vec![
                call("proj_1", "old", "2026-05-01T00:00:00Z", 1),
                call("proj_1", "new", "2026-07-01T00:00:00Z", 1),
            ],
        ))
        .await
        .expect("fold again");
    assert_eq!(
        report.folded,
        vec![(pid("proj_1"), EventId::parse("old").expect("id"))]
    );
    assert_eq!(
        report.duplicates,
        vec![(pid("proj_1"), EventId::parse("new").expect("id"))]
    );
}

/// Far more rows than SQLite binds in one statement (32,766 parameters):
/// 5,000 facts of 5,000 actors touch over 25,000 counters.
pub async fn a_large_batch_folds_in_one_go(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let n: i64 = 5_000;
    let facts: Vec<UsageFact> = (0..n)
        .map(|i| UsageFact {
            actor_id: Some(format!("user_{i}")),
            ..call("proj_1", &format!("e{i}"), "2026-07-07T12:31:10Z", 2)
        })
        .collect();
    let report = s
        .fold_batch(&batch(0, n, facts.clone()))
        .await
        .expect("fold");
    assert_eq!(report.folded.len(), facts.len());
    assert!(report.duplicates.is_empty());
    // project, api key, all keys: 5 windows each; then 5 per actor.
    assert_eq!(report.totals.len(), 15 + 5 * facts.len());
    let minute = key(
        Dimension::Project,
        WindowKind::Rolling1m,
        "2026-07-07T12:31Z",
    );
    let expected = Totals {
        requests: 0,
        calls: 5_000,
        rows: 10_000,
    };
    assert_eq!(total(s, "proj_1", minute.clone()).await, expected);
    assert_eq!(
        total(
            s,
            "proj_1",
            key(
                Dimension::Actor("user_4999".into()),
                WindowKind::Day,
                "2026-07-07"
            )
        )
        .await,
        Totals {
            requests: 0,
            calls: 1,
            rows: 2
        }
    );

    // Redelivered under new offsets: every id is a duplicate.
    let report = s
        .fold_batch(&batch(n, 2 * n, facts))
        .await
        .expect("fold again");
    assert!(report.folded.is_empty());
    assert_eq!(report.duplicates.len(), 5_000);
    assert!(report.totals.is_empty());
    assert_eq!(total(s, "proj_1", minute).await, expected);
}

fn api_key(id: &str, project: &str) -> ApiKey {
    ApiKey {
        id: ApiKeyId::parse(id).expect("key id"),
        project_id: pid(project),
        name: id.into(),
        prefix: "tg_abc".into(),
        grants: Grants::default(),
        created_at: utc("2026-01-02T00:00:00Z"),
    }
}

pub async fn a_deleted_api_key_no_longer_reads_back(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let k = api_key("key_1", "proj_1");
    s.create_api_key(&k, "hash-1").await.expect("create key");
    let q = quota("q_key", "proj_1", Scope::ApiKey, Some("key_1"), WindowKind::Day);
    s.create_quota(&q).await.expect("quota on the key");

    let at = utc("2026-03-01T00:00:00Z");
    assert!(s.delete_api_key(&k.id, at).await.expect("delete"));
    assert_eq!(s.api_key(&k.id).await.expect("read"), None);
    assert_eq!(
        s.api_key_by_secret_hash("hash-1").await.expect("by hash"),
        None,
        "a deleted key cannot authenticate"
    );
    assert!(
        !s.delete_api_key(&k.id, at).await.expect("delete again"),
        "already deleted"
    );
    assert!(
        !s.delete_api_key(&ApiKeyId::parse("key_nope").expect("id"), at)
            .await
            .expect("delete unknown")
    );
    // The quota naming it stays (inert), and can be deleted.
    assert_eq!(s.quota(&q.id).await.expect("quota"), Some(q.clone()));
    assert!(s.delete_quota(&q.id).await.expect("delete quota"));
    // A deleted key's secret hash is still taken.
    assert!(matches!(
        s.create_api_key(&api_key("key_2", "proj_1"), "hash-1").await,
        Err(PortError::Conflict(_))
    ));
}

fn breach(quota: &str, window_key: &str, observed: u64) -> MonitorBreach {
    MonitorBreach {
        quota_id: QuotaId::parse(quota).expect("quota id"),
        project_id: pid("proj_1"),
        metric: Metric::Calls,
        meter_type: None,
        window: WindowKind::Rolling1m,
        window_key: window_key.into(),
        limit: 5,
        observed_value: observed,
    }
}

fn aid(s: &str) -> AuditId {
    AuditId::parse(s).expect("audit id")
}

pub async fn audit_entries_page_by_cursor_in_id_order(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    s.create_project(&project("proj_2", Tz::UTC))
        .await
        .expect("create project");
    let at = utc("2026-07-07T12:31:10.123456Z");
    // Written out of order; read back in id order.
    for (i, n) in [3, 1, 4, 0, 2].into_iter().enumerate() {
        let e = breach("q_1", &format!("w{n}"), 6 + n).entry(aid(&format!("aud_{n:04}")), at);
        assert!(s.record_audit(&e).await.expect("record"), "entry {i}");
    }
    let mut other = breach("q_9", "w0", 6).entry(aid("aud_0005"), at);
    other.project_id = pid("proj_2");
    s.record_audit(&other).await.expect("other project");

    let all = s.audit(&pid("proj_1"), None, 100).await.expect("all");
    let ids: Vec<&str> = all.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["aud_0000", "aud_0001", "aud_0002", "aud_0003", "aud_0004"]);
    assert_eq!(all[1], breach("q_1", "w1", 7).entry(aid("aud_0001"), at), "round trip");

    let first = s.audit(&pid("proj_1"), None, 2).await.expect("page 1");
    assert_eq!(first.len(), 2);
    let second = s
        .audit(&pid("proj_1"), Some(&first[1].id), 2)
        .await
        .expect("page 2");
    assert_eq!(
        second.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
        ["aud_0002", "aud_0003"]
    );
    let last = s
        .audit(&pid("proj_1"), Some(&second[1].id), 2)
        .await
        .expect("page 3");
    assert_eq!(last.len(), 1);
    assert!(
        s.audit(&pid("proj_1"), Some(&last[0].id), 2)
            .await
            .expect("past the end")
            .is_empty()
    );
    assert_eq!(
        s.audit(&pid("proj_2"), None, 100)
            .await
            .expect("other project"),
        vec![other]
    );

    // A change entry with a principal round-trips too.
    let q = quota("q_a", "proj_1", Scope::Project, None, WindowKind::Day);
    let change = AuditEntry {
        id: aid("aud_0010"),
        project_id: pid("proj_1"),
        action: AuditAction::CreateQuota,
        principal: Some(Principal::new("admin", "api")),
        resource: "q_a".into(),
        detail: AuditDetail::QuotaChange {
            before: None,
            after: Some(Box::new(q)),
        },
        created_at: at,
    };
    assert!(s.record_audit(&change).await.expect("change"));
    let got = s
        .audit(&pid("proj_1"), Some(&aid("aud_0004")), 10)
        .await
        .expect("after");
    assert_eq!(got, vec![change]);
}

pub async fn a_monitor_breach_is_written_once_per_quota_and_window(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let at = utc("2026-07-07T12:31:10Z");
    let first = breach("q_1", "2026-07-07T12:31Z", 6).entry(aid("aud_1"), at);
    assert!(s.record_audit(&first).await.expect("first"));
    // The same quota and window again (a later check, another gateway): skipped.
    let again = breach("q_1", "2026-07-07T12:31Z", 9).entry(aid("aud_2"), at);
    assert!(!s.record_audit(&again).await.expect("again"));
    // Another window, another quota: written.
    assert!(
        s.record_audit(&breach("q_1", "2026-07-07T12:32Z", 6).entry(aid("aud_3"), at))
            .await
            .expect("next window")
    );
    assert!(
        s.record_audit(&breach("q_2", "2026-07-07T12:31Z", 6).entry(aid("aud_4"), at))
            .await
            .expect("other quota")
    );
    // Many writers racing on one breach write one entry.
    let racers: Vec<_> = (0..8)
        .map(|i| {
            let e = breach("q_3", "2026-07-07T12:31Z", 6).entry(aid(&format!("aud_r{i}")), at);
            async move { s.record_audit(&e).await.expect("race") }
        })
        .collect();
    let written = futures::future::join_all(racers).await;
    assert_eq!(written.iter().filter(|w| **w).count(), 1, "{written:?}");

    let all = s.audit(&pid("proj_1"), None, 100).await.expect("read");
    let kept: Vec<(&str, &str)> = all
        .iter()
        .map(|e| (e.resource.as_str(), e.id.as_str()))
        .filter(|(r, _)| *r != "q_3")
        .collect();
    assert_eq!(kept, [("q_1", "aud_1"), ("q_1", "aud_3"), ("q_2", "aud_4")]);
    assert_eq!(all.len(), 4);
    match &all[0].detail {
        AuditDetail::QuotaMonitorBreach { observed_value, .. } => {
            assert_eq!(*observed_value, 6, "the first one is kept")
        }
        other => panic!("unexpected detail {other:?}"),
    }
}

fn desired(scope: &str, scope_ref: Option<&str>, metric: &str, window: &str, limit: i64) -> DesiredQuota {
    DesiredQuota {
        scope: Some(scope.into()),
        scope_ref: scope_ref.map(|r| Some(r.to_owned())),
        metric: Some(metric.into()),
        window: Some(window.into()),
        limit: Some(limit),
        ..Default::default()
    }
}

/// Plans `want` against what `s` holds now, with ids `q_new<n>` and audit ids from `aud_<tag><n>`.
async fn plan_for(s: &dyn Store, want: &[DesiredQuota], at: &str, tag: &str) -> (QuotaPlan, Vec<AuditEntry>) {
    let current = s.quotas(&pid("proj_1")).await.expect("current");
    let mut n = 0;
    let plan = meter::apply::plan(&pid("proj_1"), want, &current, utc(at), &mut || {
        n += 1;
        QuotaId::parse(format!("q_{tag}{n}")).expect("id")
    })
    .expect("a valid plan");
    let mut m = 0;
    let audit = plan.audit(&Principal::new("admin", "test"), utc(at), &mut || {
        m += 1;
        aid(&format!("aud_{tag}{m:03}"))
    });
    (plan, audit)
}

pub async fn apply_quotas_carries_out_a_plan_with_its_audit_entries(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let want = vec![
        desired("project", None, "calls", "day", 100),
        desired("api_key", Some("key_1"), "requests", "rolling_1m", 60),
        desired("actor", None, "rows", "calendar_month", 5000),
    ];
    let (plan, audit) = plan_for(s, &want, "2026-03-01T00:00:00Z", "a").await;
    assert_eq!((plan.creates.len(), plan.updates.len(), plan.deletes.len()), (3, 0, 0));
    s.apply_quotas(&plan, &audit).await.expect("apply");
    let stored = s.quotas(&pid("proj_1")).await.expect("list");
    let created: Vec<Quota> = plan.creates.iter().map(|c| c.quota.clone()).collect();
    assert_eq!(stored, created);
    let log = s.audit(&pid("proj_1"), None, 100).await.expect("audit");
    assert_eq!(log, audit);
    assert!(log.iter().all(|e| e.action == AuditAction::CreateQuota));

    // The same set again plans nothing.
    let (again, audit) = plan_for(s, &want, "2026-03-02T00:00:00Z", "b").await;
    assert!(again.is_empty() && audit.is_empty());
    assert_eq!(again.unchanged, 3);

    // A new limit, a new mode, one removed, one added.
    let mut next = want.clone();
    next[0].limit = Some(200);
    next[1].mode = Some("monitor".into());
    next.remove(2);
    next.push(desired("project", None, "requests", "rolling_24h", 9));
    let (plan, audit) = plan_for(s, &next, "2026-03-03T00:00:00Z", "c").await;
    assert_eq!((plan.creates.len(), plan.updates.len(), plan.deletes.len()), (1, 2, 1));
    s.apply_quotas(&plan, &audit).await.expect("apply changes");
    let stored = s.quotas(&pid("proj_1")).await.expect("list");
    assert_eq!(stored.len(), 3);
    let day = stored
        .iter()
        .find(|q| q.spec.window == WindowKind::Day)
        .expect("day quota");
    assert_eq!((day.spec.limit, day.updated_at), (200, utc("2026-03-03T00:00:00Z")));
    assert_eq!(day.created_at, utc("2026-03-01T00:00:00Z"));
    let key = stored
        .iter()
        .find(|q| q.spec.scope == Scope::ApiKey)
        .expect("key quota");
    assert_eq!(key.spec.mode, Mode::Monitor);
    assert!(stored.iter().all(|q| q.spec.scope != Scope::Actor), "removed");
    let actions: Vec<&str> = s
        .audit(&pid("proj_1"), Some(&aid("aud_a003")), 100)
        .await
        .expect("audit")
        .iter()
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(
        actions,
        ["quotas:DeleteQuota", "quotas:UpdateQuota", "quotas:UpdateQuota", "quotas:CreateQuota"]
    );
    let (again, _) = plan_for(s, &next, "2026-03-04T00:00:00Z", "d").await;
    assert!(again.is_empty(), "a fixed point");

    // Single changes (the REST routes) have no precondition on the set.
    let q = stored[0].clone();
    let patch = QuotaPatch {
        limit: Some(1),
        mode: None,
    };
    s.apply_quotas(&QuotaPlan::update(q.clone(), &patch, utc("2026-03-05T00:00:00Z")), &[])
        .await
        .expect("single update");
    assert_eq!(s.quota(&q.id).await.expect("read").map(|q| q.spec.limit), Some(1));
    s.apply_quotas(&QuotaPlan::delete(q.clone()), &[])
        .await
        .expect("single delete");
    assert_eq!(s.quota(&q.id).await.expect("read"), None);
    let e = s.apply_quotas(&QuotaPlan::delete(q.clone()), &[]).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "already gone: {e:?}");
    let e = s.apply_quotas(&QuotaPlan::update(q, &patch, utc("2026-03-05T00:00:00Z")), &[]).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "already gone: {e:?}");
}

pub async fn a_failing_plan_changes_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let want = vec![
        desired("project", None, "calls", "day", 100),
        desired("api_key", Some("key_1"), "requests", "rolling_1m", 60),
    ];
    let (plan, audit) = plan_for(s, &want, "2026-03-01T00:00:00Z", "a").await;
    s.apply_quotas(&plan, &audit).await.expect("apply");
    let before = s.quotas(&pid("proj_1")).await.expect("list");
    let log_before = s.audit(&pid("proj_1"), None, 100).await.expect("audit");

    // (1) A plan whose last step fails (a create colliding with a stored
    // identity): the delete, the update and the audit entries before it are
    // rolled back.
    let mut next = want.clone();
    next[0].limit = Some(1);
    next.remove(1);
    next.push(desired("project", None, "rows", "day", 3));
    let (mut bad, audit) = plan_for(s, &next, "2026-03-02T00:00:00Z", "b").await;
    assert_eq!((bad.creates.len(), bad.updates.len(), bad.deletes.len()), (1, 1, 1));
    let mut clash = bad.creates[0].clone();
    clash.quota.id = QuotaId::parse("q_clash").expect("id");
    clash.quota.spec = before[0].spec.clone();
    bad.creates.push(clash);
    let e = s.apply_quotas(&bad, &audit).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "{e:?}");
    assert_eq!(s.quotas(&pid("proj_1")).await.expect("list"), before, "nothing changed");
    assert_eq!(s.audit(&pid("proj_1"), None, 100).await.expect("audit"), log_before);

    // (2) A plan made from a set that has moved since: fenced, nothing changed.
    let (stale, audit) = plan_for(s, &next, "2026-03-02T00:00:00Z", "c").await;
    s.update_quota(
        &before[1].id,
        &QuotaPatch {
            limit: Some(61),
            mode: None,
        },
        utc("2026-03-02T00:00:01Z"),
    )
    .await
    .expect("a concurrent change");
    let moved = s.quotas(&pid("proj_1")).await.expect("list");
    let e = s.apply_quotas(&stale, &audit).await;
    assert!(matches!(e, Err(PortError::Fenced(_))), "{e:?}");
    assert_eq!(s.quotas(&pid("proj_1")).await.expect("list"), moved);
    assert_eq!(s.audit(&pid("proj_1"), None, 100).await.expect("audit"), log_before);
    // A quota created behind the plan's back fences it too.
    let (stale, audit) = plan_for(s, &next, "2026-03-02T00:00:00Z", "d").await;
    s.create_quota(&quota("q_sneak", "proj_1", Scope::Project, None, WindowKind::Rolling1h))
        .await
        .expect("a concurrent create");
    assert!(matches!(s.apply_quotas(&stale, &audit).await, Err(PortError::Fenced(_))));

    // Re-planned from what is there now, it goes through.
    let (fresh, audit) = plan_for(s, &next, "2026-03-03T00:00:00Z", "e").await;
    s.apply_quotas(&fresh, &audit).await.expect("re-planned");
    let (again, _) = plan_for(s, &next, "2026-03-04T00:00:00Z", "f").await;
    assert!(again.is_empty());
}

pub async fn two_applies_racing_from_the_same_set_one_wins(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC))
        .await
        .expect("create project");
    let base = vec![desired("project", None, "calls", "day", 100)];
    let (plan, audit) = plan_for(s, &base, "2026-03-01T00:00:00Z", "a").await;
    s.apply_quotas(&plan, &audit).await.expect("apply");
    // Two appliers read the same set and plan different outcomes.
    let (left, left_audit) =
        plan_for(s, &[desired("project", None, "calls", "day", 1)], "2026-03-02T00:00:00Z", "l").await;
    let (right, right_audit) =
        plan_for(s, &[desired("project", None, "rows", "day", 2)], "2026-03-02T00:00:00Z", "r").await;
    let (l, r) = tokio::join!(s.apply_quotas(&left, &left_audit), s.apply_quotas(&right, &right_audit));
    let fenced = [&l, &r].iter().filter(|x| matches!(x, Err(PortError::Fenced(_)))).count();
    assert_eq!((l.is_ok() as u8 + r.is_ok() as u8, fenced), (1, 1), "{l:?} {r:?}");
    let stored = s.quotas(&pid("proj_1")).await.expect("list");
    if l.is_ok() {
        assert_eq!(stored.iter().map(|q| (q.spec.metric, q.spec.limit)).collect::<Vec<_>>(), [(Metric::Calls, 1)]);
    } else {
        assert_eq!(stored.iter().map(|q| (q.spec.metric, q.spec.limit)).collect::<Vec<_>>(), [(Metric::Rows, 2)]);
    }
    // Only the winner's audit entries were written.
    let log = s.audit(&pid("proj_1"), Some(&aid("aud_a999")), 100).await.expect("audit");
    let winner = if l.is_ok() { &left_audit } else { &right_audit };
    assert_eq!(&log, winner);
}
