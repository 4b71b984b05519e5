//! End-to-end tests of the whole system on real services: PostgreSQL, Redis
//! and a Kafka-protocol broker (see `scripts/test`).

mod alerts;
mod audit;
mod console_browser;
mod corrections;
mod estimates;
mod explain;
mod export_schedules;
mod exports;
mod faults_fold;
mod faults_outage;
mod faults_view;
mod harness;
mod invariants;
mod model;
mod permits;
mod projectors;
mod replay;
mod roles;
mod webhooks;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use harness::*;
use rand::Rng;
use serde_json::{Value, json};

/// (a) A calls quota of 1,000, two gateway processes, 64 concurrent clients
/// that check then settle: exactly 1,000 admitted; every other answer is the
/// documented 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exact_admission_across_two_gateways() {
    exact_admission(Mode::Distributed).await;
}

/// (a) in one `tollgate dev` process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exact_admission_dev() {
    exact_admission(Mode::Dev).await;
}

async fn exact_admission(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_gateway().await;
    }
    env.start_projector();
    let tz = safe_timezone();
    let (pid, kid, secret) = env.project_with_key(tz).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 1000}))
        .await;

    let admitted = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..64 {
        let gw = env.gateways[c % env.gateways.len()].clone();
        let (http, secret, pid, kid, qid) = (env.http.clone(), secret.clone(), pid.clone(), kid.clone(), qid.clone());
        let (admitted, refused) = (admitted.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let r = check(&http, &gw, &secret, json!({})).await;
                let status = r.status().as_u16();
                let headers = r.headers().clone();
                let body: Value = r.json().await.expect("check body");
                match status {
                    200 => {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        assert!(headers.contains_key("x-quota-remaining-calls"), "remaining header");
                        let rid = body["reservation_id"].as_str().expect("reservation id");
                        let ev = call_event(&format!("c{c}-{i}"), &pid, &kid, Some(rid), 3);
                        let (s, b) = post_events(&http, &gw, vec![ev]).await;
                        assert_eq!(s, 202, "settle: {b}");
                    }
                    429 => {
                        refused.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(body["error"]["code"], "QUOTA_EXCEEDED", "{body}");
                        let meta = &body["error"]["meta"];
                        assert_eq!(meta["quota_id"], qid.as_str());
                        assert_eq!(meta["metric"], "calls");
                        assert_eq!(meta["limit"], 1000);
                        assert_eq!(meta["window"], "day");
                        assert!(meta["resets_at"].is_string());
                        let ra: u64 = headers["retry-after"].to_str().expect("ascii").parse().expect("seconds");
                        assert!((1..=86_400).contains(&ra));
                        assert_eq!(headers["x-quota-remaining-calls"], "0");
                        assert!(headers.contains_key("x-quota-reset"));
                    }
                    other => panic!("unexpected status {other}: {body}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    assert_eq!(admitted.load(Ordering::SeqCst), 1000, "exactly the limit is admitted");
    assert_eq!(refused.load(Ordering::SeqCst), 64 * 25 - 1000);

    // The durable fold agrees, and the quota reads the same count.
    env.eventually(60, "1,000 calls folded", || async {
        env.durable(&pid, &format!("k:{kid}"), "day").await.1 == 1000
    })
    .await;
    assert_eq!(env.durable(&pid, &format!("k:{kid}"), "day").await.2, 3000, "rows folded");
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(q["current_usage"]["count"], 1000, "{q}");
}

/// (b) 50,000 events while the projector is SIGKILLed five times at random
/// moments: the aggregates equal the totals of the acknowledged events.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn projector_killed_five_times_loses_and_doubles_nothing() {
    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    let mut proj = env.start_projector();
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;

    let acked_calls = Arc::new(AtomicU64::new(0));
    let acked_rows = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    for t in 0..4 {
        let (http, gw, pid, kid) = (env.http.clone(), env.gw().to_owned(), pid.clone(), kid.clone());
        let (acked_calls, acked_rows) = (acked_calls.clone(), acked_rows.clone());
        senders.push(tokio::spawn(async move {
            for b in 0..25 {
                let mut rows_in_batch = 0;
                let events: Vec<Value> = (0..500)
                    .map(|i| {
                        let rows = rand::rng().random_range(0..10u64);
                        rows_in_batch += rows;
                        call_event(&format!("t{t}-b{b}-e{i}"), &pid, &kid, None, rows)
                    })
                    .collect();
                let (s, body) = post_events(&http, &gw, events).await;
                assert_eq!(s, 202, "{body}");
                acked_calls.fetch_add(500, Ordering::SeqCst);
                acked_rows.fetch_add(rows_in_batch, Ordering::SeqCst);
            }
        }));
    }
    for _ in 0..5 {
        let wait = rand::rng().random_range(300..2000);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        env.kill(proj);
        tokio::time::sleep(Duration::from_millis(rand::rng().random_range(50..500))).await;
        proj = env.start_projector();
    }
    for s in senders {
        s.await.expect("sender");
    }
    let calls = acked_calls.load(Ordering::SeqCst) as i64;
    let rows = acked_rows.load(Ordering::SeqCst) as i64;
    assert_eq!(calls, 50_000);
    env.eventually(240, "all acknowledged events folded", || async { env.durable(&pid, "p", "day").await.1 >= calls })
        .await;
    // Settle a little longer: nothing more may arrive.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, c, r) = env.durable(&pid, "p", "day").await;
    assert_eq!((c, r), (calls, rows), "nothing lost, nothing counted twice");
    let (_, c, r) = env.durable(&pid, &format!("k:{kid}"), "calendar_month").await;
    assert_eq!((c, r), (calls, rows));

    // The invariants, from the log itself.
    let audit = invariants::LogAudit::of(&env).await;
    let acked: Vec<String> =
        (0..4).flat_map(|t| (0..25).flat_map(move |b| (0..500).map(move |i| format!("t{t}-b{b}-e{i}")))).collect();
    audit.assert_acknowledged_on_log(&pid, &acked);
    audit.assert_accounted(&env).await;
    let tz: chrono_tz::Tz = safe_timezone_of(&env, &pid).await;
    audit.assert_folded_once(&env, &pid, tz).await;
}

/// (c) The same event id, in one batch and in two batches, is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_event_ids_count_once() {
    duplicates(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_event_ids_count_once_dev() {
    duplicates(Mode::Dev).await;
}

async fn duplicates(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 100}))
        .await;
    let e = call_event("dup-1", &pid, &kid, None, 5);
    let (s, b) = post_events(&env.http, env.gw(), vec![e.clone(), e.clone()]).await;
    assert_eq!((s, b["accepted"].clone(), b["duplicates"].clone()), (202, json!(1), json!(1)), "{b}");
    // Before the fold the view already counts it once, and a resend adds nothing.
    let (s, _) = post_events(&env.http, env.gw(), vec![e.clone()]).await;
    assert_eq!(s, 202);
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(q["current_usage"]["count"], 1, "{q}");
    env.eventually(30, "the event folded", || async { env.durable(&pid, "p", "day").await.1 == 1 }).await;
    // After the fold, a resend in a later batch is still counted once.
    let (s, _) = post_events(&env.http, env.gw(), vec![e.clone(), call_event("dup-2", &pid, &kid, None, 1)]).await;
    assert_eq!(s, 202);
    env.eventually(30, "the second event folded", || async { env.durable(&pid, "p", "day").await.1 == 2 }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(env.durable(&pid, "p", "day").await, (0, 2, 6));
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(q["current_usage"]["count"], 2, "{q}");
}

/// (d) A malformed message on the topic lands in the DLQ with a reason, and
/// the events after it are folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_message_goes_to_the_dlq() {
    use rdkafka::Message;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::Headers;
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let Some(mut env) = Env::new().await else { return };
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;
    let producer: FutureProducer =
        rdkafka::ClientConfig::new().set("bootstrap.servers", &env.brokers).create().expect("producer");
    let topic = format!("{}usage", env.topic_prefix);
    producer
        .send(FutureRecord::to(&topic).key(&pid).payload(b"not avro at all".as_slice()), Duration::from_secs(10))
        .await
        .expect("produce garbage");
    // A well-framed record of an unknown schema fingerprint, too.
    let mut unknown = vec![0xC3, 0x01];
    unknown.extend_from_slice(&[7u8; 8]);
    producer
        .send(FutureRecord::to(&topic).key(&pid).payload(&unknown), Duration::from_secs(10))
        .await
        .expect("produce unknown fingerprint");
    let events: Vec<Value> = (0..10).map(|i| call_event(&format!("after-{i}"), &pid, &kid, None, 1)).collect();
    let (s, _) = post_events(&env.http, env.gw(), events).await;
    assert_eq!(s, 202);
    env.eventually(30, "events after the bad ones folded", || async { env.durable(&pid, "p", "day").await.1 == 10 })
        .await;

    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &env.brokers)
        .set("group.id", format!("dlq-reader-{}", env.id))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let dlq = format!("{}dlq", env.topic_prefix);
    consumer.subscribe(&[&dlq]).expect("subscribe dlq");
    let mut found = Vec::new();
    while found.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .expect("a dead letter within 30 s")
            .expect("dlq message");
        let reason = m
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "tollgate-reason").and_then(|h| h.value.map(<[u8]>::to_vec)))
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .expect("a reason header");
        found.push((m.payload().map(<[u8]>::to_vec).unwrap_or_default(), reason));
    }
    assert!(found.iter().any(|(p, r)| p == b"not avro at all" && r.starts_with("malformed")), "{found:?}");
    assert!(found.iter().any(|(p, r)| *p == unknown && r.contains("fingerprint")), "{found:?}");
}

