//! Export schedules (issue 11 item 6, `meter::export::schedule`): what an
//! admin defines, and the [`Scheduler`] the notifier process runs them with.
//!
//! A schedule is audited like every admin change (create, change, delete,
//! "run now"), as an entry of its project when it names one project, else
//! of the installation.
//!
//! The [`Scheduler`] claims the schedule due soonest (a lease held by the
//! store, so any number of notifiers may run: one runs each schedule, and a
//! notifier that dies mid-run leaves a claim that lapses and a `running`
//! export run that the next run of its project marks failed), runs one
//! export per project ([`super::exports::run_export`], written under
//! `<export dir>/<destination>/project=<id>/period=<key>/part-<run>.<ext>`),
//! and sets when it is due next. A project whose export is already running
//! (another schedule's, or one through the API) is not waited for: the
//! schedule is due again a minute later, and that run adds only what the
//! other did not write. Each run's end reaches the project's webhook
//! endpoints as `export.completed` or `export.failed`, enqueued by the
//! store as the run ends.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use meter::export::{Cadence, CustomerKind, Destination, ExportRun, ExportSchedule, Format, Grace, Projects};
use meter::{
    AuditAction, AuditDetail, AuditEntry, Clock, ExportStore, Principal, ScheduleStore, TenantStore, WindowKind,
};
use tracing::{info, warn};

use super::exports::{ExportRequest, Output, run_export};
use super::{Error, Page, Result, now_micros};
use crate::state::{AppState, ExportSettings, new_audit_id, new_id};

/// Most schedules a page lists.
pub const MAX_PAGE: usize = 100;
/// The runs a schedule's detail shows.
pub const RECENT_RUNS: usize = 10;
/// How soon a schedule whose project was busy (or whose store failed) is
/// due again.
pub const RETRY: Duration = Duration::from_secs(60);

/// A new schedule, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSchedule {
    pub projects: Projects,
    pub period: WindowKind,
    pub dimensions: BTreeSet<CustomerKind>,
    pub grace: Grace,
    pub format: Format,
    pub destination: Destination,
    pub cadence: Cadence,
    /// `None`: the project's zone for a schedule of one project, else UTC.
    pub timezone: Option<Tz>,
    pub enabled: bool,
}

/// A change to a schedule; `None` keeps the field.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulePatch {
    pub enabled: Option<bool>,
    pub cadence: Option<Cadence>,
    pub format: Option<Format>,
    pub destination: Option<Destination>,
}

/// A schedule and the runs it started, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleDetail {
    pub schedule: ExportSchedule,
    pub runs: Vec<ExportRun>,
}

fn audit(
    s: &ExportSchedule,
    action: AuditAction,
    before: Option<&ExportSchedule>,
    after: Option<&ExportSchedule>,
    by: &Principal,
    at: DateTime<Utc>,
) -> AuditEntry {
    let project_id = match &s.projects {
        Projects::Some(ids) if ids.len() == 1 => ids.first().cloned(),
        _ => None,
    };
    AuditEntry {
        id: new_audit_id(),
        project_id,
        action,
        principal: Some(by.clone()),
        resource: s.id.clone(),
        detail: AuditDetail::ExportScheduleChange { before: before.map(Into::into), after: after.map(Into::into) },
        created_at: at,
    }
}

/// Creates a schedule (every project it names must exist), audited as `by`.
pub async fn create(s: &AppState, new: NewSchedule, by: &Principal) -> Result<ExportSchedule> {
    let mut zone = None;
    if let Projects::Some(ids) = &new.projects {
        for id in ids {
            let p = s.stores.tenants.project(id).await?.ok_or_else(|| Error::not_found("project", id.as_str()))?;
            zone.get_or_insert(p.timezone);
        }
    }
    let timezone = match (new.timezone, &new.projects) {
        (Some(tz), _) => tz,
        (None, Projects::Some(ids)) if ids.len() == 1 => zone.unwrap_or(Tz::UTC),
        (None, _) => Tz::UTC,
    };
    let now = now_micros(s.clock.as_ref());
    let mut schedule = ExportSchedule {
        id: new_id("exs"),
        projects: new.projects,
        period: new.period,
        dimensions: new.dimensions,
        grace: new.grace,
        format: new.format,
        destination: new.destination,
        cadence: new.cadence,
        timezone,
        enabled: new.enabled,
        next_run_at: now,
        last_run_at: None,
        created_at: now,
        updated_at: now,
    };
    schedule.next_run_at = schedule.next_after(now);
    let entry = audit(&schedule, AuditAction::CreateExportSchedule, None, Some(&schedule), by, now);
    s.stores.schedules.create_schedule(&schedule, &[entry]).await?;
    Ok(schedule)
}

