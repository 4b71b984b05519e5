//! Declarative quotas: a project's desired set of quotas, compared with the
//! stored set, gives a plan of creates, updates and deletes.
//!
//! `tollgate apply -f quotas.yaml` and `PUT /v1/projects/{id}/quotas` state
//! the whole set of a project's quotas; [`plan`] says what has to change for
//! the store to match it. It is pure: the store carries a plan out in one
//! transaction and refuses it, changing nothing, if the stored set moved
//! since it was planned (`Store::apply_quotas`).
//!
//! The rules:
//! - An entry matches a stored quota by its identity (scope, scope_ref,
//!   metric, window, meter_type), or by `id` when it carries one. Matched, it
//!   updates `limit` and `mode` if they differ; unmatched, it is created.
//!   Stored quotas that no entry matches are deleted.
//! - Every entry is checked by [`validate`], the function the REST route
//!   uses, so a file cannot declare what the API refuses. Errors name the
//!   entry and the field: `quotas[2].window`.
//! - With an `id`, the identity is immutable: a different `scope`,
//!   `scope_ref`, `metric`, `window`, `meter_type` or `on_unpriced` fails
//!   the whole plan naming the field. Omitting a nullable one (`scope_ref`,
//!   `meter_type`, `on_unpriced`) means "as stored"; an explicit null that
//!   disagrees with the stored value is a change.
//! - Two entries with one identity, or one id, are refused.
//! - The plan is a fixed point: planning the same entries against the
//!   result of carrying it out plans nothing.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::audit::{AuditAction, AuditDetail, AuditEntry, Principal};
use crate::error::FieldError;
use crate::ids::{AuditId, ProjectId, QuotaId};
use crate::quota::{Metric, OnUnpriced, Quota, QuotaDraft, QuotaPatch, QuotaSpec, Scope, validate};
use crate::window::WindowKind;

/// Most entries one apply may carry.
pub const MAX_ENTRIES: usize = 1000;

/// One entry of a desired set, every field still as the caller wrote it.
/// `None` is "not supplied"; for the nullable fields `Some(None)` is an
/// explicit null.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DesiredQuota {
    pub id: Option<String>,
    pub scope: Option<String>,
    pub scope_ref: Option<Option<String>>,
    pub metric: Option<String>,
    pub window: Option<String>,
    pub limit: Option<i64>,
    /// A decimal limit (`cost_usd` only), as written.
    pub limit_decimal: Option<String>,
    pub mode: Option<String>,
    pub meter_type: Option<Option<String>>,
    pub on_unpriced: Option<Option<String>>,
}

/// What makes a quota the quota it is, within its project.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub scope: Scope,
    pub scope_ref: Option<String>,
    pub metric: Metric,
    pub window: WindowKind,
    pub meter_type: Option<String>,
}

impl Identity {
    pub fn of(spec: &QuotaSpec) -> Identity {
        Identity {
            scope: spec.scope,
            scope_ref: spec.scope_ref.clone(),
            metric: spec.metric,
            window: spec.window,
            meter_type: spec.meter_type.clone(),
        }
    }
}

/// A quota to create, and the entry it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Create {
    pub entry: usize,
    pub quota: Quota,
}

/// A quota whose `limit` or `mode` changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub before: Quota,
    pub after: Quota,
}

/// What has to change, in the order the store carries it out: deletes,
/// updates, creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaPlan {
    pub project_id: ProjectId,
    /// The stored quotas the plan was made from. When set, the store refuses
    /// the plan ([`PortError::Fenced`](crate::PortError::Fenced)) unless the
    /// project's quotas are still exactly these.
    pub based_on: Option<Vec<Quota>>,
    pub deletes: Vec<Quota>,
    pub updates: Vec<Update>,
    pub creates: Vec<Create>,
    /// Entries that already match their stored quota.
    pub unchanged: usize,
}

impl QuotaPlan {
    fn empty(project_id: ProjectId) -> QuotaPlan {
        QuotaPlan {
            project_id,
            based_on: None,
            deletes: Vec::new(),
            updates: Vec::new(),
            creates: Vec::new(),
            unchanged: 0,
        }
    }

    /// Creates one quota (`POST /v1/quotas`).
    pub fn create(quota: Quota) -> QuotaPlan {
        let mut p = QuotaPlan::empty(quota.spec.project_id.clone());
        p.creates.push(Create { entry: 0, quota });
        p
    }