/// (e) FLUSHALL on Redis during traffic: checks after it see the right
/// counts again within seconds. Runs on a Redis server of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_flush_during_traffic_recovers() {
    testkit::require!(Postgres, Kafka);
    let redis = testkit::RedisServer::start().await;
    let client = redis::Client::open(redis.url()).expect("redis client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect to own redis");

    let mut env = Env::with_redis(redis.url()).await;
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let limit = 400u64;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": limit}))
        .await;

    let settled = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..8 {
        let (http, gw, secret, pid, kid) =
            (env.http.clone(), env.gw().to_owned(), secret.clone(), pid.clone(), kid.clone());
        let (settled, stop) = (settled.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) && i < 25 {
                let r = check(&http, &gw, &secret, json!({})).await;
                if r.status().as_u16() == 200 {
                    let body: Value = r.json().await.expect("body");
                    let rid = body["reservation_id"].as_str().expect("rid").to_owned();
                    let (s, _) =
                        post_events(&http, &gw, vec![call_event(&format!("f{c}-{i}"), &pid, &kid, Some(&rid), 0)])
                            .await;
                    assert_eq!(s, 202);
                    settled.fetch_add(1, Ordering::SeqCst);
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("flushall");
    for t in tasks {
        t.await.expect("traffic task");
    }
    stop.store(true, Ordering::SeqCst);
    let n = settled.load(Ordering::SeqCst);
    assert!(n > 0 && n <= limit, "settled {n}");
    // Within seconds the view is right again: the quota reads every settled call.
    env.eventually(10, "the view counts every settled call", || async {
        let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
        let count = &q["current_usage"]["count"];
        if *count != json!(n) {
            eprintln!("the view counts {count} of {n} settled calls");
        }
        *count == json!(n)
    })
    .await;
    // And checks compare against it exactly: limit − n more are admitted.
    let mut more = 0;
    loop {
        let r = check(&env.http, env.gw(), &secret, json!({})).await;
        if r.status().as_u16() != 200 {
            assert_eq!(r.status().as_u16(), 429);
            break;
        }
        more += 1;
        assert!(more <= limit, "runaway admission");
    }
    assert_eq!(more, limit - n);
    drop(env);
    drop(redis);
}

/// (f) The validity rules through the API: every metric × scope × window of
/// this release, each accepted (201) or refused (400 naming the field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_validity_table() {
    validity(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_validity_table_dev() {
    validity(Mode::Dev).await;
}

async fn validity(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    let (pid, kid, _) = env.project_with_key("UTC").await;
    let metrics = ["requests", "calls", "rows", "tokens", "cost_usd", "storage_bytes"];
    let scopes = ["project", "api_key", "agent", "actor"];
    let windows = ["rolling_1m", "rolling_1h", "rolling_24h", "day", "calendar_month", "current"];
    let mut accepted = 0;
    for m in metrics {
        for s in scopes {
            for w in windows {
                let valid_scope = match m {
                    "requests" => ["project", "api_key"].contains(&s),
                    "calls" | "rows" => ["project", "api_key", "actor"].contains(&s),
                    "tokens" | "cost_usd" => ["project", "agent", "actor"].contains(&s),
                    _ => s == "project",
                };
                let expect_field = if !valid_scope {
                    Some("scope")
                } else if (m == "storage_bytes") != (w == "current") {
                    Some("window")
                } else {
                    None
                };
                let scope_ref = if s == "api_key" { json!(kid) } else { Value::Null };
                let (status, body) = env
                    .admin_post("/v1/quotas", json!({"project_id": pid, "scope": s, "scope_ref": scope_ref, "metric": m, "window": w, "limit": 5}))
                    .await;
                match expect_field {
                    None => {
                        assert_eq!(status, 201, "{m}/{s}/{w}: {body}");
                        accepted += 1;
                    }
                    Some(f) => {
                        assert_eq!(status, 400, "{m}/{s}/{w}: {body}");
                        assert_eq!(body["error"]["code"], "INVALID_REQUEST");
                        assert_eq!(body["error"]["meta"]["field"], f, "{m}/{s}/{w}: {body}");
                    }
                }
            }
        }
    }
    assert_eq!(accepted, 5 * (2 + 3 + 3 + 3 + 3) + 1);
    let (_, list) = env.admin_get(&format!("/v1/quotas?project_id={pid}")).await;
    assert_eq!(list["data"].as_array().map(Vec::len), Some(accepted), "refusals changed nothing");

    // A duplicate identity is a conflict; a null scope_ref is part of the identity.
    let q = json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 9});
    let (s, b) = env.admin_post("/v1/quotas", q).await;
    assert_eq!((s, b["error"]["code"].clone()), (409, json!("QUOTA_CONFLICT")), "{b}");
    // Field-level errors.
    for (body, field) in [
        (json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 0}), "limit"),
        (json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": "5"}), "limit"),
        (json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day"}), "limit"),
        (json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "week", "limit": 5}), "window"),
        (
            json!({"project_id": pid, "scope": "api_key", "scope_ref": "key_nope", "metric": "calls", "window": "day", "limit": 5}),
            "scope_ref",
        ),
        (
            json!({"project_id": "proj_nope", "scope": "project", "metric": "calls", "window": "day", "limit": 5}),
            "project_id",
        ),
        (
            json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 5, "mode": "loud"}),
            "mode",
        ),
        (
            json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 5, "meter_type": "llm_tokens"}),
            "meter_type",
        ),
        (
            json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 5, "colour": "red"}),
            "colour",
        ),
    ] {
        let (s, b) = env.admin_post("/v1/quotas", body.clone()).await;
        assert_eq!(s, 400, "{body}: {b}");
        assert_eq!(b["error"]["meta"]["field"], field, "{body}: {b}");
    }
    // PATCH changes only limit and mode.
    let (_, list) = env.admin_get(&format!("/v1/quotas?project_id={pid}")).await;
    let id = list["data"][0]["id"].as_str().expect("a quota").to_owned();
    let r = env
        .http
        .patch(format!("{}/v1/quotas/{id}", env.gw()))
        .bearer_auth(ADMIN)
        .json(&json!({"window": "rolling_1h"}))
        .send()
        .await
        .expect("patch");
    assert_eq!(r.status().as_u16(), 400);
    let b: Value = r.json().await.expect("body");
    assert_eq!(b["error"]["meta"]["field"], "window");
    let r = env
        .http
        .patch(format!("{}/v1/quotas/{id}", env.gw()))
        .bearer_auth(ADMIN)
        .json(&json!({"limit": 77, "mode": "monitor"}))
        .send()
        .await
        .expect("patch");
    assert_eq!(r.status().as_u16(), 200);
    let b: Value = r.json().await.expect("body");
    assert_eq!((b["limit"].clone(), b["mode"].clone()), (json!(77), json!("monitor")));
    // Bad events change nothing: one bad event refuses the whole batch.
    let good = call_event("ok-1", &pid, &kid, None, 1);
    let mut bad = call_event("bad-1", &pid, &kid, None, 1);
    bad["rows"] = json!(-3);
    let (s, b) = post_events(&env.http, env.gw(), vec![good, bad]).await;
    assert_eq!(s, 400);
    assert_eq!(b["error"]["meta"]["field"], "events[1].rows", "{b}");
    // Without the right token nothing is allowed.
    let r = env
        .http
        .post(format!("{}/v1/quotas", env.gw()))
        .bearer_auth(GATEWAY)
        .json(&json!({}))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status().as_u16(), 401);
}