async fn schedule_of(s: &AppState, id: &str) -> Result<ExportSchedule> {
    s.stores.schedules.schedule(id).await?.ok_or_else(|| Error::not_found("export schedule", id))
}

/// A schedule and its recent runs.
pub async fn get(s: &AppState, id: &str) -> Result<ScheduleDetail> {
    let schedule = schedule_of(s, id).await?;
    let runs = s.stores.schedules.schedule_runs(id, RECENT_RUNS).await?;
    Ok(ScheduleDetail { schedule, runs })
}

/// A page of schedules by id, after the cursor.
pub async fn list(s: &AppState, after: Option<&str>, limit: usize) -> Result<Page<ExportSchedule>> {
    let limit = limit.clamp(1, MAX_PAGE);
    let mut items = s.stores.schedules.schedules(after, limit + 1).await?;
    let next = if items.len() > limit {
        items.truncate(limit);
        items.last().map(|l| l.id.clone())
    } else {
        None
    };
    Ok(Page { items, next })
}

/// Changes a schedule, audited as `by`. A new cadence sets the next run
/// by it; enabling a schedule never runs it for the boundaries it missed
/// while disabled, only from the next one.
pub async fn update(s: &AppState, id: &str, patch: SchedulePatch, by: &Principal) -> Result<ExportSchedule> {
    let before = schedule_of(s, id).await?;
    let now = now_micros(s.clock.as_ref());
    let mut after = before.clone();
    if let Some(e) = patch.enabled {
        after.enabled = e;
    }
    if let Some(c) = patch.cadence {
        after.cadence = c;
    }
    if let Some(f) = patch.format {
        after.format = f;
    }
    if let Some(d) = patch.destination {
        after.destination = d;
    }
    if after.cadence != before.cadence || (after.enabled && !before.enabled) {
        after.next_run_at = after.next_after(now);
    }
    after.updated_at = now;
    store_change(s, &before, &after, by, now).await?;
    Ok(after)
}

/// Makes a schedule due now: the next notifier step runs it (a disabled
/// one is refused: enable it first).
pub async fn run_now(s: &AppState, id: &str, by: &Principal) -> Result<ExportSchedule> {
    let before = schedule_of(s, id).await?;
    if !before.enabled {
        return Err(Error::invalid("enabled", "the schedule is disabled: enable it before running it"));
    }
    let now = now_micros(s.clock.as_ref());
    let after = ExportSchedule { next_run_at: now, updated_at: now, ..before.clone() };
    store_change(s, &before, &after, by, now).await?;
    Ok(after)
}

async fn store_change(
    s: &AppState,
    before: &ExportSchedule,
    after: &ExportSchedule,
    by: &Principal,
    at: DateTime<Utc>,
) -> Result<()> {
    let entry = audit(after, AuditAction::UpdateExportSchedule, Some(before), Some(after), by, at);
    if !s.stores.schedules.update_schedule(after, &[entry]).await? {
        return Err(Error::not_found("export schedule", after.id.clone()));
    }
    Ok(())
}

/// Deletes a schedule (its runs stay, and count for their exports).
pub async fn delete(s: &AppState, id: &str, by: &Principal) -> Result<()> {
    let before = schedule_of(s, id).await?;
    let now = now_micros(s.clock.as_ref());
    let entry = audit(&before, AuditAction::DeleteExportSchedule, Some(&before), None, by, now);
    if !s.stores.schedules.delete_schedule(id, &[entry]).await? {
        return Err(Error::not_found("export schedule", id));
    }
    Ok(())
}

/// Runs due schedules: the notifier's second duty (see the module doc).
pub struct Scheduler {
    tenants: Arc<dyn TenantStore>,
    exports: Arc<dyn ExportStore>,
    schedules: Arc<dyn ScheduleStore>,
    clock: Arc<dyn Clock>,
    settings: ExportSettings,
    claimant: String,
    /// How long an idle scheduler waits before it looks again.
    pub poll: Duration,
}

/// What one step did: the schedule it ran, and its runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerStep {
    pub schedule_id: String,
    pub runs: Vec<ExportRun>,
    /// Projects whose export was running already, left for the retry.
    pub busy: Vec<String>,
    /// When the schedule is due next.
    pub next_run_at: DateTime<Utc>,
}

