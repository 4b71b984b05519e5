//! The console's server time per page, for a project with 1,000 API keys.
//!
//! Each backend gets one project with 1,000 keys (made through
//! `POST /v1/projects/{id}/api-keys`), a calls-per-day quota on the whole
//! project, one on all keys together, and one on each of 20 keys, 5
//! folded events per key (what the usage page groups), 10 checks on each
//! of the first 100 keys (so the bars have something to show), a
//! webhook endpoint, and a signed-in console session. Every console page
//! is then rendered through `gateway::app(..)` in this process (`oneshot`,
//! no sockets: the time is the server's alone, from request to the last
//! byte of the body), 3 times to warm up and then `RENDERS` times; the
//! report gives the median and the slowest render of each page.
//!
//! Backends: PostgreSQL with the Redis view (the distributed deployment;
//! skipped when either does not answer), and the embedded one (SQLite and
//! the in-memory view, as in `tollgate dev`). Both with a no-op log: no
//! page publishes anything.
//!
//! Run it with `cargo bench --bench console` (or `scripts/bench`). Under
//! `cargo test --all-targets` it returns at once. It never asserts: it
//! prints a markdown report and writes it to `target/bench-console.md`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use gateway::state::SystemClock;
use gateway::{AppState, Settings};
use serde_json::{Value, json};
use store::{MemoryView, PgStore, RedisView, SqliteStore};
use tower::ServiceExt;

mod support;
use support::{AnyResult, NullLog, bench_main, loadavg};

const ADMIN: &str = "admin-token-bench";
const GATEWAY: &str = "gateway-token-bench";
/// Keys in the project.
const KEYS: usize = 1_000;
/// Keys with a quota of their own.
const OWN_QUOTAS: usize = 20;
/// Keys with checks on them, and checks on each.
const BUSY_KEYS: usize = 100;
const CHECKS: usize = 10;
/// Events folded for each key.
const FOLDED: usize = 5;
/// Measured renders of each page (after 3 to warm up).
const RENDERS: usize = 20;

fn main() {
    bench_main("console", run);
}

/// One request through the app: the status and the body.
async fn send(app: &axum::Router, req: Request<Body>) -> AnyResult<(StatusCode, Vec<u8>)> {
    let res = app.clone().oneshot(req).await?;
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), 64 << 20).await?;
    Ok((status, body.to_vec()))
}

async fn api(app: &axum::Router, token: &str, uri: &str, body: Value) -> AnyResult<Value> {
    let req = Request::post(uri)
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))?;
    let (status, body) = send(app, req).await?;
    if !status.is_success() {
        return Err(format!("{uri}: {status} {}", String::from_utf8_lossy(&body)).into());
    }
    Ok(serde_json::from_slice(&body)?)
}

/// Folds `FOLDED` call events for each key (a token use on every tenth),
/// spread over the day so far, as the projector would.
async fn fold_usage(ledger: &dyn meter::Ledger, pid: &str, keys: &[(String, String)]) -> AnyResult<()> {
    let project = meter::ProjectId::parse(pid)?;
    let now = chrono::Utc::now();
    let mut facts = Vec::new();
    for (i, (kid, _)) in keys.iter().enumerate() {
        for n in 0..FOLDED {
            let at = now - chrono::Duration::minutes(((i * FOLDED + n) % 600) as i64);
            let mut f = meter::UsageFact {
                api_key_id: Some(meter::ApiKeyId::parse(kid.clone())?),
                rows: 10,
                outcome: meter::Outcome::Success,
                ..meter::UsageFact::new(
                    meter::EventId::parse(format!("f-{i}-{n}"))?,
                    project.clone(),
                    meter::EventKind::Call,
                    at,
                )
            };
            if n == 0 && i % 10 == 0 {
                f.kind = meter::EventKind::Tokens;
                f.tokens = vec![meter::TokenUsage {
                    provider: "openai".into(),
                    model: "gpt-4o".into(),
                    input: 1000,
                    output: 100,
                    ..meter::TokenUsage::default()
                }];
            }
            facts.push(f);
        }
    }
    for (n, chunk) in facts.chunks(500).enumerate() {
        let batch = meter::FoldBatch {
            consumer: "projector".into(),
            topic: "tollgate.usage".into(),
            offsets: vec![meter::OffsetMove { partition: 0, from: (n * 500) as i64, to: ((n + 1) * 500) as i64 }],
            facts: chunk.to_vec(),
            ..meter::FoldBatch::default()
        };
        ledger.fold_batch(&batch).await?;
    }
    Ok(())
}

