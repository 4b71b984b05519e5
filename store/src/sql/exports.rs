//! Billing exports over SQL (`migrations/0015_exports.sql`): the cut of
//! the fold a run exports from, the runs, and what the runs of each export
//! wrote (see `meter::export`).
//!
//! - **The cut** ([`SqlFoldCut`]) is a read-only snapshot transaction
//!   (PostgreSQL `REPEATABLE READ`, a SQLite read transaction), as a
//!   replay's [`Snapshot`](super::shadow::Snapshot) is. Both databases take
//!   the snapshot at the transaction's first read, not at its `BEGIN`, so
//!   [`ExportStore::fold_cut`] reads once as it opens it: the cut is the
//!   fold as of the call, whatever the projector commits after.
//! - **What an export wrote** is one row per run and line (`export_lines`,
//!   `migrations/0016_export_lines_by_run.sql`), recorded slice by slice as
//!   the run writes. Only the lines of runs that ended `complete` or
//!   `partial` count: the transaction that records how a run ended makes
//!   its lines count (or, for a failed run, drops them), so a run that did
//!   not finish is not subtracted by the next one.
//! - **Slices**: a run reads a charge period by ranges of customers, by
//!   their encoded dimension compared bytewise ([`Backend::BYTEWISE`]), the
//!   same range on the fold's tables and on `export_lines`.
//! - **Amounts** are `i128` in meter and `bigint` here: one that does not
//!   fit is refused (the finish fails and changes nothing), never wrapped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::export::{
    Amounts, CustomerKind, DimRange, ExportRun, ExportSpec, ExportedLine, Grace, Item, Reconciliation, RunStatus,
};
use meter::{
    AuditEntry, CounterKey, Dimension, ExportStore, FoldCut, ModelUsageRow, PortError, PortResult, ProjectId,
    StoredStorageFact, Totals, WindowKind,
};
use sqlx::Transaction;

use meter::export::schedule::notification;

use super::config::insert_audit;
use super::ledger::{
    AGGREGATE_COLUMNS, MODEL_USAGE_COLUMNS, counter_key, model_usage_row, offset_row, offsets_stmt, totals,
};
use super::webhooks::enqueue_in;
use super::{Backend, Rec, Rows, SqlStore, Stmt, corrupt, each, error, limit, to_i64};

pub(super) const RUN_COLUMNS: &str = "id, export_key, project_id, period_kind, dimensions, grace_secs, format, \
                                      status, mark, watermark, receipt_bound, started_at, finished_at, \"rows\", bytes, \
                                      file, reconciliation, error, schedule_id";

/// The dimensions of a spec as stored: `+`-joined, in order.
fn dimensions_text(spec: &ExportSpec) -> String {
    let dims: Vec<&str> = spec.dimensions.iter().map(|d| d.as_str()).collect();
    dims.join("+")
}

pub(super) fn run<B: Backend>(r: &Rec<'_, B>) -> PortResult<ExportRun> {
    let dims = r.text("dimensions")?;
    let dimensions = dims
        .split('+')
        .map(|d| d.parse::<CustomerKind>())
        .collect::<Result<BTreeSet<_>, _>>()
        .map_err(|_| corrupt("dimensions", &dims))?;
    let secs = r.count("grace_secs")?;
    let grace = Grace::new(Duration::from_secs(secs)).map_err(|_| corrupt("grace_secs", &secs.to_string()))?;
    let spec = ExportSpec::new(r.id("project_id")?, r.parse("period_kind")?, dimensions, grace)
        .map_err(|e| corrupt(&e.field, &dims))?;
    let mark = match r.get::<Option<String>>("mark")? {
        None => None,
        Some(m) => Some(m.parse().map_err(|_| corrupt("mark", &m))?),
    };
    Ok(ExportRun {
        id: r.text("id")?,
        spec,
        format: r.parse("format")?,
        status: r.parse("status")?,
        mark,
        watermark: r.json("watermark")?,
        receipt_bound: r.opt_time("receipt_bound")?,
        started_at: r.time("started_at")?,
        finished_at: r.opt_time("finished_at")?,
        rows: r.count("rows")?,
        bytes: r.count("bytes")?,
        file: r.get("file")?,
        reconciliation: r.opt_json("reconciliation")?,
        error: r.get("error")?,
        schedule_id: r.get("schedule_id")?,
    })
}