/// (d) in `tollgate dev`: a malformed record on the embedded log is
/// dead-lettered with its reason, and the events after it are folded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_message_goes_to_the_dlq_dev() {
    let mut env = Env::dev().await;
    env.start_gateway().await;
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;
    let log = store::SqliteLog::new(env.sqlite_log().await, "tollgate.");
    log.publish_raw(&pid, b"not avro at all").await.expect("put garbage on the log");
    let events: Vec<Value> = (0..10).map(|i| call_event(&format!("after-{i}"), &pid, &kid, None, 1)).collect();
    let (s, _) = post_events(&env.http, env.gw(), events).await;
    assert_eq!(s, 202);
    env.eventually(30, "events after the bad one folded", || async { env.durable(&pid, "p", "day").await.1 == 10 })
        .await;
    let dead = log.dead_letters().await.expect("read dead letters");
    assert!(dead.iter().any(|(p, r)| p == b"not avro at all" && r.starts_with("malformed")), "{dead:?}");
}

/// `tollgate dev` whose stdout is closed before it prints its banner (as
/// `tollgate dev | head -3` leaves it once `head` has exited) still serves:
/// `println!` panicked on the closed pipe and took the server down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_serves_with_its_stdout_closed() {
    let dir = std::env::temp_dir().join(format!("tg-e2e-dev-stdout-{}", testkit::unique_id()));
    let http = reqwest::Client::new();
    for _attempt in 0..3 {
        let port = free_port();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("dev")
            .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"))
            .env("TOLLGATE_DATA_DIR", &dir)
            .env("TOLLGATE_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn tollgate dev");
        drop(child.stdout.take());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if child.try_wait().expect("wait").is_some() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                // Its port taken between free_port and its bind: again.
                assert!(err.contains("binding"), "tollgate dev exited: {err}");
                break;
            }
            if let Ok(r) = http.get(format!("http://127.0.0.1:{port}/openapi.json")).send().await
                && r.status().is_success()
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
                assert!(child.try_wait().expect("wait").is_none(), "tollgate dev exited after answering");
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "tollgate dev did not answer in 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    panic!("tollgate dev could not bind three times (its ports taken?)");
}

