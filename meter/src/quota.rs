//! The quota model and its validity rules.
//!
//! A quota is accepted only where it can actually be counted: a cap that
//! cannot be aggregated would look healthy through the API while protecting
//! nothing, so every other combination is refused with the offending field
//! named. The same function serves the REST route and any declarative path.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{FieldError, named};
use crate::ids::{ProjectId, QuotaId, check_id};
use crate::price::{MeterType, Usd};
use crate::window::WindowKind;

/// What a quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    Requests,
    Calls,
    Rows,
    Tokens,
    CostUsd,
    StorageBytes,
}

impl Metric {
    pub const ALL: [Metric; 6] =
        [Metric::Requests, Metric::Calls, Metric::Rows, Metric::Tokens, Metric::CostUsd, Metric::StorageBytes];

    pub fn as_str(self) -> &'static str {
        match self {
            Metric::Requests => "requests",
            Metric::Calls => "calls",
            Metric::Rows => "rows",
            Metric::Tokens => "tokens",
            Metric::CostUsd => "cost_usd",
            Metric::StorageBytes => "storage_bytes",
        }
    }

    /// The scopes this metric can be aggregated by (DESIGN §3).
    pub fn valid_scopes(self) -> &'static [Scope] {
        match self {
            Metric::Requests => &[Scope::Project, Scope::ApiKey],
            Metric::Calls | Metric::Rows => &[Scope::Project, Scope::ApiKey, Scope::Actor],
            Metric::Tokens | Metric::CostUsd => &[Scope::Project, Scope::Agent, Scope::Actor],
            Metric::StorageBytes => &[Scope::Project],
        }
    }

    /// Whether this metric is a stock (`current` window) rather than a flow.
    pub fn is_stock(self) -> bool {
        self == Metric::StorageBytes
    }

    /// Whether this release meters it (every metric of the model is).
    pub fn is_metered(self) -> bool {
        true
    }

    /// Whether limits and usage of this metric are money (picodollars
    /// inside, decimal dollars at the API).
    pub fn is_money(self) -> bool {
        self == Metric::CostUsd
    }
}

named!(Metric, "metric", Metric::ALL);

/// Who a quota applies to. Declared from broadest to narrowest, so `Ord`
/// is the precedence used when reporting a breach (actor is most specific).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Project,
    ApiKey,
    /// A signed-in user's own allowance from its role. Internal: only role
    /// quotas have it; the API neither accepts nor lists it.
    User,
    Agent,
    Actor,
}

impl Scope {
    pub const ALL: [Scope; 4] = [Scope::Project, Scope::ApiKey, Scope::Agent, Scope::Actor];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Project => "project",
            Scope::ApiKey => "api_key",
            Scope::User => "user",
            Scope::Agent => "agent",
            Scope::Actor => "actor",
        }
    }
}

named!(Scope, "scope", Scope::ALL);

/// `enforce` refuses on a breach; `monitor` only observes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Monitor,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Enforce, Mode::Monitor];
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Monitor => "monitor",
        }
    }
}

impl OnUnpriced {
    pub const ALL: [OnUnpriced; 2] = [OnUnpriced::Block, OnUnpriced::Allow];
    pub fn as_str(self) -> &'static str {
        match self {
            OnUnpriced::Block => "block",
            OnUnpriced::Allow => "allow",
        }
    }
}

named!(Mode, "mode", Mode::ALL);
named!(OnUnpriced, "on_unpriced", OnUnpriced::ALL);

/// What an enforce `cost_usd` quota does over a pricing blackout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnpriced {
    Block,
    Allow,
}

/// A quota as a caller asked for it: every field still a string, as it came.
#[derive(Debug, Clone, Default)]
pub struct QuotaDraft {
    pub project_id: Option<String>,
    pub scope: Option<String>,
    pub scope_ref: Option<String>,
    pub metric: Option<String>,
    pub window: Option<String>,
    pub limit: Option<i64>,
    /// A limit given as a decimal (a string, or a JSON number with a
    /// fraction, as written): only `cost_usd` takes one.
    pub limit_decimal: Option<String>,
    pub mode: Option<String>,
    pub meter_type: Option<String>,
    pub on_unpriced: Option<String>,
}

/// A validated quota definition (everything but its id and timestamps).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaSpec {
    pub project_id: ProjectId,
    pub scope: Scope,
    pub scope_ref: Option<String>,
    pub metric: Metric,
    pub window: WindowKind,
    /// In the metric's unit: picodollars for `cost_usd` (see [`Metric::is_money`]).
    pub limit: u64,
    pub mode: Mode,
    pub meter_type: Option<String>,
    pub on_unpriced: Option<OnUnpriced>,
}

