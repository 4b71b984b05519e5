//! `tollgate replay`: rebuilds every aggregate from offset 0 into a shadow
//! (a schema next to the live one in PostgreSQL, or a second SQLite file
//! beside the one of `tollgate dev`) with the projector's own fold, while
//! the live projector runs; compares the shadow with the live aggregates
//! row by row and prints the differences; with `--swap`, makes the shadow
//! live and re-seeds the view.
//!
//! - **The same fold.** A [`Projector`] folds the shadow, over a reader
//!   bounded at the live offsets ([`Bounded`]), with an in-memory view of
//!   its own, and with dead letters kept in the shadow's outbox only (the
//!   live fold published them): nothing is sent anywhere. What the fold
//!   reads besides the log — projects, every version of the price book and
//!   the quotas — is copied from the live store before each stretch (see
//!   [`store::sql::shadow`]).
//! - **A consistent cut.** The live offsets and the live tables are read in
//!   one snapshot; the shadow is folded to exactly those offsets before the
//!   two are compared, so the live projector never has to stop.
//! - **Notifications.** The shadow's fold makes quota notifications into
//!   the shadow's own outbox, which has no endpoints: a replay sends
//!   nothing. The dedup keys of both outboxes are compared and reported
//!   (which notifications a fold makes depends on the quotas as they stood
//!   when it ran, which are not on the log, so they are no difference of the
//!   aggregates); `--swap` leaves the live outbox as it is, so the live
//!   fold after it finds every notification it made already enqueued and
//!   makes none of them again.
//! - **`--swap`** copies the shadow's rows over the live ones in one
//!   transaction that holds the live offsets still and finds the shadow at
//!   them (else the shadow folds on to where the live fold got, and it
//!   tries again), then deletes the view's keys so every gateway re-seeds.
//!
//! - **The audit log** is rebuilt in the shadow from the audit topic by the
//!   audit folder's own code, up to the offsets the live audit folder stood
//!   at in the same snapshot, and compared row by row, the entries of every
//!   project and the installation-wide ones (writes of prices) alike (never
//!   swapped: see [`store::sql::shadow::AUDIT_TABLES`]). Nothing is published: the
//!   shadow's audit outbox (the entries its fold makes: corrections and
//!   monitor breaches) is never relayed.
//!
//! The exit status is 1 when the shadow and the live aggregates differ
//! (with `--swap`, after swapping: the differences were real), 0 when not.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::Utc;
use clap::Args;
use gateway::state::SystemClock;
use indicatif::{ProgressBar, ProgressStyle};
use meter::{Clock, Ledger, LogReader, PortError, PortResult};
use projector::audit::{AuditConfig, AuditFolder};
use projector::replay::Bounded;
use projector::{Projector, ProjectorConfig};
use store::sql::Backend;
use store::sql::shadow::{AUDIT_TABLES, Cut, Difference, Swap, diff, diff_in};
use store::{KafkaReader, MemoryView, PgStore, RedisView, SqlStore, SqliteStore};
use tracing::warn;

use crate::Backends;

#[derive(Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    backends: Backends,
    /// Replay the embedded log and store of `tollgate dev` in this
    /// directory (the shadow is `tollgate-shadow.db` there) instead of
    /// Kafka and PostgreSQL.
    #[arg(long, env = "TOLLGATE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The live projector's consumer name (whose offsets and dead letters
    /// the shadow rebuilds).
    #[arg(long, env = "TOLLGATE_CONSUMER", default_value = "tollgate-projector")]
    consumer: String,
    /// The live audit folder's consumer name: the shadow's audit log is
    /// rebuilt from the audit topic up to its offsets and compared.
    #[arg(long, env = "TOLLGATE_AUDIT_CONSUMER", default_value = "tollgate-audit")]
    audit_consumer: String,
    /// The PostgreSQL schema the shadow is built in (dropped and created
    /// afresh), next to the live one.
    #[arg(long, env = "TOLLGATE_SHADOW_SCHEMA", default_value = "tollgate_shadow")]
    shadow_schema: String,
    /// Most records folded in one transaction.
    #[arg(long, env = "TOLLGATE_MAX_BATCH", default_value_t = 5000)]
    max_batch: usize,
    /// Make the shadow live (atomically) and re-seed the view.
    #[arg(long)]
    swap: bool,
    /// How many differences to print (all are counted).
    #[arg(long, default_value_t = 50)]
    show: usize,
}

