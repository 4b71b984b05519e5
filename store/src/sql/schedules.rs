//! Export schedules over SQL (`migrations/0017_export_schedules.sql`):
//! what the admin API keeps and what notifiers claim and run.
//!
//! A claim is a lease on the row (`claimed_by`, `claimed_until`), taken by
//! one `UPDATE … WHERE` that repeats its conditions on the row it updates:
//! under PostgreSQL's READ COMMITTED a claimant re-reads a row another
//! changed meanwhile and finds it claimed (and its candidate is picked
//! `FOR UPDATE SKIP LOCKED`, so concurrent claimants take different
//! schedules), and SQLite runs one writer at a time: two notifiers never
//! hold one schedule at once.

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::export::{CustomerKind, Destination, ExportRun, ExportSchedule, Grace, Projects};
use meter::{AuditEntry, PortResult, ProjectId, ScheduleStore};

use super::exports::{RUN_COLUMNS, run};
use super::{Backend, Rec, SqlStore, Stmt, corrupt, each, limit, to_i64};

const COLUMNS: &str = "id, projects, period_kind, dimensions, grace_secs, format, destination, cadence, timezone, \
                       enabled, next_run_at, last_run_at, created_at, updated_at";

fn schedule<B: Backend>(r: &Rec<'_, B>) -> PortResult<ExportSchedule> {
    let projects = match r.opt_json::<Vec<String>>("projects")? {
        None => Projects::All,
        Some(ids) => Projects::Some(
            ids.into_iter()
                .map(|id| ProjectId::parse(id.clone()).map_err(|_| corrupt("projects", &id)))
                .collect::<PortResult<Vec<_>>>()?,
        ),
    };
    let dims = r.text("dimensions")?;
    let dimensions = dims
        .split('+')
        .map(|d| d.parse::<CustomerKind>())
        .collect::<Result<BTreeSet<_>, _>>()
        .map_err(|_| corrupt("dimensions", &dims))?;
    let secs = r.count("grace_secs")?;
    let grace = Grace::new(Duration::from_secs(secs)).map_err(|_| corrupt("grace_secs", &secs.to_string()))?;
    let destination = r.text("destination")?;
    Ok(ExportSchedule {
        id: r.text("id")?,
        projects,
        period: r.parse("period_kind")?,
        dimensions,
        grace,
        format: r.parse("format")?,
        destination: Destination::parse(&destination).map_err(|_| corrupt("destination", &destination))?,
        cadence: r.parse("cadence")?,
        timezone: r.parse("timezone")?,
        enabled: r.get("enabled")?,
        next_run_at: r.time("next_run_at")?,
        last_run_at: r.opt_time("last_run_at")?,
        created_at: r.time("created_at")?,
        updated_at: r.time("updated_at")?,
    })
}

fn projects_json(p: &Projects) -> Option<Vec<&str>> {
    match p {
        Projects::All => None,
        Projects::Some(ids) => Some(ids.iter().map(ProjectId::as_str).collect()),
    }
}

fn dimensions_text(s: &ExportSchedule) -> String {
    let dims: Vec<&str> = s.dimensions.iter().map(|d| d.as_str()).collect();
    dims.join("+")
}

