//! What a check's options add to it (issue 12 item 9): `/v1/check` plain,
//! with `"explain": true`, with an `estimate`, and with `"permit": true`,
//! each over the backends a gateway can run: Redis view with Redis permits,
//! Redis view with PostgreSQL permits, and the in-memory view and permits of
//! `tollgate dev` and the embedded Layer.
//!
//! Everything runs in this process against the real services, with its own
//! database and Redis key prefix. The log is a no-op for every variant (what
//! the request event's publish costs is `hot_path`'s): the difference
//! between two rows is the option's own cost. The variants run interleaved,
//! in rounds, so a drift of the machine's load falls on all of them alike;
//! each check's reservation (and permit) is settled (and freed) after it,
//! untimed, so no variant reads more live reservations than another.
//!
//! Round trips are counted separately, over checks that are not settled: the
//! Redis commands a check sends (a `MONITOR` connection) and the PostgreSQL
//! transactions it commits (`pg_stat_database.xact_commit`; the statistics
//! are flushed asynchronously, so it waits before reading).
//!
//! Run it with `scripts/bench`; it writes `target/bench-check-options.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gateway::state::SystemClock;
use gateway::{AppState, Settings};
use serde_json::{Value, json};
use store::{MemoryPermits, MemoryView, PgPermits, PgStore, RedisView};

mod support;
use support::{AnyResult, Latency, NullLog, bench_main, loadavg, ms, serve};
use testkit::env::{database_url as base_db, redis_url as base_redis};

const ADMIN: &str = "admin-token-bench";
const GATEWAY: &str = "gateway-token-bench";
/// Timed checks per variant, in `ROUNDS` interleaved rounds.
const CHECKS: usize = 2_000;
const ROUNDS: usize = 4;
const WARMUP: usize = 200;
/// Unsettled checks per variant whose round trips are counted.
const COUNTED: usize = 200;
/// The permit key's `max_concurrent` and the installation's cap.
const PERMIT_CAP: u32 = 256;
/// How long to wait for PostgreSQL's statistics: an idle backend reports
/// its counts after 10 s.
const STATS_WAIT: Duration = Duration::from_secs(11);

fn main() {
    bench_main("check_options", run);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Plain,
    Explain,
    Estimate,
    Permit,
}

impl Variant {
    const ALL: [Variant; 4] = [Variant::Plain, Variant::Explain, Variant::Estimate, Variant::Permit];
    fn name(self) -> &'static str {
        match self {
            Variant::Plain => "check",
            Variant::Explain => "+ explain",
            Variant::Estimate => "+ estimate",
            Variant::Permit => "+ permit",
        }
    }
}

struct Backend {
    name: &'static str,
    url: String,
    project: String,
    key: String,
    secret: String,
    /// A key with `max_concurrent`, for the permit variant.
    capped: (String, String),
}

struct Row {
    backend: &'static str,
    variant: Variant,
    latency: Latency,
    redis: Option<f64>,
    pg: Option<f64>,
}

async fn send(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    token: &str,
    body: Option<&Value>,
) -> AnyResult<Value> {
    let mut r = http.request(method, url).bearer_auth(token);
    if let Some(b) = body {
        r = r.json(b);
    }
    let r = r.send().await?;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        return Err(format!("{url}: {status} {v}").into());
    }
    Ok(v)
}

async fn admin(http: &reqwest::Client, url: &str, body: Value) -> AnyResult<Value> {
    send(http, reqwest::Method::POST, url, ADMIN, Some(&body)).await
}