/// What a replay did.
#[derive(Debug, Default)]
struct Outcome {
    records: u64,
    folded: u64,
    duplicates: u64,
    dead_lettered: u64,
    elapsed: Duration,
    compared_rows: usize,
    /// Audit entries the shadow folded from the audit topic.
    audit_entries: usize,
    differences: Vec<Difference>,
    /// The dedup keys of the quota notifications only the live outbox holds,
    /// and only the shadow's (reported, never sent, never a difference).
    notifications: (usize, Vec<String>, Vec<String>),
    swapped: bool,
}

/// Runs the replay; `Ok(false)` when the shadow and the live aggregates differ.
pub async fn run(args: ReplayArgs) -> anyhow::Result<bool> {
    if args.max_batch == 0 {
        bail!("--max-batch must be positive");
    }
    let outcome = match &args.data_dir {
        Some(dir) => embedded(&args, dir).await?,
        None => distributed(&args).await?,
    };
    report(&outcome, args.show);
    Ok(outcome.differences.is_empty())
}

async fn distributed(args: &ReplayArgs) -> anyhow::Result<Outcome> {
    let b = &args.backends;
    let live = b.store().await?;
    let shadow = PgStore::create_shadow_schema(&b.db.database_url, &args.shadow_schema)
        .await
        .with_context(|| format!("creating the shadow schema {}", args.shadow_schema))?;
    let kafka = b.kafka();
    let reader =
        KafkaReader::new(&kafka, &format!("{}-replay", args.consumer)).context("creating the Kafka consumer")?;
    let audit_reader = KafkaReader::audit(&kafka, &format!("{}-replay", args.audit_consumer))
        .context("creating the audit consumer")?;
    let topic = kafka.usage_topic();
    let audit = AuditSide { reader: audit_reader, consumer: args.audit_consumer.clone(), topic: kafka.audit_topic() };
    let schema = args.shadow_schema.clone();
    let swap = async |expected: &BTreeMap<i32, i64>| live.swap_in_pg(&schema, &args.consumer, &topic, expected).await;
    let outcome =
        rebuild(&live, shadow, reader, audit, &args.consumer, &topic, args.max_batch, args.swap.then_some(swap))
            .await?;
    if outcome.swapped {
        let view = RedisView::connect(&b.redis_url, &b.redis_prefix).await.context("connecting to Redis")?;
        let n = view.forget_all().await.context("invalidating the view")?;
        println!("view invalidated: {n} keys under {:?} deleted; gateways re-seed at their next check", b.redis_prefix);
    }
    Ok(outcome)
}

async fn embedded(args: &ReplayArgs, dir: &std::path::Path) -> anyhow::Result<Outcome> {
    let path = dir.join("tollgate.db");
    if !path.exists() {
        bail!("{} does not exist (is {} the data directory of `tollgate dev`?)", path.display(), dir.display());
    }
    let live = SqliteStore::open(&path).await.with_context(|| format!("opening {}", path.display()))?;
    live.migrate().await.context("migrating the embedded store")?;
    let shadow_path = dir.join("tollgate-shadow.db");
    let shadow = SqliteStore::create_shadow_file(&shadow_path)
        .await
        .with_context(|| format!("creating {}", shadow_path.display()))?;
    let log = gateway::embedded::open_log(&path)
        .await
        .with_context(|| format!("opening the log beside {}", path.display()))?;
    let topic = log.usage_topic().to_owned();
    let reader = log.reader();
    let audit = AuditSide {
        reader: log.audit_reader(),
        consumer: args.audit_consumer.clone(),
        topic: log.audit_topic().into(),
    };
    let swap =
        async |expected: &BTreeMap<i32, i64>| live.swap_in_sqlite(&shadow_path, &args.consumer, &topic, expected).await;
    let outcome =
        rebuild(&live, shadow, reader, audit, &args.consumer, &topic, args.max_batch, args.swap.then_some(swap))
            .await?;
    if outcome.swapped {
        println!(
            "the view of a running `tollgate dev` is in its memory: restart it so the view is seeded from the swapped store"
        );
    }
    Ok(outcome)
}