impl QuotaSpec {
    /// The meter a `cost_usd` quota answers for (`None`: every priced meter).
    pub fn meter(&self) -> Option<MeterType> {
        self.meter_type.as_deref().and_then(|m| m.parse().ok())
    }
}

/// A stored quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    pub id: QuotaId,
    #[serde(flatten)]
    pub spec: QuotaSpec,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

fn required<'a>(v: &'a Option<String>, field: &str) -> Result<&'a str, FieldError> {
    v.as_deref().ok_or_else(|| FieldError::new(field, "is required"))
}

fn one_of<T: FromStr>(raw: &str, field: &str, allowed: &[&str]) -> Result<T, FieldError> {
    raw.parse().map_err(|_| FieldError::new(field, format!("must be one of {}; got {raw:?}", allowed.join(", "))))
}

/// The largest limit a counter can hold (PostgreSQL `bigint`).
pub const MAX_LIMIT: i64 = i64::MAX;

/// Validates a draft against the scope × metric × window rules.
pub fn validate(draft: &QuotaDraft) -> Result<QuotaSpec, FieldError> {
    let project_id = ProjectId::parse(required(&draft.project_id, "project_id")?)
        .map_err(|e| FieldError::new("project_id", e.to_string()))?;
    let metric: Metric = one_of(required(&draft.metric, "metric")?, "metric", &Metric::ALL.map(Metric::as_str))?;
    let scope: Scope = one_of(required(&draft.scope, "scope")?, "scope", &Scope::ALL.map(Scope::as_str))?;
    let window: WindowKind =
        one_of(required(&draft.window, "window")?, "window", &WindowKind::ALL.map(WindowKind::as_str))?;
    check_combination(metric, scope, window)?;
    if let Some(r) = &draft.scope_ref {
        if scope == Scope::Project {
            return Err(FieldError::new("scope_ref", "must be null for scope project"));
        }
        check_id(r).map_err(|e| FieldError::new("scope_ref", e.to_string()))?;
    }
    let limit = parse_limit(metric, draft.limit, draft.limit_decimal.as_deref())?;
    let mode = match &draft.mode {
        None => Mode::Enforce,
        Some(m) => one_of(m, "mode", &["enforce", "monitor"])?,
    };
    if draft.meter_type.is_some() && metric != Metric::CostUsd {
        return Err(FieldError::new("meter_type", "is only allowed on cost_usd quotas"));
    }
    if draft.on_unpriced.is_some() && metric != Metric::CostUsd {
        return Err(FieldError::new("on_unpriced", "is only allowed on cost_usd quotas"));
    }
    let meter_type = match &draft.meter_type {
        None => None,
        Some(m) => {
            let t: MeterType = one_of(m, "meter_type", &MeterType::ALL.map(MeterType::as_str))?;
            Some(t.as_str().to_owned())
        }
    };
    let on_unpriced = match (&draft.on_unpriced, metric) {
        (Some(o), _) => Some(one_of(o, "on_unpriced", &["block", "allow"])?),
        (None, Metric::CostUsd) => Some(OnUnpriced::Block),
        (None, _) => None,
    };
    Ok(QuotaSpec {
        project_id,
        scope,
        scope_ref: draft.scope_ref.clone(),
        metric,
        window,
        limit,
        mode,
        meter_type,
        on_unpriced,
    })
}

/// A limit in the metric's unit: a whole number > 0, or for `cost_usd`
/// dollars (whole, or a decimal with up to 12 places) turned into picodollars.
pub fn parse_limit(metric: Metric, whole: Option<i64>, decimal: Option<&str>) -> Result<u64, FieldError> {
    let bad = |m: &str| FieldError::new("limit", m.to_owned());
    let v = match (metric.is_money(), whole, decimal) {
        (_, None, None) => return Err(bad("is required")),
        (false, Some(n), _) => n,
        (false, None, Some(_)) => return Err(bad("must be a whole number greater than 0")),
        (true, Some(n), _) => Usd::from_dollars(n).ok_or_else(|| bad("is too large"))?.picos(),
        (true, None, Some(d)) => Usd::parse(d).map_err(|e| bad(&format!("must be dollars as a decimal: {e}")))?.picos(),
    };
    if v <= 0 {
        return Err(bad(if metric.is_money() {
            "must be greater than 0"
        } else {
            "must be a whole number greater than 0"
        }));
    }
    Ok(v as u64)
}

/// A limit as the API shows it: a number, or for money a decimal string of dollars.
pub fn limit_json(metric: Metric, v: u64) -> serde_json::Value {
    if metric.is_money() {
        serde_json::Value::String(Usd(i64::try_from(v).unwrap_or(i64::MAX)).to_string())
    } else {
        serde_json::Value::from(v)
    }
}

