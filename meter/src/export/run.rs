//! # An export and its runs, as the store keeps them
//!
//! An **export** is what finance asks for: one project's usage per charge
//! period (`day` or `calendar_month` in the project's zone) for some
//! customer dimensions. Its identity is [`ExportSpec::key`]: two requests
//! for the same project, period and dimensions are runs of the same export,
//! and each run writes only what was folded since the runs before it (see
//! [`super::run`]). A run's format is its own: the rows are the same.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Amounts, Grace, Item};
use crate::error::FieldError;
use crate::ids::ProjectId;
use crate::usage::Dimension;
use crate::window::WindowKind;

/// A kind of customer an export bills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CustomerKind {
    Project,
    ApiKey,
    Actor,
    Agent,
    User,
}

impl CustomerKind {
    pub const ALL: [CustomerKind; 5] =
        [CustomerKind::Project, CustomerKind::ApiKey, CustomerKind::Actor, CustomerKind::Agent, CustomerKind::User];

    pub fn as_str(self) -> &'static str {
        match self {
            CustomerKind::Project => "project",
            CustomerKind::ApiKey => "api_key",
            CustomerKind::Actor => "actor",
            CustomerKind::Agent => "agent",
            CustomerKind::User => "user",
        }
    }

    /// The kind of a customer dimension (`None` for the all-keys sum).
    pub fn of(d: &Dimension) -> Option<CustomerKind> {
        match d {
            Dimension::Project => Some(CustomerKind::Project),
            Dimension::ApiKey(_) => Some(CustomerKind::ApiKey),
            Dimension::Actor(_) => Some(CustomerKind::Actor),
            Dimension::Agent(_) => Some(CustomerKind::Agent),
            Dimension::User(_) => Some(CustomerKind::User),
            Dimension::AllApiKeys => None,
        }
    }
}

impl FromStr for CustomerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        CustomerKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("`{s}` is not one of project, api_key, actor, agent, user"))
    }
}

/// A file format of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    Csv,
    Jsonl,
    Parquet,
}

impl Format {
    pub const ALL: [Format; 3] = [Format::Csv, Format::Jsonl, Format::Parquet];

    pub fn as_str(self) -> &'static str {
        match self {
            Format::Csv => "csv",
            Format::Jsonl => "jsonl",
            Format::Parquet => "parquet",
        }
    }

    /// The file name extension.
    pub fn extension(self) -> &'static str {
        self.as_str()
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Csv => "text/csv; charset=utf-8",
            Format::Jsonl => "application/jsonl",
            Format::Parquet => "application/vnd.apache.parquet",
        }
    }
}

impl FromStr for Format {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Format::ALL
            .into_iter()
            .find(|f| f.as_str() == s)
            .ok_or_else(|| format!("`{s}` is not one of csv, jsonl, parquet"))
    }
}

/// What an export covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    pub project_id: ProjectId,
    /// `day` or `calendar_month`.
    pub period: WindowKind,
    /// At least one.
    pub dimensions: BTreeSet<CustomerKind>,
    pub grace: Grace,
}

impl ExportSpec {
    /// A spec of a `day` or `calendar_month` period and at least one dimension.
    pub fn new(
        project_id: ProjectId,
        period: WindowKind,
        dimensions: BTreeSet<CustomerKind>,
        grace: Grace,
    ) -> Result<ExportSpec, FieldError> {
        if !matches!(period, WindowKind::Day | WindowKind::CalendarMonth) {
            return Err(FieldError::new("period", "must be day or calendar_month"));
        }
        if dimensions.is_empty() {
            return Err(FieldError::new("dimensions", "name at least one of project, api_key, actor, agent, user"));
        }
        Ok(ExportSpec { project_id, period, dimensions, grace })
    }

    /// The export's identity: `<project>/<period>/<dimension>+<dimension>…`.
    /// (The grace is not part of it: it decides where a row is billed, not
    /// what the runs sum to.)
    pub fn key(&self) -> String {
        let dims: Vec<&str> = self.dimensions.iter().map(|d| d.as_str()).collect();
        format!("{}/{}/{}", self.project_id, self.period.as_str(), dims.join("+"))
    }

    /// Whether a line of `dimension` belongs to this export.
    pub fn covers(&self, dimension: &Dimension) -> bool {
        CustomerKind::of(dimension).is_some_and(|k| self.dimensions.contains(&k))
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Running,
    /// Everything folded by its watermark is written.
    Complete,
    /// Stopped at a bound ([`Mark`]): what it did not write, the next run does.
    Partial,
    Failed,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Complete => "complete",
            RunStatus::Partial => "partial",
            RunStatus::Failed => "failed",
        }
    }
}

impl FromStr for RunStatus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [RunStatus::Running, RunStatus::Complete, RunStatus::Partial, RunStatus::Failed]
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("`{s}` is not a run status"))
    }
}

/// The bound a partial run stopped at (ADR-0196 decision 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Mark {
    Rows,
    Time,
}

impl Mark {
    pub fn as_str(self) -> &'static str {
        match self {
            Mark::Rows => "ROWS",
            Mark::Time => "TIME",
        }
    }
}

