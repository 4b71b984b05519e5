//! Billing exports: one run of an export (issue 11, DESIGN §13).
//!
//! A run reads the fold through one cut ([`meter::FoldCut`]: its offsets,
//! the watermark, and every total agree), and for each charge period of the
//! export — those with counters or a breakdown by model, those earlier runs
//! wrote, and every period since the project's first storage fact — writes
//! what the fold holds less what the earlier runs wrote ([`meter::export::run`]):
//! usage in its own period until a complete run has seen the period closed
//! (its end plus the grace), after which what is folded for it is a
//! correction in the period open at the run. Rows are written as they
//! come, to a file or to a directory laid out
//! `project=<id>/period=<billing period>/part-<run>.<ext>`.
//!
//! **Memory is bounded by a slice, whatever the size.** A charge period is
//! read in slices of [`SLICE`] customers (by their encoded dimension,
//! bytewise: [`DimRange`]), the same range on the fold and on what earlier
//! runs wrote; a slice's rows are written and then recorded against the run
//! ([`ExportStore::record_export_lines`]) before the next slice is read.
//!
//! The run ends in one transaction that stores how it ended (its recorded
//! lines then count for the next run, which subtracts them; a failed run's
//! are dropped) and its audit entry. A run stops early at
//! its row cap or time bound (ADR-0196 decision 1): it is then `partial`,
//! marked `ROWS` or `TIME`, and what it did not write the next run does.
//! A complete run is reconciled: every line's sum over all runs, as the
//! store now holds it, against the fold in the run's cut.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use meter::export::format::{CsvOut, JsonLinesOut, RunInfo};
use meter::export::{
    Amounts, Check, DimRange, ExportRun, ExportSpec, ExportedLine, Format, Line, Mark, Period, Reconciliation, Row,
    RunStatus, folded_lines, period_of, run,
};
use meter::{
    AuditAction, AuditDetail, AuditEntry, Clock, ExportStore, FoldCut, Principal, StoredStorageFact, TenantStore,
};
use meter::{WindowKind, window_at};

use super::{Error, Result};
use crate::state::{AppState, new_audit_id, new_id};

/// Where a run's rows go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// One file.
    File(PathBuf),
    /// A directory: a file per billing period, `project=<id>/period=<key>/part-<run>.<ext>`.
    Dir(PathBuf),
    /// One file in a directory, named after the run: `<run id>.<ext>` (the API's runs).
    Named(PathBuf),
}

/// One run asked for.
#[derive(Debug, Clone)]
pub struct ExportRequest {
    pub spec: ExportSpec,
    pub format: Format,
    pub out: Output,
    /// Most rows the run writes; past them it stops, marked `ROWS`.
    pub max_rows: u64,
    /// How long it may run; past it it stops, marked `TIME`.
    pub max_time: Duration,
    /// How many customers of a charge period it reads (and holds) at once.
    pub slice: usize,
    /// The projector whose fold is exported (its consumer name and the usage topic).
    pub consumer: String,
    pub topic: String,
    pub principal: Option<Principal>,
    /// The schedule that starts the run, if one does.
    pub schedule_id: Option<String>,
}

/// A byte-counting writer.
struct Counting {
    inner: BufWriter<File>,
    bytes: Arc<AtomicU64>,
}

impl Write for Counting {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

enum Sink {
    Csv(CsvOut<Counting>),
    Jsonl(JsonLinesOut<Counting>),
    #[cfg(feature = "parquet")]
    Parquet(crate::parquet::ParquetOut<Counting>),
}

impl Sink {
    fn open(format: Format, path: &Path, bytes: Arc<AtomicU64>) -> io::Result<Sink> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let w = Counting { inner: BufWriter::new(File::create(path)?), bytes };
        Ok(match format {
            Format::Csv => Sink::Csv(CsvOut::new(w)?),
            Format::Jsonl => Sink::Jsonl(JsonLinesOut::new(w)),
            #[cfg(feature = "parquet")]
            Format::Parquet => Sink::Parquet(crate::parquet::ParquetOut::new(w)?),
            #[cfg(not(feature = "parquet"))]
            Format::Parquet => {
                return Err(io::Error::new(io::ErrorKind::Unsupported, "this build has no Parquet writer"));
            }
        })
    }