/// A gateway on `state`, with a project holding a calls quota on a key and a
/// tokens quota on the project, neither ever reached, and a second key with
/// `max_concurrent`.
async fn backend(http: &reqwest::Client, name: &'static str, state: AppState) -> AnyResult<Backend> {
    let url = serve(gateway::app(state)).await?;
    let p = admin(http, &format!("{url}/v1/projects"), json!({"name": name, "timezone": "UTC"})).await?;
    let project = p["id"].as_str().ok_or("project id")?.to_owned();
    let k = admin(http, &format!("{url}/v1/projects/{project}/api-keys"), json!({"name": "plain"})).await?;
    let key = k["id"].as_str().ok_or("key id")?.to_owned();
    let secret = k["secret"].as_str().ok_or("secret")?.to_owned();
    let c = admin(
        http,
        &format!("{url}/v1/projects/{project}/api-keys"),
        json!({"name": "capped", "grants": {"max_concurrent": PERMIT_CAP}}),
    )
    .await?;
    let capped = (c["id"].as_str().ok_or("key id")?.to_owned(), c["secret"].as_str().ok_or("secret")?.to_owned());
    for (scope, scope_ref, metric) in [
        ("api_key", Some(key.as_str()), "calls"),
        ("api_key", Some(capped.0.as_str()), "calls"),
        ("project", None, "tokens"),
    ] {
        admin(
            http,
            &format!("{url}/v1/quotas"),
            json!({"project_id": project, "scope": scope, "scope_ref": scope_ref, "metric": metric, "window": "day",
                   "limit": 1_000_000_000_000i64}),
        )
        .await?;
    }
    Ok(Backend { name, url, project, key, secret, capped })
}

/// One check of `variant`: its answer.
async fn check(http: &reqwest::Client, b: &Backend, variant: Variant) -> AnyResult<Value> {
    let body = match variant {
        Variant::Plain => json!({"api_key": b.secret}),
        Variant::Explain => json!({"api_key": b.secret, "explain": true}),
        Variant::Estimate => json!({"api_key": b.secret, "estimate": {"tokens": 100}}),
        Variant::Permit => json!({"api_key": b.capped.1, "permit": true}),
    };
    send(http, reqwest::Method::POST, &format!("{}/v1/check", b.url), GATEWAY, Some(&body)).await
}

/// Settles the check's reservation with the call's event (tokens for an
/// estimate) and frees its permit: untimed.
async fn settle(http: &reqwest::Client, b: &Backend, variant: Variant, answer: &Value, n: u64) -> AnyResult<()> {
    let rid = answer["reservation_id"].as_str().ok_or("reservation id")?;
    let key = if variant == Variant::Permit { &b.capped.0 } else { &b.key };
    let mut ev = json!({"id": format!("bench-{n}"), "project_id": b.project, "api_key_id": key,
                        "occurred_at": chrono::Utc::now().to_rfc3339(), "reservation_id": rid});
    if variant == Variant::Estimate {
        ev["type"] = json!("tokens");
        ev["tokens"] = json!([{"provider": "bench", "model": "m", "input": 60, "output": 40}]);
    } else {
        ev["type"] = json!("call");
        ev["outcome"] = json!("success");
    }
    if let Some(permit) = answer["permit"]["id"].as_str() {
        ev["permit_id"] = json!(permit);
    }
    send(http, reqwest::Method::POST, &format!("{}/v1/events", b.url), GATEWAY, Some(&json!({"events": [ev]}))).await?;
    Ok(())
}

