//! Reading the console's forms into the API's own request bodies, so a
//! form is validated exactly as the API validates the same fields: the
//! typed fields become a JSON object (a number where one was typed, the
//! text as typed otherwise, an empty field left out), read by the API's
//! DTO with [`crate::dto::from_value`] and converted with its `TryFrom`.

use std::collections::BTreeMap;

use meter::FieldError;
use serde_json::{Map, Value};

use crate::dto::from_value;
use crate::dto::quotas::QuotaPatchBody;
use crate::dto::reports::UsageParams;
use crate::dto::tenants::{ApiKeyBody, KeyGrantsBody};
use crate::service::provisioning::{KeyGrants, NewApiKey};
use crate::service::quotas::Edit;
use crate::service::usage::UsageQuery;

/// The grant fields of the key forms, as the API names them.
pub const GRANT_FIELDS: [&str; 3] = ["max_concurrent", "query_timeout", "max_rows"];

/// A form's fields as typed (the last value of a repeated name wins).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fields(BTreeMap<String, String>);

impl Fields {
    /// The fields of an `application/x-www-form-urlencoded` body.
    pub fn parse(body: &[u8]) -> Fields {
        Fields(form_urlencoded::parse(body).map(|(k, v)| (k.into_owned(), v.into_owned())).collect())
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// A field as typed, or "" when absent.
    pub fn value(&self, name: &str) -> &str {
        self.get(name).unwrap_or("")
    }

    /// Refuses a field the form does not have (`csrf` aside), as the API
    /// refuses a body's unknown field: a form that names one was not made by
    /// this page, and reading only the fields it knows would change less
    /// than whoever sent it meant.
    pub fn only(&self, known: &[&str]) -> Result<(), FieldError> {
        match self.0.keys().find(|k| k.as_str() != "csrf" && !known.contains(&k.as_str())) {
            Some(k) => Err(FieldError::new(k.clone(), "is not a known field")),
            None => Ok(()),
        }
    }

    /// The field, trimmed, if not empty.
    fn present(&self, name: &str) -> Option<&str> {
        self.get(name).map(str::trim).filter(|v| !v.is_empty())
    }

    /// The named fields as a JSON object: numbers where `numeric` says so and
    /// the text is one, the text otherwise (which the DTO refuses as the API
    /// does: "must be a number").
    fn object(&self, names: &[&str], numeric: bool) -> Map<String, Value> {
        let mut out = Map::new();
        for name in names {
            if let Some(v) = self.present(name) {
                let value = match serde_json::from_str::<serde_json::Number>(v) {
                    Ok(n) if numeric => Value::Number(n),
                    _ => Value::String(v.to_owned()),
                };
                out.insert((*name).to_owned(), value);
            }
        }
        out
    }

    /// The grants and role of a key form, as `POST /v1/projects/{id}/api-keys` reads them.
    fn key_body(&self, with_name: bool) -> Map<String, Value> {
        let mut body = if with_name { self.object(&["name"], false) } else { Map::new() };
        body.extend(self.object(&["role_id"], false));
        let grants = self.object(&GRANT_FIELDS, true);
        if !grants.is_empty() {
            body.insert("grants".into(), Value::Object(grants));
        }
        body
    }

    /// The new-key form (name, role, grants), validated as the API's body.
    pub fn new_key(&self) -> Result<NewApiKey, FieldError> {
        self.only(&["name", "role_id", GRANT_FIELDS[0], GRANT_FIELDS[1], GRANT_FIELDS[2]])?;
        NewApiKey::try_from(from_value::<ApiKeyBody>(Value::Object(self.key_body(true)))?)
    }

    /// The grant form (role, grants), read as `PUT /v1/api-keys/{id}/grants`
    /// reads its body; an empty role is none.
    pub fn key_grants(&self) -> Result<KeyGrants, FieldError> {
        self.only(&["role_id", GRANT_FIELDS[0], GRANT_FIELDS[1], GRANT_FIELDS[2]])?;
        KeyGrants::try_from(from_value::<KeyGrantsBody>(Value::Object(self.key_body(false)))?)
    }
}

impl Fields {
    /// The mode switch (`mode`), read as `PATCH /v1/quotas/{id}` reads its body.
    /// The form may say which page to go back to (`from`).
    pub fn quota_mode(&self) -> Result<Edit, FieldError> {
        self.only(&["mode", "from"])?;
        let body = self.object(&["mode"], false);
        if body.is_empty() {
            return Err(FieldError::new("mode", "is required"));
        }
        Edit::try_from(from_value::<QuotaPatchBody>(Value::Object(body))?)
    }