    fn row(&mut self, info: &RunInfo, row: &Row) -> io::Result<()> {
        match self {
            Sink::Csv(s) => s.row(info, row),
            Sink::Jsonl(s) => s.row(info, row),
            #[cfg(feature = "parquet")]
            Sink::Parquet(s) => s.row(info, row),
        }
    }

    fn finish(self) -> io::Result<()> {
        let mut w = match self {
            Sink::Csv(s) => s.finish()?,
            Sink::Jsonl(s) => s.finish()?,
            #[cfg(feature = "parquet")]
            Sink::Parquet(s) => s.finish()?,
        };
        w.flush()?;
        w.inner.get_ref().sync_all()
    }
}

/// The files of a run: one, or one per billing period.
struct Files {
    format: Format,
    out: Output,
    run_id: String,
    project: String,
    open: BTreeMap<String, Sink>,
    bytes: Arc<AtomicU64>,
    /// Every file the run created, to remove if it fails.
    created: Vec<PathBuf>,
}

impl Files {
    fn path(&self, billing_period: &str) -> PathBuf {
        match &self.out {
            Output::File(p) => p.clone(),
            Output::Named(d) => d.join(format!("{}.{}", self.run_id, self.format.extension())),
            Output::Dir(d) => d
                .join(format!("project={}", self.project))
                .join(format!("period={billing_period}"))
                .join(format!("part-{}.{}", self.run_id, self.format.extension())),
        }
    }

    fn key<'a>(&self, billing_period: &'a str) -> &'a str {
        match self.out {
            Output::File(_) | Output::Named(_) => "",
            Output::Dir(_) => billing_period,
        }
    }

    fn row(&mut self, info: &RunInfo, row: &Row) -> io::Result<()> {
        let key = self.key(&row.billing_period.key).to_owned();
        if !self.open.contains_key(&key) {
            let path = self.path(&row.billing_period.key);
            self.created.push(path.clone());
            let sink = Sink::open(self.format, &path, self.bytes.clone())?;
            self.open.insert(key.clone(), sink);
        }
        match self.open.get_mut(&key) {
            Some(s) => s.row(info, row),
            None => Err(io::Error::other("the file just opened is gone")),
        }
    }

    /// Finishes the files no row of a later charge period can reach: every
    /// billing period's but the open one's (corrections go there).
    fn close_before(&mut self, open: &str) -> io::Result<()> {
        let done: Vec<String> = self.open.keys().filter(|k| !k.is_empty() && k.as_str() != open).cloned().collect();
        for k in done {
            if let Some(s) = self.open.remove(&k) {
                s.finish()?;
            }
        }
        Ok(())
    }

    /// Finishes every file; a single-file run with no rows still writes its
    /// (empty) file, so a reader finds the header.
    fn finish(&mut self) -> io::Result<String> {
        if !matches!(self.out, Output::Dir(_)) && self.open.is_empty() {
            self.created.push(self.path(""));
            let sink = Sink::open(self.format, &self.path(""), self.bytes.clone())?;
            self.open.insert(String::new(), sink);
        }
        for (_, s) in std::mem::take(&mut self.open) {
            s.finish()?;
        }
        Ok(match &self.out {
            Output::Dir(d) => d.display().to_string(),
            _ => self.path("").display().to_string(),
        })
    }
}

