//! In-process check: an axum service wrapped in [`gateway::TollgateLayer`]
//! over the embedded backends, against the same axum hello-world baseline as
//! `hot_path` (baseline B), measured in one run on one machine.
//!
//! Everything runs in this process on one tokio multi-thread runtime:
//!
//! - baseline: an axum `POST /hello` returning small JSON on `127.0.0.1:0`;
//! - the Layer: the same app under `TollgateLayer`, over
//!   [`gateway::embedded::Embedded`] (the SQLite store and log in two files
//!   in a fresh temporary directory, the in-memory view, the projector on a
//!   thread of its own), with a project, an API key and an enforce `calls`/`day` quota
//!   with a huge limit on that key, so every call is checked, reserved and
//!   settled (and its request and call events published);
//! - diagnostic: the same Layer with the Redis view (`RedisView` at
//!   `TOLLGATE_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`, under a key
//!   prefix of its own that is deleted afterwards); skipped when Redis does
//!   not answer;
//! - diagnostics, to see where the time goes: the same Layer with the SQLite
//!   files at `synchronous = NORMAL` instead of `FULL`; with the log's tables
//!   in the store's file (as the embedded log was before it had a file of
//!   its own); with the projector a task of the runtime serving the
//!   requests (as it was before session 20); with the SQLite log but no
//!   projector; and with a no-op log and no projector (the layer's own
//!   cost: identify, check, reserve and settle in the memory view).
//!
//! The same HTTP client (reqwest), body and headers drive every variant:
//! 5,000 sequential requests after 500 warm-up (p50, p99), then 64
//! concurrent clients for 5 s after a 1 s warm-up (requests/s). Before
//! each variant hello-world's throughput is measured again, the same way;
//! each variant's ratio is given against that one and against the median
//! of the run's hello-world measurements, since hello-world's throughput
//! alone moves by up to 2× within one run on this machine. Since session 26
//! the embedded Layer and the no-op-log Layer are also measured
//! **interleaved** with hello-world: 8 pairs of 1-s slices, alternating,
//! each pair in the other order from the one before, with the projector
//! let fold everything logged before each slice; their ratio in equal time
//! is the one the machine's drift does not move (`support::interleave`).
//! Since session 27 the two are then measured so again, each in a new
//! process of this benchmark (`TOLLGATE_BENCH_FRESH=layer|null_log` runs
//! only that, and prints its row): hello-world alone measured 46,000–53,000
//! req/s in a new process here and about 38,000 once the first Layer had
//! run, so the run's history could have been in the ratio.
//!
//! To profile one variant,
//! `TOLLGATE_BENCH_PROFILE=hello|layer|layer_task|sync_normal|no_projector|null_log`
//! runs only that one, its concurrent clients for
//! `TOLLGATE_BENCH_PROFILE_SECS` (default 20) and nothing else, so a
//! sampling profiler attached to the process (`perf record -g -p <pid>`)
//! sees only it; the process prints its pid first, and afterwards the
//! variant's sequential latency (p50, p99), measured as a full run does.
//! With `TOLLGATE_BENCH_PROFILE_COUNT=<n>` as well, it makes exactly `n`
//! sequential requests instead and nothing else, for an instruction count:
//! under `valgrind --tool=callgrind`, the difference of two counts' totals
//! over the difference of their requests is what one request costs,
//! whatever the set-up did, and the same for the same build and inputs
//! whatever else the machine runs.
//!
//! Run it with `cargo bench --bench in_process` (or `scripts/bench`). Under
//! `cargo test --all-targets` it returns at once. It never asserts: it prints
//! a markdown report and writes it to `target/bench-in-process.md`. With
//! `--features mimalloc` every allocation of the process (the baseline's,
//! the Layer's and the client's) goes to mimalloc instead of the system
//! allocator, and the report goes to `target/bench-in-process-mimalloc.md`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::routing::post;
use gateway::embedded::{Embedded, FoldThread};
use gateway::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
use gateway::state::{SystemClock, random_token};
use gateway::{AppState, Settings, TollgateLayer};
use meter::{Clock, Metric, PortError, PortResult, Principal, Store, View, WindowKind};
use projector::audit::{AuditFolder, AuditRelay};
use projector::{Projector, ProjectorConfig};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use store::{MemoryView, SqliteLog, SqliteLogReader, SqliteStore};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod support;
use support::{
    AnyResult, Interleaved, Latency, NullLog, Rate, bench_main, interleave, loadavg, ms, sequential, serve, throughput,
};

/// Sequential HTTP requests per latency measurement (after warm-up).
const HTTP_N: usize = 5_000;
const HTTP_WARMUP: usize = 500;
/// Concurrent clients, warm-up and duration of a throughput measurement.
const CLIENTS: usize = 64;
const THROUGHPUT_WARMUP_SECS: f64 = 1.0;
const THROUGHPUT_SECS: f64 = 5.0;
/// Interleaved throughput: this many pairs of slices, each slice this long
/// (after the variant's own measurements, with the same clients).
const INTERLEAVED_PAIRS: usize = 8;
const SLICE_SECS: f64 = 1.0;
/// The quota's limit: never reached, so every call is admitted.
const HUGE_LIMIT: u64 = 1_000_000_000_000;

