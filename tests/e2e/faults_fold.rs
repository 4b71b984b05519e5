//! The fold's faults, end to end (issue 9, items 1 and 2): records the fold
//! cannot take, late and early events, a projector that catches up long
//! after, duplicates, two projectors racing and a projector killed again and
//! again while it dead-letters. The projector must never stop, every record
//! must be folded or dead-lettered (once, with its reason), and the totals
//! must be a fold of the log: each test ends with `LogAudit`'s invariants.
//!
//! They run on the shared services (they freeze, flush or restart none of
//! them); a test that makes the store refuse a record does so with a
//! trigger in its own database.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use meter::{ApiKeyId, EventId, EventKind, ProjectId, TokenUsage, UsageFact};
use rand::Rng;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};

use crate::harness::*;
use crate::invariants::LogAudit;

/// A producer of raw records straight onto the environment's usage topic.
struct Raw {
    producer: FutureProducer,
    topic: String,
}

impl Raw {
    fn new(env: &Env) -> Raw {
        let producer =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &env.brokers).create().expect("raw producer");
        Raw { producer, topic: format!("{}usage", env.topic_prefix) }
    }

    async fn bytes(&self, key: &str, payload: &[u8]) {
        self.producer
            .send(FutureRecord::to(&self.topic).key(key).payload(payload), Duration::from_secs(10))
            .await
            .expect("produce a raw record");
    }

    async fn fact(&self, f: &UsageFact) {
        let bytes = schemas::encode_usage(f).expect("encode a raw fact");
        self.bytes(f.project_id.as_str(), &bytes).await;
    }
}

/// A successful call of `rows` rows, received at `received`.
fn raw_call(id: &str, pid: &str, kid: &str, occurred: DateTime<Utc>, received: DateTime<Utc>) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse(kid).expect("key id")),
        rows: 1,
        gateway: "raw".into(),
        received_at: Some(received),
        ..UsageFact::new(
            EventId::parse(id).expect("event id"),
            ProjectId::parse(pid).expect("project id"),
            EventKind::Call,
            occurred,
        )
    }
}

fn raw_tokens(id: &str, pid: &str, entries: &[u64], received: DateTime<Utc>) -> UsageFact {
    UsageFact {
        agent_id: Some("bot".into()),
        tokens: entries
            .iter()
            .map(|&input| TokenUsage { provider: "openai".into(), model: "gpt-4o".into(), input, ..Default::default() })
            .collect(),
        gateway: "raw".into(),
        received_at: Some(received),
        ..UsageFact::new(
            EventId::parse(id).expect("event id"),
            ProjectId::parse(pid).expect("project id"),
            EventKind::Tokens,
            received,
        )
    }
}

async fn pg(env: &Env) -> sqlx::PgPool {
    sqlx::PgPool::connect(&env.db_url).await.expect("connect test database")
}

