//! Price book bodies (`PUT`/`GET /v1/prices`) and the `quota_unpriced`
//! exceptions (`GET /v1/exceptions`).
//!
//! Prices are decimal dollars per unit (one token) with up to 12 decimal
//! places, written as strings (`"0.0000025"`) or JSON numbers (taken as the
//! decimal they were written as, never computed with as floats), and shown
//! as strings.

use chrono::{DateTime, Utc};
use meter::price::check_price;
use meter::{Component, FieldError, Metric, Price, PriceKey, ProjectId, QuotaId, UnpricedException, Usd};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::quotas::LimitView;
use super::{DecimalText, List, Text, required, timestamp};
use crate::service::Page;
use crate::service::pricing::{EXCEPTION_PREFIX, ExceptionsQuery, MAX_PRICES, NewPrice, PriceFilter};

/// A (provider, model, component) a price applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"provider": "openai", "model": "gpt-4o", "component": "input_tokens"}))]
pub struct PriceKeyView {
    pub provider: String,
    pub model: String,
    /// `input_tokens`, `output_tokens` or `cached_tokens`.
    pub component: String,
}

impl From<&PriceKey> for PriceKeyView {
    fn from(k: &PriceKey) -> Self {
        PriceKeyView {
            provider: k.provider.clone(),
            model: k.model.clone(),
            component: k.component.as_str().to_owned(),
        }
    }
}

/// One price row to write.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
                          "unit_price_usd": "0.0000025", "effective_from": "2026-01-01T00:00:00Z"}))]
pub struct PriceBody {
    #[schema(value_type = String)]
    pub provider: Option<Text>,
    #[schema(value_type = String)]
    pub model: Option<Text>,
    /// `input_tokens`, `output_tokens` or `cached_tokens`.
    #[schema(value_type = String)]
    pub component: Option<Text>,
    /// Dollars per token, up to 12 decimal places: a decimal string, or a
    /// number taken as written.
    #[schema(value_type = String, example = "0.0000025")]
    pub unit_price_usd: Option<DecimalText>,
    /// RFC 3339; the row applies from then on (default: now).
    #[schema(value_type = Option<DateTime<Utc>>)]
    pub effective_from: Option<Text>,
}

impl TryFrom<PriceBody> for NewPrice {
    type Error = FieldError;
    fn try_from(b: PriceBody) -> Result<NewPrice, FieldError> {
        let Text(component) = required(b.component, "component")?;
        let component = component
            .parse::<Component>()
            .map_err(|_| FieldError::new("component", "must be one of input_tokens, output_tokens, cached_tokens"))?;
        let DecimalText(raw) = required(b.unit_price_usd, "unit_price_usd")?;
        let unit_price_usd = Usd::parse(&raw).map_err(|e| FieldError::new("unit_price_usd", e))?;
        let effective_from = b.effective_from.map(|Text(t)| timestamp(&t, "effective_from")).transpose()?;
        let key =
            PriceKey { provider: required(b.provider, "provider")?.0, model: required(b.model, "model")?.0, component };
        // The key and the amount are what is checked; the time is any.
        check_price(&Price { key: key.clone(), unit_price_usd, effective_from: DateTime::UNIX_EPOCH })?;
        Ok(NewPrice { key, unit_price_usd, effective_from })
    }
}

/// `PUT /v1/prices`: rows to add (a row with the same key and
/// `effective_from` is replaced).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"prices": [
    {"provider": "openai", "model": "gpt-4o", "component": "input_tokens", "unit_price_usd": "0.0000025",
     "effective_from": "2026-01-01T00:00:00Z"},
    {"provider": "openai", "model": "gpt-4o", "component": "output_tokens", "unit_price_usd": "0.00001"},
]}))]
pub struct PricesBody {
    /// 1 to 1000 rows.
    #[schema(value_type = Vec<PriceBody>)]
    pub prices: Option<List<PriceBody>>,
}

impl TryFrom<PricesBody> for Vec<NewPrice> {
    type Error = FieldError;
    fn try_from(b: PricesBody) -> Result<Vec<NewPrice>, FieldError> {
        let List(list) = b.prices.ok_or_else(|| FieldError::new("prices", "must be a list"))?;
        if list.is_empty() || list.len() > MAX_PRICES {
            return Err(FieldError::new("prices", format!("must hold 1 to {MAX_PRICES} rows")));
        }
        list.into_iter()
            .enumerate()
            .map(|(i, p)| NewPrice::try_from(p).map_err(|e| e.under(&format!("prices[{i}]."))))
            .collect()
    }
}

/// A price row.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PriceView {
    pub provider: String,
    pub model: String,
    pub component: String,
    /// Dollars per token, a decimal string.
    #[schema(example = "0.0000025")]
    pub unit_price_usd: String,
    pub effective_from: DateTime<Utc>,
}

impl From<&Price> for PriceView {
    fn from(p: &Price) -> Self {
        PriceView {
            provider: p.key.provider.clone(),
            model: p.key.model.clone(),
            component: p.key.component.as_str().to_owned(),
            unit_price_usd: p.unit_price_usd.to_string(),
            effective_from: p.effective_from,
        }
    }
}

/// Price rows.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"data": [{"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
    "unit_price_usd": "0.0000025", "effective_from": "2026-01-01T00:00:00Z"}]}))]
pub struct PriceList {
    pub data: Vec<PriceView>,
}

impl From<&[Price]> for PriceList {
    fn from(rows: &[Price]) -> Self {
        PriceList { data: rows.iter().map(PriceView::from).collect() }
    }
}

