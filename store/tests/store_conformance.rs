//! The `Store` conformance suite. Each behaviour is one async fn over
//! `&dyn Store`; `conformance!` stamps every one out as a test per backend:
//!
//! - `pg::*` runs against a real PostgreSQL. Each test gets a database of
//!   its own (`tg_<uuid>`), so the tests run in parallel; it is dropped when
//!   the test ends, even if it panics. `TOLLGATE_TEST_DATABASE_URL` names the
//!   server (default `postgres://postgres@127.0.0.1:5432/test`); when it does
//!   not answer these tests are skipped (`testkit`), unless
//!   `TOLLGATE_REQUIRE_SERVICES` is set.
//! - `sqlite::*` runs against the embedded store, a fresh file in a temporary
//!   directory per test, removed when the test ends.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Duration, Utc};
use chrono_tz::Tz;
use meter::{
    ApiKey, ApiKeyId, AuditAction, AuditBatch, AuditDetail, AuditEntry, AuditId, Component, Counter, CounterKey,
    DesiredQuota, Dimension, EventId, EventKind, FoldBatch, FoldReport, Footprint, Grants, Ledger, MeterType, Metric,
    Mode, ModelUsageRow, MonitorBreach, OffsetMove, OnUnpriced, Outcome, Population, PortError, Price, PriceBook,
    PriceKey, Principal, Project, ProjectId, Quota, QuotaId, QuotaPatch, QuotaPlan, QuotaSpec, Scope, Store,
    TenantStore, TokenUsage, Totals, UnpricedException, UnpricedRow, UsageFact, Usd, WindowKind,
};
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
            the_audit_outbox_is_folded_into_the_log_once_per_entry,
            a_key_or_role_change_writes_its_audit_entry_with_it_or_not_at_all,
            a_projects_keys_and_roles_are_listed_and_a_keys_grants_change_with_their_entry,
            a_monitor_breach_is_written_once_per_quota_and_window,
            apply_quotas_carries_out_a_plan_with_its_audit_entries,
            a_failing_plan_changes_nothing,
            two_applies_racing_from_the_same_set_one_wins,
            a_tokens_event_is_priced_at_its_event_time_in_the_fold,
            refolding_a_tokens_or_storage_event_adds_nothing,
            the_price_book_round_trips_in_key_order,
            a_write_of_prices_is_audited_installation_wide_with_it_or_not_at_all,
            racing_writes_of_prices_each_see_what_the_other_replaced,
            unpriced_rows_are_recorded_once_and_read_in_order,
            a_footprint_of_deltas_only_is_their_sum,
            a_snapshot_resets_the_footprint_to_it_plus_the_deltas_after_it,
            a_late_snapshot_keeps_only_the_deltas_after_it,
            the_order_of_storage_facts_does_not_change_the_footprint,
            concurrent_folds_of_one_project_keep_every_storage_fact,
            a_batch_with_a_snapshot_among_stored_and_new_deltas_keeps_only_those_after_it,
            an_exception_is_filed_once_and_counts_its_occurrences,
            exceptions_page_by_quota_id,
            a_tokens_events_breakdown_lands_in_its_local_day_and_month,
            refolding_a_tokens_event_adds_nothing_to_the_breakdown,
            two_tokens_events_of_one_model_add_up_in_the_breakdown,
            population_totals_list_each_member_of_a_population,
            sums_saturate_rather_than_fail_the_batch,
            a_price_is_applied_only_to_what_was_received_after_it_was_put,
            dead_letters_are_kept_with_the_fold_and_published_once,
            the_dedup_set_is_purged_by_the_fold_position_not_the_clock,
            a_correction_amends_or_voids_its_original_as_the_difference,
            a_refused_correction_is_dead_lettered_with_its_reason_and_forgotten,
            a_tokens_amend_is_priced_as_of_the_originals_receipt,
            members_split_the_partitions_and_a_lapsed_members_are_taken,
            concurrent_heartbeats_never_give_a_partition_to_two_members,
        );

        // `purge_processed_before` and `migrate` are inherent methods of
        // each store (not on the port), with the same signatures.
        #[tokio::test]
        async fn purging_the_dedup_set_forgets_old_ids_only() {
            let Some(db) = $fixture.await else { return };
            let store = &db.store;
            super::purging_the_dedup_set_forgets_old_ids_only(store, async |before| {
                store.purge_processed_before(before).await.expect("purge")
            })
            .await;
        }

        #[tokio::test]
        async fn a_storage_fact_refolded_after_its_id_was_purged_is_not_counted_twice() {
            let Some(db) = $fixture.await else { return };
            let store = &db.store;
            super::a_storage_fact_refolded_after_its_id_was_purged_is_not_counted_twice(store, async |before| {
                store.purge_processed_before(before).await.expect("purge")
            })
            .await;
        }

        #[tokio::test]
        async fn migrating_twice_is_harmless() {
            let Some(db) = $fixture.await else { return };
            db.store.migrate().await.expect("second migrate");
        }
    };
    (@plain $fixture:expr; $($test:ident),* $(,)?) => {
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
            s.create_project(&project("proj_1", chrono_tz::Asia::Kathmandu)).await.expect("create project");
            s.fold_batch(&batch(
                0,
                2,
                vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5), request("proj_1", "e2", "2026-07-07T12:31:20Z")],
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
        assert_eq!(total(&s, "proj_1", minute).await, Totals { requests: 1, calls: 1, rows: 5, ..Totals::default() });
        assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets"), BTreeMap::from([(0, 2)]));
        // The fold's ids are still known: a redelivery counts nothing.
        let report = s
            .fold_batch(&batch(2, 3, vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5)]))
            .await
            .expect("fold after reopening");
        assert!(report.folded.is_empty());
        assert_eq!(report.duplicates.len(), 1);

        // What makes a commit survive a kill -9: WAL, fsync on commit.
        let (journal,): (String,) =
            sqlx::query_as("PRAGMA journal_mode").fetch_one(s.pool()).await.expect("journal mode");
        assert_eq!(journal, "wal");
        let (synchronous,): (i64,) =
            sqlx::query_as("PRAGMA synchronous").fetch_one(s.pool()).await.expect("synchronous");
        assert_eq!(synchronous, 2, "FULL");
        let (foreign_keys,): (i64,) =
            sqlx::query_as("PRAGMA foreign_keys").fetch_one(s.pool()).await.expect("foreign keys");
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
    async fn new() -> Option<SqliteDb> {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.0.join("tollgate.db")).await.expect("open the test file");
        store.migrate().await.expect("migrate");
        Some(SqliteDb { store, _dir: dir })
    }
}

/// A fresh, migrated PostgreSQL database (`testkit::TestDb`, dropped on
/// drop); `None`, and the test skipped, when PostgreSQL does not answer.
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

fn project(id: &str, tz: Tz) -> Project {
    Project { id: pid(id), name: format!("project {id}"), timezone: tz, created_at: utc("2026-01-01T00:00:00Z") }
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

fn request(project: &str, id: &str, at: &str) -> UsageFact {
    UsageFact { kind: EventKind::Request, rows: 0, api_key_id: None, ..call(project, id, at, 0) }
}

fn batch(from: i64, to: i64, facts: Vec<UsageFact>) -> FoldBatch {
    FoldBatch {
        consumer: "projector".into(),
        topic: "tollgate.usage".into(),
        offsets: vec![OffsetMove { partition: 0, from, to }],
        facts,
        dead_letters: Vec::new(),
        sources: BTreeMap::new(),
        horizon: None,
    }
}

fn key(dimension: Dimension, window: WindowKind, window_key: &str) -> CounterKey {
    CounterKey { dimension, window, window_key: window_key.into() }
}

async fn total(store: &dyn Store, project: &str, k: CounterKey) -> Totals {
    let got = store.totals(&pid(project), std::slice::from_ref(&k)).await.expect("totals");
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, k);
    got[0].1
}

/// A quota created, updated or deleted on its own: a one-quota plan, as the
/// admin API carries it out.
async fn create_quota(s: &dyn Store, q: &Quota) -> Result<(), PortError> {
    s.apply_quotas(&QuotaPlan::create(q.clone()), &[]).await
}

async fn update_quota(
    s: &dyn Store,
    id: &QuotaId,
    patch: &QuotaPatch,
    at: DateTime<Utc>,
) -> Result<Option<Quota>, PortError> {
    let Some(before) = s.quota(id).await? else { return Ok(None) };
    s.apply_quotas(&QuotaPlan::update(before, patch, at), &[]).await?;
    s.quota(id).await
}

async fn delete_quota(s: &dyn Store, id: &QuotaId) -> Result<bool, PortError> {
    let Some(q) = s.quota(id).await? else { return Ok(false) };
    s.apply_quotas(&QuotaPlan::delete(q), &[]).await?;
    Ok(true)
}

fn quota(id: &str, project: &str, scope: Scope, scope_ref: Option<&str>, window: WindowKind) -> Quota {
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
    assert_eq!(s.project(&p.id).await.expect("read project"), Some(p.clone()));
    assert_eq!(s.project(&pid("nope")).await.expect("read missing project"), None);
    assert!(matches!(s.create_project(&p).await, Err(PortError::Conflict(_))), "duplicate project id");

    // A role with grants and a quota, read back as written.
    let role = meter::Role {
        id: meter::RoleId::parse("role_partner").expect("role id"),
        project_id: p.id.clone(),
        name: "partner".into(),
        grants: Grants { max_concurrent: Some(2), query_timeout: Some(30), max_rows: None },
        quota: Some(meter::RoleQuota { calls: Some(100_000), rows: None, per: meter::Per::Month }),
        exempt: false,
        created_at: utc("2026-01-02T03:04:05.123456Z"),
    };
    s.create_role(&role, &[]).await.expect("create role");
    assert_eq!(s.role(&role.id).await.expect("read role"), Some(role.clone()));
    let admins = meter::Role {
        id: meter::RoleId::parse("role_admins").expect("role id"),
        quota: None,
        exempt: true,
        ..role.clone()
    };
    s.create_role(&admins, &[]).await.expect("create role");
    assert_eq!(s.role(&admins.id).await.expect("read role"), Some(admins));
    assert_eq!(s.role(&meter::RoleId::parse("role_none").expect("id")).await.expect("read"), None);

    let k = ApiKey {
        id: ApiKeyId::parse("key_1").expect("key id"),
        project_id: p.id.clone(),
        name: "ci".into(),
        prefix: "tg_abc".into(),
        grants: Grants { max_concurrent: Some(5), query_timeout: None, max_rows: Some(1000) },
        role_id: Some(role.id.clone()),
        created_at: utc("2026-01-02T03:04:05.123456Z"),
    };
    s.create_api_key(&k, "hash-1", &[]).await.expect("create key");
    assert_eq!(s.api_key(&k.id).await.expect("read key"), Some(k.clone()));
    assert_eq!(s.api_key_by_secret_hash("hash-1").await.expect("by hash"), Some(k.clone()));
    assert_eq!(s.api_key_by_secret_hash("hash-2").await.expect("by unknown hash"), None);
    assert_eq!(s.api_key(&ApiKeyId::parse("key_2").expect("id")).await.expect("missing key"), None);

    let other = ApiKey { id: ApiKeyId::parse("key_2").expect("id"), ..k.clone() };
    assert!(
        matches!(s.create_api_key(&other, "hash-1", &[]).await, Err(PortError::Conflict(_))),
        "a secret hash is unique"
    );
    let orphan = ApiKey { id: ApiKeyId::parse("key_3").expect("id"), project_id: pid("nope"), ..k };
    assert!(
        matches!(s.create_api_key(&orphan, "hash-3", &[]).await, Err(PortError::Permanent(_))),
        "a key needs its project"
    );
}

pub async fn quotas_crud(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let a = quota("q_a", "proj_1", Scope::Project, None, WindowKind::Day);
    let mut b = quota("q_b", "proj_1", Scope::ApiKey, Some("key_1"), WindowKind::CalendarMonth);
    b.created_at = utc("2026-02-01T11:00:00Z");
    b.spec.metric = Metric::Rows;
    b.spec.mode = Mode::Monitor;
    create_quota(s, &a).await.expect("create a");
    create_quota(s, &b).await.expect("create b");
    // The enums the validator refuses today still round-trip through storage.
    let mut c = quota("q_c", "proj_1", Scope::Agent, None, WindowKind::Rolling1h);
    c.created_at = utc("2026-02-01T12:00:00Z");
    c.spec.metric = Metric::CostUsd;
    c.spec.meter_type = Some("llm_tokens".into());
    c.spec.on_unpriced = Some(OnUnpriced::Allow);
    create_quota(s, &c).await.expect("create c");

    assert_eq!(s.quota(&a.id).await.expect("read a"), Some(a.clone()));
    assert_eq!(s.quota(&c.id).await.expect("read c"), Some(c.clone()));
    assert_eq!(s.quotas(&pid("proj_1")).await.expect("list"), vec![a.clone(), b.clone(), c.clone()]);
    assert!(s.quotas(&pid("proj_2")).await.expect("list other").is_empty());

    let at = utc("2026-03-01T00:00:00Z");
    let patched = update_quota(s, &a.id, &QuotaPatch { limit: Some(7), mode: Some(Mode::Monitor) }, at)
        .await
        .expect("patch")
        .expect("a exists");
    assert_eq!(patched.spec.limit, 7);
    assert_eq!(patched.spec.mode, Mode::Monitor);
    assert_eq!(patched.updated_at, at);
    assert_eq!(patched.created_at, a.created_at);
    let only_limit = update_quota(s, &a.id, &QuotaPatch { limit: Some(9), mode: None }, at)
        .await
        .expect("patch limit")
        .expect("a exists");
    assert_eq!((only_limit.spec.limit, only_limit.spec.mode), (9, Mode::Monitor));
    assert_eq!(s.quota(&a.id).await.expect("reread"), Some(only_limit));
    assert_eq!(
        update_quota(s, &QuotaId::parse("q_none").expect("id"), &QuotaPatch::default(), at).await.expect("patch none"),
        None
    );

    assert!(delete_quota(s, &b.id).await.expect("delete b"));
    assert!(!delete_quota(s, &b.id).await.expect("delete b again"));
    assert_eq!(s.quota(&b.id).await.expect("read deleted"), None);
}

pub async fn a_duplicate_quota_identity_is_a_conflict(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");

    // scope_ref NULL on both: still the same identity.
    create_quota(s, &quota("q_1", "proj_1", Scope::Project, None, WindowKind::Day)).await.expect("first");
    let e = create_quota(s, &quota("q_2", "proj_1", Scope::Project, None, WindowKind::Day)).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "null scope_ref collides: {e:?}");
    let e = create_quota(s, &quota("q_3", "proj_1", Scope::ApiKey, None, WindowKind::Day)).await;
    assert!(e.is_ok(), "another scope is another identity: {e:?}");
    let e = create_quota(s, &quota("q_4", "proj_1", Scope::ApiKey, None, WindowKind::Day)).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "all-keys quota twice: {e:?}");

    create_quota(s, &quota("q_5", "proj_1", Scope::ApiKey, Some("key_1"), WindowKind::Day)).await.expect("one key");
    let e = create_quota(s, &quota("q_6", "proj_1", Scope::ApiKey, Some("key_1"), WindowKind::Day)).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "same key twice: {e:?}");
    create_quota(s, &quota("q_7", "proj_1", Scope::ApiKey, Some("key_2"), WindowKind::Day)).await.expect("other key");
    create_quota(s, &quota("q_8", "proj_1", Scope::Project, None, WindowKind::Rolling1m)).await.expect("other window");

    // Only identity matters: a different limit or mode still collides.
    let mut q = quota("q_9", "proj_1", Scope::Project, None, WindowKind::Day);
    q.spec.limit = 5;
    q.spec.mode = Mode::Monitor;
    assert!(matches!(create_quota(s, &q).await, Err(PortError::Conflict(_))));
    // The same id twice is a conflict too.
    let e = create_quota(s, &quota("q_1", "proj_1", Scope::Project, None, WindowKind::Rolling1h)).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "same id: {e:?}");

    assert_eq!(s.quotas(&pid("proj_1")).await.expect("list").len(), 5);
}