/// The invariants of every fault test, read from the log once the fold has
/// caught up: acknowledged ⊆ log, log = folded ∪ DLQ, no record twice in
/// the DLQ, and the totals a fold of the log. Returns the audit.
async fn audit(env: &Env, pid: &str, acked: &[String], dead: usize) -> LogAudit {
    let mut audit = LogAudit::of(env).await;
    for _ in 0..150 {
        if audit.dlq.len() >= dead {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        audit = LogAudit::of(env).await;
    }
    // Settle: nothing more may arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let audit = LogAudit::of(env).await;
    assert_eq!(audit.dlq.len(), dead, "dead letters: {:?}", audit.dead_lettered());
    assert_eq!(audit.dead_lettered().len(), audit.dlq.len(), "a record is in the DLQ twice");
    audit.assert_acknowledged_on_log(pid, acked);
    audit.assert_accounted(env).await;
    let tz = safe_timezone_of(env, pid).await;
    audit.assert_folded_once(env, pid, tz).await;
    audit
}

/// Raw records the fold cannot take, among good ones, straight on the topic:
/// garbage, an entry past 2^53, entries whose sum passes it (the i64
/// overflow of old), events too old or too far ahead of their receipt, and a
/// record the store refuses (a trigger in this test's database). The
/// projector keeps folding; each bad one is in the DLQ with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_records_among_good_ones_are_dead_lettered_and_the_rest_folded() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;
    let pool = pg(&env).await;
    sqlx::query(
        "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
           IF NEW.event_id LIKE 'poison%' THEN RAISE EXCEPTION 'poisoned record %', NEW.event_id; END IF;
           RETURN NEW; END $$",
    )
    .execute(&pool)
    .await
    .expect("trigger function");
    sqlx::query("CREATE TRIGGER poison BEFORE INSERT ON processed_events FOR EACH ROW EXECUTE FUNCTION poison()")
        .execute(&pool)
        .await
        .expect("trigger");
    pool.close().await;
    env.start_projector();

    let raw = Raw::new(&env);
    let now = Utc::now();
    let minute = chrono::Duration::minutes(1);
    let big = 1u64 << 53;
    raw.fact(&raw_call("good-0", &pid, &kid, now, now)).await;
    raw.bytes(&pid, b"not avro at all").await;
    raw.fact(&raw_tokens("overflow", &pid, &[big + 1], now)).await;
    // Two entries whose sum passes i64::MAX (what once stopped the fold).
    raw.fact(&raw_tokens("i64-overflow", &pid, &[1 << 62, 1 << 62], now)).await;
    // Each entry within the bound, their sum past it.
    raw.fact(&raw_tokens("sum", &pid, &[big, big], now)).await;
    raw.fact(&raw_call("too-old", &pid, &kid, now - chrono::Duration::days(60), now)).await;
    raw.fact(&raw_call("future", &pid, &kid, now + minute * 10, now)).await;
    raw.fact(&raw_call("poison-1", &pid, &kid, now, now)).await;
    for i in 1..5 {
        raw.fact(&raw_call(&format!("good-{i}"), &pid, &kid, now, now)).await;
    }
    let events: Vec<Value> = (0..20).map(|i| call_event(&format!("api-{i}"), &pid, &kid, None, 2)).collect();
    let (s, b) = post_events(&env.http, env.gw(), events).await;
    assert_eq!(s, 202, "{b}");

    env.eventually(60, "the good records folded", || async { env.durable(&pid, "p", "day").await.1 == 25 }).await;
    assert_eq!(env.durable(&pid, "p", "day").await, (0, 25, 45));
    let acked: Vec<String> = (0..20).map(|i| format!("api-{i}")).collect();
    let audit = audit(&env, &pid, &acked, 7).await;
    let mut reasons: Vec<String> = audit.dead_lettered().into_values().collect();
    reasons.sort();
    let expect = [
        "invalid: tokens: the input tokens of its entries sum past 2^53",
        "invalid: tokens[0].input: is more than 2^53",
        "invalid: tokens[0].input: is more than 2^53",
        "malformed",
        "out of range: occurred_at: is more than 5 minutes in the future",
        "out of range: occurred_at: is older than the dedup horizon",
        "refused by the store: ",
    ];
    for (reason, prefix) in reasons.iter().zip(expect) {
        assert!(reason.starts_with(prefix), "{reason:?} should start with {prefix:?}; all: {reasons:?}");
    }
    assert!(reasons[6].contains("poisoned record poison-1"), "the store's own reason: {}", reasons[6]);
}

