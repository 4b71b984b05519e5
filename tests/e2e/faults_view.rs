//! Losing the view, and losing a gateway (DESIGN §2, guarantees 4 and 8;
//! §10): Redis is a cache of the log, so admission stays exact across its
//! loss, counters never go back silently, and a dead gateway's reservations
//! are freed by their leases.
//!
//! Each test runs its own `redis-server` (`testkit::RedisServer`) and shares
//! PostgreSQL and the broker. The view-loss tests are the issue's
//! reproduction, with two gateways: a `calls` quota of 60; 10 calls settled
//! and folded; the projector stopped; 20 more settled (on the log, not
//! folded) and 20 checked and holding reservations; then the view is lost —
//! `FLUSHALL`, a restart with nothing, or a restart from a snapshot taken
//! after the first 10 (its `loaded` marker restored with it). Then 64
//! clients check through both gateways until refused: exactly 10 are
//! admitted (zero overshoot, and no undershoot either), and the view reads
//! 60 (settled + held). Then everything is settled, the projector comes
//! back, and the invariants are read from the system's own records:
//! acknowledged ⊆ log, log = folded ∪ DLQ, the durable totals a fold of the
//! log (no double count), every admitted request event on the log with its
//! reservation, and Redis equal to PostgreSQL (nothing left pending) within
//! 10 s of the fold catching up.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::*;
use crate::invariants::LogAudit;