    /// Changes one quota's `limit` and `mode` (`PATCH /v1/quotas/{id}`).
    pub fn update(before: Quota, patch: &QuotaPatch, at: DateTime<Utc>) -> QuotaPlan {
        let mut after = before.clone();
        patch.apply(&mut after.spec);
        after.updated_at = at;
        let mut p = QuotaPlan::empty(before.spec.project_id.clone());
        p.updates.push(Update { before, after });
        p
    }

    /// Deletes one quota (`DELETE /v1/quotas/{id}`).
    pub fn delete(quota: Quota) -> QuotaPlan {
        let mut p = QuotaPlan::empty(quota.spec.project_id.clone());
        p.deletes.push(quota);
        p
    }

    /// Whether carrying it out would change nothing.
    pub fn is_empty(&self) -> bool {
        self.creates.is_empty() && self.updates.is_empty() && self.deletes.is_empty()
    }

    /// The audit entries of the plan's changes, in the order they are made.
    pub fn audit(
        &self,
        principal: &Principal,
        at: DateTime<Utc>,
        new_id: &mut dyn FnMut() -> AuditId,
    ) -> Vec<AuditEntry> {
        let mut entry = |action, resource: &QuotaId, before: Option<&Quota>, after: Option<&Quota>| AuditEntry {
            id: new_id(),
            project_id: Some(self.project_id.clone()),
            action,
            principal: Some(principal.clone()),
            resource: resource.to_string(),
            detail: AuditDetail::QuotaChange {
                before: before.cloned().map(Box::new),
                after: after.cloned().map(Box::new),
            },
            created_at: at,
        };
        let mut out = Vec::with_capacity(self.deletes.len() + self.updates.len() + self.creates.len());
        for q in &self.deletes {
            out.push(entry(AuditAction::DeleteQuota, &q.id, Some(q), None));
        }
        for u in &self.updates {
            out.push(entry(AuditAction::UpdateQuota, &u.before.id, Some(&u.before), Some(&u.after)));
        }
        for c in &self.creates {
            out.push(entry(AuditAction::CreateQuota, &c.quota.id, None, Some(&c.quota)));
        }
        out
    }
}

fn on_unpriced_str(o: Option<OnUnpriced>) -> Option<&'static str> {
    o.map(|o| match o {
        OnUnpriced::Block => "block",
        OnUnpriced::Allow => "allow",
    })
}

/// A nullable field: as supplied, or as stored when omitted on an entry with an id.
fn resolve(supplied: &Option<Option<String>>, stored: Option<Option<&str>>) -> Option<String> {
    match (supplied, stored) {
        (Some(v), _) => v.clone(),
        (None, Some(s)) => s.map(str::to_owned),
        (None, None) => None,
    }
}

fn immutable(prefix: &str, field: &str, stored: Option<&str>, got: Option<&str>) -> FieldError {
    let show = |v: Option<&str>| v.map_or_else(|| "null".to_owned(), |v| format!("{v:?}"));
    FieldError::new(
        format!("{prefix}{field}"),
        format!(
            "is immutable (stored {}, file {}); replace the quota (drop its id) to change it",
            show(stored),
            show(got)
        ),
    )
}

/// The first identity field of `want` (as written) that differs from `stored`.
fn check_identity(prefix: &str, stored: &QuotaSpec, want: [(&str, Option<&str>); 6]) -> Result<(), FieldError> {
    let have = [
        ("scope", Some(stored.scope.as_str())),
        ("scope_ref", stored.scope_ref.as_deref()),
        ("metric", Some(stored.metric.as_str())),
        ("window", Some(stored.window.as_str())),
        ("meter_type", stored.meter_type.as_deref()),
        ("on_unpriced", on_unpriced_str(stored.on_unpriced)),
    ];
    for ((field, got), (_, was)) in want.into_iter().zip(have) {
        if got != was {
            return Err(immutable(prefix, field, was, got));
        }
    }
    Ok(())
}

