//! # Export schedules: runs the notifier starts on its own
//!
//! A **schedule** (issue 11 item 6) is an export definition — the projects
//! (some, or all of them, those created later included), the billing
//! period, the customer dimensions, the grace, the format, a destination
//! directory — and a **cadence**: `hourly`, `daily` or `monthly`. The
//! notifier process runs a due schedule: one run of the export per project,
//! written under the destination laid out
//! `project=<id>/period=<key>/part-<run>.<ext>`, and each run's end is
//! announced to the project's webhook endpoints as `export.completed` or
//! `export.failed` ([`notification`]).
//!
//! **When a schedule is due.** A cadence's boundaries are those of a window
//! in the schedule's time zone: every hour (`rolling_1h`: the UTC hour),
//! every midnight (`day`), every first of the month (`calendar_month`). A
//! schedule runs once the export's grace has passed since a boundary
//! ([`next_due`]): a daily export of days with a grace of 1 h runs at 01:00,
//! when the day before has just closed, so that run bills it whole and
//! makes it final. A notifier that was down runs a schedule once when it is
//! back, not once per boundary it missed: each run adds everything folded
//! since the one before, so nothing is lost by skipping.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Component, Path};
use std::str::FromStr;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde_json::json;

use super::{CustomerKind, ExportRun, ExportSpec, Format, Grace, RunStatus};
use crate::error::FieldError;
use crate::ids::ProjectId;
use crate::webhook::{EXPORT_COMPLETED, EXPORT_FAILED, Notification};
use crate::window::{WindowKind, window_at};

/// How often a schedule runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cadence {
    Hourly,
    Daily,
    Monthly,
}

impl Cadence {
    pub const ALL: [Cadence; 3] = [Cadence::Hourly, Cadence::Daily, Cadence::Monthly];

    pub fn as_str(self) -> &'static str {
        match self {
            Cadence::Hourly => "hourly",
            Cadence::Daily => "daily",
            Cadence::Monthly => "monthly",
        }
    }

    /// The window whose boundaries are the cadence's.
    fn window(self) -> WindowKind {
        match self {
            Cadence::Hourly => WindowKind::Rolling1h,
            Cadence::Daily => WindowKind::Day,
            Cadence::Monthly => WindowKind::CalendarMonth,
        }
    }
}

impl fmt::Display for Cadence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Cadence {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Cadence::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| format!("`{s}` is not one of hourly, daily, monthly"))
    }
}

/// When a schedule of `cadence` in `tz`, whose runs wait `delay` past a
/// boundary, is next due after `after`: the first boundary plus `delay`
/// that is strictly after `after`.
pub fn next_due(cadence: Cadence, tz: Tz, delay: Grace, after: DateTime<Utc>) -> DateTime<Utc> {
    let delay = chrono::Duration::from_std(delay.duration()).unwrap_or(chrono::Duration::hours(72));
    // The boundary before `after - delay` is at most `after - delay`: the
    // next one is the end of the window holding that instant.
    let from = after - delay;
    let w = window_at(cadence.window(), tz, from);
    // A cadence window always resets (only `current` does not).
    let boundary = w.resets_at.unwrap_or(from + chrono::Duration::hours(1));
    boundary + delay
}

/// The projects a schedule runs for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Projects {
    /// Every project there is when it runs.
    All,
    /// These, in order (at least one, at most [`Projects::MAX`], each once).
    Some(Vec<ProjectId>),
}

impl Projects {
    pub const MAX: usize = 100;

    /// A list of projects, refused by `field` when empty, too long or
    /// naming one twice.
    pub fn list(ids: Vec<ProjectId>, field: &str) -> Result<Projects, FieldError> {
        if ids.is_empty() || ids.len() > Projects::MAX {
            return Err(FieldError::new(field, format!("name 1 to {} projects, or \"all\"", Projects::MAX)));
        }
        let mut seen = BTreeSet::new();
        for (i, id) in ids.iter().enumerate() {
            if !seen.insert(id) {
                return Err(FieldError::new(format!("{field}[{i}]"), format!("{id} is named twice")));
            }
        }
        Ok(Projects::Some(ids))
    }
}

/// Where a schedule writes: a relative path under the notifier's export
/// directory, with no `..`, no root and no empty or `.` part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination(String);

impl Destination {
    pub const MAX_LEN: usize = 255;