/// How the view is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loss {
    FlushAll,
    RestartEmpty,
    OlderSnapshot,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_view_flushall_keeps_admission_exact() {
    view_loss(Loss::FlushAll).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_view_empty_restart_keeps_admission_exact() {
    view_loss(Loss::RestartEmpty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_view_older_snapshot_is_not_trusted() {
    view_loss(Loss::OlderSnapshot).await;
}

/// A check through `gw` that must be admitted: its reservation.
async fn admitted(env: &Env, gw: &str, secret: &str) -> String {
    let r = check(&env.http, gw, secret, json!({})).await;
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 200, "check: {body}");
    body["reservation_id"].as_str().expect("reservation id").to_owned()
}

/// Settles a reservation with a call event through `gw`; the event id.
async fn settle(env: &Env, gw: &str, id: &str, pid: &str, kid: &str, rid: &str) -> String {
    let (s, b) = post_events(&env.http, gw, vec![call_event(id, pid, kid, Some(rid), 1)]).await;
    assert_eq!(s, 202, "settle {id}: {b}");
    id.to_owned()
}

/// A quota's current usage as the view reads it (durable + pending + reserved).
async fn usage(env: &Env, qid: &str) -> i64 {
    let (s, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(s, 200, "{q}");
    q["current_usage"]["count"].as_i64().expect("a count")
}

/// The project's (durable, pending) calls of its day counter, read from Redis.
async fn redis_calls(env: &Env, conn: &mut redis::aio::MultiplexedConnection, pid: &str) -> (i64, i64) {
    let pattern = format!("{}{{{pid}}}:c:p|day|*", env.redis_prefix);
    let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query_async(conn).await.expect("keys");
    let mut out = (0, 0);
    for k in keys {
        let (t, p): (Option<i64>, Option<i64>) =
            redis::cmd("HMGET").arg(&k).arg("t_calls").arg("p_calls").query_async(conn).await.expect("hmget");
        out.0 += t.unwrap_or(0);
        out.1 += p.unwrap_or(0);
    }
    out
}

/// 64 clients through every gateway, each checking until refused (a 503 of
/// a view coming back is retried): the reservations admitted.
async fn rush(env: &Env, secret: &str) -> Vec<(String, String)> {
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..64 {
        let gw = env.gateways[c % env.gateways.len()].clone();
        let (http, secret, got, refused) = (env.http.clone(), secret.to_owned(), got.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..200 {
                let r = check(&http, &gw, &secret, json!({})).await;
                let status = r.status().as_u16();
                let body: Value = r.json().await.unwrap_or(Value::Null);
                match status {
                    200 => {
                        let rid = body["reservation_id"].as_str().expect("reservation id").to_owned();
                        got.lock().expect("lock").push((gw.clone(), rid));
                    }
                    429 => {
                        refused.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    503 => tokio::time::sleep(Duration::from_millis(100)).await,
                    other => panic!("check answered {other}: {body}"),
                }
            }
            panic!("a client was never refused");
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    assert_eq!(refused.load(Ordering::SeqCst), 64, "every client ends refused");
    got.lock().expect("lock").clone()
}

async fn view_loss(loss: Loss) {
    testkit::require!(Postgres, Kafka);
    let mut redis = testkit::RedisServer::start().await;
    let mut env = Env::with_redis(redis.url()).await;
    let gws = [env.start_gateway().await, env.start_gateway().await];
    let projector = env.start_projector();
    let tz = safe_timezone();
    let (pid, kid, secret) = env.project_with_key(tz).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 60}))
        .await;
    let mut acked = Vec::new();

    // 10 calls settled and folded.
    for i in 0..10 {
        let gw = &gws[i % 2];
        let rid = admitted(&env, gw, &secret).await;
        acked.push(settle(&env, gw, &format!("a{i}"), &pid, &kid, &rid).await);
    }
    env.eventually(30, "the first ten folded", || async { env.durable(&pid, "p", "day").await.1 == 10 }).await;
    if loss == Loss::OlderSnapshot {
        // Let the fold reach the view too, then keep this state as the backup.
        tokio::time::sleep(Duration::from_millis(500)).await;
        redis.save().await;
    }

    // The projector stops: what follows is on the log, not folded.
    env.kill(projector);
    for i in 10..30 {
        let gw = &gws[i % 2];
        let rid = admitted(&env, gw, &secret).await;
        acked.push(settle(&env, gw, &format!("a{i}"), &pid, &kid, &rid).await);
    }
    let mut held: Vec<(String, String)> = Vec::new();
    for i in 0..20 {
        let gw = gws[i % 2].clone();
        let rid = admitted(&env, &gw, &secret).await;
        held.push((gw, rid));
    }
    assert_eq!(usage(&env, &qid).await, 50, "30 settled + 20 held");
    // The request events are published in the background: on the log first.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let client = redis::Client::open(redis.url()).expect("redis client");
    match loss {
        Loss::FlushAll => {
            let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("flushall");
        }
        Loss::RestartEmpty => redis.restart_empty().await,
        Loss::OlderSnapshot => redis.restart_from_snapshot().await,
    }
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");
    if loss == Loss::OlderSnapshot {
        let (t, _) = redis_calls(&env, &mut conn, &pid).await;
        assert!(t <= 10, "the snapshot holds the older state: {t} durable calls");
    }

    // Exactly the 10 slots left are taken, through both gateways at once.
    let rushed = rush(&env, &secret).await;
    assert_eq!(rushed.len(), 10, "admitted after the loss ({loss:?}): zero overshoot, none lost");
    assert_eq!(usage(&env, &qid).await, 60, "30 settled + 30 held, as the view reads it");
    for gw in &gws {
        let r = check(&env.http, gw, &secret, json!({})).await;
        assert_eq!(r.status().as_u16(), 429, "full on {gw}");
    }

    // Everything held is settled; the projector comes back and catches up.
    held.extend(rushed);
    for (i, (gw, rid)) in held.iter().enumerate() {
        acked.push(settle(&env, gw, &format!("h{i}"), &pid, &kid, rid).await);
    }
    env.start_projector();
    env.eventually(30, "the fold caught up", || async { env.durable(&pid, "p", "day").await.1 == 60 }).await;
    let started = tokio::time::Instant::now();
    loop {
        let calls = redis_calls(&env, &mut conn, &pid).await;
        if calls == (60, 0) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "Redis = PostgreSQL within 10 s: {calls:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(usage(&env, &qid).await, 60);

    let audit = LogAudit::of(&env).await;
    audit.assert_acknowledged_on_log(&pid, &acked);
    audit.assert_accounted(&env).await;
    audit.assert_folded_once(&env, &pid, safe_timezone_of(&env, &pid).await).await;
    let requests: Vec<meter::UsageFact> = audit
        .facts()
        .into_iter()
        .map(|(_, _, f)| f)
        .filter(|f| f.project_id.as_str() == pid && f.kind == meter::EventKind::Request)
        .collect();
    let admitted_requests: Vec<&meter::UsageFact> = requests.iter().filter(|f| f.admitted == Some(true)).collect();
    assert_eq!(admitted_requests.len(), 60, "every admitted check's request event is on the log");
    assert!(
        admitted_requests.iter().all(|f| f.lease_until.is_some() && !f.held.is_empty() && f.reservation_id.is_some()),
        "an admitted request event carries its reservation"
    );
    assert!(
        requests.iter().filter(|f| f.admitted == Some(false)).all(|f| f.held.is_empty() && !f.breaches.is_empty()),
        "a refused one holds nothing and names its breach"
    );
    drop(env);
    drop(redis);
}

/// A gateway killed (`SIGKILL`) while holding reservations: nothing it
/// acknowledged is lost, its reservations keep their slots until their
/// leases end — also through a `FLUSHALL` meanwhile, since the other
/// gateway's reseed reads them from the log — and then they are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_view_gateway_killed_holding_reservations() {
    testkit::require!(Postgres, Kafka);
    let redis = testkit::RedisServer::start().await;
    let mut env = Env::with_redis(redis.url()).await;
    let lease = Duration::from_secs(4);
    env.extra_env.push(("TOLLGATE_LEASE".into(), "4s".into()));
    let doomed = env.start_gateway().await; // child 0
    let survivor = env.start_gateway().await; // child 1
    env.start_projector();
    let tz = safe_timezone();
    let (pid, kid, secret) = env.project_with_key(tz).await;
    let qid =
        env.quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 5})).await;
    let mut acked = Vec::new();
    for i in 0..2 {
        let rid = admitted(&env, &doomed, &secret).await;
        acked.push(settle(&env, &doomed, &format!("k{i}"), &pid, &kid, &rid).await);
    }
    for _ in 0..3 {
        admitted(&env, &doomed, &secret).await;
    }
    let held_at = tokio::time::Instant::now();
    // Its request events reach the log (published in the background).
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.kill(0);
    env.gateways.retain(|g| *g != doomed);

    let r = check(&env.http, &survivor, &secret, json!({})).await;
    assert_eq!(r.status().as_u16(), 429, "the dead gateway's reservations still hold their slots");
    // The view is lost too: the survivor's reseed reads them from the log.
    let client = redis::Client::open(redis.url()).expect("redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("flushall");
    let r = check(&env.http, &survivor, &secret, json!({})).await;
    assert_eq!(r.status().as_u16(), 429, "after the reseed too");
    assert_eq!(usage(&env, &qid).await, 5, "2 settled + 3 held");
    if held_at.elapsed() >= lease {
        panic!("the machine is too slow for this test's 4 s lease");
    }

    // Their leases end: exactly the 3 slots come back.
    tokio::time::sleep(lease.saturating_sub(held_at.elapsed()) + Duration::from_millis(300)).await;
    let mut more = 0;
    for i in 0..10 {
        let r = check(&env.http, &survivor, &secret, json!({})).await;
        match r.status().as_u16() {
            200 => {
                let body: Value = r.json().await.expect("body");
                let rid = body["reservation_id"].as_str().expect("rid").to_owned();
                acked.push(settle(&env, &survivor, &format!("s{i}"), &pid, &kid, &rid).await);
                more += 1;
            }
            429 => break,
            other => panic!("check answered {other}"),
        }
    }
    assert_eq!(more, 3, "the leases freed exactly the dead gateway's slots");

    env.eventually(30, "the fold caught up", || async { env.durable(&pid, "p", "day").await.1 == 5 }).await;
    let audit = LogAudit::of(&env).await;
    audit.assert_acknowledged_on_log(&pid, &acked);
    audit.assert_accounted(&env).await;
    audit.assert_folded_once(&env, &pid, safe_timezone_of(&env, &pid).await).await;
    drop(env);
    drop(redis);
}

/// A gateway killed just after its first checks, with the view flushed:
/// it listened only once its producers had their producer ids, so the
/// request events of those checks left at once (a fresh producer holds
/// records back until its id comes, 0.5–1 s after it is made), and the
/// survivor's reseed reads their reservations back from the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_view_fresh_gateway_killed_after_its_first_checks() {
    testkit::require!(Postgres, Kafka);
    let redis = testkit::RedisServer::start().await;
    let mut env = Env::with_redis(redis.url()).await;
    env.extra_env.push(("TOLLGATE_LEASE".into(), "60s".into()));
    let survivor = env.start_gateway().await;
    let (pid, _, secret) = env.project_with_key(safe_timezone()).await;
    env.quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 3})).await;
    let fresh = env.start_gateway().await;
    let doomed = env.last_started();
    for _ in 0..3 {
        admitted(&env, &fresh, &secret).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    env.kill(doomed);
    env.gateways.retain(|g| *g != fresh);

    let client = redis::Client::open(redis.url()).expect("redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("flushall");
    let r = check(&env.http, &survivor, &secret, json!({})).await;
    assert_eq!(r.status().as_u16(), 429, "the killed gateway's three reservations, read back from the log");
    drop(env);
    drop(redis);
}

/// Redis unreachable: a check does what the policy says — `deny` (the
/// default) answers 503 `VIEW_UNAVAILABLE`, `allow` admits uncounted — and
/// each decision is counted on `/metrics` by policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_view_unreachable_follows_the_policy() {
    testkit::require!(Postgres, Kafka);
    let redis = testkit::RedisServer::start().await;
    let mut env = Env::with_redis(redis.url()).await;
    let deny = env.start_gateway().await;
    env.extra_env.push(("TOLLGATE_VIEW_DOWN".into(), "allow".into()));
    let allow = env.start_gateway().await;
    let (pid, _, secret) = env.project_with_key(safe_timezone()).await;
    env.quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 100})).await;
    for gw in [&deny, &allow] {
        let r = check(&env.http, gw, &secret, json!({})).await;
        assert_eq!(r.status().as_u16(), 200, "Redis up");
    }
    drop(redis);

    let r = check(&env.http, &deny, &secret, json!({})).await;
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("VIEW_UNAVAILABLE")), "{body}");
    let r = check(&env.http, &allow, &secret, json!({})).await;
    assert_eq!(r.status().as_u16(), 200, "admitted uncounted");

    let metric = |text: &str, policy: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with("tollgate_view_unavailable_total") && l.contains(&format!("policy=\"{policy}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    for (gw, policy) in [(&deny, "deny"), (&allow, "allow")] {
        let text = env.http.get(format!("{gw}/metrics")).send().await.expect("metrics").text().await.expect("text");
        assert!(metric(&text, policy) >= 1.0, "{policy} decisions counted on {gw}/metrics");
    }
}