/// `tollgate dev` keeps its state: killed and started again on the same
/// data directory, the quotas and the counters are still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_state_survives_a_restart() {
    let mut env = Env::dev().await;
    env.start_gateway().await;
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 5}))
        .await;
    for i in 0..3 {
        let r = check(&env.http, env.gw(), &secret, json!({})).await;
        assert_eq!(r.status().as_u16(), 200);
        let body: Value = r.json().await.expect("body");
        let rid = body["reservation_id"].as_str().expect("rid").to_owned();
        let (s, _) =
            post_events(&env.http, env.gw(), vec![call_event(&format!("r{i}"), &pid, &kid, Some(&rid), 2)]).await;
        assert_eq!(s, 202);
    }
    env.eventually(30, "three calls folded", || async { env.durable(&pid, "p", "day").await.1 == 3 }).await;
    env.restart_dev().await;
    let (s, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(s, 200, "{q}");
    assert_eq!(q["current_usage"]["count"], 3, "{q}");
    let mut admitted = 0;
    while check(&env.http, env.gw(), &secret, json!({})).await.status().as_u16() == 200 {
        admitted += 1;
        assert!(admitted <= 5, "runaway admission after restart");
    }
    assert_eq!(admitted, 2, "the restarted process continues from 3 of 5");
}

