//! Recording: what calls used, onto the view and the log.
//!
//! Facts are settled into the view *before* they are published, so the
//! projector's fold always finds the pending delta it must drop, and they are
//! acknowledged only after the broker acknowledged every one of them.
//!
//! **A failed publish never gives a slot back** (DESIGN §10). The settle
//! already replaced the call's reservation with its real usage (a `calls`
//! slot is now a pending call); if the log does not acknowledge the facts
//! within the publish timeout (or is known to be down), that usage stays in
//! the view — the safe direction — and the facts stay in the log's retry
//! queue, published when the log is back; the caller gets
//! [`Error::LogUnavailable`] (503 `LOG_UNAVAILABLE`) and may send the same
//! events again (the view adds an event id once, the queue holds it once,
//! the fold counts it once). So admitted ≤ limit holds through an outage of
//! any length. When the queue is full the facts are not queued: the usage
//! still stays in the view and the client must retry. A fact that never
//! reaches the log (the process died with its queue, or the client gave up
//! on a full queue) leaves its pending delta in the view until the
//! counter's window ends: it over-counts, never under-counts.
//!
//! While PostgreSQL is down, recording goes on from the configuration the
//! state's cache holds; the unpriced rows it writes ahead of the events are
//! best effort (skipped while the store is down, bounded by
//! `store_timeout`): the fold writes them again from the log.
//!
//! [`accept`] is `/v1/events` (facts a gateway reports, checked against the
//! clock and the store first); [`record`] is what both it and the tower
//! Layer run.

use std::collections::{BTreeMap, HashMap, HashSet};

use meter::correction::{Counted, Target};
use meter::{EventId, EventKind, PortError, ProjectId, Settlement, UnpricedRow, UsageFact, View};
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
    /// Of the permits the events named, how many were held and are now
    /// released (`None`: the events named none).
    pub permits_released: Option<usize>,
}

/// Records facts a gateway reported (`/v1/events`). Each is checked before
/// anything is written: its event time within the dedup horizon and at
/// most 5 minutes ahead, its project existing, its key (if it names one)
/// belonging to that project; a refusal names the event (`events[3].…`)
/// and writes nothing. The same id twice in one request counts once.
/// Every fact is stamped with this instance's name and its receipt time
/// (`received_at`: what its lateness is judged by, on the log and in a replay).
///
/// A correction is checked against what the store holds of its original
/// and what the request did to it before ([`meter::correction`]): one of
/// an event already voided, of a request or storage event, past the
/// horizon, or with quantities of the wrong kind is refused naming the
/// field. One whose original the store does not hold (not folded yet, or
/// unknown) is accepted and judged by the fold, which dead-letters it if
/// the original is not folded before it.
pub async fn accept(s: &AppState, mut facts: Vec<UsageFact>) -> Result<Accepted> {
    let now = s.clock.now();
    // The originals the request's corrections name, as the request leaves them.
    let named: HashSet<(ProjectId, EventId)> =
        facts.iter().filter_map(|f| f.corrects.clone().map(|o| (f.project_id.clone(), o))).collect();
    let mut known: HashMap<(ProjectId, EventId), Target> = HashMap::new();
    for (i, f) in facts.iter_mut().enumerate() {
        let p = format!("events[{i}].");
        meter::usage::check_fact_time(f.occurred_at, now, s.settings.horizon).map_err(|e| e.under(&p))?;
        let Some(cfg) = s.project_config(&f.project_id).await? else {
            return Err(Error::invalid(format!("{p}project_id"), format!("project {} does not exist", f.project_id)));
        };
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
        let key = (f.project_id.clone(), f.id.clone());
        if let Some(original) = f.corrects.clone() {
            let target_key = (f.project_id.clone(), original);
            let target = match known.get(&target_key) {
                Some(t) => Some(t.clone()),
                None => stored_target(s, &target_key.0, &target_key.1).await,
            };
            if let Some(t) = target {
                let next = meter::correction::apply_correction(f, Some(&t), s.settings.horizon)
                    .map_err(|e| Error::Invalid(e.under(&p)))?;
                known.insert(target_key, Target::Counted(Box::new(next)));
            }
        } else if named.contains(&key) && !known.contains_key(&key) {
            known.insert(
                key,
                Counted::of(f, cfg.project.timezone).map_or(Target::Other, |c| Target::Counted(Box::new(c))),
            );
        }
    }
    let total = facts.len();
    let mut seen = HashSet::with_capacity(total);
    facts.retain(|f| seen.insert((f.project_id.clone(), f.id.clone())));
    record(s, &facts).await?;
    metrics::counter!("tollgate_events_accepted_total").increment(facts.len() as u64);
    Ok(Accepted { accepted: facts.len(), duplicates: total - facts.len(), permits_released: None })
}

