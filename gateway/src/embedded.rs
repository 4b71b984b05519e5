//! Tollgate in-process, with no external service: the embedded log and store
//! in one SQLite file, the in-memory view (or any other view, Redis for
//! instance), and the projector running as a task beside the gateway. It is
//! what `tollgate dev` runs and what a Rust service embeds under a
//! [`TollgateLayer`](crate::TollgateLayer). The fold, the verdict and the API
//! are the same code as the distributed deployment; only the ports differ.

use std::path::Path;
use std::sync::Arc;

use meter::{Clock, PortError, PortResult, Store, View};
use projector::{Projector, ProjectorConfig};
use store::{MemoryView, SqliteLog, SqliteStore};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::seeding::TailSource;
use crate::state::{AppState, Settings};

/// A running embedded Tollgate: the state to serve or layer, and its projector.
pub struct Embedded {
    pub state: AppState,
    stop: oneshot::Sender<()>,
    projector: JoinHandle<PortResult<()>>,
}

impl Embedded {
    /// Opens (or creates) the data file at `path` and starts the projector,
    /// with the in-memory view.
    pub async fn open(path: &Path, settings: Settings, clock: Arc<dyn Clock>) -> PortResult<Embedded> {
        Self::open_with_view(path, settings, clock, Arc::new(MemoryView::new())).await
    }

    /// As [`Embedded::open`], with the view given (Redis, when configured).
    pub async fn open_with_view(
        path: &Path,
        settings: Settings,
        clock: Arc<dyn Clock>,
        view: Arc<dyn View>,
    ) -> PortResult<Embedded> {
        let store = SqliteStore::open(path).await?;
        store.migrate().await?;
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        log.ensure_schema().await?;
        let reader = log.reader();
        let topic = log.usage_topic().to_owned();
        let store: Arc<dyn Store> = Arc::new(store);
        let config = ProjectorConfig::new(topic.clone());
        let tail = TailSource {
            tail: Arc::new(log.clone()),
            consumer: config.consumer.clone(),
            topic,
            flush_timeout: std::time::Duration::from_secs(5),
            lease_horizon: settings.lease + std::time::Duration::from_secs(30),
        };
        let state =
            AppState::new(store.clone(), view.clone(), Arc::new(log), clock.clone(), settings).with_log_tail(tail);
        let projector = Projector::new(reader, store, view, clock, config);
        let (stop, stopped) = oneshot::channel::<()>();
        let projector = tokio::spawn(projector.run(async move {
            let _ = stopped.await;
        }));
        Ok(Embedded { state, stop, projector })
    }

    /// How long [`Embedded::shutdown`] waits for queued publishes.
    pub const FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

    /// Waits (at most [`Embedded::FLUSH_TIMEOUT`]) until what the log still
    /// holds in its retry queue is on it, then stops the projector; what it
    /// folded is durable.
    pub async fn shutdown(self) -> PortResult<()> {
        if let Err(e) = self.state.log.flush(Self::FLUSH_TIMEOUT).await {
            tracing::warn!(error = %e, "shutting down with publishes still queued");
        }
        let _ = self.stop.send(());
        match self.projector.await {
            Ok(r) => r,
            Err(e) => Err(PortError::Permanent(format!("projector task: {e}"))),
        }
    }
}
