//! `/metrics`: every counter and histogram the process records, in the
//! Prometheus text format.
//!
//! Why here: the gateway, the projector and `tollgate dev` all record into
//! the `metrics` facade; this module installs the one process-wide recorder
//! (the first call wins, later calls get the same handle) and renders it.
//! Durations (`*_seconds`) are true Prometheus histograms with buckets from
//! 100 µs to 10 s, so p50/p99 can be computed across instances.
//!
//! What is recorded (names are `tollgate_<what>_total` or `_seconds`):
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `tollgate_check_seconds` | | latency of a check (HTTP or Layer), from the caller named to the verdict |
//! | `tollgate_checks_total` | `verdict` = admitted, refused, degraded, exempt, unavailable, error | checks by outcome |
//! | `tollgate_check_refusals_total` | `metric` | refused checks by the metric that refused them |
//! | `tollgate_exempt_checks_total` | | checks by exempt callers (admins, exempt roles, break-glass) |
//! | `tollgate_monitor_breaches_total` | | monitor-mode quotas a check found breached (admitted anyway) |
//! | `tollgate_view_unavailable_total` | `policy` = allow, deny, settle | decisions taken while the view was unreachable |
//! | `tollgate_view_reseeds_total` | | projects re-seeded into the view (durable totals + log tail) |
//! | `tollgate_view_reseed_tail_events_total` | | facts of the log tail those reseeds read |
//! | `tollgate_view_stale_forgotten_total` | | projects found under another Redis server's marker (a restored snapshot) and forgotten before their reseed |
//! | `tollgate_view_update_failures_total`, `tollgate_view_backlog_events`, `tollgate_view_backlog_dropped_total` | | the projector's view updates that failed, the folded events whose pending deltas still wait to be dropped, and those given up (backlog full) |
//! | `tollgate_config_stale_total` | | lookups answered from the configuration cache while the store was down |
//! | `tollgate_events_accepted_total` | | events acknowledged on `/v1/events` |
//! | `tollgate_events_unacknowledged_total` | | settles the log did not acknowledge in time (kept queued) |
//! | `tollgate_request_events_unacknowledged_total` | | request events the log's queue could not take (full: lost from the log) |
//! | `tollgate_unpriced_rows_deferred_total` | | unpriced rows left to the fold because the store was down |
//! | `tollgate_publish_queue_depth` | `log` = kafka, sqlite | records awaiting the log (gauge) |
//! | `tollgate_publish_failures_total` | `log` | records whose publish attempt failed and were queued again |
//! | `tollgate_publish_queue_full_total` | `log` | publishes refused because the queue was full |
//! | `tollgate_publish_dropped_total` | `log` | records the log refused for good |
//! | `tollgate_layer_record_failures_total`, `tollgate_layer_bad_rows_total` | | the tower Layer's settles that failed, rows counts it could not read |
//! | `tollgate_projector_events_total` | `result` = folded, duplicate, dead_lettered | what the fold did (its rate is the fold rate) |
//! | `tollgate_projector_lag_seconds` | | receipt-to-fold time of the oldest fact of each batch |
//! | `tollgate_projector_partition_lag_offsets` | `consumer`, `partition` | how far the log's end is past the projector's position, per partition it holds, sampled every 5 s (records on Kafka; an upper bound on the embedded log, whose topics share one offset sequence) |
//! | `tollgate_projector_store_refusals_total` | | batches the store refused for good (then bisected) |
//! | `tollgate_view_update_failures_total` | | view updates after a fold that failed |
//! | `tollgate_dead_letters_total` | `reason` = malformed, invalid, out_of_range, store | dead letters by cause |
//! | `tollgate_dead_letters_published_total`, `tollgate_dead_letter_publish_failures_total` | | the DLQ outbox's publishes |

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Bucket bounds of every `*_seconds` histogram.
const SECONDS_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the process's Prometheus recorder, once; `None` if another
/// recorder was installed first (then `/metrics` answers what it can: nothing).
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .ok()?;
            let handle = builder.install_recorder().ok()?;
            // Histograms are drained into their buckets by the upkeep; run it
            // off the request path, if there is a runtime to run it on.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let h = handle.clone();
                rt.spawn(async move {
                    loop {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        h.run_upkeep();
                    }
                });
            }
            Some(handle)
        })
        .as_ref()
}

/// Everything recorded so far, in the Prometheus text format.
pub fn render() -> String {
    install().map(PrometheusHandle::render).unwrap_or_default()
}