/// `/v1/events`: [`accept`]s the facts, then releases the permits the
/// events named (`permit_id`): the calls they guarded have ended. They are
/// released once the facts are recorded — acknowledged, or kept in the view
/// while the log is unavailable (the client's retry finds them released) —
/// and never when the events were refused, which changes nothing.
pub async fn settle(s: &AppState, facts: Vec<UsageFact>, permits: &[meter::PermitId]) -> Result<Accepted> {
    let result = accept(s, facts).await;
    if permits.is_empty() {
        return result;
    }
    match result {
        Ok(a) => {
            let released = super::permits::release_settled(s, permits).await;
            Ok(Accepted { permits_released: Some(released), ..a })
        }
        Err(Error::LogUnavailable) => {
            super::permits::release_settled(s, permits).await;
            Err(Error::LogUnavailable)
        }
        Err(e) => Err(e),
    }
}

/// Settles facts into the view, then publishes them; returns once the log
/// acknowledged every one, or fails with [`Error::LogUnavailable`] keeping
/// the settlement (see the module doc).
pub async fn record(s: &AppState, facts: &[UsageFact]) -> Result<()> {
    settle_into_view(s, facts).await?;
    publish(s, facts).await
}

/// [`record`] for the calls of an admitted check whose request event the
/// caller still holds ([`admission::admit_holding`](super::admission::admit_holding)):
/// the facts are settled, then published in ONE publish behind the request
/// event, so the log has them in that order, contiguous, and a log that
/// commits per publish commits once. If the facts cannot be settled (their
/// project is gone, the store fails), the request event is still sent, on
/// its own.
pub async fn record_after(s: &AppState, request: super::admission::RequestEvent, facts: Vec<UsageFact>) -> Result<()> {
    settle_into_view(s, &facts).await?;
    let mut all = Vec::with_capacity(facts.len() + 1);
    all.push(request.take());
    all.extend(facts);
    let published = publish(s, &all).await;
    if published.is_err() {
        // Warned about with the call's: queued with it unless refused for good.
        metrics::counter!("tollgate_request_events_unacknowledged_total").increment(1);
    }
    published
}

/// The view's half of [`record`]: settles `facts`, per project (their
/// unpriced rows written ahead, best effort).
async fn settle_into_view(s: &AppState, facts: &[UsageFact]) -> Result<()> {
    let now = s.clock.now();
    let book =
        if facts.iter().any(|f| f.kind == EventKind::Tokens) { s.price_book().await? } else { Default::default() };
    // Settle into the view first, per project, so a fold never precedes it.
    // By project, the ids borrowed from the facts.
    let mut by_project: BTreeMap<&ProjectId, Vec<Settlement>> = BTreeMap::new();
    let mut unpriced: BTreeMap<ProjectId, Vec<UnpricedRow>> = BTreeMap::new();
    for f in facts {
        let Some(cfg) = s.project_config(&f.project_id).await? else {
            return Err(Error::invalid("project_id", format!("project {} does not exist", f.project_id)));
        };
        // Only where a check can read it; the fold brings every counter's
        // durable total (meter::Watched says why).
        let counters =
            meter::usage::counters_where(f, cfg.project.timezone, &book, |d, w| cfg.watched.covers_parts(d, w));
        if f.kind == EventKind::Tokens {
            let rows = meter::usage::priced(f, &book).unpriced_rows;
            if !rows.is_empty() {
                let out = unpriced.entry(f.project_id.clone()).or_default();
                // A refusal and an exception read them on a quota's counter;
                // the fold records them on every counter.
                for (c, _) in &counters {
                    out.extend(rows.iter().map(|k| UnpricedRow { counter: c.clone(), key: k.clone() }));
                }
            }
        }
        let deltas = counters.into_iter().filter(|(c, _)| c.resets_at.is_none_or(|r| r > now)).collect();
        let settlement = Settlement { event: f.id.clone(), reservation: f.reservation_id.clone(), deltas };
        by_project.entry(&f.project_id).or_default().push(settlement);
    }
    // The unpriced rows go to the store before the events are acknowledged,
    // so a refusal over a blackout can name them at once; but not at the
    // cost of the settle: the fold writes them again from the log.
    for (project, rows) in &unpriced {
        record_unpriced(s, project, rows).await;
    }
    for (project, settlements) in by_project {
        if let Err(e) = s.view.settle(project, &settlements, now).await {
            // The log is the truth: the view catches up when the projector folds.
            warn!(error = %e, %project, "settle into view failed");
            metrics::counter!("tollgate_view_unavailable_total", "policy" => "settle").increment(1);
        }
    }
    Ok(())
}

/// The log's half of [`record`]: publishes `facts` and waits for them.
async fn publish(s: &AppState, facts: &[UsageFact]) -> Result<()> {
    match s.log.publish(facts).await {
        Ok(()) => Ok(()),
        Err(e) => {
            // The settlement stays: the usage is real, and the facts are on
            // their way (or the client sends them again).
            warn!(error = %e, n = facts.len(), "events not acknowledged by the log; their usage stays in the view");
            metrics::counter!("tollgate_events_unacknowledged_total").increment(facts.len() as u64);
            match e {
                PortError::Transient(_) => Err(Error::LogUnavailable),
                e => Err(Error::Backend(e)),
            }
        }
    }
}

