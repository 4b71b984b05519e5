//! Roles (ADR-0011): grant templates with a quota of their own.
//!
//! A role carries grants (`max_concurrent`, `query_timeout`, `max_rows`)
//! and at most one quota: calls and/or rows per day or per calendar month.
//! An API key with a role, and every signed-in user the gateway names with
//! that role (`user:<subject>`), gets the role's quota as an allowance of
//! its own: one counter per key or per user, never one pool the first
//! caller can exhaust. Limits only narrow: a key's effective limit is the
//! smallest of its own grant and its role's. A role marked `exempt` (an
//! administrator's, or the break-glass one) is never limited or counted.
//!
//! The role's quota becomes ordinary [`Quota`]s at check time
//! ([`role_quotas`]), on the caller's own counter, so the one check script
//! and the one verdict enforce it like any other quota.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::admission::Caller;
use crate::error::FieldError;
use crate::ids::{ProjectId, QuotaId, RoleId};
use crate::quota::{Metric, Mode, Quota, QuotaSpec, Scope};
use crate::tenant::Grants;
use crate::window::WindowKind;

/// The period of a role's quota: calendar periods in the project's zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Per {
    Day,
    Month,
}

impl Per {
    pub fn window(self) -> WindowKind {
        match self {
            Per::Day => WindowKind::Day,
            Per::Month => WindowKind::CalendarMonth,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Day => "day",
            Per::Month => "month",
        }
    }
}

/// `{"calls": 100000, "rows": 10000000, "per": "month"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleQuota {
    pub calls: Option<u64>,
    pub rows: Option<u64>,
    pub per: Per,
}

impl RoleQuota {
    /// Either count may be left out, but not both; each is > 0.
    pub fn check(&self) -> Result<(), FieldError> {
        if self.calls.is_none() && self.rows.is_none() {
            return Err(FieldError::new("quota", "needs calls, rows or both"));
        }
        for (name, v) in [("calls", self.calls), ("rows", self.rows)] {
            if v.is_some_and(|v| v == 0 || v > i64::MAX as u64) {
                return Err(FieldError::new(format!("quota.{name}"), "must be a whole number greater than 0"));
            }
        }
        Ok(())
    }
}

/// A role of a project.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    pub id: RoleId,
    pub project_id: ProjectId,
    pub name: String,
    pub grants: Grants,
    pub quota: Option<RoleQuota>,
    /// Administrators and break-glass callers: never limited or counted.
    pub exempt: bool,
    pub created_at: DateTime<Utc>,
}

/// The smallest of two optional limits (`None` is no limit).
fn narrow<T: Ord + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// The bounds one call runs under: the server's (`TOLLGATE_QUERY_TIMEOUT`,
/// `TOLLGATE_MAX_PAGE_SIZE`, `TOLLGATE_STREAM_MAX_ROWS`), narrowed by the
/// caller's effective grants and never widened by them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub query_timeout: std::time::Duration,
    /// The rows of one page.
    pub max_rows: u64,
    /// The rows of one streamed response.
    pub stream_max_rows: u64,
}

impl Bounds {
    /// These (the server's) narrowed by a caller's effective grants: a
    /// grant's `max_rows` bounds pages and streams alike.
    pub fn narrowed(&self, grants: &Grants) -> Bounds {
        let rows = |server: u64| grants.max_rows.map_or(server, |g| g.min(server));
        Bounds {
            query_timeout: crate::permit::query_timeout(grants.query_timeout, self.query_timeout),
            max_rows: rows(self.max_rows),
            stream_max_rows: rows(self.stream_max_rows),
        }
    }
}

/// The limits that apply: each the smallest of the key's own and its role's.
pub fn effective_grants(own: &Grants, role: Option<&Role>) -> Grants {
    let Some(r) = role else { return own.clone() };
    Grants {
        max_concurrent: narrow(own.max_concurrent, r.grants.max_concurrent),
        query_timeout: narrow(own.query_timeout, r.grants.query_timeout),
        max_rows: narrow(own.max_rows, r.grants.max_rows),
    }
}

