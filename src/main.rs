//! `tollgate`: the one binary. `serve` runs the HTTP gateway, `project` the
//! projector, `notify` the webhook notifier, `migrate` the PostgreSQL
//! migrations, `dev` everything in one process, `apply` a file of quotas,
//! `replay` a rebuild of every aggregate from the log into a shadow,
//! compared with the live one.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use gateway::state::SystemClock;
use gateway::{AppState, Settings, ViewDownPolicy};
use meter::{Clock, Log};
use projector::{Projector, ProjectorConfig};
use store::{
    KafkaAuditLog, KafkaConfig, KafkaLog, KafkaReader, KafkaTail, PgPermits, PgStore, PublishOptions, RedisView,
    Retention,
};
use tracing::info;

/// `--features mimalloc`: mimalloc instead of the system allocator.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod apply;
mod dev;
mod export;
mod notify;
mod replay;

#[derive(Parser)]
#[command(name = "tollgate", version, about = "Usage metering and exact quota enforcement on an event log")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP gateway (hot path and admin API).
    Serve(Box<ServeArgs>),
    /// Run the projector: fold the usage log into PostgreSQL and Redis.
    Project(ProjectArgs),
    /// Apply the PostgreSQL migrations and exit.
    Migrate(DbArgs),
    /// Run everything in one process with no external service: an embedded
    /// store and log in SQLite files, and the in-memory view.
    Dev(dev::DevArgs),
    /// Run the notifier: deliver the webhook outbox (PostgreSQL) to the
    /// subscribed endpoints. Any number may run at once.
    Notify(NotifyCmdArgs),
    /// Make a project's quotas match a file (`-f quotas.yaml`): create,
    /// update and delete them, all or nothing.
    Apply(apply::ApplyArgs),
    /// Rebuild every aggregate from offset 0 into a shadow (a PostgreSQL
    /// schema, or a file beside the embedded store) while the live
    /// projector runs, compare it with the live aggregates row by row and
    /// print the differences (exit status 1 if any); `--swap` makes the
    /// shadow live and re-seeds the view.
    Replay(replay::ReplayArgs),
    /// Run a billing export: a project's (or every project's) usage per
    /// billing period and customer, as CSV, JSON Lines or Parquet; each run
    /// adds what was folded since the previous run of the same export.
    /// `--verify` also folds the log to the run's watermark and compares.
    Export(Box<export::ExportArgs>),
}

#[derive(Args, Clone)]
struct DbArgs {
    /// PostgreSQL URL.
    #[arg(long, env = "TOLLGATE_DATABASE_URL", default_value = "postgres://postgres@127.0.0.1:5432/tollgate")]
    database_url: String,
}

#[derive(Args, Clone)]
struct Backends {
    #[command(flatten)]
    db: DbArgs,
    /// Kafka bootstrap brokers, `host:port[,…]`.
    #[arg(long, env = "TOLLGATE_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// Redis URL of the view: `redis://host:port/db`, or
    /// `redis+cluster://host:port,host:port` for a Redis Cluster.
    #[arg(long, env = "TOLLGATE_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Prefix of every topic name (`<prefix>usage`, `<prefix>audit`, `<prefix>dlq`).
    #[arg(long, env = "TOLLGATE_TOPIC_PREFIX", default_value = "tollgate.")]
    topic_prefix: String,
    /// Prefix of every Redis key.
    #[arg(long, env = "TOLLGATE_REDIS_PREFIX", default_value = "tg:")]
    redis_prefix: String,
    /// Partitions of each topic Tollgate creates.
    #[arg(long, env = "TOLLGATE_TOPIC_PARTITIONS", default_value_t = 3)]
    topic_partitions: i32,
    /// Replication factor of each topic Tollgate creates.
    #[arg(long, env = "TOLLGATE_TOPIC_REPLICATION", default_value_t = 1)]
    topic_replication: i32,
    /// How long the Kafka producer tries to deliver one record before it
    /// gives up on it (`message.timeout.ms`); `0s` is never, the default.
    /// Records given up on are sent again from the retry queue anyway; a
    /// finite timeout needs a broker that handles idempotent-producer epoch
    /// bumps (Apache Kafka does; tansu 0.6 does not).
    #[arg(long, env = "TOLLGATE_KAFKA_MESSAGE_TIMEOUT", default_value = "0s", value_parser = humantime::parse_duration)]
    kafka_message_timeout: Duration,
    /// How long the usage topic keeps records when Tollgate creates it:
    /// `forever` (the default; a replay rebuilds from offset 0), or a
    /// duration (`400days`). An existing topic keeps its configuration.
    #[arg(long, env = "TOLLGATE_USAGE_RETENTION", default_value = "forever")]
    usage_retention: Retention,
    /// How long the dead-letter topic keeps records when Tollgate creates it.
    #[arg(long, env = "TOLLGATE_DLQ_RETENTION", default_value = "forever")]
    dlq_retention: Retention,
    /// How long the audit topic keeps records when Tollgate creates it:
    /// `forever` (the default; the audit log is folded from it, and a store
    /// rebuilt from the topic has every entry only if the topic kept it).
    #[arg(long, env = "TOLLGATE_AUDIT_RETENTION", default_value = "forever")]
    audit_retention: Retention,
}