/// With `--features mimalloc`, the whole process (hello-world, the Layer and
/// the HTTP client alike) allocates with mimalloc instead of the system's.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The allocator this build runs on, as the report names it.
const ALLOCATOR: &str = if cfg!(feature = "mimalloc") { "mimalloc" } else { "system (glibc)" };

fn main() {
    bench_main("in_process", run);
}

use testkit::env::redis_url as base_redis;

/// One POST of `body` with the key as `Authorization: Bearer`, the way the
/// layer reads it; true on a 2xx answer whose body was read completely.
async fn post_json(http: &reqwest::Client, url: &str, secret: &str, body: &Value) -> bool {
    match http.post(url).bearer_auth(secret).json(body).send().await {
        Ok(r) => {
            let ok = r.status().is_success();
            r.bytes().await.is_ok() && ok
        }
        Err(_) => false,
    }
}

/// The baseline handler: `hot_path`'s baseline B.
async fn hello() -> Json<Value> {
    Json(json!({"allowed": true}))
}

fn hello_app() -> axum::Router {
    axum::Router::new().route("/hello", post(hello))
}

/// One variant's numbers: latency, throughput, and what it wrote.
#[derive(Debug, Clone, Default)]
struct Variant {
    lat: Latency,
    rate: Rate,
    /// 2xx answers over every run of this variant, warm-ups included.
    answered: u64,
    /// Records in the SQLite log after the runs (a request and a call event
    /// per admitted call), when they could be counted.
    log_records: Option<i64>,
    /// Hello-world's throughput measured again just before this variant's
    /// (hello-world alone has moved between 34,000 and 72,000 req/s within
    /// one run here, so one measurement of it makes a poor baseline).
    hello_before: Option<Rate>,
    /// Its throughput and hello-world's, measured in alternating slices.
    interleaved: Option<Interleaved>,
}

/// Sequential latency, then throughput, of POST `url`.
async fn measure(http: &reqwest::Client, url: &str, secret: &str, body: &Value) -> Variant {
    let answered = Arc::new(AtomicU64::new(0));
    let op = {
        let (h, u, s, b, answered) = (http.clone(), url.to_owned(), secret.to_owned(), body.clone(), answered.clone());
        move || {
            let (h, u, s, b, answered) = (h.clone(), u.clone(), s.clone(), b.clone(), answered.clone());
            async move {
                let ok = post_json(&h, &u, &s, &b).await;
                if ok {
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                ok
            }
        }
    };
    eprintln!("in_process:   {HTTP_N} sequential (after {HTTP_WARMUP} warm-up)");
    let lat = sequential(HTTP_WARMUP, HTTP_N, op.clone()).await;
    eprintln!("in_process:   {CLIENTS} clients for {THROUGHPUT_SECS} s (after {THROUGHPUT_WARMUP_SECS} s warm-up)");
    throughput(CLIENTS, THROUGHPUT_WARMUP_SECS, op.clone()).await;
    let rate = throughput(CLIENTS, THROUGHPUT_SECS, op).await;
    Variant {
        lat,
        rate,
        answered: answered.load(Ordering::Relaxed),
        log_records: None,
        hello_before: None,
        interleaved: None,
    }
}

/// POSTs of `body` to `url` with `secret`, as an operation to time.
fn poster(
    http: &reqwest::Client,
    url: &str,
    secret: &str,
    body: &Value,
) -> impl Fn() -> Pin<Box<dyn Future<Output = bool> + Send>> + Clone + Send + Sync + 'static {
    let (h, u, s, b) = (http.clone(), url.to_owned(), secret.to_owned(), body.clone());
    move || {
        let (h, u, s, b) = (h.clone(), u.clone(), s.clone(), b.clone());
        Box::pin(async move { post_json(&h, &u, &s, &b).await })
    }
}