/// A line's amount as stored; one beyond a 64-bit integer is refused.
fn amount(what: &str, v: i128) -> PortResult<i64> {
    i64::try_from(v).map_err(|_| PortError::Permanent(format!("exported {what} {v} does not fit a 64-bit integer")))
}

/// What the runs wrote of one line, read back.
fn exported_line<B: Backend>(r: &Rec<'_, B>, period_key: &str) -> PortResult<ExportedLine> {
    let dimension = r.text("dimension")?;
    let item = r.text("item")?;
    Ok(ExportedLine {
        period_key: period_key.to_owned(),
        dimension: Dimension::decode(&dimension).ok_or_else(|| corrupt("dimension", &dimension))?,
        item: Item::decode(&item).ok_or_else(|| corrupt("item", &item))?,
        amounts: Amounts {
            consumed: i128::from(r.int("consumed")?),
            priced: i128::from(r.int("priced")?),
            unpriced: i128::from(r.int("unpriced")?),
            cost: i128::from(r.int("cost")?),
        },
    })
}

/// The condition that a `dimension` column is in a range, bytewise, with
/// its parameters numbered from `next`.
fn in_range<B: Backend>(column: &str, range: &DimRange, next: usize, stmt_params: &mut Vec<String>) -> String {
    let c = B::BYTEWISE;
    let mut sql = String::new();
    let mut n = next;
    if let Some(a) = &range.after {
        sql.push_str(&format!(" AND {column}{c} > ${n}"));
        stmt_params.push(a.clone());
        n += 1;
    }
    if let Some(t) = &range.through {
        sql.push_str(&format!(" AND {column}{c} <= ${n}"));
        stmt_params.push(t.clone());
    }
    sql
}

/// One insert of lines a run wrote (each at most once per run).
fn insert_lines(run_id: &str, export_key: &str, written: &[ExportedLine]) -> PortResult<Stmt> {
    let mut consumed = Vec::with_capacity(written.len());
    let mut priced = Vec::with_capacity(written.len());
    let mut unpriced = Vec::with_capacity(written.len());
    let mut cost = Vec::with_capacity(written.len());
    for l in written {
        consumed.push(amount("consumed", l.amounts.consumed)?);
        priced.push(amount("priced", l.amounts.priced)?);
        unpriced.push(amount("unpriced", l.amounts.unpriced)?);
        cost.push(amount("cost", l.amounts.cost)?);
    }
    let rows = Rows::new()
        .text("run_id", written.iter().map(|_| run_id))
        .text("export_key", written.iter().map(|_| export_key))
        .text("period_key", written.iter().map(|l| l.period_key.as_str()))
        .text("dimension", written.iter().map(|l| l.dimension.encode()))
        .text("item", written.iter().map(|l| l.item.encode()))
        .int("consumed", consumed)
        .int("priced", priced)
        .int("unpriced", unpriced)
        .int("cost", cost);
    Ok(Stmt::new(
        "INSERT INTO export_lines (run_id, export_key, period_key, dimension, item, consumed, priced, unpriced, cost) \
         SELECT * FROM {rows} AS t",
    )
    .rows(rows))
}

/// The cut of the fold an export run reads (see [`FoldCut`]): a read-only
/// snapshot transaction, rolled back when closed (or dropped).
pub struct SqlFoldCut<B: Backend> {
    tx: Transaction<'static, B>,
}