/// The quotas a role puts on one caller's own counter: the key's
/// (`api_key` scope, its id) or the signed-in user's (`user` scope, its
/// name). Their ids (`role:<role>:calls`) name the role in a refusal.
pub fn role_quotas(role: &Role, caller: &Caller) -> Vec<Quota> {
    let Some(q) = role.quota else { return Vec::new() };
    let (scope, scope_ref) = match (&caller.user, &caller.api_key) {
        (Some(u), _) => (Scope::User, u.clone()),
        (None, Some(k)) => (Scope::ApiKey, k.as_str().to_owned()),
        (None, None) => return Vec::new(),
    };
    let mut out = Vec::new();
    for (metric, limit) in [(Metric::Calls, q.calls), (Metric::Rows, q.rows)] {
        let Some(limit) = limit else { continue };
        let Ok(id) = QuotaId::parse(format!("role:{}:{}", role.id, metric.as_str())) else { continue };
        out.push(Quota {
            id,
            spec: QuotaSpec {
                project_id: role.project_id.clone(),
                scope,
                scope_ref: Some(scope_ref.clone()),
                metric,
                window: q.per.window(),
                limit,
                mode: Mode::Enforce,
                meter_type: None,
                on_unpriced: None,
            },
            created_at: role.created_at,
            updated_at: role.created_at,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use chrono_tz::Tz;

    use super::*;

    #[test]
    fn grants_narrow_the_servers_bounds_and_never_widen_them() {
        let server =
            Bounds { query_timeout: std::time::Duration::from_secs(30), max_rows: 1000, stream_max_rows: 100_000 };
        assert_eq!(server.narrowed(&Grants::default()), server);
        let narrow = Grants { max_concurrent: None, query_timeout: Some(5), max_rows: Some(500) };
        assert_eq!(
            server.narrowed(&narrow),
            Bounds { query_timeout: std::time::Duration::from_secs(5), max_rows: 500, stream_max_rows: 500 }
        );
        let wide = Grants { max_concurrent: None, query_timeout: Some(300), max_rows: Some(5000) };
        assert_eq!(
            server.narrowed(&wide),
            Bounds { query_timeout: std::time::Duration::from_secs(30), max_rows: 1000, stream_max_rows: 5000 }
        );
    }
    use crate::admission::{CheckInput, CheckOutcome, decide, plan_check};
    use crate::ids::ApiKeyId;
    use crate::usage::Dimension;

    fn role(quota: Option<RoleQuota>) -> Role {
        Role {
            id: RoleId::parse("role_partner").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            name: "partner".into(),
            grants: Grants { max_concurrent: Some(5), query_timeout: Some(30), max_rows: None },
            quota,
            exempt: false,
            created_at: DateTime::from_timestamp(0, 0).expect("epoch"),
        }
    }

    #[test]
    fn limits_only_narrow() {
        let own = Grants { max_concurrent: Some(10), query_timeout: None, max_rows: Some(100) };
        let r = role(None);
        let e = effective_grants(&own, Some(&r));
        assert_eq!((e.max_concurrent, e.query_timeout, e.max_rows), (Some(5), Some(30), Some(100)));
        assert_eq!(effective_grants(&own, None), own);
    }

    #[test]
    fn each_signed_in_user_gets_a_counter_of_their_own() {
        let r = role(Some(RoleQuota { calls: Some(2), rows: None, per: Per::Month }));
        let at = DateTime::from_timestamp(1_780_000_000, 0).expect("time");
        let user = |u: &str| Caller { user: Some(u.into()), ..Caller::default() };
        let alice = role_quotas(&r, &user("user:alice"));
        assert_eq!(alice.len(), 1);
        assert_eq!(alice[0].id.as_str(), "role:role_partner:calls");
        let plan = plan_check(
            &alice,
            Tz::UTC,
            &CheckInput { caller: user("user:alice"), storage_delta: None, ..Default::default() },
            at,
        );
        assert_eq!(plan.counters[0].key.dimension, Dimension::User("user:alice".into()));
        assert_eq!(plan.counters[0].key.window, WindowKind::CalendarMonth);
        // Alice's quota never matches Bob, and Bob's is his own counter.
        let plan = plan_check(
            &alice,
            Tz::UTC,
            &CheckInput { caller: user("user:bob"), storage_delta: None, ..Default::default() },
            at,
        );
        assert!(plan.limits.is_empty());
        let bob = role_quotas(&r, &user("user:bob"));
        let plan = plan_check(
            &bob,
            Tz::UTC,
            &CheckInput { caller: user("user:bob"), storage_delta: None, ..Default::default() },
            at,
        );
        assert_eq!(plan.counters[0].key.dimension, Dimension::User("user:bob".into()));
        let v = decide(&bob, &plan, &CheckOutcome::of(false, vec![2]), at);
        let b = v.breach.expect("used up");
        assert_eq!((b.scope, b.scope_ref.as_deref()), (Scope::User, Some("user:bob")));
    }

    #[test]
    fn a_key_with_a_role_takes_the_quota_on_its_own_counter() {
        let r = role(Some(RoleQuota { calls: Some(100), rows: Some(1000), per: Per::Day }));
        let key = Caller::key(&ApiKeyId::parse("k1").expect("id"), None);
        let qs = role_quotas(&r, &key);
        assert_eq!(qs.len(), 2);
        assert!(qs.iter().all(|q| q.spec.scope == Scope::ApiKey && q.spec.scope_ref.as_deref() == Some("k1")));
        assert!(qs.iter().all(|q| q.spec.window == WindowKind::Day));
    }

    #[test]
    fn a_role_quota_needs_a_count() {
        assert_eq!(RoleQuota { calls: None, rows: None, per: Per::Day }.check().expect_err("empty").field, "quota");
        assert_eq!(
            RoleQuota { calls: Some(0), rows: None, per: Per::Day }.check().expect_err("zero").field,
            "quota.calls"
        );
        assert!(RoleQuota { calls: None, rows: Some(5), per: Per::Month }.check().is_ok());
    }
}