/// `/v1/events` refuses, by the gateway's clock, an event older than the
/// horizon or more than 5 minutes ahead (400 naming the field, nothing of
/// the request written); a late event inside the horizon is folded into the
/// window of its event time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_refuses_what_the_fold_would_dead_letter_and_folds_late_events_in_their_window() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, _) = env.project_with_key("UTC").await;
    let at = |t: DateTime<Utc>, id: &str| {
        let mut e = call_event(id, &pid, &kid, None, 1);
        e["occurred_at"] = json!(t.to_rfc3339());
        e
    };
    let now = Utc::now();
    for (event, what) in [
        (at(now - chrono::Duration::days(36), "old"), "older than the dedup horizon"),
        (at(now + chrono::Duration::minutes(10), "ahead"), "in the future"),
    ] {
        let (s, b) = post_events(&env.http, env.gw(), vec![at(now, "fine"), event]).await;
        assert_eq!(s, 400, "{b}");
        assert_eq!(b["error"]["code"], "INVALID_REQUEST", "{b}");
        assert_eq!(b["error"]["meta"]["field"], "events[1].occurred_at", "{b}");
        assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains(what)), "{b}");
    }
    let late = now - chrono::Duration::days(20);
    let (s, b) = post_events(&env.http, env.gw(), vec![at(late, "late")]).await;
    assert_eq!(s, 202, "{b}");
    let day = late.format("%Y-%m-%d").to_string();
    env.eventually(30, "the late event folded", || async { env.durable(&pid, "p", "day").await.1 == 1 }).await;
    let pool = pg(&env).await;
    let (calls,): (i64,) = sqlx::query_as(
        "SELECT calls FROM usage_aggregates WHERE project_id = $1 AND dimension = 'p' AND window_kind = 'day'
         AND window_key = $2",
    )
    .bind(&pid)
    .bind(&day)
    .fetch_one(&pool)
    .await
    .expect("the late event's day");
    pool.close().await;
    assert_eq!(calls, 1, "in the day it occurred, {day}; and nothing of the refused requests");
    audit(&env, &pid, &["late".to_owned()], 0).await;
}