/// `tollgate apply -f quotas.yaml` (and `PUT /v1/projects/{id}/quotas`):
/// applied twice the second run changes nothing; a new limit updates, a
/// missing entry deletes; an immutable change fails the whole apply naming
/// the field, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declarative_apply() {
    declarative(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declarative_apply_dev() {
    declarative(Mode::Dev).await;
}

/// The project's quotas, by "metric/window", as (id, limit, mode, updated_at).
async fn quota_set(env: &Env, pid: &str) -> std::collections::BTreeMap<String, (String, u64, String, String)> {
    let (s, list) = env.admin_get(&format!("/v1/quotas?project_id={pid}")).await;
    assert_eq!(s, 200, "{list}");
    list["data"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|q| {
            (
                format!("{}/{}", q["metric"].as_str().expect("metric"), q["window"].as_str().expect("window")),
                (
                    q["id"].as_str().expect("id").to_owned(),
                    q["limit"].as_u64().expect("limit"),
                    q["mode"].as_str().expect("mode").to_owned(),
                    q["updated_at"].as_str().expect("updated_at").to_owned(),
                ),
            )
        })
        .collect()
}

async fn declarative(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, secret) = env.project_with_key("UTC").await;
    let dir = std::env::temp_dir().join(format!("tg-apply-{}", env.id));
    std::fs::create_dir_all(&dir).expect("a directory for the file");
    let file = dir.join("quotas.yaml");
    let write = |day_limit: u64, with_actor: bool, extra: &str| {
        let mut y = format!(
            "# the quotas of project {pid}\nproject_id: {pid}\nquotas:\n{extra}  - scope: project\n    metric: calls\n    window: day\n    limit: {day_limit}\n  - scope: api_key\n    scope_ref: {kid}\n    metric: requests\n    window: rolling_1m\n    limit: 60\n    mode: monitor\n"
        );
        if with_actor {
            y.push_str("  - scope: actor\n    metric: rows\n    window: calendar_month\n    limit: 5000\n");
        }
        std::fs::write(&file, y).expect("write the file");
    };

    // First apply: three creates.
    write(100, true, "");
    let (ok, out, err) = env.apply(&file, &[]);
    assert!(ok, "apply failed: {err}");
    assert!(out.contains(&format!("applied to project {pid}: 3 created, 0 updated, 0 deleted, 0 unchanged")), "{out}");
    let first = quota_set(&env, &pid).await;
    assert_eq!(first.keys().collect::<Vec<_>>(), ["calls/day", "requests/rolling_1m", "rows/calendar_month"]);
    assert_eq!(first["requests/rolling_1m"].2, "monitor");

    // The gateway enforces what the file created (within its config cache).
    env.eventually(10, "the applied calls quota in the check headers", || async {
        let r = check(&env.http, env.gw(), &secret, json!({})).await;
        r.status().as_u16() == 200 && r.headers().get("x-quota-remaining-calls").is_some_and(|v| v == "99")
    })
    .await;

    // The same file again: nothing changes, not even a timestamp.
    let (ok, out, err) = env.apply(&file, &[]);
    assert!(ok, "{err}");
    assert!(out.contains("0 created, 0 updated, 0 deleted, 3 unchanged"), "{out}");
    assert_eq!(quota_set(&env, &pid).await, first);

    // A dry run of a change reports it and changes nothing.
    write(250, false, "");
    let (ok, out, err) = env.apply(&file, &["--dry-run"]);
    assert!(ok, "{err}");
    assert!(out.contains("dry run") && out.contains("0 created, 1 updated, 1 deleted, 1 unchanged"), "{out}");
    assert_eq!(quota_set(&env, &pid).await, first);

    // A new limit and a removed entry.
    let (ok, out, err) = env.apply(&file, &[]);
    assert!(ok, "{err}");
    assert!(out.contains("0 created, 1 updated, 1 deleted, 1 unchanged"), "{out}");
    assert!(out.contains("limit 100 -> 250"), "{out}");
    let second = quota_set(&env, &pid).await;
    assert_eq!(second.keys().collect::<Vec<_>>(), ["calls/day", "requests/rolling_1m"]);
    assert_eq!(
        (second["calls/day"].0.as_str(), second["calls/day"].1),
        (first["calls/day"].0.as_str(), 250),
        "updated in place"
    );
    assert_eq!(second["requests/rolling_1m"], first["requests/rolling_1m"]);

    // An immutable change, beside a valid one: the whole apply fails naming
    // the field, and neither change is made.
    let day_id = second["calls/day"].0.clone();
    write(
        250,
        false,
        &format!("  - id: {day_id}\n    scope: project\n    metric: calls\n    window: rolling_1h\n    limit: 7\n"),
    );
    let y = std::fs::read_to_string(&file).expect("read back");
    // Drop the entry without an id for the same quota, so the only problem is the window.
    let y = y.replacen("  - scope: project\n    metric: calls\n    window: day\n    limit: 250\n", "", 1);
    let y = y.replace("limit: 60\n    mode: monitor", "limit: 61\n    mode: monitor");
    std::fs::write(&file, &y).expect("write");
    let (ok, out, err) = env.apply(&file, &[]);
    assert!(!ok, "an immutable change must fail: {out}");
    assert!(err.contains("quotas[0].window") && err.contains("immutable"), "{err}");
    assert_eq!(quota_set(&env, &pid).await, second, "nothing changed");

    // Unknown fields and bad values are refused by entry and field.
    std::fs::write(&file, format!("project_id: {pid}\nquotas:\n  - scope: project\n    metric: calls\n    window: day\n    limit: 5\n    colour: red\n")).expect("write");
    let (ok, _, err) = env.apply(&file, &[]);
    assert!(!ok && err.contains("quotas[0].colour"), "{err}");
    std::fs::write(&file, format!("project_id: {pid}\nquotas:\n  - scope: project\n    metric: calls\n    window: day\n    limit: 5\n  - scope: project\n    metric: calls\n    window: week\n    limit: 5\n")).expect("write");
    let (ok, _, err) = env.apply(&file, &[]);
    assert!(!ok && err.contains("quotas[1].window"), "{err}");
    assert_eq!(quota_set(&env, &pid).await, second, "nothing changed");

    // The same through the API, as JSON.
    let body = |limit: u64, window: &str, id: Option<&str>| {
        json!({"project_id": pid, "quotas": [
            {"id": id, "scope": "project", "metric": "calls", "window": window, "limit": limit},
            {"scope": "api_key", "scope_ref": kid, "metric": "requests", "window": "rolling_1m", "limit": 60, "mode": "monitor"},
        ]})
    };
    let put = format!("/v1/projects/{pid}/quotas");
    let (s, b) = env.admin_req(reqwest::Method::PUT, &put, Some(body(300, "day", None))).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        (b["created"].clone(), b["updated"].clone(), b["deleted"].clone(), b["unchanged"].clone()),
        (json!(0), json!(1), json!(0), json!(1)),
        "{b}"
    );
    let (s, b) = env.admin_req(reqwest::Method::PUT, &put, Some(body(300, "day", Some(&day_id)))).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        (b["created"].clone(), b["updated"].clone(), b["deleted"].clone()),
        (json!(0), json!(0), json!(0)),
        "a no-op: {b}"
    );
    let third = quota_set(&env, &pid).await;
    let (s, b) = env.admin_req(reqwest::Method::PUT, &put, Some(body(1, "rolling_1h", Some(&day_id)))).await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(b["error"]["code"], "INVALID_REQUEST");
    assert_eq!(b["error"]["meta"]["field"], "quotas[0].window", "{b}");
    let (s, b) =
        env.admin_req(reqwest::Method::PUT, &put, Some(json!({"quotas": [{"scope": "project", "colour": 1}]}))).await;
    assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!("quotas[0].colour")), "{b}");
    let (s, b) =
        env.admin_req(reqwest::Method::PUT, &put, Some(json!({"project_id": "proj_other", "quotas": []}))).await;
    assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!("project_id")), "{b}");
    let (s, _) =
        env.admin_req(reqwest::Method::PUT, "/v1/projects/proj_nope/quotas", Some(json!({"quotas": []}))).await;
    assert_eq!(s, 404);
    assert_eq!(quota_set(&env, &pid).await, third, "refusals changed nothing");

    // Every change is in the audit log, with who made it, once folded from
    // the audit topic: the key the project started with, then the quotas.
    let log = env.audit_when(&pid, 30, "seven audit entries", |e| e.len() >= 7).await;
    let actions: Vec<(String, String)> = log
        .iter()
        .map(|e| {
            (e["action"].as_str().expect("action").to_owned(), e["principal_id"].as_str().unwrap_or("").to_owned())
        })
        .collect();
    let count = |a: &str, who: &str| actions.iter().filter(|(x, p)| x == a && p == who).count();
    assert_eq!(count("quotas:CreateQuota", "cli"), 3, "{actions:?}");
    assert_eq!(count("quotas:UpdateQuota", "cli"), 1, "{actions:?}");
    assert_eq!(count("quotas:DeleteQuota", "cli"), 1, "{actions:?}");
    assert_eq!(count("quotas:UpdateQuota", "admin_token"), 1, "{actions:?}");
    assert_eq!(count("keys:CreateApiKey", "admin_token"), 1, "{actions:?}");
    assert_eq!(actions.len(), 7, "{actions:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A monitor quota never refuses; its breach writes one audit entry per
/// window (from the fold), read back through `GET /v1/audit` paged by cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_breach_is_audited_once_per_window() {
    monitor_audit(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_breach_is_audited_once_per_window_dev() {
    monitor_audit(Mode::Dev).await;
}

async fn monitor_audit(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    // The entry is written by the fold, from the request events' breaches,
    // to the audit outbox; the audit relay and folder beside the projector
    // bring it to the topic and the audit log.
    env.start_projector();
    let (pid, _, secret) = env.project_with_key(safe_timezone()).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "requests", "window": "day", "limit": 2, "mode": "monitor"}))
        .await;
    for i in 0..8 {
        let r = check(&env.http, env.gw(), &secret, json!({})).await;
        assert_eq!(r.status().as_u16(), 200, "monitor never refuses (check {i})");
    }
    let breaches = || async {
        let (s, log) = env.admin_get(&format!("/v1/audit?project_id={pid}")).await;
        assert_eq!(s, 200, "{log}");
        log["data"]
            .as_array()
            .expect("entries")
            .iter()
            .filter(|e| e["action"] == "quotas:MonitorBreach")
            .cloned()
            .collect::<Vec<Value>>()
    };
    env.eventually(30, "the monitor breach in the audit log", || async { !breaches().await.is_empty() }).await;
    // More breaching checks in the same window add nothing.
    for _ in 0..5 {
        assert_eq!(check(&env.http, env.gw(), &secret, json!({})).await.status().as_u16(), 200);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let found = breaches().await;
    assert_eq!(found.len(), 1, "once per window: {found:?}");
    let e = &found[0];
    assert_eq!(e["resource"], qid.as_str());
    assert_eq!((e["principal_type"].clone(), e["principal_id"].clone()), (Value::Null, Value::Null));
    let d = &e["detail"];
    assert_eq!(d["kind"], "quota_monitor_breach");
    assert_eq!(
        (d["metric"].clone(), d["window"].clone(), d["limit"].clone()),
        (json!("requests"), json!("day"), json!(2))
    );
    assert_eq!(d["observed_value"], 3, "the third request breached: {d}");
    assert_eq!(d["meter_type"], Value::Null);
    assert!(d["window_key"].as_str().is_some_and(|k| k.len() == 10), "a day key: {d}");

    // Paging: the key's creation, the quota's, then the breach; by cursor
    // and by page.
    env.audit_when(&pid, 30, "three entries", |e| e.len() >= 3).await;
    let (_, p1) = env.admin_get(&format!("/v1/audit?project_id={pid}&limit=1")).await;
    assert_eq!(p1["data"][0]["action"], "keys:CreateApiKey", "{p1}");
    assert_eq!(p1["data"][0]["principal_type"], "admin");
    let next = p1["next"].as_str().expect("a cursor").to_owned();
    let (_, p2) = env.admin_get(&format!("/v1/audit?project_id={pid}&limit=1&after={next}")).await;
    assert_eq!(p2["data"][0]["action"], "quotas:CreateQuota", "{p2}");
    assert_eq!(p2["data"][0]["principal_type"], "admin");
    let next = p2["next"].as_str().expect("a cursor").to_owned();
    let (_, p3) = env.admin_get(&format!("/v1/audit?project_id={pid}&limit=1&after={next}")).await;
    assert_eq!(p3["data"][0]["action"], "quotas:MonitorBreach", "{p3}");
    assert_eq!(p3["next"], Value::Null, "the last page: {p3}");
    let (_, by_page) = env.admin_get(&format!("/v1/audit?project_id={pid}&limit=1&page=3")).await;
    assert_eq!(by_page["data"], p3["data"]);
    for (q, field) in [
        ("limit=1000&page=11", "page"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("page=0", "page"),
        ("page=1&after=aud_1", "page"),
        ("after=a%20b", "after"),
        ("colour=red", "colour"),
    ] {
        let (s, b) = env.admin_get(&format!("/v1/audit?project_id={pid}&{q}")).await;
        assert_eq!(s, 400, "{q}: {b}");
        assert_eq!(b["error"]["code"], "INVALID_REQUEST");
        assert_eq!(b["error"]["meta"]["field"], field, "{q}: {b}");
    }
    let (_, b) = env.admin_get(&format!("/v1/audit?project_id={pid}&limit=1000&page=11")).await;
    assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains("after")), "names the cursor: {b}");
    let (s, _) = env.admin_get("/v1/audit").await;
    assert_eq!(s, 400);
    let r =
        env.http.get(format!("{}/v1/audit?project_id={pid}", env.gw())).bearer_auth(GATEWAY).send().await.expect("req");
    assert_eq!(r.status().as_u16(), 401, "admin only");
}

