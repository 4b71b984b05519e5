//! `tollgate replay` end to end (issue 9, item 7; DESIGN §11): the log
//! folded live, then rebuilt from offset 0 into a shadow while the live
//! projector runs, must give byte-identical aggregates — events received
//! more than 35 days ago by the wall clock, a price put after some tokens
//! events were received, corrections, a record dead-lettered (and
//! dead-lettered once, never published again) — and a live aggregate tampered with must show as
//! a difference (exit status 1) that `--swap` repairs, after which checks
//! see the right usage again.

use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use meter::{ApiKeyId, EventId, EventKind, ProjectId, UsageFact};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};

use crate::harness::*;
use crate::invariants::LogAudit;

/// Runs `tollgate replay` against the environment's services.
pub(crate) fn replay(env: &Env, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    c.arg("replay").args(args).stdin(Stdio::null());
    match env.mode {
        Mode::Distributed => c
            .env("TOLLGATE_DATABASE_URL", &env.db_url)
            .env("TOLLGATE_REDIS_URL", &env.redis_url)
            .env("TOLLGATE_REDIS_PREFIX", &env.redis_prefix)
            .env("TOLLGATE_TOPIC_PREFIX", &env.topic_prefix)
            .env("TOLLGATE_KAFKA_BROKERS", &env.brokers)
            .env_remove("TOLLGATE_DATA_DIR"),
        Mode::Dev => c.env("TOLLGATE_DATA_DIR", &env.data_dir),
    };
    c.env("TOLLGATE_LOG", if testkit::env::test_log() { "info" } else { "warn" });
    let out = c.output().expect("run tollgate replay");
    if testkit::env::test_log() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    }
    out
}

pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A replay that found no difference.
pub(crate) fn assert_identical(o: &Output) {
    let out = stdout(o);
    assert!(
        o.status.success() && out.contains("no differences"),
        "replay: {:?}\n{out}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A call of one row received at `received`, as a gateway would have put it on the log.
fn old_call(id: &str, pid: &str, kid: &str, received: DateTime<Utc>) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse(kid).expect("key id")),
        rows: 1,
        gateway: "old".into(),
        received_at: Some(received),
        ..UsageFact::new(
            EventId::parse(id).expect("event id"),
            ProjectId::parse(pid).expect("project id"),
            EventKind::Call,
            received - chrono::Duration::minutes(5),
        )
    }
}

fn tokens(id: &str, pid: &str) -> Value {
    json!({"id": id, "type": "tokens", "project_id": pid, "agent_id": "bot", "occurred_at": Utc::now().to_rfc3339(),
           "tokens": [{"provider": "openai", "model": "gpt-4o", "input": 1000}]})
}

async fn put_price(env: &Env) {
    let (s, b) = env
        .admin_req(
            reqwest::Method::PUT,
            "/v1/prices",
            Some(json!({"prices": [{"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
                                    "unit_price_usd": "0.000002", "effective_from": "2026-01-01T00:00:00Z"}]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
}

/// Rows of `table` (the compared columns) in one schema and not the other,
/// both ways.
async fn apart(pool: &sqlx::PgPool, table: &str, cols: &str) -> (i64, i64) {
    let count = |a: &str, b: &str| {
        format!("SELECT COUNT(*) FROM (SELECT {cols} FROM {a}.{table} EXCEPT SELECT {cols} FROM {b}.{table}) AS d")
    };
    let live_only: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count("public", "tollgate_shadow")))
        .fetch_one(pool)
        .await
        .expect("diff");
    let shadow_only: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count("tollgate_shadow", "public")))
        .fetch_one(pool)
        .await
        .expect("diff");
    (live_only, shadow_only)
}

/// Deletes the environment's view keys (a `FLUSHDB` of its prefix).
async fn flush_view(env: &Env) {
    let client = redis::Client::open(env.redis_url.as_str()).expect("redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis connection");
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("{}*", env.redis_prefix)).query_async(&mut conn).await.expect("keys");
    if !keys.is_empty() {
        let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await.expect("del");
    }
}