/// The periods of `kind` from the one holding `from` to the one holding `to`.
fn periods_between(kind: WindowKind, tz: Tz, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<String> {
    let mut out = Vec::new();
    let mut t = from;
    while t <= to {
        let w = window_at(kind, tz, t);
        out.push(w.key.clone());
        match w.resets_at.filter(|r| *r > t) {
            Some(r) => t = r,
            None => break,
        }
    }
    out
}

/// A run through the API: bounded by the server's settings, its file in
/// the server's export directory.
pub async fn start(s: &AppState, spec: ExportSpec, format: Format, principal: Principal) -> Result<ExportRun> {
    let x = &s.settings.exports;
    let req = ExportRequest {
        spec,
        format,
        out: Output::Named(x.dir.clone()),
        max_rows: x.max_rows,
        max_time: x.max_time,
        slice: x.slice,
        consumer: x.consumer.clone(),
        topic: x.topic.clone(),
        principal: Some(principal),
        schedule_id: None,
    };
    run_export(s.stores.tenants.as_ref(), s.stores.exports.as_ref(), s.clock.as_ref(), &req, &|_, _| {}).await
}

/// A run, by id.
pub async fn get(s: &AppState, id: &str) -> Result<ExportRun> {
    s.stores.exports.export_run(id).await?.ok_or_else(|| Error::not_found("export run", id))
}

/// A project's newest runs, newest first, at most `limit` (404 if there is
/// no such project).
pub async fn runs(s: &AppState, project: &meter::ProjectId, limit: usize) -> Result<Vec<ExportRun>> {
    if s.stores.tenants.project(project).await?.is_none() {
        return Err(Error::not_found("project", project.as_str()));
    }
    Ok(s.stores.exports.export_runs(project, limit).await?)
}

/// The file of a run, if it is one this server wrote and holds: a run that
/// did not fail, whose file lies under the server's export directory (a
/// run of `tollgate export` wrote elsewhere, on its own host).
pub fn server_file(s: &AppState, run: &ExportRun) -> Option<PathBuf> {
    if run.status == RunStatus::Failed {
        return None;
    }
    let path = Path::new(run.file.as_deref()?);
    path.starts_with(&s.settings.exports.dir).then(|| path.to_path_buf())
}

/// How many customers of a charge period a run reads (and holds) at once,
/// unless told otherwise.
pub const SLICE: usize = 2048;

/// How the run went, before it is stored.
struct Progress {
    rows: u64,
    mark: Option<Mark>,
}

/// Runs one export: see the module doc. The run is stored whatever
/// happens once it started: a run that fails says so (`failed`, with why)
/// and is returned as such, having written nothing the next run would
/// not write again. `progress` is told the rows and bytes written so far.
pub async fn run_export(
    tenants: &dyn TenantStore,
    exports: &dyn ExportStore,
    clock: &dyn Clock,
    req: &ExportRequest,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<ExportRun> {
    let project = tenants
        .project(&req.spec.project_id)
        .await?
        .ok_or_else(|| Error::not_found("project", req.spec.project_id.to_string()))?;
    let tz = project.timezone;
    let at = clock.now();
    let mut cut = exports.fold_cut().await?;
    let watermark = cut.offsets(&req.consumer, &req.topic).await?;
    let receipt_bound = cut.newest_receipt(&req.consumer, &req.topic).await?;
    let mut export_run = ExportRun {
        id: new_id("exr"),
        spec: req.spec.clone(),
        format: req.format,
        status: RunStatus::Running,
        mark: None,
        watermark,
        receipt_bound,
        started_at: at,
        finished_at: None,
        rows: 0,
        bytes: 0,
        file: None,
        reconciliation: None,
        error: None,
        schedule_id: req.schedule_id.clone(),
    };
    // A run that died running frees the project once past its bound.
    let stale = chrono::Duration::from_std(req.max_time.saturating_add(Duration::from_secs(600)))
        .unwrap_or(chrono::Duration::days(1));
    exports.abandon_export_runs(&req.spec.project_id, at - stale, at).await?;
    match exports.create_export_run(&export_run).await {
        Err(meter::PortError::Conflict(_)) => {
            cut.close().await?;
            return Err(Error::ExportRunning { project: req.spec.project_id.to_string() });
        }
        r => r?,
    }
    let bytes = Arc::new(AtomicU64::new(0));
    let mut created = Vec::new();
    let ctx = Ctx { exports, req, export_run: &export_run, tz, at };
    let outcome = write_rows(&ctx, cut.as_mut(), bytes.clone(), &mut created, progress).await;
    export_run.finished_at = Some(clock.now());
    export_run.bytes = bytes.load(Ordering::Relaxed);
    match outcome {
        Ok((p, file)) => {
            export_run.rows = p.rows;
            export_run.mark = p.mark;
            export_run.file = file;
            export_run.status = if p.mark.is_some() { RunStatus::Partial } else { RunStatus::Complete };
        }
        Err(e) => {
            export_run.status = RunStatus::Failed;
            export_run.error = Some(e.to_string());
            // What a failed run wrote never counts, so the next run writes
            // it again: its files go, or a reader would count it twice.
            remove(&created);
            export_run.bytes = 0;
        }
    }
    let audit = audit_entry(&export_run, req.principal.clone());
    if let Err(e) = exports.finish_export_run(&export_run, &[audit]).await {
        remove(&created);
        return Err(e.into());
    }
    if export_run.status == RunStatus::Complete {
        // The run is complete whatever the reconciliation finds; one that
        // could not be made says so in its place (and is not `ok`).
        let fold = match reconcile(exports, cut.as_mut(), &req.spec, tz, at, req.slice).await {
            Ok(fold) => fold,
            Err(e) => {
                tracing::warn!(run = %export_run.id, error = %e, "export run: reconciliation failed");
                Check { lines: 0, differing: 0, differences: vec![format!("the reconciliation failed: {e}")] }
            }
        };
        let r = Reconciliation { fold, log: None };
        exports.set_reconciliation(&export_run.id, &r, clock.now()).await?;
        export_run.reconciliation = Some(r);
    }
    cut.close().await?;
    Ok(export_run)
}

/// Removes a run's files (a failed run's: see [`run_export`]).
fn remove(files: &[PathBuf]) {
    for f in files {
        if let Err(e) = std::fs::remove_file(f)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(file = %f.display(), error = %e, "a failed export run's file could not be removed");
        }
    }
}

fn audit_entry(run: &ExportRun, principal: Option<Principal>) -> AuditEntry {
    AuditEntry {
        id: new_audit_id(),
        project_id: Some(run.spec.project_id.clone()),
        action: AuditAction::RunExport,
        principal,
        resource: run.id.clone(),
        detail: AuditDetail::ExportRun {
            export_key: run.spec.key(),
            format: run.format.as_str().to_owned(),
            status: run.status.as_str().to_owned(),
            mark: run.mark.map(|m| m.as_str().to_owned()),
            rows: run.rows,
            bytes: run.bytes,
            watermark: run.watermark_text(),
            error: run.error.clone(),
            schedule_id: run.schedule_id.clone(),
        },
        created_at: run.finished_at.unwrap_or(run.started_at),
    }
}

/// The charge periods a run goes through, in order.
async fn periods(
    exports: &dyn ExportStore,
    cut: &mut dyn FoldCut,
    spec: &ExportSpec,
    tz: Tz,
    at: DateTime<Utc>,
    storage: &[StoredStorageFact],
) -> Result<Vec<Period>> {
    let mut keys: BTreeSet<String> = cut.window_keys(&spec.project_id, spec.period).await?.into_iter().collect();
    keys.extend(exports.exported_periods(&spec.key()).await?);
    if spec.dimensions.contains(&meter::export::CustomerKind::Project)
        && let Some(first) = storage.first()
    {
        keys.extend(periods_between(spec.period, tz, first.occurred_at, at));
    }
    let mut out: Vec<Period> = keys.iter().filter_map(|k| period_of(spec.period, k, tz)).collect();
    out.sort_by_key(|p| p.start);
    Ok(out)
}

/// One slice of a charge period: what the fold holds of its lines, as of
/// the cut, and what earlier runs wrote of them.
struct Slice {
    folded: BTreeMap<Line, Amounts>,
    exported: BTreeMap<Line, Amounts>,
}

/// Reads a charge period slice by slice: `slice` customers' counters at
/// a time, and the breakdown rows and earlier runs' lines of the same
/// range of customers (the last slice's range is open-ended, so a customer
/// with no counter is still read).
struct Slices<'a> {
    spec: &'a ExportSpec,
    period: &'a Period,
    tz: Tz,
    storage: &'a [StoredStorageFact],
    at: DateTime<Utc>,
    slice: usize,
    after: Option<String>,
    done: bool,
}