pub async fn fold_batch_folds_and_returns_the_new_totals(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");

    let facts = vec![
        call("proj_1", "e1", "2026-07-07T12:31:10Z", 5),
        call("proj_1", "e2", "2026-07-07T12:31:50Z", 7),
        request("proj_1", "e3", "2026-07-07T12:31:55Z"),
        UsageFact { outcome: Outcome::Failure, ..call("proj_1", "e4", "2026-07-07T12:32:00Z", 3) },
        call("proj_2", "e1", "2026-07-07T12:31:10Z", 1),
    ];
    let report = s.fold_batch(&batch(0, 5, facts.clone())).await.expect("fold");
    let ids: Vec<(ProjectId, EventId)> = facts.iter().map(|f| (f.project_id.clone(), f.id.clone())).collect();
    assert_eq!(report.folded, ids, "every id is new, the failed call included");
    assert!(report.duplicates.is_empty());

    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    let by_counter: BTreeMap<(ProjectId, CounterKey), Totals> =
        report.totals.iter().map(|(p, c, t)| ((p.clone(), c.key.clone()), *t)).collect();
    assert_eq!(by_counter.len(), report.totals.len(), "each counter once");
    assert_eq!(
        by_counter[&(pid("proj_1"), minute.clone())],
        Totals { requests: 1, calls: 2, rows: 12, ..Totals::default() }
    );
    assert_eq!(
        by_counter[&(pid("proj_2"), minute.clone())],
        Totals { requests: 0, calls: 1, rows: 1, ..Totals::default() }
    );
    let (_, c, _) =
        report.totals.iter().find(|(p, c, _)| p == &pid("proj_1") && c.key == minute).expect("minute counter reported");
    assert_eq!(c.resets_at, Some(utc("2026-07-07T12:32:00Z")));
    assert!(
        !by_counter.contains_key(&(pid("proj_1"), key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:32Z"))),
        "a failed call touches no counter"
    );
    // The actor counts calls but not requests.
    assert_eq!(
        by_counter[&(pid("proj_1"), key(Dimension::Actor("user_1".into()), WindowKind::Day, "2026-07-07"))],
        Totals { requests: 0, calls: 2, rows: 12, ..Totals::default() }
    );

    // A second batch reports the new absolute totals.
    let report =
        s.fold_batch(&batch(5, 6, vec![call("proj_1", "e5", "2026-07-07T12:31:59Z", 100)])).await.expect("fold again");
    let t = report
        .totals
        .iter()
        .find(|(p, c, _)| p == &pid("proj_1") && c.key == minute)
        .map(|(_, _, t)| *t)
        .expect("minute counter reported");
    assert_eq!(t, Totals { requests: 1, calls: 3, rows: 112, ..Totals::default() });
    assert_eq!(total(s, "proj_1", minute.clone()).await, t);
    assert_eq!(
        total(
            s,
            "proj_1",
            key(Dimension::ApiKey(ApiKeyId::parse("key_1").expect("id")), WindowKind::Rolling1h, "2026-07-07T12:00Z")
        )
        .await,
        Totals { requests: 0, calls: 3, rows: 112, ..Totals::default() }
    );
    assert_eq!(
        total(s, "proj_1", key(Dimension::Project, WindowKind::Day, "2026-07-08")).await,
        Totals::default(),
        "a counter never written is zero"
    );

    // open_totals: at 12:31:30 every window is open; at 12:32 the minute closed.
    let open = s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z")).await.expect("open totals");
    assert!(open.iter().any(|(c, _)| c.key == minute));
    let open = s.open_totals(&pid("proj_1"), utc("2026-07-07T12:32:00Z")).await.expect("open totals");
    assert!(!open.iter().any(|(c, _)| c.key == minute));
    let (_, day) = open
        .iter()
        .find(|(c, _)| c.key == key(Dimension::Project, WindowKind::Day, "2026-07-07"))
        .expect("day still open");
    assert_eq!(*day, Totals { requests: 1, calls: 3, rows: 112, ..Totals::default() });
    assert!(s.open_totals(&pid("proj_1"), utc("2026-09-01T00:00:00Z")).await.expect("later").is_empty());

    assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets"), BTreeMap::from([(0, 6)]));
}

pub async fn the_same_event_in_two_batches_counts_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");

    s.fold_batch(&batch(0, 1, vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5)])).await.expect("first");
    // A client resent e1 (a new offset); e2 is new.
    let report = s
        .fold_batch(&batch(
            1,
            3,
            vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5), call("proj_1", "e2", "2026-07-07T12:31:20Z", 1)],
        ))
        .await
        .expect("second");
    assert_eq!(report.folded, vec![(pid("proj_1"), EventId::parse("e2").expect("id"))]);
    assert_eq!(report.duplicates, vec![(pid("proj_1"), EventId::parse("e1").expect("id"))]);
    assert_eq!(
        total(s, "proj_1", minute.clone()).await,
        Totals { requests: 0, calls: 2, rows: 6, ..Totals::default() }
    );

    // A batch of nothing but duplicates still moves the offsets and touches no counter.
    let report =
        s.fold_batch(&batch(3, 4, vec![call("proj_1", "e2", "2026-07-07T12:31:20Z", 1)])).await.expect("third");
    assert!(report.folded.is_empty());
    assert_eq!(report.duplicates.len(), 1);
    assert!(report.totals.is_empty());
    assert_eq!(total(s, "proj_1", minute).await, Totals { requests: 0, calls: 2, rows: 6, ..Totals::default() });
    assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets"), BTreeMap::from([(0, 4)]));

    // The same id in another project is another event.
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    let report =
        s.fold_batch(&batch(4, 5, vec![call("proj_2", "e1", "2026-07-07T12:31:10Z", 5)])).await.expect("other project");
    assert_eq!(report.folded.len(), 1);
}

pub async fn the_same_event_twice_in_one_batch_counts_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let first = call("proj_1", "e1", "2026-07-07T12:31:10Z", 5);
    // The second copy differs; the first one wins.
    let second = call("proj_1", "e1", "2026-07-07T12:31:10Z", 50);
    let report = s
        .fold_batch(&batch(0, 3, vec![first, call("proj_1", "e2", "2026-07-07T12:31:11Z", 1), second]))
        .await
        .expect("fold");
    let e = |id: &str| (pid("proj_1"), EventId::parse(id).expect("id"));
    assert_eq!(report.folded, vec![e("e1"), e("e2")]);
    assert_eq!(report.duplicates, vec![e("e1")]);
    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    assert_eq!(total(s, "proj_1", minute).await, Totals { requests: 0, calls: 2, rows: 6, ..Totals::default() });
}

pub async fn a_fenced_batch_changes_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    s.fold_batch(&batch(0, 2, vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 5)])).await.expect("first");
    let before_offsets = s.offsets("projector", "tollgate.usage").await.expect("offsets");
    let before_totals = s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z")).await.expect("totals");

    // A stale projector replays from 0; another starts from a wrong offset.
    for from in [0, 1, 3] {
        let e = s
            .fold_batch(&batch(from, 4, vec![call("proj_1", "e2", "2026-07-07T12:31:20Z", 9)]))
            .await
            .expect_err("fenced");
        assert!(matches!(e, PortError::Fenced(_)), "from {from}: {e:?}");
    }
    // A two-partition batch whose second partition is stale changes the first one neither.
    let mut two = batch(2, 3, vec![call("proj_1", "e3", "2026-07-07T12:31:30Z", 1)]);
    two.offsets.push(OffsetMove { partition: 1, from: 5, to: 6 });
    assert!(matches!(s.fold_batch(&two).await, Err(PortError::Fenced(_))));

    assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets"), before_offsets);
    assert_eq!(s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z")).await.expect("totals"), before_totals);
    assert_eq!(
        total(s, "proj_1", minute.clone()).await,
        Totals { requests: 0, calls: 1, rows: 5, ..Totals::default() }
    );

    // The fenced events were not marked as seen: the right batch folds them.
    let report =
        s.fold_batch(&batch(2, 4, vec![call("proj_1", "e2", "2026-07-07T12:31:20Z", 9)])).await.expect("in order");
    assert_eq!(report.folded.len(), 1);
    assert_eq!(total(s, "proj_1", minute).await, Totals { requests: 0, calls: 2, rows: 14, ..Totals::default() });
}

pub async fn two_projectors_racing_from_the_same_offset_fold_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    for (from, to) in [(0, 1), (1, 2)] {
        let b = batch(from, to, vec![call("proj_1", &format!("e{from}"), "2026-07-07T12:31:10Z", 1)]);
        let (a, b2) = tokio::join!(s.fold_batch(&b), s.fold_batch(&b));
        let results = [a, b2];
        assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1, "from {from}: {results:?}");
        assert!(results.iter().any(|r| matches!(r, Err(PortError::Fenced(_)))), "from {from}: {results:?}");
    }
    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    assert_eq!(total(s, "proj_1", minute).await, Totals { requests: 0, calls: 2, rows: 2, ..Totals::default() });
}

pub async fn offsets_round_trip_per_consumer_and_topic(s: &dyn Store) {
    assert!(s.offsets("projector", "tollgate.usage").await.expect("none yet").is_empty());
    let mut b = batch(0, 10, Vec::new());
    b.offsets.push(OffsetMove { partition: 2, from: 0, to: 3 });
    s.fold_batch(&b).await.expect("move two partitions without facts");
    let mut b = batch(10, 12, Vec::new());
    b.offsets.push(OffsetMove { partition: 1, from: 0, to: 1 });
    s.fold_batch(&b).await.expect("a new partition joins");
    assert_eq!(
        s.offsets("projector", "tollgate.usage").await.expect("offsets"),
        BTreeMap::from([(0, 12), (1, 1), (2, 3)])
    );
    // Another consumer, or another topic, has offsets of its own.
    assert!(s.offsets("replay", "tollgate.usage").await.expect("other consumer").is_empty());
    assert!(s.offsets("projector", "other.usage").await.expect("other topic").is_empty());
    let mut other = batch(0, 4, Vec::new());
    other.consumer = "replay".into();
    s.fold_batch(&other).await.expect("other consumer starts fresh");
    assert_eq!(s.offsets("replay", "tollgate.usage").await.expect("replay"), BTreeMap::from([(0, 4)]));
    assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets").get(&0), Some(&12));

    // A fresh partition must start at 0.
    let mut late = batch(0, 1, Vec::new());
    late.offsets = vec![OffsetMove { partition: 7, from: 5, to: 6 }];
    let e = s.fold_batch(&late).await;
    assert!(matches!(e, Err(PortError::Fenced(_))), "{e:?}");
    assert!(!s.offsets("projector", "tollgate.usage").await.expect("offsets").contains_key(&7));
}

pub async fn a_calendar_month_in_kathmandu_lands_in_the_local_month(s: &dyn Store) {
    s.create_project(&project("proj_ktm", chrono_tz::Asia::Kathmandu)).await.expect("create project");
    s.create_project(&project("proj_utc", Tz::UTC)).await.expect("create project");
    // 18:20 UTC on 31 July is 00:05 on 1 August in Kathmandu (+05:45).
    let at = "2026-07-31T18:20:00Z";
    let report = s
        .fold_batch(&batch(0, 2, vec![call("proj_ktm", "e1", at, 3), call("proj_utc", "e1", at, 3)]))
        .await
        .expect("fold");

    let august = key(Dimension::Project, WindowKind::CalendarMonth, "2026-08");
    let july = key(Dimension::Project, WindowKind::CalendarMonth, "2026-07");
    assert_eq!(
        total(s, "proj_ktm", august.clone()).await,
        Totals { requests: 0, calls: 1, rows: 3, ..Totals::default() }
    );
    assert_eq!(total(s, "proj_ktm", july.clone()).await, Totals::default());
    assert_eq!(
        total(s, "proj_utc", july.clone()).await,
        Totals { requests: 0, calls: 1, rows: 3, ..Totals::default() }
    );
    assert_eq!(total(s, "proj_utc", august.clone()).await, Totals::default());

    let (_, month, _) =
        report.totals.iter().find(|(p, c, _)| p == &pid("proj_ktm") && c.key == august).expect("august reported");
    assert_eq!(month.resets_at, Some(utc("2026-08-31T18:15:00Z")));
    let day = key(Dimension::Project, WindowKind::Day, "2026-08-01");
    assert_eq!(total(s, "proj_ktm", day).await.calls, 1);
    // Rolling windows stay in UTC.
    let hour = key(Dimension::Project, WindowKind::Rolling1h, "2026-07-31T18:00Z");
    assert_eq!(total(s, "proj_ktm", hour).await.calls, 1);

    // The month's row is open until its local end.
    let open = s.open_totals(&pid("proj_ktm"), utc("2026-08-31T18:14:59Z")).await.expect("open");
    assert!(open.iter().any(|(c, _)| c.key == august));
    let open = s.open_totals(&pid("proj_ktm"), utc("2026-08-31T18:15:00Z")).await.expect("open");
    assert!(!open.iter().any(|(c, _)| c.key == august));
}

pub async fn an_event_of_an_unknown_project_fails_the_batch_and_changes_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let e = s
        .fold_batch(&batch(
            0,
            2,
            vec![call("proj_1", "e1", "2026-07-07T12:31:10Z", 1), call("ghost", "e2", "2026-07-07T12:31:10Z", 1)],
        ))
        .await
        .expect_err("unknown project");
    match e {
        PortError::Permanent(m) => assert!(m.contains("ghost"), "names the project: {m}"),
        other => panic!("expected permanent, got {other:?}"),
    }
    assert!(s.offsets("projector", "tollgate.usage").await.expect("offsets").is_empty());
    assert!(s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:30Z")).await.expect("totals").is_empty());
}

pub async fn purging_the_dedup_set_forgets_old_ids_only(s: &dyn Store, purge: impl AsyncFn(DateTime<Utc>) -> u64) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.fold_batch(&batch(
        0,
        2,
        vec![call("proj_1", "old", "2026-05-01T00:00:00Z", 1), call("proj_1", "new", "2026-07-01T00:00:00Z", 1)],
    ))
    .await
    .expect("fold");
    let purged = purge(utc("2026-07-01T00:00:00Z") - Duration::days(35)).await;
    assert_eq!(purged, 1);
    let report = s
        .fold_batch(&batch(
            2,
            4,
            vec![call("proj_1", "old", "2026-05-01T00:00:00Z", 1), call("proj_1", "new", "2026-07-01T00:00:00Z", 1)],
        ))
        .await
        .expect("fold again");
    assert_eq!(report.folded, vec![(pid("proj_1"), EventId::parse("old").expect("id"))]);
    assert_eq!(report.duplicates, vec![(pid("proj_1"), EventId::parse("new").expect("id"))]);
}

