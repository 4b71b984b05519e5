//! Permits: `max_concurrent` as leased slots (ADR-0011 §1, ADR-0196 §2).
//!
//! A check that asks for a permit, from a caller with a `max_concurrent`
//! grant, takes one slot of the caller's own pool and one of the
//! installation's pool (every permit of every caller together) in one
//! step, or neither. A permit is held until it is released (`DELETE
//! /v1/permits/{id}`, or the settle of the call's event naming it) or its
//! lease lapses; a renew extends the lease by its length from the renewal.
//! A holder that dies is freed when its lease lapses, and not before.
//!
//! The rules, all pure and all here:
//!
//! - **whose limit** ([`own_cap`]): the caller's cap is the smaller of its
//!   key's `max_concurrent` and its role's, reported as the key's when the
//!   key's is the smaller or they are equal; a signed-in user's is its
//!   role's. A caller with no `max_concurrent` takes no permit (nothing
//!   changes for a key that never set one).
//! - **whose pool** ([`holder`]): a key's slots are the key's; a signed-in
//!   user's are that user's (per project), never one pool of the role.
//! - **the lease** ([`lease`]): the effective `query_timeout` (the grant's,
//!   narrowed by the server's) plus [`LEASE_MARGIN`].
//! - **the installation's cap** ([`installation_cap`]): a quarter of the
//!   PostgreSQL pool, at least one, unless configured.
//! - **a lapsed permit** is one whose `expires_at` is at or before `at`;
//!   every operation reaps lapsed permits before it looks (reap, then claim).
//!
//! [`PermitModel`] is the reference model of a permit store, the one the
//! in-memory backend runs; the Redis and PostgreSQL backends pass the same
//! conformance suite (`store/tests/permit_conformance.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::admission::Caller;
use crate::ids::{PermitId, ProjectId};
use crate::role::Role;
use crate::tenant::Grants;

/// What a lease is longer than the call's time limit by: a holder that dies
/// keeps its slot this long after its call would have timed out.
pub const LEASE_MARGIN: Duration = Duration::from_secs(30);

/// The holder name of the installation's pool (a caller's holder always
/// starts with its project id, which cannot be `*`).
pub const INSTALLATION: &str = "*";

/// Whose limit a permit pool is: what a `TOO_MANY_CONCURRENT` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whose {
    /// The API key's own `max_concurrent`.
    ApiKey,
    /// The role's `max_concurrent` (a key's role's, or a signed-in user's role's).
    Role,
    /// The installation-wide cap on all permits together.
    Installation,
}

impl Whose {
    pub fn as_str(self) -> &'static str {
        match self {
            Whose::ApiKey => "api_key",
            Whose::Role => "role",
            Whose::Installation => "installation",
        }
    }
}

/// A caller's own cap, and whose it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnCap {
    pub limit: u32,
    pub whose: Whose,
}

/// The caller's cap: the smaller of the key's `max_concurrent` and its
/// role's (the key's on a tie). `key` is `None` for a signed-in user, whose
/// cap is its role's. `None`: the caller takes no permit.
pub fn own_cap(key: Option<&Grants>, role: Option<&Role>) -> Option<OwnCap> {
    let k = key.and_then(|g| g.max_concurrent).map(|limit| OwnCap { limit, whose: Whose::ApiKey });
    let r = role.and_then(|r| r.grants.max_concurrent).map(|limit| OwnCap { limit, whose: Whose::Role });
    match (k, r) {
        (Some(k), Some(r)) => Some(if r.limit < k.limit { r } else { k }),
        (k, None) => k,
        (None, r) => r,
    }
}

/// The pool a caller's permits are counted in: its key's, or (a signed-in
/// user) its own within its project. `None` for a caller that is neither.
pub fn holder(project: &ProjectId, caller: &Caller) -> Option<String> {
    match (&caller.user, &caller.api_key) {
        (Some(u), _) => Some(format!("{project}/u:{u}")),
        (None, Some(k)) => Some(format!("{project}/k:{k}")),
        (None, None) => None,
    }
}

/// A permit's lease: the effective `query_timeout` — the grant's (seconds),
/// narrowed by the server's — plus [`LEASE_MARGIN`].
pub fn lease(grant_secs: Option<u64>, server: Duration) -> Duration {
    query_timeout(grant_secs, server).saturating_add(LEASE_MARGIN)
}

/// The effective `query_timeout`: a key's or role's grant (whole seconds)
/// narrows the server's, never widens it.
pub fn query_timeout(grant_secs: Option<u64>, server: Duration) -> Duration {
    grant_secs.map_or(server, |s| Duration::from_secs(s).min(server))
}

/// The installation's cap on all permits together: `configured`, or a
/// quarter of the PostgreSQL pool, at least one.
pub fn installation_cap(pool_size: u32, configured: Option<u32>) -> u32 {
    configured.unwrap_or(pool_size / 4).max(1)
}