/// A projector stopped while records piled up, received 40 days ago (a wall
/// clock would call them too old; by their receipt they are on time),
/// resent, and tokens events received before and after a back-dated price
/// was put: started, it folds every record as the live fold would have —
/// the old ones in, each id once, and the price only for what was received
/// after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_catching_up_folds_by_receipt_and_prices_as_of_receipt() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    let (pid, kid, _) = env.project_with_key("UTC").await;
    let raw = Raw::new(&env);
    let received = Utc::now() - chrono::Duration::days(40);
    let old: Vec<UsageFact> = (0..30)
        .map(|i| {
            let r = received + chrono::Duration::seconds(i);
            raw_call(&format!("old-{i}"), &pid, &kid, r - chrono::Duration::hours(1), r)
        })
        .collect();
    for f in &old {
        raw.fact(f).await;
    }
    // Resent as they were, and through the API a second time in one request.
    raw.fact(&old[3]).await;
    raw.fact(&old[7]).await;
    let dup = call_event("api-dup", &pid, &kid, None, 1);
    let (s, b) = post_events(&env.http, env.gw(), vec![dup.clone(), dup.clone()]).await;
    assert_eq!((s, b["accepted"].clone(), b["duplicates"].clone()), (202, json!(1), json!(1)), "{b}");
    let (s, _) = post_events(&env.http, env.gw(), vec![dup]).await;
    assert_eq!(s, 202);

    let tokens = |id: &str| {
        json!({"id": id, "type": "tokens", "project_id": pid, "agent_id": "bot", "occurred_at": Utc::now().to_rfc3339(),
               "tokens": [{"provider": "openai", "model": "gpt-4o", "input": 1000}]})
    };
    let (s, b) = post_events(&env.http, env.gw(), vec![tokens("before-price")]).await;
    assert_eq!(s, 202, "{b}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, b) = env
        .admin_req(
            reqwest::Method::PUT,
            "/v1/prices",
            Some(json!({"prices": [{"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
                                    "unit_price_usd": "0.000002", "effective_from": "2026-01-01T00:00:00Z"}]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, b) = post_events(&env.http, env.gw(), vec![tokens("after-price")]).await;
    assert_eq!(s, 202, "{b}");

    env.start_projector();
    env.eventually(60, "the backlog folded", || async { env.durable(&pid, "p", "day").await.1 == 31 }).await;
    env.eventually(30, "the tokens folded", || async { env.durable_tokens(&pid, "p", "day").await == 2000 }).await;
    let pool = pg(&env).await;
    let (cost, priced, unpriced): (i64, i64, i64) = sqlx::query_as(
        "SELECT CAST(SUM(cost_llm_tokens) AS BIGINT), CAST(SUM(llm_priced) AS BIGINT), CAST(SUM(llm_unpriced) AS BIGINT)
         FROM usage_aggregates WHERE project_id = $1 AND dimension = 'p' AND window_kind = 'day'",
    )
    .bind(&pid)
    .fetch_one(&pool)
    .await
    .expect("cost");
    pool.close().await;
    assert_eq!((cost, priced, unpriced), (1000 * 2_000_000, 1, 1), "only the event received after the price");
    let acked = vec!["api-dup".to_owned(), "before-price".to_owned(), "after-price".to_owned()];
    audit(&env, &pid, &acked, 0).await;
}

/// Two projector processes on the same consumer name, with bad records in
/// the stream: fenced, every event is folded once and every bad record
/// dead-lettered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_projectors_racing_fold_and_dead_letter_exactly_once() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    env.start_projector();
    env.start_projector();
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;
    let raw = Raw::new(&env);
    let mut acked = Vec::new();
    for b in 0..20 {
        let events: Vec<Value> = (0..200)
            .map(|i| {
                let id = format!("b{b}-e{i}");
                acked.push(id.clone());
                call_event(&id, &pid, &kid, None, 1)
            })
            .collect();
        let (s, body) = post_events(&env.http, env.gw(), events).await;
        assert_eq!(s, 202, "{body}");
        raw.bytes(&pid, format!("garbage {b}").as_bytes()).await;
    }
    env.eventually(120, "every event folded", || async { env.durable(&pid, "p", "day").await.1 == 4000 }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(env.durable(&pid, "p", "day").await, (0, 4000, 4000));
    audit(&env, &pid, &acked, 20).await;
}

/// The projector SIGKILLed again and again while the stream carries bad
/// records: the DLQ never holds a record twice, and none is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dlq_never_holds_a_record_twice_through_a_projector_kill_loop() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    // A short claim on dead letters: a killed projector's wait for the next.
    let lease = [("TOLLGATE_DEAD_LETTER_LEASE", "1s")];
    let mut proj = env.start_projector_with(&lease);
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;

    let sent = Arc::new(AtomicU64::new(0));
    let sender = {
        let (http, gw, pid, kid, sent) =
            (env.http.clone(), env.gw().to_owned(), pid.clone(), kid.clone(), sent.clone());
        let raw = Raw::new(&env);
        tokio::spawn(async move {
            for b in 0..30 {
                let events: Vec<Value> =
                    (0..100).map(|i| call_event(&format!("b{b}-e{i}"), &pid, &kid, None, 1)).collect();
                let (s, body) = post_events(&http, &gw, events).await;
                assert_eq!(s, 202, "{body}");
                raw.bytes(&pid, format!("garbage {b}-a").as_bytes()).await;
                raw.bytes(&pid, format!("garbage {b}-b").as_bytes()).await;
                sent.fetch_add(100, Ordering::SeqCst);
                let pause = rand::rng().random_range(20..120);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        })
    };
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(rand::rng().random_range(200..900))).await;
        env.kill(proj);
        tokio::time::sleep(Duration::from_millis(rand::rng().random_range(20..300))).await;
        proj = env.start_projector_with(&lease);
    }
    sender.await.expect("sender");
    assert_eq!(sent.load(Ordering::SeqCst), 3000);
    env.eventually(120, "every event folded", || async { env.durable(&pid, "p", "day").await.1 == 3000 }).await;
    let acked: Vec<String> = (0..30).flat_map(|b| (0..100).map(move |i| format!("b{b}-e{i}"))).collect();
    let audit = audit(&env, &pid, &acked, 60).await;
    let per_source: BTreeMap<(i32, i64), usize> = audit.dlq.iter().fold(BTreeMap::new(), |mut m, r| {
        let p = r.headers.get("tollgate-source-partition").and_then(|v| v.parse().ok()).unwrap_or(-1);
        let o = r.headers.get("tollgate-source-offset").and_then(|v| v.parse().ok()).unwrap_or(-1);
        *m.entry((p, o)).or_default() += 1;
        m
    });
    assert!(per_source.values().all(|n| *n == 1), "a record dead-lettered twice: {per_source:?}");
}