/// Far more rows than SQLite binds in one statement (32,766 parameters):
/// 5,000 facts of 5,000 actors touch over 25,000 counters.
pub async fn a_large_batch_folds_in_one_go(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let n: i64 = 5_000;
    let facts: Vec<UsageFact> = (0..n)
        .map(|i| UsageFact {
            actor_id: Some(format!("user_{i}")),
            ..call("proj_1", &format!("e{i}"), "2026-07-07T12:31:10Z", 2)
        })
        .collect();
    let report = s.fold_batch(&batch(0, n, facts.clone())).await.expect("fold");
    assert_eq!(report.folded.len(), facts.len());
    assert!(report.duplicates.is_empty());
    // project, api key, all keys: 5 windows each; then 5 per actor.
    assert_eq!(report.totals.len(), 15 + 5 * facts.len());
    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    let expected = Totals { calls: 5_000, rows: 10_000, ..Totals::default() };
    assert_eq!(total(s, "proj_1", minute.clone()).await, expected);
    assert_eq!(
        total(s, "proj_1", key(Dimension::Actor("user_4999".into()), WindowKind::Day, "2026-07-07")).await,
        Totals { requests: 0, calls: 1, rows: 2, ..Totals::default() }
    );

    // Redelivered under new offsets: every id is a duplicate.
    let report = s.fold_batch(&batch(n, 2 * n, facts)).await.expect("fold again");
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
        role_id: None,
        created_at: utc("2026-01-02T00:00:00Z"),
    }
}

pub async fn a_deleted_api_key_no_longer_reads_back(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let k = api_key("key_1", "proj_1");
    s.create_api_key(&k, "hash-1", &[]).await.expect("create key");
    let q = quota("q_key", "proj_1", Scope::ApiKey, Some("key_1"), WindowKind::Day);
    create_quota(s, &q).await.expect("quota on the key");

    let at = utc("2026-03-01T00:00:00Z");
    assert!(s.delete_api_key(&k.id, at, &[]).await.expect("delete"));
    assert_eq!(s.api_key(&k.id).await.expect("read"), None);
    assert_eq!(s.api_key_by_secret_hash("hash-1").await.expect("by hash"), None, "a deleted key cannot authenticate");
    assert!(!s.delete_api_key(&k.id, at, &[]).await.expect("delete again"), "already deleted");
    assert!(!s.delete_api_key(&ApiKeyId::parse("key_nope").expect("id"), at, &[]).await.expect("delete unknown"));
    // The quota naming it stays (inert), and can be deleted.
    assert_eq!(s.quota(&q.id).await.expect("quota"), Some(q.clone()));
    assert!(delete_quota(s, &q.id).await.expect("delete quota"));
    // A deleted key's secret hash is still taken.
    assert!(matches!(s.create_api_key(&api_key("key_2", "proj_1"), "hash-1", &[]).await, Err(PortError::Conflict(_))));
}

/// The audit entry of an admin's change to `resource`.
fn change(id: &str, action: AuditAction, resource: &str, detail: AuditDetail) -> AuditEntry {
    meter::admin_change(
        aid(id),
        &pid("proj_1"),
        action,
        resource,
        detail,
        &Principal::new("admin", "test"),
        utc("2026-03-01T00:00:00Z"),
    )
}

/// A key created or deleted and a role created write their entries to the
/// audit outbox in the change's transaction: a change refused writes none,
/// a delete that deleted nothing writes none.
pub async fn a_key_or_role_change_writes_its_audit_entry_with_it_or_not_at_all(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let k = api_key("key_1", "proj_1");
    let created = change(
        "aud_0001",
        AuditAction::CreateApiKey,
        "key_1",
        AuditDetail::ApiKeyChange { before: None, after: Some(meter::KeyView::from(&k)) },
    );
    s.create_api_key(&k, "hash-1", std::slice::from_ref(&created)).await.expect("create key");
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![created.clone()]);

    // Refused (the secret hash is taken): neither the key nor its entry.
    let dup = api_key("key_2", "proj_1");
    let refused = change(
        "aud_0002",
        AuditAction::CreateApiKey,
        "key_2",
        AuditDetail::ApiKeyChange { before: None, after: Some(meter::KeyView::from(&dup)) },
    );
    assert!(matches!(s.create_api_key(&dup, "hash-1", &[refused]).await, Err(PortError::Conflict(_))));
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![created.clone()], "no entry without its change");

    let deleted = change(
        "aud_0003",
        AuditAction::DeleteApiKey,
        "key_1",
        AuditDetail::ApiKeyChange { before: Some(meter::KeyView::from(&k)), after: None },
    );
    let at = utc("2026-03-01T00:00:00Z");
    assert!(s.delete_api_key(&k.id, at, std::slice::from_ref(&deleted)).await.expect("delete"));
    let again = AuditEntry { id: aid("aud_0004"), ..deleted.clone() };
    assert!(!s.delete_api_key(&k.id, at, &[again]).await.expect("delete again"), "already deleted");

    let role = meter::Role {
        id: meter::RoleId::parse("role_1").expect("role id"),
        project_id: pid("proj_1"),
        name: "partner".into(),
        grants: Grants::default(),
        quota: None,
        exempt: false,
        created_at: at,
    };
    let role_made = change(
        "aud_0005",
        AuditAction::CreateRole,
        "role_1",
        AuditDetail::RoleChange { before: None, after: Some(meter::RoleView::from(&role)) },
    );
    s.create_role(&role, std::slice::from_ref(&role_made)).await.expect("create role");
    let twice = AuditEntry { id: aid("aud_0006"), ..role_made.clone() };
    assert!(s.create_role(&role, &[twice]).await.is_err(), "a role id is unique");
    assert_eq!(
        s.unpublished_audit(10).await.expect("outbox"),
        vec![created, deleted, role_made],
        "one entry per change made, in order"
    );
}

/// A project's live keys and its roles are listed by id (not another
/// project's, not a deleted key); a key's grants and role change with their
/// audit entry, or, for a key that is not live, not at all.
pub async fn a_projects_keys_and_roles_are_listed_and_a_keys_grants_change_with_their_entry(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    let (k2, k1, other, gone) = (
        api_key("key_2", "proj_1"),
        api_key("key_1", "proj_1"),
        api_key("key_3", "proj_2"),
        api_key("key_4", "proj_1"),
    );
    for (k, hash) in [(&k2, "h2"), (&k1, "h1"), (&other, "h3"), (&gone, "h4")] {
        s.create_api_key(k, hash, &[]).await.expect("create key");
    }
    let at = utc("2026-03-01T00:00:00Z");
    assert!(s.delete_api_key(&gone.id, at, &[]).await.expect("delete"));
    let ids = |keys: Vec<ApiKey>| keys.into_iter().map(|k| k.id.to_string()).collect::<Vec<_>>();
    assert_eq!(ids(s.api_keys(&pid("proj_1")).await.expect("keys")), ["key_1", "key_2"]);
    assert_eq!(ids(s.api_keys(&pid("proj_9")).await.expect("keys")), Vec::<String>::new());

    let role = |id: &str, project: &str| meter::Role {
        id: meter::RoleId::parse(id).expect("role id"),
        project_id: pid(project),
        name: "partner".into(),
        grants: Grants::default(),
        quota: None,
        exempt: false,
        created_at: at,
    };
    for r in [role("role_2", "proj_1"), role("role_1", "proj_1"), role("role_3", "proj_2")] {
        s.create_role(&r, &[]).await.expect("create role");
    }
    let roles = s.roles(&pid("proj_1")).await.expect("roles");
    assert_eq!(roles.iter().map(|r| r.id.to_string()).collect::<Vec<_>>(), ["role_1", "role_2"]);

    let changed = ApiKey {
        grants: Grants { max_concurrent: Some(3), query_timeout: Some(10), max_rows: None },
        role_id: Some(meter::RoleId::parse("role_1").expect("role id")),
        name: "not written".into(),
        ..k1.clone()
    };
    let entry = change(
        "aud_0001",
        AuditAction::UpdateApiKey,
        "key_1",
        AuditDetail::ApiKeyChange {
            before: Some(meter::KeyView::from(&k1)),
            after: Some(meter::KeyView::from(&changed)),
        },
    );
    assert!(s.update_api_key(&changed, std::slice::from_ref(&entry)).await.expect("update"));
    let read = s.api_key(&k1.id).await.expect("read").expect("live");
    assert_eq!((read.grants, read.role_id, read.name), (changed.grants.clone(), changed.role_id.clone(), k1.name));
    let on_gone = change("aud_0002", AuditAction::UpdateApiKey, "key_4", entry.detail.clone());
    assert!(!s.update_api_key(&ApiKey { grants: changed.grants.clone(), ..gone }, &[on_gone]).await.expect("update"));
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![entry], "no entry without its change");
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

/// The consumer and topic the suite folds the audit outbox under.
const AUDIT_CONSUMER: &str = "conformance-audit";
const AUDIT_TOPIC: &str = "tollgate.audit";

/// What the audit relay and folder do, the topic aside: the outbox's
/// pending entries folded into the audit log (one offset per entry on a
/// pretend partition 0) and marked published. Returns how many were new.
async fn relay_and_fold(s: &dyn Store) -> usize {
    let pending = s.unpublished_audit(10_000).await.expect("the outbox");
    let from = s.offsets(AUDIT_CONSUMER, AUDIT_TOPIC).await.expect("offsets").get(&0).copied().unwrap_or(0);
    let to = from + i64::try_from(pending.len()).expect("a small outbox");
    let batch = AuditBatch {
        consumer: AUDIT_CONSUMER.into(),
        topic: AUDIT_TOPIC.into(),
        entries: pending.clone(),
        offsets: vec![OffsetMove { partition: 0, from, to }],
    };
    let new = s.fold_audit(&batch).await.expect("fold the audit entries");
    let ids: Vec<AuditId> = pending.into_iter().map(|e| e.id).collect();
    s.audit_published(&ids, utc("2026-01-01T00:00:00Z")).await.expect("mark published");
    new
}

/// The audit log as `GET /v1/audit` reads it once the outbox is folded.
async fn folded_audit(
    s: &dyn Store,
    project: &ProjectId,
    after: Option<&AuditId>,
    limit: usize,
) -> meter::PortResult<Vec<AuditEntry>> {
    relay_and_fold(s).await;
    s.audit(Some(project), after, limit).await
}

/// The outbox holds what writers wrote, in order, until it is published;
/// the log holds what was folded, once per id and once-key, with the
/// folder's offsets moved in the same transaction.
pub async fn the_audit_outbox_is_folded_into_the_log_once_per_entry(s: &dyn Store) {
    let at = utc("2026-07-07T12:31:10.123456Z");
    let first = breach("q_1", "w1", 6).entry(aid("aud_0002"), at);
    let second = breach("q_2", "w1", 7).entry(aid("aud_0001"), at);
    assert!(s.record_audit(&first).await.expect("record"));
    assert!(s.record_audit(&second).await.expect("record"));
    assert!(!s.record_audit(&first).await.expect("the same id again"), "an id is written once");
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![first.clone(), second.clone()], "write order");
    assert_eq!(s.unpublished_audit(1).await.expect("outbox"), vec![first.clone()], "at most the limit");
    // Nothing is in the log before it is folded (no project is needed).
    assert!(s.audit(Some(&pid("proj_1")), None, 10).await.expect("log").is_empty());

    s.audit_published(&[first.id.clone(), aid("aud_nope")], at).await.expect("published");
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![second.clone()]);
    // Published, its once-key still holds: a breach of the same window is not written again.
    let again = breach("q_1", "w1", 9).entry(aid("aud_0009"), at);
    assert!(!s.record_audit(&again).await.expect("again"), "once, before the log");

    // The folder: both entries, offsets 0 → 2; in id order in the log.
    let fold = |entries: Vec<AuditEntry>, from: i64, to: i64| AuditBatch {
        consumer: AUDIT_CONSUMER.into(),
        topic: AUDIT_TOPIC.into(),
        entries,
        offsets: vec![OffsetMove { partition: 0, from, to }],
    };
    assert_eq!(s.fold_audit(&fold(vec![first.clone(), second.clone()], 0, 2)).await.expect("fold"), 2);
    assert_eq!(s.audit(Some(&pid("proj_1")), None, 10).await.expect("log"), vec![second.clone(), first.clone()]);
    assert_eq!(s.offsets(AUDIT_CONSUMER, AUDIT_TOPIC).await.expect("offsets"), BTreeMap::from([(0, 2)]));
    // Published again (a relay killed before its mark): nothing new, offsets on.
    assert_eq!(s.fold_audit(&fold(vec![second.clone(), first.clone()], 2, 4)).await.expect("refold"), 0);
    assert_eq!(s.audit(Some(&pid("proj_1")), None, 10).await.expect("log").len(), 2);
    // Another id with a once-key the log holds (an outbox rebuilt from scratch): skipped.
    assert_eq!(s.fold_audit(&fold(vec![again.clone()], 4, 5)).await.expect("same once-key"), 0);
    // A redelivered batch is fenced and changes nothing.
    let third = breach("q_3", "w1", 6).entry(aid("aud_0003"), at);
    let e = s.fold_audit(&fold(vec![third.clone()], 2, 3)).await;
    assert!(matches!(e, Err(PortError::Fenced(_))), "{e:?}");
    assert_eq!(s.audit(Some(&pid("proj_1")), None, 10).await.expect("log").len(), 2);
    assert_eq!(s.offsets(AUDIT_CONSUMER, AUDIT_TOPIC).await.expect("offsets"), BTreeMap::from([(0, 5)]));
    // The folder's offsets are its own: the projector's are untouched.
    assert!(s.offsets("tollgate-projector", AUDIT_TOPIC).await.expect("offsets").is_empty());
}

pub async fn audit_entries_page_by_cursor_in_id_order(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    let at = utc("2026-07-07T12:31:10.123456Z");
    // Written out of order; read back in id order.
    for (i, n) in [3, 1, 4, 0, 2].into_iter().enumerate() {
        let e = breach("q_1", &format!("w{n}"), 6 + n).entry(aid(&format!("aud_{n:04}")), at);
        assert!(s.record_audit(&e).await.expect("record"), "entry {i}");
    }
    let mut other = breach("q_9", "w0", 6).entry(aid("aud_0005"), at);
    other.project_id = Some(pid("proj_2"));
    s.record_audit(&other).await.expect("other project");

    let all = folded_audit(s, &pid("proj_1"), None, 100).await.expect("all");
    let ids: Vec<&str> = all.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["aud_0000", "aud_0001", "aud_0002", "aud_0003", "aud_0004"]);
    assert_eq!(all[1], breach("q_1", "w1", 7).entry(aid("aud_0001"), at), "round trip");

    let first = folded_audit(s, &pid("proj_1"), None, 2).await.expect("page 1");
    assert_eq!(first.len(), 2);
    let second = folded_audit(s, &pid("proj_1"), Some(&first[1].id), 2).await.expect("page 2");
    assert_eq!(second.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["aud_0002", "aud_0003"]);
    let last = folded_audit(s, &pid("proj_1"), Some(&second[1].id), 2).await.expect("page 3");
    assert_eq!(last.len(), 1);
    assert!(folded_audit(s, &pid("proj_1"), Some(&last[0].id), 2).await.expect("past the end").is_empty());
    assert_eq!(folded_audit(s, &pid("proj_2"), None, 100).await.expect("other project"), vec![other]);

    // A change entry with a principal round-trips too.
    let q = quota("q_a", "proj_1", Scope::Project, None, WindowKind::Day);
    let change = AuditEntry {
        id: aid("aud_0010"),
        project_id: Some(pid("proj_1")),
        action: AuditAction::CreateQuota,
        principal: Some(Principal::new("admin", "api")),
        resource: "q_a".into(),
        detail: AuditDetail::QuotaChange { before: None, after: Some(Box::new(q)) },
        created_at: at,
    };
    assert!(s.record_audit(&change).await.expect("change"));
    let got = folded_audit(s, &pid("proj_1"), Some(&aid("aud_0004")), 10).await.expect("after");
    assert_eq!(got, vec![change]);
}