/// Checks until refused; how many were admitted (at most `max`).
async fn admitted(env: &Env, secret: &str, max: usize) -> usize {
    for n in 0..=max {
        let r = check(&env.http, env.gw(), secret, json!({})).await;
        match r.status().as_u16() {
            200 => continue,
            429 => return n,
            s => panic!("check answered {s}: {:?}", r.text().await),
        }
    }
    max + 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_rebuilds_identical_aggregates_while_the_projector_runs_and_swap_repairs() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    env.start_projector();
    let tz = safe_timezone();
    let (pid, kid, secret) = env.project_with_key(tz).await;

    // On the log as a gateway put them 40 days ago (inside the horizon at
    // their receipt, far outside it by today's clock), and a record that is
    // not an event at all.
    let producer: FutureProducer =
        rdkafka::ClientConfig::new().set("bootstrap.servers", &env.brokers).create().expect("producer");
    let topic = format!("{}usage", env.topic_prefix);
    let long_ago = Utc::now() - chrono::Duration::days(40);
    for i in 0..20 {
        let f = old_call(&format!("old-{i}"), &pid, &kid, long_ago + chrono::Duration::seconds(i));
        let bytes = schemas::encode_usage(&f).expect("encode");
        producer
            .send(FutureRecord::to(&topic).key(&pid).payload(&bytes), Duration::from_secs(10))
            .await
            .expect("produce an old event");
    }
    producer
        .send(FutureRecord::to(&topic).key(&pid).payload(b"not an event"), Duration::from_secs(10))
        .await
        .expect("produce garbage");

    // Tokens received before and after a price was put, and calls.
    let (s, b) = post_events(&env.http, env.gw(), vec![tokens("before-price", &pid)]).await;
    assert_eq!(s, 202, "{b}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    put_price(&env).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, b) = post_events(&env.http, env.gw(), vec![tokens("after-price", &pid)]).await;
    assert_eq!(s, 202, "{b}");
    let calls: Vec<Value> = (0..30).map(|i| call_event(&format!("c-{i}"), &pid, &kid, None, 2)).collect();
    let (s, b) = post_events(&env.http, env.gw(), calls).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(60, "the live fold", || async { env.durable(&pid, "p", "day").await.1 == 50 }).await;
    // Corrections amend what the dedup set says two calls count.
    let amend = |id: &str, of: &str, rows: u64| {
        json!({"id": id, "type": "correction", "project_id": pid, "corrects": of,
               "occurred_at": Utc::now().to_rfc3339(), "rows": rows})
    };
    let (s, b) = post_events(&env.http, env.gw(), vec![amend("x-0", "c-0", 5), amend("x-1", "c-1", 7)]).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(60, "the corrections folded", || async { env.durable(&pid, "p", "day").await.2 == 88 }).await;

    // Traffic while the replay runs: the live projector keeps folding.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let traffic = {
        let (http, gw, pid, kid, stop, sent) =
            (env.http.clone(), env.gw().to_owned(), pid.clone(), kid.clone(), stop.clone(), sent.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let events: Vec<Value> =
                    (0..10).map(|j| call_event(&format!("t-{i}-{j}"), &pid, &kid, None, 1)).collect();
                let (s, b) = post_events(&http, &gw, events).await;
                assert_eq!(s, 202, "{b}");
                sent.fetch_add(10, Ordering::SeqCst);
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let during = replay(&env, &[]);
    stop.store(true, Ordering::SeqCst);
    traffic.await.expect("traffic");
    assert_identical(&during);
    assert!(sent.load(Ordering::SeqCst) > 0, "no traffic during the replay");

    // Quiet now: replay again, and compare the two schemas ourselves.
    let total = 50 + i64::try_from(sent.load(Ordering::SeqCst)).expect("count");
    env.eventually(60, "the live fold of the traffic", || async { env.durable(&pid, "p", "day").await.1 == total })
        .await;
    assert_identical(&replay(&env, &[]));
    let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect");
    let totals = r#"project_id, dimension, window_kind, window_key, resets_at, requests, calls, "rows", tokens,
        cost_llm_tokens, cost_compute_execution, cost_api_request, cost_storage, llm_events, llm_priced,
        llm_unpriced, storage_events, storage"#;
    for (table, cols) in [
        ("usage_aggregates", totals),
        ("model_usage", "*"),
        ("unpriced_rows", "*"),
        ("storage_facts", "*"),
        ("processed_events", "*"),
        ("fold_receipts", "*"),
        ("consumer_offsets", "*"),
        ("dead_letters", r#"consumer, topic, "partition", "offset", key, payload, reason"#),
    ] {
        assert_eq!(apart(&pool, table, cols).await, (0, 0), "{table} differs between live and shadow");
    }
    // The day of the old events in the project's zone (its windows' keys).
    let zone = tz.parse::<chrono_tz::Tz>().expect("zone");
    let old_day = long_ago.with_timezone(&zone).format("%Y-%m-%d").to_string();
    let (old_calls, cost, priced): (i64, i64, i64) = sqlx::query_as(
        "SELECT CAST(SUM(calls) FILTER (WHERE window_key = $2) AS BIGINT), CAST(SUM(cost_llm_tokens) AS BIGINT),
                CAST(SUM(llm_priced) AS BIGINT)
         FROM tollgate_shadow.usage_aggregates WHERE project_id = $1 AND dimension = 'p' AND window_kind = 'day'",
    )
    .bind(&pid)
    .bind(&old_day)
    .fetch_one(&pool)
    .await
    .expect("shadow totals");
    assert_eq!((old_calls, cost, priced), (20, 1000 * 2_000_000, 1), "old events in, priced as of receipt");
    let (letters, published): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(*) FILTER (WHERE published) FROM tollgate_shadow.dead_letters")
            .fetch_one(&pool)
            .await
            .expect("shadow dead letters");
    assert_eq!((letters, published), (1, 0), "the shadow keeps its dead letter and publishes nothing");
    let audit = LogAudit::of(&env).await;
    assert_eq!(audit.dlq.len(), 1, "the DLQ holds the bad record once: {:?}", audit.dead_lettered());

    // A live aggregate gone wrong: checks see it (the view re-seeded from
    // it), the replay reports it, `--swap` puts the log's truth back.
    let today = Utc::now().with_timezone(&zone).format("%Y-%m-%d").to_string();
    let used: i64 = sqlx::query_scalar(
        "SELECT calls FROM usage_aggregates WHERE project_id = $1 AND dimension = 'p' AND window_kind = 'day'
         AND window_key = $2",
    )
    .bind(&pid)
    .bind(&today)
    .fetch_one(&pool)
    .await
    .expect("today's calls");
    env.quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day",
                     "limit": used + 3}))
        .await;
    sqlx::query("UPDATE usage_aggregates SET calls = calls + 5 WHERE project_id = $1 AND window_kind = 'day'")
        .bind(&pid)
        .execute(&pool)
        .await
        .expect("tamper");
    flush_view(&env).await;
    assert_eq!(admitted(&env, &secret, 5).await, 0, "the tampered total refuses every check");
    let found = replay(&env, &[]);
    assert_eq!(found.status.code(), Some(1), "{}", stdout(&found));
    assert!(stdout(&found).contains("usage_aggregates"), "{}", stdout(&found));
    let swapped = replay(&env, &["--swap"]);
    assert!(stdout(&swapped).contains("swapped"), "{}\n{}", stdout(&swapped), String::from_utf8_lossy(&swapped.stderr));
    assert_eq!(admitted(&env, &secret, 5).await, 3, "after the swap checks see the right usage");
    pool.close().await;
    assert_identical(&replay(&env, &[]));
}