#[async_trait]
impl<B: Backend> FoldCut for SqlFoldCut<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "cut_offsets"))]
    async fn offsets(&mut self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>> {
        let rows = each(&B::fetch(&mut *self.tx, offsets_stmt(consumer, topic)).await?, offset_row::<B>)?;
        Ok(rows.into_iter().collect())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "cut_newest_receipt"))]
    async fn newest_receipt(&mut self, consumer: &str, topic: &str) -> PortResult<Option<DateTime<Utc>>> {
        let stmt = Stmt::new("SELECT newest_receipt FROM fold_receipts WHERE consumer = $1 AND topic = $2")
            .text(consumer)
            .text(topic);
        match B::fetch(&mut *self.tx, stmt).await?.first() {
            Some(row) => Ok(Some(Rec::<B>(row).time("newest_receipt")?)),
            None => Ok(None),
        }
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "cut_window_keys"))]
    async fn window_keys(&mut self, project: &ProjectId, window: WindowKind) -> PortResult<Vec<String>> {
        let stmt = Stmt::new(
            "SELECT window_key FROM usage_aggregates WHERE project_id = $1 AND window_kind = $2 \
             UNION SELECT window_key FROM model_usage WHERE project_id = $1 AND window_kind = $2",
        )
        .text(project.as_str())
        .text(window.as_str());
        let keys = each(&B::fetch(&mut *self.tx, stmt).await?, |r: &Rec<'_, B>| r.text("window_key"))?;
        // Sorted here, bytewise, whatever the database's collation.
        Ok(keys.into_iter().collect::<BTreeSet<_>>().into_iter().collect())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "cut_window_totals"))]
    async fn window_totals(
        &mut self,
        project: &ProjectId,
        window: WindowKind,
        key: &str,
        after: Option<&str>,
        max: usize,
    ) -> PortResult<Vec<(CounterKey, Totals)>> {
        let c = B::BYTEWISE;
        let range = DimRange { after: after.map(str::to_owned), through: None };
        let mut params = Vec::new();
        let cond = in_range::<B>("dimension", &range, 4, &mut params);
        let n = 4 + params.len();
        let mut stmt = Stmt::new(format!(
            "SELECT {} FROM usage_aggregates WHERE project_id = $1 AND window_kind = $2 AND window_key = $3{cond} \
             ORDER BY dimension{c} LIMIT ${n}",
            *AGGREGATE_COLUMNS
        ))
        .text(project.as_str())
        .text(window.as_str())
        .text(key);
        for p in params {
            stmt = stmt.text(p);
        }
        let stmt = stmt.int(limit(max));
        each(&B::fetch(&mut *self.tx, stmt).await?, |r: &Rec<'_, B>| Ok((counter_key(r)?, totals(r)?)))
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "cut_window_models"))]
    async fn window_models(
        &mut self,
        project: &ProjectId,
        window: WindowKind,
        key: &str,
        range: &DimRange,
    ) -> PortResult<Vec<(Dimension, ModelUsageRow)>> {
        let mut params = Vec::new();
        let cond = in_range::<B>("dimension", range, 4, &mut params);
        let mut stmt = Stmt::new(format!(
            "SELECT dimension, {MODEL_USAGE_COLUMNS} FROM model_usage \
             WHERE project_id = $1 AND window_kind = $2 AND window_key = $3{cond}"
        ))
        .text(project.as_str())
        .text(window.as_str())
        .text(key);
        for p in params {
            stmt = stmt.text(p);
        }
        let mut out = each(&B::fetch(&mut *self.tx, stmt).await?, |r: &Rec<'_, B>| {
            let d = r.text("dimension")?;
            Ok((d.clone(), Dimension::decode(&d).ok_or_else(|| corrupt("dimension", &d))?, model_usage_row(r)?))
        })?;
        // By dimension (bytewise), then in meter's orders (as `ReportStore::model_usage`).
        out.sort_by(|(da, _, a), (db, _, b)| {
            (da.as_bytes(), &a.key, a.meter, a.embedding).cmp(&(db.as_bytes(), &b.key, b.meter, b.embedding))
        });
        Ok(out.into_iter().map(|(_, d, r)| (d, r)).collect())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "cut_storage_facts"))]
    async fn storage_facts(
        &mut self,
        project: &ProjectId,
        before: DateTime<Utc>,
    ) -> PortResult<Vec<StoredStorageFact>> {
        let stmt = Stmt::new(
            "SELECT event_id, kind, occurred_at, bytes FROM storage_facts \
             WHERE project_id = $1 AND occurred_at < $2 ORDER BY occurred_at, event_id",
        )
        .text(project.as_str())
        .time(before);
        each(&B::fetch(&mut *self.tx, stmt).await?, |r: &Rec<'_, B>| {
            let kind = r.text("kind")?;
            let snapshot = match kind.as_str() {
                "snapshot" => true,
                "delta" => false,
                _ => return Err(corrupt("kind", &kind)),
            };
            Ok(StoredStorageFact {
                event_id: r.id("event_id")?,
                snapshot,
                occurred_at: r.time("occurred_at")?,
                bytes: r.int("bytes")?,
            })
        })
    }

    async fn close(self: Box<Self>) -> PortResult<()> {
        self.tx.rollback().await.map_err(error::<B>)
    }
}