fn report(o: &Outcome, show: usize) {
    let secs = o.elapsed.as_secs_f64().max(1e-9);
    println!(
        "replayed {} records in {:.2} s ({:.0} records/s): {} folded, {} duplicates, {} dead-lettered",
        o.records,
        o.elapsed.as_secs_f64(),
        o.records as f64 / secs,
        o.folded,
        o.duplicates,
        o.dead_lettered
    );
    println!("audit log: {} entries rebuilt from the audit topic", o.audit_entries);
    if o.differences.is_empty() {
        println!("compared {} rows: no differences", o.compared_rows);
    } else {
        println!("compared {} rows: {} differences", o.compared_rows, o.differences.len());
        for d in o.differences.iter().take(show) {
            println!("  {d}");
        }
        if o.differences.len() > show {
            println!("  … and {} more", o.differences.len() - show);
        }
    }
    let (made, only_live, only_shadow) = &o.notifications;
    println!(
        "notifications: the shadow's fold made {made} (sent none); {} only live, {} only in the shadow",
        only_live.len(),
        only_shadow.len()
    );
    for k in only_live.iter().chain(only_shadow).take(show) {
        println!("  notification {k}: {}", if only_live.contains(k) { "only live" } else { "only in the shadow" });
    }
    if o.swapped {
        println!("swapped: the shadow's aggregates are live");
    }
}

/// The shadow's projector and what it has done.
struct Shadow<B: Backend, R: LogReader> {
    store: SqlStore<B>,
    projector: Projector<Bounded<R>>,
    consumer: String,
    topic: String,
    bar: ProgressBar,
    outcome: Outcome,
}

/// Stretches folded up to the live offsets before the cut is taken (the
/// last stretch is folded with the snapshot open, however long it is).
const CATCH_UP_ROUNDS: usize = 20;

/// How long the shadow may read nothing while short of its bound.
const STALL: Duration = Duration::from_secs(60);