#[async_trait]
impl<B: Backend> ScheduleStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "create_schedule"))]
    async fn create_schedule(&self, s: &ExportSchedule, audit: &[AuditEntry]) -> PortResult<()> {
        let stmt = Stmt::new(format!(
            "INSERT INTO export_schedules ({COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
        ))
        .text(&s.id)
        .opt_json(projects_json(&s.projects).as_ref())?
        .text(s.period.as_str())
        .text(dimensions_text(s))
        .int(to_i64("grace_secs", s.grace.duration().as_secs())?)
        .text(s.format.as_str())
        .text(s.destination.as_str())
        .text(s.cadence.as_str())
        .text(s.timezone.name())
        .flag(s.enabled)
        .time(s.next_run_at)
        .opt_time(s.last_run_at)
        .time(s.created_at)
        .time(s.updated_at);
        self.run_audited(stmt, audit).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "schedule"))]
    async fn schedule(&self, id: &str) -> PortResult<Option<ExportSchedule>> {
        let stmt = Stmt::new(format!("SELECT {COLUMNS} FROM export_schedules WHERE id = $1")).text(id);
        self.opt(stmt).await?.as_ref().map(|r| schedule(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "schedules"))]
    async fn schedules(&self, after: Option<&str>, max: usize) -> PortResult<Vec<ExportSchedule>> {
        let stmt = Stmt::new(format!(
            "SELECT {COLUMNS} FROM export_schedules WHERE (CAST($1 AS TEXT) IS NULL OR id{c} > $1) \
             ORDER BY id{c} LIMIT $2",
            c = B::BYTEWISE
        ))
        .opt_text(after)
        .int(limit(max));
        each(&self.all(stmt).await?, schedule::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "update_schedule"))]
    async fn update_schedule(&self, s: &ExportSchedule, audit: &[AuditEntry]) -> PortResult<bool> {
        let stmt = Stmt::new(
            "UPDATE export_schedules SET enabled = $2, cadence = $3, format = $4, destination = $5, \
             next_run_at = $6, updated_at = $7 WHERE id = $1",
        )
        .text(&s.id)
        .flag(s.enabled)
        .text(s.cadence.as_str())
        .text(s.format.as_str())
        .text(s.destination.as_str())
        .time(s.next_run_at)
        .time(s.updated_at);
        Ok(self.run_audited(stmt, audit).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "delete_schedule"))]
    async fn delete_schedule(&self, id: &str, audit: &[AuditEntry]) -> PortResult<bool> {
        let stmt = Stmt::new("DELETE FROM export_schedules WHERE id = $1").text(id);
        Ok(self.run_audited(stmt, audit).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "claim_due_schedule"))]
    async fn claim_due_schedule(
        &self,
        claimant: &str,
        at: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> PortResult<Option<ExportSchedule>> {
        // PostgreSQL: the candidate is locked as it is picked, and one
        // another claimant is picking is skipped, so concurrent claimants
        // take different schedules (SQLite has one writer at a time).
        let skip = if B::LOCK_ROWS.is_empty() { String::new() } else { format!("{} SKIP LOCKED", B::LOCK_ROWS) };
        let stmt = Stmt::new(format!(
            "UPDATE export_schedules SET claimed_by = $1, claimed_until = $3 \
             WHERE enabled AND next_run_at <= $2 AND (claimed_until IS NULL OR claimed_until < $2) \
               AND id = (SELECT id FROM export_schedules \
                         WHERE enabled AND next_run_at <= $2 AND (claimed_until IS NULL OR claimed_until < $2) \
                         ORDER BY next_run_at, id LIMIT 1{skip}) \
             RETURNING {COLUMNS}"
        ))
        .text(claimant)
        .time(at)
        .time(until);
        self.all(stmt).await?.first().map(|r| schedule(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "extend_schedule_claim"))]
    async fn extend_schedule_claim(&self, id: &str, claimant: &str, until: DateTime<Utc>) -> PortResult<bool> {
        let stmt = Stmt::new("UPDATE export_schedules SET claimed_until = $3 WHERE id = $1 AND claimed_by = $2")
            .text(id)
            .text(claimant)
            .time(until);
        Ok(self.run(stmt).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "finish_schedule_run"))]
    async fn finish_schedule_run(
        &self,
        id: &str,
        claimant: &str,
        ran_at: DateTime<Utc>,
        next_run_at: DateTime<Utc>,
    ) -> PortResult<bool> {
        let stmt = Stmt::new(
            "UPDATE export_schedules SET last_run_at = $3, next_run_at = $4, claimed_by = NULL, \
             claimed_until = NULL WHERE id = $1 AND claimed_by = $2",
        )
        .text(id)
        .text(claimant)
        .time(ran_at)
        .time(next_run_at);
        Ok(self.run(stmt).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "schedule_runs"))]
    async fn schedule_runs(&self, id: &str, max: usize) -> PortResult<Vec<ExportRun>> {
        let stmt = Stmt::new(format!(
            "SELECT {RUN_COLUMNS} FROM export_runs WHERE schedule_id = $1 ORDER BY started_at DESC, id DESC LIMIT $2"
        ))
        .text(id)
        .int(limit(max));
        each(&self.all(stmt).await?, run::<B>)
    }
}