/// A read-only view of the embedded log's file with the store's attached:
/// enough to ask whether the projector has folded every usage record.
async fn fold_watch(log: &Path, store: &Path) -> AnyResult<SqlitePool> {
    let store = store.to_string_lossy().into_owned();
    let options = SqliteConnectOptions::new().filename(log).read_only(true);
    Ok(SqlitePoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            let store = store.clone();
            Box::pin(async move {
                sqlx::query("ATTACH DATABASE ? AS store").bind(store).execute(conn).await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await?)
}

/// Whether the projector's offsets (in the attached store) are past the
/// last usage record of every partition of the log; `None` if it cannot
/// be read.
async fn folded_all(watch: &SqlitePool) -> Option<bool> {
    let behind: i64 = sqlx::query_scalar(
        r#"SELECT count(*) FROM
             (SELECT "partition" AS p, max("offset") AS last FROM log_records
              WHERE topic = 'tollgate.usage' GROUP BY "partition") AS l
           WHERE l.last >= COALESCE((SELECT o.next_offset FROM store.consumer_offsets AS o
                                     WHERE o.consumer = 'tollgate-projector' AND o.topic = 'tollgate.usage'
                                       AND o."partition" = l.p), 0)"#,
    )
    .fetch_one(watch)
    .await
    .ok()?;
    Some(behind == 0)
}

/// Waits (up to 10 s) until the projector watched by `watch` has folded
/// every usage record logged so far; false if it had not by then.
async fn fold_caught_up(watch: &SqlitePool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while folded_all(watch).await != Some(true) {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    true
}

/// A project, an API key (its secret is returned) and an enforce `calls`
/// quota on that key that is never reached, through the provisioning service.
async fn project_with_quota(state: &AppState, name: &str) -> AnyResult<String> {
    let starter = Starter {
        project: NewProject { name: name.into(), timezone: chrono_tz::Tz::UTC },
        key: NewApiKey { name: "bench".into(), ..NewApiKey::default() },
        quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: HUGE_LIMIT }),
    };
    Ok(provisioning::provision(state, starter, &Principal::new("admin", "bench")).await?.secret)
}

/// One request through the layer, to see that it admits and meters before
/// anything is timed: a 2xx with the admission's `X-Quota-*` headers.
async fn probe(http: &reqwest::Client, url: &str, secret: &str, body: &Value) -> AnyResult<String> {
    let r = http.post(url).bearer_auth(secret).json(body).send().await?;
    let status = r.status();
    let quota: Vec<String> = r
        .headers()
        .iter()
        .filter(|(n, _)| n.as_str().starts_with("x-quota"))
        .map(|(n, v)| format!("{n}: {}", v.to_str().unwrap_or("?")))
        .collect();
    let text = r.text().await?;
    if !status.is_success() {
        return Err(format!("the layer answered {status}: {text}").into());
    }
    if quota.is_empty() {
        return Err("the layer answered without X-Quota-* headers: is the quota planned?".into());
    }
    Ok(quota.join(", "))
}

/// Records in the SQLite log of `path`, counted on a connection of our own.
async fn log_records(path: &Path) -> Option<i64> {
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(path).read_only(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options).await.ok()?;
    let n: Option<i64> = sqlx::query_scalar("SELECT COUNT(*) FROM log_records").fetch_one(&pool).await.ok();
    pool.close().await;
    n
}

/// What the layer runs on.
enum Backend {
    /// `Embedded::open`: the SQLite store and log, the in-memory view.
    Memory,
    /// `Embedded::open_with_view` with this view (Redis).
    View(Arc<dyn View>),
    /// Diagnostic: as `Embedded::open`, built by hand the same way, but the
    /// SQLite files with `synchronous = NORMAL` (no fsync per commit in WAL
    /// mode) instead of `FULL`: what durability costs.
    SyncNormal,
    /// Diagnostic: as `Embedded::open` was before the log had a file of its
    /// own: the log's tables in the store's file, so the log's group commit
    /// and the fold take turns at one write lock.
    OneFile,
    /// Diagnostic: as `Embedded::open` was before session 20: the projector
    /// a task of the runtime that serves the requests, not on a thread of
    /// its own.
    SharedRuntime,
    /// Diagnostic: as `Embedded::open` (`synchronous = FULL`) but without
    /// the projector: what its folds, writing to the same file, cost.
    NoProjector,
    /// Diagnostic: the SQLite store and the in-memory view with a log that
    /// keeps nothing, and no projector: the layer's own cost.
    NullLog,
}

/// A running backend, to stop once measured.
enum Running {
    Embedded(Box<Embedded>),
    Projector(FoldThread),
    Task(oneshot::Sender<()>, JoinHandle<PortResult<()>>),
    Nothing,
}

impl Running {
    async fn stop(self) {
        let r = match self {
            Running::Embedded(e) => e.shutdown().await,
            Running::Projector(folding) => folding.stop().await,
            Running::Task(stop, task) => {
                let _ = stop.send(());
                task.await.unwrap_or_else(|e| Err(PortError::Permanent(format!("projector task: {e}"))))
            }
            Running::Nothing => Ok(()),
        };
        if let Err(e) = r {
            eprintln!("in_process: projector stopped with an error: {e}");
        }
    }
}

/// The SQLite pool of `SqliteStore::open`, with `synchronous` as given.
async fn sqlite_pool(path: &Path, synchronous: SqliteSynchronous) -> AnyResult<SqlitePool> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(synchronous)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(10));
    Ok(SqlitePoolOptions::new()
        .test_before_acquire(false)
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await?)
}

/// The file the log of `backend` over the data file `path` is in.
fn log_file(path: &Path, backend: &Backend) -> PathBuf {
    match backend {
        Backend::OneFile => path.to_owned(),
        _ => gateway::embedded::log_path(path),
    }
}

