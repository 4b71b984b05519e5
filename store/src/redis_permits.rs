//! # Permits in Redis
//!
//! [`RedisPermits`] implements [`meter::Permits`] with one Lua script per
//! operation (`src/lua/permit_*.lua`, which document their KEYS/ARGV), so
//! reap-then-claim is atomic for every gateway sharing the Redis: two
//! gateways never take the same slot. It shares its [`RedisView`]'s
//! connection and prefix (`RedisView::permits`).
//!
//! ## Layout
//!
//! With `P` the prefix, every key carries the hash tag `{permits}`, so one
//! script may touch every pool (also on Redis Cluster, including the
//! holder keys the scripts derive at run time):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `P{permits}:h:<holder>` | zset | a holder's permits: id → lease end (ms) |
//! | `P{permits}:all` | zset | every permit of the installation: id → lease end (ms) |
//! | `P{permits}:id` | hash | id → `<holder>\|<lease ms>\|<fencing token>` |
//! | `P{permits}:token` | string | the last fencing token given |
//!
//! A lapsed permit is one whose lease end is at or before the `at` of the
//! call (the caller's clock, as for the view). Every claim first reaps every
//! lapsed permit of the installation (from the installation's zset, its
//! holder's and the index), so nothing a dead holder left outlives its
//! lease by more than the next claim; a holder's zset empties itself away.
//!
//! The fencing token is an `INCR`: greater than every token given before,
//! as long as Redis keeps its data. A Redis that loses it (flushed,
//! restarted empty) starts the pools empty — every permit is freed, the
//! safe direction for a permit — and its tokens from 1 again.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{Claimed, Permit, PermitClaim, PermitId, Permits, Pool, PortError, PortResult};
use redis::Script;
use std::sync::Arc;
use tracing::Instrument;

use crate::redis_conn::RedisConn;
use crate::redis_view::classify;

struct Scripts {
    claim: Script,
    renew: Script,
    release: Script,
}

/// Permits in Redis; cheap to clone.
#[derive(Clone)]
pub struct RedisPermits {
    conn: RedisConn,
    /// `P{permits}:`
    base: Arc<str>,
    scripts: Arc<Scripts>,
}

impl std::fmt::Debug for RedisPermits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPermits").field("base", &self.base).finish_non_exhaustive()
    }
}

fn ms(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

fn from_ms(v: i64) -> PortResult<DateTime<Utc>> {
    DateTime::from_timestamp_millis(v).ok_or_else(|| PortError::Permanent(format!("redis permits: bad lease end {v}")))
}

fn token(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl RedisPermits {
    /// Over a view's connection; `prefix` is the view's (no `{` or `}`).
    pub(crate) fn new(conn: RedisConn, prefix: &str) -> RedisPermits {
        RedisPermits {
            conn,
            base: format!("{prefix}{{permits}}:").into(),
            scripts: Arc::new(Scripts {
                claim: Script::new(include_str!("lua/permit_claim.lua")),
                renew: Script::new(include_str!("lua/permit_renew.lua")),
                release: Script::new(include_str!("lua/permit_release.lua")),
            }),
        }
    }

    fn key(&self, what: &str) -> String {
        format!("{}{what}", self.base)
    }

    fn holders(&self) -> String {
        self.key("h:")
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        inv: &redis::ScriptInvocation<'_>,
    ) -> PortResult<T> {
        let mut conn = self.conn.clone();
        inv.invoke_async(&mut conn)
            .instrument(tracing::debug_span!("datastore", op))
            .await
            .map_err(|e| classify(op, &e))
    }
}

#[async_trait]
impl Permits for RedisPermits {
    async fn claim(&self, c: &PermitClaim, at: DateTime<Utc>) -> PortResult<Claimed> {
        let lease = meter::permit::lease_ms(c.lease);
        let mut inv = self.scripts.claim.prepare_invoke();
        inv.key(format!("{}{}", self.holders(), c.holder))
            .key(self.key("all"))
            .key(self.key("id"))
            .key(self.key("token"))
            .arg(ms(at))
            .arg(c.id.as_str())
            .arg(lease)
            .arg(c.cap)
            .arg(c.installation_cap)
            .arg(self.holders())
            .arg(&c.holder);
        let (granted, a, b): (i64, i64, i64) = self.run("permit_claim", &inv).await?;
        Ok(match (granted, a) {
            (1, _) => Claimed::Granted(Permit {
                id: c.id.clone(),
                holder: c.holder.clone(),
                expires_at: from_ms(b)?,
                token: token(a),
            }),
            (_, 0) => Claimed::Full(Pool::Caller),
            _ => Claimed::Full(Pool::Installation),
        })
    }

    async fn renew(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<Option<Permit>> {
        let mut inv = self.scripts.renew.prepare_invoke();
        inv.key(self.key("all")).key(self.key("id")).arg(ms(at)).arg(id.as_str()).arg(self.holders());
        let (renewed, tok, ends, holder): (i64, i64, i64, String) = self.run("permit_renew", &inv).await?;
        if renewed != 1 {
            return Ok(None);
        }
        Ok(Some(Permit { id: id.clone(), holder, expires_at: from_ms(ends)?, token: token(tok) }))
    }

    async fn release(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<bool> {
        let mut inv = self.scripts.release.prepare_invoke();
        inv.key(self.key("all")).key(self.key("id")).arg(ms(at)).arg(id.as_str()).arg(self.holders());
        let released: i64 = self.run("permit_release", &inv).await?;
        Ok(released == 1)
    }
}
