//! Notification benchmark: how long a breach takes to reach a webhook
//! receiver, and how fast the notifier delivers, against baselines measured
//! in the same run (DESIGN §8, §12).
//!
//! The gateway (PostgreSQL, Kafka, an in-memory view), the projector and
//! the notifier (production settings: a 250 ms poll, 32 deliveries at once)
//! run in this process; the receiver is a local axum server that answers
//! 204 and notes when each message arrived.
//!
//! - **Latency, breach → delivery received**: `PROJECTS` projects, each with
//!   a `calls` quota of 1 a day and an endpoint subscribed to
//!   `quota.exceeded`. One project at a time, two calls are settled through
//!   `POST /v1/events` (the second passes the limit, whatever "reached"
//!   means); the clock starts at the settle's 202 and stops when the
//!   receiver has the project's `quota.exceeded`. The baseline is the
//!   receiver's own round trip (a plain POST of the same size).
//! - **Delivery throughput**: `DELIVERIES` `webhook.test` messages enqueued
//!   at once for one endpoint, timed until the receiver has them all,
//!   against a plain client posting the same bodies with the notifier's
//!   concurrency.
//!
//! Run it with `cargo bench --bench notify` (services up, as `scripts/test`
//! starts them) or `scripts/bench`. Under `cargo test --all-targets` it
//! returns at once. It prints a markdown report and writes it to
//! `target/bench-notify.md`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use gateway::state::SystemClock;
use gateway::{AppState, Settings};
use meter::webhook::Notification;
use meter::{Clock, MessageId, WebhookId, WebhookStore};
use projector::notify::{Notifier, NotifierConfig};
use serde_json::{Value, json};
use store::{KafkaConfig, KafkaLog, KafkaReader, MemoryView, PgStore};

mod support;
use support::{AnyResult, Latency, Rate, bench_main, loadavg, ms, sequential, serve, throughput};

const ADMIN: &str = "admin-token-bench";
const GATEWAY: &str = "gateway-token-bench";

/// Breaches timed, one after another.
const PROJECTS: usize = 100;
/// The pause between two breaches (so each is timed alone, not queued).
const PACE: Duration = Duration::from_millis(100);
/// Messages of the throughput run.
const DELIVERIES: usize = 2_000;
/// Sequential plain POSTs of the latency baseline.
const RAW_N: usize = 1_000;

fn main() {
    bench_main("notify", run);
}

/// What the receiver saw: each message id once, with its type, its
/// project (from `data.project_id`) and when it arrived.
#[derive(Clone, Default)]
struct Inbox {
    got: Arc<Mutex<HashMap<String, Arrival>>>,
}

/// One message at the receiver: (type, project, when).
type Arrival = (String, String, Instant);

impl Inbox {
    /// When the `quota.exceeded` of each project arrived.
    fn exceeded(&self) -> HashMap<String, Instant> {
        let got = self.got.lock().map(|g| g.clone()).unwrap_or_default();
        got.into_values().filter(|(t, _, _)| t == "quota.exceeded").map(|(_, p, at)| (p, at)).collect()
    }

    fn count(&self, kind: &str) -> usize {
        self.got.lock().map(|g| g.values().filter(|(t, _, _)| t == kind).count()).unwrap_or(0)
    }
}

async fn receive(State(inbox): State<Inbox>, headers: HeaderMap, body: axum::body::Bytes) -> StatusCode {
    let at = Instant::now();
    let Some(id) = headers.get("webhook-id").and_then(|v| v.to_str().ok()) else {
        return StatusCode::NO_CONTENT;
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let kind = v["type"].as_str().unwrap_or("").to_owned();
    let project = v["data"]["project_id"].as_str().unwrap_or("").to_owned();
    if let Ok(mut got) = inbox.got.lock() {
        got.entry(id.to_owned()).or_insert((kind, project, at));
    }
    StatusCode::NO_CONTENT
}

async fn api(http: &reqwest::Client, url: &str, token: &str, body: Value) -> AnyResult<Value> {
    let r = http.post(url).bearer_auth(token).json(&body).send().await?;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        return Err(format!("POST {url}: {status} {v}").into());
    }
    Ok(v)
}

struct Results {
    load_before: String,
    load_after: String,
    raw_post: Latency,
    breach: Latency,
    breaches_missing: usize,
    exceeded_sent: usize,
    raw_rate: Rate,
    notify_rate: Rate,
}

