//! The price book (`PUT`/`GET /v1/prices`) and the `quota_unpriced`
//! exceptions (`GET /v1/exceptions`).
//!
//! Prices are decimal dollars per unit (one token) with up to 12 decimal
//! places, written as strings (`"0.0000025"`) or JSON numbers (taken as the
//! decimal they were written as, never computed with as floats). A row
//! applies from its `effective_from` on; events are priced by their event
//! time, by the gateway when it settles them into the view and by the
//! projector when it folds them.

use std::collections::HashMap;
use std::str::FromStr;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use meter::price::check_price;
use meter::{Component, Metric, Price, PriceKey, ProjectId, QuotaId, UnpricedException, Usd};
use serde_json::{Value, json};

use crate::auth;
use crate::error::{ApiError, ApiResult};
use crate::fields;
use crate::hot::price_key_json;
use crate::state::AppState;

/// Most rows one `PUT /v1/prices` may carry.
pub const MAX_PRICES: usize = 1000;

fn price_json(p: &Price) -> Value {
    json!({
        "provider": p.key.provider, "model": p.key.model, "component": p.key.component.as_str(),
        "unit_price_usd": p.unit_price_usd.to_string(), "effective_from": p.effective_from,
    })
}

fn parse_price(v: &Value, i: usize, now: DateTime<Utc>) -> ApiResult<Price> {
    let p = format!("prices[{i}].");
    let Value::Object(o) = v else { return Err(ApiError::invalid(format!("prices[{i}]"), "must be an object")) };
    fields::only(o, &p, &["provider", "model", "component", "unit_price_usd", "effective_from"])?;
    let component = fields::req_str(o, &p, "component")?;
    let component = Component::from_str(&component).map_err(|_| {
        ApiError::invalid(format!("{p}component"), "must be one of input_tokens, output_tokens, cached_tokens")
    })?;
    let raw = match o.get("unit_price_usd") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        None | Some(Value::Null) => return Err(ApiError::invalid(format!("{p}unit_price_usd"), "is required")),
        Some(_) => return Err(ApiError::invalid(format!("{p}unit_price_usd"), "must be a decimal string")),
    };
    let unit = Usd::parse(&raw).map_err(|e| ApiError::invalid(format!("{p}unit_price_usd"), e))?;
    let effective_from = match fields::opt_str(o, &p, "effective_from")? {
        None => now,
        Some(t) => DateTime::parse_from_rfc3339(&t)
            .map_err(|_| ApiError::invalid(format!("{p}effective_from"), "must be an RFC 3339 timestamp"))?
            .with_timezone(&Utc),
    };
    let price = Price {
        key: PriceKey {
            provider: fields::req_str(o, &p, "provider")?,
            model: fields::req_str(o, &p, "model")?,
            component,
        },
        unit_price_usd: unit,
        effective_from,
    };
    check_price(&price).map_err(|e| ApiError::invalid(format!("{p}{}", e.field), e.message))?;
    Ok(price)
}

#[utoipa::path(put, path = "/v1/prices", tag = "admin",
    responses((status = 200, description = "The rows written (a row with the same key and effective_from is replaced)"),
              (status = 400, description = "INVALID_REQUEST naming the field; nothing was written")))]
pub async fn put_prices(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    let obj = fields::object(&body)?;
    fields::only(&obj, "", &["prices"])?;
    let Some(Value::Array(list)) = obj.get("prices") else {
        return Err(ApiError::invalid("prices", "must be a list"));
    };
    if list.is_empty() || list.len() > MAX_PRICES {
        return Err(ApiError::invalid("prices", format!("must hold 1 to {MAX_PRICES} rows")));
    }
    let now = crate::admin::now_micros(s.clock.as_ref());
    let prices = list.iter().enumerate().map(|(i, v)| parse_price(v, i, now)).collect::<ApiResult<Vec<_>>>()?;
    s.store.put_prices(&prices).await?;
    s.invalidate_prices();
    Ok(Json(json!({ "data": prices.iter().map(price_json).collect::<Vec<_>>() })))
}

#[utoipa::path(get, path = "/v1/prices", tag = "admin",
    params(("provider" = Option<String>, Query, description = "Only this provider"),
           ("model" = Option<String>, Query, description = "Only this model")),
    responses((status = 200, description = "The price book, every row with its effective_from")))]
pub async fn get_prices(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(raw): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    if let Some(k) = raw.keys().find(|k| !["provider", "model"].contains(&k.as_str())) {
        return Err(ApiError::invalid(k.clone(), "is not a known parameter"));
    }
    let rows: Vec<Value> = s
        .store
        .prices()
        .await?
        .iter()
        .filter(|p| raw.get("provider").is_none_or(|v| *v == p.key.provider))
        .filter(|p| raw.get("model").is_none_or(|v| *v == p.key.model))
        .map(price_json)
        .collect();
    Ok(Json(json!({ "data": rows })))
}

fn exception_json(e: &UnpricedException) -> Value {
    json!({
        "id": format!("quota_unpriced:{}", e.quota_id),
        "kind": "quota_unpriced",
        "severity": "warning",
        "project_id": e.project_id,
        "quota_id": e.quota_id,
        "limit": meter::quota::limit_json(Metric::CostUsd, e.limit),
        "window_key": e.window_key,
        "llm_events": e.llm_events,
        "unpriced_events": e.unpriced_events,
        "unpriced_rows": e.unpriced_rows.iter().map(price_key_json).collect::<Vec<_>>(),
        "occurrence_count": e.occurrence_count,
        "first_seen": e.first_seen,
        "last_seen": e.last_seen,
    })
}

#[utoipa::path(get, path = "/v1/exceptions", tag = "admin",
    params(("project_id" = String, Query, description = "The project"),
           ("after" = Option<String>, Query, description = "Cursor: the `next` of the previous page"),
           ("limit" = Option<u64>, Query, description = "Entries per page, 1–1000 (default 100)")),
    responses((status = 200, description = "The project's quota_unpriced exceptions, one per cost quota")))]
pub async fn exceptions(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(raw): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    auth::admin(&s, &headers)?;
    if let Some(k) = raw.keys().find(|k| !["project_id", "after", "limit"].contains(&k.as_str())) {
        return Err(ApiError::invalid(k.clone(), "is not a known parameter"));
    }
    let project = raw.get("project_id").ok_or_else(|| ApiError::invalid("project_id", "is required"))?;
    let project = ProjectId::parse(project.clone()).map_err(|e| ApiError::invalid("project_id", e.to_string()))?;
    let limit = match raw.get("limit") {
        None => 100,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => return Err(ApiError::invalid("limit", "must be between 1 and 1000")),
        },
    };
    let after = match raw.get("after") {
        None => None,
        Some(a) => Some(
            QuotaId::parse(a.strip_prefix("quota_unpriced:").unwrap_or(a).to_owned())
                .map_err(|e| ApiError::invalid("after", e.to_string()))?,
        ),
    };
    let mut rows = s.store.exceptions(&project, after.as_ref(), limit + 1).await?;
    let next = if rows.len() > limit {
        rows.truncate(limit);
        rows.last().map(|e| format!("quota_unpriced:{}", e.quota_id))
    } else {
        None
    };
    Ok(Json(json!({ "data": rows.iter().map(exception_json).collect::<Vec<_>>(), "next": next })))
}