impl FromStr for Mark {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ROWS" => Ok(Mark::Rows),
            "TIME" => Ok(Mark::Time),
            _ => Err(format!("`{s}` is not ROWS or TIME")),
        }
    }
}

/// One comparison of a reconciliation: how many lines were compared, how
/// many differ, and the first [`Check::SHOWN`] of those
/// (`line: expected … found …`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    pub lines: u64,
    #[serde(default)]
    pub differing: u64,
    pub differences: Vec<String>,
}

impl Check {
    /// The most differences a check keeps as text (a reconciliation of a
    /// million lines that all differ stays small).
    pub const SHOWN: usize = 100;

    pub fn ok(&self) -> bool {
        self.differing == 0 && self.differences.is_empty()
    }

    /// Counts differences, keeping the first [`Check::SHOWN`].
    pub fn differ(&mut self, differences: impl IntoIterator<Item = String>) {
        for d in differences {
            self.differing += 1;
            if self.differences.len() < Check::SHOWN {
                self.differences.push(d);
            }
        }
    }
}

/// A run's reconciliation (issue 11 item 4): the rows of every run of the
/// export so far against the fold at the run's watermark, and, when asked
/// (`--verify`), against a fold of the log itself up to the watermark.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconciliation {
    pub fold: Check,
    pub log: Option<Check>,
}

impl Reconciliation {
    pub fn ok(&self) -> bool {
        self.fold.ok() && self.log.as_ref().is_none_or(Check::ok)
    }
}

/// One run of an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportRun {
    /// `exr_…`.
    pub id: String,
    pub spec: ExportSpec,
    pub format: Format,
    pub status: RunStatus,
    pub mark: Option<Mark>,
    /// The fold's next offset per partition of the usage topic at the run:
    /// everything before is covered.
    pub watermark: BTreeMap<i32, i64>,
    /// The newest receipt time the fold had folded at the run.
    pub receipt_bound: Option<DateTime<Utc>>,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub rows: u64,
    pub bytes: u64,
    /// Where the file is (a path on the host that ran it).
    pub file: Option<String>,
    pub reconciliation: Option<Reconciliation>,
    pub error: Option<String>,
    /// The schedule that started it (`exs_…`), if one did.
    pub schedule_id: Option<String>,
}

impl ExportRun {
    /// The watermark as rows carry it: `partition:offset`, `;`-separated.
    pub fn watermark_text(&self) -> String {
        let parts: Vec<String> = self.watermark.iter().map(|(p, o)| format!("{p}:{o}")).collect();
        parts.join(";")
    }
}

/// What the runs of an export wrote of one line, by its own charge period's
/// key: what the next run subtracts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedLine {
    pub period_key: String,
    pub dimension: Dimension,
    pub item: Item,
    pub amounts: Amounts,
}

impl Item {
    /// A stable text for storage: `m:<metric>` or
    /// `t:<provider>\u{1f}<model>\u{1f}<component>` (unit separators: names
    /// may hold any other character).
    pub fn encode(&self) -> String {
        match self {
            Item::Metric(m) => format!("m:{m}"),
            Item::Model { provider, model, component } => format!("t:{provider}\u{1f}{model}\u{1f}{component}"),
        }
    }

    pub fn decode(s: &str) -> Option<Item> {
        let (tag, rest) = s.split_once(':')?;
        match tag {
            "m" => Some(Item::Metric(rest.to_owned())),
            "t" => {
                let mut it = rest.split('\u{1f}');
                let (provider, model, component) = (it.next()?, it.next()?, it.next()?);
                if it.next().is_some() {
                    return None;
                }
                Some(Item::Model { provider: provider.into(), model: model.into(), component: component.into() })
            }
            _ => None,
        }
    }
}

impl fmt::Display for Item {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Item::Metric(m) => f.write_str(m),
            Item::Model { provider, model, component } => write!(f, "tokens {provider}/{model}/{component}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_items_text_round_trips_whatever_its_names() {
        for item in [
            Item::Metric("cost_usd:llm_tokens".into()),
            Item::Model { provider: "a:b".into(), model: "m|n/o".into(), component: "input_tokens".into() },
        ] {
            assert_eq!(Item::decode(&item.encode()), Some(item.clone()));
        }
        assert_eq!(Item::decode("x:1"), None);
    }

    #[test]
    fn an_exports_key_names_its_project_period_and_dimensions_in_order() {
        let dims = BTreeSet::from([CustomerKind::User, CustomerKind::ApiKey]);
        let spec =
            ExportSpec::new(ProjectId::parse("proj_1").expect("id"), WindowKind::CalendarMonth, dims, Grace::DEFAULT)
                .expect("spec");
        assert_eq!(spec.key(), "proj_1/calendar_month/api_key+user");
        let e =
            ExportSpec::new(spec.project_id.clone(), WindowKind::Rolling1h, spec.dimensions.clone(), Grace::DEFAULT);
        assert_eq!(e.map_err(|e| e.field), Err("period".to_owned()));
        assert!(ExportSpec::new(spec.project_id, WindowKind::Day, BTreeSet::new(), Grace::DEFAULT).is_err());
    }
}