/// What the store holds of a correction's original, best effort: `None`
/// (the fold judges) while the store is down or slow, or when it holds
/// nothing.
async fn stored_target(s: &AppState, project: &ProjectId, event: &EventId) -> Option<Target> {
    if s.store_down() {
        return None;
    }
    match tokio::time::timeout(s.settings.store_timeout, s.stores.ledger.correction_target(project, event)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            warn!(error = %e, %project, %event, "correction's original not looked up; the fold judges it");
            None
        }
        Err(_) => {
            warn!(%project, %event, "correction's original not looked up in time; the fold judges it");
            None
        }
    }
}

/// Writes unpriced rows, best effort: skipped while the store is known to
/// be down, given up after `store_timeout`.
async fn record_unpriced(s: &AppState, project: &ProjectId, rows: &[UnpricedRow]) {
    let outcome = if s.store_down() {
        Err("the store is down".to_owned())
    } else {
        match tokio::time::timeout(s.settings.store_timeout, s.stores.prices.record_unpriced(project, rows)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {:?}", s.settings.store_timeout)),
        }
    };
    if let Err(why) = outcome {
        warn!(error = %why, %project, "unpriced rows not written ahead of the fold");
        metrics::counter!("tollgate_unpriced_rows_deferred_total").increment(rows.len() as u64);
    }
}

#[cfg(all(test, feature = "embedded"))]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use async_trait::async_trait;
    use meter::{EventId, Log, Metric, PortResult, Principal, UsageFact, WindowKind};
    use store::{MemoryView, SqliteStore};

    use super::*;
    use crate::service::admission;
    use crate::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
    use crate::service::quotas;
    use crate::state::{Settings, SystemClock};

    /// A log that acknowledges nothing while `down`, and keeps what it took.
    #[derive(Default)]
    struct SwitchLog {
        down: AtomicBool,
        taken: Mutex<Vec<UsageFact>>,
    }

    #[async_trait]
    impl Log for SwitchLog {
        async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
            if self.down.load(Ordering::SeqCst) {
                return Err(PortError::Transient("the log is down".into()));
            }
            self.taken.lock().expect("lock").extend_from_slice(facts);
            Ok(())
        }
    }

    /// A `calls` quota of 2 and a `requests` quota, the log down: each
    /// settle answers LOG_UNAVAILABLE and keeps its call counted, so the
    /// third check is refused; no request is taken back; a retry once the
    /// log is back is acknowledged and counts nothing again.
    #[tokio::test]
    async fn a_failed_publish_keeps_the_slot_and_the_request_count() {
        let dir = std::env::temp_dir().join(format!("tollgate-rec-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
        store.migrate().await.expect("migrate");
        let log = Arc::new(SwitchLog::default());
        let s = AppState::new(
            Arc::new(store),
            Arc::new(MemoryView::new()),
            log.clone(),
            Arc::new(SystemClock),
            Settings::new("adm", "gw"),
        );
        let by = Principal::new("admin", "test");
        let starter = Starter {
            project: NewProject { name: "p".into(), timezone: chrono_tz::Tz::UTC },
            key: NewApiKey { name: "k".into(), ..NewApiKey::default() },
            quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: 2 }),
        };
        let made = provisioning::provision(&s, starter, &by).await.expect("provision");
        let calls = made.quota.expect("calls quota").id;
        let requests = provisioning::key_quota(
            &s,
            &made.key,
            KeyQuota { metric: Metric::Requests, window: WindowKind::Day, limit: 100 },
            &by,
        )
        .await
        .expect("requests quota")
        .id;
        let count = |id| {
            let s = s.clone();
            async move { quotas::get(&s, &id).await.expect("quota").current_usage.expect("usage").count }
        };

        log.down.store(true, Ordering::SeqCst);
        let mut facts = Vec::new();
        for i in 0..2 {
            let a = admission::admit(&s, Arc::new(made.key.clone()), None, None, None).await.expect("admitted");
            let fact = UsageFact {
                api_key_id: Some(made.key.id.clone()),
                reservation_id: Some(a.reservation),
                ..UsageFact::new(
                    EventId::parse(format!("call-{i}")).expect("id"),
                    made.project.id.clone(),
                    EventKind::Call,
                    chrono::Utc::now(),
                )
            };
            let e = record(&s, std::slice::from_ref(&fact)).await.expect_err("the log is down");
            assert!(matches!(e, Error::LogUnavailable), "{e:?}");
            facts.push(fact);
        }
        assert_eq!(count(calls.clone()).await, 2, "both calls stay counted");
        let e =
            admission::admit(&s, Arc::new(made.key.clone()), None, None, None).await.expect_err("the limit is reached");
        assert!(matches!(e, Error::Refused(_)), "{e:?}");
        // Let the request events' background publishes fail.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert_eq!(count(requests.clone()).await, 3, "no request is taken back");

        log.down.store(false, Ordering::SeqCst);
        record(&s, &facts).await.expect("the client's retry is acknowledged");
        assert_eq!(count(calls).await, 2, "the retry counts nothing again");
        let taken: Vec<EventId> = log.taken.lock().expect("lock").iter().map(|f| f.id.clone()).collect();
        assert_eq!(taken, facts.iter().map(|f| f.id.clone()).collect::<Vec<_>>());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