/// Redis commands sent per check naming `prefix` (a `MONITOR` connection),
/// over `n` checks, settled only once counted (into `answers`).
async fn redis_commands(
    prefix: &str,
    n: usize,
    http: &reqwest::Client,
    b: &Backend,
    v: Variant,
    answers: &mut Vec<Value>,
) -> Option<f64> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let url = base_redis();
    let hostport = url.strip_prefix("redis://")?.split('/').next()?.rsplit('@').next()?.to_owned();
    let mut stream = tokio::net::TcpStream::connect(hostport).await.ok()?;
    stream.write_all(b"MONITOR\r\n").await.ok()?;
    let mut lines = BufReader::new(stream).lines();
    if !lines.next_line().await.ok()??.starts_with("+OK") {
        return None;
    }
    let (needle, seen) = (prefix.to_owned(), Arc::new(AtomicU64::new(0)));
    let reader = {
        let seen = seen.clone();
        tokio::spawn(async move {
            // Commands a script runs show `[<db> lua]`: not round trips.
            while let Ok(Some(l)) = lines.next_line().await {
                if l.contains(&needle) && !l.contains(" lua] ") {
                    seen.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    for _ in 0..n {
        answers.push(check(http, b, v).await.ok()?);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    reader.abort();
    Some(seen.load(Ordering::Relaxed) as f64 / n as f64)
}

async fn commits(pool: &sqlx::PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(pool)
        .await
        .ok()
}

/// PostgreSQL transactions committed per check, over `n` checks settled
/// only once counted (into `answers`): the database's count before and
/// after, each read once every backend has reported (the read itself
/// commits one).
async fn pg_commits(
    pool: &sqlx::PgPool,
    n: usize,
    http: &reqwest::Client,
    b: &Backend,
    v: Variant,
    answers: &mut Vec<Value>,
) -> Option<f64> {
    tokio::time::sleep(STATS_WAIT).await;
    let from = commits(pool).await?;
    for _ in 0..n {
        answers.push(check(http, b, v).await.ok()?);
    }
    tokio::time::sleep(STATS_WAIT).await;
    let all = (commits(pool).await? - from) as f64;
    Some(((all - 1.0) / n as f64).max(0.0))
}

async fn run() -> AnyResult<()> {
    let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let db = format!("tg_bench_{id}");
    let base = base_db();
    let admin_pool = sqlx::PgPool::connect(&base).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}"))).execute(&admin_pool).await?;
    let db_url = match base.rfind('/') {
        Some(i) => format!("{}/{db}", &base[..i]),
        None => return Err(format!("database url without a path: {base}").into()),
    };
    let prefix = format!("tgbench:{id}:");
    let load_before = loadavg();
    let result = measure(&db_url, &prefix).await;
    let load_after = loadavg();
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")))
        .execute(&admin_pool)
        .await;
    admin_pool.close().await;
    let rows = result?;
    let report = report(&rows, &load_before, &load_after);
    println!("\n{report}");
    let dir =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    let path = std::path::Path::new(&dir).join("bench-check-options.md");
    match std::fs::write(&path, &report) {
        Ok(()) => eprintln!("check_options: report written to {}", path.display()),
        Err(e) => eprintln!("check_options: could not write {}: {e}", path.display()),
    }
    Ok(())
}

async fn measure(db_url: &str, prefix: &str) -> AnyResult<Vec<Row>> {
    let store = PgStore::connect(db_url).await?;
    store.migrate().await?;
    let store = Arc::new(store);
    let stats = sqlx::PgPool::connect(db_url).await?;
    let view = Arc::new(RedisView::connect(&base_redis(), prefix).await?);
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).tcp_nodelay(true).build()?;
    let settings = || {
        let mut s = Settings::new(ADMIN, GATEWAY);
        // Room for the round-trip pass's unreleased permits. The PostgreSQL
        // claim walks `generate_series(1, cap)` for the caller's and the
        // installation's pools: its cost grows with the caps.
        s.installation_permits = PERMIT_CAP;
        s
    };
    let state = |view: Arc<dyn meter::View>, permits: Arc<dyn meter::Permits>| {
        AppState::new(store.clone(), view, Arc::new(NullLog), Arc::new(SystemClock), settings()).with_permits(permits)
    };
    let backends = vec![
        backend(&http, "redis", state(view.clone(), Arc::new(view.permits()))).await?,
        backend(&http, "postgres", state(view.clone(), Arc::new(PgPermits::new(store.pool().clone())))).await?,
        backend(&http, "memory", state(Arc::new(MemoryView::new()), Arc::new(MemoryPermits::new()))).await?,
    ];

    let mut n = 0u64;
    for b in &backends {
        for v in Variant::ALL {
            for _ in 0..WARMUP / 4 {
                let a = check(&http, b, v).await?;
                n += 1;
                settle(&http, b, v, &a, n).await?;
            }
        }
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); backends.len() * Variant::ALL.len()];
    let mut errors = vec![0usize; samples.len()];
    for round in 0..ROUNDS {
        eprintln!("check_options: round {} of {ROUNDS}", round + 1);
        for (bi, b) in backends.iter().enumerate() {
            for (vi, v) in Variant::ALL.into_iter().enumerate() {
                let slot = bi * Variant::ALL.len() + vi;
                for _ in 0..CHECKS / ROUNDS {
                    let t = Instant::now();
                    let a = check(&http, b, v).await;
                    samples[slot].push(t.elapsed().as_secs_f64() * 1e6);
                    n += 1;
                    match a {
                        Ok(a) => settle(&http, b, v, &a, n).await?,
                        Err(_) => errors[slot] += 1,
                    }
                }
            }
        }
    }
    let mut rows = Vec::new();
    for (bi, b) in backends.iter().enumerate() {
        for (vi, v) in Variant::ALL.into_iter().enumerate() {
            let slot = bi * Variant::ALL.len() + vi;
            eprintln!("check_options: round trips of {} {}", b.name, v.name());
            let mut answers = Vec::new();
            let redis = if b.name == "memory" {
                None
            } else {
                redis_commands(prefix, COUNTED, &http, b, v, &mut answers).await
            };
            for a in std::mem::take(&mut answers) {
                n += 1;
                settle(&http, b, v, &a, n).await?;
            }
            // Only the PostgreSQL permits touch the database on a check (the
            // configuration is cached): counted there, against a plain check.
            let pg = if b.name == "postgres" && matches!(v, Variant::Plain | Variant::Permit) {
                pg_commits(&stats, COUNTED, &http, b, v, &mut answers).await
            } else {
                None
            };
            for a in answers {
                n += 1;
                settle(&http, b, v, &a, n).await?;
            }
            rows.push(Row {
                backend: b.name,
                variant: v,
                latency: Latency::of(std::mem::take(&mut samples[slot]), errors[slot]),
                redis,
                pg,
            });
        }
    }
    Ok(rows)
}

fn report(rows: &[Row], load_before: &str, load_after: &str) -> String {
    let mut out = String::new();
    out.push_str("## What a permit, an estimate and an explain add to a check\n\n");
    out.push_str(&format!(
        "`cargo bench --bench check_options`: {CHECKS} sequential `/v1/check`s per row over HTTP, interleaved in \
         {ROUNDS} rounds, the log a no-op; round trips over {COUNTED} more: Redis commands sent (a MONITOR \
         connection), PostgreSQL transactions committed (counted on the PostgreSQL permits only: no other \
         check touches the database, its configuration being cached). Permit caps {PERMIT_CAP} (the key's and \
         the installation's). Load average before {load_before}, after {load_after}.\n\n"
    ));
    out.push_str(
        "| backend | check | p50 | p99 | p50 × check | p50 added | p99 added | Redis commands | PostgreSQL commits \
         | errors |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let base = rows.iter().find(|x| x.backend == r.backend && x.variant == Variant::Plain).map(|x| x.latency);
        let added = |f: fn(&Latency) -> f64| match (base, r.variant) {
            (Some(b), v) if v != Variant::Plain => format!("{:+.3} ms", (f(&r.latency) - f(&b)) / 1000.0),
            _ => "—".into(),
        };
        let per = |v: Option<f64>| v.map_or("—".into(), |x| format!("{x:.2}"));
        let ratio = base.map_or("—".into(), |b| format!("{:.2}", r.latency.p50 / b.p50));
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.variant.name(),
            ms(r.latency.p50),
            ms(r.latency.p99),
            ratio,
            added(|l| l.p50),
            added(|l| l.p99),
            per(r.redis),
            per(r.pg),
            r.latency.errors,
        ));
    }
    out
}