#[async_trait]
impl<B: Backend> ExportStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "fold_cut"))]
    async fn fold_cut(&self) -> PortResult<Box<dyn FoldCut>> {
        let mut tx = self.pool.begin_with(B::SNAPSHOT_BEGIN).await.map_err(error::<B>)?;
        // The snapshot is taken at the first read (see the module doc).
        B::fetch(&mut *tx, Stmt::new("SELECT next_offset FROM consumer_offsets LIMIT 1")).await?;
        Ok(Box::new(SqlFoldCut { tx }))
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "create_export_run"))]
    async fn create_export_run(&self, run: &ExportRun) -> PortResult<()> {
        let params: Vec<String> = (1..=19).map(|i| format!("${i}")).collect();
        let stmt = Stmt::new(format!("INSERT INTO export_runs ({RUN_COLUMNS}) VALUES ({})", params.join(", ")))
            .text(&run.id)
            .text(run.spec.key())
            .text(run.spec.project_id.as_str())
            .text(run.spec.period.as_str())
            .text(dimensions_text(&run.spec))
            .int(to_i64("grace_secs", run.spec.grace.duration().as_secs())?)
            .text(run.format.as_str())
            .text(run.status.as_str())
            .opt_text(run.mark.map(|m| m.as_str()))
            .json(&run.watermark)?
            .opt_time(run.receipt_bound)
            .time(run.started_at)
            .opt_time(run.finished_at)
            .int(to_i64("rows", run.rows)?)
            .int(to_i64("bytes", run.bytes)?)
            .opt_text(run.file.as_deref())
            .opt_json(run.reconciliation.as_ref())?
            .opt_text(run.error.as_deref())
            .opt_text(run.schedule_id.as_deref());
        self.run(stmt).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "exported_lines"))]
    async fn exported_lines(
        &self,
        export_key: &str,
        period_key: &str,
        range: &DimRange,
    ) -> PortResult<Vec<ExportedLine>> {
        let mut params = Vec::new();
        let cond = in_range::<B>("l.dimension", range, 3, &mut params);
        // Sums of bigints are numeric on PostgreSQL: cast back (one that
        // does not fit is an error, never wrapped).
        let mut stmt = Stmt::new(format!(
            "SELECT l.dimension, l.item, CAST(SUM(l.consumed) AS bigint) AS consumed, \
             CAST(SUM(l.priced) AS bigint) AS priced, CAST(SUM(l.unpriced) AS bigint) AS unpriced, \
             CAST(SUM(l.cost) AS bigint) AS cost \
             FROM export_lines l JOIN export_runs r ON r.id = l.run_id \
             WHERE l.export_key = $1 AND l.period_key = $2 AND r.status IN ('complete', 'partial'){cond} \
             GROUP BY l.dimension, l.item \
             HAVING NOT (SUM(l.consumed) = 0 AND SUM(l.priced) = 0 AND SUM(l.unpriced) = 0 AND SUM(l.cost) = 0)"
        ))
        .text(export_key)
        .text(period_key);
        for p in params {
            stmt = stmt.text(p);
        }
        let mut out = each(&self.all(stmt).await?, |r: &Rec<'_, B>| exported_line(r, period_key))?;
        out.sort_by(|a, b| (&a.dimension, &a.item).cmp(&(&b.dimension, &b.item)));
        Ok(out)
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = B::SPAN_DB, op = "record_export_lines", lines = lines.len())
    )]
    async fn record_export_lines(&self, run_id: &str, export_key: &str, lines: &[ExportedLine]) -> PortResult<()> {
        // Bounded statements: a slice's lines, a few thousand rows each.
        for chunk in lines.chunks(4096) {
            self.run(insert_lines(run_id, export_key, chunk)?).await?;
        }
        Ok(())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "exported_periods"))]
    async fn exported_periods(&self, export_key: &str) -> PortResult<Vec<String>> {
        let stmt = Stmt::new(
            "SELECT DISTINCT l.period_key FROM export_lines l JOIN export_runs r ON r.id = l.run_id \
             WHERE l.export_key = $1 AND r.status IN ('complete', 'partial')",
        )
        .text(export_key);
        let keys = each(&self.all(stmt).await?, |r: &Rec<'_, B>| r.text("period_key"))?;
        Ok(keys.into_iter().collect::<BTreeSet<_>>().into_iter().collect())
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = B::SPAN_DB, op = "finish_export_run")
    )]
    async fn finish_export_run(&self, run: &ExportRun, audit: &[AuditEntry]) -> PortResult<()> {
        // Dropping `tx` without committing rolls everything back.
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        let update = Stmt::new(
            "UPDATE export_runs SET status = $2, mark = $3, finished_at = $4, \"rows\" = $5, bytes = $6, \
             file = $7, reconciliation = $8, error = $9, watermark = $10, receipt_bound = $11 WHERE id = $1",
        )
        .text(&run.id)
        .text(run.status.as_str())
        .opt_text(run.mark.map(|m| m.as_str()))
        .opt_time(run.finished_at)
        .int(to_i64("rows", run.rows)?)
        .int(to_i64("bytes", run.bytes)?)
        .opt_text(run.file.as_deref())
        .opt_json(run.reconciliation.as_ref())?
        .opt_text(run.error.as_deref())
        .json(&run.watermark)?
        .opt_time(run.receipt_bound);
        if B::execute(&mut *tx, update).await? != 1 {
            return Err(PortError::Permanent(format!("there is no export run {}", run.id)));
        }
        if run.status == RunStatus::Failed {
            B::execute(&mut *tx, Stmt::new("DELETE FROM export_lines WHERE run_id = $1").text(&run.id)).await?;
        }
        for entry in audit {
            B::execute(&mut *tx, insert_audit(entry)?).await?;
        }
        // A complete run's notification waits for its reconciliation.
        if run.status != RunStatus::Complete {
            let at = run.finished_at.unwrap_or(run.started_at);
            enqueue_in::<B>(&mut *tx, &notification(run, at), None).await?;
        }
        tx.commit().await.map_err(error::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "export_run"))]
    async fn export_run(&self, id: &str) -> PortResult<Option<ExportRun>> {
        let stmt = Stmt::new(format!("SELECT {RUN_COLUMNS} FROM export_runs WHERE id = $1")).text(id);
        self.opt(stmt).await?.as_ref().map(|r| run(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "export_runs"))]
    async fn export_runs(&self, project: &ProjectId, max: usize) -> PortResult<Vec<ExportRun>> {
        let stmt = Stmt::new(format!(
            "SELECT {RUN_COLUMNS} FROM export_runs WHERE project_id = $1 ORDER BY started_at DESC, id DESC LIMIT $2"
        ))
        .text(project.as_str())
        .int(limit(max));
        each(&self.all(stmt).await?, run::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "set_reconciliation"))]
    async fn set_reconciliation(
        &self,
        id: &str,
        reconciliation: &Reconciliation,
        at: DateTime<Utc>,
    ) -> PortResult<bool> {
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        let stmt =
            Stmt::new(format!("UPDATE export_runs SET reconciliation = $2 WHERE id = $1 RETURNING {RUN_COLUMNS}"))
                .text(id)
                .json(reconciliation)?;
        let rows = B::fetch(&mut *tx, stmt).await?;
        let Some(row) = rows.first() else { return Ok(false) };
        let updated = run(&Rec::<B>(row))?;
        if updated.status == RunStatus::Complete {
            // Once per run: a second reconciliation (`--verify`) finds it enqueued.
            enqueue_in::<B>(&mut *tx, &notification(&updated, at), None).await?;
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(true)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "last_complete_run"))]
    async fn last_complete_run(&self, export_key: &str) -> PortResult<Option<DateTime<Utc>>> {
        let stmt = Stmt::new(
            "SELECT started_at FROM export_runs WHERE export_key = $1 AND status = 'complete' \
             ORDER BY started_at DESC LIMIT 1",
        )
        .text(export_key);
        self.opt(stmt).await?.as_ref().map(|r| Rec::<B>(r).time("started_at")).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "abandon_export_runs"))]
    async fn abandon_export_runs(
        &self,
        project: &ProjectId,
        started_before: DateTime<Utc>,
        at: DateTime<Utc>,
    ) -> PortResult<u64> {
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        let lines = Stmt::new(
            "DELETE FROM export_lines WHERE run_id IN \
             (SELECT id FROM export_runs WHERE project_id = $1 AND status = 'running' AND started_at < $2)",
        )
        .text(project.as_str())
        .time(started_before);
        B::execute(&mut *tx, lines).await?;
        let stmt = Stmt::new(format!(
            "UPDATE export_runs SET status = 'failed', finished_at = $3, \
             error = 'abandoned: still running past its time bound (its process died?)' \
             WHERE project_id = $1 AND status = 'running' AND started_at < $2 RETURNING {RUN_COLUMNS}"
        ))
        .text(project.as_str())
        .time(started_before)
        .time(at);
        let abandoned = each(&B::fetch(&mut *tx, stmt).await?, run::<B>)?;
        for r in &abandoned {
            enqueue_in::<B>(&mut *tx, &notification(r, at), None).await?;
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(abandoned.len() as u64)
    }
}