/// Starts `backend` on the SQLite file at `path`.
async fn start(path: &Path, backend: Backend) -> AnyResult<(AppState, Running)> {
    let mut settings = Settings::new(random_token(32), random_token(32));
    settings.instance = format!("bench-{}", random_token(6));
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    Ok(match backend {
        Backend::Memory => {
            let e = Embedded::open(path, settings, clock).await?;
            (e.state.clone(), Running::Embedded(Box::new(e)))
        }
        Backend::View(view) => {
            let e = Embedded::open_with_view(path, settings, clock, view).await?;
            (e.state.clone(), Running::Embedded(Box::new(e)))
        }
        Backend::SyncNormal | Backend::OneFile | Backend::SharedRuntime => {
            // What `Embedded::open_with_view` does, on pools of our own.
            let synchronous = match backend {
                Backend::SyncNormal => SqliteSynchronous::Normal,
                _ => SqliteSynchronous::Full,
            };
            let store = SqliteStore::from_pool(sqlite_pool(path, synchronous).await?);
            store.migrate().await?;
            let log_pool = match backend {
                Backend::OneFile => store.pool().clone(),
                _ => sqlite_pool(&log_file(path, &backend), synchronous).await?,
            };
            let log = SqliteLog::new(log_pool, "tollgate.");
            log.ensure_schema().await?;
            let reader = log.reader();
            let topic = log.usage_topic().to_owned();
            let store: Arc<dyn Store> = Arc::new(store);
            let view: Arc<dyn View> = Arc::new(MemoryView::new());
            let state = AppState::new(store.clone(), view.clone(), Arc::new(log), clock.clone(), settings);
            let projector = Projector::new(reader, store, view, clock, ProjectorConfig::new(topic));
            if let Backend::SharedRuntime = backend {
                let (stop, stopped) = oneshot::channel::<()>();
                let task = tokio::spawn(projector.run(async move {
                    let _ = stopped.await;
                }));
                (state, Running::Task(stop, task))
            } else {
                let none: Option<(AuditRelay, AuditFolder<SqliteLogReader>)> = None;
                (state, Running::Projector(FoldThread::spawn(projector, none)?))
            }
        }
        Backend::NoProjector => {
            let store = SqliteStore::open(path).await?;
            store.migrate().await?;
            let log = gateway::embedded::open_log(path).await?;
            let view: Arc<dyn View> = Arc::new(MemoryView::new());
            (AppState::new(Arc::new(store), view, Arc::new(log), clock, settings), Running::Nothing)
        }
        Backend::NullLog => {
            let store = SqliteStore::open(path).await?;
            store.migrate().await?;
            let state = AppState::new(Arc::new(store), Arc::new(MemoryView::new()), Arc::new(NullLog), clock, settings);
            (state, Running::Nothing)
        }
    })
}

/// A Tollgate on `backend` in `path`, the hello-world app under its layer,
/// and the measurements of it (and the admission headers of a probe).
///
/// With `hello` (hello-world's URL and the key it is sent), its throughput
/// is then also measured interleaved with hello-world's ([`interleave`]).
async fn layered(
    http: &reqwest::Client,
    path: &Path,
    backend: Backend,
    body: &Value,
    hello: Option<(&str, &str)>,
) -> AnyResult<(Variant, String)> {
    let log_path = log_file(path, &backend);
    let folds = matches!(backend, Backend::Memory | Backend::View(_));
    let (state, running) = start(path, backend).await?;
    let secret = project_with_quota(&state, "bench-in-process").await?;
    let url = format!("{}/hello", serve(hello_app().layer(TollgateLayer::new(state))).await?);
    let headers = probe(http, &url, &secret, body).await?;
    let mut v = measure(http, &url, &secret, body).await;
    if let Some((hello_url, hello_secret)) = hello {
        eprintln!("in_process:   interleaved with hello-world, {INTERLEAVED_PAIRS} pairs of {SLICE_SECS} s slices");
        let watch = if folds { Some(fold_watch(&log_path, path).await?) } else { None };
        let (h, l) = (poster(http, hello_url, hello_secret, body), poster(http, &url, &secret, body));
        let settle = async || match &watch {
            Some(w) => fold_caught_up(w).await,
            None => true,
        };
        let i = interleave(CLIENTS, INTERLEAVED_PAIRS, SLICE_SECS, h, l, settle).await;
        v.answered += i.done[1];
        v.interleaved = Some(i);
        if let Some(w) = watch {
            w.close().await;
        }
    }
    v.answered += 1; // the probe
    // Let the background request-event publishes drain, then stop the projector.
    tokio::time::sleep(Duration::from_secs(2)).await;
    v.log_records = log_records(&log_path).await;
    running.stop().await;
    Ok((v, headers))
}

/// Deletes every key under `prefix`.
async fn delete_prefix(prefix: &str) {
    let Ok(client) = redis::Client::open(base_redis()) else { return };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else { return };
    let mut cursor = 0u64;
    loop {
        let page: Result<(u64, Vec<String>), _> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
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

/// The Redis view, or why it is not there.
async fn redis_view(prefix: &str) -> Result<Arc<dyn View>, String> {
    let url = base_redis();
    let ping = async {
        let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
        let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
        redis::cmd("PING").query_async::<String>(&mut conn).await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(3), ping).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(format!("Redis at {url} does not answer: {e}")),
        Err(_) => return Err(format!("Redis at {url} does not answer within 3 s")),
    }
    match store::RedisView::connect(&url, prefix).await {
        Ok(v) => Ok(Arc::new(v)),
        Err(e) => Err(format!("RedisView at {url}: {e}")),
    }
}

struct Results {
    load_before: String,
    load_after: String,
    workers: usize,
    dir: PathBuf,
    hello: Variant,
    layer: Variant,
    layer_headers: String,
    redis: Result<Variant, String>,
    sync_normal: Variant,
    one_file: Variant,
    shared_runtime: Variant,
    no_projector: Variant,
    null_log: Variant,
    /// The embedded and no-op-log Layers interleaved with hello-world, each
    /// in a fresh process ([`fresh`]): their report rows, or why not.
    fresh: Vec<(&'static str, Result<String, String>)>,
}

/// The HTTP client of every measurement, a random key shaped like the keys
/// Tollgate issues (hello-world is sent the same), and hot_path's check body
/// with it; the key itself goes in `Authorization: Bearer`.
fn client() -> AnyResult<(reqwest::Client, String, Value)> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).tcp_nodelay(true).build()?;
    let secret_shape = format!("tg_{}", random_token(40));
    let body = json!({ "api_key": secret_shape });
    Ok((http, secret_shape, body))
}