/// `at` plus a lease, saturating at the largest instant.
pub fn lease_end(at: DateTime<Utc>, lease: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(lease).ok().and_then(|d| at.checked_add_signed(d)).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// A lease in whole milliseconds (what the stores keep), at least 1.
pub fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// One claim: a slot of `holder`'s pool (at most `cap` held) and one of
/// the installation's (at most `installation_cap`), both or neither.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitClaim {
    /// The new permit's id: new, never one claimed before (the caller
    /// makes it unique).
    pub id: PermitId,
    pub holder: String,
    pub cap: u32,
    pub installation_cap: u32,
    pub lease: Duration,
}

/// A permit held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permit {
    pub id: PermitId,
    pub holder: String,
    /// When its lease lapses (unless renewed or released before).
    pub expires_at: DateTime<Utc>,
    /// The fencing token: greater than that of every permit granted before
    /// it by the same store (while the store keeps its state), so what a
    /// holder guards can refuse a holder whose lease lapsed and whose slot
    /// went to a later one.
    pub token: u64,
}

/// Which pool was full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// The caller's own (its key's, role's or user's cap).
    Caller,
    /// The installation's.
    Installation,
}

/// What a claim got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    Granted(Permit),
    /// Nothing was taken.
    Full(Pool),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    holder: String,
    expires_at: DateTime<Utc>,
    lease: Duration,
    token: u64,
}

/// The reference model of a permit store: the permits held, reaped of
/// lapsed ones before every operation.
#[derive(Debug, Clone, Default)]
pub struct PermitModel {
    live: BTreeMap<PermitId, Held>,
    last_token: u64,
}

impl PermitModel {
    pub fn new() -> Self {
        Self::default()
    }

    fn reap(&mut self, at: DateTime<Utc>) {
        self.live.retain(|_, h| h.expires_at > at);
    }

    fn permit(id: &PermitId, h: &Held) -> Permit {
        Permit { id: id.clone(), holder: h.holder.clone(), expires_at: h.expires_at, token: h.token }
    }

    /// Reaps, then takes a slot of the caller's pool and one of the
    /// installation's, or neither.
    pub fn claim(&mut self, c: &PermitClaim, at: DateTime<Utc>) -> Claimed {
        self.reap(at);
        let mine = self.live.values().filter(|h| h.holder == c.holder).count();
        if mine >= c.cap as usize {
            return Claimed::Full(Pool::Caller);
        }
        if self.live.len() >= c.installation_cap as usize {
            return Claimed::Full(Pool::Installation);
        }
        self.last_token = self.last_token.saturating_add(1);
        let h = Held {
            holder: c.holder.clone(),
            expires_at: lease_end(at, c.lease),
            lease: c.lease,
            token: self.last_token,
        };
        let p = Self::permit(&c.id, &h);
        self.live.insert(c.id.clone(), h);
        Claimed::Granted(p)
    }

    /// Extends a live permit's lease to `at` + its lease; `None` if it is
    /// not held (released, lapsed, or never granted).
    pub fn renew(&mut self, id: &PermitId, at: DateTime<Utc>) -> Option<Permit> {
        self.reap(at);
        let h = self.live.get_mut(id)?;
        h.expires_at = lease_end(at, h.lease);
        Some(Self::permit(id, h))
    }

    /// Frees a permit's slots; false if it was not held.
    pub fn release(&mut self, id: &PermitId, at: DateTime<Utc>) -> bool {
        self.reap(at);
        self.live.remove(id).is_some()
    }

    /// How many permits `holder` holds at `at` (all of them with [`INSTALLATION`]).
    pub fn held(&self, holder: &str, at: DateTime<Utc>) -> usize {
        self.live.values().filter(|h| h.expires_at > at && (holder == INSTALLATION || h.holder == holder)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_narrows_the_query_timeout_and_never_widens_it() {
        let server = Duration::from_secs(30);
        assert_eq!(query_timeout(None, server), server);
        assert_eq!(query_timeout(Some(5), server), Duration::from_secs(5));
        assert_eq!(query_timeout(Some(60), server), server);
        assert_eq!(lease(Some(5), server), Duration::from_secs(35));
    }
    use crate::ids::{ApiKeyId, RoleId};

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_780_000_000 + s, 0).expect("time")
    }

    fn claim(id: &str, holder: &str, cap: u32, installation_cap: u32) -> PermitClaim {
        PermitClaim {
            id: PermitId::parse(id).expect("id"),
            holder: holder.into(),
            cap,
            installation_cap,
            lease: Duration::from_secs(31),
        }
    }

    fn role(max: Option<u32>) -> Role {
        Role {
            id: RoleId::parse("role_partner").expect("id"),
            project_id: ProjectId::parse("p1").expect("id"),
            name: "partner".into(),
            grants: Grants { max_concurrent: max, ..Grants::default() },
            quota: None,
            exempt: false,
            created_at: t(0),
        }
    }

