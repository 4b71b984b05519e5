//! Hot-path benchmark: Tollgate's `/v1/check` and `/v1/events` against the
//! baselines DESIGN §8 names, measured as ratios in one run on one machine.
//!
//! Everything runs in this process on one tokio multi-thread runtime, against
//! the real services (PostgreSQL, Redis, a Kafka-protocol broker), with its
//! own database, Redis key prefix and topic prefix:
//!
//! - baseline A: `RedisView::check` (the check script) called directly,
//!   sequentially, and a plain Redis `PING` for reference;
//! - baseline B: an axum hello-world, driven by the same HTTP client as the
//!   check: sequential latency and 64-client throughput;
//! - `/v1/check` through `gateway::app` with the real adapters; its
//!   throughput and process CPU against hello-world's also interleaved (8
//!   pairs of 1-s slices, alternating, `support::interleave`), the ratio the
//!   machine's drift between two separate measurements does not move;
//! - baseline C: a raw rdkafka producer (the same configuration as
//!   `store::KafkaConfig::producer`) versus `/v1/events`.
//!
//! Run it with `scripts/bench` (or `cargo bench --bench hot_path` when the
//! services are up). Under `cargo test --all-targets` it returns at once.
//! To profile, `TOLLGATE_BENCH_PROFILE=check|hello` sets everything up,
//! then runs only that endpoint's 64 clients for
//! `TOLLGATE_BENCH_PROFILE_SECS` (default 20) after 1 s of warm-up, printing
//! the process's pid first, so that `perf record -p <pid>` sees only them.
//! It never asserts: it prints a markdown report and writes it to
//! `target/bench-report.md` (`target/bench-report-mimalloc.md` with
//! `--features mimalloc`, which puts the whole process on mimalloc).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use gateway::state::SystemClock;
use gateway::{AppState, Settings};
use meter::{
    ApiKeyId, EventId, EventKind, Hold, Ledger, Outcome, ProjectId, QuotaStore, ReservationId, Settlement, UsageFact,
    View,
};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use serde_json::{Value, json};
use store::{KafkaConfig, KafkaLog, PgStore, RedisView};

/// With `--features mimalloc`, the whole process (hello-world, the gateway,
/// the HTTP client and librdkafka's threads alike) allocates with mimalloc
/// instead of the system's, as `in_process` does.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The allocator this build runs on, as the report names it.
const ALLOCATOR: &str = if cfg!(feature = "mimalloc") { "mimalloc" } else { "system (glibc)" };

mod support;
use support::{
    AnyResult, Interleaved, Latency, NullLog, Rate, bench_main, interleave, loadavg, ms, sequential, serve, throughput,
};

const ADMIN: &str = "admin-token-bench";
const GATEWAY: &str = "gateway-token-bench";

/// Sequential round trips for the Redis baselines.
const REDIS_N: usize = 10_000;
/// Sequential HTTP requests per latency measurement (after warm-up).
const HTTP_N: usize = 5_000;
const HTTP_WARMUP: usize = 500;
/// Concurrent clients and duration of a throughput measurement.
const CLIENTS: usize = 64;
const THROUGHPUT_SECS: u64 = 5;
/// Records and events of the log measurements.
const EVENTS_N: usize = 50_000;
const EVENTS_BATCH: usize = 500;
const EVENTS_CLIENTS: usize = 4;
/// Checks watched on a MONITOR connection to count Redis commands per check.
const MONITOR_CHECKS: usize = 1_000;
/// `/v1/check` and hello-world interleaved: this many pairs of slices, each
/// slice this long.
const INTERLEAVED_PAIRS: usize = 8;
const SLICE_SECS: f64 = 1.0;

fn main() {
    bench_main("hot_path", run);
}

use testkit::env::{database_url as base_db, kafka as kafka_brokers, redis_url as base_redis};

/// A one-second warm-up, then the measured run.
async fn measured_throughput<F, Fut>(op: F) -> Rate
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    throughput(CLIENTS, 1.0, op.clone()).await;
    throughput(CLIENTS, THROUGHPUT_SECS as f64, op).await
}

/// One POST with the gateway token and a JSON body; true on a 2xx answer
/// whose body was read completely.
async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> bool {
    match http.post(url).bearer_auth(GATEWAY).json(body).send().await {
        Ok(r) => {
            let ok = r.status().is_success();
            r.bytes().await.is_ok() && ok
        }
        Err(_) => false,
    }
}

async fn admin_post(http: &reqwest::Client, url: &str, body: Value) -> AnyResult<Value> {
    let r = http.post(url).bearer_auth(ADMIN).json(&body).send().await?;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        return Err(format!("POST {url}: {status} {v}").into());
    }
    Ok(v)
}

