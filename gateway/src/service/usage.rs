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
}