impl<'a> Slices<'a> {
    fn new(
        spec: &'a ExportSpec,
        period: &'a Period,
        tz: Tz,
        storage: &'a [StoredStorageFact],
        at: DateTime<Utc>,
        slice: usize,
    ) -> Self {
        Slices { spec, period, tz, storage, at, slice: slice.max(1), after: None, done: false }
    }

    async fn next(&mut self, cut: &mut dyn FoldCut, exports: &dyn ExportStore) -> Result<Option<Slice>> {
        if self.done {
            return Ok(None);
        }
        let (spec, period) = (self.spec, self.period);
        let totals =
            cut.window_totals(&spec.project_id, spec.period, &period.key, self.after.as_deref(), self.slice).await?;
        let through = if totals.len() >= self.slice { totals.last().map(|(k, _)| k.dimension.encode()) } else { None };
        self.done = through.is_none();
        let range = DimRange { after: self.after.take(), through: through.clone() };
        self.after = through;
        let models = cut.window_models(&spec.project_id, spec.period, &period.key, &range).await?;
        // The project's storage lines belong to the slice that holds it.
        let storage = if range.contains(&meter::Dimension::Project.encode()) { self.storage } else { &[] };
        let folded = folded_lines(spec, period, self.tz, &totals, &models, storage, self.at);
        let lines = exports.exported_lines(&spec.key(), &period.key, &range).await?;
        let exported = lines
            .into_iter()
            .map(|l| (Line { period: period.clone(), dimension: l.dimension, item: l.item }, l.amounts))
            .collect();
        Ok(Some(Slice { folded, exported }))
    }
}