/// The project, its keys, quotas, usage and webhook; the console pages to render.
async fn populate(app: &axum::Router, ledger: &dyn meter::Ledger) -> AnyResult<Vec<(&'static str, String)>> {
    let p = api(app, ADMIN, "/v1/projects", json!({"name": "thousand keys", "timezone": "Europe/Paris"})).await?;
    let pid = p["id"].as_str().ok_or("project id")?.to_owned();
    let mut keys = Vec::with_capacity(KEYS);
    for i in 0..KEYS {
        let k =
            api(app, ADMIN, &format!("/v1/projects/{pid}/api-keys"), json!({"name": format!("key-{i:04}")})).await?;
        keys.push((k["id"].as_str().ok_or("key id")?.to_owned(), k["secret"].as_str().ok_or("secret")?.to_owned()));
    }
    let quota = |scope: &str, scope_ref: Option<&str>, limit: u64| json!({"project_id": pid, "scope": scope, "scope_ref": scope_ref, "metric": "calls", "window": "day", "limit": limit});
    let q = api(app, ADMIN, "/v1/quotas", quota("project", None, 1_000_000)).await?;
    let quota_id = q["id"].as_str().ok_or("quota id")?.to_owned();
    api(app, ADMIN, "/v1/quotas", quota("api_key", None, 10_000)).await?;
    for (kid, _) in keys.iter().take(OWN_QUOTAS) {
        api(app, ADMIN, "/v1/quotas", quota("api_key", Some(kid), 18)).await?;
    }
    fold_usage(ledger, &pid, &keys).await?;
    for (_, secret) in keys.iter().take(BUSY_KEYS) {
        for _ in 0..CHECKS {
            api(app, GATEWAY, "/v1/check", json!({"api_key": secret})).await?;
        }
    }
    let w = api(
        app,
        ADMIN,
        &format!("/v1/projects/{pid}/webhooks"),
        json!({"url": "https://hooks.example.com/tollgate", "event_types": ["*"]}),
    )
    .await?;
    let wid = w["id"].as_str().ok_or("webhook id")?.to_owned();
    let base = format!("/console/projects/{pid}");
    let kid = &keys[0].0;
    Ok(vec![
        ("projects", "/console".to_owned()),
        ("project (1,000 keys with bars)", base.clone()),
        ("key", format!("{base}/keys/{kid}")),
        ("quotas", format!("{base}/quotas")),
        ("quota (chart)", format!("{base}/quotas/{quota_id}")),
        ("usage by key", format!("{base}/usage?group_by=api_key")),
        ("breaches", format!("{base}/breaches")),
        ("audit trail", format!("{base}/audit")),
        ("exceptions", format!("{base}/exceptions")),
        ("webhooks", format!("{base}/webhooks")),
        ("webhook deliveries", format!("{base}/webhooks/{wid}")),
        ("exports", format!("{base}/exports")),
        ("pipeline health", "/console/health".to_owned()),
    ])
}

