//! Export schedule bodies (`/v1/export-schedules`).

use chrono::{DateTime, Utc};
use meter::export::{Destination, ExportSchedule, Projects};
use meter::{FieldError, ProjectId};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::exports::{ExportRunView, dimensions, format, grace, period};
use super::{Count, Flag, Text, required};
use crate::service::export_schedules::{MAX_PAGE, NewSchedule, ScheduleDetail, SchedulePatch};

/// `POST /v1/export-schedules`: an export the notifier runs on a cadence.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_ids": ["proj_01j9"], "period": "day", "dimensions": ["api_key"],
                          "format": "csv", "destination": "finance/daily", "cadence": "daily"}))]
pub struct ScheduleBody {
    /// The projects, 1 to 100; or give `all_projects` instead.
    #[schema(value_type = Option<Vec<String>>)]
    pub project_ids: Option<Vec<Text>>,
    /// `true`: every project there is at each run (those created later too).
    #[schema(value_type = Option<bool>)]
    pub all_projects: Option<Flag>,
    /// `day` or `calendar_month`, in each project's time zone.
    #[schema(value_type = String)]
    pub period: Option<Text>,
    /// One or several of `project`, `api_key`, `actor`, `agent`, `user`.
    #[schema(value_type = Vec<String>)]
    pub dimensions: Option<Vec<Text>>,
    /// `csv`, `jsonl` or `parquet`.
    #[schema(value_type = String)]
    pub format: Option<Text>,
    /// A relative directory under the notifier's export directory
    /// (`TOLLGATE_EXPORT_DIR`), where each run writes
    /// `project=<id>/period=<key>/part-<run>.<ext>`.
    #[schema(value_type = String)]
    pub destination: Option<Text>,
    /// `hourly`, `daily` or `monthly`: a run once the grace has passed
    /// since each hour, midnight or first of the month in `timezone`.
    #[schema(value_type = String)]
    pub cadence: Option<Text>,
    /// The IANA zone of the cadence: by default the project's for a
    /// schedule of one project, else UTC.
    #[schema(value_type = Option<String>)]
    pub timezone: Option<Text>,
    /// Seconds after a period ends before it closes: 3600 by default, at most 259200 (72 h).
    #[schema(value_type = Option<u64>)]
    pub grace_seconds: Option<Count>,
    /// Default true.
    #[schema(value_type = Option<bool>)]
    pub enabled: Option<Flag>,
}

fn projects(ids: Option<Vec<Text>>, all: Option<Flag>) -> Result<Projects, FieldError> {
    match (ids, all) {
        (Some(_), Some(Flag(true))) => {
            Err(FieldError::new("all_projects", "give project_ids or all_projects, not both"))
        }
        (None, Some(Flag(true))) => Ok(Projects::All),
        (Some(ids), _) => {
            let mut parsed = Vec::with_capacity(ids.len());
            for (i, Text(id)) in ids.into_iter().enumerate() {
                parsed.push(
                    ProjectId::parse(id).map_err(|e| FieldError::new(format!("project_ids[{i}]"), e.to_string()))?,
                );
            }
            Projects::list(parsed, "project_ids")
        }
        (None, _) => Err(FieldError::new("project_ids", "is required (or all_projects: true)")),
    }
}

fn cadence(Text(c): Text) -> Result<meter::export::Cadence, FieldError> {
    c.parse().map_err(|e| FieldError::new("cadence", e))
}

fn destination(Text(d): Text) -> Result<Destination, FieldError> {
    Destination::parse(&d)
}

impl TryFrom<ScheduleBody> for NewSchedule {
    type Error = FieldError;
    fn try_from(b: ScheduleBody) -> Result<NewSchedule, FieldError> {
        let timezone = b
            .timezone
            .map(|Text(z)| {
                z.parse().map_err(|_| FieldError::new("timezone", format!("{z:?} is not an IANA time zone")))
            })
            .transpose()?;
        Ok(NewSchedule {
            projects: projects(b.project_ids, b.all_projects)?,
            period: period(required(b.period, "period")?)?,
            dimensions: dimensions(required(b.dimensions, "dimensions")?)?,
            grace: grace(b.grace_seconds)?,
            format: format(required(b.format, "format")?)?,
            destination: destination(required(b.destination, "destination")?)?,
            cadence: cadence(required(b.cadence, "cadence")?)?,
            timezone,
            enabled: b.enabled.is_none_or(|Flag(f)| f),
        })
    }
}

/// `PATCH /v1/export-schedules/{id}`: the fields to change. What the runs
/// bill (projects, period, dimensions, grace) does not change: that is
/// another schedule.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"enabled": false}))]
pub struct SchedulePatchBody {
    #[schema(value_type = Option<bool>)]
    pub enabled: Option<Flag>,
    #[schema(value_type = Option<String>)]
    pub cadence: Option<Text>,
    #[schema(value_type = Option<String>)]
    pub format: Option<Text>,
    #[schema(value_type = Option<String>)]
    pub destination: Option<Text>,
}

impl TryFrom<SchedulePatchBody> for SchedulePatch {
    type Error = FieldError;
    fn try_from(b: SchedulePatchBody) -> Result<SchedulePatch, FieldError> {
        Ok(SchedulePatch {
            enabled: b.enabled.map(|Flag(f)| f),
            cadence: b.cadence.map(cadence).transpose()?,
            format: b.format.map(format).transpose()?,
            destination: b.destination.map(destination).transpose()?,
        })
    }
}

