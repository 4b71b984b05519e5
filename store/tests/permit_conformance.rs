//! The `Permits` conformance suite: every behaviour is a generic body
//! (`suite_*`) over an `Arc<dyn Permits>`, stamped out by `conformance!` as a
//! test per backend:
//!
//! - `memory::*` against a fresh [`MemoryPermits`] (the reference model);
//! - `redis::*` against [`RedisPermits`] on the Redis at
//!   `TOLLGATE_TEST_REDIS_URL`, with a key prefix of each test's own;
//! - `postgres::*` against [`PgPermits`] in a fresh, migrated database on
//!   the server at `TOLLGATE_TEST_DATABASE_URL`.
//!
//! Every backend takes its time from the `at` it is given (Redis compares
//! the scripts' `now`, PostgreSQL the bound instant), so the bodies move
//! time by hand: a lease lapses exactly at its end, and not a millisecond
//! before.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use meter::{Claimed, Permit, PermitClaim, PermitId, Permits, Pool};
use store::{MemoryPermits, PgPermits, PgStore, RedisView};
use uuid::Uuid;

// ---------------------------------------------------------------- helpers

fn t0() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2030-01-01T00:00:00Z").expect("timestamp").with_timezone(&Utc)
}

fn at_ms(ms: i64) -> DateTime<Utc> {
    t0() + chrono::Duration::milliseconds(ms)
}

fn holder() -> String {
    format!("p-{}/k:key_1", Uuid::new_v4().simple())
}

fn new_id() -> PermitId {
    PermitId::parse(format!("pmt_{}", Uuid::new_v4().simple())).expect("permit id")
}

fn ask(holder: &str, cap: u32, installation_cap: u32, lease_secs: u64) -> PermitClaim {
    PermitClaim {
        id: new_id(),
        holder: holder.to_owned(),
        cap,
        installation_cap,
        lease: Duration::from_secs(lease_secs),
    }
}

async fn claim(p: &dyn Permits, c: &PermitClaim, at: DateTime<Utc>) -> Claimed {
    p.claim(c, at).await.expect("claim")
}

async fn granted(p: &dyn Permits, c: &PermitClaim, at: DateTime<Utc>) -> Permit {
    match claim(p, c, at).await {
        Claimed::Granted(permit) => permit,
        Claimed::Full(pool) => panic!("{pool:?} pool full for {}", c.holder),
    }
}

// ---------------------------------------------------------------- bodies

/// A holder takes up to its cap; past it nothing is taken, and another
/// holder's pool is its own.
async fn suite_a_holder_takes_up_to_its_cap(p: Arc<dyn Permits>) {
    let (h, other) = (holder(), holder());
    let a = granted(&*p, &ask(&h, 2, 100, 31), t0()).await;
    assert_eq!((a.holder.as_str(), a.expires_at), (h.as_str(), at_ms(31_000)));
    granted(&*p, &ask(&h, 2, 100, 31), t0()).await;
    assert_eq!(claim(&*p, &ask(&h, 2, 100, 31), t0()).await, Claimed::Full(Pool::Caller));
    assert_eq!(claim(&*p, &ask(&h, 2, 100, 31), at_ms(1)).await, Claimed::Full(Pool::Caller), "a refusal took nothing");
    granted(&*p, &ask(&other, 1, 100, 31), t0()).await;
    // The slot a refusal did not take is there once one is released.
    assert!(p.release(&a.id, at_ms(2)).await.expect("release"));
    granted(&*p, &ask(&h, 2, 100, 31), at_ms(3)).await;
}

/// The installation's cap bounds every holder's permits together, and a
/// claim refused by it takes no slot of its holder's.
async fn suite_the_installation_cap_spans_holders(p: Arc<dyn Permits>) {
    let (h1, h2, h3) = (holder(), holder(), holder());
    let a = granted(&*p, &ask(&h1, 2, 3, 60), t0()).await;
    granted(&*p, &ask(&h1, 2, 3, 60), t0()).await;
    granted(&*p, &ask(&h2, 2, 3, 60), t0()).await;
    assert_eq!(claim(&*p, &ask(&h2, 2, 3, 60), t0()).await, Claimed::Full(Pool::Installation));
    assert_eq!(claim(&*p, &ask(&h3, 1, 3, 60), t0()).await, Claimed::Full(Pool::Installation));
    // The holder's own pool is reported first when both are full.
    assert_eq!(claim(&*p, &ask(&h1, 2, 3, 60), t0()).await, Claimed::Full(Pool::Caller));
    assert!(p.release(&a.id, at_ms(1)).await.expect("release"));
    // h3's cap is 1: had its refused claim taken its slot, this would be full.
    granted(&*p, &ask(&h3, 1, 3, 60), at_ms(2)).await;
    assert_eq!(claim(&*p, &ask(&h2, 2, 3, 60), at_ms(2)).await, Claimed::Full(Pool::Installation));
}