/// `GET /v1/prices` filters.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PriceParams {
    /// Only this provider.
    pub provider: Option<String>,
    /// Only this model.
    pub model: Option<String>,
}

impl From<PriceParams> for PriceFilter {
    fn from(p: PriceParams) -> Self {
        PriceFilter { provider: p.provider, model: p.model }
    }
}

/// `GET /v1/exceptions` parameters.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ExceptionParams {
    /// The project.
    #[param(value_type = String)]
    pub project_id: Option<String>,
    /// Cursor: the `next` of the previous page.
    pub after: Option<String>,
    /// Entries per page, 1–1000 (default 100).
    #[param(value_type = Option<u64>)]
    pub limit: Option<String>,
}

impl TryFrom<ExceptionParams> for ExceptionsQuery {
    type Error = FieldError;
    fn try_from(p: ExceptionParams) -> Result<ExceptionsQuery, FieldError> {
        let project = p.project_id.ok_or_else(|| FieldError::new("project_id", "is required"))?;
        let project_id = ProjectId::parse(project).map_err(|e| FieldError::new("project_id", e.to_string()))?;
        let limit = match p.limit {
            None => 100,
            Some(l) => match l.parse::<usize>() {
                Ok(n) if (1..=1000).contains(&n) => n,
                _ => return Err(FieldError::new("limit", "must be between 1 and 1000")),
            },
        };
        let after = match p.after {
            None => None,
            Some(a) => Some(
                QuotaId::parse(a.strip_prefix(EXCEPTION_PREFIX).unwrap_or(&a))
                    .map_err(|e| FieldError::new("after", e.to_string()))?,
            ),
        };
        Ok(ExceptionsQuery { project_id, after, limit })
    }
}

/// A `quota_unpriced` exception: a cost quota whose window held AI usage
/// with no price, one per quota, counted each time it is seen again.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExceptionView {
    /// `quota_unpriced:<quota id>`.
    pub id: String,
    /// `quota_unpriced`.
    pub kind: String,
    /// `warning`.
    pub severity: String,
    pub project_id: String,
    pub quota_id: String,
    pub limit: LimitView,
    pub window_key: String,
    pub llm_events: u64,
    pub unpriced_events: u64,
    pub unpriced_rows: Vec<PriceKeyView>,
    pub occurrence_count: u64,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
}

impl From<&UnpricedException> for ExceptionView {
    fn from(e: &UnpricedException) -> Self {
        ExceptionView {
            id: format!("{EXCEPTION_PREFIX}{}", e.quota_id),
            kind: "quota_unpriced".into(),
            severity: "warning".into(),
            project_id: e.project_id.to_string(),
            quota_id: e.quota_id.to_string(),
            limit: LimitView::of(Metric::CostUsd, e.limit),
            window_key: e.window_key.clone(),
            llm_events: e.llm_events,
            unpriced_events: e.unpriced_events,
            unpriced_rows: e.unpriced_rows.iter().map(PriceKeyView::from).collect(),
            occurrence_count: e.occurrence_count,
            first_seen: e.first_seen,
            last_seen: e.last_seen,
        }
    }
}

/// A page of exceptions.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"data": [{"id": "quota_unpriced:quota_0197a3c4", "kind": "quota_unpriced",
    "severity": "warning", "project_id": "proj_0197a3c2", "quota_id": "quota_0197a3c4", "limit": "25",
    "window_key": "2026-07-07", "llm_events": 3, "unpriced_events": 3,
    "unpriced_rows": [{"provider": "openai", "model": "mystery", "component": "input_tokens"}],
    "occurrence_count": 2, "first_seen": "2026-07-07T12:00:00Z", "last_seen": "2026-07-07T12:05:00Z"}],
    "next": null}))]
pub struct ExceptionList {
    pub data: Vec<ExceptionView>,
    /// The cursor of the next page, or `null` on the last.
    pub next: Option<String>,
}

impl From<&Page<UnpricedException>> for ExceptionList {
    fn from(p: &Page<UnpricedException>) -> Self {
        ExceptionList { data: p.items.iter().map(ExceptionView::from).collect(), next: p.next.clone() }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::dto::from_value;

    fn field(v: serde_json::Value) -> String {
        match from_value::<PricesBody>(v) {
            Err(e) => e.field,
            Ok(b) => Vec::<NewPrice>::try_from(b).expect_err("refused").field,
        }
    }

    #[test]
    fn a_bad_row_is_named_by_its_index_and_field() {
        let row = |k: &str, v: serde_json::Value| {
            let mut r = json!({"provider": "openai", "model": "m", "component": "input_tokens", "unit_price_usd": "1"});
            r[k] = v;
            json!({"prices": [r]})
        };
        assert_eq!(field(row("unit_price_usd", json!("0.0000000000001"))), "prices[0].unit_price_usd");
        assert_eq!(field(row("unit_price_usd", json!(true))), "prices[0].unit_price_usd");
        assert_eq!(field(row("component", json!("vibes"))), "prices[0].component");
        assert_eq!(field(row("provider", json!(""))), "prices[0].provider");
        assert_eq!(field(row("effective_from", json!("soon"))), "prices[0].effective_from");
        assert_eq!(field(json!({"prices": []})), "prices");
        assert_eq!(field(json!({})), "prices");
        let ok = from_value::<PricesBody>(row("unit_price_usd", json!(0.00001))).expect("typed");
        let rows = Vec::<NewPrice>::try_from(ok).expect("valid");
        assert_eq!(rows[0].unit_price_usd.to_string(), "0.00001", "a number is taken as written");
    }
}