/// A signed-in user's check reserves on its role's quota like a key's, and
/// its request event is on the log too (counting no request): a `FLUSHALL`
/// while the user holds reservations does not give their slots away — the
/// reseed reads them from the log on the other gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_view_flush_keeps_a_signed_in_users_reservations() {
    testkit::require!(Postgres, Kafka);
    let redis = testkit::RedisServer::start().await;
    let mut env = Env::with_redis(redis.url()).await;
    let first = env.start_gateway().await;
    let second = env.start_gateway().await;
    let (pid, _, _) = env.project_with_key(safe_timezone()).await;
    let (s, role) = env
        .admin_post(
            &format!("/v1/projects/{pid}/roles"),
            json!({"name": "analyst", "quota": {"calls": 3, "per": "day"}}),
        )
        .await;
    assert_eq!(s, 201, "{role}");
    let user = json!({"user": "user:alice", "role_id": role["id"]});
    let ask = |gw: String| {
        let (http, user) = (env.http.clone(), user.clone());
        async move {
            let r = http.post(format!("{gw}/v1/check")).bearer_auth(GATEWAY).json(&user).send().await.expect("check");
            r.status().as_u16()
        }
    };
    assert_eq!(ask(first.clone()).await, 200);
    assert_eq!(ask(first.clone()).await, 200);
    // Both request events reach the log (published in the background).
    let on_log = || async {
        let facts = crate::invariants::LogAudit::of(&env).await.facts();
        facts
            .iter()
            .filter(|(_, _, f)| f.project_id.as_str() == pid && f.user_id.as_deref() == Some("user:alice"))
            .count()
            == 2
    };
    env.eventually(30, "the user's request events are on the log", on_log).await;
    let client = redis::Client::open(redis.url()).expect("redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("flushall");
    assert_eq!(ask(second.clone()).await, 200, "the third slot");
    assert_eq!(ask(second.clone()).await, 429, "2 held (from the log) + 1 admitted = the role's 3");
    drop(env);
    drop(redis);
}
