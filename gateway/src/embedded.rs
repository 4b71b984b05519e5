//! Tollgate in-process, with no external service: the embedded store in one
//! SQLite file and the log in another beside it ([`log_path`]), the
//! in-memory view (or any other view, Redis for instance), and the projector
//! with the audit relay and folder beside the gateway, on a thread of their
//! own ([`Embedded::open_with_view`] says why). It is
//! what `tollgate dev` runs and what a Rust service embeds under a
//! [`TollgateLayer`](crate::TollgateLayer). The fold, the verdict and the API
//! are the same code as the distributed deployment; only the ports differ.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use meter::{Clock, LogReader, PortError, PortResult, Store, View};
use projector::audit::{AuditConfig, AuditFolder, AuditRelay};
use projector::{Projector, ProjectorConfig};
use store::{MemoryView, SqliteLog, SqliteStore};
use tokio::sync::{oneshot, watch};

use crate::seeding::TailSource;
use crate::state::{AppState, Settings};

/// The file of the embedded log beside the store's data file `path`:
/// `tollgate.db` → `tollgate-log.db`. The log has a file of its own because
/// SQLite has one writer per file: in one file, every group commit of the
/// log waited for the fold's transaction and the other way round.
pub fn log_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().map_or_else(|| "tollgate".into(), |s| s.to_string_lossy().into_owned());
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!("{stem}-log{ext}"))
}

/// Opens (or creates) the embedded log beside the data file `path`
/// ([`log_path`]), topics `tollgate.*`. A data file from before the log had
/// a file of its own holds the log itself: its records move into the log's
/// file first, offsets kept ([`SqliteLog::take_over`]), so the positions the
/// projector stored still name the same records.
pub async fn open_log(path: &Path) -> PortResult<SqliteLog> {
    let file = log_path(path);
    let log = SqliteLog::new(SqliteStore::open(&file).await?.pool().clone(), "tollgate.");
    log.ensure_schema().await?;
    if path.exists() {
        let moved = log.take_over(path).await?;
        if moved > 0 {
            let (from, to) = (path.display(), file.display());
            tracing::info!(records = moved, %from, %to, "moved the embedded log into a file of its own");
        }
    }
    Ok(log)
}

/// A running embedded Tollgate: the state to serve or layer, its projector,
/// and beside it the audit relay and folder (the audit outbox to the
/// file's audit topic, that topic to the audit log).
pub struct Embedded {
    pub state: AppState,
    folding: FoldThread,
}

/// A projector, and the audit relay and folder when given, on a thread of
/// their own (`tollgate-fold`, with a current-thread runtime) until
/// [`FoldThread::stop`] or until dropped (they stop at their next await).
pub struct FoldThread {
    stop: watch::Sender<()>,
    /// What the projector and the audit tasks ended with.
    ended: oneshot::Receiver<(PortResult<()>, PortResult<()>)>,
}

impl FoldThread {
    /// Starts `projector` (and `audit`) on a new thread.
    pub fn spawn<R, A>(projector: Projector<R>, audit: Option<(AuditRelay, AuditFolder<A>)>) -> PortResult<FoldThread>
    where
        R: LogReader + 'static,
        A: LogReader + 'static,
    {
        let (stop, stopped) = watch::channel(());
        let until_stopped = move || {
            let mut stopped = stopped.clone();
            // A send, or the sender's drop.
            async move {
                let _ = stopped.changed().await;
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| PortError::Permanent(format!("the projector's runtime: {e}")))?;
        let (done, ended) = oneshot::channel();
        std::thread::Builder::new()
            .name("tollgate-fold".into())
            .spawn(move || {
                let both = runtime.block_on(async {
                    let audit = async {
                        match audit {
                            Some((relay, folder)) => projector::audit::run(Some(relay), folder, until_stopped()).await,
                            None => Ok(()),
                        }
                    };
                    tokio::join!(projector.run(until_stopped()), audit)
                });
                let _ = done.send(both);
            })
            .map_err(|e| PortError::Permanent(format!("the projector's thread: {e}")))?;
        Ok(FoldThread { stop, ended })
    }

    /// Stops them and waits for them to end; the projector's own error
    /// first, then the audit's.
    pub async fn stop(self) -> PortResult<()> {
        let _ = self.stop.send(());
        match self.ended.await {
            Ok((folded, audit)) => folded.and(audit),
            Err(_) => Err(PortError::Permanent("the projector's thread ended without an answer (a panic)".into())),
        }
    }
}

impl Embedded {
    /// Opens (or creates) the data file at `path` and starts the projector,
    /// with the in-memory view.
    pub async fn open(path: &Path, settings: Settings, clock: Arc<dyn Clock>) -> PortResult<Embedded> {
        Self::open_with_view(path, settings, clock, Arc::new(MemoryView::new())).await
    }

    /// As [`Embedded::open`], with the view given (Redis, when configured).
    ///
    /// The projector and the audit relay and folder run on a thread of
    /// their own (`tollgate-fold`, a current-thread runtime), not as tasks
    /// of the caller's runtime: a fold step is CPU work between its awaits
    /// (decoding a batch, posting it), and as a task it held one of the
    /// runtime's workers while requests waited for it. On a thread of its
    /// own the operating system shares the cores between it and the
    /// requests instead.
    pub async fn open_with_view(
        path: &Path,
        settings: Settings,
        clock: Arc<dyn Clock>,
        view: Arc<dyn View>,
    ) -> PortResult<Embedded> {
        let store = SqliteStore::open(path).await?;
        store.migrate().await?;
        let log = open_log(path).await?;
        let reader = log.reader();
        let audit_reader = log.audit_reader();
        let audit_config = AuditConfig::new(log.audit_topic());
        let topic = log.usage_topic().to_owned();
        let store: Arc<dyn Store> = Arc::new(store);
        let config = ProjectorConfig::new(topic.clone());
        // Exports read this fold, and write beside the data file unless told.
        let mut settings = settings;
        settings.exports.topic = topic.clone();
        settings.exports.consumer = config.consumer.clone();
        if settings.exports.dir == crate::state::ExportSettings::default().dir
            && let Some(dir) = path.parent()
        {
            settings.exports.dir = dir.join("exports");
        }
        let tail = TailSource {
            tail: Arc::new(log.clone()),
            consumer: config.consumer.clone(),
            topic,
            flush_timeout: std::time::Duration::from_secs(5),
            lease_horizon: settings.lease + std::time::Duration::from_secs(30),
        };
        let log = Arc::new(log);
        let relay = AuditRelay::new(store.clone(), log.clone(), clock.clone(), audit_config.max_batch);
        let folder = AuditFolder::new(audit_reader, store.clone(), audit_config);
        let state = AppState::new(store.clone(), view.clone(), log, clock.clone(), settings).with_log_tail(tail);
        let projector = Projector::new(reader, store, view, clock, config);
        let folding = FoldThread::spawn(projector, Some((relay, folder)))?;
        Ok(Embedded { state, folding })
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
        self.folding.stop().await
    }
}