/// What a run writes by: its store, request and record, the project's
/// zone, and when it started.
struct Ctx<'a> {
    exports: &'a dyn ExportStore,
    req: &'a ExportRequest,
    export_run: &'a ExportRun,
    tz: Tz,
    at: DateTime<Utc>,
}

/// Writes the run's rows; `created` gets every file it made, whatever happens.
async fn write_rows(
    ctx: &Ctx<'_>,
    cut: &mut dyn FoldCut,
    bytes: Arc<AtomicU64>,
    created: &mut Vec<PathBuf>,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(Progress, Option<String>)> {
    let (req, export_run) = (ctx.req, ctx.export_run);
    let spec = &req.spec;
    let mut files = Files {
        format: req.format,
        out: req.out.clone(),
        run_id: export_run.id.clone(),
        project: spec.project_id.to_string(),
        open: BTreeMap::new(),
        bytes: bytes.clone(),
        created: Vec::new(),
    };
    let done = write_periods(ctx, cut, &bytes, &mut files, progress).await;
    created.append(&mut files.created);
    done
}

/// [`write_rows`], into `files`.
async fn write_periods(
    ctx: &Ctx<'_>,
    cut: &mut dyn FoldCut,
    bytes: &AtomicU64,
    files: &mut Files,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<(Progress, Option<String>)> {
    let Ctx { exports, req, export_run, tz, at } = *ctx;
    let spec = &req.spec;
    let started = Instant::now();
    let storage = cut.storage_facts(&spec.project_id, at).await?;
    let open = period_of(spec.period, &window_at(spec.period, tz, at).key, tz)
        .ok_or_else(|| Error::invalid("period", "the period open now cannot be found"))?;
    let info = RunInfo {
        run_id: export_run.id.clone(),
        project_id: spec.project_id.to_string(),
        watermark: export_run.watermark_text(),
    };
    let io = |e: io::Error| Error::Backend(meter::PortError::Permanent(format!("writing the export: {e}")));
    // The newest complete run before this one: the periods it saw closed are final.
    let frozen = exports.last_complete_run(&spec.key()).await?;
    let mut p = Progress { rows: 0, mark: None };
    'periods: for period in periods(exports, cut, spec, tz, at, &storage).await? {
        let mut slices = Slices::new(spec, &period, tz, &storage, at, req.slice);
        while let Some(slice) = slices.next(cut, exports).await? {
            let rows = run(&slice.folded, &slice.exported, &open, spec.grace, frozen);
            drop(slice);
            let mut written = Vec::with_capacity(rows.len());
            for row in rows {
                if p.rows >= req.max_rows {
                    p.mark = Some(Mark::Rows);
                } else if started.elapsed() >= req.max_time {
                    p.mark = Some(Mark::Time);
                }
                if p.mark.is_some() {
                    break;
                }
                files.row(&info, &row).map_err(io)?;
                p.rows += 1;
                let Row { line, amounts, .. } = row;
                written.push(ExportedLine {
                    period_key: line.period.key,
                    dimension: line.dimension,
                    item: line.item,
                    amounts,
                });
                if p.rows.is_multiple_of(1024) {
                    progress(p.rows, bytes.load(Ordering::Relaxed));
                }
            }
            // Recorded once written: a run that fails after this drops them.
            exports.record_export_lines(&export_run.id, &spec.key(), &written).await?;
            if p.mark.is_some() {
                break 'periods;
            }
        }
        files.close_before(&open.key).map_err(io)?;
    }
    let file = files.finish().map_err(io)?;
    progress(p.rows, bytes.load(Ordering::Relaxed));
    Ok((p, Some(file)))
}

/// Every line of the export, as the store holds the sum of its runs,
/// against the fold in the cut (the live one of the run, or a fold of the
/// log to the run's watermark), as of `at` (the run's start).
pub async fn reconcile(
    exports: &dyn ExportStore,
    cut: &mut dyn FoldCut,
    spec: &ExportSpec,
    tz: Tz,
    at: DateTime<Utc>,
    slice: usize,
) -> Result<Check> {
    let storage = cut.storage_facts(&spec.project_id, at).await?;
    let mut check = Check::default();
    for period in periods(exports, cut, spec, tz, at, &storage).await? {
        let mut slices = Slices::new(spec, &period, tz, &storage, at, slice);
        while let Some(slice) = slices.next(cut, exports).await? {
            check.differ(compare(&slice.folded, &slice.exported));
            check.lines += slice.folded.len().max(slice.exported.len()) as u64;
        }
    }
    Ok(check)
}

/// Every line where `expected` and `found` differ, as text.
pub fn compare(expected: &BTreeMap<Line, Amounts>, found: &BTreeMap<Line, Amounts>) -> Vec<String> {
    let lines: BTreeSet<&Line> = expected.keys().chain(found.keys()).collect();
    lines
        .into_iter()
        .filter_map(|l| {
            let (e, f) = (expected.get(l).copied().unwrap_or_default(), found.get(l).copied().unwrap_or_default());
            (e != f)
                .then(|| format!("{} {} {}: expected {e:?}, found {f:?}", l.period.key, l.dimension.encode(), l.item))
        })
        .collect()
}
