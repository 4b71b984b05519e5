//! Spawns real Tollgate processes against real PostgreSQL, Redis and a
//! Kafka-protocol broker, each test with its own database, key prefix and
//! topics so tests run in parallel (see the `testkit` crate: a distributed
//! test is skipped, with its reason printed, when a service does not answer,
//! unless `TOLLGATE_REQUIRE_SERVICES` is set; a `tollgate dev` test needs
//! nothing).
//!
//! Gateways run with a configuration cache TTL of 0, so a test never waits
//! for a quota change to reach them, and a publish timeout of 30 s (the
//! fault tests of `faults_outage` set a short one).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::{Timelike, Utc};
use serde_json::{Value, json};
use testkit::Service;

pub const ADMIN: &str = "admin-token-e2e";
pub const GATEWAY: &str = "gateway-token-e2e";

pub use testkit::env::kafka;
pub use testkit::free_port;

/// A day-window time zone whose current day has at least two hours left and
/// has run for at least two, so a test never straddles a window boundary.
pub fn safe_timezone() -> &'static str {
    let zones = [("UTC", 0i64), ("Asia/Tokyo", 9), ("America/New_York", -5), ("Asia/Kolkata", 5)];
    let now = Utc::now();
    for (z, off) in zones {
        let h = (now.hour() as i64 + off).rem_euclid(24);
        if (2..=21).contains(&h) {
            return z;
        }
    }
    "UTC"
}

/// Services a fault test brings of its own; `None` takes the shared one.
#[derive(Debug, Clone, Default)]
pub struct Services {
    /// A PostgreSQL server URL (the test database is created on it).
    pub pg_server: Option<String>,
    pub redis_url: Option<String>,
    pub brokers: Option<String>,
}

/// The time zone a project was created with.
pub async fn safe_timezone_of(env: &Env, project: &str) -> chrono_tz::Tz {
    let (_, p) = env.admin_get(&format!("/v1/projects/{project}")).await;
    p["timezone"].as_str().and_then(|t| t.parse().ok()).expect("the project's time zone")
}

/// Which deployment a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `tollgate serve` + `tollgate project` on PostgreSQL, Redis and the broker.
    Distributed,
    /// `tollgate dev`: one process, SQLite log and store, in-memory view.
    Dev,
}

/// One isolated environment: database, Redis prefix, topic prefix (or, in
/// dev mode, a data directory of its own).
pub struct Env {
    pub mode: Mode,
    pub data_dir: std::path::PathBuf,
    pub id: String,
    pub db_url: String,
    pub redis_url: String,
    pub redis_prefix: String,
    pub topic_prefix: String,
    /// The broker(s) its processes use (`TOLLGATE_KAFKA_BROKERS`).
    pub brokers: String,
    /// Where the last projector started serves `/metrics`.
    pub projector_metrics: Option<String>,
    /// Extra environment variables of every process it starts (a fault
    /// test's short timeouts).
    pub extra_env: Vec<(String, String)>,
    children: Vec<(String, Child)>,
    /// Dropped (database, keys) when the environment is.
    _db: Option<testkit::TestDb>,
    _keys: Option<testkit::RedisPrefix>,
    pub gateways: Vec<String>,
    pub http: reqwest::Client,
}

impl Env {
    /// A distributed environment on the test Redis; `None` (the test is
    /// skipped) when a service does not answer.
    pub async fn new() -> Option<Env> {
        if !testkit::available(&[Service::Postgres, Service::Redis, Service::Kafka]) {
            return None;
        }
        Some(Self::with_redis(testkit::env::redis_url()).await)
    }

    /// A distributed environment whose view is the Redis at `redis_url`.
    pub async fn with_redis(redis_url: String) -> Env {
        Self::with_services(Services { redis_url: Some(redis_url), ..Services::default() }).await
    }

