//! The notifier's settings, shared by `tollgate notify` (the notifier as
//! its own process), `serve` and `project` (which run it beside themselves
//! with `--notify`) and `dev` (which always runs it). A notifier delivers
//! the webhook outbox and runs the export schedules that are due.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Args};
use gateway::service::export_schedules::Scheduler;
use gateway::state::ExportSettings;
use meter::{Clock, WebhookStore};
use projector::notify::{Notifier, NotifierConfig};

#[derive(Args, Clone, Debug)]
pub struct NotifyArgs {
    /// Deliver to private, loopback and link-local addresses, and accept
    /// endpoints on them (off by default: a webhook URL must not reach
    /// into the network Tollgate runs in).
    #[arg(long, env = "TOLLGATE_WEBHOOK_ALLOW_PRIVATE", default_value_t = false, action = ArgAction::Set)]
    pub webhook_allow_private: bool,
    /// How long one delivery attempt may take.
    #[arg(long, env = "TOLLGATE_WEBHOOK_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub webhook_timeout: Duration,
    /// How long a notifier's claim on a delivery lasts (what a killed
    /// notifier's deliveries wait for another); above the timeout.
    #[arg(long, env = "TOLLGATE_NOTIFY_LEASE", default_value = "60s", value_parser = humantime::parse_duration)]
    pub notify_lease: Duration,
    /// Most deliveries attempted at once.
    #[arg(long, env = "TOLLGATE_NOTIFY_BATCH", default_value_t = 32)]
    pub notify_batch: usize,
    /// How often an idle notifier looks for due deliveries.
    #[arg(long, env = "TOLLGATE_NOTIFY_POLL", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub notify_poll: Duration,
}

impl NotifyArgs {
    pub fn config(&self) -> anyhow::Result<NotifierConfig> {
        if self.notify_lease <= self.webhook_timeout {
            anyhow::bail!("TOLLGATE_NOTIFY_LEASE must be longer than TOLLGATE_WEBHOOK_TIMEOUT");
        }
        if self.notify_batch == 0 || self.webhook_timeout.is_zero() {
            anyhow::bail!("TOLLGATE_NOTIFY_BATCH and TOLLGATE_WEBHOOK_TIMEOUT must be positive");
        }
        Ok(NotifierConfig {
            lease: chrono::Duration::from_std(self.notify_lease).context("--notify-lease")?,
            batch: self.notify_batch,
            timeout: self.webhook_timeout,
            allow_private: self.webhook_allow_private,
            poll: self.notify_poll,
            ..NotifierConfig::default()
        })
    }
}

/// Where scheduled export runs write and how far they may go: shared by
/// `serve` (its API runs too), `project` and `notify`.
#[derive(Args, Clone, Debug)]
pub struct ExportRunArgs {
    /// Where export runs write: an API run's file (`<run id>.<ext>`), a
    /// schedule's directory (its `destination` under this one).
    #[arg(long, env = "TOLLGATE_EXPORT_DIR", default_value = "tollgate-exports")]
    pub export_dir: std::path::PathBuf,
    /// Most rows one export run writes; past them it stops, marked ROWS.
    #[arg(long, env = "TOLLGATE_EXPORT_MAX_ROWS", default_value_t = 10_000_000)]
    pub export_max_rows: u64,
    /// How long one export run may write; past it it stops, marked TIME.
    #[arg(long, env = "TOLLGATE_EXPORT_MAX_TIME", default_value = "10m", value_parser = humantime::parse_duration)]
    pub export_max_time: Duration,
    /// How many customers of a charge period an export run reads at once (what bounds its memory).
    #[arg(long, env = "TOLLGATE_EXPORT_SLICE", default_value_t = gateway::service::exports::SLICE as u32,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub export_slice: u32,
}

impl ExportRunArgs {
    /// The settings of runs of the fold of `consumer` on the usage `topic`.
    pub fn settings(&self, consumer: &str, topic: String) -> ExportSettings {
        ExportSettings {
            dir: self.export_dir.clone(),
            max_rows: self.export_max_rows,
            max_time: self.export_max_time,
            slice: self.export_slice as usize,
            consumer: consumer.to_owned(),
            topic,
        }
    }
}

/// Runs a notifier (and, if given, the export scheduler beside it) until
/// `shutdown`.
pub async fn run(
    webhooks: Arc<dyn WebhookStore>,
    clock: Arc<dyn Clock>,
    config: NotifierConfig,
    scheduler: Option<Scheduler>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let notifier = Notifier::new(webhooks, clock, config).context("starting the notifier")?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let schedules = async move {
        let Some(scheduler) = scheduler else { return Ok(()) };
        let mut stopped = stopped;
        scheduler
            .run(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })
            .await
            .context("export scheduler stopped")
    };
    let deliveries = async move {
        let done = notifier.run(shutdown).await.context("notifier stopped");
        let _ = stop.send(true);
        done
    };
    let (delivered, scheduled) = tokio::join!(deliveries, schedules);
    delivered.and(scheduled)
}

/// Runs a notifier in the background, stopping when `stop` fires.
pub fn spawn(
    webhooks: Arc<dyn WebhookStore>,
    clock: Arc<dyn Clock>,
    config: NotifierConfig,
    scheduler: Option<Scheduler>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    tokio::spawn(async move {
        let mut stop = stop;
        run(webhooks, clock, config, scheduler, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
    })
}

/// The export scheduler of a notifier over `store`, named after the notifier's claimant.
pub fn scheduler<S: meter::Store + 'static>(
    store: Arc<S>,
    clock: Arc<dyn Clock>,
    config: &NotifierConfig,
    settings: ExportSettings,
) -> Scheduler {
    Scheduler::new(store.clone(), store.clone(), store, clock, settings, config.claimant.clone())
}