    #[test]
    fn the_narrowest_cap_is_reported_as_its_owners() {
        let key = |m| Grants { max_concurrent: m, ..Grants::default() };
        let cap = |limit, whose| Some(OwnCap { limit, whose });
        assert_eq!(own_cap(Some(&key(Some(5))), None), cap(5, Whose::ApiKey));
        assert_eq!(own_cap(Some(&key(Some(5))), Some(&role(Some(3)))), cap(3, Whose::Role));
        assert_eq!(own_cap(Some(&key(Some(2))), Some(&role(Some(3)))), cap(2, Whose::ApiKey));
        assert_eq!(own_cap(Some(&key(Some(3))), Some(&role(Some(3)))), cap(3, Whose::ApiKey), "a tie is the key's");
        assert_eq!(own_cap(Some(&key(None)), Some(&role(Some(4)))), cap(4, Whose::Role));
        assert_eq!(own_cap(None, Some(&role(Some(4)))), cap(4, Whose::Role), "a signed-in user's is its role's");
        assert_eq!(own_cap(Some(&key(None)), Some(&role(None))), None, "no max_concurrent: no permit");
        assert_eq!(own_cap(None, None), None);
    }

    #[test]
    fn a_signed_in_users_slots_are_its_own() {
        let p = ProjectId::parse("p1").expect("id");
        let alice = Caller { user: Some("user:alice".into()), ..Caller::default() };
        let bob = Caller { user: Some("user:bob".into()), ..Caller::default() };
        let key = Caller::key(&ApiKeyId::parse("key_1").expect("id"), None);
        assert_eq!(holder(&p, &alice).as_deref(), Some("p1/u:user:alice"));
        assert_ne!(holder(&p, &alice), holder(&p, &bob));
        assert_eq!(holder(&p, &key).as_deref(), Some("p1/k:key_1"));
        assert_eq!(holder(&p, &Caller::default()), None);
    }

    #[test]
    fn the_lease_is_the_effective_timeout_plus_thirty_seconds() {
        let server = Duration::from_secs(60);
        assert_eq!(lease(Some(5), server), Duration::from_secs(35));
        assert_eq!(lease(Some(600), server), Duration::from_secs(90), "a wider grant is narrowed by the server's");
        assert_eq!(lease(None, server), Duration::from_secs(90));
        assert_eq!(lease(Some(u64::MAX), Duration::MAX), Duration::MAX, "saturates");
        assert_eq!(lease_end(t(0), Duration::MAX), DateTime::<Utc>::MAX_UTC);
    }

    #[test]
    fn the_installation_cap_is_a_quarter_of_the_pool_at_least_one() {
        assert_eq!(installation_cap(16, None), 4);
        assert_eq!(installation_cap(3, None), 1);
        assert_eq!(installation_cap(16, Some(100)), 100);
        assert_eq!(installation_cap(16, Some(0)), 1);
    }

    #[test]
    fn reap_then_claim_up_to_each_cap() {
        let mut m = PermitModel::new();
        let Claimed::Granted(a) = m.claim(&claim("a", "p/k:1", 2, 3), t(0)) else { panic!("a") };
        assert_eq!(a.expires_at, t(31));
        let Claimed::Granted(b) = m.claim(&claim("b", "p/k:1", 2, 3), t(1)) else { panic!("b") };
        assert!(b.token > a.token, "fencing tokens increase");
        assert_eq!(m.claim(&claim("c", "p/k:1", 2, 3), t(2)), Claimed::Full(Pool::Caller));
        assert!(matches!(m.claim(&claim("d", "p/k:2", 2, 3), t(2)), Claimed::Granted(_)));
        assert_eq!(m.claim(&claim("e", "p/k:3", 2, 3), t(2)), Claimed::Full(Pool::Installation));
        // Not before the lease lapses; at it, the slot is free.
        assert_eq!(m.claim(&claim("c", "p/k:1", 2, 3), t(30)), Claimed::Full(Pool::Caller));
        let Claimed::Granted(c) = m.claim(&claim("c", "p/k:1", 2, 4), t(31)) else { panic!("a lapsed") };
        assert!(c.token > b.token);
        assert_eq!(m.renew(&a.id, t(31)), None, "a lapsed permit cannot be renewed");
        assert!(!m.release(&a.id, t(31)));
    }

    #[test]
    fn renew_extends_and_release_frees() {
        let mut m = PermitModel::new();
        let Claimed::Granted(a) = m.claim(&claim("a", "p/k:1", 1, 10), t(0)) else { panic!("a") };
        let r = m.renew(&a.id, t(30)).expect("live");
        assert_eq!((r.expires_at, r.token), (t(61), a.token));
        assert_eq!(m.claim(&claim("b", "p/k:1", 1, 10), t(60)), Claimed::Full(Pool::Caller));
        assert!(m.release(&a.id, t(60)));
        assert!(!m.release(&a.id, t(60)), "released once");
        assert!(matches!(m.claim(&claim("b", "p/k:1", 1, 10), t(60)), Claimed::Granted(_)));
        assert_eq!(m.held("p/k:1", t(60)), 1);
        assert_eq!(m.held(INSTALLATION, t(60)), 1);
    }
}