/// Per page: (name, median ms, slowest ms, body bytes).
type Rows = Vec<(&'static str, f64, f64, usize)>;

async fn measure(state: AppState) -> AnyResult<Rows> {
    let cookie = format!(
        "tollgate_console={}",
        gateway::console::session::new_session(&state, meter::Clock::now(&*state.clock))
    );
    let ledger = state.stores.ledger.clone();
    let app = gateway::app(state);
    let pages = populate(&app, &*ledger).await?;
    let mut rows = Vec::new();
    for (name, uri) in pages {
        let mut ms = Vec::with_capacity(RENDERS);
        let mut bytes = 0;
        for i in 0..RENDERS + 3 {
            let req = Request::get(&uri).header("cookie", &cookie).body(Body::empty())?;
            let t = Instant::now();
            let (status, body) = send(&app, req).await?;
            let took = t.elapsed().as_secs_f64() * 1000.0;
            if status != StatusCode::OK {
                return Err(format!("{uri}: {status}").into());
            }
            bytes = body.len();
            if i >= 3 {
                ms.push(took);
            }
        }
        ms.sort_by(f64::total_cmp);
        rows.push((name, ms[ms.len() / 2], ms[ms.len() - 1], bytes));
    }
    Ok(rows)
}

fn settings() -> Settings {
    Settings::new(ADMIN, GATEWAY)
}

async fn run() -> AnyResult<()> {
    let load_before = loadavg();
    let mut sections = Vec::new();

    if testkit::available(&[testkit::Service::Postgres, testkit::Service::Redis]) {
        let db = testkit::TestDb::new("tg_bench_console").await;
        let keys = testkit::RedisPrefix {
            url: testkit::env::redis_url(),
            prefix: format!("tgbench:console:{}:", testkit::unique_id()),
        };
        let store = PgStore::connect(&db.url).await?;
        store.migrate().await?;
        let view = RedisView::connect(&keys.url, &keys.prefix).await?;
        let state =
            AppState::new(Arc::new(store), Arc::new(view), Arc::new(NullLog), Arc::new(SystemClock), settings());
        eprintln!("console: PostgreSQL and Redis");
        sections.push(("PostgreSQL + Redis view", measure(state).await?));
    }

    let dir = std::env::temp_dir().join(format!("tollgate-bench-console-{}", testkit::unique_id()));
    std::fs::create_dir_all(&dir)?;
    let store = SqliteStore::open(&dir.join("t.db")).await?;
    store.migrate().await?;
    let state = AppState::new(
        Arc::new(store),
        Arc::new(MemoryView::new()),
        Arc::new(NullLog),
        Arc::new(SystemClock),
        settings(),
    );
    eprintln!("console: embedded");
    let embedded = measure(state).await;
    let _ = std::fs::remove_dir_all(&dir);
    sections.push(("embedded (SQLite + memory view)", embedded?));

    let load_after = loadavg();
    let mut report = format!(
        "## Console pages for a project with {KEYS} keys\n\n\
         `cargo bench --bench console`: server time of each page through `gateway::app` in-process \
         (request to the last byte of the body, no sockets), median and slowest of {RENDERS} renders after 3 \
         to warm up; {KEYS} keys, {} calls-per-day quotas ({OWN_QUOTAS} on single keys), {CHECKS} checks on each of \
         {BUSY_KEYS} keys, {FOLDED} events folded for each key (a tenth of the keys with a token use). Load average before {load_before}, after {load_after}.\n",
        OWN_QUOTAS + 2
    );
    for (name, rows) in &sections {
        report.push_str(&format!("\n### {name}\n\n| page | median | slowest | body |\n|---|---:|---:|---:|\n"));
        for (page, median, slowest, bytes) in rows {
            report.push_str(&format!("| {page} | {median:.1} ms | {slowest:.1} ms | {} KiB |\n", bytes / 1024));
        }
    }
    println!("\n{report}");
    let target =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    let path = std::path::Path::new(&target).join("bench-console.md");
    match std::fs::write(&path, &report) {
        Ok(()) => eprintln!("console: report written to {}", path.display()),
        Err(e) => eprintln!("console: could not write {}: {e}", path.display()),
    }
    Ok(())
}
