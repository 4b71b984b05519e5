//! Usage: reports over what was folded, and a counter's live count.
//!
//! A report (`GET /v1/usage`) is a project's durable usage in one calendar
//! window (`day` or `calendar_month`, in the project's time zone), grouped
//! by model, actor, agent or API key. Its figures are what the projector has
//! folded (the ledger's aggregates), so they lag the hot path by the events
//! not yet folded and never count an event twice.
//!
//! A live count ([`live_count`]) is what a check compares against: durable
//! plus settled plus reserved, from the view (seeded if it must be), or the
//! durable totals alone when the view cannot answer.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use meter::{CounterKey, Dimension, ModelUsageRow, Population, Project, ProjectId, Totals, View, Window, WindowKind};

use super::{Error, Result};
use crate::state::AppState;

/// What a report groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Model,
    Actor,
    Agent,
    ApiKey,
}

impl GroupBy {
    pub const ALL: [GroupBy; 4] = [GroupBy::Model, GroupBy::Actor, GroupBy::Agent, GroupBy::ApiKey];

    pub fn as_str(self) -> &'static str {
        match self {
            GroupBy::Model => "model",
            GroupBy::Actor => "actor",
            GroupBy::Agent => "agent",
            GroupBy::ApiKey => "api_key",
        }
    }
}

impl FromStr for GroupBy {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        GroupBy::ALL.into_iter().find(|g| g.as_str() == s).ok_or(())
    }
}

/// A report asked for, its parameters checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageQuery {
    pub project_id: ProjectId,
    pub group_by: GroupBy,
    pub window: WindowKind,
    /// The instant whose window is reported; `None` is now.
    pub at: Option<DateTime<Utc>>,
}

/// One actor, agent or key of a report, and its durable totals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The id field it is reported under: `actor_id`, `agent_id` or `api_key_id`.
    pub field: &'static str,
    pub id: String,
    pub totals: Totals,
}

/// The rows of a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rows {
    /// By model: one row per (provider, model, component, meter, embedding).
    Models(Vec<ModelUsageRow>),
    /// By actor, agent or key.
    Members(Vec<Member>),
}

/// A usage report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub project: Project,
    pub window: Window,
    pub group_by: GroupBy,
    pub rows: Rows,
}

/// The id field and id of a counter's dimension, if it is of the group.
pub fn member(group_by: GroupBy, key: &CounterKey) -> Option<(&'static str, String)> {
    match (group_by, &key.dimension) {
        (GroupBy::Actor, Dimension::Actor(a)) => Some(("actor_id", a.clone())),
        (GroupBy::Agent, Dimension::Agent(g)) => Some(("agent_id", g.clone())),
        (GroupBy::ApiKey, Dimension::ApiKey(k)) => Some(("api_key_id", k.as_str().to_owned())),
        _ => None,
    }
}

/// A usage report of a project (404 if there is no such project).
pub async fn report(s: &AppState, q: UsageQuery) -> Result<Report> {
    let project = s
        .stores
        .tenants
        .project(&q.project_id)
        .await?
        .ok_or_else(|| Error::not_found("project", q.project_id.as_str()))?;
    let window = meter::window_at(q.window, project.timezone, q.at.unwrap_or_else(|| s.clock.now()));
    let rows = match q.group_by {
        GroupBy::Model => Rows::Models(s.stores.reports.model_usage(&project.id, window.kind, &window.key).await?),
        g => {
            let population = match g {
                GroupBy::Actor => Population::Actors,
                GroupBy::Agent => Population::Agents,
                _ => Population::ApiKeys,
            };
            let totals = s.stores.reports.population_totals(&project.id, population, window.kind, &window.key).await?;
            Rows::Members(
                totals
                    .into_iter()
                    .filter_map(|(k, totals)| member(g, &k).map(|(field, id)| Member { field, id, totals }))
                    .collect(),
            )
        }
    };
    Ok(Report { project, window, group_by: q.group_by, rows })
}

/// Most slices a window is charted in (a month of days, a DST day of hours,
/// an hour of minutes).
pub const MAX_SLICES: usize = 62;

