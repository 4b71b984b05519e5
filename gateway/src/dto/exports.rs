//! Billing export bodies (`/v1/exports`).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use meter::export::{CustomerKind, ExportRun, Format, Grace, Reconciliation};
use meter::{FieldError, ProjectId, WindowKind};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Count, Text, required};

/// `POST /v1/exports`: one run of an export. Runs of the same project,
/// period and dimensions are runs of the same export: each writes only what
/// was folded since the ones before it.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"project_id": "proj_01j9", "period": "calendar_month",
                          "dimensions": ["actor", "api_key"], "format": "parquet"}))]
pub struct ExportBody {
    #[schema(value_type = String)]
    pub project_id: Option<Text>,
    /// `day` or `calendar_month`, in the project's time zone.
    #[schema(value_type = String)]
    pub period: Option<Text>,
    /// One or several of `project`, `api_key`, `actor`, `agent`, `user`.
    #[schema(value_type = Vec<String>)]
    pub dimensions: Option<Vec<Text>>,
    /// `csv`, `jsonl` or `parquet`.
    #[schema(value_type = String)]
    pub format: Option<Text>,
    /// How long after a period ends its usage may still arrive before it
    /// closes, in seconds: 3600 by default, at most 259200 (72 h).
    #[schema(value_type = Option<u64>)]
    pub grace_seconds: Option<Count>,
}

/// An export run asked for, its fields checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewExport {
    pub project_id: ProjectId,
    pub period: WindowKind,
    pub dimensions: BTreeSet<CustomerKind>,
    pub format: Format,
    pub grace: Grace,
}

impl TryFrom<ExportBody> for NewExport {
    type Error = FieldError;
    fn try_from(b: ExportBody) -> Result<NewExport, FieldError> {
        let project_id = ProjectId::parse(required(b.project_id, "project_id")?.0)
            .map_err(|e| FieldError::new("project_id", e.to_string()))?;
        Ok(NewExport {
            project_id,
            period: period(required(b.period, "period")?)?,
            dimensions: dimensions(required(b.dimensions, "dimensions")?)?,
            format: format(required(b.format, "format")?)?,
            grace: grace(b.grace_seconds)?,
        })
    }
}

/// An export's `period`: `day` or `calendar_month`.
pub(crate) fn period(Text(p): Text) -> Result<WindowKind, FieldError> {
    match p.as_str() {
        "day" => Ok(WindowKind::Day),
        "calendar_month" => Ok(WindowKind::CalendarMonth),
        other => Err(FieldError::new("period", format!("must be day or calendar_month; got {other:?}"))),
    }
}

/// An export's `dimensions`: at least one, each once.
pub(crate) fn dimensions(given: Vec<Text>) -> Result<BTreeSet<CustomerKind>, FieldError> {
    if given.is_empty() {
        return Err(FieldError::new("dimensions", "name at least one of project, api_key, actor, agent, user"));
    }
    let mut dimensions = BTreeSet::new();
    for (i, Text(d)) in given.into_iter().enumerate() {
        let k = d.parse::<CustomerKind>().map_err(|e| FieldError::new(format!("dimensions[{i}]"), e))?;
        if !dimensions.insert(k) {
            return Err(FieldError::new(format!("dimensions[{i}]"), format!("{d} is named twice")));
        }
    }
    Ok(dimensions)
}

/// A run's `format`.
pub(crate) fn format(Text(f): Text) -> Result<Format, FieldError> {
    f.parse::<Format>().map_err(|e| FieldError::new("format", e))
}

/// An export's `grace_seconds`: 3600 unless given, at most 72 h.
pub(crate) fn grace(given: Option<Count>) -> Result<Grace, FieldError> {
    match given {
        None => Ok(Grace::DEFAULT),
        Some(Count(s)) => {
            Grace::new(std::time::Duration::from_secs(s)).map_err(|e| FieldError::new("grace_seconds", e.message))
        }
    }
}

/// One run of an export.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"id": "exr_0193", "export_key": "proj_01j9/calendar_month/actor+api_key",
    "project_id": "proj_01j9", "period": "calendar_month", "dimensions": ["api_key", "actor"], "format": "parquet",
    "grace_seconds": 3600, "status": "complete", "mark": null, "watermark": {"0": 1200, "1": 1187},
    "receipt_bound": "2026-07-31T23:59:58Z", "started_at": "2026-08-01T02:00:00Z", "finished_at": "2026-08-01T02:00:03Z",
    "rows": 4211, "bytes": 183220, "file": "/v1/exports/exr_0193/file",
    "reconciliation": {"fold": {"lines": 4211, "differing": 0, "differences": []}, "log": null}, "error": null}))]
pub struct ExportRunView {
    pub id: String,
    /// The export the run belongs to: `<project>/<period>/<dimensions>`.
    pub export_key: String,
    pub project_id: String,
    pub period: String,
    pub dimensions: Vec<String>,
    pub format: String,
    pub grace_seconds: u64,
    /// `running`, `complete`, `partial` (stopped at a bound: see `mark`) or `failed` (see `error`).
    pub status: String,
    /// `ROWS` or `TIME`: the bound a partial run stopped at. The next run writes the rest.
    pub mark: Option<String>,
    /// The usage topic's next offset per partition the run covers (everything before it).
    pub watermark: BTreeMap<String, i64>,
    /// The newest receipt time folded by the watermark.
    pub receipt_bound: Option<DateTime<Utc>>,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub rows: u64,
    pub bytes: u64,
    /// Where to download the file (a run through the API), if it has one.
    pub file: Option<String>,
    /// For a complete run: every line's sum over all runs of the export
    /// against the fold at the watermark (`fold`), and against a fold of
    /// the log itself (`log`, once `tollgate export --verify` checked it).
    #[schema(value_type = Option<Object>)]
    pub reconciliation: Option<Reconciliation>,
    pub error: Option<String>,
}

impl ExportRunView {
    /// The view of a run; `downloadable` when the API holds its file.
    pub fn of(r: &ExportRun, downloadable: bool) -> ExportRunView {
        ExportRunView {
            id: r.id.clone(),
            export_key: r.spec.key(),
            project_id: r.spec.project_id.to_string(),
            period: r.spec.period.as_str().to_owned(),
            dimensions: r.spec.dimensions.iter().map(|d| d.as_str().to_owned()).collect(),
            format: r.format.as_str().to_owned(),
            grace_seconds: r.spec.grace.duration().as_secs(),
            status: r.status.as_str().to_owned(),
            mark: r.mark.map(|m| m.as_str().to_owned()),
            watermark: r.watermark.iter().map(|(p, o)| (p.to_string(), *o)).collect(),
            receipt_bound: r.receipt_bound,
            started_at: r.started_at,
            finished_at: r.finished_at,
            rows: r.rows,
            bytes: r.bytes,
            file: (downloadable && r.file.is_some()).then(|| format!("/v1/exports/{}/file", r.id)),
            reconciliation: r.reconciliation.clone(),
            error: r.error.clone(),
        }
    }
}
