//! The notifier's settings, shared by `tollgate notify` (the notifier as
//! its own process), `serve` and `project` (which run it beside themselves
//! with `--notify`) and `dev` (which always runs it).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Args};
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

/// Runs a notifier until `shutdown`.
pub async fn run(
    webhooks: Arc<dyn WebhookStore>,
    clock: Arc<dyn Clock>,
    config: NotifierConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let notifier = Notifier::new(webhooks, clock, config).context("starting the notifier")?;
    notifier.run(shutdown).await.context("notifier stopped")
}

/// Runs a notifier in the background, stopping when `stop` fires.
pub fn spawn(
    webhooks: Arc<dyn WebhookStore>,
    clock: Arc<dyn Clock>,
    config: NotifierConfig,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    tokio::spawn(async move {
        let mut stop = stop;
        run(webhooks, clock, config, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
    })
}