impl<B: Backend, R: LogReader> Shadow<B, R> {
    /// A shadow at offset 0: the projector's own fold over `reader`, into
    /// `store`, with a view of its own, publishing no dead letters.
    async fn new(
        store: SqlStore<B>,
        mut reader: R,
        consumer: &str,
        topic: &str,
        max_batch: usize,
    ) -> anyhow::Result<Self> {
        let ends = reader.ends().await.unwrap_or_default();
        let bar = ProgressBar::new(u64::try_from(sum(&ends)).unwrap_or(0));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {elapsed_precise} [{bar:30}] {pos}/{len} offsets · {per_sec} · ETA {eta} · {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        let mut config = ProjectorConfig::new(topic);
        config.consumer = consumer.to_owned();
        config.max_batch = max_batch;
        config.publish_dead_letters = false;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let shadow: Arc<dyn meter::Store> = Arc::new(store.clone());
        let mut projector = Projector::new(Bounded::new(reader), shadow, Arc::new(MemoryView::new()), clock, config);
        projector.start().await.context("positioning the shadow at offset 0")?;
        Ok(Shadow {
            store,
            projector,
            consumer: consumer.to_owned(),
            topic: topic.to_owned(),
            bar,
            outcome: Outcome::default(),
        })
    }

    /// Folds the shadow to exactly `target` (live offsets read before the
    /// call), having copied the fold's inputs from the live store first.
    async fn fold_to(&mut self, live: &SqlStore<B>, target: &BTreeMap<i32, i64>) -> anyhow::Result<()> {
        self.store.copy_fold_inputs(live).await.context("copying projects, prices and quotas into the shadow")?;
        self.projector.reader_mut().set_until(target.clone());
        let mut idle_since = Instant::now();
        while !self.projector.reader_mut().reached() {
            match self.projector.step().await {
                Ok(r) => {
                    if r.read > 0 {
                        idle_since = Instant::now();
                    } else if idle_since.elapsed() > STALL {
                        bail!("the shadow read nothing for {STALL:?} short of the live offsets {target:?}");
                    }
                    self.outcome.records += r.read as u64;
                    self.outcome.folded += r.folded as u64;
                    self.outcome.duplicates += r.duplicates as u64;
                    self.outcome.dead_lettered += r.dead_lettered as u64;
                    let pos: i64 = self.projector.reader_mut().positions().values().sum();
                    self.bar.set_position(u64::try_from(pos).unwrap_or(0));
                    self.bar.set_message(format!(
                        "{} records, {} folded, {} dead-lettered",
                        self.outcome.records, self.outcome.folded, self.outcome.dead_lettered
                    ));
                }
                Err(PortError::Permanent(e)) => bail!("the shadow's fold stopped: {e}"),
                Err(e) => {
                    warn!(error = %e, "shadow step failed; re-seeking to the shadow's offsets");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    self.projector.start().await.context("re-positioning the shadow")?;
                }
            }
        }
        Ok(())
    }

    async fn offsets(&self) -> PortResult<BTreeMap<i32, i64>> {
        self.store.offsets(&self.consumer, &self.topic).await
    }
}

/// Folds the whole log into `shadow` (fresh) up to exactly `target`, with
/// the projector's own fold (the inputs it reads besides the log copied
/// from `live`), and gives the shadow back with how many records it read:
/// what `tollgate export --verify` counts the log with.
pub(crate) async fn fold_log<B: Backend, R: LogReader>(
    live: &SqlStore<B>,
    shadow: SqlStore<B>,
    reader: R,
    consumer: &str,
    topic: &str,
    target: &BTreeMap<i32, i64>,
) -> anyhow::Result<(SqlStore<B>, u64)> {
    let mut s = Shadow::new(shadow, reader, consumer, topic, 5000).await?;
    s.fold_to(live, target).await?;
    s.bar.finish_and_clear();
    Ok((s.store, s.outcome.records))
}

fn sum(m: &BTreeMap<i32, i64>) -> i64 {
    m.values().copied().fold(0i64, i64::saturating_add)
}

/// The audit topic, and the live audit folder's consumer name.
struct AuditSide<R: LogReader> {
    reader: R,
    consumer: String,
    topic: String,
}

/// Folds the audit topic into the shadow's audit log up to `target` (the
/// live audit folder's offsets), with the folder's own code. Returns how
/// many entries it folded.
async fn rebuild_audit<R: LogReader>(
    shadow: Arc<dyn meter::Store>,
    side: AuditSide<R>,
    target: &BTreeMap<i32, i64>,
    max_batch: usize,
) -> anyhow::Result<usize> {
    let mut config = AuditConfig::new(side.topic);
    config.consumer = side.consumer;
    config.max_batch = max_batch;
    let mut folder = AuditFolder::new(Bounded::new(side.reader), shadow, config);
    folder.start().await.context("positioning the shadow's audit folder")?;
    folder.reader_mut().set_until(target.clone());
    let (mut folded, mut idle_since) = (0, Instant::now());
    while !folder.reader_mut().reached() {
        match folder.step().await {
            Ok(r) if r.read > 0 => {
                folded += r.folded;
                idle_since = Instant::now();
            }
            Ok(_) if idle_since.elapsed() > STALL => {
                bail!("the shadow's audit folder read nothing for {STALL:?} short of the live offsets {target:?}")
            }
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "shadow audit step failed; re-seeking");
                tokio::time::sleep(Duration::from_millis(300)).await;
                folder.start().await.context("re-positioning the shadow's audit folder")?;
            }
        }
    }
    Ok(folded)
}

