//! Declarative quotas, shared by `PUT /v1/projects/{id}/quotas` and
//! `tollgate apply -f quotas.yaml`: the document read field by field (a
//! wrong field is an error naming it, `quotas[2].window`), and the service
//! that plans it against the store and carries the plan out in one
//! transaction.
//!
//! The document (YAML for the CLI, JSON for the API; the same shape):
//!
//! ```yaml
//! project_id: proj_…
//! quotas:
//!   - scope: api_key
//!     scope_ref: key_…
//!     metric: calls
//!     window: day
//!     limit: 1000
//!     mode: monitor        # optional, enforce by default
//!     id: quota_…          # optional: pins the entry to a stored quota
//! ```

use meter::apply::{DesiredQuota, QuotaPlan};
use meter::{ApiKeyId, Clock, PortError, Principal, ProjectId, Scope, Store};
use serde_json::{Map, Value, json};

use crate::error::{ApiError, ApiResult};
use crate::fields;
use crate::state::{new_audit_id, new_quota_id};

/// A parsed document: the project it names (if it names one) and its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    pub project_id: Option<String>,
    pub quotas: Vec<DesiredQuota>,
}

const ENTRY_FIELDS: [&str; 9] =
    ["id", "scope", "scope_ref", "metric", "window", "limit", "mode", "meter_type", "on_unpriced"];

/// A nullable field: absent, an explicit null, or a string.
fn nullable(obj: &Map<String, Value>, prefix: &str, field: &str) -> ApiResult<Option<Option<String>>> {
    match obj.get(field) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(None)),
        Some(Value::String(s)) => Ok(Some(Some(s.clone()))),
        Some(_) => Err(ApiError::invalid(format!("{prefix}{field}"), "must be a string or null")),
    }
}

/// Reads a document. Unknown fields are refused, at the top and in entries.
pub fn parse_document(v: &Value) -> ApiResult<Document> {
    let Value::Object(top) = v else { return Err(ApiError::invalid("body", "must be an object")) };
    fields::only(top, "", &["project_id", "quotas"])?;
    let project_id = fields::opt_str(top, "", "project_id")?;
    let list = match top.get("quotas") {
        Some(Value::Array(list)) => list,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("quotas", "is required (an empty list deletes every quota of the project)"));
        }
        Some(_) => return Err(ApiError::invalid("quotas", "must be a list")),
    };
    if list.len() > meter::apply::MAX_ENTRIES {
        return Err(ApiError::invalid("quotas", format!("must hold at most {} entries", meter::apply::MAX_ENTRIES)));
    }
    let mut quotas = Vec::with_capacity(list.len());
    for (i, e) in list.iter().enumerate() {
        let prefix = format!("quotas[{i}].");
        let Value::Object(o) = e else { return Err(ApiError::invalid(format!("quotas[{i}]"), "must be an object")) };
        fields::only(o, &prefix, &ENTRY_FIELDS)?;
        let lim = fields::limit(o, &prefix)?;
        quotas.push(DesiredQuota {
            id: fields::opt_str(o, &prefix, "id")?,
            scope: fields::opt_str(o, &prefix, "scope")?,
            scope_ref: nullable(o, &prefix, "scope_ref")?,
            metric: fields::opt_str(o, &prefix, "metric")?,
            window: fields::opt_str(o, &prefix, "window")?,
            limit: lim.0,
            limit_decimal: lim.1,
            mode: fields::opt_str(o, &prefix, "mode")?,
            meter_type: nullable(o, &prefix, "meter_type")?,
            on_unpriced: nullable(o, &prefix, "on_unpriced")?,
        });
    }
    Ok(Document { project_id, quotas })
}

/// How many times a plan is made again after the stored set moved under it.
const ATTEMPTS: usize = 3;