async fn run() -> AnyResult<()> {
    let load_before = loadavg();
    let db = testkit::TestDb::new("tg_bench_notify").await;
    let kafka = KafkaConfig::new(testkit::env::kafka(), testkit::topic_prefix("tgbench-notify"));
    let mut delay = Duration::from_millis(200);
    for attempt in 0.. {
        match kafka.ensure_topics().await {
            Ok(()) => break,
            Err(e) if attempt < 10 => {
                eprintln!("notify: topics not ready ({e}); retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(3));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let store = PgStore::connect(&db.url).await?;
    store.migrate().await?;
    let store = Arc::new(store);
    let view = Arc::new(MemoryView::new());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let mut settings = Settings::new(ADMIN, GATEWAY);
    settings.webhook_allow_private = true;
    let state = AppState::new(store.clone(), view.clone(), Arc::new(KafkaLog::new(&kafka)?), clock.clone(), settings);
    let gw = serve(gateway::app(state)).await?;

    let inbox = Inbox::default();
    let hook =
        format!("{}/hook", serve(axum::Router::new().route("/hook", post(receive)).with_state(inbox.clone())).await?);

    // The projector and the notifier, as `tollgate serve --notify` runs them.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let consumer = format!("bench-notify-{}", uuid::Uuid::new_v4().simple());
    let mut config = projector::ProjectorConfig::new(kafka.usage_topic());
    config.consumer = consumer.clone();
    let mut p =
        projector::Projector::new(KafkaReader::new(&kafka, &consumer)?, store.clone(), view, clock.clone(), config);
    let mut stop_p = stopped.clone();
    let fold = tokio::spawn(async move {
        p.start().await?;
        p.run(async move {
            let _ = stop_p.wait_for(|s| *s).await;
        })
        .await
    });
    let notifier = Notifier::new(
        store.clone(),
        clock.clone(),
        NotifierConfig { allow_private: true, ..NotifierConfig::default() },
    )?;
    let mut stop_n = stopped.clone();
    let deliver = tokio::spawn(async move {
        notifier
            .run(async move {
                let _ = stop_n.wait_for(|s| *s).await;
            })
            .await
    });

    let http = reqwest::Client::new();
    // --- baseline: the receiver's own round trip ---
    // A body of the same size as an alert's, under a type of its own so the
    // receiver does not count it as one.
    let sample = json!({"type": "bench.baseline", "timestamp": "2026-12-01T00:00:00.000Z",
        "data": {"quota_id": "quota_x", "project_id": "proj_x", "limit": 1, "observed_value": 2}})
    .to_string();
    let raw_post = sequential(100, RAW_N, || {
        let (http, hook, body) = (http.clone(), hook.clone(), sample.clone());
        async move {
            let id = format!("msg_raw{}", uuid::Uuid::new_v4().simple());
            http.post(&hook).header("webhook-id", id).body(body).send().await.is_ok_and(|r| r.status().is_success())
        }
    })
    .await;

    // --- latency: breach → delivery received ---
    let mut keys = Vec::with_capacity(PROJECTS);
    for i in 0..PROJECTS {
        let p =
            api(&http, &format!("{gw}/v1/projects"), ADMIN, json!({"name": format!("bench{i}"), "timezone": "UTC"}))
                .await?;
        let pid = p["id"].as_str().ok_or("project id")?.to_owned();
        let k = api(&http, &format!("{gw}/v1/projects/{pid}/api-keys"), ADMIN, json!({"name": "bench"})).await?;
        let kid = k["id"].as_str().ok_or("key id")?.to_owned();
        api(
            &http,
            &format!("{gw}/v1/quotas"),
            ADMIN,
            json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 1}),
        )
        .await?;
        api(
            &http,
            &format!("{gw}/v1/projects/{pid}/webhooks"),
            ADMIN,
            json!({"url": hook, "event_types": ["quota.exceeded"]}),
        )
        .await?;
        keys.push((pid, kid));
    }
    eprintln!("notify: {PROJECTS} projects ready; timing breaches");
    let mut sent: HashMap<String, Instant> = HashMap::new();
    for (n, (pid, kid)) in keys.iter().enumerate() {
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let events: Vec<Value> = (0..2)
            .map(|c| {
                json!({"id": format!("bench-{n}-{c}"), "type": "call", "project_id": pid, "api_key_id": kid,
                            "occurred_at": now, "outcome": "success"})
            })
            .collect();
        api(&http, &format!("{gw}/v1/events"), GATEWAY, json!({"events": events})).await?;
        sent.insert(pid.clone(), Instant::now());
        tokio::time::sleep(PACE).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while inbox.exceeded().len() < PROJECTS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A moment more, to see any second copy.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let arrived = inbox.exceeded();
    let us: Vec<f64> = sent
        .iter()
        .filter_map(|(p, t0)| arrived.get(p).map(|t1| t1.saturating_duration_since(*t0).as_secs_f64() * 1e6))
        .collect();
    let breaches_missing = PROJECTS - us.len();
    let breach = Latency::of(us, breaches_missing);
    let exceeded_sent = inbox.count("quota.exceeded");

    // --- throughput: the notifier against a plain client ---
    let raw_rate = throughput(NotifierConfig::default().batch, 3.0, {
        let (http, hook, body) = (http.clone(), hook.clone(), sample.clone());
        move || {
            let (http, hook, body) = (http.clone(), hook.clone(), body.clone());
            async move {
                let id = format!("msg_tput{}", uuid::Uuid::new_v4().simple());
                http.post(&hook).header("webhook-id", id).body(body).send().await.is_ok_and(|r| r.status().is_success())
            }
        }
    })
    .await;
    let (pid, _) = keys.first().ok_or("a project")?;
    let w = api(
        &http,
        &format!("{gw}/v1/projects/{pid}/webhooks"),
        ADMIN,
        json!({"url": hook, "event_types": ["webhook.test"]}),
    )
    .await?;
    let endpoint_id = WebhookId::parse(w["id"].as_str().ok_or("webhook id")?)?;
    let endpoint = store.endpoint(&endpoint_id).await?.ok_or("the endpoint")?;
    let before = inbox.count("webhook.test");
    let start = Instant::now();
    for _ in 0..DELIVERIES {
        let id = MessageId::parse(format!("msg_{}", uuid::Uuid::new_v4().simple()))?;
        store.enqueue(&Notification::test(id, &endpoint, clock.now()), Some(&endpoint_id)).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while inbox.count("webhook.test") - before < DELIVERIES && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let done = (inbox.count("webhook.test") - before) as u64;
    let notify_rate = Rate {
        per_sec: done as f64 / secs,
        done,
        errors: (DELIVERIES as u64).saturating_sub(done),
        secs,
        cpu_secs: None,
    };

    let _ = stop.send(true);
    fold.await??;
    deliver.await??;

    let r = Results {
        load_before,
        load_after: loadavg(),
        raw_post,
        breach,
        breaches_missing,
        exceeded_sent,
        raw_rate,
        notify_rate,
    };
    let report = report(&r);
    println!("{report}");
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    std::fs::write(format!("{target}/bench-notify.md"), &report)?;
    Ok(())
}

fn report(r: &Results) -> String {
    let ratio = r.notify_rate.per_sec / r.raw_rate.per_sec.max(1e-9);
    format!(
        "## Notifications (`cargo bench --bench notify`)\n\n\
         load average before {} / after {}\n\n\
         | measurement | p50 | p99 | n |\n|---|---|---|---|\n\
         | receiver round trip (plain POST, baseline) | {} | {} | {} |\n\
         | breach → `quota.exceeded` received | {} | {} | {} ({} missing, {} received) |\n\n\
         | throughput | per second | done | seconds |\n|---|---|---|---|\n\
         | plain client, {} at once (baseline) | {:.0} | {} | {:.2} |\n\
         | notifier, {} `webhook.test` messages | {:.0} | {} | {:.2} |\n\n\
         notifier / plain client: **{:.3}**\n",
        r.load_before,
        r.load_after,
        ms(r.raw_post.p50),
        ms(r.raw_post.p99),
        r.raw_post.n,
        ms(r.breach.p50),
        ms(r.breach.p99),
        r.breach.n,
        r.breaches_missing,
        r.exceeded_sent,
        NotifierConfig::default().batch,
        r.raw_rate.per_sec,
        r.raw_rate.done,
        r.raw_rate.secs,
        DELIVERIES,
        r.notify_rate.per_sec,
        r.notify_rate.done,
        r.notify_rate.secs,
        ratio,
    )
}