/// Replays into `shadow`, compares with `live` (the audit log too), and
/// swaps if given how.
#[allow(clippy::too_many_arguments)]
async fn rebuild<B, R, F>(
    live: &SqlStore<B>,
    shadow: SqlStore<B>,
    reader: R,
    audit: AuditSide<R>,
    consumer: &str,
    topic: &str,
    max_batch: usize,
    swap: Option<F>,
) -> anyhow::Result<Outcome>
where
    B: Backend,
    R: LogReader,
    F: AsyncFn(&BTreeMap<i32, i64>) -> PortResult<Swap>,
{
    for t in shadow.uncompared_tables().await.context("listing the shadow's tables")? {
        warn!(table = %t, "table not compared by replay (add it to store::sql::shadow::FOLD_TABLES if the fold writes it)");
    }
    let mut s = Shadow::new(shadow, reader, consumer, topic, max_batch).await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let defaults = ProjectorConfig::new(topic);
    let keep = defaults.horizon + defaults.receipt_disorder;
    let started = Instant::now();

    // Most of the log, without holding anything of the live store: up to
    // where the live fold stands, again and again while it moves on.
    for _ in 0..CATCH_UP_ROUNDS {
        let target = live.offsets(consumer, topic).await.context("reading the live offsets")?;
        let at = s.projector.reader_mut().positions().clone();
        let behind: i64 = target.iter().map(|(p, o)| o - at.get(p).copied().unwrap_or(0)).sum();
        if let Ok(ends) = s.projector.reader_mut().ends().await {
            s.bar.set_length(u64::try_from(sum(&ends).max(sum(&target))).unwrap_or(0));
        }
        if behind <= i64::try_from(max_batch).unwrap_or(i64::MAX) {
            break;
        }
        s.fold_to(live, &target).await?;
    }

    // The cut: the live side in one snapshot, the shadow folded to its offsets.
    let mut snap = live.snapshot().await.context("opening a snapshot of the live store")?;
    let target = snap.offsets(consumer, topic).await.context("reading the live offsets")?;
    s.fold_to(live, &target).await?;
    s.bar.finish_and_clear();
    s.outcome.elapsed = started.elapsed();
    let newest = snap.newest_receipt(consumer, topic).await?;
    let processed_since = newest
        .map(|n| n.min(clock.now()))
        .and_then(|n| n.checked_sub_signed(keep))
        .unwrap_or(chrono::DateTime::<Utc>::UNIX_EPOCH);
    let cut = Cut { consumer: consumer.to_owned(), topic: topic.to_owned(), processed_since };
    let live_state = snap.fold_state(&cut).await.context("reading the live aggregates")?;
    let live_keys = snap.notification_keys().await.context("reading the live outbox")?;
    // The audit log, as of the same instant, and where the live audit
    // folder stood then.
    let audit_target = snap.offsets(&audit.consumer, &audit.topic).await.context("reading the audit offsets")?;
    let live_audit = snap.audit_state().await.context("reading the live audit log")?;
    snap.close().await?;
    let shadow_state = s.store.fold_state(&cut).await.context("reading the shadow's aggregates")?;
    let shadow_keys = s.store.notification_keys().await.context("reading the shadow's outbox")?;
    s.outcome.notifications = (
        shadow_keys.len(),
        live_keys.difference(&shadow_keys).cloned().collect(),
        shadow_keys.difference(&live_keys).cloned().collect(),
    );
    s.outcome.compared_rows = live_state.rows().max(shadow_state.rows());
    s.outcome.differences = diff(&live_state, &shadow_state);
    let shadow_store: Arc<dyn meter::Store> = Arc::new(s.store.clone());
    s.outcome.audit_entries = rebuild_audit(shadow_store, audit, &audit_target, max_batch).await?;
    let shadow_audit = s.store.audit_state().await.context("reading the shadow's audit log")?;
    s.outcome.compared_rows += live_audit.rows().max(shadow_audit.rows());
    s.outcome.differences.extend(diff_in(AUDIT_TABLES, &live_audit, &shadow_audit));

    if let Some(swap) = swap {
        for attempt in 0.. {
            let at = s.offsets().await?;
            match swap(&at).await.context("swapping the shadow in")? {
                Swap::Done => {
                    s.outcome.swapped = true;
                    break;
                }
                Swap::Moved(now) if attempt < 20 => s.fold_to(live, &now).await?,
                Swap::Moved(_) => bail!("the live projector kept moving past the shadow; nothing swapped"),
            }
        }
    }
    Ok(s.outcome)
}
