//! Request and response bodies: what goes over the wire, typed.
//!
//! A request body is a `#[derive(Deserialize, ToSchema)]` struct that
//! refuses unknown fields; it is read through [`serde_path_to_error`], so the
//! first wrong field is answered 400 `INVALID_REQUEST` with its path in
//! `meta.field` (`events[3].rows`, `quotas[1].window`, `grants.max_rows`),
//! exactly as the API always named it. Its field types ([`fields`]) give the
//! type errors; `TryFrom<Dto>` for the domain value gives the semantic ones
//! (an id's alphabet, a known time zone, a metric a scope allows), with no
//! store lookups — those are the service's. A response body is a
//! `#[derive(Serialize, ToSchema)]` struct built `From` the domain value.
//! Both are in `/openapi.json`, with examples.
//!
//! Query strings are read the same way ([`Params`]), unknown parameters
//! refused by name (`colour: is not a known parameter`).

pub mod check;
pub mod errors;
pub mod events;
pub mod export_schedules;
pub mod exports;
pub mod fields;
pub mod prices;
pub mod quotas;
pub mod reports;
pub mod tenants;
pub mod webhooks;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use meter::FieldError;
use serde::de::DeserializeOwned;
use serde_path_to_error::{Path, Segment};

use crate::error::ApiError;
pub use fields::*;

/// What an unknown key is called in the message: a field of a body, or a
/// parameter of a query string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Noun {
    Field,
    Parameter,
}

/// The field a path names, as the API names it: `events[3].rows`; the body
/// itself when the path is empty.
fn path_name(path: &Path) -> String {
    let mut out = String::new();
    for seg in path.iter() {
        match seg {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push('?');
            }
        }
    }
    out
}

/// The name between the first pair of backticks of a serde message.
fn quoted(message: &str) -> Option<&str> {
    let (_, rest) = message.split_once('`')?;
    Some(rest.split_once('`')?.0)
}

/// One refusal from a deserialisation error: the field it is about and the
/// API's message for it. serde's own wording ("unknown field `x`, expected
/// …", "invalid type: map, expected a list") is turned into the API's ("is
/// not a known field", "must be a list"); the field types' messages are
/// already the API's.
fn refusal(path: &Path, message: &str, noun: Noun) -> FieldError {
    let mut field = path_name(path);
    let under = |field: &str, name: &str| if field.is_empty() { name.to_owned() } else { format!("{field}.{name}") };
    let message = if message.starts_with("unknown field") {
        match noun {
            Noun::Field => "is not a known field".to_owned(),
            Noun::Parameter => "is not a known parameter".to_owned(),
        }
    } else if let Some(name) = message.strip_prefix("missing field").and_then(|_| quoted(message)) {
        field = under(&field, name);
        "is required".to_owned()
    } else if let Some(name) = message.strip_prefix("duplicate field").and_then(|_| quoted(message)) {
        field = under(&field, name);
        "is given more than once".to_owned()
    } else if (message.starts_with("invalid type: ") || message.starts_with("invalid value: "))
        && let Some((_, expected)) = message.split_once(", expected ")
    {
        format!("must be {expected}")
    } else {
        message.to_owned()
    };
    if field.is_empty() {
        let message = if message == "must be an object" { "must be a JSON object".to_owned() } else { message };
        return FieldError::new("body", message);
    }
    FieldError::new(field, message)
}

/// Reads a JSON body as `T`, which must be an object. Bad JSON is a
/// refusal of `body`; a wrong field, of that field.
pub fn from_slice<T: DeserializeOwned>(body: &[u8]) -> Result<T, FieldError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, Object<T>>(&mut de) {
        Ok(Object(v)) => match de.end() {
            Ok(()) => Ok(v),
            Err(e) => Err(FieldError::new("body", format!("is not valid JSON: {e}"))),
        },
        Err(e) => {
            let inner = e.inner();
            if inner.is_syntax() || inner.is_eof() || inner.is_io() {
                return Err(FieldError::new("body", format!("is not valid JSON: {inner}")));
            }
            // serde_json adds the position to every message; the field says where.
            let text = inner.to_string();
            let position = format!(" at line {} column {}", inner.line(), inner.column());
            Err(refusal(e.path(), text.strip_suffix(&position).unwrap_or(&text), Noun::Field))
        }
    }
}

/// Reads an already parsed JSON value (a YAML file, for `tollgate apply`)
/// as `T`, which must be an object.
pub fn from_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, FieldError> {
    serde_path_to_error::deserialize::<_, Object<T>>(value)
        .map(|Object(v)| v)
        .map_err(|e| refusal(e.path(), &e.inner().to_string(), Noun::Field))
}

/// Reads a query string (`a=1&b=2`, without the `?`) as `T`.
pub fn from_query<T: DeserializeOwned>(query: &str) -> Result<T, FieldError> {
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize::<_, T>(de).map_err(|e| refusal(e.path(), &e.inner().to_string(), Noun::Parameter))
}