impl Backends {
    fn kafka(&self) -> KafkaConfig {
        let mut k = KafkaConfig::new(&self.kafka_brokers, &self.topic_prefix);
        k.partitions = self.topic_partitions;
        k.replication = self.topic_replication;
        k.message_timeout = self.kafka_message_timeout;
        k.usage_retention = self.usage_retention;
        k.dlq_retention = self.dlq_retention;
        k.audit_retention = self.audit_retention;
        k
    }

    async fn store(&self) -> anyhow::Result<PgStore> {
        let store = PgStore::connect(&self.db.database_url).await.context("connecting to PostgreSQL")?;
        store.migrate().await.context("migrating PostgreSQL")?;
        Ok(store)
    }

    async fn topics(&self) -> anyhow::Result<()> {
        let kafka = self.kafka();
        let mut delay = Duration::from_millis(200);
        for attempt in 0.. {
            match kafka.ensure_topics().await {
                Ok(()) => return Ok(()),
                Err(e) if attempt < 10 => {
                    tracing::warn!(error = %e, "topics not ready; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(3));
                }
                Err(e) => return Err(e).context("creating topics"),
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ViewDown {
    Allow,
    Deny,
}

/// Where the concurrency permits (`max_concurrent`) are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PermitsBackend {
    /// A sorted set per caller in the view's Redis, reap-then-claim in one script.
    Redis,
    /// The UNLOGGED `heavy_permit` table (ADR-0196).
    Postgres,
}

/// The concurrency permits' settings, shared by `serve` and `dev`.
#[derive(Args, Clone)]
pub(crate) struct PermitArgs {
    /// The server's query timeout, which a key's or role's `query_timeout`
    /// narrows (never widens): a permit's lease is the narrowest of them
    /// plus 30 s, so a holder that dies frees its slot then.
    #[arg(long, env = "TOLLGATE_QUERY_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) query_timeout: Duration,
    /// The rows of one page, which a key's or role's `max_rows` narrows:
    /// the tower Layer cuts a page to it.
    #[arg(long, env = "TOLLGATE_MAX_PAGE_SIZE", default_value_t = gateway::state::DEFAULT_MAX_PAGE_SIZE)]
    pub(crate) max_page_size: u64,
    /// The rows of one streamed response, which `max_rows` narrows too: the
    /// tower Layer stops a stream there.
    #[arg(long, env = "TOLLGATE_STREAM_MAX_ROWS", default_value_t = gateway::state::DEFAULT_STREAM_MAX_ROWS)]
    pub(crate) stream_max_rows: u64,
    /// Requests one caller may run at once on each of Tollgate's own heavy
    /// endpoints (the audit log, usage reports, webhook deliveries).
    #[arg(long, env = "TOLLGATE_HEAVY_CONCURRENCY", default_value_t = 4)]
    pub(crate) heavy_concurrency: u32,
    /// How long one of those requests may run before it is answered 503
    /// `heavy-request-timed-out`.
    #[arg(long, env = "TOLLGATE_HEAVY_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) heavy_timeout: Duration,
    /// The installation-wide cap on all permits together, every key's and
    /// user's (checked in the same step as the caller's own); by default a
    /// quarter of the PostgreSQL pool (16 connections), at least one.
    #[arg(long, env = "TOLLGATE_PERMITS_CAP")]
    pub(crate) permits_cap: Option<u32>,
}

impl PermitArgs {
    /// Sets them, with the installation's cap a quarter of `pool_size` unless given.
    pub(crate) fn apply(&self, settings: &mut Settings, pool_size: u32) -> anyhow::Result<()> {
        if self.query_timeout.is_zero() {
            bail!("TOLLGATE_QUERY_TIMEOUT must be positive");
        }
        if self.permits_cap == Some(0) {
            bail!("TOLLGATE_PERMITS_CAP must be at least 1");
        }
        if self.max_page_size == 0 || self.stream_max_rows == 0 {
            bail!("TOLLGATE_MAX_PAGE_SIZE and TOLLGATE_STREAM_MAX_ROWS must be at least 1");
        }
        settings.query_timeout = self.query_timeout;
        if self.heavy_concurrency == 0 || self.heavy_timeout.is_zero() {
            bail!("TOLLGATE_HEAVY_CONCURRENCY and TOLLGATE_HEAVY_TIMEOUT must be positive");
        }
        settings.heavy_concurrency = self.heavy_concurrency;
        settings.heavy_timeout = self.heavy_timeout;
        settings.max_page_size = self.max_page_size;
        settings.stream_max_rows = self.stream_max_rows;
        settings.installation_permits = meter::permit::installation_cap(pool_size, self.permits_cap);
        Ok(())
    }
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    backends: Backends,
    /// Address to listen on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// Bearer token of the admin API.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: String,
    /// Bearer token of the hot path (check, events).
    #[arg(long, env = "TOLLGATE_GATEWAY_TOKEN", hide_env_values = true)]
    gateway_token: String,
    /// How long an admitted call holds its reservation if never settled
    /// (more than zero, at most an hour).
    #[arg(long, env = "TOLLGATE_LEASE", default_value = "60s", value_parser = crate::parse_lease)]
    lease: Duration,
    /// How long quota and key configuration is cached per instance.
    #[arg(long, env = "TOLLGATE_CONFIG_TTL", default_value = "1s", value_parser = humantime::parse_duration)]
    config_ttl: Duration,
    /// While PostgreSQL cannot be read, checks and settles go on from the
    /// last configuration loaded, if it is at most this old (else 503).
    #[arg(long, env = "TOLLGATE_CONFIG_MAX_STALE", default_value = "1h", value_parser = humantime::parse_duration)]
    config_max_stale: Duration,
    /// How long the hot path waits for PostgreSQL (a configuration load, a
    /// side write) before it goes on without it.
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", default_value = "1s", value_parser = humantime::parse_duration)]
    store_timeout: Duration,
    /// The longest a settle waits for the log's acknowledgement before it
    /// answers 503 LOG_UNAVAILABLE (its events stay queued and are retried).
    #[arg(long, env = "TOLLGATE_PUBLISH_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    publish_timeout: Duration,
    /// Most events waiting in this process for the log's acknowledgement;
    /// past it a settle answers 503 and queues nothing (the client retries).
    #[arg(long, env = "TOLLGATE_PUBLISH_QUEUE", default_value_t = 100_000)]
    publish_queue: usize,
    /// At shutdown, how long to wait for queued events to reach the log.
    #[arg(long, env = "TOLLGATE_SHUTDOWN_FLUSH_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_flush_timeout: Duration,
    /// What a check does when Redis cannot be reached.
    #[arg(long, env = "TOLLGATE_VIEW_DOWN", value_enum, default_value = "deny")]
    view_down: ViewDown,
    /// Where the concurrency permits are kept, shared by every gateway:
    /// `redis` (the view's Redis) or `postgres` (the `heavy_permit` table).
    #[arg(long, env = "TOLLGATE_PERMITS", value_enum, default_value = "redis")]
    permits: PermitsBackend,
    #[command(flatten)]
    permit: PermitArgs,
    /// This instance's name on the events it emits.
    #[arg(long, env = "TOLLGATE_INSTANCE")]
    instance: Option<String>,
    /// The projector's consumer name: a reseed of a lost view reads the
    /// durable totals at its offsets, then the log past them.
    #[arg(long, env = "TOLLGATE_CONSUMER", default_value = "tollgate-projector")]
    consumer: String,
    /// Before a reseed of a lost view, how long to wait for this gateway's
    /// queued events to reach the log (a check fails by the view-down
    /// policy meanwhile).
    #[arg(long, env = "TOLLGATE_SEED_FLUSH_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    seed_flush_timeout: Duration,
    #[command(flatten)]
    export: notify::ExportRunArgs,
    /// Also run a notifier in this process (or run `tollgate notify`).
    #[arg(long, env = "TOLLGATE_NOTIFY", default_value_t = false, action = clap::ArgAction::Set)]
    notify: bool,
    #[command(flatten)]
    notifier: notify::NotifyArgs,
}

#[derive(Args)]
struct NotifyCmdArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    notify: notify::NotifyArgs,
    /// The projector whose fold scheduled exports read (its consumer name).
    #[arg(long, env = "TOLLGATE_CONSUMER", default_value = "tollgate-projector")]
    consumer: String,
    /// Prefix of every topic name: scheduled exports read the fold of `<prefix>usage`.
    #[arg(long, env = "TOLLGATE_TOPIC_PREFIX", default_value = "tollgate.")]
    topic_prefix: String,
    #[command(flatten)]
    export: notify::ExportRunArgs,
}

#[derive(Args)]
struct ProjectArgs {
    #[command(flatten)]
    backends: Backends,
    /// The name the projector's offsets are stored under.
    #[arg(long, env = "TOLLGATE_CONSUMER", default_value = "tollgate-projector")]
    consumer: String,
    /// Most records folded in one transaction.
    #[arg(long, env = "TOLLGATE_MAX_BATCH", default_value_t = 5000)]
    max_batch: usize,
    /// How long a projector's claim on dead letters it is publishing lasts
    /// (what a killed projector's letters wait for another; above 10 s, the
    /// time one publish may take).
    #[arg(long, env = "TOLLGATE_DEAD_LETTER_LEASE", default_value = "30s", value_parser = humantime::parse_duration)]
    dead_letter_lease: Duration,
    /// How long a projector's membership lasts unrenewed: projectors of one
    /// consumer name split the usage topic's partitions among themselves,
    /// and a killed one's partitions go to the others this long after its
    /// last heartbeat (it renews five times per lease).
    #[arg(long, env = "TOLLGATE_PROJECTOR_LEASE", default_value = "10s", value_parser = humantime::parse_duration)]
    projector_lease: Duration,
    /// The name the audit folder's offsets (on the audit topic) are stored
    /// under. The folder, and the relay that publishes the store's audit
    /// outbox to the audit topic, run beside the projector.
    #[arg(long, env = "TOLLGATE_AUDIT_CONSUMER", default_value = "tollgate-audit")]
    audit_consumer: String,
    /// Where the projector serves `/metrics` (Prometheus text) and `/healthz`;
    /// `off` serves nothing.
    #[arg(long, env = "TOLLGATE_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    metrics_listen: String,
    /// Also run a notifier in this process (or run `tollgate notify`).
    #[arg(long, env = "TOLLGATE_NOTIFY", default_value_t = false, action = clap::ArgAction::Set)]
    notify: bool,
    #[command(flatten)]
    notifier: notify::NotifyArgs,
    /// Where the notifier's scheduled exports write, and their bounds.
    #[command(flatten)]
    export: notify::ExportRunArgs,
}

/// A reservation's lease: more than zero (a lease that ends at once holds
/// nothing), and at most the view's [`meter::view::LEASE_GRACE`], which is
/// how long it remembers a hold released after a flush lost it.
pub(crate) fn parse_lease(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    let max = meter::view::LEASE_GRACE;
    if d.is_zero() || d > max {
        return Err(format!("a lease is more than zero and at most {}", humantime::format_duration(max)));
    }
    Ok(d)
}

/// Serves `/metrics` and `/healthz` on `addr` in the background (the
/// projector has no other HTTP surface).
async fn serve_metrics(addr: &str) -> anyhow::Result<()> {
    if addr == "off" {
        return Ok(());
    }
    gateway::telemetry::install();
    let router = axum::Router::new()
        .route("/metrics", axum::routing::get(|| async { gateway::telemetry::render() }))
        .route("/healthz", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    info!(addr = %listener.local_addr()?, "projector metrics listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::warn!(error = %e, "metrics listener stopped");
        }
    });
    Ok(())
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// How long a gateway waits at start for its Kafka producers' ids before
/// it serves anyway.
const PRODUCER_ID_WAIT: Duration = Duration::from_secs(5);

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if args.admin_token.len() < 8 || args.gateway_token.len() < 8 {
        bail!("TOLLGATE_ADMIN_TOKEN and TOLLGATE_GATEWAY_TOKEN must be at least 8 characters");
    }
    if args.admin_token == args.gateway_token {
        bail!("TOLLGATE_ADMIN_TOKEN and TOLLGATE_GATEWAY_TOKEN must differ");
    }
    if args.publish_timeout.is_zero() || args.store_timeout.is_zero() || args.publish_queue == 0 {
        bail!("TOLLGATE_PUBLISH_TIMEOUT, TOLLGATE_STORE_TIMEOUT and TOLLGATE_PUBLISH_QUEUE must be positive");
    }
    // The port first, so that a port taken fails the start at once and no
    // other process can take it while the rest starts; connections wait in
    // its backlog until the gateway serves (below).
    let listener =
        tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let b = &args.backends;
    // The producers next: each gets its producer id about half a second
    // after it is made, while the rest starts (see below).
    let mut kafka = b.kafka();
    kafka.publish = PublishOptions { timeout: args.publish_timeout, queue: args.publish_queue };
    let producers = KafkaLog::new(&kafka).context("creating the Kafka producer")?;
    let store = b.store().await?;
    b.topics().await?;
    let view = RedisView::connect(&b.redis_url, &b.redis_prefix).await.context("connecting to Redis")?;
    let log: Arc<dyn Log> = Arc::new(producers.clone());
    let mut settings = Settings::new(args.admin_token, args.gateway_token);
    settings.lease = args.lease;
    settings.config_ttl = args.config_ttl;
    settings.config_max_stale = args.config_max_stale;
    settings.store_timeout = args.store_timeout;
    settings.view_down = match args.view_down {
        ViewDown::Allow => ViewDownPolicy::Allow,
        ViewDown::Deny => ViewDownPolicy::Deny,
    };
    if let Some(i) = args.instance {
        settings.instance = i;
    }
    settings.webhook_allow_private = args.notifier.webhook_allow_private;
    args.permit.apply(&mut settings, store.pool().options().get_max_connections())?;
    let permits: Arc<dyn meter::Permits> = match args.permits {
        PermitsBackend::Redis => Arc::new(view.permits()),
        PermitsBackend::Postgres => Arc::new(PgPermits::new(store.pool().clone())),
    };
    info!(backend = ?args.permits, installation_cap = settings.installation_permits, "permits");
    let notifier_config = args.notify.then(|| args.notifier.config()).transpose()?;
    settings.exports = args.export.settings(&args.consumer, kafka.usage_topic());
    let tail = gateway::seeding::TailSource {
        tail: Arc::new(KafkaTail::new(&kafka)),
        consumer: args.consumer,
        topic: kafka.usage_topic(),
        flush_timeout: args.seed_flush_timeout,
        lease_horizon: args.lease + Duration::from_secs(30),
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = Arc::new(store);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let notifier = notifier_config.map(|c| {
        let scheduler = notify::scheduler(store.clone(), clock.clone(), &c, settings.exports.clone());
        notify::spawn(store.clone(), clock.clone(), c, Some(scheduler), stopped)
    });
    let state =
        AppState::new(store, Arc::new(view), log.clone(), clock, settings).with_log_tail(tail).with_permits(permits);
    // No check answered before the producers can send its request event at
    // once (KafkaLog::wait_for_ids): a gateway killed within a second of its
    // start would otherwise take the reservations it granted with it.
    if !producers.wait_for_ids(PRODUCER_ID_WAIT).await {
        tracing::warn!(
            waited_ms = PRODUCER_ID_WAIT.as_millis() as u64,
            "the Kafka producers have no producer id yet (is the broker up?): serving anyway; \
             events wait in this process until they have"
        );
    }
    info!(addr = %listener.local_addr()?, "tollgate gateway listening");
    axum::serve(listener, gateway::app(state)).with_graceful_shutdown(shutdown_signal()).await?;
    let _ = stop.send(true);
    if let Some(n) = notifier {
        n.await.context("notifier task")??;
    }
    // What the log has not acknowledged yet is still in this process.
    if let Err(e) = log.flush(args.shutdown_flush_timeout).await {
        tracing::warn!(error = %e, "shutting down with events not yet on the log; they are lost with this process");
    }
    Ok(())
}

async fn project(args: ProjectArgs) -> anyhow::Result<()> {
    let b = &args.backends;
    let store = b.store().await?;
    b.topics().await?;
    let view = RedisView::connect(&b.redis_url, &b.redis_prefix).await.context("connecting to Redis")?;
    let kafka = b.kafka();
    let reader = KafkaReader::new(&kafka, &args.consumer).context("creating the Kafka consumer")?;
    let mut config = ProjectorConfig::new(kafka.usage_topic());
    config.consumer = args.consumer;
    config.max_batch = args.max_batch;
    config.dead_letter_lease = chrono::Duration::from_std(args.dead_letter_lease).context("--dead-letter-lease")?;
    if args.projector_lease < Duration::from_millis(500) {
        bail!("TOLLGATE_PROJECTOR_LEASE must be at least 500ms");
    }
    config.share = Some(projector::ShareConfig {
        member_lease: chrono::Duration::from_std(args.projector_lease).context("--projector-lease")?,
        heartbeat: args.projector_lease / 5,
    });
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let notifier_config = args.notify.then(|| args.notifier.config()).transpose()?;
    let store = Arc::new(store);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let exports = args.export.settings(&config.consumer, kafka.usage_topic());
    let notifier = notifier_config.map(|c| {
        let scheduler = notify::scheduler(store.clone(), clock.clone(), &c, exports);
        notify::spawn(store.clone(), clock.clone(), c, Some(scheduler), stopped)
    });
    let mut audit_config = projector::audit::AuditConfig::new(kafka.audit_topic());
    audit_config.consumer = args.audit_consumer;
    let audit_reader = KafkaReader::audit(&kafka, &audit_config.consumer).context("creating the audit consumer")?;
    let audit_log = Arc::new(KafkaAuditLog::new(&kafka).context("creating the audit producer")?);
    let relay = projector::audit::AuditRelay::new(store.clone(), audit_log, clock.clone(), audit_config.max_batch);
    let folder = projector::audit::AuditFolder::new(audit_reader, store.clone(), audit_config);
    let mut audit_stopped = stop.subscribe();
    let audit = tokio::spawn(projector::audit::run(Some(relay), folder, async move {
        let _ = audit_stopped.wait_for(|s| *s).await;
    }));
    let projector = Projector::new(reader, store, Arc::new(view), clock, config);
    serve_metrics(&args.metrics_listen).await?;
    info!("tollgate projector running");
    let folded = projector.run(shutdown_signal()).await.context("projector stopped");
    let _ = stop.send(true);
    if let Some(n) = notifier {
        n.await.context("notifier task")??;
    }
    audit.await.context("audit task")??;
    folded
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TOLLGATE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rdkafka=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve(a) => serve(*a).await,
        Command::Project(a) => project(a).await,
        Command::Dev(a) => dev::run(a).await,
        Command::Apply(a) => apply::run(a).await,
        Command::Notify(a) => {
            let config = a.notify.config()?;
            let store = PgStore::connect(&a.db.database_url).await.context("connecting to PostgreSQL")?;
            store.migrate().await.context("migrating PostgreSQL")?;
            let store = Arc::new(store);
            let clock: Arc<dyn Clock> = Arc::new(SystemClock);
            let exports = a.export.settings(&a.consumer, format!("{}usage", a.topic_prefix));
            let scheduler = notify::scheduler(store.clone(), clock.clone(), &config, exports);
            notify::run(store, clock, config, Some(scheduler), shutdown_signal()).await
        }
        Command::Replay(a) => {
            if !replay::run(a).await? {
                // The differences are printed; the status says there were some.
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Export(a) => {
            let status = export::run(*a).await?;
            if status != 0 {
                std::process::exit(status);
            }
            Ok(())
        }
        Command::Migrate(a) => {
            let store = PgStore::connect(&a.database_url).await.context("connecting to PostgreSQL")?;
            store.migrate().await.context("migrating")?;
            info!("migrations applied");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_more_than_zero_and_at_most_the_views_grace() {
        assert_eq!(parse_lease("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_lease("1h"), Ok(meter::view::LEASE_GRACE));
        for bad in ["0s", "61m", "2h"] {
            let e = parse_lease(bad).expect_err(bad);
            assert!(e.contains("at most 1h"), "{bad}: {e}");
        }
        assert!(parse_lease("soon").is_err());
    }

    #[test]
    fn serve_and_dev_refuse_a_lease_past_an_hour() {
        for args in [&["tollgate", "dev", "--lease", "2h"][..], &["tollgate", "serve", "--lease", "2h"]] {
            let e = Cli::try_parse_from(args).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("--lease") && e.contains("at most 1h"), "{args:?}: {e}");
        }
    }
}