/// `DELETE /v1/api-keys/{id}`: the key stops authenticating; a quota naming
/// it goes inert but stays visible and deletable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_key_leaves_an_inert_quota() {
    inert_quota(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_key_leaves_an_inert_quota_dev() {
    inert_quota(Mode::Dev).await;
}

async fn inert_quota(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, secret) = env.project_with_key("UTC").await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 5}))
        .await;
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(q["inert"], false, "{q}");
    assert_eq!(check(&env.http, env.gw(), &secret, json!({})).await.status().as_u16(), 200);

    let (s, b) = env.admin_req(reqwest::Method::DELETE, &format!("/v1/api-keys/{kid}"), None).await;
    assert_eq!(s, 204, "{b}");
    let (s, _) = env.admin_req(reqwest::Method::DELETE, &format!("/v1/api-keys/{kid}"), None).await;
    assert_eq!(s, 404, "already deleted");
    let (s, _) = env.admin_req(reqwest::Method::DELETE, "/v1/api-keys/key_nope", None).await;
    assert_eq!(s, 404);
    let (s, _) = env.admin_get(&format!("/v1/api-keys/{kid}")).await;
    assert_eq!(s, 404);
    env.eventually(5, "the deleted key refused", || async {
        check(&env.http, env.gw(), &secret, json!({})).await.status().as_u16() == 401
    })
    .await;

    let (s, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(s, 200, "still visible: {q}");
    assert_eq!(q["inert"], true, "{q}");
    assert_eq!(q["current_usage"], Value::Null, "{q}");
    let (_, list) = env.admin_get(&format!("/v1/quotas?project_id={pid}")).await;
    assert_eq!(list["data"][0]["inert"], true, "{list}");
    // A new quota cannot name the deleted key.
    let (s, b) = env
        .admin_post("/v1/quotas", json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "requests", "window": "day", "limit": 5}))
        .await;
    assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!("scope_ref")), "{b}");
    // Still deletable.
    let (s, _) = env.admin_req(reqwest::Method::DELETE, &format!("/v1/quotas/{qid}"), None).await;
    assert_eq!(s, 204);
    let (s, _) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    assert_eq!(s, 404);
    let log = env.audit_when(&pid, 30, "four entries", |e| e.len() >= 4).await;
    let actions: Vec<&str> = log.iter().filter_map(|e| e["action"].as_str()).collect();
    assert_eq!(
        actions,
        ["keys:CreateApiKey", "quotas:CreateQuota", "keys:DeleteApiKey", "quotas:DeleteQuota"],
        "{log:?}"
    );
}

