//! # testkit — what every Tollgate test suite shares
//!
//! Why it exists: the store, view, log, gateway and end-to-end suites all
//! need the same things — where the services are, a database / Redis key
//! prefix / topic prefix of their own so they run in parallel, free ports —
//! and used to write each of them again. Here they are written once, with one
//! set of environment variable names ([`env`]).
//!
//! ## Services: found, or skipped with a reason
//!
//! A test that needs PostgreSQL, Redis or the Kafka-protocol broker starts
//! with [`require!`]. When a service does not answer, the test prints why
//! and returns (a plain `cargo test` on a laptop with nothing running passes
//! the pure suites and skips the rest) — unless `TOLLGATE_REQUIRE_SERVICES`
//! is set, as `scripts/test` sets it, in which case the test fails: CI never
//! skips.
//!
//! ## Clean-up
//!
//! [`TestDb`] drops its database and [`RedisPrefix`] deletes its keys when
//! they go out of scope, even when the test panics (the clean-up runs on a
//! thread of its own, outside the test's runtime). Topics cannot be deleted
//! through tansu, so [`topic_prefix`] only makes them unique.

#![cfg_attr(test, allow(clippy::unwrap_used))]

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::Duration;

pub mod parquet;
pub mod webhooks;

pub mod env {
    //! The environment variables every suite reads, and their defaults.

    /// The broker, `host:port`.
    pub const KAFKA: &str = "TOLLGATE_TEST_KAFKA";
    /// A PostgreSQL server URL; tests create databases of their own on it.
    pub const DATABASE_URL: &str = "TOLLGATE_TEST_DATABASE_URL";
    /// A Redis URL; tests use key prefixes of their own on it.
    pub const REDIS_URL: &str = "TOLLGATE_TEST_REDIS_URL";
    /// A Redis Cluster, `redis+cluster://host:port,host:port,…` (scripts/test
    /// starts three masters on 127.0.0.1:7001-7003).
    pub const REDIS_CLUSTER_URL: &str = "TOLLGATE_TEST_REDIS_CLUSTER";
    /// Set (to anything) to make a missing service a failure, not a skip.
    pub const REQUIRE_SERVICES: &str = "TOLLGATE_REQUIRE_SERVICES";
    /// Set to show the logs of the processes and code under test.
    pub const TEST_LOG: &str = "TEST_LOG";

    pub fn kafka() -> String {
        std::env::var(KAFKA).unwrap_or_else(|_| "127.0.0.1:9092".into())
    }
    pub fn database_url() -> String {
        std::env::var(DATABASE_URL).unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
    }
    pub fn redis_url() -> String {
        std::env::var(REDIS_URL).unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }
    pub fn redis_cluster_url() -> String {
        std::env::var(REDIS_CLUSTER_URL)
            .unwrap_or_else(|_| "redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003".into())
    }
    pub fn services_required() -> bool {
        std::env::var_os(REQUIRE_SERVICES).is_some()
    }
    pub fn test_log() -> bool {
        std::env::var_os(TEST_LOG).is_some()
    }
}

/// A service a test may need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Postgres,
    Redis,
    Kafka,
    RedisCluster,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Service::Postgres => "PostgreSQL",
            Service::Redis => "Redis",
            Service::Kafka => "the Kafka broker",
            Service::RedisCluster => "the Redis Cluster",
        }
    }

    /// `host:port` of the service, from its configured URL.
    fn address(self) -> String {
        match self {
            Service::Postgres => host_port(&env::database_url(), 5432),
            Service::Redis => host_port(&env::redis_url(), 6379),
            Service::Kafka => env::kafka().split(',').next().unwrap_or_default().to_owned(),
            Service::RedisCluster => {
                let url = env::redis_cluster_url();
                let nodes = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
                nodes.split(',').next().unwrap_or_default().trim().trim_end_matches('/').to_owned()
            }
        }
    }

    /// Whether something accepts connections at its address (asked once per
    /// process: the answer does not change during a test run).
    fn answers(self) -> bool {
        static ANSWERS: [OnceLock<bool>; 4] = [OnceLock::new(), OnceLock::new(), OnceLock::new(), OnceLock::new()];
        *ANSWERS[self as usize].get_or_init(|| reachable(&self.address()))
    }
}

/// `host:port` of a URL like `scheme://user@host:port/db?x`.
fn host_port(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split(['/', '?']).next().unwrap_or_default();
    let hostport = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    if hostport.contains(':') { hostport.to_owned() } else { format!("{hostport}:{default_port}") }
}

fn reachable(address: &str) -> bool {
    let Ok(addrs) = address.to_socket_addrs() else { return false };
    let addrs: Vec<SocketAddr> = addrs.collect();
    addrs.iter().any(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).is_ok())
}