impl Scheduler {
    pub fn new(
        tenants: Arc<dyn TenantStore>,
        exports: Arc<dyn ExportStore>,
        schedules: Arc<dyn ScheduleStore>,
        clock: Arc<dyn Clock>,
        settings: ExportSettings,
        claimant: impl Into<String>,
    ) -> Scheduler {
        Scheduler {
            tenants,
            exports,
            schedules,
            clock,
            settings,
            claimant: claimant.into(),
            poll: Duration::from_secs(1),
        }
    }

    /// How long a claim on a schedule lasts: past one project's run at its
    /// time bound, with room to end it. Renewed before each project.
    fn lease(&self) -> chrono::Duration {
        let d = self.settings.max_time.saturating_add(Duration::from_secs(300));
        chrono::Duration::from_std(d).unwrap_or(chrono::Duration::hours(1))
    }

    /// Claims the schedule due soonest and runs it; `None` when none is due.
    pub async fn step(&self) -> Result<Option<SchedulerStep>> {
        let at = self.clock.now();
        let Some(schedule) = self.schedules.claim_due_schedule(&self.claimant, at, at + self.lease()).await? else {
            return Ok(None);
        };
        let projects = match &schedule.projects {
            Projects::Some(ids) => ids.clone(),
            Projects::All => self.tenants.projects().await?.into_iter().map(|p| p.id).collect(),
        };
        let mut step = SchedulerStep {
            schedule_id: schedule.id.clone(),
            runs: Vec::new(),
            busy: Vec::new(),
            next_run_at: schedule.next_after(at),
        };
        let mut retry = false;
        for project in projects {
            let now = self.clock.now();
            if !self.schedules.extend_schedule_claim(&schedule.id, &self.claimant, now + self.lease()).await? {
                warn!(schedule = %schedule.id, "export schedule: claim lost mid-run; another notifier has it");
                return Ok(Some(step));
            }
            let spec = schedule.spec(project.clone()).map_err(Error::Invalid)?;
            let req = ExportRequest {
                spec,
                format: schedule.format,
                out: Output::Dir(self.settings.dir.join(schedule.destination.as_str())),
                max_rows: self.settings.max_rows,
                max_time: self.settings.max_time,
                slice: self.settings.slice,
                consumer: self.settings.consumer.clone(),
                topic: self.settings.topic.clone(),
                principal: Some(Principal::new("schedule", schedule.id.clone())),
                schedule_id: Some(schedule.id.clone()),
            };
            match run_export(self.tenants.as_ref(), self.exports.as_ref(), self.clock.as_ref(), &req, &|_, _| {}).await
            {
                Ok(run) => {
                    info!(schedule = %schedule.id, run = %run.id, project = %project, status = run.status.as_str(),
                          rows = run.rows, "export schedule: run ended");
                    step.runs.push(run);
                }
                Err(Error::ExportRunning { project }) => {
                    step.busy.push(project);
                    retry = true;
                }
                Err(Error::NotFound { what: "project", id }) => {
                    warn!(schedule = %schedule.id, project = %id, "export schedule: the project is gone; skipped");
                }
                Err(e) => {
                    warn!(schedule = %schedule.id, project = %project, error = %e, "export schedule: the run could not start");
                    retry = true;
                }
            }
        }
        let ended = self.clock.now();
        if retry {
            let soon = ended + chrono::Duration::from_std(RETRY).unwrap_or(chrono::Duration::minutes(1));
            step.next_run_at = step.next_run_at.min(soon);
        }
        if !self.schedules.finish_schedule_run(&schedule.id, &self.claimant, at, step.next_run_at).await? {
            warn!(schedule = %schedule.id, "export schedule: claim lost before the run was recorded");
        }
        Ok(Some(step))
    }

    /// Runs steps until `shutdown` resolves (between steps), waiting
    /// [`Scheduler::poll`] whenever nothing was due or the store failed.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        info!(claimant = %self.claimant, dir = %self.settings.dir.display(), "export scheduler running");
        loop {
            let idle = match self.step().await {
                Ok(done) => done.is_none(),
                Err(Error::Backend(e)) if e.is_transient() => {
                    warn!(error = %e, "export scheduler: store unavailable; retrying");
                    true
                }
                Err(e) => {
                    warn!(error = %e, "export scheduler: a step failed");
                    true
                }
            };
            let wait = if idle { self.poll } else { Duration::ZERO };
            tokio::select! {
                biased;
                _ = &mut shutdown => return Ok(()),
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}