/// `/metrics` on the gateway and the projector (and `tollgate dev`), in the
/// Prometheus text format, counting what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_in_prometheus_text() {
    metrics(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_in_prometheus_text_dev() {
    metrics(Mode::Dev).await;
}

async fn metrics(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    env.start_projector();
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    env.quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 2}))
        .await;
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(check(&env.http, env.gw(), &secret, json!({})).await.status().as_u16());
        }
        v
    };
    assert_eq!(statuses, [200, 200, 429]);
    let (s, _) = post_events(&env.http, env.gw(), vec![call_event("m-1", &pid, &kid, None, 3)]).await;
    assert_eq!(s, 202);
    env.eventually(30, "the event folded", || async { env.durable(&pid, "p", "day").await.1 == 1 }).await;

    let text = |url: String| {
        let http = env.http.clone();
        async move {
            let r = http.get(url).send().await.expect("metrics request");
            assert_eq!(r.status().as_u16(), 200);
            assert!(
                r.headers()["content-type"].to_str().is_ok_and(|c| c.starts_with("text/plain")),
                "{:?}",
                r.headers()
            );
            r.text().await.expect("metrics body")
        }
    };
    let sample = |body: &str, name: &str| -> f64 {
        body.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    };
    let gw = text(format!("{}/metrics", env.gw())).await;
    assert_eq!(sample(&gw, "tollgate_checks_total{verdict=\"admitted\"}"), 2.0, "{gw}");
    assert_eq!(sample(&gw, "tollgate_checks_total{verdict=\"refused\"}"), 1.0, "{gw}");
    assert_eq!(sample(&gw, "tollgate_check_seconds_count"), 3.0, "{gw}");
    assert!(gw.contains("# TYPE tollgate_check_seconds histogram"), "{gw}");
    assert_eq!(sample(&gw, "tollgate_events_accepted_total"), 1.0, "{gw}");
    // The projector's own numbers: in-process under dev, on its own port otherwise.
    let proj_url = match mode {
        Mode::Distributed => env.projector_metrics.clone().expect("a projector was started"),
        Mode::Dev => format!("{}/metrics", env.gw()),
    };
    env.eventually(10, "the fold counted in the projector's metrics", || {
        let body = text(proj_url.clone());
        async move { sample(&body.await, "tollgate_projector_events_total{result=\"folded\"}") >= 1.0 }
    })
    .await;
    // Its lag per partition, sampled from the log's ends: every partition
    // it holds, caught up once the fold is (the requests' events too).
    env.eventually(20, "every partition's lag sampled at 0", || {
        let body = text(proj_url.clone());
        async move {
            let body = body.await;
            let lags: Vec<&str> =
                body.lines().filter(|l| l.starts_with("tollgate_projector_partition_lag_offsets{")).collect();
            !lags.is_empty() && lags.iter().all(|l| l.ends_with(" 0"))
        }
    })
    .await;
}
