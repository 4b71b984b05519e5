//! Recording: what calls used, onto the view and the log.
//!
//! Facts are settled into the view *before* they are published, so the
//! projector's fold always finds the pending delta it must drop, and they are
//! acknowledged only after the broker acknowledged every one of them; a
//! failed publish takes the settlement back and acknowledges nothing.
//! [`accept`] is `/v1/events` (facts a gateway reports, checked against the
//! clock and the store first); [`record`] is what both it and the tower
//! Layer run.

use std::collections::{BTreeMap, HashSet};

use meter::{EventId, EventKind, ProjectId, Settlement, UnpricedRow, UsageFact, View};
use tracing::warn;

use super::{Error, Result};
use crate::state::AppState;

/// Most events one `/v1/events` may carry.
pub const MAX_EVENTS: usize = 5000;

/// What `/v1/events` accepted: the events recorded, and those left out as
/// repeats of an earlier event of the same request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub accepted: usize,
    pub duplicates: usize,
}

/// Records facts a gateway reported (`/v1/events`). Each is checked before
/// anything is written: its event time within the dedup horizon and at
/// most 5 minutes ahead, its project existing, its key (if it names one)
/// belonging to that project; a refusal names the event (`events[3].…`)
/// and writes nothing. The same id twice in one request counts once.
/// Every fact is stamped with this instance's name and its receipt time
/// (`received_at`: what its lateness is judged by, on the log and in a replay).
pub async fn accept(s: &AppState, mut facts: Vec<UsageFact>) -> Result<Accepted> {
    let now = s.clock.now();
    for (i, f) in facts.iter_mut().enumerate() {
        let p = format!("events[{i}].");
        meter::usage::check_fact_time(f.occurred_at, now, s.settings.horizon).map_err(|e| e.under(&p))?;
        if s.project_config(&f.project_id).await?.is_none() {
            return Err(Error::invalid(format!("{p}project_id"), format!("project {} does not exist", f.project_id)));
        }
        if let Some(kid) = &f.api_key_id
            && s.key_by_id(kid).await?.is_none_or(|key| key.project_id != f.project_id)
        {
            return Err(Error::invalid(
                format!("{p}api_key_id"),
                format!("no api key {kid} in project {}", f.project_id),
            ));
        }
        f.gateway.clone_from(&s.settings.instance);
        f.received_at = Some(now);
    }
    let total = facts.len();
    let mut seen = HashSet::with_capacity(total);
    facts.retain(|f| seen.insert((f.project_id.clone(), f.id.clone())));
    record(s, &facts).await?;
    metrics::counter!("tollgate_events_accepted_total").increment(facts.len() as u64);
    Ok(Accepted { accepted: facts.len(), duplicates: total - facts.len() })
}

/// Settles facts into the view, then publishes them; returns once the log
/// acknowledged every one (or takes the settlement back and fails with
/// [`Error::LogUnavailable`]).
pub async fn record(s: &AppState, facts: &[UsageFact]) -> Result<()> {
    let now = s.clock.now();
    let book =
        if facts.iter().any(|f| f.kind == EventKind::Tokens) { s.price_book().await? } else { Default::default() };
    // Settle into the view first, per project, so a fold never precedes it.
    let mut by_project: BTreeMap<ProjectId, Vec<Settlement>> = BTreeMap::new();
    let mut unpriced: BTreeMap<ProjectId, Vec<UnpricedRow>> = BTreeMap::new();
    for f in facts {
        let Some(cfg) = s.project_config(&f.project_id).await? else {
            return Err(Error::invalid("project_id", format!("project {} does not exist", f.project_id)));
        };
        let counters = meter::usage::counters_for(f, cfg.project.timezone, &book);
        if f.kind == EventKind::Tokens {
            let rows = meter::usage::priced(f, &book).unpriced_rows;
            if !rows.is_empty() {
                let out = unpriced.entry(f.project_id.clone()).or_default();
                // A refusal and an exception read them on a quota's counter;
                // the fold records them on every counter.
                for (c, _) in counters.iter().filter(|(c, _)| cfg.watched.covers(&c.key)) {
                    out.extend(rows.iter().map(|k| UnpricedRow { counter: c.clone(), key: k.clone() }));
                }
            }
        }
        // Only where a check can read it; the fold brings every counter's
        // durable total (meter::Watched says why).
        let deltas = counters
            .into_iter()
            .filter(|(c, _)| c.resets_at.is_none_or(|r| r > now) && cfg.watched.covers(&c.key))
            .collect();
        by_project.entry(f.project_id.clone()).or_default().push(Settlement {
            event: f.id.clone(),
            reservation: f.reservation_id.clone(),
            deltas,
        });
    }
    // The unpriced rows go to the store before the events are acknowledged,
    // so a refusal over a blackout can name them at once.
    for (project, rows) in &unpriced {
        s.stores.prices.record_unpriced(project, rows).await?;
    }
    for (project, settlements) in &by_project {
        if let Err(e) = s.view.settle(project, settlements, now).await {
            // The log is the truth: the view catches up when the projector folds.
            warn!(error = %e, %project, "settle into view failed");
            metrics::counter!("tollgate_view_unavailable_total", "policy" => "settle").increment(1);
        }
    }
    if let Err(e) = s.log.publish(facts).await {
        warn!(error = %e, "publishing events failed; nothing acknowledged");
        for (project, settlements) in &by_project {
            let ids: Vec<EventId> = settlements.iter().map(|x| x.event.clone()).collect();
            let _ = s.view.unsettle(project, &ids).await;
        }
        return Err(Error::LogUnavailable);
    }
    Ok(())
}