/// A JSON request body read as `T` (any content type, as the API always
/// took). A wrong one is answered 400 `INVALID_REQUEST` naming the field.
#[derive(Debug, Clone)]
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let bytes = Bytes::from_request(req, state).await.map_err(IntoResponse::into_response)?;
        from_slice(&bytes).map(Body).map_err(|e| ApiError::from(e).into_response())
    }
}

/// A query string read as `T`. A wrong one is answered 400
/// `INVALID_REQUEST` naming the parameter.
#[derive(Debug, Clone)]
pub struct Params<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Ok(Params(from_query(parts.uri.query().unwrap_or(""))?))
    }
}

/// Parses an optional id in the shared alphabet, refusing it by `field`.
pub fn opt_id(v: Option<Text>, field: &str) -> Result<Option<String>, FieldError> {
    match v {
        None => Ok(None),
        Some(Text(s)) => {
            meter::ids::check_id(&s).map_err(|e| FieldError::new(field, e.to_string()))?;
            Ok(Some(s))
        }
    }
}

/// A required field: present and not null.
pub fn required<T>(v: Option<T>, field: &str) -> Result<T, FieldError> {
    v.ok_or_else(|| FieldError::new(field, "is required"))
}

/// A name (of a project, key or role): 1–200 characters, not only blanks.
pub fn name(v: Option<Text>) -> Result<String, FieldError> {
    let Text(name) = required(v, "name")?;
    if name.trim().is_empty() || name.len() > 200 {
        return Err(FieldError::new("name", "must be 1–200 characters"));
    }
    Ok(name)
}

/// An RFC 3339 timestamp, in UTC.
pub fn timestamp(raw: &str, field: &str) -> Result<chrono::DateTime<chrono::Utc>, FieldError> {
    chrono::DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|_| FieldError::new(field, "must be an RFC 3339 timestamp"))
}

/// An id from a path (`/v1/quotas/{id}`): one that cannot be an id names
/// nothing, so it is 404, like any id that names nothing.
pub fn path_id<T>(
    what: &'static str,
    raw: String,
    parse: impl FnOnce(String) -> Result<T, meter::IdError>,
) -> Result<T, crate::service::Error> {
    parse(raw.clone()).map_err(|_| crate::service::Error::not_found(what, raw))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    // Read through `Debug` only: these test what is refused.
    #[allow(dead_code)]
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        name: Option<Text>,
    }

    #[allow(dead_code)]
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        items: Option<List<Inner>>,
        inner: Option<Object<Inner>>,
        n: Option<Count>,
    }

    fn field(body: &str) -> (String, String) {
        let e = from_slice::<Outer>(body.as_bytes()).expect_err("refused");
        (e.field, e.message)
    }

    #[test]
    fn a_refusal_names_the_field_by_its_path() {
        assert_eq!(
            field(r#"{"items":[{"name":"a"},{"name":5}]}"#),
            ("items[1].name".into(), "must be a string".into())
        );
        assert_eq!(field(r#"{"items":[{"colour":1}]}"#), ("items[0].colour".into(), "is not a known field".into()));
        assert_eq!(field(r#"{"items":{}}"#), ("items".into(), "must be a list".into()));
        assert_eq!(field(r#"{"items":[1]}"#), ("items[0]".into(), "must be an object".into()));
        assert_eq!(field(r#"{"items":[["a"]]}"#), ("items[0]".into(), "must be an object".into()), "not by position");
        assert_eq!(field(r#"{"inner":[]}"#), ("inner".into(), "must be an object".into()));
        assert_eq!(field(r#"{"n":-3}"#), ("n".into(), "must be a whole number ≥ 0".into()));
        assert_eq!(field(r#"{"n":"3"}"#), ("n".into(), "must be a number".into()));
        assert_eq!(field("[]"), ("body".into(), "must be a JSON object".into()));
        assert_eq!(field("null"), ("body".into(), "must be a JSON object".into()));
        let (f, m) = field(r#"{"n": tru}"#);
        assert_eq!(f, "body");
        assert!(m.starts_with("is not valid JSON: "), "{m}");
        assert_eq!(field("").0, "body");
        assert_eq!(field(r#"{} {}"#).0, "body", "trailing characters");
        assert!(from_slice::<Outer>(br#"{"inner":null,"items":null,"n":null}"#).is_ok(), "null is absence");
    }

    #[test]
    fn a_value_and_a_query_are_read_the_same_way() {
        let e = from_value::<Outer>(serde_json::json!({"items": [{"name": 1}]})).expect_err("refused");
        assert_eq!((e.field.as_str(), e.message.as_str()), ("items[0].name", "must be a string"));
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Q {
            #[allow(dead_code)]
            a: Option<String>,
        }
        let e = from_query::<Q>("a=1&colour=red").expect_err("refused");
        assert_eq!((e.field.as_str(), e.message.as_str()), ("colour", "is not a known parameter"));
    }
}