/// A project with one key and a calls quota on it that is never reached.
async fn project_with_quota(http: &reqwest::Client, gw: &str, name: &str) -> AnyResult<(String, String, String)> {
    let p = admin_post(http, &format!("{gw}/v1/projects"), json!({"name": name, "timezone": "UTC"})).await?;
    let pid = p["id"].as_str().ok_or("project id")?.to_owned();
    let k = admin_post(http, &format!("{gw}/v1/projects/{pid}/api-keys"), json!({"name": "bench"})).await?;
    let kid = k["id"].as_str().ok_or("key id")?.to_owned();
    let secret = k["secret"].as_str().ok_or("secret")?.to_owned();
    admin_post(
        http,
        &format!("{gw}/v1/quotas"),
        json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day",
               "limit": 1_000_000_000_000i64}),
    )
    .await?;
    Ok((pid, kid, secret))
}

struct Results {
    load_before: String,
    load_after: String,
    ping: Latency,
    script: Latency,
    hello: Latency,
    check: Latency,
    hello_rate: Rate,
    check_rate: Rate,
    /// `/v1/check` and hello-world in alternating slices.
    check_interleaved: Interleaved,
    redis_cmds_per_check: Option<(f64, f64)>,
    script_rate: Rate,
    nolog_check: Latency,
    nolog_check_rate: Rate,
    settle_rate: Rate,
    record_bytes: usize,
    raw_pipelined: Rate,
    raw_batched: Rate,
    events: Rate,
    /// Records on the usage topic when the consumers started.
    log_records: u64,
    raw_consumer: Rate,
    replay: Rate,
    /// PostgreSQL commits in the bench database during the replay.
    replay_commits: i64,
    replay_folded: u64,
}