pub async fn a_monitor_breach_is_written_once_per_quota_and_window(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let at = utc("2026-07-07T12:31:10Z");
    let first = breach("q_1", "2026-07-07T12:31Z", 6).entry(aid("aud_1"), at);
    assert!(s.record_audit(&first).await.expect("first"));
    // The same quota and window again (a later check, another gateway): skipped.
    let again = breach("q_1", "2026-07-07T12:31Z", 9).entry(aid("aud_2"), at);
    assert!(!s.record_audit(&again).await.expect("again"));
    // Another window, another quota: written.
    assert!(s.record_audit(&breach("q_1", "2026-07-07T12:32Z", 6).entry(aid("aud_3"), at)).await.expect("next window"));
    assert!(s.record_audit(&breach("q_2", "2026-07-07T12:31Z", 6).entry(aid("aud_4"), at)).await.expect("other quota"));
    // Many writers racing on one breach write one entry.
    let racers: Vec<_> = (0..8)
        .map(|i| {
            let e = breach("q_3", "2026-07-07T12:31Z", 6).entry(aid(&format!("aud_r{i}")), at);
            async move { s.record_audit(&e).await.expect("race") }
        })
        .collect();
    let written = futures::future::join_all(racers).await;
    assert_eq!(written.iter().filter(|w| **w).count(), 1, "{written:?}");

    let all = folded_audit(s, &pid("proj_1"), None, 100).await.expect("read");
    let kept: Vec<(&str, &str)> =
        all.iter().map(|e| (e.resource.as_str(), e.id.as_str())).filter(|(r, _)| *r != "q_3").collect();
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
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
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
    let log = folded_audit(s, &pid("proj_1"), None, 100).await.expect("audit");
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
    let day = stored.iter().find(|q| q.spec.window == WindowKind::Day).expect("day quota");
    assert_eq!((day.spec.limit, day.updated_at), (200, utc("2026-03-03T00:00:00Z")));
    assert_eq!(day.created_at, utc("2026-03-01T00:00:00Z"));
    let key = stored.iter().find(|q| q.spec.scope == Scope::ApiKey).expect("key quota");
    assert_eq!(key.spec.mode, Mode::Monitor);
    assert!(stored.iter().all(|q| q.spec.scope != Scope::Actor), "removed");
    let actions: Vec<&str> = folded_audit(s, &pid("proj_1"), Some(&aid("aud_a003")), 100)
        .await
        .expect("audit")
        .iter()
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(actions, ["quotas:DeleteQuota", "quotas:UpdateQuota", "quotas:UpdateQuota", "quotas:CreateQuota"]);
    let (again, _) = plan_for(s, &next, "2026-03-04T00:00:00Z", "d").await;
    assert!(again.is_empty(), "a fixed point");

    // Single changes (the REST routes) have no precondition on the set.
    let q = stored[0].clone();
    let patch = QuotaPatch { limit: Some(1), mode: None };
    s.apply_quotas(&QuotaPlan::update(q.clone(), &patch, utc("2026-03-05T00:00:00Z")), &[])
        .await
        .expect("single update");
    assert_eq!(s.quota(&q.id).await.expect("read").map(|q| q.spec.limit), Some(1));
    s.apply_quotas(&QuotaPlan::delete(q.clone()), &[]).await.expect("single delete");
    assert_eq!(s.quota(&q.id).await.expect("read"), None);
    let e = s.apply_quotas(&QuotaPlan::delete(q.clone()), &[]).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "already gone: {e:?}");
    let e = s.apply_quotas(&QuotaPlan::update(q, &patch, utc("2026-03-05T00:00:00Z")), &[]).await;
    assert!(matches!(e, Err(PortError::Conflict(_))), "already gone: {e:?}");
}

pub async fn a_failing_plan_changes_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let want = vec![
        desired("project", None, "calls", "day", 100),
        desired("api_key", Some("key_1"), "requests", "rolling_1m", 60),
    ];
    let (plan, audit) = plan_for(s, &want, "2026-03-01T00:00:00Z", "a").await;
    s.apply_quotas(&plan, &audit).await.expect("apply");
    let before = s.quotas(&pid("proj_1")).await.expect("list");
    let log_before = folded_audit(s, &pid("proj_1"), None, 100).await.expect("audit");

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
    assert_eq!(folded_audit(s, &pid("proj_1"), None, 100).await.expect("audit"), log_before);

    // (2) A plan made from a set that has moved since: fenced, nothing changed.
    let (stale, audit) = plan_for(s, &next, "2026-03-02T00:00:00Z", "c").await;
    update_quota(s, &before[1].id, &QuotaPatch { limit: Some(61), mode: None }, utc("2026-03-02T00:00:01Z"))
        .await
        .expect("a concurrent change");
    let moved = s.quotas(&pid("proj_1")).await.expect("list");
    let e = s.apply_quotas(&stale, &audit).await;
    assert!(matches!(e, Err(PortError::Fenced(_))), "{e:?}");
    assert_eq!(s.quotas(&pid("proj_1")).await.expect("list"), moved);
    assert_eq!(folded_audit(s, &pid("proj_1"), None, 100).await.expect("audit"), log_before);
    // A quota created behind the plan's back fences it too.
    let (stale, audit) = plan_for(s, &next, "2026-03-02T00:00:00Z", "d").await;
    create_quota(s, &quota("q_sneak", "proj_1", Scope::Project, None, WindowKind::Rolling1h))
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
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
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
    let log = folded_audit(s, &pid("proj_1"), Some(&aid("aud_a999")), 100).await.expect("audit");
    let winner = if l.is_ok() { &left_audit } else { &right_audit };
    assert_eq!(&log, winner);
}

// --- Tokens, prices and unpriced rows ---------------------------------------

fn price(model: &str, component: Component, picos: i64, from: &str) -> Price {
    Price {
        key: PriceKey { provider: "openai".into(), model: model.into(), component },
        unit_price_usd: Usd(picos),
        effective_from: utc(from),
    }
}

/// When the tests' prices are put: before every fact of the suite, so each
/// is known as of any receipt there.
fn recorded() -> DateTime<Utc> {
    utc("2026-01-01T00:00:00Z")
}

fn pkey(model: &str, component: Component) -> PriceKey {
    PriceKey { provider: "openai".into(), model: model.into(), component }
}

fn usage(model: &str, input: u64, output: u64, cached: u64) -> TokenUsage {
    TokenUsage { provider: "openai".into(), model: model.into(), input, output, cached, ..TokenUsage::default() }
}

/// A tokens event of agent `agent_1` and actor `user_1`.
fn tokens(project: &str, id: &str, at: &str, entries: Vec<TokenUsage>) -> UsageFact {
    UsageFact {
        agent_id: Some("agent_1".into()),
        actor_id: Some("user_1".into()),
        tokens: entries,
        ..fact(project, id, EventKind::Tokens, at)
    }
}