/// The scope × metric and window rules, in both directions.
pub fn check_combination(metric: Metric, scope: Scope, window: WindowKind) -> Result<(), FieldError> {
    if !metric.valid_scopes().contains(&scope) {
        let valid: Vec<&str> = metric.valid_scopes().iter().map(|s| s.as_str()).collect();
        return Err(FieldError::new("scope", format!("{metric} can only be scoped to {}", valid.join(", "))));
    }
    match (metric.is_stock(), window == WindowKind::Current) {
        (true, false) => Err(FieldError::new("window", format!("{metric} only accepts current"))),
        (false, true) => {
            Err(FieldError::new("window", format!("current is only valid for storage_bytes; {metric} needs a window")))
        }
        _ => Ok(()),
    }
}

/// A change to a quota: only `limit` and `mode` may change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaPatch {
    pub limit: Option<u64>,
    pub mode: Option<Mode>,
}

impl QuotaPatch {
    /// Applies the patch to a spec.
    pub fn apply(&self, spec: &mut QuotaSpec) {
        if let Some(l) = self.limit {
            spec.limit = l;
        }
        if let Some(m) = self.mode {
            spec.mode = m;
        }
    }
}

/// The fields that make up a quota's identity and can never change.
pub const IMMUTABLE_FIELDS: [&str; 7] =
    ["project_id", "scope", "scope_ref", "metric", "window", "meter_type", "on_unpriced"];

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(metric: &str, scope: &str, window: &str) -> QuotaDraft {
        QuotaDraft {
            project_id: Some("proj_1".into()),
            scope: Some(scope.into()),
            metric: Some(metric.into()),
            window: Some(window.into()),
            limit: Some(10),
            ..Default::default()
        }
    }

    #[test]
    fn validity_table_for_metered_metrics() {
        // (metric, scope, window) → Ok or the field refused.
        let cases: &[(&str, &str, &str, Option<&str>)] = &[
            ("requests", "project", "rolling_1m", None),
            ("requests", "api_key", "calendar_month", None),
            ("requests", "actor", "day", Some("scope")),
            ("requests", "agent", "day", Some("scope")),
            ("requests", "project", "current", Some("window")),
            ("calls", "project", "day", None),
            ("calls", "api_key", "rolling_24h", None),
            ("calls", "actor", "rolling_1h", None),
            ("calls", "agent", "rolling_1h", Some("scope")),
            ("rows", "actor", "calendar_month", None),
            ("rows", "project", "current", Some("window")),
            ("tokens", "project", "day", None),
            ("storage_bytes", "project", "current", None),
            ("bogus", "project", "day", Some("metric")),
            ("calls", "bogus", "day", Some("scope")),
            ("calls", "project", "week", Some("window")),
        ];
        for (m, s, w, want) in cases {
            let got = validate(&draft(m, s, w));
            match want {
                None => assert!(got.is_ok(), "{m}/{s}/{w}: {got:?}"),
                Some(field) => {
                    assert_eq!(got.expect_err("refused").field, *field, "{m}/{s}/{w}")
                }
            }
        }
    }

    #[test]
    fn limit_mode_and_cost_only_fields_are_checked() {
        let mut d = draft("calls", "project", "day");
        d.limit = Some(0);
        assert_eq!(validate(&d).expect_err("zero").field, "limit");
        d.limit = None;
        assert_eq!(validate(&d).expect_err("missing").field, "limit");
        let mut d = draft("calls", "project", "day");
        d.mode = Some("audit".into());
        assert_eq!(validate(&d).expect_err("mode").field, "mode");
        let mut d = draft("calls", "project", "day");
        d.meter_type = Some("llm_tokens".into());
        assert_eq!(validate(&d).expect_err("meter_type").field, "meter_type");
        let mut d = draft("calls", "project", "day");
        d.on_unpriced = Some("allow".into());
        assert_eq!(validate(&d).expect_err("on_unpriced").field, "on_unpriced");
        let mut d = draft("calls", "project", "day");
        d.scope_ref = Some("key_1".into());
        assert_eq!(validate(&d).expect_err("ref on project").field, "scope_ref");
        let mut d = draft("calls", "api_key", "day");
        d.scope_ref = Some("key 1".into());
        assert_eq!(validate(&d).expect_err("bad ref").field, "scope_ref");
    }

    #[test]
    fn precedence_orders_scopes_broad_to_narrow() {
        assert!(Scope::Actor > Scope::Agent);
        assert!(Scope::Agent > Scope::ApiKey);
        assert!(Scope::ApiKey > Scope::Project);
    }
}