/// Whether every service in `needed` answers. When one does not: panics if
/// `TOLLGATE_REQUIRE_SERVICES` is set, else prints why the running test (the
/// test harness names each test's thread after it) is skipped and returns
/// false. Tests use it through [`require!`].
pub fn available(needed: &[Service]) -> bool {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    let missing: Vec<String> =
        needed.iter().filter(|s| !s.answers()).map(|s| format!("{} at {}", s.name(), s.address())).collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!("{test}: {} not reachable", missing.join(" and "));
    if env::services_required() {
        panic!("{why} (and {} is set)", env::REQUIRE_SERVICES);
    }
    eprintln!("skipped {why}; set {} to make this a failure", env::REQUIRE_SERVICES);
    false
}

/// Returns from the enclosing test (after printing why) unless the named
/// services answer: `testkit::require!(Postgres, Redis);`. Fails instead of
/// skipping when `TOLLGATE_REQUIRE_SERVICES` is set.
#[macro_export]
macro_rules! require {
    ($($service:ident),+ $(,)?) => {
        if !$crate::available(&[$($crate::Service::$service),+]) {
            return;
        }
    };
}

/// A short random id (12 hex digits) for names of databases, prefixes, topics.
pub fn unique_id() -> String {
    let mut s = uuid::Uuid::new_v4().simple().to_string();
    s.truncate(12);
    s
}

/// A port nothing listens on right now (bound to 0 and released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("bind 127.0.0.1:0")
}

/// A topic prefix of its own (`<tag>.<id>.`), so a test's topics are its own.
pub fn topic_prefix(tag: &str) -> String {
    format!("{tag}.{}.", unique_id())
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    match query {
        Some(q) => format!("{host_part}/{db}?{q}"),
        None => format!("{host_part}/{db}"),
    }
}

/// A fresh, empty PostgreSQL database on the test server, dropped (with
/// `FORCE`, so open connections do not keep it) when this goes out of scope.
#[derive(Debug)]
pub struct TestDb {
    /// The database's name (`<tag>_<id>`).
    pub name: String,
    /// A URL that connects to it.
    pub url: String,
    server: String,
}

impl TestDb {
    /// Creates `<tag>_<id>` on the server at `TOLLGATE_TEST_DATABASE_URL`.
    pub async fn new(tag: &str) -> TestDb {
        TestDb::on(&env::database_url(), tag).await
    }

    /// Creates `<tag>_<id>` on the server at `server` (a URL of any of its
    /// databases), e.g. a [`PgCluster`] of the test's own.
    pub async fn on(server: &str, tag: &str) -> TestDb {
        use sqlx::Connection;
        let server = server.to_owned();
        let name = format!("{tag}_{}", unique_id());
        let mut admin = sqlx::PgConnection::connect(&server).await.expect("connect to the test PostgreSQL server");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create the test database");
        let _ = admin.close().await;
        TestDb { url: with_database(&server, &name), name, server }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (server, name) = (self.server.clone(), self.name.clone());
        on_own_runtime(async move {
            use sqlx::Connection;
            if let Ok(mut admin) = sqlx::PgConnection::connect(&server).await {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
                    .execute(&mut admin)
                    .await;
                let _ = admin.close().await;
            }
        });
    }
}

/// A Redis key prefix of its own (`<tag>:<id>:`) on the test Redis; every
/// key under it is deleted when this goes out of scope.
#[derive(Debug)]
pub struct RedisPrefix {
    pub url: String,
    pub prefix: String,
}

impl RedisPrefix {
    pub fn new(tag: &str) -> RedisPrefix {
        RedisPrefix { url: env::redis_url(), prefix: format!("{tag}:{}:", unique_id()) }
    }

    /// A prefix of its own on the test Redis Cluster ([`env::redis_cluster_url`]).
    pub fn on_cluster(tag: &str) -> RedisPrefix {
        RedisPrefix { url: env::redis_cluster_url(), prefix: format!("{tag}:{}:", unique_id()) }
    }

    /// Deletes every key under the prefix now.
    pub async fn clear(&self) {
        clear_prefix(&self.url, &self.prefix).await;
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let (url, prefix) = (self.url.clone(), self.prefix.clone());
        on_own_runtime(async move { clear_prefix(&url, &prefix).await });
    }
}

async fn clear_prefix(url: &str, prefix: &str) {
    if let Some(nodes) = url.strip_prefix("redis+cluster://") {
        // Every master's keys under the prefix (a cluster node answers for its own).
        for node in nodes.split(',').map(|n| n.trim().trim_end_matches('/')).filter(|n| !n.is_empty()) {
            clear_node(&format!("redis://{node}"), prefix, true).await;
        }
        return;
    }
    clear_node(url, prefix, false).await;
}