pub async fn a_tokens_event_is_priced_at_its_event_time_in_the_fold(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    // $2.50 per million input tokens: 2,500,000 picodollars a token.
    s.put_prices(&[price("gpt-4o", Component::InputTokens, 2_500_000, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");

    let e1 = UsageFact {
        tokens: vec![TokenUsage { reasoning: 50, ..usage("gpt-4o", 1000, 200, 0) }],
        ..tokens("proj_1", "e1", "2026-07-07T12:31:10Z", Vec::new())
    };
    let e2 = tokens("proj_1", "e2", "2026-07-07T12:31:20Z", vec![usage("mystery", 7, 0, 3)]);
    let e3 = UsageFact {
        meter_type: Some(MeterType::ComputeExecution),
        ..tokens("proj_1", "e3", "2026-07-07T12:31:30Z", vec![usage("gpt-4o", 4, 0, 0)])
    };
    let report = s.fold_batch(&batch(0, 3, vec![e1, e2, e3])).await.expect("fold");
    assert_eq!(report.folded.len(), 3);

    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    let expected = Totals {
        // 1000 + 200 (reasoning is not billable) + 7 + 3; e3 is not on the AI meter.
        tokens: 1210,
        // 1000 × 2,500,000 = $0.0025, exactly.
        cost_llm_tokens: 2_500_000_000,
        cost_compute_execution: 4 * 2_500_000,
        llm_events: 2,
        llm_priced: 1,
        llm_unpriced: 2,
        ..Totals::default()
    };
    let reported = report
        .totals
        .iter()
        .find(|(p, c, _)| p == &pid("proj_1") && c.key == minute)
        .map(|(_, _, t)| *t)
        .expect("minute reported");
    assert_eq!(reported, expected);
    assert_eq!(total(s, "proj_1", minute.clone()).await, expected);
    // Tokens count for the agent and the actor, never for keys.
    let agent_day = key(Dimension::Agent("agent_1".into()), WindowKind::Day, "2026-07-07");
    assert_eq!(total(s, "proj_1", agent_day.clone()).await, expected);
    let actor_day = key(Dimension::Actor("user_1".into()), WindowKind::Day, "2026-07-07");
    assert_eq!(total(s, "proj_1", actor_day).await, expected);
    assert!(!report.totals.iter().any(|(_, c, _)| c.key.dimension == Dimension::AllApiKeys));

    // The unpriced components were remembered on the counters they landed in.
    let unpriced = vec![
        pkey("gpt-4o", Component::OutputTokens),
        pkey("mystery", Component::InputTokens),
        pkey("mystery", Component::CachedTokens),
    ];
    assert_eq!(s.unpriced_rows(&pid("proj_1"), &minute, 10).await.expect("unpriced"), unpriced);
    assert_eq!(s.unpriced_rows(&pid("proj_1"), &agent_day, 10).await.expect("unpriced"), unpriced);

    // A new price from 12:35 on: an event before it keeps the old price, even
    // folded after the new row; one after it takes the new one.
    s.put_prices(
        &[
            price("gpt-4o", Component::InputTokens, 2_000_000, "2026-07-07T12:35:00Z"),
            price("gpt-4o", Component::OutputTokens, 10_000_000, "2026-07-07T12:35:00Z"),
        ],
        recorded(),
        None,
    )
    .await
    .expect("new prices");
    let report = s
        .fold_batch(&batch(
            3,
            5,
            vec![
                tokens("proj_1", "e4", "2026-07-07T12:31:40Z", vec![usage("gpt-4o", 10, 0, 0)]),
                tokens("proj_1", "e5", "2026-07-07T12:40:00Z", vec![usage("gpt-4o", 100, 1, 0)]),
            ],
        ))
        .await
        .expect("fold after the new prices");
    assert_eq!(report.folded.len(), 2);
    let m = total(s, "proj_1", minute.clone()).await;
    assert_eq!(m.cost_llm_tokens, 2_500_000_000 + 10 * 2_500_000, "the old price, and e1 unchanged");
    assert_eq!((m.llm_events, m.llm_priced, m.llm_unpriced), (3, 2, 2));
    let later = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:40Z");
    let l = total(s, "proj_1", later.clone()).await;
    assert_eq!(l.cost_llm_tokens, 100 * 2_000_000 + 10_000_000);
    assert_eq!((l.llm_events, l.llm_priced, l.llm_unpriced), (1, 1, 0));
    assert!(s.unpriced_rows(&pid("proj_1"), &later, 10).await.expect("unpriced").is_empty());
    let day = total(s, "proj_1", key(Dimension::Project, WindowKind::Day, "2026-07-07")).await;
    assert_eq!(day.cost_llm_tokens, 2_500_000_000 + 25_000_000 + 210_000_000);
    assert_eq!(day.tokens, 1210 + 10 + 101);

    // open_totals carries every field.
    let open = s.open_totals(&pid("proj_1"), utc("2026-07-07T12:31:59Z")).await.expect("open");
    let (_, t) = open.iter().find(|(c, _)| c.key == minute).expect("minute open");
    assert_eq!(*t, m);
}

pub async fn refolding_a_tokens_or_storage_event_adds_nothing(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.put_prices(&[price("gpt-4o", Component::InputTokens, 3, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");
    let facts = vec![
        tokens("proj_1", "t1", "2026-07-07T12:31:10Z", vec![usage("gpt-4o", 10, 5, 0)]),
        storage("proj_1", "s1", EventKind::StorageSnapshot, "2026-07-07T12:00:00Z", 1000),
        storage("proj_1", "s2", EventKind::StorageDelta, "2026-07-07T12:10:00Z", 24),
    ];
    s.fold_batch(&batch(0, 3, facts.clone())).await.expect("fold");
    let day = key(Dimension::Project, WindowKind::Day, "2026-07-07");
    let before = (
        total(s, "proj_1", day.clone()).await,
        total(s, "proj_1", CounterKey::footprint()).await,
        s.unpriced_rows(&pid("proj_1"), &day, 10).await.expect("unpriced"),
    );
    assert_eq!(before.0.cost_llm_tokens, 30);
    assert_eq!((before.1.storage, before.1.storage_events), (1024, 2));
    assert_eq!(before.2, vec![pkey("gpt-4o", Component::OutputTokens)]);

    // Redelivered under new offsets, even with a price that would now cover it.
    s.put_prices(&[price("gpt-4o", Component::OutputTokens, 7, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");
    let report = s.fold_batch(&batch(3, 6, facts)).await.expect("refold");
    assert!(report.folded.is_empty());
    assert_eq!(report.duplicates.len(), 3);
    assert!(report.totals.is_empty());
    let after = (
        total(s, "proj_1", day.clone()).await,
        total(s, "proj_1", CounterKey::footprint()).await,
        s.unpriced_rows(&pid("proj_1"), &day, 10).await.expect("unpriced"),
    );
    assert_eq!(after, before);
}

pub async fn the_price_book_round_trips_in_key_order(s: &dyn Store) {
    assert!(s.prices().await.expect("empty book").is_empty());
    s.put_prices(&[], recorded(), None).await.expect("nothing to put");
    let book = vec![
        price("gpt-4o", Component::CachedTokens, 1_250_000, "2026-01-01T00:00:00Z"),
        price("gpt-4o", Component::InputTokens, 2_000_000, "2026-07-01T00:00:00Z"),
        Price {
            key: PriceKey { provider: "anthropic".into(), model: "claude".into(), component: Component::OutputTokens },
            unit_price_usd: Usd(15_000_000),
            effective_from: utc("2026-03-01T00:00:00.123456Z"),
        },
        price("gpt-4o", Component::InputTokens, 2_500_000, "2026-01-01T00:00:00Z"),
        price("gpt-4o", Component::OutputTokens, 0, "2026-01-01T00:00:00Z"),
        // The same key and instant twice in one call: the last one wins.
        price("gpt-4o", Component::OutputTokens, 10_000_000, "2026-01-01T00:00:00Z"),
    ];
    s.put_prices(&book, recorded(), None).await.expect("put");
    let expected = vec![
        book[2].clone(),
        // Components in meter's order (input, output, cached), then by time.
        book[3].clone(),
        book[1].clone(),
        book[5].clone(),
        book[0].clone(),
    ];
    assert_eq!(s.prices().await.expect("book"), expected);
    assert_eq!(s.prices().await.expect("book"), PriceBook::new(book.clone()).prices().collect::<Vec<_>>());

    // A row with the same key and instant is replaced; the others stay.
    s.put_prices(&[price("gpt-4o", Component::InputTokens, 2_400_000, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("replace");
    let got = s.prices().await.expect("book");
    assert_eq!(got.len(), 5);
    assert_eq!(got[1].unit_price_usd, Usd(2_400_000));

    // All or nothing: a negative price fails the call and changes nothing.
    let e = s
        .put_prices(
            &[
                price("gpt-5", Component::InputTokens, 1, "2026-01-01T00:00:00Z"),
                price("gpt-5", Component::OutputTokens, -1, "2026-01-01T00:00:00Z"),
            ],
            recorded(),
            None,
        )
        .await;
    assert!(matches!(e, Err(PortError::Permanent(_))), "{e:?}");
    assert_eq!(s.prices().await.expect("book"), got);
}

pub async fn unpriced_rows_are_recorded_once_and_read_in_order(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let minute = Counter {
        key: key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z"),
        resets_at: Some(utc("2026-07-07T12:32:00Z")),
    };
    let agent = Counter {
        key: key(Dimension::Agent("agent_1".into()), WindowKind::Day, "2026-07-07"),
        resets_at: Some(utc("2026-07-08T00:00:00Z")),
    };
    let row = |counter: &Counter, model: &str, component| UnpricedRow {
        counter: counter.clone(),
        key: pkey(model, component),
    };
    let rows = vec![
        row(&minute, "zeta", Component::InputTokens),
        row(&minute, "gpt-4o", Component::CachedTokens),
        row(&minute, "gpt-4o", Component::OutputTokens),
        row(&minute, "gpt-4o", Component::InputTokens),
        row(&minute, "gpt-4o", Component::OutputTokens),
        row(&agent, "alpha", Component::OutputTokens),
        UnpricedRow {
            counter: minute.clone(),
            key: PriceKey { provider: "anthropic".into(), model: "zeta".into(), component: Component::CachedTokens },
        },
    ];
    s.record_unpriced(&pid("proj_1"), &rows).await.expect("record");
    // Idempotent: the gateway and the fold both write them.
    s.record_unpriced(&pid("proj_1"), &rows[1..3]).await.expect("record again");
    s.record_unpriced(&pid("proj_1"), &[]).await.expect("record nothing");

    let all = s.unpriced_rows(&pid("proj_1"), &minute.key, 100).await.expect("all");
    let mut expected: Vec<PriceKey> = rows.iter().filter(|r| r.counter == minute).map(|r| r.key.clone()).collect();
    expected.sort();
    expected.dedup();
    assert_eq!(expected.len(), 5);
    assert_eq!(all, expected, "distinct, in PriceKey order");
    assert_eq!(all[0].provider, "anthropic");
    assert_eq!(
        all[1..4].iter().map(|k| k.component).collect::<Vec<_>>(),
        [Component::InputTokens, Component::OutputTokens, Component::CachedTokens]
    );
    assert_eq!(s.unpriced_rows(&pid("proj_1"), &minute.key, 2).await.expect("limited"), expected[..2]);
    assert_eq!(
        s.unpriced_rows(&pid("proj_1"), &agent.key, 10).await.expect("agent"),
        vec![pkey("alpha", Component::OutputTokens)]
    );
    assert!(s.unpriced_rows(&pid("proj_2"), &minute.key, 10).await.expect("other project").is_empty());
    let other_window = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:32Z");
    assert!(s.unpriced_rows(&pid("proj_1"), &other_window, 10).await.expect("other window").is_empty());
}

// --- The storage footprint ---------------------------------------------------

fn storage(project: &str, id: &str, kind: EventKind, at: &str, bytes: i64) -> UsageFact {
    UsageFact { storage_bytes: Some(bytes), ..fact(project, id, kind, at) }
}

fn delta(id: &str, at: &str, bytes: i64) -> UsageFact {
    storage("proj_1", id, EventKind::StorageDelta, at, bytes)
}

fn snapshot(id: &str, at: &str, bytes: i64) -> UsageFact {
    storage("proj_1", id, EventKind::StorageSnapshot, at, bytes)
}

/// The footprint a fold reported for `project`, checked against what the
/// store reads back.
async fn reported_footprint(s: &dyn Store, report: &FoldReport, project: &str) -> Totals {
    let (_, c, t) = report
        .totals
        .iter()
        .find(|(p, c, _)| p == &pid(project) && c.key == CounterKey::footprint())
        .expect("footprint reported");
    assert_eq!(c.resets_at, None, "the footprint never resets");
    assert_eq!(total(s, project, CounterKey::footprint()).await, *t);
    *t
}

fn footprint_of(facts: &[UsageFact]) -> (i64, u64) {
    let mut f = Footprint::default();
    for fact in facts {
        f.apply(fact);
    }
    (f.bytes(), f.events())
}

pub async fn a_footprint_of_deltas_only_is_their_sum(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let facts = vec![
        delta("d1", "2026-07-07T12:00:00Z", 100),
        delta("d2", "2026-07-07T12:01:00Z", 50),
        delta("d3", "2026-07-07T11:00:00Z", -30),
    ];
    let report = s.fold_batch(&batch(0, 3, facts.clone())).await.expect("fold");
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!(t, Totals { storage: 120, storage_events: 3, ..Totals::default() });
    assert_eq!((t.storage, t.storage_events), footprint_of(&facts));
    assert_eq!(report.totals.len(), 1, "a storage fact lands on the footprint only");

    // Below zero is possible (deletes of bytes never measured).
    let report = s.fold_batch(&batch(3, 4, vec![delta("d4", "2026-07-07T12:02:00Z", -500)])).await.expect("fold");
    assert_eq!(reported_footprint(s, &report, "proj_1").await.storage, -380);

    // The footprint is open at any time, and seeds the view with the rest.
    for at in ["2026-07-07T12:00:00Z", "2099-01-01T00:00:00Z"] {
        let open = s.open_totals(&pid("proj_1"), utc(at)).await.expect("open");
        let (c, t) = open.iter().find(|(c, _)| c.key == CounterKey::footprint()).expect("footprint open");
        assert_eq!((c.resets_at, t.storage, t.storage_events), (None, -380, 4));
    }
}

pub async fn a_snapshot_resets_the_footprint_to_it_plus_the_deltas_after_it(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let facts = vec![
        delta("d1", "2026-07-07T12:00:00Z", 100),
        snapshot("s1", "2026-07-07T12:05:00Z", 1000),
        // At the snapshot's very instant: already in it.
        delta("d2", "2026-07-07T12:05:00Z", 7),
        delta("d3", "2026-07-07T12:06:00Z", 10),
    ];
    let report = s.fold_batch(&batch(0, 4, facts.clone())).await.expect("fold");
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (1010, 4));
    assert_eq!((t.storage, t.storage_events), footprint_of(&facts));

    // Two snapshots at one instant: the greater event id wins.
    let more = vec![snapshot("s3", "2026-07-07T12:10:00Z", 5000), snapshot("s2", "2026-07-07T12:10:00Z", 4000)];
    let report = s.fold_batch(&batch(4, 6, more.clone())).await.expect("fold");
    let all: Vec<UsageFact> = facts.into_iter().chain(more).collect();
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (5000, 6));
    assert_eq!((t.storage, t.storage_events), footprint_of(&all));
}

pub async fn a_late_snapshot_keeps_only_the_deltas_after_it(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let first = vec![
        delta("d1", "2026-07-07T12:00:00Z", 100),
        delta("d2", "2026-07-07T12:10:00Z", 10),
        delta("d3", "2026-07-07T12:20:00Z", 5),
    ];
    let report = s.fold_batch(&batch(0, 3, first.clone())).await.expect("fold");
    assert_eq!(reported_footprint(s, &report, "proj_1").await.storage, 115);

    // Measured at 12:05, arriving after deltas of 12:10 and 12:20 were folded.
    let late = vec![snapshot("s1", "2026-07-07T12:05:00Z", 500)];
    let report = s.fold_batch(&batch(3, 4, late.clone())).await.expect("fold");
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (515, 4));
    let mut all: Vec<UsageFact> = first.into_iter().chain(late).collect();
    assert_eq!((t.storage, t.storage_events), footprint_of(&all));

    // An even older snapshot changes nothing but the count.
    let older = snapshot("s0", "2026-07-07T11:00:00Z", 1);
    let report = s.fold_batch(&batch(4, 5, vec![older.clone()])).await.expect("fold");
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (515, 5));
    all.push(older);
    assert_eq!((t.storage, t.storage_events), footprint_of(&all));
}

pub async fn the_order_of_storage_facts_does_not_change_the_footprint(s: &dyn Store) {
    let facts = vec![
        delta("e01", "2026-07-07T10:00:00Z", 40),
        snapshot("e02", "2026-07-07T11:00:00Z", 900),
        delta("e03", "2026-07-07T11:30:00Z", -25),
        delta("e04", "2026-07-07T11:00:00Z", 3),
        snapshot("e05", "2026-07-07T12:00:00Z", 700),
        delta("e06", "2026-07-07T12:30:00Z", 60),
        snapshot("e07", "2026-07-07T12:00:00Z", 650),
        delta("e08", "2026-07-07T13:00:00Z", -10),
        delta("e09", "2026-07-07T09:00:00Z", 1_000_000),
        snapshot("e10", "2026-07-07T08:00:00Z", 5),
    ];
    let expected = footprint_of(&facts);
    // For the record: e07 beats e05 at 12:00 (the greater id), then e06 and e08.
    assert_eq!(expected, (650 + 60 - 10, 10));

    // The same facts, split in two batches, in several orders: one project each.
    let mut reversed = facts.clone();
    reversed.reverse();
    let mut interleaved: Vec<UsageFact> = facts.iter().step_by(2).cloned().collect();
    interleaved.extend(facts.iter().skip(1).step_by(2).cloned());
    let orders = [(facts.clone(), 5), (reversed, 3), (interleaved, 5), (facts.clone(), 9)];
    let mut offset = 0;
    for (i, (order, split)) in orders.into_iter().enumerate() {
        let name = format!("proj_{i}");
        s.create_project(&project(&name, Tz::UTC)).await.expect("create project");
        let order: Vec<UsageFact> = order.into_iter().map(|f| UsageFact { project_id: pid(&name), ..f }).collect();
        // After each batch, the footprint of the facts folded so far.
        let (a, b) = order.split_at(split);
        for (part, upto) in [(a, split), (b, order.len())] {
            let report = s.fold_batch(&batch(offset, offset + 1, part.to_vec())).await.expect("fold");
            offset += 1;
            let t = reported_footprint(s, &report, &name).await;
            assert_eq!((t.storage, t.storage_events), footprint_of(&order[..upto]), "order {i}, {upto} facts");
        }
        assert_eq!(total(s, &name, CounterKey::footprint()).await.storage, expected.0, "order {i}");
    }
}

/// Two projectors on two partitions folding storage facts of one project at
/// once: the footprint reflects both batches, whichever commits last.
pub async fn concurrent_folds_of_one_project_keep_every_storage_fact(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let mut all = vec![delta("d0", "2026-07-07T12:00:00Z", 1)];
    s.fold_batch(&batch(0, 1, all.clone())).await.expect("the footprint row exists");
    let on = |partition: i32, from: i64, facts: Vec<UsageFact>| FoldBatch {
        offsets: vec![OffsetMove { partition, from, to: from + 1 }],
        ..batch(0, 0, facts)
    };
    for round in 0..20 {
        let a = vec![delta(&format!("a{round}"), "2026-07-07T12:01:00Z", 10)];
        let b = vec![delta(&format!("b{round}"), "2026-07-07T12:02:00Z", 100)];
        let (ba, bb) = (on(1, round, a.clone()), on(2, round, b.clone()));
        let (ra, rb) = tokio::join!(s.fold_batch(&ba), s.fold_batch(&bb));
        ra.expect("partition 1");
        rb.expect("partition 2");
        all.extend(a);
        all.extend(b);
        let t = total(s, "proj_1", CounterKey::footprint()).await;
        assert_eq!((t.storage, t.storage_events), footprint_of(&all), "round {round}");
    }
}

/// A late snapshot that lands between stored deltas, in a batch that also
/// brings deltas before and after it and an older snapshot: only the deltas
/// after it count, stored or new.
pub async fn a_batch_with_a_snapshot_among_stored_and_new_deltas_keeps_only_those_after_it(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let first = vec![
        snapshot("s0", "2026-07-07T11:00:00Z", 50),
        delta("d1", "2026-07-07T12:00:00Z", 100),
        delta("d2", "2026-07-07T12:10:00Z", 10),
        delta("d3", "2026-07-07T12:20:00Z", 5),
    ];
    let report = s.fold_batch(&batch(0, 4, first.clone())).await.expect("fold");
    assert_eq!(reported_footprint(s, &report, "proj_1").await.storage, 165);

    let second = vec![
        delta("d4", "2026-07-07T12:04:00Z", 1_000),
        snapshot("s2", "2026-07-07T12:05:00Z", 500),
        snapshot("s1", "2026-07-07T11:30:00Z", 7),
        // At the snapshot's instant: already in it.
        delta("d5", "2026-07-07T12:05:00Z", 3),
        delta("d6", "2026-07-07T12:30:00Z", 2),
    ];
    let report = s.fold_batch(&batch(4, 9, second.clone())).await.expect("fold");
    let all: Vec<UsageFact> = first.into_iter().chain(second).collect();
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (500 + 10 + 5 + 2, 9));
    assert_eq!((t.storage, t.storage_events), footprint_of(&all));
}

/// An id the dedup set forgot (older than the horizon) folds again, but the
/// store still holds its storage fact: the footprint counts it once.
pub async fn a_storage_fact_refolded_after_its_id_was_purged_is_not_counted_twice(
    s: &dyn Store,
    purge: impl AsyncFn(DateTime<Utc>) -> u64,
) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let facts = vec![
        delta("d1", "2026-05-01T00:00:00Z", 100),
        snapshot("s1", "2026-05-01T00:01:00Z", 1000),
        delta("d2", "2026-07-01T00:00:00Z", 5),
    ];
    let report = s.fold_batch(&batch(0, 3, facts.clone())).await.expect("fold");
    let before = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((before.storage, before.storage_events), (1005, 3));
    assert_eq!(purge(utc("2026-07-01T00:00:00Z") - Duration::days(35)).await, 2);

    let report = s.fold_batch(&batch(3, 6, facts)).await.expect("fold again");
    let e = |id: &str| (pid("proj_1"), EventId::parse(id).expect("id"));
    assert_eq!(report.folded, vec![e("d1"), e("s1")], "the dedup set forgot them");
    assert_eq!(report.duplicates, vec![e("d2")]);
    assert_eq!(reported_footprint(s, &report, "proj_1").await, before);
}

// --- Exceptions ----------------------------------------------------------------

fn exception(quota: &str, project: &str, at: &str) -> UnpricedException {
    UnpricedException {
        project_id: pid(project),
        quota_id: QuotaId::parse(quota).expect("quota id"),
        limit: 25_000_000_000_000,
        window_key: "2026-07".into(),
        llm_events: 4,
        unpriced_events: 4,
        unpriced_rows: vec![pkey("mystery", Component::InputTokens)],
        // Ignored: the store counts.
        occurrence_count: 99,
        first_seen: utc(at),
        last_seen: utc(at),
    }
}

pub async fn an_exception_is_filed_once_and_counts_its_occurrences(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let first = exception("q_cost", "proj_1", "2026-07-07T12:00:00.123456Z");
    let stored = s.file_exception(&first).await.expect("file");
    assert_eq!(stored, UnpricedException { occurrence_count: 1, ..first.clone() });

    let again = UnpricedException {
        limit: 30_000_000_000_000,
        window_key: "2026-08".into(),
        llm_events: 9,
        unpriced_events: 3,
        unpriced_rows: vec![pkey("mystery", Component::InputTokens), pkey("mystery", Component::OutputTokens)],
        first_seen: utc("2026-08-01T00:00:00Z"),
        last_seen: utc("2026-08-01T00:00:00Z"),
        ..first.clone()
    };
    let stored = s.file_exception(&again).await.expect("file again");
    assert_eq!(
        stored,
        UnpricedException { occurrence_count: 2, first_seen: first.first_seen, ..again.clone() },
        "counted, first_seen kept, the rest replaced"
    );
    assert_eq!(s.exceptions(&pid("proj_1"), None, 10).await.expect("list"), vec![stored]);

    // Filed concurrently, each filing counts.
    let racers: Vec<_> = (0..6)
        .map(|_| {
            let e = again.clone();
            async move { s.file_exception(&e).await.expect("race") }
        })
        .collect();
    futures::future::join_all(racers).await;
    let listed = s.exceptions(&pid("proj_1"), None, 10).await.expect("list");
    assert_eq!(listed.iter().map(|e| e.occurrence_count).collect::<Vec<_>>(), [8]);

    // A project that does not exist cannot file one.
    let e = s.file_exception(&exception("q_ghost", "ghost", "2026-07-07T12:00:00Z")).await;
    assert!(matches!(e, Err(PortError::Permanent(_))), "{e:?}");
}

pub async fn exceptions_page_by_quota_id(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    for q in ["q_3", "q_1", "q_5", "q_2", "q_4"] {
        s.file_exception(&exception(q, "proj_1", "2026-07-07T12:00:00Z")).await.expect("file");
    }
    s.file_exception(&exception("q_0", "proj_2", "2026-07-07T12:00:00Z")).await.expect("other project");

    let ids = |page: &[UnpricedException]| page.iter().map(|e| e.quota_id.as_str().to_owned()).collect::<Vec<_>>();
    let first = s.exceptions(&pid("proj_1"), None, 2).await.expect("page 1");
    assert_eq!(ids(&first), ["q_1", "q_2"]);
    let second = s.exceptions(&pid("proj_1"), Some(&first[1].quota_id), 2).await.expect("page 2");
    assert_eq!(ids(&second), ["q_3", "q_4"]);
    let third = s.exceptions(&pid("proj_1"), Some(&second[1].quota_id), 2).await.expect("page 3");
    assert_eq!(ids(&third), ["q_5"]);
    assert!(s.exceptions(&pid("proj_1"), Some(&third[0].quota_id), 2).await.expect("past the end").is_empty());
    // The cursor need not exist.
    let from = QuotaId::parse("q_25").expect("id");
    assert_eq!(ids(&s.exceptions(&pid("proj_1"), Some(&from), 10).await.expect("after")), ["q_3", "q_4", "q_5"]);
    assert_eq!(ids(&s.exceptions(&pid("proj_2"), None, 10).await.expect("other")), ["q_0"]);
    assert!(s.exceptions(&pid("proj_3"), None, 10).await.expect("none").is_empty());
}

// --- The token usage breakdown and window totals -----------------------------

fn model_row(
    model: &str,
    component: Component,
    meter: MeterType,
    embedding: bool,
    (priced_quantity, unpriced_quantity, cost): (u64, u64, i64),
) -> ModelUsageRow {
    ModelUsageRow { key: pkey(model, component), meter, embedding, priced_quantity, unpriced_quantity, cost: Usd(cost) }
}

async fn breakdown(s: &dyn Store, project: &str, window: WindowKind, window_key: &str) -> Vec<ModelUsageRow> {
    s.model_usage(&pid(project), window, window_key).await.expect("model usage")
}

pub async fn a_tokens_events_breakdown_lands_in_its_local_day_and_month(s: &dyn Store) {
    // 20:00 UTC on 31 July is 01:45 on 1 August in Kathmandu (+05:45).
    s.create_project(&project("proj_1", chrono_tz::Asia::Kathmandu)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    s.put_prices(&[price("gpt-4o", Component::InputTokens, 2_500_000, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");
    let chat = UsageFact {
        tokens: vec![
            TokenUsage { reasoning: 50, ..usage("gpt-4o", 1000, 200, 0) },
            TokenUsage { embedding: true, ..usage("te-3", 10, 0, 0) },
        ],
        ..tokens("proj_1", "e1", "2026-07-31T20:00:00Z", Vec::new())
    };
    let compute = UsageFact {
        meter_type: Some(MeterType::ComputeExecution),
        ..tokens("proj_1", "e2", "2026-07-31T20:00:01Z", vec![usage("gpt-4o", 4, 0, 0)])
    };
    let report = s.fold_batch(&batch(0, 2, vec![chat, compute])).await.expect("fold");
    assert_eq!(report.folded.len(), 2);

    // By key (components in meter's order), then meter (llm_tokens first),
    // then embedding; priced and unpriced apart; reasoning never listed.
    let expected = vec![
        // 1000 × 2,500,000 picodollars = $0.0025, exactly.
        model_row("gpt-4o", Component::InputTokens, MeterType::LlmTokens, false, (1000, 0, 2_500_000_000)),
        model_row("gpt-4o", Component::InputTokens, MeterType::ComputeExecution, false, (4, 0, 10_000_000)),
        model_row("gpt-4o", Component::OutputTokens, MeterType::LlmTokens, false, (0, 200, 0)),
        model_row("te-3", Component::InputTokens, MeterType::LlmTokens, true, (0, 10, 0)),
    ];
    assert_eq!(breakdown(s, "proj_1", WindowKind::Day, "2026-08-01").await, expected);
    assert_eq!(breakdown(s, "proj_1", WindowKind::CalendarMonth, "2026-08").await, expected);
    // The cost adds up to what the aggregates priced, meter by meter.
    let day = total(s, "proj_1", key(Dimension::Project, WindowKind::Day, "2026-08-01")).await;
    assert_eq!((day.cost_llm_tokens, day.cost_compute_execution), (2_500_000_000, 10_000_000));

    // Not the UTC day or month, not another window, not another project.
    assert!(breakdown(s, "proj_1", WindowKind::Day, "2026-07-31").await.is_empty());
    assert!(breakdown(s, "proj_1", WindowKind::CalendarMonth, "2026-07").await.is_empty());
    assert!(breakdown(s, "proj_1", WindowKind::Rolling1h, "2026-07-31T20:00Z").await.is_empty());
    assert!(breakdown(s, "proj_2", WindowKind::Day, "2026-08-01").await.is_empty());

    // Other kinds of event add no row.
    s.fold_batch(&batch(2, 3, vec![call("proj_1", "c1", "2026-07-31T20:00:02Z", 5)])).await.expect("fold a call");
    assert_eq!(breakdown(s, "proj_1", WindowKind::Day, "2026-08-01").await, expected);
}

pub async fn refolding_a_tokens_event_adds_nothing_to_the_breakdown(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.put_prices(&[price("gpt-4o", Component::InputTokens, 3, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");
    let t1 = tokens("proj_1", "t1", "2026-07-07T12:31:10Z", vec![usage("gpt-4o", 10, 5, 0)]);
    s.fold_batch(&batch(0, 1, vec![t1.clone()])).await.expect("fold");
    let expected = vec![
        model_row("gpt-4o", Component::InputTokens, MeterType::LlmTokens, false, (10, 0, 30)),
        model_row("gpt-4o", Component::OutputTokens, MeterType::LlmTokens, false, (0, 5, 0)),
    ];
    assert_eq!(breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await, expected);

    // Redelivered under new offsets (twice in one batch, too), even with a
    // price that would now cover its output: nothing moves.
    s.put_prices(&[price("gpt-4o", Component::OutputTokens, 7, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");
    let report = s.fold_batch(&batch(1, 3, vec![t1.clone(), t1])).await.expect("refold");
    assert!(report.folded.is_empty());
    assert_eq!(report.duplicates.len(), 2);
    assert_eq!(breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await, expected);
    assert_eq!(breakdown(s, "proj_1", WindowKind::CalendarMonth, "2026-07").await, expected);

    // A fenced batch changes nothing either.
    let fenced = s
        .fold_batch(&batch(0, 1, vec![tokens("proj_1", "t2", "2026-07-07T12:32:00Z", vec![usage("gpt-4o", 1, 0, 0)])]))
        .await;
    assert!(matches!(fenced, Err(PortError::Fenced(_))), "{fenced:?}");
    assert_eq!(breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await, expected);
}

pub async fn two_tokens_events_of_one_model_add_up_in_the_breakdown(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.put_prices(
        &[
            price("gpt-4o", Component::InputTokens, 2_500_000, "2026-01-01T00:00:00Z"),
            price("gpt-4o", Component::CachedTokens, 1_250_000, "2026-01-01T00:00:00Z"),
        ],
        recorded(),
        None,
    )
    .await
    .expect("prices");
    // Two in one batch (summed before the upsert), for two actors; a third
    // in a later batch of the same month but another day (added to the row).
    let other_actor = UsageFact {
        actor_id: Some("user_2".into()),
        ..tokens("proj_1", "e2", "2026-07-07T18:00:00Z", vec![usage("gpt-4o", 300, 0, 40), usage("gpt-4o", 1, 2, 0)])
    };
    s.fold_batch(&batch(
        0,
        2,
        vec![tokens("proj_1", "e1", "2026-07-07T12:00:00Z", vec![usage("gpt-4o", 100, 20, 0)]), other_actor],
    ))
    .await
    .expect("fold");
    s.fold_batch(&batch(2, 3, vec![tokens("proj_1", "e3", "2026-07-08T09:00:00Z", vec![usage("gpt-4o", 1000, 0, 0)])]))
        .await
        .expect("fold later");

    let day = vec![
        model_row("gpt-4o", Component::InputTokens, MeterType::LlmTokens, false, (401, 0, 401 * 2_500_000)),
        model_row("gpt-4o", Component::OutputTokens, MeterType::LlmTokens, false, (0, 22, 0)),
        model_row("gpt-4o", Component::CachedTokens, MeterType::LlmTokens, false, (40, 0, 40 * 1_250_000)),
    ];
    assert_eq!(breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await, day);
    assert_eq!(
        breakdown(s, "proj_1", WindowKind::Day, "2026-07-08").await,
        vec![model_row("gpt-4o", Component::InputTokens, MeterType::LlmTokens, false, (1000, 0, 1000 * 2_500_000))]
    );
    let month = vec![
        model_row("gpt-4o", Component::InputTokens, MeterType::LlmTokens, false, (1401, 0, 1401 * 2_500_000)),
        model_row("gpt-4o", Component::OutputTokens, MeterType::LlmTokens, false, (0, 22, 0)),
        model_row("gpt-4o", Component::CachedTokens, MeterType::LlmTokens, false, (40, 0, 40 * 1_250_000)),
    ];
    assert_eq!(breakdown(s, "proj_1", WindowKind::CalendarMonth, "2026-07").await, month);
    // The breakdown's cost is the month's priced AI cost, to the picodollar.
    let priced =
        total(s, "proj_1", key(Dimension::Project, WindowKind::CalendarMonth, "2026-07")).await.cost_llm_tokens;
    assert_eq!(month.iter().map(|r| r.cost.picos()).sum::<i64>(), i64::try_from(priced).expect("fits"));
}

pub async fn population_totals_list_each_member_of_a_population(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    let user = |id: &str, f: UsageFact| UsageFact { actor_id: Some(id.into()), ..f };
    s.fold_batch(&batch(
        0,
        6,
        vec![
            // Day 7: tokens of user_1 (agent_1), a call of user_2 (key_1).
            tokens("proj_1", "t1", "2026-07-07T12:00:00Z", vec![usage("gpt-4o", 100, 20, 0)]),
            user("user_2", call("proj_1", "c1", "2026-07-07T13:00:00Z", 5)),
            user("user_2", call("proj_1", "c2", "2026-07-07T14:00:00Z", 2)),
            // Day 8: user_3, in the same month.
            user("user_3", call("proj_1", "c3", "2026-07-08T09:00:00Z", 1)),
            // Another project, the same day.
            user("user_9", call("proj_2", "c4", "2026-07-07T12:00:00Z", 1)),
            request("proj_1", "r1", "2026-07-07T12:00:00Z"),
        ],
    ))
    .await
    .expect("fold");

    let listed = |window: WindowKind, window_key: &'static str, population: Population| async move {
        s.population_totals(&pid("proj_1"), population, window, window_key).await.expect("population totals")
    };
    let actor = |a: &str, window: WindowKind, k: &str| key(Dimension::Actor(a.into()), window, k);

    // Both actors of the day, in dimension order, and nothing else.
    let day = listed(WindowKind::Day, "2026-07-07", Population::Actors).await;
    let u1 = actor("user_1", WindowKind::Day, "2026-07-07");
    let u2 = actor("user_2", WindowKind::Day, "2026-07-07");
    assert_eq!(day, vec![(u1.clone(), total(s, "proj_1", u1).await), (u2.clone(), total(s, "proj_1", u2).await)]);
    assert_eq!(day[0].1.tokens, 120);
    assert_eq!((day[1].1.calls, day[1].1.rows), (2, 7));

    // The month has all three; other populations list their own members.
    let month = listed(WindowKind::CalendarMonth, "2026-07", Population::Actors).await;
    assert_eq!(
        month.iter().map(|(k, _)| k.dimension.clone()).collect::<Vec<_>>(),
        ["user_1", "user_2", "user_3"].map(|a| Dimension::Actor(a.into()))
    );
    assert_eq!(month[1].1.calls, 2);
    let agents = listed(WindowKind::Day, "2026-07-07", Population::Agents).await;
    assert_eq!(
        agents.iter().map(|(k, _)| k.dimension.clone()).collect::<Vec<_>>(),
        [Dimension::Agent("agent_1".into())]
    );
    // Every key, never the all-keys counter.
    let keys = listed(WindowKind::Day, "2026-07-07", Population::ApiKeys).await;
    let key_1 = ApiKeyId::parse("key_1").expect("key id");
    assert_eq!(keys.iter().map(|(k, _)| k.dimension.clone()).collect::<Vec<_>>(), [Dimension::ApiKey(key_1)]);
    assert_eq!((keys[0].1.requests, keys[0].1.calls), (0, 2), "the request had no key");
    assert!(listed(WindowKind::Day, "2026-07-09", Population::Actors).await.is_empty());
    assert!(listed(WindowKind::Rolling24h, "2026-07-07", Population::Actors).await.is_empty());
    assert!(listed(WindowKind::Day, "2026-07-07", Population::Users).await.is_empty());
    assert!(
        s.population_totals(&pid("proj_3"), Population::Actors, WindowKind::Day, "2026-07-07")
            .await
            .expect("none")
            .is_empty()
    );
}

// --- A fold nothing stops and no clock can change ---------------------------

/// Sums that would pass `i64::MAX` stay at it, in the aggregates, the
/// breakdown by model and the footprint, whatever the split into batches,
/// rather than failing the batch.
pub async fn sums_saturate_rather_than_fail_the_batch(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    // $1,000,000 a token: one event of 2^53 input tokens costs past $9.2M.
    s.put_prices(
        &[price("gpt-4o", Component::InputTokens, 1_000_000 * 1_000_000_000_000, "2026-01-01T00:00:00Z")],
        recorded(),
        None,
    )
    .await
    .expect("prices");
    let big = 1u64 << 53;
    let spend = |id: &str| tokens("proj_1", id, "2026-07-07T12:31:10Z", vec![usage("gpt-4o", big, 0, 0)]);
    let calls = |from: usize| -> Vec<UsageFact> {
        (from..from + 600).map(|i| call("proj_1", &format!("c{i}"), "2026-07-07T12:31:20Z", big)).collect()
    };
    let mut first = vec![spend("t1"), spend("t2")];
    first.extend(calls(0));
    let n = first.len() as i64;
    s.fold_batch(&batch(0, n, first)).await.expect("a first batch near the bound");
    let mut second = vec![spend("t3")];
    second.extend(calls(600));
    let m = second.len() as i64;
    s.fold_batch(&batch(n, n + m, second)).await.expect("a second batch past it");

    let month = total(s, "proj_1", key(Dimension::Project, WindowKind::CalendarMonth, "2026-07")).await;
    assert_eq!(month.cost_llm_tokens, i64::MAX as u64, "held at the largest amount");
    assert_eq!(month.rows, i64::MAX as u64, "1,200 calls of 2^53 rows: held at i64::MAX");
    assert_eq!(month.calls, 1_200, "the other fields still count");
    assert_eq!(month.tokens, 3 * big);
    let rows = breakdown(s, "proj_1", WindowKind::CalendarMonth, "2026-07").await;
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].priced_quantity, rows[0].cost), (3 * big, Usd(i64::MAX)));

    // The footprint: 1,100 deltas of 2^53 bytes, over two batches.
    let deltas = |from: usize| -> Vec<UsageFact> {
        (from..from + 550).map(|i| delta(&format!("d{i}"), "2026-07-07T12:00:00Z", big as i64)).collect()
    };
    s.fold_batch(&batch(n + m, n + m + 550, deltas(0))).await.expect("deltas");
    let report = s.fold_batch(&batch(n + m + 550, n + m + 1100, deltas(550))).await.expect("deltas past the bound");
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (i64::MAX, 1_100));
    // The stored deltas alone now sum past the bound; and a delete is still a delta.
    let report = s
        .fold_batch(&batch(
            n + m + 1100,
            n + m + 1102,
            vec![
                delta("d-big", "2026-07-07T12:00:00Z", big as i64),
                delta("d-del", "2026-07-07T12:00:00Z", -(big as i64)),
            ],
        ))
        .await
        .expect("deltas over stored ones past the bound");
    let t = reported_footprint(s, &report, "proj_1").await;
    assert_eq!((t.storage, t.storage_events), (i64::MAX, 1_102));
}

/// A price put after an event was received, even one in effect from before
/// the event, never prices it; nor does a row that replaces one: the fold
/// reads the book as of each fact's receipt, so folding now or replaying
/// later gives the same cost.
pub async fn a_price_is_applied_only_to_what_was_received_after_it_was_put(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let received = |f: UsageFact, at: &str| UsageFact { received_at: Some(utc(at)), ..f };
    let input = |id: &str| tokens("proj_1", id, "2026-07-07T12:31:10Z", vec![usage("gpt-4o", 10, 0, 0)]);
    s.put_prices(
        &[price("gpt-4o", Component::InputTokens, 3, "2026-01-01T00:00:00Z")],
        utc("2026-07-07T12:00:00Z"),
        None,
    )
    .await
    .expect("prices");
    // Put at 13:00, back-dated to January: a new price, and a replacement of the 3.
    s.put_prices(
        &[
            price("gpt-4o", Component::InputTokens, 5, "2026-01-01T00:00:00Z"),
            price("gpt-4o", Component::OutputTokens, 7, "2026-01-01T00:00:00Z"),
        ],
        utc("2026-07-07T13:00:00Z"),
        None,
    )
    .await
    .expect("later prices");
    // The current book shows the replacement, in the same shape as ever.
    assert_eq!(
        s.prices().await.expect("book"),
        vec![
            price("gpt-4o", Component::InputTokens, 5, "2026-01-01T00:00:00Z"),
            price("gpt-4o", Component::OutputTokens, 7, "2026-01-01T00:00:00Z"),
        ]
    );
    // Both folded after 13:00; one was received before it.
    let early = received(UsageFact { tokens: vec![usage("gpt-4o", 10, 1, 0)], ..input("t1") }, "2026-07-07T12:31:11Z");
    let late = received(UsageFact { tokens: vec![usage("gpt-4o", 10, 1, 0)], ..input("t2") }, "2026-07-07T13:00:00Z");
    s.fold_batch(&batch(0, 2, vec![early, late])).await.expect("fold");
    let minute = key(Dimension::Project, WindowKind::Rolling1m, "2026-07-07T12:31Z");
    let t = total(s, "proj_1", minute.clone()).await;
    assert_eq!(t.cost_llm_tokens, 10 * 3 + (10 * 5 + 7), "the 12:31 book for t1, the 13:00 one for t2");
    assert_eq!((t.llm_priced, t.llm_unpriced), (2, 1), "t1's output had no price yet");
    assert_eq!(
        s.unpriced_rows(&pid("proj_1"), &minute, 10).await.expect("unpriced"),
        vec![pkey("gpt-4o", Component::OutputTokens)]
    );
    let rows = breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await;
    let output = rows.iter().find(|r| r.key.component == Component::OutputTokens).expect("output row");
    assert_eq!((output.priced_quantity, output.unpriced_quantity, output.cost), (1, 1, Usd(7)));
    // A fact with no receipt at all counts as received when it occurred.
    s.fold_batch(&batch(2, 3, vec![input("t3")])).await.expect("fold");
    assert_eq!(total(s, "proj_1", minute).await.cost_llm_tokens, 10 * 3 + 57 + 10 * 3);
}

fn letter(partition: i32, offset: i64, reason: &str) -> meter::DeadLetter {
    meter::DeadLetter {
        partition,
        offset,
        key: (offset % 2 == 0).then(|| b"proj_1".to_vec()),
        payload: vec![0xc3, 0x01, 0x00, offset as u8, 0xff],
        reason: reason.into(),
    }
}

/// Dead letters are kept in the fold's transaction, with the offsets that
/// move past them; they are claimed, marked and published once.
pub async fn dead_letters_are_kept_with_the_fold_and_published_once(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let at = utc("2026-07-07T12:00:00Z");
    let until = at + Duration::seconds(30);
    // A batch of dead letters only still moves the offsets.
    let only = FoldBatch { dead_letters: vec![letter(0, 0, "malformed: x")], ..batch(0, 1, Vec::new()) };
    s.fold_batch(&only).await.expect("dead letters alone");
    assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets"), BTreeMap::from([(0, 1)]));
    let mixed = FoldBatch {
        dead_letters: vec![letter(0, 1, "invalid: y"), letter(0, 3, "out of range: z")],
        ..batch(1, 4, vec![call("proj_1", "e2", "2026-07-07T12:31:10Z", 1)])
    };
    s.fold_batch(&mixed).await.expect("a fold with dead letters");
    // A fenced batch keeps none of its letters.
    let fenced = FoldBatch { dead_letters: vec![letter(0, 9, "never")], ..batch(1, 10, Vec::new()) };
    assert!(matches!(s.fold_batch(&fenced).await, Err(PortError::Fenced(_))));

    let claim = |who: &'static str, at, until| s.claim_dead_letters("projector", "tollgate.usage", who, at, until, 10);
    let mine = claim("a", at, until).await.expect("claim");
    assert_eq!(
        mine.iter().map(|p| p.letter.clone()).collect::<Vec<_>>(),
        vec![letter(0, 0, "malformed: x"), letter(0, 1, "invalid: y"), letter(0, 3, "out of range: z"),]
    );
    assert!(mine.iter().all(|p| p.mark.is_none()), "never attempted");
    // Held by `a`: nobody else gets them until the claim lapses; `a` does.
    assert!(claim("b", at + Duration::seconds(29), until).await.expect("claim").is_empty());
    assert_eq!(claim("a", at + Duration::seconds(1), until).await.expect("re-claim").len(), 3);
    // Another consumer's letters are its own.
    assert!(s.claim_dead_letters("other", "tollgate.usage", "a", at, until, 10).await.expect("claim").is_empty());

    // Marked before the attempt (a mark is set once), then published.
    let mark = meter::DlqMark::from([(0, 17), (1, 4)]);
    s.mark_dead_letters("projector", "tollgate.usage", &[(0, 0), (0, 1)], &mark).await.expect("mark");
    let later = meter::DlqMark::from([(0, 99)]);
    s.mark_dead_letters("projector", "tollgate.usage", &[(0, 0)], &later).await.expect("mark again");
    s.dead_letters_published("projector", "tollgate.usage", &[(0, 0)]).await.expect("published");
    // `a` died holding the other two: once its claim lapses, `b` gets them, marks and all.
    let taken = claim("b", until + Duration::seconds(1), until + Duration::seconds(31)).await.expect("claim");
    assert_eq!(
        taken.iter().map(|p| (p.letter.offset, p.mark.clone())).collect::<Vec<_>>(),
        vec![(1, Some(mark)), (3, None)]
    );
    s.dead_letters_published("projector", "tollgate.usage", &[(0, 1), (0, 3)]).await.expect("published");
    assert!(claim("b", until + Duration::seconds(2), until).await.expect("claim").is_empty(), "none left");
    assert!(claim("c", until + Duration::days(1), until + Duration::days(2)).await.expect("claim").is_empty());
}

/// The dedup set is purged from the fold's own position (its newest receipt
/// folded), never from the caller's clock, which can only make it keep more.
pub async fn the_dedup_set_is_purged_by_the_fold_position_not_the_clock(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let keep = Duration::days(35);
    let now = utc("2026-12-01T00:00:00Z");
    let (c, t) = ("projector", "tollgate.usage");
    assert_eq!(s.purge_processed(c, t, keep, now).await.expect("nothing folded yet"), 0);
    let received = |id: &str, occurred: &str, received: &str| UsageFact {
        received_at: Some(utc(received)),
        ..call("proj_1", id, occurred, 1)
    };
    s.fold_batch(&batch(
        0,
        3,
        vec![
            received("old", "2026-04-01T00:00:00Z", "2026-04-01T00:00:01Z"),
            received("mid", "2026-05-20T00:00:00Z", "2026-05-20T00:00:01Z"),
            // A batch's newest receipt: 1 June.
            received("new", "2026-06-01T00:00:00Z", "2026-06-01T00:00:00Z"),
        ],
    ))
    .await
    .expect("fold");
    // An older receipt later does not move the position back.
    s.fold_batch(&batch(3, 4, vec![received("late", "2026-05-02T00:00:00Z", "2026-05-03T00:00:00Z")]))
        .await
        .expect("fold");
    // A clock a year on changes nothing: the cutoff is 1 June − 35 days.
    assert_eq!(s.purge_processed(c, t, keep, utc("2027-12-01T00:00:00Z")).await.expect("purge"), 1);
    // A clock behind the fold keeps more.
    assert_eq!(s.purge_processed(c, t, keep, utc("2026-05-01T00:00:00Z")).await.expect("purge"), 0);
    assert_eq!(s.purge_processed(c, t, keep, now).await.expect("purge"), 0, "idempotent");
    let report = s
        .fold_batch(&batch(
            4,
            8,
            ["old", "mid", "new", "late"].iter().map(|id| call("proj_1", id, "2026-06-01T00:00:00Z", 1)).collect(),
        ))
        .await
        .expect("refold");
    let e = |id: &str| (pid("proj_1"), EventId::parse(id).expect("id"));
    assert_eq!(report.folded, vec![e("old")], "only the id before the cutoff was forgotten");
    assert_eq!(report.duplicates, vec![e("mid"), e("new"), e("late")]);
    // Another consumer's position is its own.
    assert_eq!(s.purge_processed("other", t, keep, now).await.expect("purge"), 0);
}

fn eid(s: &str) -> EventId {
    EventId::parse(s).expect("event id")
}

/// A correction of `of`, received the next day.
fn correction(project: &str, id: &str, of: &str) -> UsageFact {
    UsageFact {
        corrects: Some(eid(of)),
        received_at: Some(utc("2026-07-08T09:00:00Z")),
        ..fact(project, id, EventKind::Correction, "2026-07-08T09:00:00Z")
    }
}

/// A batch whose facts each came from the record at their offset.
fn sourced(from: i64, facts: Vec<UsageFact>) -> FoldBatch {
    let n = facts.len() as i64;
    let sources = (0..facts.len())
        .map(|i| {
            let source = meter::FactSource {
                partition: 0,
                offset: from + i as i64,
                key: Some(b"proj_1".to_vec()),
                payload: vec![0xc3, 0x01, i as u8],
            };
            (i, source)
        })
        .collect();
    FoldBatch { sources, ..batch(from, from + n, facts) }
}

/// An amend replaces the original's quantities on every counter it landed
/// in, a void takes it all back (the breakdown by model too), both are in
/// the audit log naming both ids, and the dedup set keeps what each
/// original counts now; a correction folded again adds nothing.
pub async fn a_correction_amends_or_voids_its_original_as_the_difference(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.put_prices(&[price("gpt-4o", Component::InputTokens, 5, "2026-01-01T00:00:00Z")], recorded(), None)
        .await
        .expect("prices");
    let at = "2026-07-07T12:31:10Z";
    let originals = vec![
        call("proj_1", "c1", at, 10),
        call("proj_1", "c2", at, 5),
        tokens("proj_1", "t1", at, vec![usage("gpt-4o", 100, 0, 0)]),
    ];
    s.fold_batch(&sourced(0, originals)).await.expect("fold originals");
    let day = key(Dimension::Project, WindowKind::Day, "2026-07-07");
    let actor = key(Dimension::Actor("user_1".into()), WindowKind::CalendarMonth, "2026-07");
    let before = total(s, "proj_1", day.clone()).await;
    assert_eq!((before.calls, before.rows, before.tokens, before.cost_llm_tokens), (2, 15, 100, 500));

    let amend = UsageFact { rows: 3, ..correction("proj_1", "x1", "c1") };
    let void = UsageFact { void: true, ..correction("proj_1", "x2", "t1") };
    let report = s.fold_batch(&sourced(3, vec![amend.clone(), void.clone()])).await.expect("fold corrections");
    assert_eq!(report.folded, vec![(pid("proj_1"), eid("x1")), (pid("proj_1"), eid("x2"))]);
    assert!(report.refused.is_empty());
    let after = total(s, "proj_1", day.clone()).await;
    assert_eq!((after.calls, after.rows, after.tokens, after.cost_llm_tokens), (2, 8, 0, 0));
    assert_eq!((after.llm_events, after.llm_priced), (0, 0), "the void takes the tokens event back");
    let a = total(s, "proj_1", actor).await;
    assert_eq!((a.calls, a.rows, a.tokens), (2, 8, 0));
    // What the fold reports: the lowered counters' new totals, for the view.
    assert!(report.lowered.iter().any(|(_, c, t)| c.key == day && t.rows == 8));
    assert!(report.totals.iter().any(|(_, c, t)| c.key == day && t.rows == 8));
    // The breakdown by model is back to nothing.
    let rows = breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await;
    assert!(rows.iter().all(|r| r.priced_quantity == 0 && r.unpriced_quantity == 0 && r.cost == Usd(0)), "{rows:?}");

    // What the dedup set holds of each original now.
    match s.correction_target(&pid("proj_1"), &eid("c1")).await.expect("target") {
        Some(meter::Target::Counted(c)) => {
            assert_eq!((c.fact.rows, c.voided, c.corrected_by.as_ref()), (3, false, Some(&eid("x1"))))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.correction_target(&pid("proj_1"), &eid("t1")).await.expect("target"),
        Some(meter::Target::Counted(c)) if c.voided
    ));
    assert_eq!(s.correction_target(&pid("proj_1"), &eid("x1")).await.expect("target"), Some(meter::Target::Other));
    assert_eq!(s.correction_target(&pid("proj_1"), &eid("nope")).await.expect("target"), None);

    // One audit entry per correction, naming both ids.
    let audit = folded_audit(s, &pid("proj_1"), None, 10).await.expect("audit");
    let named: Vec<_> = audit
        .iter()
        .filter_map(|e| match &e.detail {
            AuditDetail::EventCorrection { original_id, correction_id, void, .. } => {
                Some((e.action.as_str(), original_id.as_str(), correction_id.as_str(), *void))
            }
            _ => None,
        })
        .collect();
    let mut named = named;
    named.sort();
    let action = AuditAction::CorrectEvent.as_str();
    assert_eq!(named, vec![(action, "c1", "x1", false), (action, "t1", "x2", true)]);

    // The same corrections again (a resend): duplicates, nothing changes.
    let again = s.fold_batch(&sourced(5, vec![amend, void])).await.expect("refold");
    assert_eq!(again.duplicates.len(), 2);
    assert_eq!(total(s, "proj_1", day).await, after);
    assert_eq!(folded_audit(s, &pid("proj_1"), None, 10).await.expect("audit").len(), audit.len());
}

/// A correction of an unknown event, of another project's, of a voided one,
/// or before its original, is dead-lettered in the fold's transaction with
/// its reason, changes nothing, and its id is forgotten (so it can come
/// again once its original is folded). Without the record to dead-letter,
/// the batch is refused whole.
pub async fn a_refused_correction_is_dead_lettered_with_its_reason_and_forgotten(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.create_project(&project("proj_2", Tz::UTC)).await.expect("create project");
    let at = "2026-07-07T12:31:10Z";
    s.fold_batch(&sourced(0, vec![call("proj_1", "c1", at, 10), call("proj_2", "c9", at, 1)])).await.expect("fold");
    s.fold_batch(&sourced(2, vec![UsageFact { void: true, ..correction("proj_1", "v1", "c1") }])).await.expect("void");
    let day = key(Dimension::Project, WindowKind::Day, "2026-07-07");
    let before = total(s, "proj_1", day.clone()).await;
    assert_eq!((before.calls, before.rows), (0, 0));

    let bad = vec![
        UsageFact { rows: 1, ..correction("proj_1", "x1", "nope") },
        UsageFact { rows: 1, ..correction("proj_1", "x2", "c9") },
        UsageFact { rows: 1, ..correction("proj_1", "x3", "c1") },
        UsageFact { rows: 1, ..correction("proj_1", "x4", "c5") },
        call("proj_1", "c5", at, 2),
    ];
    let report = s.fold_batch(&sourced(3, bad)).await.expect("fold");
    let refused: Vec<(&str, &str)> = report.refused.iter().map(|(_, e, r)| (e.as_str(), r.as_str())).collect();
    assert_eq!(refused.len(), 4, "{refused:?}");
    assert!(refused[0].1.contains("no event nope of project proj_1 is folded"), "{refused:?}");
    assert!(refused[1].1.contains("no event c9 of project proj_1"), "another project's: {refused:?}");
    assert!(refused[2].1.contains("already voided"), "{refused:?}");
    assert!(refused[3].1.contains("no event c5"), "before its original: {refused:?}");
    assert_eq!(report.folded, vec![(pid("proj_1"), eid("c5"))]);
    assert_eq!(total(s, "proj_1", day.clone()).await.rows, 2, "only c5 counted");

    // Dead-lettered with the fold, as their records, with their reasons.
    let at = utc("2026-07-08T10:00:00Z");
    let letters = s
        .claim_dead_letters("projector", "tollgate.usage", "a", at, at + Duration::seconds(30), 10)
        .await
        .expect("claim");
    let got: Vec<(i64, bool)> =
        letters.iter().map(|l| (l.letter.offset, l.letter.reason.starts_with("invalid: corrects: "))).collect();
    assert_eq!(got, vec![(3, true), (4, true), (5, true), (6, true)]);
    assert_eq!(letters[0].letter.payload, vec![0xc3, 0x01, 0]);

    // Forgotten: x4 again, now that c5 is folded, amends it.
    let report = s.fold_batch(&sourced(8, vec![UsageFact { rows: 7, ..correction("proj_1", "x4", "c5") }])).await;
    assert_eq!(report.expect("fold").folded, vec![(pid("proj_1"), eid("x4"))]);
    assert_eq!(total(s, "proj_1", day.clone()).await.rows, 7);

    // No record to dead-letter: the whole batch is refused, nothing moves.
    let offsets = s.offsets("projector", "tollgate.usage").await.expect("offsets");
    let unsourced =
        batch(9, 11, vec![call("proj_1", "c6", "2026-07-07T12:31:10Z", 1), correction("proj_1", "x5", "gone")]);
    match s.fold_batch(&unsourced).await {
        Err(PortError::Permanent(why)) => assert!(why.contains("no event gone"), "{why}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(s.offsets("projector", "tollgate.usage").await.expect("offsets"), offsets);
    assert_eq!(total(s, "proj_1", day).await.rows, 7);
}

/// An amend of a tokens event is priced as the original was: by the price
/// book as of the original's receipt, whatever was put since.
pub async fn a_tokens_amend_is_priced_as_of_the_originals_receipt(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    s.put_prices(
        &[price("gpt-4o", Component::InputTokens, 5, "2026-01-01T00:00:00Z")],
        utc("2026-07-07T00:00:00Z"),
        None,
    )
    .await
    .expect("prices");
    let original = UsageFact {
        received_at: Some(utc("2026-07-07T12:31:11Z")),
        ..tokens("proj_1", "t1", "2026-07-07T12:31:10Z", vec![usage("gpt-4o", 100, 10, 0)])
    };
    s.fold_batch(&sourced(0, vec![original])).await.expect("fold");
    // After the original was received: a new input price, an output price,
    // both effective since January.
    s.put_prices(
        &[
            price("gpt-4o", Component::InputTokens, 1000, "2026-01-01T00:00:00Z"),
            price("gpt-4o", Component::OutputTokens, 1000, "2026-01-01T00:00:00Z"),
        ],
        utc("2026-07-07T18:00:00Z"),
        None,
    )
    .await
    .expect("later prices");
    let amend = UsageFact { tokens: vec![usage("gpt-4o", 40, 20, 0)], ..correction("proj_1", "x1", "t1") };
    s.fold_batch(&sourced(1, vec![amend])).await.expect("amend");
    let day = total(s, "proj_1", key(Dimension::Project, WindowKind::Day, "2026-07-07")).await;
    assert_eq!(day.tokens, 60);
    assert_eq!(day.cost_llm_tokens, 40 * 5, "input at the old price; output unpriced, as at the original's receipt");
    assert_eq!((day.llm_events, day.llm_priced, day.llm_unpriced), (1, 1, 1));
    let rows = breakdown(s, "proj_1", WindowKind::Day, "2026-07-07").await;
    let input = rows.iter().find(|r| r.key.component == Component::InputTokens).expect("input");
    let output = rows.iter().find(|r| r.key.component == Component::OutputTokens).expect("output");
    assert_eq!((input.priced_quantity, input.cost), (40, Usd(200)));
    assert_eq!((output.priced_quantity, output.unpriced_quantity), (0, 20));
}

/// The detail of a write of prices: each row's (model, unit price, replaced).
fn price_rows(e: &AuditEntry) -> Vec<(String, String, Option<String>)> {
    let AuditDetail::PriceChange { prices } = &e.detail else { panic!("a price change: {e:?}") };
    prices
        .iter()
        .map(|r| (r.model.clone(), r.unit_price_usd.to_string(), r.replaced_unit_price_usd.map(|u| u.to_string())))
        .collect()
}

/// A write of prices writes its audit entry (installation-wide: no
/// project) to the outbox in its own transaction, made against the book as
/// it stood: each row with the price it replaced. A write refused writes
/// neither. The installation's entries are read apart from any project's,
/// paged by cursor like them.
pub async fn a_write_of_prices_is_audited_installation_wide_with_it_or_not_at_all(s: &dyn Store) {
    s.create_project(&project("proj_1", Tz::UTC)).await.expect("create project");
    let by = Principal::new("admin", "test");
    let audit = |id: &str| meter::PriceAudit { id: aid(id), by: by.clone() };
    let breach = breach("q_1", "w1", 6).entry(aid("aud_0000"), utc("2026-07-07T00:00:00Z"));
    assert!(s.record_audit(&breach).await.expect("a project's entry"));

    let t1 = utc("2026-07-07T12:00:00.123456Z");
    let first = s
        .put_prices(
            &[
                price("gpt-4o", Component::InputTokens, 2_500_000, "2026-01-01T00:00:00Z"),
                price("o3", Component::InputTokens, 2_000_000, "2026-01-01T00:00:00Z"),
            ],
            t1,
            Some(&audit("aud_0001")),
        )
        .await
        .expect("put")
        .expect("an entry");
    assert_eq!(
        (first.project_id.as_ref(), first.action, first.resource.as_str(), first.principal.as_ref(), first.created_at),
        (None, AuditAction::PutPrices, "prices", Some(&by), t1)
    );
    assert_eq!(
        price_rows(&first),
        [("gpt-4o".into(), "0.0000025".into(), None), ("o3".into(), "0.000002".into(), None)]
    );
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![breach.clone(), first.clone()]);

    // A later row of a priced key, and a row of the same key and instant.
    let second = s
        .put_prices(
            &[
                price("gpt-4o", Component::InputTokens, 3_000_000, "2026-07-01T00:00:00Z"),
                price("o3", Component::InputTokens, 1_000_000, "2026-01-01T00:00:00Z"),
            ],
            utc("2026-07-07T12:01:00Z"),
            Some(&audit("aud_0002")),
        )
        .await
        .expect("put")
        .expect("an entry");
    assert_eq!(
        price_rows(&second),
        [
            ("gpt-4o".into(), "0.000003".into(), Some("0.0000025".into())),
            ("o3".into(), "0.000001".into(), Some("0.000002".into()))
        ]
    );

    // Refused (a negative price breaks the table's check): no rows, no entry.
    let bad = Price { unit_price_usd: Usd(-1), ..price("gpt-4o", Component::OutputTokens, 0, "2026-01-01T00:00:00Z") };
    let refused = s.put_prices(&[bad], utc("2026-07-07T12:02:00Z"), Some(&audit("aud_0003"))).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(s.unpublished_audit(10).await.expect("outbox"), vec![breach.clone(), first.clone(), second.clone()]);
    // Nothing to write: no entry.
    assert_eq!(s.put_prices(&[], utc("2026-07-07T12:03:00Z"), Some(&audit("aud_0004"))).await.expect("empty"), None);

    relay_and_fold(s).await;
    assert_eq!(s.audit(None, None, 10).await.expect("installation"), vec![first.clone(), second.clone()]);
    assert_eq!(s.audit(None, None, 1).await.expect("page 1"), vec![first.clone()]);
    assert_eq!(s.audit(None, Some(&first.id), 1).await.expect("page 2"), vec![second.clone()]);
    assert!(s.audit(None, Some(&second.id), 1).await.expect("past the end").is_empty());
    assert_eq!(s.audit(Some(&pid("proj_1")), None, 10).await.expect("the project's"), vec![breach]);
}

/// Two writes of the same row racing: the book is held still while each
/// reads what it replaces, so the second names the first's price.
pub async fn racing_writes_of_prices_each_see_what_the_other_replaced(s: &dyn Store) {
    let put = |id: String, model: String, picos: i64, at: &'static str| async move {
        let audit = meter::PriceAudit { id: aid(&id), by: Principal::new("admin", "test") };
        let row = price(&model, Component::InputTokens, picos, "2026-01-01T00:00:00Z");
        s.put_prices(&[row], utc(at), Some(&audit)).await.expect("put").expect("an entry")
    };
    // A few races, each on a row of its own.
    for round in 0..5 {
        let model = format!("m{round}");
        let (a, b) = tokio::join!(
            put(format!("aud_a{round}"), model.clone(), 1_000_000, "2026-07-07T12:00:00Z"),
            put(format!("aud_b{round}"), model, 2_000_000, "2026-07-07T12:00:01Z"),
        );
        let (a, b) = (price_rows(&a).remove(0).2, price_rows(&b).remove(0).2);
        assert!(
            (a.is_none() && b.as_deref() == Some("0.000001")) || (b.is_none() && a.as_deref() == Some("0.000002")),
            "round {round}: one replaced nothing, the other the first's price: {a:?} {b:?}"
        );
    }
}

// --- Projectors sharing the partitions ------------------------------------------

async fn members_split_the_partitions_and_a_lapsed_members_are_taken(s: &dyn Store) {
    let (c, t) = ("projector", "tollgate.usage");
    let parts: Vec<i32> = (0..6).collect();
    let t0 = utc("2026-07-07T12:00:00Z");
    let secs = |n: i64| t0 + Duration::seconds(n);
    let lease = Duration::seconds(10);
    let mine = |v: &[i32]| v.iter().copied().collect::<std::collections::BTreeSet<i32>>();
    // Alone, a takes every partition.
    assert_eq!(s.share_partitions(c, t, "a", &parts, t0, t0 + lease).await.expect("beat"), mine(&parts));
    // b joins: nothing is free until a gives back what is over its share.
    assert!(s.share_partitions(c, t, "b", &parts, secs(1), secs(1) + lease).await.expect("beat").is_empty());
    assert_eq!(s.share_partitions(c, t, "a", &parts, secs(2), secs(2) + lease).await.expect("beat"), mine(&[0, 1, 2]));
    assert_eq!(s.share_partitions(c, t, "b", &parts, secs(3), secs(3) + lease).await.expect("beat"), mine(&[3, 4, 5]));
    let (owners, live) = s.partition_owners(c, t, secs(3)).await.expect("owners");
    assert_eq!(live, ["a".to_owned(), "b".to_owned()].into());
    assert_eq!(owners.values().filter(|o| o.as_deref() == Some("b")).count(), 3);
    // Another consumer's or topic's members share nothing with these.
    assert_eq!(s.share_partitions("replay", t, "x", &parts, secs(3), secs(3) + lease).await.expect("beat").len(), 6);
    // a stops beating: once its membership lapses b takes everything.
    assert_eq!(
        s.share_partitions(c, t, "b", &parts, secs(11), secs(11) + lease).await.expect("beat"),
        mine(&[3, 4, 5])
    );
    assert_eq!(s.share_partitions(c, t, "b", &parts, secs(13), secs(13) + lease).await.expect("beat"), mine(&parts));
    let (_, live) = s.partition_owners(c, t, secs(13)).await.expect("owners");
    assert_eq!(live, ["b".to_owned()].into());
    // b leaves: its partitions are free at once for a newcomer.
    s.leave_partitions(c, t, "b").await.expect("leave");
    let (owners, live) = s.partition_owners(c, t, secs(14)).await.expect("owners");
    assert!(live.is_empty() && owners.values().all(Option::is_none), "{owners:?} {live:?}");
    assert_eq!(s.share_partitions(c, t, "c", &parts, secs(14), secs(14) + lease).await.expect("beat"), mine(&parts));
}

async fn concurrent_heartbeats_never_give_a_partition_to_two_members(s: &dyn Store) {
    let (c, t) = ("projector", "tollgate.usage");
    let parts: Vec<i32> = (0..6).collect();
    let t0 = utc("2026-07-07T12:00:00Z");
    let names: Vec<String> = (0..4).map(|i| format!("m{i}")).collect();
    let mut held: BTreeMap<String, std::collections::BTreeSet<i32>> = BTreeMap::new();
    for round in 0..3 {
        let at = t0 + Duration::seconds(round);
        let beats = futures::future::join_all(
            names.iter().map(|n| s.share_partitions(c, t, n, &parts, at, at + Duration::seconds(30))),
        )
        .await;
        for (n, b) in names.iter().zip(beats) {
            held.insert(n.clone(), b.expect("beat"));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (n, mine) in &held {
            for p in mine {
                assert!(seen.insert(*p), "round {round}: partition {p} held twice ({n}): {held:?}");
            }
        }
    }
    let sizes: Vec<usize> = held.values().map(|m| m.len()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 6, "{held:?}");
    assert!(sizes.iter().all(|n| (1..=2).contains(n)), "fair shares of 6 among 4: {held:?}");
}