async fn run() -> AnyResult<()> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    eprintln!("hot_path: run {id}; {} worker threads", tokio::runtime::Handle::current().metrics().num_workers());

    // Own database, Redis prefix and topics, as the e2e harness does.
    let db = format!("tg_bench_{id}");
    let base = base_db();
    let admin_pool = sqlx::PgPool::connect(&base).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&admin_pool).await?;
    let db_url = match base.rfind('/') {
        Some(i) => format!("{}/{db}", &base[..i]),
        None => return Err(format!("database url without a path: {base}").into()),
    };
    let redis_prefix = format!("tgbench:{id}:");
    let topic_prefix = format!("tgbench.{id}.");

    let load_before = loadavg();
    let result = measure(&db_url, &redis_prefix, &topic_prefix).await.map(|r| {
        r.map(|mut r| {
            r.load_before = load_before;
            r.load_after = loadavg();
            r
        })
    });

    // Clean up what this run made (topics stay on the broker).
    if let Ok(client) = redis::Client::open(base_redis())
        && let Ok(mut conn) = client.get_multiplexed_async_connection().await
    {
        let mut cursor = 0u64;
        loop {
            let page: Result<(u64, Vec<String>), _> = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{redis_prefix}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await;
            let Ok((next, keys)) = page else { break };
            if !keys.is_empty() {
                let _: Result<(), _> = redis::cmd("UNLINK").arg(&keys).query_async(&mut conn).await;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
        .execute(&admin_pool)
        .await;
    admin_pool.close().await;

    // A profile run (`TOLLGATE_BENCH_PROFILE`) has no report.
    let Some(r) = result? else { return Ok(()) };
    let report = report(&r);
    println!("\n{report}");
    let dir =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    let name = if cfg!(feature = "mimalloc") { "bench-report-mimalloc.md" } else { "bench-report.md" };
    let path = std::path::Path::new(&dir).join(name);
    match std::fs::write(&path, &report) {
        Ok(()) => eprintln!("hot_path: report written to {}", path.display()),
        Err(e) => eprintln!("hot_path: could not write {}: {e}", path.display()),
    }
    Ok(())
}

/// Every measurement, or `None` after a profile run.
async fn measure(db_url: &str, redis_prefix: &str, topic_prefix: &str) -> AnyResult<Option<Results>> {
    // --- the gateway, with the real adapters ---
    let store = PgStore::connect(db_url).await?;
    store.migrate().await?;
    let store = Arc::new(store);
    let kafka = KafkaConfig::new(kafka_brokers(), topic_prefix);
    let mut delay = Duration::from_millis(200);
    for attempt in 0.. {
        match kafka.ensure_topics().await {
            Ok(()) => break,
            Err(e) if attempt < 10 => {
                eprintln!("hot_path: topics not ready ({e}); retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(3));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let view = Arc::new(RedisView::connect(&base_redis(), redis_prefix).await?);
    let log = KafkaLog::new(&kafka)?;
    let state =
        AppState::new(store.clone(), view.clone(), Arc::new(log), Arc::new(SystemClock), Settings::new(ADMIN, GATEWAY));
    let gw = serve(gateway::app(state)).await?;

    // --- baseline B: hello-world on the same runtime ---
    async fn hello() -> Json<Value> {
        Json(json!({"allowed": true}))
    }
    let hello_url = format!("{}/hello", serve(axum::Router::new().route("/hello", post(hello))).await?);

    // One client for every HTTP measurement.
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).tcp_nodelay(true).build()?;

    let (pid, kid, secret) = project_with_quota(&http, &gw, "bench-check").await?;
    let (view_pid, view_kid, _) = project_with_quota(&http, &gw, "bench-view").await?;

    if let Ok(which) = std::env::var("TOLLGATE_BENCH_PROFILE") {
        let url = match which.as_str() {
            "check" => check_url_of(&gw),
            "hello" => hello_url.clone(),
            other => return Err(format!("TOLLGATE_BENCH_PROFILE: {other:?} is not check or hello").into()),
        };
        let secs: u64 = std::env::var("TOLLGATE_BENCH_PROFILE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
        let body = json!({ "api_key": secret });
        let op = move || {
            let (h, u, b) = (http.clone(), url.clone(), body.clone());
            async move { post_json(&h, &u, &b).await }
        };
        support::throughput(CLIENTS, 1.0, op.clone()).await;
        eprintln!("hot_path: profiling {which}: pid {} for {secs} s", std::process::id());
        let rate = support::throughput(CLIENTS, secs as f64, op).await;
        eprintln!("hot_path: {which}: {:.0} req/s ({} in {:.2} s)", rate.per_sec, rate.done, rate.secs);
        return Ok(None);
    }

    // --- baseline A: Redis PING and the check script ---
    eprintln!("hot_path: Redis baselines ({REDIS_N} sequential each)");
    let redis_client = redis::Client::open(base_redis())?;
    let ping_conn = redis::aio::ConnectionManager::new(redis_client.clone()).await?;
    let ping = sequential(200, REDIS_N, || {
        let mut c = ping_conn.clone();
        async move { redis::cmd("PING").query_async::<String>(&mut c).await.is_ok() }
    })
    .await;

    let view_project = ProjectId::parse(view_pid)?;
    let view_key = ApiKeyId::parse(view_kid)?;
    let quotas = store.quotas(&view_project).await?;
    let totals = store.open_totals(&view_project, chrono::Utc::now()).await?;
    view.seed(&view_project, &meter::Seed::of_totals(totals), chrono::Utc::now()).await?;
    let script = {
        let (view, project, key, quotas) = (view.clone(), view_project.clone(), view_key.clone(), quotas.clone());
        sequential(200, REDIS_N, move || {
            let (view, project, key, quotas) = (view.clone(), project.clone(), key.clone(), quotas.clone());
            async move { script_check(&view, &project, &key, &quotas).await }
        })
        .await
    };

    // --- HTTP latency: hello-world, then /v1/check ---
    let check_url = check_url_of(&gw);
    let check_body = json!({ "api_key": secret });
    eprintln!("hot_path: hello-world latency ({HTTP_N} sequential)");
    let hello_lat = {
        let (h, u, b) = (http.clone(), hello_url.clone(), check_body.clone());
        sequential(HTTP_WARMUP, HTTP_N, move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };
    eprintln!("hot_path: /v1/check latency ({HTTP_N} sequential)");
    let check_lat = {
        let (h, u, b) = (http.clone(), check_url.clone(), check_body.clone());
        sequential(HTTP_WARMUP, HTTP_N, move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };

    // --- HTTP throughput ---
    eprintln!("hot_path: hello-world throughput ({CLIENTS} clients, {THROUGHPUT_SECS} s)");
    let hello_rate = {
        let (h, u, b) = (http.clone(), hello_url.clone(), check_body.clone());
        measured_throughput(move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };
    eprintln!("hot_path: /v1/check throughput ({CLIENTS} clients, {THROUGHPUT_SECS} s)");
    let check_rate = {
        let (h, u, b) = (http.clone(), check_url.clone(), check_body.clone());
        measured_throughput(move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };
    eprintln!("hot_path: /v1/check and hello-world interleaved ({INTERLEAVED_PAIRS} pairs of {SLICE_SECS} s slices)");
    let check_interleaved = {
        let op = |url: &String| {
            let (h, u, b) = (http.clone(), url.clone(), check_body.clone());
            move || {
                let (h, u, b) = (h.clone(), u.clone(), b.clone());
                async move { post_json(&h, &u, &b).await }
            }
        };
        // A pause before each slice lets the request events the checks
        // publish in the background go out before the next slice starts.
        let settle = async || {
            tokio::time::sleep(Duration::from_millis(100)).await;
            true
        };
        interleave(CLIENTS, INTERLEAVED_PAIRS, SLICE_SECS, op(&hello_url), op(&check_url), settle).await
    };
    // Let the background publishes of the checks' request events drain.
    tokio::time::sleep(Duration::from_secs(3)).await;

    // --- baseline C: raw producer, then /v1/events ---
    let project = ProjectId::parse(pid.clone())?;
    let key = ApiKeyId::parse(kid.clone())?;
    let sample = UsageFact {
        id: EventId::parse("bench-000000-00000")?,
        project_id: project.clone(),
        api_key_id: Some(key.clone()),
        agent_id: None,
        actor_id: None,
        user_id: None,
        occurred_at: chrono::Utc::now(),
        kind: EventKind::Call,
        outcome: Outcome::Success,
        rows: 1,
        tokens: Vec::new(),
        storage_bytes: None,
        meter_type: None,
        reservation_id: None,
        gateway: "gw-bench0".into(),
        received_at: Some(chrono::Utc::now()),
        ..UsageFact::new(EventId::parse("bench-000000-00000")?, project.clone(), EventKind::Call, chrono::Utc::now())
    };
    let payload = schemas::encode_usage(&sample)?;
    let record_bytes = payload.len();
    let producer = kafka.producer()?;
    let topic = kafka.usage_topic();
    let send = send_one;
    // Warm-up: metadata and connections.
    for _ in 0..100 {
        send(&producer, &topic, pid.as_str(), &payload).await;
    }
    eprintln!("hot_path: raw producer, {EVENTS_N} records of {record_bytes} bytes, all in flight");
    let raw_pipelined = {
        let start = Instant::now();
        let mut inflight: FuturesUnordered<_> =
            (0..EVENTS_N).map(|_| send(&producer, &topic, pid.as_str(), &payload)).collect();
        let (mut ok, mut bad) = (0u64, 0u64);
        while let Some(r) = inflight.next().await {
            if r { ok += 1 } else { bad += 1 }
        }
        let secs = start.elapsed().as_secs_f64();
        Rate { per_sec: ok as f64 / secs, done: ok, errors: bad, secs, cpu_secs: None }
    };
    eprintln!("hot_path: raw producer, {EVENTS_N} records in batches of {EVENTS_BATCH} from {EVENTS_CLIENTS} tasks");
    let raw_batched = {
        let producer = Arc::new(producer);
        let (payload, topic, key) = (Arc::new(payload), Arc::new(topic), Arc::new(pid.clone()));
        batched(move |_batch| {
            let (producer, payload, topic, key) = (producer.clone(), payload.clone(), topic.clone(), key.clone());
            async move {
                let sends = (0..EVENTS_BATCH).map(|_| send(&producer, &topic, &key, &payload));
                let oks = futures::future::join_all(sends).await;
                oks.iter().filter(|x| **x).count()
            }
        })
        .await
    };

    eprintln!(
        "hot_path: /v1/events, {EVENTS_N} call events in batches of {EVENTS_BATCH} from {EVENTS_CLIENTS} clients"
    );
    let events_url = format!("{gw}/v1/events");
    let event = |i: usize| {
        json!({
            "id": format!("bench-{i:06}"), "type": "call", "project_id": pid, "api_key_id": kid,
            "occurred_at": chrono::Utc::now().to_rfc3339(), "outcome": "success", "rows": 1,
        })
    };
    // Warm-up batch (ids outside the measured range).
    let warm: Vec<Value> = (0..EVENTS_BATCH).map(|i| event(EVENTS_N + i)).collect();
    post_json(&http, &events_url, &json!({ "events": warm })).await;
    let bodies: Arc<Vec<Value>> = Arc::new(
        (0..EVENTS_N / EVENTS_BATCH)
            .map(|b| json!({ "events": (0..EVENTS_BATCH).map(|i| event(b * EVENTS_BATCH + i)).collect::<Vec<_>>() }))
            .collect(),
    );
    let events = {
        let (h, u) = (http.clone(), events_url.clone());
        batched(move |b| {
            let (h, u, bodies) = (h.clone(), u.clone(), bodies.clone());
            async move { if post_json(&h, &u, &bodies[b]).await { EVENTS_BATCH } else { 0 } }
        })
        .await
    };

    // --- baseline D: a raw consumer, then the projector replaying the log ---
    let (log_records, raw_consumer) = raw_consume(&kafka).await?;
    eprintln!("hot_path: projector replay of {log_records} records from offset 0 (PostgreSQL + Redis)");
    let (replay, replay_commits, replay_folded) =
        replay_log(&kafka, db_url, store.clone(), view.clone(), log_records).await?;

    // --- diagnostics (not DESIGN targets): where the time goes ---
    eprintln!("hot_path: diagnostics: Redis commands per check (MONITOR, {MONITOR_CHECKS} checks)");
    let redis_cmds_per_check = {
        let (h, u, b) = (http.clone(), check_url.clone(), check_body.clone());
        commands_per_op(redis_prefix, MONITOR_CHECKS, move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };

    eprintln!("hot_path: diagnostics: check script throughput ({CLIENTS} tasks, {THROUGHPUT_SECS} s)");
    let script_rate = {
        let (view, project, key, quotas) = (view.clone(), view_project.clone(), view_key.clone(), quotas.clone());
        measured_throughput(move || {
            let (view, project, key, quotas) = (view.clone(), project.clone(), key.clone(), quotas.clone());
            async move { script_check(&view, &project, &key, &quotas).await }
        })
        .await
    };

    eprintln!("hot_path: diagnostics: /v1/check with a no-op log");
    let nolog_state = AppState::new(
        store.clone(),
        view.clone(),
        Arc::new(NullLog),
        Arc::new(SystemClock),
        Settings::new(ADMIN, GATEWAY),
    );
    let nolog_url = format!("{}/v1/check", serve(gateway::app(nolog_state)).await?);
    let nolog_check = {
        let (h, u, b) = (http.clone(), nolog_url.clone(), check_body.clone());
        sequential(HTTP_WARMUP, HTTP_N, move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };
    let nolog_check_rate = {
        let (h, u, b) = (http.clone(), nolog_url.clone(), check_body.clone());
        measured_throughput(move || {
            let (h, u, b) = (h.clone(), u.clone(), b.clone());
            async move { post_json(&h, &u, &b).await }
        })
        .await
    };

    eprintln!("hot_path: diagnostics: settle script, {EVENTS_N} call facts in batches of {EVENTS_BATCH}");
    let settle_rate = {
        let (view, project, key) = (view.clone(), view_project.clone(), view_key.clone());
        batched(move |b| {
            let (view, project, key) = (view.clone(), project.clone(), key.clone());
            async move {
                let now = chrono::Utc::now();
                let settlements: Vec<Settlement> = (0..EVENTS_BATCH)
                    .map(|i| {
                        let fact = UsageFact {
                            id: EventId::parse(format!("settle-{:06}", b * EVENTS_BATCH + i)).expect("event id"),
                            project_id: project.clone(),
                            api_key_id: Some(key.clone()),
                            agent_id: None,
                            actor_id: None,
                            user_id: None,
                            occurred_at: now,
                            kind: EventKind::Call,
                            outcome: Outcome::Success,
                            rows: 1,
                            tokens: Vec::new(),
                            storage_bytes: None,
                            meter_type: None,
                            reservation_id: None,
                            gateway: "gw-bench0".into(),
                            ..UsageFact::new(
                                EventId::parse("settle").expect("event id"),
                                project.clone(),
                                EventKind::Call,
                                now,
                            )
                        };
                        let deltas =
                            meter::usage::counters_for(&fact, chrono_tz::Tz::UTC, &meter::PriceBook::default())
                                .into_iter()
                                .filter(|(c, _)| c.resets_at.is_none_or(|r| r > now))
                                .collect();
                        Settlement { event: fact.id, reservation: None, deltas }
                    })
                    .collect();
                if view.settle(&project, &settlements, now).await.is_ok() { EVENTS_BATCH } else { 0 }
            }
        })
        .await
    };

    Ok(Some(Results {
        load_before: String::new(),
        load_after: String::new(),
        script_rate,
        nolog_check,
        nolog_check_rate,
        settle_rate,
        ping,
        script,
        hello: hello_lat,
        check: check_lat,
        hello_rate,
        check_rate,
        check_interleaved,
        redis_cmds_per_check,
        record_bytes,
        raw_pipelined,
        raw_batched,
        events,
        log_records,
        raw_consumer,
        replay,
        replay_commits,
        replay_folded,
    }))
}

/// Reads the whole usage topic from offset 0 with a plain rdkafka consumer
/// (the same client settings as the projector's reader), counting records.
async fn raw_consume(kafka: &KafkaConfig) -> AnyResult<(u64, Rate)> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::{Offset, TopicPartitionList};
    let topic = kafka.usage_topic();
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .set("group.id", format!("bench-raw-{}", uuid::Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "20")
        .create()?;
    let md = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
    let partitions: Vec<i32> =
        md.topics().iter().filter(|t| t.name() == topic).flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
    let mut total = 0u64;
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        let (_, high) = consumer.fetch_watermarks(&topic, *p, Duration::from_secs(10))?;
        total += u64::try_from(high).unwrap_or(0);
        tpl.add_partition_offset(&topic, *p, Offset::Offset(0))?;
    }
    consumer.assign(&tpl)?;
    eprintln!("hot_path: raw consumer, {total} records from offset 0");
    let start = Instant::now();
    let mut read = 0u64;
    while read < total {
        match tokio::time::timeout(Duration::from_secs(10), consumer.recv()).await {
            Ok(Ok(_)) => read += 1,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => break,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok((total, Rate { per_sec: read as f64 / secs, done: read, errors: total - read, secs, cpu_secs: None }))
}

/// Replays the usage topic from offset 0 through the projector into the
/// bench database and the view (a consumer name of its own, so it starts at
/// 0): the time until it has read every record, and the commits it made.
async fn replay_log(
    kafka: &KafkaConfig,
    db_url: &str,
    store: Arc<PgStore>,
    view: Arc<RedisView>,
    total: u64,
) -> AnyResult<(Rate, i64, u64)> {
    let commits = || async {
        let pool = sqlx::PgPool::connect(db_url).await?;
        let n: (i64,) = sqlx::query_as("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        Ok::<i64, sqlx::Error>(n.0)
    };
    let reader = store::KafkaReader::new(kafka, &format!("bench-replay-{}", uuid::Uuid::new_v4().simple()))?;
    let mut config = projector::ProjectorConfig::new(kafka.usage_topic());
    config.consumer = format!("bench-replay-{}", uuid::Uuid::new_v4().simple());
    let mut p = projector::Projector::new(reader, store, view, Arc::new(SystemClock), config);
    // pg_stat counters are flushed lazily; wait a little so the baseline is settled.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = commits().await?;
    let start = Instant::now();
    p.start().await?;
    // Until every record is read, or 20 polls in a row (4 s) bring none: a
    // poll that comes back empty while the consumer fetches the next batch
    // from the broker is no sign of the end.
    let (mut read, mut folded, mut idle) = (0u64, 0u64, 0);
    while read < total && idle < 20 {
        let r = p.step().await?;
        idle = if r.read == 0 { idle + 1 } else { 0 };
        read += r.read as u64;
        folded += r.folded as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = commits().await?;
    Ok((
        Rate { per_sec: read as f64 / secs, done: read, errors: total.saturating_sub(read), secs, cpu_secs: None },
        after - before,
        folded,
    ))
}

fn check_url_of(gw: &str) -> String {
    format!("{gw}/v1/check")
}

/// One call of the check script, planned as the gateway plans it.
async fn script_check(view: &RedisView, project: &ProjectId, key: &ApiKeyId, quotas: &[meter::Quota]) -> bool {
    let now = chrono::Utc::now();
    let plan = meter::plan_check(
        quotas,
        chrono_tz::Tz::UTC,
        &meter::CheckInput { caller: meter::Caller::key(key, None), storage_delta: None, ..Default::default() },
        now,
    );
    let hold = Hold {
        reservation: ReservationId::parse(gateway::state::new_id("res")).expect("reservation id"),
        request_event: EventId::parse(gateway::state::new_id("req")).expect("event id"),
        lease_until: now + chrono::Duration::seconds(60),
    };
    matches!(view.check(project, &plan, &hold, now).await, Ok(Some(o)) if o.admitted)
}

/// Redis commands naming `prefix` per call of `op`, counted on a MONITOR
/// connection over `n` sequential calls (other clients do not count):
/// (commands the clients sent, commands scripts ran inside Redis).
async fn commands_per_op<F, Fut>(prefix: &str, n: usize, mut op: F) -> Option<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let url = base_redis();
    let rest = url.strip_prefix("redis://")?;
    let hostport = rest.split('/').next()?.rsplit('@').next()?.to_owned();
    let mut stream = tokio::net::TcpStream::connect(hostport).await.ok()?;
    stream.write_all(b"MONITOR\r\n").await.ok()?;
    let mut lines = BufReader::new(stream).lines();
    if !lines.next_line().await.ok()??.starts_with("+OK") {
        return None;
    }
    let needle = prefix.to_owned();
    let client = Arc::new(AtomicU64::new(0));
    let script = Arc::new(AtomicU64::new(0));
    let reader = {
        let (client, script) = (client.clone(), script.clone());
        tokio::spawn(async move {
            // `<time> [<db> <addr>] "cmd" ...`; commands run by a script show `[<db> lua]`.
            while let Ok(Some(l)) = lines.next_line().await {
                if l.contains(&needle) {
                    if l.contains(" lua] ") { &script } else { &client }.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    for _ in 0..n {
        op().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    reader.abort();
    let per = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 / n as f64;
    Some((per(&client), per(&script)))
}

/// One record through the producer; true once the broker acknowledged it.
async fn send_one(producer: &FutureProducer, topic: &str, key: &str, payload: &[u8]) -> bool {
    producer
        .send(FutureRecord::to(topic).key(key).payload(payload), Timeout::After(Duration::from_secs(30)))
        .await
        .is_ok()
}

/// `EVENTS_N / EVENTS_BATCH` batches taken by `EVENTS_CLIENTS` tasks; `op`
/// returns how many of its batch succeeded.
async fn batched<F, Fut>(op: F) -> Rate
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = usize> + Send,
{
    let batches = EVENTS_N / EVENTS_BATCH;
    let next = Arc::new(AtomicUsize::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..EVENTS_CLIENTS {
        let (op, next, ok) = (op.clone(), next.clone(), ok.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let b = next.fetch_add(1, Ordering::Relaxed);
                if b >= batches {
                    break;
                }
                ok.fetch_add(op(b).await as u64, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = start.elapsed().as_secs_f64();
    let done = ok.load(Ordering::Relaxed);
    Rate { per_sec: done as f64 / secs, done, errors: EVENTS_N as u64 - done, secs, cpu_secs: None }
}

fn lat_row(name: &str, what: &str, l: &Latency) -> String {
    let err = if l.errors > 0 { format!(" ({} errors)", l.errors) } else { String::new() };
    format!("| {name} | {what} | {} | {} | n = {}{err} |\n", ms(l.p50), ms(l.p99), l.n)
}

fn rate_row(name: &str, what: &str, r: &Rate, unit: &str) -> String {
    let err = if r.errors > 0 { format!(", {} errors", r.errors) } else { String::new() };
    format!("| {name} | {what} | {:.0} {unit}/s | | {} in {:.2} s{err} |\n", r.per_sec, r.done, r.secs)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "**met**" } else { "**not met**" }
}

fn report(r: &Results) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{} worker threads; allocator: {ALLOCATOR}; load average {} before, {} after (anything else running skews every number)\n\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        r.load_before,
        r.load_after
    ));
    s.push_str("### Raw measurements\n\n");
    s.push_str("| Measurement | What | p50 / rate | p99 | Notes |\n|---|---|---|---|---|\n");
    s.push_str(&lat_row("Redis PING", "round trip, sequential", &r.ping));
    s.push_str(&lat_row("A: Redis check script", "`RedisView::check`, sequential", &r.script));
    s.push_str(&lat_row("B: hello-world", "HTTP POST, sequential", &r.hello));
    s.push_str(&lat_row("`/v1/check`", "HTTP POST, sequential", &r.check));
    s.push_str(&rate_row("B: hello-world", &format!("{CLIENTS} concurrent clients"), &r.hello_rate, "req"));
    s.push_str(&rate_row("`/v1/check`", &format!("{CLIENTS} concurrent clients"), &r.check_rate, "req"));
    s.push_str(&rate_row(
        "C: raw producer",
        &format!("{EVENTS_N} × {} B records, all in flight", r.record_bytes),
        &r.raw_pipelined,
        "rec",
    ));
    s.push_str(&rate_row(
        "C': raw producer",
        &format!("{EVENTS_N} records, batches of {EVENTS_BATCH} from {EVENTS_CLIENTS} tasks"),
        &r.raw_batched,
        "rec",
    ));
    s.push_str(&rate_row(
        "`/v1/events`",
        &format!("{EVENTS_N} call events, batches of {EVENTS_BATCH} from {EVENTS_CLIENTS} clients"),
        &r.events,
        "ev",
    ));
    s.push_str(&rate_row(
        "D: raw consumer",
        &format!("{} records of the usage topic from offset 0", r.log_records),
        &r.raw_consumer,
        "rec",
    ));
    s.push_str(&rate_row(
        "projector replay",
        &format!(
            "the same records, decoded, deduplicated, folded into PostgreSQL and Redis ({} folded)",
            r.replay_folded
        ),
        &r.replay,
        "rec",
    ));

    s.push_str("\n### DESIGN §8 targets\n\n| Target | Measured | Bound | Result |\n|---|---|---|---|\n");
    let bound = r.hello.p99 + 2.0 * r.script.p99 + 500.0;
    s.push_str(&format!(
        "| check p99 ≤ hello p99 + 2 × script p99 + 0.5 ms | {} | {} ({} + 2 × {} + 0.5 ms) | {} |\n",
        ms(r.check.p99),
        ms(bound),
        ms(r.hello.p99),
        ms(r.script.p99),
        verdict(r.check.p99 <= bound)
    ));
    let tput = r.check_rate.per_sec / r.hello_rate.per_sec;
    s.push_str(&format!(
        "| check throughput ≥ 0.35 × hello-world | {tput:.3} ({:.0} / {:.0} req/s) | 0.35 | {} |\n",
        r.check_rate.per_sec,
        r.hello_rate.per_sec,
        verdict(tput >= 0.35)
    ));
    let i = &r.check_interleaved;
    let (lo, hi) = i.pair_range();
    s.push_str(&format!(
        "| the same, interleaved ({INTERLEAVED_PAIRS} pairs of {SLICE_SECS}-s slices, in equal time) | {:.3} ({:.0} / \
         {:.0} req/s; pairs {lo:.3}–{hi:.3}) | 0.35 | {} |\n",
        i.ratio(),
        i.side(1).0,
        i.side(0).0,
        verdict(i.ratio() >= 0.35)
    ));
    // The process holds the clients, the gateway and the producer; the
    // broker, Redis and PostgreSQL are processes of their own.
    match (r.check_rate.cpu_us_per_op(), r.hello_rate.cpu_us_per_op()) {
        (Some(check), Some(hello)) if hello > 0.0 => {
            let ratio = check / hello;
            s.push_str(&format!(
                "| process CPU per check ≤ 3 × hello-world's per request (issue 14; clients in both) | {ratio:.2} ({check:.0} / {hello:.0} µs user + system) | 3 | {} |\n",
                verdict(ratio <= 3.0)
            ));
        }
        _ => s.push_str(
            "| process CPU per check ≤ 3 × hello-world's per request | not measured (no /proc/self/stat) | 3 | - |\n",
        ),
    }
    if let Some(ratio) = i.cpu_ratio() {
        s.push_str(&format!("| the same, interleaved | {ratio:.2} | 3 | {} |\n", verdict(ratio <= 3.0)));
    }
    let publish = r.events.per_sec / r.raw_pipelined.per_sec;
    s.push_str(&format!(
        "| publish (`/v1/events`) ≥ 0.5 × raw producer | {publish:.3} ({:.0} / {:.0} per s) | 0.5 | {} |\n",
        r.events.per_sec,
        r.raw_pipelined.per_sec,
        verdict(publish >= 0.5)
    ));
    let replay = r.replay.per_sec / r.raw_consumer.per_sec;
    s.push_str(&format!(
        "| fold ≥ 0.5 × raw consumer | {replay:.3} ({:.0} / {:.0} rec/s; the projector over the backlog) | 0.5 | {} |\n",
        r.replay.per_sec,
        r.raw_consumer.per_sec,
        verdict(replay >= 0.5)
    ));
    s.push_str(&format!(
        "| replay ≥ 0.6 × raw consumer | {replay:.3} (the same run: {} records from offset 0 into an empty counter set) | 0.6 | {} |\n",
        r.log_records,
        verdict(replay >= 0.6)
    ));
    let per_event = r.replay_commits as f64 / r.replay_folded.max(1) as f64;
    s.push_str(&format!(
        "| no per-event PostgreSQL commit | {} commits for {} folded events ({per_event:.4} per event) | < 1 | {} |\n",
        r.replay_commits,
        r.replay_folded,
        verdict(per_event < 1.0)
    ));
    match r.redis_cmds_per_check {
        Some((c, inner)) => s.push_str(&format!(
            "| one Redis round trip per check | {c:.2} commands sent per check (MONITOR, {MONITOR_CHECKS} checks; \
             the script runs {inner:.1} commands inside Redis) | 1 | {} |\n",
            verdict((c - 1.0).abs() < 0.01)
        )),
        None => s.push_str("| one Redis round trip per check | not measured (MONITOR unavailable) | 1 | — |\n"),
    }

    s.push_str(
        "\n### Diagnostics (not targets)\n\n| Measurement | What | p50 / rate | p99 | Notes |\n|---|---|---|---|---|\n",
    );
    s.push_str(&rate_row(
        "Redis check script",
        &format!("`RedisView::check`, {CLIENTS} concurrent tasks"),
        &r.script_rate,
        "op",
    ));
    s.push_str(&lat_row("`/v1/check`, no-op log", "HTTP POST, sequential", &r.nolog_check));
    s.push_str(&rate_row(
        "`/v1/check`, no-op log",
        &format!("{CLIENTS} concurrent clients"),
        &r.nolog_check_rate,
        "req",
    ));
    s.push_str(&rate_row(
        "Redis settle script",
        &format!("`RedisView::settle`, {EVENTS_N} call facts, batches of {EVENTS_BATCH}, {EVENTS_CLIENTS} tasks"),
        &r.settle_rate,
        "ev",
    ));
    let batched = r.events.per_sec / r.raw_batched.per_sec;
    s.push_str(&format!(
        "\n`/v1/events` / raw producer driven in the same shape (C'): {batched:.3}. \
         `/v1/check` / hello-world with a no-op log: {:.3} throughput, p99 {} against the same bound.\n",
        r.nolog_check_rate.per_sec / r.hello_rate.per_sec,
        ms(r.nolog_check.p99),
    ));
    s
}