/// The same on `tollgate dev`: the embedded log replayed into a shadow file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_the_embedded_store() {
    let mut env = Env::dev().await;
    env.start_gateway().await;
    let (pid, kid, _) = env.project_with_key("UTC").await;
    let (s, b) = post_events(&env.http, env.gw(), vec![tokens("before-price", &pid)]).await;
    assert_eq!(s, 202, "{b}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    put_price(&env).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut events = vec![tokens("after-price", &pid)];
    events.extend((0..20).map(|i| call_event(&format!("c-{i}"), &pid, &kid, None, 1)));
    let (s, b) = post_events(&env.http, env.gw(), events).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(30, "the fold", || async { env.durable(&pid, "p", "day").await.1 == 20 }).await;

    assert_identical(&replay(&env, &[]));
    let pool = env.sqlite().await;
    sqlx::query("UPDATE usage_aggregates SET calls = calls + 1 WHERE project_id = ?1 AND window_kind = 'day'")
        .bind(&pid)
        .execute(&pool)
        .await
        .expect("tamper");
    let found = replay(&env, &[]);
    assert_eq!(found.status.code(), Some(1), "{}", stdout(&found));
    assert!(stdout(&found).contains("calls: live 21, shadow 20"), "{}", stdout(&found));
    let swapped = replay(&env, &["--swap"]);
    assert!(stdout(&swapped).contains("swapped"), "{}", stdout(&swapped));
    assert_eq!(env.durable(&pid, "p", "day").await.1, 20, "the swap put the fold of the log back");
    pool.close().await;
    assert_identical(&replay(&env, &[]));
}