    pub fn parse(s: &str) -> Result<Destination, FieldError> {
        let refuse = |why: &str| Err(FieldError::new("destination", why.to_owned()));
        if s.is_empty() || s.len() > Destination::MAX_LEN {
            return refuse("must be 1 to 255 characters");
        }
        if s.chars().any(|c| c.is_control() || c == '\\') {
            return refuse("must not hold control characters or backslashes");
        }
        for part in s.split('/') {
            if part.is_empty() || part == "." || part == ".." {
                return refuse(
                    "must be a relative directory under the export directory: no leading `/`, no `..`, `.` or empty part",
                );
            }
        }
        if !Path::new(s).components().all(|c| matches!(c, Component::Normal(_))) {
            return refuse("must be a relative directory under the export directory");
        }
        Ok(Destination(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A schedule, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSchedule {
    /// `exs_…`.
    pub id: String,
    pub projects: Projects,
    /// `day` or `calendar_month`.
    pub period: WindowKind,
    /// At least one.
    pub dimensions: BTreeSet<CustomerKind>,
    pub grace: Grace,
    pub format: Format,
    pub destination: Destination,
    pub cadence: Cadence,
    /// The zone of the cadence's boundaries.
    pub timezone: Tz,
    /// A disabled schedule is kept and never runs.
    pub enabled: bool,
    /// When it runs next (an admin's "run now" sets it to now).
    pub next_run_at: DateTime<Utc>,
    /// When it last ran.
    pub last_run_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl ExportSchedule {
    /// The spec of its export of one project.
    pub fn spec(&self, project: ProjectId) -> Result<ExportSpec, FieldError> {
        ExportSpec::new(project, self.period, self.dimensions.clone(), self.grace)
    }

    /// When it is next due after a run at `at` (see [`next_due`]).
    pub fn next_after(&self, at: DateTime<Utc>) -> DateTime<Utc> {
        next_due(self.cadence, self.timezone, self.grace, at)
    }
}

/// The notification of a run's end, to the endpoints of its project that
/// want it: `export.failed` for a failed run, else `export.completed`
/// (`status` `complete`, with its reconciliation, or `partial`, with the
/// bound it stopped at). Its id and dedup key come from the run alone, so
/// however often it is enqueued it is one message.
pub fn notification(run: &ExportRun, at: DateTime<Utc>) -> Notification {
    let event_type = if run.status == RunStatus::Failed { EXPORT_FAILED } else { EXPORT_COMPLETED };
    let dedup = format!("export/{}", run.id);
    let watermark: serde_json::Map<String, serde_json::Value> =
        run.watermark.iter().map(|(p, o)| (p.to_string(), json!(o))).collect();
    let dims: Vec<&str> = run.spec.dimensions.iter().map(|d| d.as_str()).collect();
    let data = json!({
        "run_id": run.id,
        "schedule_id": run.schedule_id,
        "export_key": run.spec.key(),
        "project_id": run.spec.project_id,
        "period": run.spec.period.as_str(),
        "dimensions": dims,
        "format": run.format.as_str(),
        "status": run.status.as_str(),
        "mark": run.mark.map(|m| m.as_str()),
        "rows": run.rows,
        "bytes": run.bytes,
        "watermark": watermark,
        "receipt_bound": run.receipt_bound,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "file": run.file,
        "reconciled": run.reconciliation.as_ref().map(|r| r.ok()),
        "reconciliation": run.reconciliation,
        "error": run.error,
    });
    let id = crate::alert::message_id(&dedup, run.started_at);
    Notification::new(id, run.spec.project_id.clone(), event_type, data, Some(dedup), at)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::export::{Check, Mark, Reconciliation};

    fn t(s: &str) -> DateTime<Utc> {
        s.parse().expect("an instant")
    }

    fn grace(h: u64) -> Grace {
        Grace::new(Duration::from_secs(h * 3600)).expect("grace")
    }

    #[test]
    fn a_daily_schedule_runs_once_the_day_before_has_closed() {
        let utc = chrono_tz::UTC;
        // Created mid-day: first due at 01:00 the next day.
        assert_eq!(next_due(Cadence::Daily, utc, grace(1), t("2026-07-07T12:00:00Z")), t("2026-07-08T01:00:00Z"));
        // Between midnight and 01:00 the day before has not closed yet.
        assert_eq!(next_due(Cadence::Daily, utc, grace(1), t("2026-07-08T00:30:00Z")), t("2026-07-08T01:00:00Z"));
        // Exactly at its time, the next is a day later (strictly after).
        assert_eq!(next_due(Cadence::Daily, utc, grace(1), t("2026-07-08T01:00:00Z")), t("2026-07-09T01:00:00Z"));
        // A notifier down for three days runs it once, then on time.
        assert_eq!(next_due(Cadence::Daily, utc, grace(1), t("2026-07-11T09:00:00Z")), t("2026-07-12T01:00:00Z"));
    }

    #[test]
    fn boundaries_are_the_zones_and_survive_daylight_saving() {
        let ny: Tz = "America/New_York".parse().expect("zone");
        // 2026-03-08 is 23 hours long in New York (EST → EDT).
        assert_eq!(next_due(Cadence::Daily, ny, grace(0), t("2026-03-08T04:59:59Z")), t("2026-03-08T05:00:00Z"));
        assert_eq!(next_due(Cadence::Daily, ny, grace(0), t("2026-03-08T05:00:00Z")), t("2026-03-09T04:00:00Z"));
        let ktm: Tz = "Asia/Kathmandu".parse().expect("zone");
        assert_eq!(next_due(Cadence::Monthly, ktm, grace(2), t("2026-07-15T00:00:00Z")), t("2026-07-31T20:15:00Z"));
        assert_eq!(
            next_due(Cadence::Hourly, chrono_tz::UTC, grace(0), t("2026-07-07T12:59:59Z")),
            t("2026-07-07T13:00:00Z")
        );
        // A grace longer than the cadence still lands strictly after.
        let at = t("2026-07-07T12:10:00Z");
        let due = next_due(Cadence::Hourly, chrono_tz::UTC, grace(3), at);
        assert_eq!(due, t("2026-07-07T13:00:00Z"));
        assert!(due > at);
    }

    #[test]
    fn next_due_is_always_after_and_a_boundary_plus_the_grace() {
        let zones: [Tz; 3] =
            [chrono_tz::UTC, "Asia/Kathmandu".parse().expect("z"), "Europe/London".parse().expect("z")];
        let mut at = t("2026-01-01T00:00:00Z");
        while at < t("2027-01-01T00:00:00Z") {
            for tz in zones {
                for cadence in Cadence::ALL {
                    for h in [0, 1, 72] {
                        let due = next_due(cadence, tz, grace(h), at);
                        assert!(due > at, "{cadence} {tz} {at}");
                        let boundary = due - chrono::Duration::hours(h as i64);
                        assert_eq!(window_at(cadence.window(), tz, boundary).start, boundary, "{cadence} {tz} {at}");
                        // No boundary in between was skipped.
                        let before = window_at(cadence.window(), tz, boundary - chrono::Duration::seconds(1)).start;
                        assert!(before + chrono::Duration::hours(h as i64) <= at, "{cadence} {tz} {at}");
                    }
                }
            }
            at += chrono::Duration::minutes(4321);
        }
    }

    #[test]
    fn a_destination_stays_under_the_export_directory() {
        for ok in ["finance", "finance/monthly", "a b/c-d_e.f"] {
            assert_eq!(Destination::parse(ok).expect(ok).as_str(), ok);
        }
        for bad in ["", "/etc", "../up", "a/../../b", "a//b", "./a", "a/.", "a\\b", "a\nb", &"x".repeat(256)] {
            assert_eq!(Destination::parse(bad).expect_err(bad).field, "destination", "{bad:?}");
        }
    }

    #[test]
    fn a_list_of_projects_names_each_once() {
        let p = |s: &str| ProjectId::parse(s).expect("id");
        assert!(Projects::list(vec![p("proj_a"), p("proj_b")], "project_ids").is_ok());
        assert_eq!(Projects::list(vec![], "project_ids").expect_err("empty").field, "project_ids");
        assert_eq!(
            Projects::list(vec![p("proj_a"), p("proj_a")], "project_ids").expect_err("twice").field,
            "project_ids[1]"
        );
    }

    #[test]
    fn a_runs_notification_is_completed_or_failed_and_one_per_run() {
        let spec = ExportSpec::new(
            ProjectId::parse("proj_1").expect("id"),
            WindowKind::Day,
            BTreeSet::from([CustomerKind::ApiKey]),
            Grace::DEFAULT,
        )
        .expect("spec");
        let mut run = ExportRun {
            id: "exr_1".into(),
            spec,
            format: Format::Csv,
            status: RunStatus::Complete,
            mark: None,
            watermark: BTreeMap::from([(0, 12), (1, 7)]),
            receipt_bound: Some(t("2026-07-07T12:00:00Z")),
            started_at: t("2026-07-08T01:00:00Z"),
            finished_at: Some(t("2026-07-08T01:00:02Z")),
            rows: 40,
            bytes: 4000,
            file: Some("/x/exports".into()),
            reconciliation: Some(Reconciliation {
                fold: Check { lines: 40, differing: 0, differences: vec![] },
                log: None,
            }),
            error: None,
            schedule_id: Some("exs_1".into()),
        };
        let at = t("2026-07-08T01:00:03Z");
        let n = notification(&run, at);
        assert_eq!(n.event_type, EXPORT_COMPLETED);
        assert_eq!(n.dedup_key.as_deref(), Some("export/exr_1"));
        let body: serde_json::Value = serde_json::from_str(&n.body).expect("json");
        assert_eq!(body["type"], "export.completed");
        assert_eq!(body["data"]["schedule_id"], "exs_1");
        assert_eq!(body["data"]["export_key"], "proj_1/day/api_key");
        assert_eq!(body["data"]["rows"], 40);
        assert_eq!(body["data"]["watermark"], json!({"0": 12, "1": 7}));
        assert_eq!(body["data"]["reconciled"], true);
        // The same run, later: the same message.
        assert_eq!(notification(&run, at).id, n.id);
        run.status = RunStatus::Partial;
        run.mark = Some(Mark::Rows);
        run.reconciliation = None;
        let p: serde_json::Value = serde_json::from_str(&notification(&run, at).body).expect("json");
        assert_eq!((p["type"].as_str(), p["data"]["mark"].as_str()), (Some("export.completed"), Some("ROWS")));
        assert_eq!(p["data"]["reconciled"], serde_json::Value::Null);
        run.status = RunStatus::Failed;
        run.error = Some("disk full".into());
        let f: serde_json::Value = serde_json::from_str(&notification(&run, at).body).expect("json");
        assert_eq!((f["type"].as_str(), f["data"]["error"].as_str()), (Some("export.failed"), Some("disk full")));
    }
}