    /// The usage page's choices for `project`, read as `GET /v1/usage`
    /// reads its parameters (an empty one is left out).
    pub fn usage_query(&self, project: &meter::ProjectId) -> Result<UsageQuery, FieldError> {
        self.only(&["group_by", "window", "at"])?;
        let opt = |name: &str| self.present(name).map(str::to_owned);
        UsageQuery::try_from(UsageParams {
            project_id: Some(project.to_string()),
            group_by: Some(opt("group_by").unwrap_or_else(|| "model".to_owned())),
            window: opt("window"),
            at: opt("at"),
        })
    }
}

/// The form field an API field name is typed into (`grants.max_rows` → `max_rows`).
pub fn input_of(field: &str) -> &str {
    field.strip_prefix("grants.").unwrap_or(field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meter::Grants;

    fn fields(body: &str) -> Fields {
        Fields::parse(body.as_bytes())
    }

    #[test]
    fn a_key_form_is_read_as_the_api_body() {
        let k = fields("name=partner&max_rows=500&max_concurrent=&query_timeout=+30+&csrf=x").new_key().expect("valid");
        assert_eq!((k.name.as_str(), k.grants.max_rows, k.grants.query_timeout), ("partner", Some(500), Some(30)));
        assert_eq!(k.grants.max_concurrent, None, "an empty field is no grant");
        let refused = |body: &str| {
            let e = fields(body).new_key().expect_err("refused");
            (e.field, e.message)
        };
        assert_eq!(refused("max_rows=5"), ("name".into(), "is required".into()));
        assert_eq!(refused("name=a&max_rows=abc"), ("grants.max_rows".into(), "must be a number".into()));
        assert_eq!(refused("name=a&max_rows=-1"), ("grants.max_rows".into(), "must be a whole number ≥ 0".into()));
        assert_eq!(refused("name=a&max_rows=0"), ("grants.max_rows".into(), "must be greater than 0".into()));
        assert_eq!(
            refused("name=a&max_concurrent=1001"),
            ("grants.max_concurrent".into(), "must be between 1 and 1000".into())
        );
        assert_eq!(refused("name=a&role_id=no%20spaces").0, "role_id");
        assert_eq!(refused("name=a&max_row=5"), ("max_row".into(), "is not a known field".into()));
    }

    #[test]
    fn a_grant_form_is_read_as_the_api_reads_grants() {
        let g = fields("max_concurrent=4&role_id=").key_grants().expect("valid");
        assert_eq!(g, KeyGrants { role_id: None, grants: Grants { max_concurrent: Some(4), ..Grants::default() } });
        let e = fields("max_concurrent=0").key_grants().expect_err("refused");
        assert_eq!((e.field.as_str(), input_of(&e.field)), ("grants.max_concurrent", "max_concurrent"));
        assert_eq!(fields("").key_grants().expect("nothing granted"), KeyGrants::default());
        assert_eq!(fields("name=renamed").key_grants().expect_err("not a grant field").field, "name");
    }

    #[test]
    fn the_mode_and_usage_forms_refuse_fields_they_do_not_have() {
        assert!(fields("csrf=x&mode=monitor&from=quotas").quota_mode().is_ok());
        assert_eq!(fields("mode=monitor&limit=5").quota_mode().expect_err("refused").field, "limit");
        let p = meter::ProjectId::parse("proj_a").expect("an id");
        assert_eq!(fields("group_by=key&project_id=other").usage_query(&p).expect_err("refused").field, "project_id");
    }
}