    /// A distributed environment on the given services (a fault test's own
    /// broker, Redis or PostgreSQL cluster), the shared ones for the rest.
    pub async fn with_services(services: Services) -> Env {
        let redis_url = services.redis_url.unwrap_or_else(testkit::env::redis_url);
        let db = match &services.pg_server {
            Some(server) => testkit::TestDb::on(server, "tg_e2e").await,
            None => testkit::TestDb::new("tg_e2e").await,
        };
        let keys = testkit::RedisPrefix { url: redis_url.clone(), prefix: format!("tge2e:{}:", testkit::unique_id()) };
        let id = testkit::unique_id();
        Env {
            mode: Mode::Distributed,
            data_dir: std::env::temp_dir().join(format!("tg-e2e-{id}")),
            db_url: db.url.clone(),
            redis_url,
            redis_prefix: keys.prefix.clone(),
            topic_prefix: testkit::topic_prefix("tge2e"),
            brokers: services.brokers.unwrap_or_else(kafka),
            projector_metrics: None,
            extra_env: Vec::new(),
            id,
            children: Vec::new(),
            _db: Some(db),
            _keys: Some(keys),
            gateways: Vec::new(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build().expect("http client"),
        }
    }

    /// An environment for `tollgate dev`, with a fresh data directory.
    pub async fn dev() -> Env {
        let id = testkit::unique_id();
        let data_dir = std::env::temp_dir().join(format!("tg-e2e-dev-{id}"));
        std::fs::create_dir_all(&data_dir).expect("data dir");
        Env {
            mode: Mode::Dev,
            db_url: format!("sqlite://{}", data_dir.join("tollgate.db").display()),
            data_dir,
            redis_url: String::new(),
            redis_prefix: String::new(),
            topic_prefix: "tollgate.".into(),
            brokers: String::new(),
            projector_metrics: None,
            extra_env: Vec::new(),
            id,
            children: Vec::new(),
            _db: None,
            _keys: None,
            gateways: Vec::new(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build().expect("http client"),
        }
    }

    /// An environment of `mode`; `None` when a distributed one cannot run here.
    pub async fn of(mode: Mode) -> Option<Env> {
        match mode {
            Mode::Distributed => Env::new().await,
            Mode::Dev => Some(Env::dev().await),
        }
    }

    fn command(&self, sub: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        c.arg(sub)
            .env("TOLLGATE_DATABASE_URL", &self.db_url)
            .env("TOLLGATE_REDIS_URL", &self.redis_url)
            .env("TOLLGATE_REDIS_PREFIX", &self.redis_prefix)
            .env("TOLLGATE_TOPIC_PREFIX", &self.topic_prefix)
            .env("TOLLGATE_KAFKA_BROKERS", &self.brokers)
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .env("TOLLGATE_GATEWAY_TOKEN", GATEWAY)
            .env("TOLLGATE_CONFIG_TTL", "0s")
            .env("TOLLGATE_LOG", if testkit::env::test_log() { "info" } else { "warn" })
            // Tests not about outages wait for the log as long as they did
            // before the 2 s publish bound: the shared broker on a busy
            // machine can take longer to acknowledge a batch of 500. A fault
            // test sets its own (`extra_env` comes after, and wins).
            .env("TOLLGATE_PUBLISH_TIMEOUT", "30s")
            .env("TOLLGATE_EXPORT_DIR", self.data_dir.join("exports"))
            // Tiny slices: every export here reads its periods in many.
            .env("TOLLGATE_EXPORT_SLICE", "3")
            .envs(self.extra_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if !testkit::env::test_log() {
            c.stderr(Stdio::null());
        }
        c
    }

    /// Starts a gateway process and waits until it answers.
    ///
    /// A port from [`free_port`] is free when picked, not when the child
    /// binds it: another test's listener (a projector's metrics endpoint
    /// answers `/healthz` with `ok` too) can take it in between. So the
    /// answer must be `ok` from a server that also has the gateway's
    /// `/openapi.json`, while the child still runs; a child that exited (it
    /// could not bind) is started again on another port.
    pub async fn start_gateway(&mut self) -> String {
        for _attempt in 0..3 {
            let port = free_port();
            let mut child = match self.mode {
                Mode::Distributed => self
                    .command("serve")
                    .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"))
                    .env("TOLLGATE_INSTANCE", format!("gw{}", self.gateways.len()))
                    .spawn()
                    .expect("spawn tollgate serve"),
                Mode::Dev => self
                    .command("dev")
                    .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"))
                    .env("TOLLGATE_DATA_DIR", &self.data_dir)
                    .env("TOLLGATE_NO_DEMO", "true")
                    .spawn()
                    .expect("spawn tollgate dev"),
            };
            let url = format!("http://127.0.0.1:{port}");
            let mut exited = false;
            for _ in 0..600 {
                if child.try_wait().ok().flatten().is_some() {
                    exited = true;
                    break;
                }
                if let Ok(r) = self.http.get(format!("{url}/healthz")).send().await
                    && r.status().is_success()
                    && r.text().await.is_ok_and(|t| t == "ok")
                    && let Ok(api) = self.http.get(format!("{url}/openapi.json")).send().await
                    && api.status().is_success()
                    && child.try_wait().ok().flatten().is_none()
                {
                    self.children.push(("gateway".into(), child));
                    self.gateways.push(url.clone());
                    return url;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if !exited {
                self.children.push(("gateway".into(), child));
                panic!("gateway did not start on {url}");
            }
        }
        panic!("gateway exited three times before answering (its ports taken?)");
    }

    /// Starts a projector process; returns its index for `kill`.
    pub fn start_projector(&mut self) -> usize {
        if self.mode == Mode::Dev {
            // `tollgate dev` runs its projector in-process.
            return usize::MAX;
        }
        let metrics = format!("127.0.0.1:{}", free_port());
        let child =
            self.command("project").env("TOLLGATE_METRICS_LISTEN", &metrics).spawn().expect("spawn tollgate project");
        self.projector_metrics = Some(format!("http://{metrics}/metrics"));
        self.children.push(("projector".into(), child));
        self.children.len() - 1
    }

    /// Starts a projector process with more environment (`TOLLGATE_…`
    /// settings of its own); returns its index for `kill`.
    pub fn start_projector_with(&mut self, vars: &[(&str, &str)]) -> usize {
        assert_eq!(self.mode, Mode::Distributed, "`tollgate dev` runs its projector in-process");
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut c = self.command("project");
        c.env("TOLLGATE_METRICS_LISTEN", &metrics).envs(vars.iter().copied());
        self.children.push(("projector".into(), c.spawn().expect("spawn tollgate project")));
        self.projector_metrics = Some(format!("http://{metrics}/metrics"));
        self.children.len() - 1
    }

    /// Starts a `tollgate notify` process with more environment; returns
    /// its index for `kill`.
    pub fn start_notifier_with(&mut self, vars: &[(&str, &str)]) -> usize {
        assert_eq!(self.mode, Mode::Distributed, "`tollgate dev` runs its notifier in-process");
        let mut c = self.command("notify");
        c.envs(vars.iter().copied());
        self.children.push(("notifier".into(), c.spawn().expect("spawn tollgate notify")));
        self.children.len() - 1
    }

    /// The index for `kill` of the process started last.
    pub fn last_started(&self) -> usize {
        self.children.len() - 1
    }

    /// SIGKILLs a child process.
    pub fn kill(&mut self, index: usize) {
        let (_, c) = &mut self.children[index];
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Kills every process of this environment and starts `tollgate dev`
    /// again on the same data directory.
    pub async fn restart_dev(&mut self) -> String {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
        self.gateways.clear();
        self.start_gateway().await
    }

    pub fn gw(&self) -> &str {
        &self.gateways[0]
    }

    pub async fn admin_post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.gw()))
            .bearer_auth(ADMIN)
            .json(&body)
            .send()
            .await
            .expect("admin request");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn admin_get(&self, path: &str) -> (u16, Value) {
        let r = self.http.get(format!("{}{path}", self.gw())).bearer_auth(ADMIN).send().await.expect("admin get");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Any admin request; the body is sent as JSON when given.
    pub async fn admin_req(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut r = self.http.request(method, format!("{}{path}", self.gw())).bearer_auth(ADMIN);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let r = r.send().await.expect("admin request");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Runs `tollgate apply -f <file> <extra…>` against this environment's
    /// store (PostgreSQL, or the dev data directory); returns whether it
    /// succeeded, its stdout and its stderr.
    pub fn apply(&self, file: &std::path::Path, extra: &[&str]) -> (bool, String, String) {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        c.arg("apply").arg("-f").arg(file).args(extra).env_remove("TOLLGATE_DATA_DIR").env("TOLLGATE_LOG", "warn");
        match self.mode {
            Mode::Distributed => c.env("TOLLGATE_DATABASE_URL", &self.db_url),
            Mode::Dev => c.arg("--data-dir").arg(&self.data_dir),
        };
        let out = c.output().expect("run tollgate apply");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `tollgate <args…>` to the end against this environment's
    /// services (in dev mode with `--data-dir`, which the subcommand must
    /// take); returns its exit status, stdout and stderr.
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let mut c = self.command(args[0]);
        c.args(&args[1..]).env_remove("TOLLGATE_DATA_DIR").stdout(Stdio::piped()).stderr(Stdio::piped());
        if self.mode == Mode::Dev {
            c.arg("--data-dir").arg(&self.data_dir);
        }
        let out = c.output().expect("run tollgate");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// A project, one key (id, secret) in it.
    pub async fn project_with_key(&self, tz: &str) -> (String, String, String) {
        let (s, p) = self.admin_post("/v1/projects", json!({"name": "e2e", "timezone": tz})).await;
        assert_eq!(s, 201, "create project: {p}");
        let pid = p["id"].as_str().expect("project id").to_owned();
        let (s, k) = self.admin_post(&format!("/v1/projects/{pid}/api-keys"), json!({"name": "k"})).await;
        assert_eq!(s, 201, "create key: {k}");
        (pid, k["id"].as_str().expect("key id").to_owned(), k["secret"].as_str().expect("secret").to_owned())
    }

    /// Subscribes `url` to every event of `project`: (endpoint id, signing secret).
    pub async fn webhook(&self, project: &str, url: &str) -> (String, String) {
        let (s, w) = self
            .admin_post(&format!("/v1/projects/{project}/webhooks"), json!({"url": url, "event_types": ["*"]}))
            .await;
        assert_eq!(s, 201, "subscribe {url}: {w}");
        (w["id"].as_str().expect("webhook id").to_owned(), w["secret"].as_str().expect("secret").to_owned())
    }

    pub async fn quota(&self, body: Value) -> String {
        let (s, q) = self.admin_post("/v1/quotas", body).await;
        assert_eq!(s, 201, "create quota: {q}");
        q["id"].as_str().expect("quota id").to_owned()
    }

    /// Durable totals of one counter in PostgreSQL.
    pub async fn durable(&self, project: &str, dimension: &str, window: &str) -> (i64, i64, i64) {
        let sql = "SELECT CAST(COALESCE(SUM(requests),0) AS BIGINT), CAST(COALESCE(SUM(calls),0) AS BIGINT),
                          CAST(COALESCE(SUM(\"rows\"),0) AS BIGINT)
                   FROM usage_aggregates WHERE project_id = $1 AND dimension = $2 AND window_kind = $3";
        let row: Option<(i64, i64, i64)> = match self.mode {
            Mode::Distributed => {
                let pool = sqlx::PgPool::connect(&self.db_url).await.expect("connect test database");
                let r = sqlx::query_as(sql).bind(project).bind(dimension).bind(window).fetch_optional(&pool).await;
                pool.close().await;
                r.expect("read aggregates")
            }
            Mode::Dev => {
                let pool = self.sqlite().await;
                let r = sqlx::query_as(sql).bind(project).bind(dimension).bind(window).fetch_optional(&pool).await;
                pool.close().await;
                r.expect("read aggregates")
            }
        };
        row.unwrap_or((0, 0, 0))
    }

    /// Durable billable tokens of one dimension's counters in one window kind.
    pub async fn durable_tokens(&self, project: &str, dimension: &str, window: &str) -> i64 {
        let sql = "SELECT CAST(COALESCE(SUM(tokens),0) AS BIGINT) FROM usage_aggregates
                   WHERE project_id = $1 AND dimension = $2 AND window_kind = $3";
        let r: Result<(i64,), sqlx::Error> = match self.mode {
            Mode::Distributed => {
                let pool = sqlx::PgPool::connect(&self.db_url).await.expect("connect test database");
                let r = sqlx::query_as(sql).bind(project).bind(dimension).bind(window).fetch_one(&pool).await;
                pool.close().await;
                r
            }
            Mode::Dev => {
                let pool = self.sqlite().await;
                let r = sqlx::query_as(sql).bind(project).bind(dimension).bind(window).fetch_one(&pool).await;
                pool.close().await;
                r
            }
        };
        r.expect("read aggregates").0
    }

    /// Runs one statement on this environment's store (PostgreSQL, or the
    /// dev data file).
    pub async fn execute(&self, statement: &str) {
        let sql = sqlx::AssertSqlSafe(statement.to_owned());
        match self.mode {
            Mode::Distributed => {
                let pool = sqlx::PgPool::connect(&self.db_url).await.expect("connect test database");
                sqlx::query(sql).execute(&pool).await.expect("a statement");
                pool.close().await;
            }
            Mode::Dev => {
                let pool = self.sqlite().await;
                sqlx::query(sql).execute(&pool).await.expect("a statement");
                pool.close().await;
            }
        }
    }

    /// A connection to the dev data file (shared with the running process).
    pub async fn sqlite(&self) -> sqlx::SqlitePool {
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(self.data_dir.join("tollgate.db"))
            .busy_timeout(Duration::from_secs(10));
        sqlx::SqlitePool::connect_with(opts).await.expect("open the dev data file")
    }

    /// A connection to the dev log's file (beside the data file).
    pub async fn sqlite_log(&self) -> sqlx::SqlitePool {
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(gateway::embedded::log_path(&self.data_dir.join("tollgate.db")))
            .busy_timeout(Duration::from_secs(10));
        sqlx::SqlitePool::connect_with(opts).await.expect("open the dev log file")
    }

    /// A project's audit log as `GET /v1/audit` answers it (up to 1,000
    /// entries), once `ready` holds of it. An entry appears there once the
    /// audit folder (beside the projector) has folded it from the audit
    /// topic, about a poll after it was made: a bounded poll, at most `secs`.
    pub async fn audit_when(
        &self,
        project: &str,
        secs: u64,
        what: &str,
        ready: impl Fn(&[Value]) -> bool,
    ) -> Vec<Value> {
        self.audit_of_when(&format!("project_id={project}"), secs, what, ready).await
    }

    /// The installation-wide audit log (`scope=installation`: writes of
    /// prices) once `ready` holds of it, as [`Env::audit_when`].
    pub async fn installation_audit_when(&self, secs: u64, what: &str, ready: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        self.audit_of_when("scope=installation", secs, what, ready).await
    }

    /// `GET /v1/audit?<scope>&limit=1000` once `ready` holds of its entries.
    async fn audit_of_when(&self, scope: &str, secs: u64, what: &str, ready: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let (s, log) = self.admin_get(&format!("/v1/audit?{scope}&limit=1000")).await;
            assert_eq!(s, 200, "{log}");
            let entries = log["data"].as_array().cloned().unwrap_or_default();
            if ready(&entries) {
                return entries;
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}: {entries:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every entry on the audit topic (Kafka's, or the embedded log's), decoded.
    pub async fn audit_topic(&self) -> Vec<meter::AuditEntry> {
        match self.mode {
            Mode::Distributed => crate::invariants::read_topic(&self.brokers, &format!("{}audit", self.topic_prefix))
                .into_iter()
                .map(|r| schemas::decode_audit(&r.payload).expect("an audit entry on the audit topic"))
                .collect(),
            Mode::Dev => {
                let pool = self.sqlite_log().await;
                let rows: Vec<(Vec<u8>,)> = sqlx::query_as(
                    r#"SELECT payload FROM log_records WHERE topic = 'tollgate.audit' ORDER BY "offset""#,
                )
                .fetch_all(&pool)
                .await
                .expect("the audit topic");
                pool.close().await;
                rows.iter().map(|(p,)| schemas::decode_audit(p).expect("an audit entry on the audit topic")).collect()
            }
        }
    }

    /// Waits until `f` holds, polling, or panics after `secs`.
    pub async fn eventually<F, Fut>(&self, secs: u64, what: &str, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        while tokio::time::Instant::now() < deadline {
            if f().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("timed out waiting for {what}");
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The dev data, or a distributed run's export files.
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

/// A check by secret, from one gateway.
pub async fn check(http: &reqwest::Client, gw: &str, secret: &str, extra: Value) -> reqwest::Response {
    let mut body = json!({ "api_key": secret });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    http.post(format!("{gw}/v1/check")).bearer_auth(GATEWAY).json(&body).send().await.expect("check request")
}

/// Posts events; returns the status and body.
pub async fn post_events(http: &reqwest::Client, gw: &str, events: Vec<Value>) -> (u16, Value) {
    let r = http
        .post(format!("{gw}/v1/events"))
        .bearer_auth(GATEWAY)
        .json(&json!({ "events": events }))
        .send()
        .await
        .expect("events request");
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// A successful call event.
pub fn call_event(id: &str, project: &str, key: &str, reservation: Option<&str>, rows: u64) -> Value {
    json!({
        "id": id, "type": "call", "project_id": project, "api_key_id": key,
        "occurred_at": Utc::now().to_rfc3339(), "reservation_id": reservation,
        "outcome": "success", "rows": rows,
    })
}