/// Set to `layer` or `null_log`, the process measures only that Layer
/// interleaved with hello-world and prints its report row ([`fresh`]).
const FRESH_ENV: &str = "TOLLGATE_BENCH_FRESH";
/// What the row printed by [`fresh`] begins with.
const FRESH_MARK: &str = "FRESH\t";

/// The report row of [`fresh`]`(which)`, run in a new process of this
/// benchmark: a full run's variants leave state behind them (servers,
/// pooled connections, views, a larger heap), and hello-world alone has
/// measured about a quarter slower after the first Layer than before it.
async fn in_own_process(which: &str) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this benchmark's path: {e}"))?;
    let out = tokio::process::Command::new(exe)
        .arg("--bench")
        .env(FRESH_ENV, which)
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .map_err(|e| format!("could not run it: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix(FRESH_MARK)) {
        Some(row) if out.status.success() => Ok(format!("{row}\n")),
        _ => Err(format!("it printed no result ({})", out.status)),
    }
}

/// Measures one Layer (`layer`: embedded; `null_log`: the no-op log) and
/// hello-world interleaved, in this process and nothing else before them
/// but a warm-up of each; prints the report row after [`FRESH_MARK`].
async fn fresh(which: &str) -> AnyResult<()> {
    let (backend, name) = match which {
        "layer" => (Backend::Memory, LAYER),
        "null_log" => (Backend::NullLog, NULL_LOG),
        other => return Err(format!("{FRESH_ENV}: {other:?} is not layer or null_log").into()),
    };
    let (http, secret_shape, body) = client()?;
    let dir = std::env::temp_dir().join(format!("tollgate-bench-fresh-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("fresh.db");
    let log_path = log_file(&path, &backend);
    let folds = matches!(backend, Backend::Memory);
    let hello_url = format!("{}/hello", serve(hello_app()).await?);
    let (state, running) = start(&path, backend).await?;
    let secret = project_with_quota(&state, "bench-fresh").await?;
    let url = format!("{}/hello", serve(hello_app().layer(TollgateLayer::new(state))).await?);
    let (h, l) = (poster(&http, &hello_url, &secret_shape, &body), poster(&http, &url, &secret, &body));
    throughput(CLIENTS, THROUGHPUT_WARMUP_SECS, h.clone()).await;
    throughput(CLIENTS, THROUGHPUT_WARMUP_SECS, l.clone()).await;
    let watch = if folds { Some(fold_watch(&log_path, &path).await?) } else { None };
    let settle = async || match &watch {
        Some(w) => fold_caught_up(w).await,
        None => true,
    };
    let i = interleave(CLIENTS, INTERLEAVED_PAIRS, SLICE_SECS, h, l, settle).await;
    println!("{FRESH_MARK}{}", interleaved_row(name, &i).trim_end());
    if let Some(w) = watch {
        w.close().await;
    }
    running.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

async fn run() -> AnyResult<()> {
    if let Ok(which) = std::env::var("TOLLGATE_BENCH_PROFILE") {
        return profile(&which).await;
    }
    if let Ok(which) = std::env::var(FRESH_ENV) {
        return fresh(&which).await;
    }
    let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    eprintln!("in_process: run {id}; {workers} worker threads");
    let load_before = loadavg();

    let dir = std::env::temp_dir().join(format!("tollgate-bench-{id}"));
    std::fs::create_dir_all(&dir)?;
    let redis_prefix = format!("tgbench-inproc:{id}:");
    let result = measure_all(&dir, &redis_prefix, workers, load_before).await;
    delete_prefix(&redis_prefix).await;
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        eprintln!("in_process: could not remove {}: {e}", dir.display());
    }

    let mut r = result?;
    for (which, name) in [("layer", LAYER), ("null_log", NULL_LOG)] {
        eprintln!("in_process: {name}, interleaved with hello-world in a process of its own");
        r.fresh.push((name, in_own_process(which).await));
    }
    let report = report(&r);
    println!("\n{report}");
    let target =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    let name = if cfg!(feature = "mimalloc") { "bench-in-process-mimalloc.md" } else { "bench-in-process.md" };
    let path = Path::new(&target).join(name);
    match std::fs::write(&path, &report) {
        Ok(()) => eprintln!("in_process: report written to {}", path.display()),
        Err(e) => eprintln!("in_process: could not write {}: {e}", path.display()),
    }
    Ok(())
}

/// Runs one variant's concurrent clients for a while, for a profiler.
async fn profile(which: &str) -> AnyResult<()> {
    let secs: f64 = std::env::var("TOLLGATE_BENCH_PROFILE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20.0);
    let (http, secret_shape, body) = client()?;
    let dir = std::env::temp_dir().join(format!("tollgate-bench-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let backend = match which {
        "hello" => None,
        "layer" => Some(Backend::Memory),
        "null_log" => Some(Backend::NullLog),
        "layer_task" => Some(Backend::SharedRuntime),
        "sync_normal" => Some(Backend::SyncNormal),
        "no_projector" => Some(Backend::NoProjector),
        other => {
            return Err(format!(
                "TOLLGATE_BENCH_PROFILE: {other:?} is not hello, layer, layer_task, sync_normal, no_projector or null_log"
            )
            .into());
        }
    };
    let (url, secret, running) = match backend {
        None => (format!("{}/hello", serve(hello_app()).await?), secret_shape.clone(), Running::Nothing),
        Some(b) => {
            let (state, running) = start(&dir.join("profile.db"), b).await?;
            let secret = project_with_quota(&state, "bench-profile").await?;
            (format!("{}/hello", serve(hello_app().layer(TollgateLayer::new(state))).await?), secret, running)
        }
    };
    let op = poster(&http, &url, &secret, &body);
    if let Some(n) = std::env::var("TOLLGATE_BENCH_PROFILE_COUNT").ok().and_then(|s| s.parse::<usize>().ok()) {
        let lat = sequential(0, n, op).await;
        eprintln!("in_process: {which}: {} sequential requests, {} errors", lat.n, lat.errors);
        running.stop().await;
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(());
    }
    let op_latency = op.clone();
    throughput(CLIENTS, THROUGHPUT_WARMUP_SECS, op.clone()).await;
    eprintln!("in_process: profiling {which}: pid {} for {secs} s", std::process::id());
    let rate = throughput(CLIENTS, secs, op).await;
    eprintln!(
        "in_process: {which}: {:.0} req/s ({} in {:.2} s, {} errors)",
        rate.per_sec, rate.done, rate.secs, rate.errors
    );
    // Then the sequential latency, as a full run measures it.
    let lat = sequential(HTTP_WARMUP, HTTP_N, op_latency).await;
    eprintln!(
        "in_process: {which}: sequential p50 {:.3} ms, p99 {:.3} ms ({} requests, {} errors)",
        lat.p50 / 1e3,
        lat.p99 / 1e3,
        lat.n,
        lat.errors
    );
    running.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

async fn measure_all(dir: &Path, redis_prefix: &str, workers: usize, load_before: String) -> AnyResult<Results> {
    // One client for every HTTP measurement, as in hot_path.
    let (http, secret_shape, body) = client()?;

    eprintln!("in_process: hello-world");
    let hello_url = format!("{}/hello", serve(hello_app()).await?);
    let hello = measure(&http, &hello_url, &secret_shape, &body).await;

    // Hello-world's throughput again, just before each variant's.
    let hello_again = async || {
        eprintln!("in_process:   hello-world again, {CLIENTS} clients for {THROUGHPUT_SECS} s");
        let op = poster(&http, &hello_url, &secret_shape, &body);
        throughput(CLIENTS, THROUGHPUT_WARMUP_SECS, op.clone()).await;
        throughput(CLIENTS, THROUGHPUT_SECS, op).await
    };
    let interleaved = Some((hello_url.as_str(), secret_shape.as_str()));
    let with_hello = |before: Rate, (mut v, headers): (Variant, String)| {
        v.hello_before = Some(before);
        (v, headers)
    };

    eprintln!("in_process: TollgateLayer over the embedded view (SQLite store and log, in-memory view)");
    let before = hello_again().await;
    let (layer, layer_headers) =
        with_hello(before, layered(&http, &dir.join("memory.db"), Backend::Memory, &body, interleaved).await?);

    eprintln!("in_process: diagnostics: TollgateLayer with the Redis view (SQLite store and log)");
    let redis = match redis_view(redis_prefix).await {
        Ok(view) => {
            let before = hello_again().await;
            layered(&http, &dir.join("redis.db"), Backend::View(view), &body, None)
                .await
                .map(|v| with_hello(before, v).0)
                .map_err(|e| e.to_string())
        }
        Err(why) => Err(why),
    };
    if let Err(why) = &redis {
        eprintln!("in_process: Redis variant skipped: {why}");
    }

    eprintln!("in_process: diagnostics: TollgateLayer, in-memory view, SQLite with synchronous = NORMAL");
    let before = hello_again().await;
    let (sync_normal, _) =
        with_hello(before, layered(&http, &dir.join("normal.db"), Backend::SyncNormal, &body, None).await?);

    eprintln!("in_process: diagnostics: TollgateLayer, in-memory view, the log in the store's file");
    let before = hello_again().await;
    let (one_file, _) =
        with_hello(before, layered(&http, &dir.join("onefile.db"), Backend::OneFile, &body, None).await?);

    eprintln!("in_process: diagnostics: TollgateLayer, in-memory view, the projector a task of the serving runtime");
    let before = hello_again().await;
    let (shared_runtime, _) =
        with_hello(before, layered(&http, &dir.join("task.db"), Backend::SharedRuntime, &body, None).await?);

    eprintln!("in_process: diagnostics: TollgateLayer, in-memory view, SQLite log, no projector");
    let before = hello_again().await;
    let (no_projector, _) =
        with_hello(before, layered(&http, &dir.join("noproj.db"), Backend::NoProjector, &body, None).await?);

    eprintln!("in_process: diagnostics: TollgateLayer, in-memory view, no-op log");
    let before = hello_again().await;
    let (null_log, _) =
        with_hello(before, layered(&http, &dir.join("nulllog.db"), Backend::NullLog, &body, interleaved).await?);

    Ok(Results {
        load_before,
        load_after: loadavg(),
        workers,
        dir: dir.to_owned(),
        hello,
        layer,
        layer_headers,
        redis,
        sync_normal,
        one_file,
        shared_runtime,
        no_projector,
        null_log,
        fresh: Vec::new(),
    })
}

fn lat_row(name: &str, l: &Latency) -> String {
    let err = if l.errors > 0 { format!(" ({} errors)", l.errors) } else { String::new() };
    format!("| {name} | HTTP POST, sequential | {} | {} | n = {}{err} |\n", ms(l.p50), ms(l.p99), l.n)
}

fn rate_row(name: &str, r: &Rate) -> String {
    let err = if r.errors > 0 { format!(", {} errors", r.errors) } else { String::new() };
    format!(
        "| {name} | {CLIENTS} concurrent clients, {THROUGHPUT_SECS} s | {:.0} req/s | | {} in {:.2} s{err} |\n",
        r.per_sec, r.done, r.secs
    )
}

fn ratio_rows(name: &str, v: &Variant, hello: &Variant, median: f64) -> String {
    let adjacent = match &v.hello_before {
        Some(h) => format!("{:.3} ({:.0} / {:.0} req/s)", v.rate.per_sec / h.per_sec, v.rate.per_sec, h.per_sec),
        None => "–".to_owned(),
    };
    format!(
        "| {name} | {:+.3} ms | {:+.3} ms | {adjacent} | {:.3} ({:.0} / {:.0} req/s) |\n",
        (v.lat.p50 - hello.lat.p50) / 1000.0,
        (v.lat.p99 - hello.lat.p99) / 1000.0,
        v.rate.per_sec / median,
        v.rate.per_sec,
        median,
    )
}

/// The median of hello-world's throughputs in this run: the first and the
/// one before each variant.
fn hello_median(r: &Results, variants: &[(&str, &Variant)]) -> f64 {
    let mut all: Vec<f64> = std::iter::once(r.hello.rate.per_sec)
        .chain(variants.iter().filter_map(|(_, v)| v.hello_before.as_ref().map(|h| h.per_sec)))
        .collect();
    all.sort_by(f64::total_cmp);
    match all.len() {
        0 => 0.0,
        n if n % 2 == 1 => all[n / 2],
        n => (all[n / 2 - 1] + all[n / 2]) / 2.0,
    }
}

fn interleaved_row(name: &str, i: &Interleaved) -> String {
    let (h, h_lo, h_hi) = i.side(0);
    let (v, v_lo, v_hi) = i.side(1);
    let (r_lo, r_hi) = i.pair_range();
    let cpu = i.cpu_ratio().map_or_else(|| "–".to_owned(), |c| format!("{c:.2}"));
    let late =
        if i.unsettled > 0 { format!(", {} slices began before it caught up", i.unsettled) } else { String::new() };
    format!(
        "| {name} | {h:.0} ({h_lo:.0}–{h_hi:.0}) | {v:.0} ({v_lo:.0}–{v_hi:.0}) | **{:.3}** | {r_lo:.3}–{r_hi:.3} | \
         {cpu} | {:.2} s in all, {:.0} ms at most{late} |\n",
        i.ratio(),
        i.waited.as_secs_f64(),
        i.longest_wait.as_secs_f64() * 1e3,
    )
}

fn log_note(v: &Variant) -> String {
    match v.log_records {
        Some(n) => format!(
            "{n} records in the SQLite log for {} admitted calls ({:.2} per call; a request and a call event each)",
            v.answered,
            n as f64 / v.answered.max(1) as f64
        ),
        None => format!("{} admitted calls; the SQLite log could not be counted", v.answered),
    }
}

const LAYER: &str = "Layer, embedded (memory view)";
const REDIS: &str = "Layer, Redis view (diagnostic)";
const NORMAL: &str = "Layer, memory view, SQLite `synchronous = NORMAL` (diagnostic)";
const ONE_FILE: &str = "Layer, memory view, the log in the store's file (as before; diagnostic)";
const SHARED_RUNTIME: &str = "Layer, memory view, the projector a task of the serving runtime (as before; diagnostic)";
const NO_PROJECTOR: &str = "Layer, memory view, SQLite log, no projector (diagnostic)";
const NULL_LOG: &str = "Layer, memory view, no-op log, no projector (diagnostic)";

fn report(r: &Results) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{} worker threads ({} cores); allocator: {ALLOCATOR}; load average {} before, {} after (anything else \
         running skews every number). SQLite files in {}.\n\n",
        r.workers,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        r.load_before,
        r.load_after,
        r.dir.display(),
    ));
    let mut variants: Vec<(&str, &Variant)> = vec![("hello-world", &r.hello), (LAYER, &r.layer)];
    if let Ok(v) = &r.redis {
        variants.push((REDIS, v));
    }
    variants.push((NORMAL, &r.sync_normal));
    variants.push((ONE_FILE, &r.one_file));
    variants.push((SHARED_RUNTIME, &r.shared_runtime));
    variants.push((NO_PROJECTOR, &r.no_projector));
    variants.push((NULL_LOG, &r.null_log));

    s.push_str("### In-process check: measurements\n\n");
    s.push_str("| Measurement | What | p50 / rate | p99 | Notes |\n|---|---|---|---|---|\n");
    for (name, v) in &variants {
        s.push_str(&lat_row(name, &v.lat));
    }
    for (name, v) in &variants {
        s.push_str(&rate_row(name, &v.rate));
    }

    let median = hello_median(r, &variants);
    s.push_str("\n### Against hello-world\n\n");
    s.push_str(
        "| Variant | p50 − hello p50 | p99 − hello p99 | throughput / hello-world's just before it | \
         throughput / the run's median hello-world |\n|---|---|---|---|---|\n",
    );
    s.push_str(&ratio_rows(LAYER, &r.layer, &r.hello, median));
    match &r.redis {
        Ok(v) => s.push_str(&ratio_rows(REDIS, v, &r.hello, median)),
        Err(why) => s.push_str(&format!("| {REDIS} | skipped: {why} | | | |\n")),
    }
    s.push_str(&ratio_rows(NORMAL, &r.sync_normal, &r.hello, median));
    s.push_str(&ratio_rows(ONE_FILE, &r.one_file, &r.hello, median));
    s.push_str(&ratio_rows(SHARED_RUNTIME, &r.shared_runtime, &r.hello, median));
    s.push_str(&ratio_rows(NO_PROJECTOR, &r.no_projector, &r.hello, median));
    s.push_str(&ratio_rows(NULL_LOG, &r.null_log, &r.hello, median));

    s.push_str(&format!(
        "\n### Interleaved with hello-world\n\n{INTERLEAVED_PAIRS} pairs of {SLICE_SECS}-s slices of {CLIENTS} \
         clients, each pair in the other order from the one before; before each slice the projector is let fold \
         every record logged so far (that wait is in neither side's time).\n\n\
         | Variant | hello-world req/s (slices) | variant req/s (slices) | variant / hello-world, in equal time | \
         pairs' ratios | process CPU per request / hello-world's | waited for the fold |\n|---|---|---|---|---|---|---|\n"
    ));
    for (name, v) in [(LAYER, &r.layer), (NULL_LOG, &r.null_log)] {
        if let Some(i) = &v.interleaved {
            s.push_str(&interleaved_row(name, i));
        }
    }

    s.push_str(
        "\n### Interleaved with hello-world, each in a process of its own\n\nAs above, in a new process of this \
         benchmark per Layer, in which hello-world and that Layer are all that ran (a second of warm-up each): \
         the variants measured before them in a full run leave servers, pooled connections, views and a larger \
         heap behind, and hello-world alone has measured about a quarter slower after the first Layer than \
         before it.\n\n\
         | Variant | hello-world req/s (slices) | variant req/s (slices) | variant / hello-world, in equal time | \
         pairs' ratios | process CPU per request / hello-world's | waited for the fold |\n|---|---|---|---|---|---|---|\n",
    );
    for (name, row) in &r.fresh {
        match row {
            Ok(row) => s.push_str(row),
            Err(why) => s.push_str(&format!("| {name} | {why} | | | | | |\n")),
        }
    }

    let again: Vec<String> =
        variants.iter().filter_map(|(_, v)| v.hello_before.as_ref()).map(|h| format!("{:.0}", h.per_sec)).collect();
    s.push_str(&format!(
        "\nHello-world's throughput: {:.0} req/s first, then {} req/s just before each variant (median {:.0}).\n",
        r.hello.rate.per_sec,
        again.join(", "),
        median
    ));
    s.push_str(&format!("Layer probe headers: {}.\n", r.layer_headers));
    s.push_str(&format!("{LAYER}: {}.\n", log_note(&r.layer)));
    if let Ok(v) = &r.redis {
        s.push_str(&format!("{REDIS}: {}.\n", log_note(v)));
    }
    s.push_str(&format!("{NORMAL}: {}.\n", log_note(&r.sync_normal)));
    s.push_str(&format!("{ONE_FILE}: {}.\n", log_note(&r.one_file)));
    s.push_str(&format!("{SHARED_RUNTIME}: {}.\n", log_note(&r.shared_runtime)));
    s.push_str(&format!("{NO_PROJECTOR}: {}.\n", log_note(&r.no_projector)));
    s
}