/// Plans the changes that make `project`'s quotas (`current`) match
/// `desired`. New quotas get ids from `new_id` and timestamps `at`.
pub fn plan(
    project: &ProjectId,
    desired: &[DesiredQuota],
    current: &[Quota],
    at: DateTime<Utc>,
    new_id: &mut dyn FnMut() -> QuotaId,
) -> Result<QuotaPlan, FieldError> {
    if desired.len() > MAX_ENTRIES {
        return Err(FieldError::new("quotas", format!("must hold at most {MAX_ENTRIES} entries")));
    }
    let current: Vec<&Quota> = current.iter().filter(|q| &q.spec.project_id == project).collect();
    let by_id: HashMap<&QuotaId, &Quota> = current.iter().map(|q| (&q.id, *q)).collect();
    let by_identity: HashMap<Identity, &Quota> = current.iter().map(|q| (Identity::of(&q.spec), *q)).collect();
    let mut seen_ids: HashMap<QuotaId, usize> = HashMap::new();
    let mut seen_identities: HashMap<Identity, usize> = HashMap::new();
    let mut matched: HashSet<&QuotaId> = HashSet::new();
    let mut plan = QuotaPlan::empty(project.clone());
    plan.based_on = Some(current.iter().map(|q| (*q).clone()).collect());

    for (i, d) in desired.iter().enumerate() {
        let prefix = format!("quotas[{i}].");
        let stored = match &d.id {
            None => None,
            Some(raw) => {
                let id =
                    QuotaId::parse(raw.clone()).map_err(|e| FieldError::new(format!("{prefix}id"), e.to_string()))?;
                let q = by_id.get(&id).copied().ok_or_else(|| {
                    FieldError::new(format!("{prefix}id"), format!("no quota {id} in project {project}"))
                })?;
                if let Some(j) = seen_ids.insert(id, i) {
                    return Err(FieldError::new(format!("{prefix}id"), format!("is also the id of quotas[{j}]")));
                }
                Some(q)
            }
        };
        let stored_spec = stored.map(|q| &q.spec);
        let scope_ref = resolve(&d.scope_ref, stored_spec.map(|s| s.scope_ref.as_deref()));
        let meter_type = resolve(&d.meter_type, stored_spec.map(|s| s.meter_type.as_deref()));
        let on_unpriced = resolve(&d.on_unpriced, stored_spec.map(|s| on_unpriced_str(s.on_unpriced)));
        if let Some(s) = stored_spec {
            // Checked as written, before validation, so the message is about
            // the field that changed rather than a rule it now breaks.
            check_identity(
                &prefix,
                s,
                [
                    ("scope", d.scope.as_deref().or(Some(s.scope.as_str()))),
                    ("scope_ref", scope_ref.as_deref()),
                    ("metric", d.metric.as_deref().or(Some(s.metric.as_str()))),
                    ("window", d.window.as_deref().or(Some(s.window.as_str()))),
                    ("meter_type", meter_type.as_deref()),
                    ("on_unpriced", on_unpriced.as_deref()),
                ],
            )?;
        }
        let draft = QuotaDraft {
            project_id: Some(project.to_string()),
            scope: d.scope.clone(),
            scope_ref,
            metric: d.metric.clone(),
            window: d.window.clone(),
            limit: d.limit,
            limit_decimal: d.limit_decimal.clone(),
            mode: d.mode.clone(),
            meter_type,
            on_unpriced,
        };
        let spec = validate(&draft).map_err(|e| FieldError::new(format!("{prefix}{}", e.field), e.message))?;
        let identity = Identity::of(&spec);
        if let Some(j) = seen_identities.insert(identity.clone(), i) {
            return Err(FieldError::new(
                format!("quotas[{i}]"),
                format!("has the same scope, scope_ref, metric, window and meter_type as quotas[{j}]"),
            ));
        }
        match stored.or_else(|| by_identity.get(&identity).copied()) {
            None => plan
                .creates
                .push(Create { entry: i, quota: Quota { id: new_id(), spec, created_at: at, updated_at: at } }),
            Some(q) => {
                if spec.on_unpriced != q.spec.on_unpriced {
                    return Err(immutable(
                        &prefix,
                        "on_unpriced",
                        on_unpriced_str(q.spec.on_unpriced),
                        on_unpriced_str(spec.on_unpriced),
                    ));
                }
                matched.insert(&q.id);
                if (spec.limit, spec.mode) == (q.spec.limit, q.spec.mode) {
                    plan.unchanged += 1;
                } else {
                    let mut after = q.clone();
                    after.spec.limit = spec.limit;
                    after.spec.mode = spec.mode;
                    after.updated_at = at;
                    plan.updates.push(Update { before: q.clone(), after });
                }
            }
        }
    }
    plan.deletes = current.iter().filter(|q| !matched.contains(&q.id)).map(|q| (*q).clone()).collect();
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Mode;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
    }

    fn pid() -> ProjectId {
        ProjectId::parse("p1").expect("project id")
    }

    fn stored(
        id: &str,
        scope: Scope,
        scope_ref: Option<&str>,
        metric: Metric,
        window: WindowKind,
        limit: u64,
    ) -> Quota {
        let t0 = utc("2026-01-01T00:00:00Z");
        Quota {
            id: QuotaId::parse(id).expect("quota id"),
            spec: QuotaSpec {
                project_id: pid(),
                scope,
                scope_ref: scope_ref.map(str::to_owned),
                metric,
                window,
                limit,
                mode: Mode::Enforce,
                meter_type: None,
                on_unpriced: None,
            },
            created_at: t0,
            updated_at: t0,
        }
    }

    /// The stored set every case starts from.
    fn current() -> Vec<Quota> {
        vec![
            stored("q_day", Scope::Project, None, Metric::Calls, WindowKind::Day, 100),
            stored("q_key", Scope::ApiKey, Some("k1"), Metric::Requests, WindowKind::Rolling1m, 60),
            stored("q_actor", Scope::Actor, None, Metric::Rows, WindowKind::CalendarMonth, 5000),
        ]
    }

    fn entry(scope: &str, scope_ref: Option<&str>, metric: &str, window: &str, limit: i64) -> DesiredQuota {
        DesiredQuota {
            scope: Some(scope.into()),
            scope_ref: scope_ref.map(|r| Some(r.to_owned())),
            metric: Some(metric.into()),
            window: Some(window.into()),
            limit: Some(limit),
            ..Default::default()
        }
    }

    /// The file that matches `current()` exactly.
    fn same() -> Vec<DesiredQuota> {
        vec![
            entry("project", None, "calls", "day", 100),
            entry("api_key", Some("k1"), "requests", "rolling_1m", 60),
            entry("actor", None, "rows", "calendar_month", 5000),
        ]
    }

    fn with(mut v: Vec<DesiredQuota>, f: impl FnOnce(&mut Vec<DesiredQuota>)) -> Vec<DesiredQuota> {
        f(&mut v);
        v
    }

    fn run(desired: &[DesiredQuota], current: &[Quota]) -> Result<QuotaPlan, FieldError> {
        let mut n = 0;
        plan(&pid(), desired, current, utc("2026-03-01T00:00:00Z"), &mut || {
            n += 1;
            QuotaId::parse(format!("q_new{n}")).expect("id")
        })
    }

    /// (creates as "metric/window", updated ids, deleted ids, unchanged)
    type Summary = (Vec<String>, Vec<String>, Vec<String>, usize);

    fn summary(p: &QuotaPlan) -> Summary {
        (
            p.creates.iter().map(|c| format!("{}/{}", c.quota.spec.metric, c.quota.spec.window)).collect(),
            p.updates.iter().map(|u| u.before.id.to_string()).collect(),
            p.deletes.iter().map(|q| q.id.to_string()).collect(),
            p.unchanged,
        )
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| (*x).to_owned()).collect()
    }

    #[test]
    fn plans_table() {
        let cases: Vec<(&str, Vec<DesiredQuota>, Summary)> = vec![
            ("the same set changes nothing", same(), (s(&[]), s(&[]), s(&[]), 3)),
            ("order does not matter", with(same(), |v| v.reverse()), (s(&[]), s(&[]), s(&[]), 3)),
            ("a new limit updates", with(same(), |v| v[0].limit = Some(200)), (s(&[]), s(&["q_day"]), s(&[]), 2)),
            (
                "a new mode updates",
                with(same(), |v| v[1].mode = Some("monitor".into())),
                (s(&[]), s(&["q_key"]), s(&[]), 2),
            ),
            (
                "mode enforce stated is the default",
                with(same(), |v| v[1].mode = Some("enforce".into())),
                (s(&[]), s(&[]), s(&[]), 3),
            ),
            ("a missing entry deletes", with(same(), |v| drop(v.remove(2))), (s(&[]), s(&[]), s(&["q_actor"]), 2)),
            (
                "a new identity creates",
                with(same(), |v| v.push(entry("project", None, "calls", "rolling_1h", 10))),
                (s(&["calls/rolling_1h"]), s(&[]), s(&[]), 3),
            ),
            (
                "a changed window without an id is a replacement",
                with(same(), |v| v[0].window = Some("rolling_24h".into())),
                (s(&["calls/rolling_24h"]), s(&[]), s(&["q_day"]), 2),
            ),
            ("an empty set deletes everything", vec![], (s(&[]), s(&[]), s(&["q_day", "q_key", "q_actor"]), 0)),
            (
                "an id matches its quota and may restate everything",
                with(same(), |v| {
                    v[0].id = Some("q_day".into());
                    v[0].limit = Some(7);
                }),
                (s(&[]), s(&["q_day"]), s(&[]), 2),
            ),
            (
                "with an id an omitted scope_ref is the stored one",
                with(same(), |v| {
                    v[1].id = Some("q_key".into());
                    v[1].scope_ref = None;
                }),
                (s(&[]), s(&[]), s(&[]), 3),
            ),
            (
                "null scope_ref on actor is one quota, a named actor another",
                with(same(), |v| v.push(entry("actor", Some("u1"), "rows", "calendar_month", 10))),
                (s(&["rows/calendar_month"]), s(&[]), s(&[]), 3),
            ),
        ];
        for (name, desired, want) in cases {
            let p = run(&desired, &current()).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(summary(&p), want, "{name}");
            assert_eq!(p.based_on.as_deref(), Some(&current()[..]), "{name}: the precondition");
        }
    }

    #[test]
    fn refusals_table() {
        let cases: Vec<(&str, Vec<DesiredQuota>, &str)> = vec![
            ("a bad window", with(same(), |v| v[2].window = Some("week".into())), "quotas[2].window"),
            ("a missing limit", with(same(), |v| v[1].limit = None), "quotas[1].limit"),
            ("a zero limit", with(same(), |v| v[0].limit = Some(0)), "quotas[0].limit"),
            ("a bad mode", with(same(), |v| v[0].mode = Some("loud".into())), "quotas[0].mode"),
            ("a missing scope", with(same(), |v| v[0].scope = None), "quotas[0].scope"),
            (
                "an invalid combination",
                with(same(), |v| v.push(entry("actor", None, "requests", "day", 1))),
                "quotas[3].scope",
            ),
            (
                "cost-only fields elsewhere",
                with(same(), |v| v[0].meter_type = Some(Some("llm_tokens".into()))),
                "quotas[0].meter_type",
            ),
            ("a duplicate identity", with(same(), |v| v.push(v[0].clone())), "quotas[3]"),
            (
                "a duplicate identity with a new limit",
                with(same(), |v| {
                    let mut d = v[1].clone();
                    d.limit = Some(1);
                    v.push(d);
                }),
                "quotas[3]",
            ),
            ("an unknown id", with(same(), |v| v[0].id = Some("q_nope".into())), "quotas[0].id"),
            ("a malformed id", with(same(), |v| v[0].id = Some("q nope".into())), "quotas[0].id"),
            (
                "one id twice",
                with(same(), |v| {
                    v[0].id = Some("q_day".into());
                    v[1].id = Some("q_day".into());
                }),
                "quotas[1].id",
            ),
            (
                "an id with another window",
                with(same(), |v| {
                    v[0].id = Some("q_day".into());
                    v[0].window = Some("rolling_1h".into());
                }),
                "quotas[0].window",
            ),
            (
                "an id with another scope",
                with(same(), |v| {
                    v[1].id = Some("q_key".into());
                    v[1].scope = Some("project".into());
                }),
                "quotas[1].scope",
            ),
            (
                "an id with another metric",
                with(same(), |v| {
                    v[0].id = Some("q_day".into());
                    v[0].metric = Some("rows".into());
                }),
                "quotas[0].metric",
            ),
            (
                "an id with an explicit null scope_ref",
                with(same(), |v| {
                    v[1].id = Some("q_key".into());
                    v[1].scope_ref = Some(None);
                }),
                "quotas[1].scope_ref",
            ),
            (
                "an id with another scope_ref",
                with(same(), |v| {
                    v[1].id = Some("q_key".into());
                    v[1].scope_ref = Some(Some("k2".into()));
                }),
                "quotas[1].scope_ref",
            ),
            (
                "an id whose identity is claimed by another entry too",
                with(same(), |v| {
                    let mut d = v[0].clone();
                    d.id = Some("q_day".into());
                    v.push(d);
                }),
                "quotas[3]",
            ),
        ];
        for (name, desired, field) in cases {
            match run(&desired, &current()) {
                Ok(p) => panic!("{name}: planned {:?}", summary(&p)),
                Err(e) => assert_eq!(e.field, field, "{name}: {e}"),
            }
        }
        let too_many = vec![entry("project", None, "calls", "day", 1); MAX_ENTRIES + 1];
        assert_eq!(run(&too_many, &[]).expect_err("too many").field, "quotas");
    }

    #[test]
    fn an_immutable_change_names_stored_and_wanted_values() {
        let desired = with(same(), |v| {
            v[0].id = Some("q_day".into());
            v[0].window = Some("rolling_1h".into());
            v[0].limit = Some(1);
        });
        let e = run(&desired, &current()).expect_err("immutable");
        assert_eq!(e.field, "quotas[0].window");
        assert!(
            e.message.contains("immutable") && e.message.contains("\"day\"") && e.message.contains("\"rolling_1h\""),
            "{e}"
        );
    }

    #[test]
    fn carrying_out_a_plan_reaches_a_fixed_point() {
        let desired = with(same(), |v| {
            v[0].limit = Some(250);
            v[1].mode = Some("monitor".into());
            v.remove(2);
            v.push(entry("project", None, "requests", "rolling_24h", 9));
        });
        let p = run(&desired, &current()).expect("plan");
        assert_eq!(summary(&p), (s(&["requests/rolling_24h"]), s(&["q_day", "q_key"]), s(&["q_actor"]), 0));
        // Carry it out by hand, as a store would.
        let mut after: Vec<Quota> = current().into_iter().filter(|q| !p.deletes.contains(q)).collect();
        for u in &p.updates {
            let q = after.iter_mut().find(|q| q.id == u.before.id).expect("updated quota");
            *q = u.after.clone();
        }
        after.extend(p.creates.iter().map(|c| c.quota.clone()));
        let again = run(&desired, &after).expect("plan again");
        assert!(again.is_empty(), "{:?}", summary(&again));
        assert_eq!(again.unchanged, 3);
        assert_eq!(p.updates[0].after.spec.limit, 250);
        assert_eq!(p.updates[1].after.spec.mode, Mode::Monitor);
        assert_eq!(p.updates[0].after.updated_at, utc("2026-03-01T00:00:00Z"));
        assert_eq!(p.updates[0].after.created_at, p.updates[0].before.created_at);
        assert_eq!(p.creates[0].entry, 2);
    }

    #[test]
    fn other_projects_quotas_are_not_touched() {
        let mut foreign = stored("q_other", Scope::Project, None, Metric::Calls, WindowKind::Day, 1);
        foreign.spec.project_id = ProjectId::parse("p2").expect("id");
        let mut cur = current();
        cur.push(foreign);
        let p = run(&same(), &cur).expect("plan");
        assert!(p.is_empty());
        assert_eq!(p.based_on.map(|b| b.len()), Some(3));
    }

    #[test]
    fn single_changes_and_their_audit_entries() {
        let at = utc("2026-03-01T00:00:00Z");
        let q = current().remove(0);
        let principal = Principal::new("admin", "api");
        let mut n = 0;
        let mut ids = || {
            n += 1;
            AuditId::parse(format!("aud_{n}")).expect("id")
        };
        let p = QuotaPlan::update(q.clone(), &QuotaPatch { limit: Some(5), mode: None }, at);
        assert_eq!(p.based_on, None, "a single change has no precondition on the whole set");
        assert_eq!((p.updates[0].after.spec.limit, p.updates[0].after.updated_at), (5, at));
        let entries = p.audit(&principal, at, &mut ids);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].action, AuditAction::UpdateQuota);
        assert_eq!(entries[0].resource, "q_day");
        assert_eq!(entries[0].principal, Some(principal.clone()));

        let mut desired = same();
        desired.remove(1);
        desired[0].limit = Some(1);
        desired.push(entry("project", None, "rows", "day", 3));
        let p = run(&desired, &current()).expect("plan");
        let actions: Vec<&str> = p.audit(&principal, at, &mut ids).iter().map(|e| e.action.as_str()).collect();
        assert_eq!(actions, ["quotas:DeleteQuota", "quotas:UpdateQuota", "quotas:CreateQuota"]);
        assert!(
            QuotaPlan::delete(q.clone()).audit(&principal, at, &mut ids)[0].detail
                == AuditDetail::QuotaChange { before: Some(Box::new(q)), after: None }
        );
    }
}