/// A permit never released frees its slot when its lease lapses, and not
/// a millisecond before; a lapsed permit cannot be renewed or released.
async fn suite_a_lease_lapses_at_its_end_and_not_before(p: Arc<dyn Permits>) {
    let h = holder();
    let dead = granted(&*p, &ask(&h, 1, 100, 31), t0()).await;
    assert_eq!(claim(&*p, &ask(&h, 1, 100, 31), at_ms(30_999)).await, Claimed::Full(Pool::Caller));
    let next = granted(&*p, &ask(&h, 1, 100, 31), at_ms(31_000)).await;
    assert!(next.token > dead.token, "the later holder's fencing token is greater");
    assert_eq!(p.renew(&dead.id, at_ms(31_000)).await.expect("renew"), None);
    assert!(!p.release(&dead.id, at_ms(31_000)).await.expect("release"));
    // The later permit is untouched by the lapsed one's release.
    assert_eq!(claim(&*p, &ask(&h, 1, 100, 31), at_ms(31_001)).await, Claimed::Full(Pool::Caller));
    // A lapsed permit also frees its installation slot.
    let h2 = holder();
    granted(&*p, &ask(&h2, 5, 2, 10), at_ms(40_000)).await;
    assert_eq!(claim(&*p, &ask(&h2, 5, 2, 10), at_ms(40_000)).await, Claimed::Full(Pool::Installation));
    granted(&*p, &ask(&h2, 5, 2, 10), at_ms(62_000)).await;
}

/// Renewing keeps a slot past three leases; once renewing stops, it lapses
/// one lease after the last renewal.
async fn suite_renew_keeps_a_slot_past_three_leases(p: Arc<dyn Permits>) {
    let h = holder();
    let held = granted(&*p, &ask(&h, 1, 100, 10), t0()).await;
    for i in 1..=4 {
        let at = at_ms(i * 8_000);
        let r = p.renew(&held.id, at).await.expect("renew").expect("still held");
        assert_eq!((r.id.clone(), r.expires_at, r.token), (held.id.clone(), at_ms(i * 8_000 + 10_000), held.token));
        assert_eq!(r.holder, h);
        assert_eq!(claim(&*p, &ask(&h, 1, 100, 10), at).await, Claimed::Full(Pool::Caller));
    }
    // 32 s in: past three leases of 10 s, the slot is still held…
    assert_eq!(claim(&*p, &ask(&h, 1, 100, 10), at_ms(41_999)).await, Claimed::Full(Pool::Caller));
    // …until one lease after the last renewal.
    granted(&*p, &ask(&h, 1, 100, 10), at_ms(42_000)).await;
    assert_eq!(p.renew(&held.id, at_ms(42_000)).await.expect("renew"), None);
}

/// A release frees both slots once; an unknown permit is neither renewed
/// nor released.
async fn suite_release_frees_once(p: Arc<dyn Permits>) {
    let h = holder();
    let a = granted(&*p, &ask(&h, 1, 1, 60), t0()).await;
    assert!(p.release(&a.id, at_ms(1)).await.expect("release"));
    assert!(!p.release(&a.id, at_ms(1)).await.expect("release again"));
    assert_eq!(p.renew(&a.id, at_ms(1)).await.expect("renew"), None);
    // Both the holder's slot and the installation's (cap 1) are free.
    granted(&*p, &ask(&holder(), 1, 1, 60), at_ms(2)).await;
    let unknown = new_id();
    assert_eq!(p.renew(&unknown, at_ms(3)).await.expect("renew"), None);
    assert!(!p.release(&unknown, at_ms(3)).await.expect("release"));
}

/// Fencing tokens only grow, across holders.
async fn suite_fencing_tokens_increase(p: Arc<dyn Permits>) {
    let mut last = 0;
    for i in 0..6 {
        let permit = granted(&*p, &ask(&holder(), 3, 100, 60), at_ms(i)).await;
        assert!(permit.token > last, "{} after {last}", permit.token);
        last = permit.token;
    }
}