/// Plans `desired` against the project's stored quotas and, unless
/// `dry_run`, carries the plan out with its audit entries: all of it or
/// nothing. Returns the plan (what changed, or would change).
pub async fn apply(
    store: &dyn Store,
    clock: &dyn Clock,
    project: &ProjectId,
    desired: &[DesiredQuota],
    principal: &Principal,
    dry_run: bool,
) -> ApiResult<QuotaPlan> {
    if store.project(project).await?.is_none() {
        return Err(ApiError::not_found("project", project.as_str()));
    }
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = store.quotas(project).await?;
        let now = crate::admin::now_micros(clock);
        let plan = meter::apply::plan(project, desired, &current, now, &mut new_quota_id)?;
        // A new api_key quota must name a live key of the project, as on
        // POST /v1/quotas. (A stored one may name a deleted key: it is inert.)
        for c in &plan.creates {
            if let (Scope::ApiKey, Some(r)) = (c.quota.spec.scope, &c.quota.spec.scope_ref) {
                let key = match ApiKeyId::parse(r.clone()) {
                    Ok(k) => store.api_key(&k).await?,
                    Err(_) => None,
                };
                if key.is_none_or(|k| &k.project_id != project) {
                    return Err(ApiError::invalid(
                        format!("quotas[{}].scope_ref", c.entry),
                        format!("no api key {r} in project {project}"),
                    ));
                }
            }
        }
        if dry_run || plan.is_empty() {
            return Ok(plan);
        }
        let audit = plan.audit(principal, now, &mut new_audit_id);
        match store.apply_quotas(&plan, &audit).await {
            Ok(()) => return Ok(plan),
            // Someone changed the project's quotas between our read and our
            // write: nothing was written; plan again from what is there now.
            Err(PortError::Fenced(_)) if attempt < ATTEMPTS => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The plan as JSON: counts and each change.
pub fn plan_json(plan: &QuotaPlan, dry_run: bool) -> Value {
    let mut changes = Vec::new();
    for q in &plan.deletes {
        changes.push(json!({ "action": "delete", "quota": crate::admin::quota_json(q) }));
    }
    for u in &plan.updates {
        changes.push(json!({
            "action": "update", "quota": crate::admin::quota_json(&u.after),
            "before": { "limit": meter::quota::limit_json(u.before.spec.metric, u.before.spec.limit), "mode": u.before.spec.mode.as_str() },
        }));
    }
    for c in &plan.creates {
        changes.push(json!({ "action": "create", "quota": crate::admin::quota_json(&c.quota) }));
    }
    json!({
        "project_id": plan.project_id,
        "dry_run": dry_run,
        "created": plan.creates.len(),
        "updated": plan.updates.len(),
        "deleted": plan.deletes.len(),
        "unchanged": plan.unchanged,
        "changes": changes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(v: Value) -> String {
        let e = parse_document(&v).expect_err("refused");
        e.meta["field"].as_str().expect("a field").to_owned()
    }

    #[test]
    fn documents_are_read_field_by_field() {
        let doc = parse_document(&json!({
            "project_id": "proj_1",
            "quotas": [
                {"scope": "api_key", "scope_ref": "key_1", "metric": "calls", "window": "day", "limit": 5},
                {"scope": "actor", "scope_ref": null, "metric": "rows", "window": "day", "limit": 9, "mode": "monitor", "id": "q_1"},
            ]
        }))
        .expect("valid");
        assert_eq!(doc.project_id.as_deref(), Some("proj_1"));
        assert_eq!(doc.quotas[0].scope_ref, Some(Some("key_1".into())));
        assert_eq!(doc.quotas[1].scope_ref, Some(None), "an explicit null");
        assert_eq!(doc.quotas[0].meter_type, None, "not supplied");
        assert_eq!(doc.quotas[1].id.as_deref(), Some("q_1"));

        assert_eq!(field(json!({"quotas": [], "colour": "red"})), "colour");
        assert_eq!(field(json!({"project_id": "p"})), "quotas");
        assert_eq!(field(json!({"quotas": {}})), "quotas");
        assert_eq!(field(json!({"quotas": [1]})), "quotas[0]");
        assert_eq!(field(json!({"quotas": [{"scope": "project", "window": "day", "colour": 1}]})), "quotas[0].colour");
        assert_eq!(field(json!({"quotas": [{}, {"window": 5}]})), "quotas[1].window");
        assert_eq!(field(json!({"quotas": [{"limit": true}]})), "quotas[0].limit");
        assert_eq!(field(json!({"quotas": [{"limit": [5]}]})), "quotas[0].limit");
        assert_eq!(field(json!({"quotas": [{"scope_ref": 7}]})), "quotas[0].scope_ref");
        assert_eq!(field(json!([])), "body");
    }
}
