//! Spawns real Tollgate processes against real PostgreSQL, Redis and a
//! Kafka-protocol broker, each test with its own database, key prefix and
//! topics so tests run in parallel.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::{Timelike, Utc};
use serde_json::{Value, json};

pub const ADMIN: &str = "admin-token-e2e";
pub const GATEWAY: &str = "gateway-token-e2e";

pub fn kafka() -> String {
    std::env::var("TOLLGATE_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}
pub fn base_db() -> String {
    std::env::var("TOLLGATE_TEST_DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}
pub fn base_redis() -> String {
    std::env::var("TOLLGATE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind port 0").local_addr().expect("addr").port()
}

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
    children: Vec<(String, Child)>,
    pub gateways: Vec<String>,
    pub http: reqwest::Client,
}

impl Env {
    pub async fn new() -> Env {
        Self::with_redis(base_redis()).await
    }

    pub async fn with_redis(redis_url: String) -> Env {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let db = format!("tg_e2e_{id}");
        let pool = sqlx::PgPool::connect(&base_db()).await.expect("connect base database");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&pool)
            .await
            .expect("create test database");
        pool.close().await;
        let base = base_db();
        let db_url = match base.rfind('/') {
            Some(i) => format!("{}/{db}", &base[..i]),
            None => panic!("database url without a path: {base}"),
        };
        Env {
            mode: Mode::Distributed,
            data_dir: std::env::temp_dir().join(format!("tg-e2e-{id}")),
            db_url,
            redis_url,
            redis_prefix: format!("tge2e:{id}:"),
            topic_prefix: format!("tge2e.{id}."),
            id,
            children: Vec::new(),
            gateways: Vec::new(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build().expect("http client"),
        }
    }

    /// An environment for `tollgate dev`, with a fresh data directory.
    pub async fn dev() -> Env {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let data_dir = std::env::temp_dir().join(format!("tg-e2e-dev-{id}"));
        std::fs::create_dir_all(&data_dir).expect("data dir");
        Env {
            mode: Mode::Dev,
            db_url: format!("sqlite://{}", data_dir.join("tollgate.db").display()),
            data_dir,
            redis_url: String::new(),
            redis_prefix: String::new(),
            topic_prefix: "tollgate.".into(),
            id,
            children: Vec::new(),
            gateways: Vec::new(),
            http: reqwest::Client::builder().pool_max_idle_per_host(64).build().expect("http client"),
        }
    }

    pub async fn of(mode: Mode) -> Env {
        match mode {
            Mode::Distributed => Env::new().await,
            Mode::Dev => Env::dev().await,
        }
    }

    fn command(&self, sub: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        c.arg(sub)
            .env("TOLLGATE_DATABASE_URL", &self.db_url)
            .env("TOLLGATE_REDIS_URL", &self.redis_url)
            .env("TOLLGATE_REDIS_PREFIX", &self.redis_prefix)
            .env("TOLLGATE_TOPIC_PREFIX", &self.topic_prefix)
            .env("TOLLGATE_KAFKA_BROKERS", kafka())
            .env("TOLLGATE_ADMIN_TOKEN", ADMIN)
            .env("TOLLGATE_GATEWAY_TOKEN", GATEWAY)
            .env("TOLLGATE_LOG", std::env::var("TEST_LOG").map(|_| "info").unwrap_or("warn"))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if std::env::var("TEST_LOG").is_err() {
            c.stderr(Stdio::null());
        }
        c
    }

    /// Starts a gateway process and waits until it answers.
    pub async fn start_gateway(&mut self) -> String {
        let port = free_port();
        let child = match self.mode {
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
        self.children.push(("gateway".into(), child));
        let url = format!("http://127.0.0.1:{port}");
        for _ in 0..600 {
            if let Ok(r) = self.http.get(format!("{url}/healthz")).send().await
                && r.status().is_success()
            {
                self.gateways.push(url.clone());
                return url;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("gateway did not start on {url}");
    }

    /// Starts a projector process; returns its index for `kill`.
    pub fn start_projector(&mut self) -> usize {
        if self.mode == Mode::Dev {
            // `tollgate dev` runs its projector in-process.
            return usize::MAX;
        }
        let child = self.command("project").spawn().expect("spawn tollgate project");
        self.children.push(("projector".into(), child));
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

    /// A project, one key (id, secret) in it.
    pub async fn project_with_key(&self, tz: &str) -> (String, String, String) {
        let (s, p) = self.admin_post("/v1/projects", json!({"name": "e2e", "timezone": tz})).await;
        assert_eq!(s, 201, "create project: {p}");
        let pid = p["id"].as_str().expect("project id").to_owned();
        let (s, k) = self.admin_post(&format!("/v1/projects/{pid}/api-keys"), json!({"name": "k"})).await;
        assert_eq!(s, 201, "create key: {k}");
        (pid, k["id"].as_str().expect("key id").to_owned(), k["secret"].as_str().expect("secret").to_owned())
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

    /// A connection to the dev data file (shared with the running process).
    pub async fn sqlite(&self) -> sqlx::SqlitePool {
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(self.data_dir.join("tollgate.db"))
            .busy_timeout(Duration::from_secs(10));
        sqlx::SqlitePool::connect_with(opts).await.expect("open the dev data file")
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
        if self.mode == Mode::Dev {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
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