/// 32 claims at once on a cap of 5: exactly 5 granted, all distinct; then
/// 5 more once they are released.
async fn suite_concurrent_claims_take_exactly_the_cap(p: Arc<dyn Permits>) {
    let h = holder();
    let round = |at: DateTime<Utc>| {
        let (p, h) = (p.clone(), h.clone());
        async move {
            let tasks: Vec<_> = (0..32)
                .map(|_| {
                    let (p, c) = (p.clone(), ask(&h, 5, 100, 60));
                    tokio::spawn(async move { p.claim(&c, at).await.expect("claim") })
                })
                .collect();
            let mut got = Vec::new();
            for t in tasks {
                if let Claimed::Granted(permit) = t.await.expect("task") {
                    got.push(permit);
                }
            }
            got
        }
    };
    let first = round(t0()).await;
    assert_eq!(first.len(), 5, "exactly the cap");
    let mut tokens: Vec<u64> = first.iter().map(|p| p.token).collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 5, "distinct fencing tokens");
    for permit in &first {
        assert!(p.release(&permit.id, at_ms(1)).await.expect("release"));
    }
    assert_eq!(round(at_ms(2)).await.len(), 5);
}

macro_rules! conformance {
    ($fixture:expr) => {
        conformance!(@each $fixture;
            suite_a_holder_takes_up_to_its_cap,
            suite_the_installation_cap_spans_holders,
            suite_a_lease_lapses_at_its_end_and_not_before,
            suite_renew_keeps_a_slot_past_three_leases,
            suite_release_frees_once,
            suite_fencing_tokens_increase,
            suite_concurrent_claims_take_exactly_the_cap,
        );
    };
    (@each $fixture:expr; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(fixture) = $fixture.await else { return };
            super::$name(fixture.permits.clone()).await;
        }
    )*};
}

// ---------------------------------------------------------------- backends

struct Memory {
    permits: Arc<dyn Permits>,
}

impl Memory {
    async fn new() -> Option<Memory> {
        Some(Memory { permits: Arc::new(MemoryPermits::new()) })
    }
}

mod memory {
    use super::*;

    conformance!(Memory::new());
}

/// Permits on the test Redis under a prefix of this test's own (its keys
/// removed on drop).
struct Fresh {
    permits: Arc<dyn Permits>,
    _keys: testkit::RedisPrefix,
}

impl Fresh {
    async fn new() -> Option<Fresh> {
        if !testkit::available(&[testkit::Service::Redis]) {
            return None;
        }
        let keys = testkit::RedisPrefix::new("tgpermit");
        let view = RedisView::connect(&keys.url, &keys.prefix).await.expect("connect to the test Redis");
        Some(Fresh { permits: Arc::new(view.permits()), _keys: keys })
    }
}

mod redis {
    use super::*;

    conformance!(Fresh::new());
}

/// The same on the test Redis Cluster: every permit script's keys carry
/// the one hash tag `{permits}`.
struct OnCluster {
    permits: Arc<dyn Permits>,
    _keys: testkit::RedisPrefix,
}

impl OnCluster {
    async fn new() -> Option<OnCluster> {
        if !testkit::available(&[testkit::Service::RedisCluster]) {
            return None;
        }
        let keys = testkit::RedisPrefix::on_cluster("tgpermit");
        let view = RedisView::connect(&keys.url, &keys.prefix).await.expect("connect to the test Redis Cluster");
        assert!(view.is_cluster());
        Some(OnCluster { permits: Arc::new(view.permits()), _keys: keys })
    }
}

mod redis_cluster {
    use super::*;

    conformance!(OnCluster::new());
}

/// Permits in a fresh, migrated PostgreSQL database (dropped on drop).
struct PgDb {
    permits: Arc<dyn Permits>,
    _db: testkit::TestDb,
}

impl PgDb {
    async fn new() -> Option<PgDb> {
        if !testkit::available(&[testkit::Service::Postgres]) {
            return None;
        }
        let db = testkit::TestDb::new("tgpermit").await;
        let store = PgStore::connect(&db.url).await.expect("connect to the test database");
        store.migrate().await.expect("migrate");
        Some(PgDb { permits: Arc::new(PgPermits::new(store.pool().clone())), _db: db })
    }
}

mod postgres {
    use super::*;

    conformance!(PgDb::new());

    /// The table is UNLOGGED (ADR-0196: a crash frees every permit).
    #[tokio::test]
    async fn the_permit_table_is_unlogged() {
        let Some(db) = PgDb::new().await else { return };
        let store = PgStore::connect(&db._db.url).await.expect("connect");
        let persistence: String =
            sqlx::query_scalar("SELECT relpersistence::text FROM pg_class WHERE relname = 'heavy_permit'")
                .fetch_one(store.pool())
                .await
                .expect("pg_class");
        assert_eq!(persistence, "u");
    }
}
