//! # Permits in PostgreSQL (ADR-0196 §2)
//!
//! [`PgPermits`] implements [`meter::Permits`] on the UNLOGGED table
//! `heavy_permit` (migration 0012): one row per slot, keyed by (holder,
//! slot), holding the permit in it and its lease end. A claim takes a slot
//! with one `INSERT … ON CONFLICT (holder, slot) DO UPDATE … WHERE
//! expired` over the free slots of `generate_series(1, cap)`, so two
//! gateways never take the same slot: the loser of a race on one slot waits
//! for the winner's row and then finds it live, takes nothing, and tries
//! again (with another slot, or finds the pool full). The holder's slot and
//! the installation's (holder `*`) are taken in one transaction, so a claim
//! takes both or neither.
//!
//! A lapsed permit (its lease end at or before `at`) is not deleted: its
//! row is the free slot the next claim overwrites. A release deletes its
//! rows; a renew moves their lease end.
//!
//! The fencing token comes from the sequence `heavy_permit_token`. The
//! table is UNLOGGED: a crash of PostgreSQL empties it, freeing every
//! permit, the safe direction for a permit.

use async_trait::async_trait;
use chrono::{DateTime, SubsecRound, Utc};
use meter::permit::INSTALLATION;
use meter::{Claimed, Permit, PermitClaim, PermitId, Permits, Pool, PortError, PortResult};
use sqlx::{PgPool, Postgres, Row};
use tracing::Instrument;

use crate::sql::error;

/// Most tries of a claim that lost races on its slots before it answers a
/// transient error (each lost race means another claim took a slot).
const MAX_ATTEMPTS: usize = 32;

/// Takes one free slot of a holder's pool: `free` is how many slots were
/// free to try (0: the pool is full), `token` the fencing token of the slot
/// taken (`NULL`: the race for it was lost, or nothing was free). `$5` is
/// the token to write (the holder's slot takes a new one; the
/// installation's slot takes the holder's).
const CLAIM: &str = "
WITH live AS (
    SELECT slot FROM heavy_permit WHERE holder = $1 AND expires_at > $2
), free AS (
    SELECT s FROM generate_series(1, $3::int) AS s
    WHERE (SELECT count(*) FROM live) < $3::int AND s NOT IN (SELECT slot FROM live)
), pick AS (
    SELECT s FROM free ORDER BY random() LIMIT 1
), claimed AS (
    INSERT INTO heavy_permit AS h (holder, slot, permit_id, token, lease_ms, expires_at)
    SELECT $1, s, $4, COALESCE($5::bigint, nextval('heavy_permit_token')), $6, $7 FROM pick
    ON CONFLICT (holder, slot) DO UPDATE
        SET permit_id = EXCLUDED.permit_id, token = EXCLUDED.token,
            lease_ms = EXCLUDED.lease_ms, expires_at = EXCLUDED.expires_at
        WHERE h.expires_at <= $2
    RETURNING h.token
)
SELECT (SELECT count(*) FROM free) AS free, (SELECT token FROM claimed) AS token";

/// Permits in PostgreSQL; cheap to clone (a pool handle).
#[derive(Debug, Clone)]
pub struct PgPermits {
    pool: PgPool,
}

/// What one slot claim found.
enum Slot {
    Taken(i64),
    Full,
    LostRace,
}

impl PgPermits {
    /// On the pool of the store (its migrations applied).
    pub fn new(pool: PgPool) -> PgPermits {
        PgPermits { pool }
    }

    async fn slot(
        tx: &mut sqlx::Transaction<'static, Postgres>,
        holder: &str,
        cap: u32,
        c: &PermitClaim,
        token: Option<i64>,
        at: DateTime<Utc>,
        ends: DateTime<Utc>,
    ) -> PortResult<Slot> {
        let cap = i32::try_from(cap).unwrap_or(i32::MAX);
        let row = sqlx::query(CLAIM)
            .bind(holder)
            .bind(at)
            .bind(cap)
            .bind(c.id.as_str())
            .bind(token)
            .bind(meter::permit::lease_ms(c.lease))
            .bind(ends)
            .fetch_one(&mut **tx)
            .await
            .map_err(error::<Postgres>)?;
        let free: i64 = row.try_get("free").map_err(error::<Postgres>)?;
        let token: Option<i64> = row.try_get("token").map_err(error::<Postgres>)?;
        Ok(match token {
            Some(t) => Slot::Taken(t),
            None if free == 0 => Slot::Full,
            None => Slot::LostRace,
        })
    }