async fn clear_node(url: &str, prefix: &str, cluster: bool) {
    let Ok(client) = redis::Client::open(url) else { return };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else { return };
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    loop {
        let r: redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500)
            .query_async(&mut conn)
            .await;
        let Ok((next, keys)) = r else { return };
        if cluster {
            // A cluster node refuses a command over keys of several slots.
            for key in &keys {
                let _: redis::RedisResult<()> = redis::cmd("UNLINK").arg(key).query_async(&mut conn).await;
            }
        } else if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("UNLINK").arg(&keys).query_async(&mut conn).await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

/// A `redis-server` of a test's own, on a free port, for tests that flush,
/// restart or restore Redis (never the shared one). Killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    pub port: u16,
    pub dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl RedisServer {
    /// Starts an empty server (no persistence unless [`RedisServer::save`] is
    /// called) and waits until it answers.
    pub async fn start() -> RedisServer {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tg-redis-{port}-{}", unique_id()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut server = RedisServer { port, dir, child: None };
        server.spawn().await;
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dbfilename", "dump.rdb"])
            .current_dir(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        self.child = Some(child);
        let client = redis::Client::open(self.url()).expect("redis url");
        for _ in 0..100 {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING").query_async::<String>(&mut c).await.is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server on port {} did not answer", self.port);
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Writes a snapshot (`SAVE`) to `dump.rdb` in its directory.
    pub async fn save(&self) {
        let client = redis::Client::open(self.url()).expect("redis url");
        let mut c = client.get_multiplexed_async_connection().await.expect("connect to own redis");
        let _: () = redis::cmd("SAVE").query_async(&mut c).await.expect("SAVE");
    }

    /// Kills the server and starts it again on the same port with nothing in it.
    pub async fn restart_empty(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(self.dir.join("dump.rdb"));
        self.spawn().await;
    }

    /// Kills the server and starts it again from the snapshot taken by the
    /// last [`RedisServer::save`] (what a restore from an older backup does).
    pub async fn restart_from_snapshot(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends a signal to a process by pid, through `kill(1)`.
fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
}

/// A tansu broker of a test's own on a free port, storing in a SQLite file
/// in its own directory: for tests that freeze (`SIGSTOP`), thaw or restart
/// the log. Killed on drop. The binary is `TOLLGATE_TEST_TANSU`, else
/// `tansu` on the `PATH` or in `~/.cargo/bin`.
#[derive(Debug)]
pub struct Tansu {
    pub port: u16,
    pub dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl Tansu {
    fn binary() -> std::path::PathBuf {
        if let Some(p) = std::env::var_os("TOLLGATE_TEST_TANSU") {
            return p.into();
        }
        let home = std::env::var_os("HOME").map(std::path::PathBuf::from).unwrap_or_default();
        let cargo = home.join(".cargo/bin/tansu");
        if cargo.exists() { cargo } else { "tansu".into() }
    }

    pub async fn start() -> Tansu {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tg-tansu-{port}-{}", unique_id()));
        std::fs::create_dir_all(&dir).expect("tansu dir");
        let mut t = Tansu { port, dir, child: None };
        t.spawn().await;
        t
    }

    /// `host:port`, for `TOLLGATE_KAFKA_BROKERS`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let child = std::process::Command::new(Self::binary())
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .env_remove("SCHEMA_REGISTRY")
            .env_remove("CLUSTER_ID")
            .current_dir(&self.dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start tansu (installed by scripts/test)");
        self.child = Some(child);
        for _ in 0..200 {
            if reachable(&self.brokers()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("tansu on port {} did not listen", self.port);
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// Freezes the broker (`SIGSTOP`): connections stay open, nothing answers.
    pub fn freeze(&self) {
        if let Some(pid) = self.pid() {
            signal(pid, "STOP");
        }
    }

    /// Lets a frozen broker go on (`SIGCONT`).
    pub fn thaw(&self) {
        if let Some(pid) = self.pid() {
            signal(pid, "CONT");
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), "CONT");
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the broker (`SIGKILL`) and starts it again on the same file and port.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// Kills the broker and leaves it down until [`Tansu::restart`].
    pub fn stop(&mut self) {
        self.kill();
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A PostgreSQL cluster of a test's own (`initdb` + `pg_ctl` from
/// `/usr/lib/postgresql/*/bin`, run as the `postgres` user when the test
/// runs as root), on a free port, trust auth: for tests that stop or restart
/// PostgreSQL. Stopped and removed on drop.
#[derive(Debug)]
pub struct PgCluster {
    pub port: u16,
    pub dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    running: bool,
}

impl PgCluster {
    fn bin_dir() -> std::path::PathBuf {
        let mut found: Vec<std::path::PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map(|d| {
                d.filter_map(Result::ok).map(|e| e.path().join("bin")).filter(|p| p.join("pg_ctl").exists()).collect()
            })
            .unwrap_or_default();
        found.sort();
        found.pop().expect("initdb and pg_ctl under /usr/lib/postgresql/*/bin")
    }

    fn as_postgres(program: &std::path::Path) -> std::process::Command {
        let root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        if root {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            std::process::Command::new(program)
        }
    }

    /// `initdb`s a new cluster and starts it.
    pub async fn start() -> PgCluster {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("tg-pg-{port}-{}", unique_id()));
        std::fs::create_dir_all(&dir).expect("pg dir");
        let _ = std::process::Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status();
        let bin = Self::bin_dir();
        let ok = Self::as_postgres(&bin.join("initdb"))
            .args(["-D"])
            .arg(dir.join("data"))
            .args(["-U", "postgres", "--auth=trust", "--no-sync"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run initdb");
        assert!(ok.success(), "initdb failed");
        let mut c = PgCluster { port, dir, bin, running: false };
        c.start_again().await;
        c
    }

    /// A URL of the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn pg_ctl(&self, args: &[&str]) -> bool {
        let opts = format!("-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off", self.port, self.dir.display());
        Self::as_postgres(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-o", &opts, "-l"])
            .arg(self.dir.join("log"))
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts a stopped cluster and waits until it answers.
    pub async fn start_again(&mut self) {
        assert!(self.pg_ctl(&["-w", "start"]), "pg_ctl start failed (see {}/log)", self.dir.display());
        self.running = true;
        for _ in 0..200 {
            if reachable(&format!("127.0.0.1:{}", self.port)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("PostgreSQL on port {} did not answer", self.port);
    }

    /// Stops the cluster at once (`-m immediate`: what a crash does).
    pub fn stop(&mut self) {
        if self.running {
            self.pg_ctl(&["-w", "-m", "immediate", "stop"]);
            self.running = false;
        }
    }

    /// Stops and starts it again.
    pub async fn restart(&mut self) {
        self.stop();
        self.start_again().await;
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs a clean-up future to completion on a thread and runtime of its own,
/// so it works from `Drop` inside or outside a runtime, and while panicking.
fn on_own_runtime<F: std::future::Future<Output = ()> + Send + 'static>(f: F) {
    let _ = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
            rt.block_on(f);
        }
    })
    .join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_reads_the_address_of_a_url() {
        assert_eq!(host_port("postgres://postgres@127.0.0.1:5432/test", 5432), "127.0.0.1:5432");
        assert_eq!(host_port("postgres://u:p@db.example/test?sslmode=disable", 5432), "db.example:5432");
        assert_eq!(host_port("redis://127.0.0.1:6380", 6379), "127.0.0.1:6380");
        assert_eq!(host_port("redis://localhost", 6379), "localhost:6379");
    }

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(with_database("postgres://p@h:5432/test", "x"), "postgres://p@h:5432/x");
        assert_eq!(with_database("postgres://p@h:5432/test?a=b", "x"), "postgres://p@h:5432/x?a=b");
        assert_eq!(with_database("postgres://p@h:5432", "x"), "postgres://p@h:5432/x");
    }

    #[tokio::test]
    async fn own_servers_start_stop_and_restart() {
        // Needs the binaries, not the shared services.
        if std::process::Command::new("redis-server").arg("--version").output().is_ok() {
            let mut r = RedisServer::start().await;
            r.restart_empty().await;
            assert!(reachable(&format!("127.0.0.1:{}", r.port)));
        }
        if std::path::Path::new("/usr/lib/postgresql").exists() {
            let mut pg = PgCluster::start().await;
            assert!(reachable(&format!("127.0.0.1:{}", pg.port)));
            pg.stop();
            assert!(!reachable(&format!("127.0.0.1:{}", pg.port)));
            pg.start_again().await;
            let mut conn = {
                use sqlx::Connection;
                sqlx::PgConnection::connect(&pg.url()).await.expect("connect to own cluster")
            };
            let one: (i32,) = sqlx::query_as("SELECT 1").fetch_one(&mut conn).await.expect("select");
            assert_eq!(one.0, 1);
        }
        if Tansu::binary().exists() {
            let mut t = Tansu::start().await;
            t.freeze();
            t.thaw();
            t.restart().await;
            assert!(reachable(&t.brokers()));
        }
    }

    #[test]
    fn an_unreachable_service_is_skipped_unless_required() {
        // Port 1 on loopback: nothing listens there.
        assert!(!reachable("127.0.0.1:1"));
        assert_eq!(unique_id().len(), 12);
        assert_ne!(free_port(), 0);
    }
}