/// The shorter windows a window's usage is charted in, from its start up to
/// `until` (or its end): the days of a calendar month, the hours of a day or
/// of 24 hours, the minutes of an hour; none for a minute or `current`.
/// Rolling windows are whole UTC hours and minutes, so in a zone whose
/// offset is not whole hours (+05:45) the first hour of a day begins before
/// the day does.
pub fn slices(window: &Window, tz: chrono_tz::Tz, until: DateTime<Utc>) -> Vec<Window> {
    let sub = match window.kind {
        WindowKind::CalendarMonth => WindowKind::Day,
        WindowKind::Day | WindowKind::Rolling24h => WindowKind::Rolling1h,
        WindowKind::Rolling1h => WindowKind::Rolling1m,
        WindowKind::Rolling1m | WindowKind::Current => return Vec::new(),
    };
    let mut out = Vec::new();
    let mut t = window.start;
    while t <= until && window.resets_at.is_none_or(|r| t < r) && out.len() < MAX_SLICES {
        let w = meter::window_at(sub, tz, t);
        match w.resets_at {
            Some(next) if next > t => t = next,
            _ => break,
        }
        out.push(w);
    }
    out
}

/// The durable totals of one dimension in each of the given windows (zero
/// where nothing was folded), in their order: one read of the ledger.
pub async fn durable_series(
    s: &AppState,
    project: &ProjectId,
    dimension: &Dimension,
    windows: &[Window],
) -> Result<Vec<Totals>> {
    let keys: Vec<CounterKey> = windows
        .iter()
        .map(|w| CounterKey { dimension: dimension.clone(), window: w.kind, window_key: w.key.clone() })
        .collect();
    let found: std::collections::HashMap<CounterKey, Totals> =
        s.stores.ledger.totals(project, &keys).await?.into_iter().collect();
    Ok(keys.iter().map(|k| found.get(k).copied().unwrap_or_default()).collect())
}

/// A counter's usage (durable + pending + the estimates its live
/// reservations hold) and its live reservations: from the view (which seeds
/// an unseeded project), or the durable totals alone, with no reservations,
/// when the view cannot answer.
pub async fn live_count(
    s: &AppState,
    project: &ProjectId,
    key: &CounterKey,
    at: DateTime<Utc>,
) -> Result<(Totals, u64)> {
    if let Ok(Some(u)) = s.view.usage(project, key, at).await {
        let mut t = u.durable;
        t.add(u.pending);
        t.add(u.reserved);
        return Ok((t, u.reserved_calls));
    }
    let totals = s.stores.ledger.totals(project, std::slice::from_ref(key)).await?;
    Ok((totals.into_iter().next().map(|(_, t)| t).unwrap_or_default(), 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_members_of_the_group_are_listed() {
        let k = |d: Dimension| CounterKey { dimension: d, window: WindowKind::Day, window_key: "2026-07-07".into() };
        assert_eq!(member(GroupBy::ApiKey, &k(Dimension::AllApiKeys)), None);
        assert_eq!(member(GroupBy::Actor, &k(Dimension::Agent("a".into()))), None);
        assert_eq!(member(GroupBy::Agent, &k(Dimension::Agent("a".into()))), Some(("agent_id", "a".to_owned())));
    }

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("instant").with_timezone(&Utc)
    }

    #[test]
    fn a_window_is_charted_in_its_days_hours_or_minutes_up_to_now() {
        let tz = chrono_tz::Asia::Kathmandu;
        let at = utc("2026-08-03T06:10:00Z");
        let month = meter::window_at(WindowKind::CalendarMonth, tz, at);
        let days: Vec<String> = slices(&month, tz, at).into_iter().map(|w| w.key).collect();
        assert_eq!(days, ["2026-08-01", "2026-08-02", "2026-08-03"]);
        // A Kathmandu day begins at 18:15 UTC: its first hour is 18:00-19:00 UTC.
        let day = meter::window_at(WindowKind::Day, tz, at);
        let hours = slices(&day, tz, at);
        assert_eq!(hours.first().map(|w| w.start), Some(utc("2026-08-02T18:00:00Z")));
        assert_eq!(hours.last().map(|w| w.start), Some(utc("2026-08-03T06:00:00Z")));
        assert_eq!(hours.len(), 13);
        let whole = slices(&day, tz, utc("2026-08-09T00:00:00Z"));
        assert_eq!(whole.len(), 25, "to the day's end, which is inside its 25th UTC hour");
        let hour = meter::window_at(WindowKind::Rolling1h, tz, at);
        assert_eq!(slices(&hour, tz, at).len(), 11, "06:00 to 06:10");
        assert!(slices(&meter::window_at(WindowKind::Rolling1m, tz, at), tz, at).is_empty());
    }
}