/// An export schedule.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(example = json!({"id": "exs_0193", "project_ids": ["proj_01j9"], "all_projects": false, "period": "day",
    "dimensions": ["api_key"], "grace_seconds": 3600, "format": "csv", "destination": "finance/daily",
    "cadence": "daily", "timezone": "Europe/Paris", "enabled": true, "next_run_at": "2026-07-08T00:00:00Z",
    "last_run_at": null, "created_at": "2026-07-07T12:00:00Z", "updated_at": "2026-07-07T12:00:00Z"}))]
pub struct ScheduleView {
    pub id: String,
    /// The projects it runs for; empty when `all_projects`.
    pub project_ids: Vec<String>,
    pub all_projects: bool,
    pub period: String,
    pub dimensions: Vec<String>,
    pub grace_seconds: u64,
    pub format: String,
    pub destination: String,
    pub cadence: String,
    pub timezone: String,
    pub enabled: bool,
    pub next_run_at: DateTime<Utc>,
    pub last_run_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl From<&ExportSchedule> for ScheduleView {
    fn from(s: &ExportSchedule) -> Self {
        let (project_ids, all_projects) = match &s.projects {
            Projects::All => (Vec::new(), true),
            Projects::Some(ids) => (ids.iter().map(ToString::to_string).collect(), false),
        };
        ScheduleView {
            id: s.id.clone(),
            project_ids,
            all_projects,
            period: s.period.as_str().to_owned(),
            dimensions: s.dimensions.iter().map(|d| d.as_str().to_owned()).collect(),
            grace_seconds: s.grace.duration().as_secs(),
            format: s.format.as_str().to_owned(),
            destination: s.destination.as_str().to_owned(),
            cadence: s.cadence.as_str().to_owned(),
            timezone: s.timezone.name().to_owned(),
            enabled: s.enabled,
            next_run_at: s.next_run_at,
            last_run_at: s.last_run_at,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

/// A schedule with the runs it started, newest first (at most 10).
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"schedule": {"id": "exs_0193", "project_ids": ["proj_01j9"], "all_projects": false,
    "period": "day", "dimensions": ["api_key"], "grace_seconds": 3600, "format": "csv", "destination": "finance/daily",
    "cadence": "daily", "timezone": "UTC", "enabled": true, "next_run_at": "2026-07-09T01:00:00Z",
    "last_run_at": "2026-07-08T01:00:00Z", "created_at": "2026-07-07T12:00:00Z", "updated_at": "2026-07-07T12:00:00Z"},
    "runs": [{"id": "exr_0194", "export_key": "proj_01j9/day/api_key", "project_id": "proj_01j9", "period": "day",
    "dimensions": ["api_key"], "format": "csv", "grace_seconds": 3600, "status": "complete", "mark": null,
    "watermark": {"0": 1200}, "receipt_bound": "2026-07-08T00:59:58Z", "started_at": "2026-07-08T01:00:00Z",
    "finished_at": "2026-07-08T01:00:02Z", "rows": 311, "bytes": 40210, "file": null,
    "reconciliation": {"fold": {"lines": 311, "differing": 0, "differences": []}, "log": null}, "error": null}]}))]
pub struct ScheduleDetailView {
    pub schedule: ScheduleView,
    pub runs: Vec<ExportRunView>,
}

impl ScheduleDetailView {
    pub fn of(d: &ScheduleDetail, downloadable: impl Fn(&meter::export::ExportRun) -> bool) -> Self {
        ScheduleDetailView {
            schedule: ScheduleView::from(&d.schedule),
            runs: d.runs.iter().map(|r| ExportRunView::of(r, downloadable(r))).collect(),
        }
    }
}

/// A page of schedules.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(example = json!({"data": [{"id": "exs_0193", "project_ids": [], "all_projects": true,
    "period": "calendar_month", "dimensions": ["project"], "grace_seconds": 7200, "format": "parquet",
    "destination": "finance/monthly", "cadence": "monthly", "timezone": "UTC", "enabled": true,
    "next_run_at": "2026-08-01T02:00:00Z", "last_run_at": null, "created_at": "2026-07-07T12:00:00Z",
    "updated_at": "2026-07-07T12:00:00Z"}], "next": null}))]
pub struct SchedulePage {
    pub data: Vec<ScheduleView>,
    /// The cursor of the next page (`after`), or `null` on the last.
    pub next: Option<String>,
}

/// `GET /v1/export-schedules`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ScheduleParams {
    /// The `next` of the previous page.
    pub after: Option<String>,
    /// Schedules per page, 1 to 100 (default 50).
    #[param(value_type = Option<u64>)]
    pub limit: Option<String>,
}

impl TryFrom<ScheduleParams> for (Option<String>, usize) {
    type Error = FieldError;
    fn try_from(p: ScheduleParams) -> Result<(Option<String>, usize), FieldError> {
        let limit = match p.limit {
            None => 50,
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_PAGE).contains(n))
                .ok_or_else(|| FieldError::new("limit", format!("must be between 1 and {MAX_PAGE}")))?,
        };
        Ok((p.after, limit))
    }
}