    async fn try_claim(&self, c: &PermitClaim, at: DateTime<Utc>, ends: DateTime<Utc>) -> PortResult<Option<Claimed>> {
        let mut tx = self.pool.begin().await.map_err(error::<Postgres>)?;
        let token = match Self::slot(&mut tx, &c.holder, c.cap, c, None, at, ends).await? {
            Slot::Taken(t) => t,
            other => {
                tx.rollback().await.map_err(error::<Postgres>)?;
                return Ok(matches!(other, Slot::Full).then_some(Claimed::Full(Pool::Caller)));
            }
        };
        match Self::slot(&mut tx, INSTALLATION, c.installation_cap, c, Some(token), at, ends).await? {
            Slot::Taken(_) => {}
            other => {
                tx.rollback().await.map_err(error::<Postgres>)?;
                return Ok(matches!(other, Slot::Full).then_some(Claimed::Full(Pool::Installation)));
            }
        }
        tx.commit().await.map_err(error::<Postgres>)?;
        Ok(Some(Claimed::Granted(Permit {
            id: c.id.clone(),
            holder: c.holder.clone(),
            expires_at: ends,
            token: u64::try_from(token).unwrap_or(0),
        })))
    }
}

#[async_trait]
impl Permits for PgPermits {
    async fn claim(&self, c: &PermitClaim, at: DateTime<Utc>) -> PortResult<Claimed> {
        // Stored to the microsecond: answer what a renew reads back.
        let ends = meter::permit::lease_end(at, c.lease).trunc_subsecs(6);
        let span = tracing::debug_span!("datastore", op = "permit_claim");
        async {
            for _ in 0..MAX_ATTEMPTS {
                if let Some(claimed) = self.try_claim(c, at, ends).await? {
                    return Ok(claimed);
                }
            }
            Err(PortError::Transient(format!("permit claim lost {MAX_ATTEMPTS} races in a row; retry")))
        }
        .instrument(span)
        .await
    }

    async fn renew(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<Option<Permit>> {
        let rows = sqlx::query(
            "UPDATE heavy_permit SET expires_at = $2 + lease_ms::float8 * interval '1 millisecond'
             WHERE permit_id = $1 AND expires_at > $2
             RETURNING holder, token, expires_at",
        )
        .bind(id.as_str())
        .bind(at)
        .fetch_all(&self.pool)
        .instrument(tracing::debug_span!("datastore", op = "permit_renew"))
        .await
        .map_err(error::<Postgres>)?;
        for row in rows {
            let holder: String = row.try_get("holder").map_err(error::<Postgres>)?;
            if holder == INSTALLATION {
                continue;
            }
            let token: i64 = row.try_get("token").map_err(error::<Postgres>)?;
            let expires_at: DateTime<Utc> = row.try_get("expires_at").map_err(error::<Postgres>)?;
            return Ok(Some(Permit { id: id.clone(), holder, expires_at, token: u64::try_from(token).unwrap_or(0) }));
        }
        Ok(None)
    }

    async fn release(&self, id: &PermitId, at: DateTime<Utc>) -> PortResult<bool> {
        let live: Option<bool> = sqlx::query_scalar(
            "WITH gone AS (DELETE FROM heavy_permit WHERE permit_id = $1 RETURNING expires_at)
             SELECT bool_or(expires_at > $2) FROM gone",
        )
        .bind(id.as_str())
        .bind(at)
        .fetch_one(&self.pool)
        .instrument(tracing::debug_span!("datastore", op = "permit_release"))
        .await
        .map_err(error::<Postgres>)?;
        Ok(live.unwrap_or(false))
    }
}
