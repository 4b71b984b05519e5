//! Reading JSON bodies field by field, so a wrong type is a 400 that names
//! the field rather than a generic deserialisation error.

use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};

/// Parses a body that must be a JSON object.
pub fn object(body: &[u8]) -> ApiResult<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid("body", "must be a JSON object")),
        Err(e) => Err(ApiError::invalid("body", format!("is not valid JSON: {e}"))),
    }
}

/// Refuses fields outside `allowed`.
pub fn only(obj: &Map<String, Value>, prefix: &str, allowed: &[&str]) -> ApiResult<()> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(format!("{prefix}{k}"), "is not a known field")),
        None => Ok(()),
    }
}

pub fn opt_str(obj: &Map<String, Value>, prefix: &str, field: &str) -> ApiResult<Option<String>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid(format!("{prefix}{field}"), "must be a string")),
    }
}

pub fn req_str(obj: &Map<String, Value>, prefix: &str, field: &str) -> ApiResult<String> {
    opt_str(obj, prefix, field)?.ok_or_else(|| ApiError::invalid(format!("{prefix}{field}"), "is required"))
}

/// A whole number ≥ 0 that fits in PostgreSQL's `bigint`.
pub fn opt_count(obj: &Map<String, Value>, prefix: &str, field: &str) -> ApiResult<Option<u64>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if v <= i64::MAX as u64 => Ok(Some(v)),
            _ => Err(ApiError::invalid(format!("{prefix}{field}"), "must be a whole number ≥ 0")),
        },
        Some(_) => Err(ApiError::invalid(format!("{prefix}{field}"), "must be a number")),
    }
}

/// An id in the shared id alphabet.
pub fn opt_id(obj: &Map<String, Value>, prefix: &str, field: &str) -> ApiResult<Option<String>> {
    let v = opt_str(obj, prefix, field)?;
    if let Some(s) = &v {
        meter::ids::check_id(s).map_err(|e| ApiError::invalid(format!("{prefix}{field}"), e.to_string()))?;
    }
    Ok(v)
}

/// A quota limit as written: a whole number, or a decimal (a string, or a
/// JSON number with a fraction, taken as its shortest decimal form; only
/// `cost_usd` accepts one, and it is never computed with as a float).
pub fn limit(obj: &Map<String, Value>, prefix: &str) -> ApiResult<(Option<i64>, Option<String>)> {
    match obj.get("limit") {
        None | Some(Value::Null) => Ok((None, None)),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) => Ok((Some(v), None)),
            None if n.is_f64() => Ok((None, Some(n.to_string()))),
            None => Err(ApiError::invalid(format!("{prefix}limit"), "is too large")),
        },
        Some(Value::String(s)) => Ok((None, Some(s.clone()))),
        Some(_) => Err(ApiError::invalid(format!("{prefix}limit"), "must be a number")),
    }
}
