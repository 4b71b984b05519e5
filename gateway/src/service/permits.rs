//! Concurrency permits after the check that took them: renew, release, and
//! the release that settling a call's event with its permit does. (A
//! permit is taken by the check, with its reservation: see
//! [`admission`](super::admission).)
//!
//! A permit is named by its id alone: the id is unguessable and only the
//! gateway token reaches these operations. A permit that is not held any
//! more — released, or its lease lapsed (and then perhaps its slot taken by
//! another) — cannot be renewed: its holder must check again.

use meter::{Permit, PermitId};
use tracing::warn;

use super::{Error, Result};
use crate::state::AppState;

/// Extends a held permit's lease to now plus its lease.
pub async fn renew(s: &AppState, id: &PermitId) -> Result<Permit> {
    let permit = s.permits.renew(id, s.clock.now()).await?;
    permit.ok_or_else(|| Error::not_found("permit", id.as_str()))
}

/// Frees a held permit's slots.
pub async fn release(s: &AppState, id: &PermitId) -> Result<()> {
    if s.permits.release(id, s.clock.now()).await? {
        metrics::counter!("tollgate_permits_released_total", "by" => "delete").increment(1);
        Ok(())
    } else {
        Err(Error::not_found("permit", id.as_str()))
    }
}

/// Frees the permits named by settled events; returns how many were held.
/// A permit already gone (lapsed, or released before) is no error: the
/// call it guarded has ended either way. A permit store that cannot be
/// reached leaves them to lapse with their leases (logged, counted).
pub async fn release_settled(s: &AppState, ids: &[PermitId]) -> usize {
    let now = s.clock.now();
    let mut released = 0;
    for id in ids {
        match s.permits.release(id, now).await {
            Ok(true) => released += 1,
            Ok(false) => {}
            Err(e) => {
                warn!(error = %e, permit = %id, "permit of a settled call not released; it lapses with its lease");
                metrics::counter!("tollgate_permits_release_failed_total").increment(1);
            }
        }
    }
    metrics::counter!("tollgate_permits_released_total", "by" => "settle").increment(released as u64);
    released
}
