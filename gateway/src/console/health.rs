//! The console's pipeline health page: the numbers `/metrics` serves, read
//! from the same rendering ([`crate::telemetry::render`]) and grouped for a
//! person — the projector's fold and lag, dead letters by reason, the
//! view's reseeds and outages, the log's unacknowledged and queued
//! publishes — and the projector's folded position per partition, from the
//! store, with how far the log's end is past it (the log's ends read now
//! when this process reads its log back, else a projector of this process's
//! sampled gauge). What another process records (a projector running apart from this
//! gateway) is on that process's `/metrics`, not here; the page says so.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};

use super::session::Session;
use super::view::page;
use super::{failure, html};
use crate::service;
use crate::state::AppState;

/// One sample of the Prometheus text: its metric name, labels as written, and value as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub name: String,
    pub labels: String,
    pub value: String,
}

/// The samples of a Prometheus text rendering (comments skipped).
pub fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}').unwrap_or(rest)),
                None => (series, ""),
            };
            Some(Sample { name: name.to_owned(), labels: labels.to_owned(), value: value.to_owned() })
        })
        .collect()
}

/// The sections of the page: a title and the metric names it shows.
const SECTIONS: [(&str, &str, &[&str]); 4] = [
    (
        "projector",
        "Projector",
        &[
            "tollgate_projector_events_total",
            "tollgate_projector_partitions",
            "tollgate_projector_store_refusals_total",
            "tollgate_view_update_failures_total",
            "tollgate_view_backlog_events",
        ],
    ),
    (
        "dlq",
        "Dead letters",
        &[
            "tollgate_dead_letters_total",
            "tollgate_dead_letters_published_total",
            "tollgate_dead_letter_publish_failures_total",
        ],
    ),
    (
        "view",
        "View",
        &[
            "tollgate_view_reseeds_total",
            "tollgate_view_reseed_tail_events_total",
            "tollgate_view_stale_forgotten_total",
            "tollgate_view_unavailable_total",
            "tollgate_config_stale_total",
        ],
    ),
    (
        "log",
        "Log outages",
        &[
            "tollgate_events_unacknowledged_total",
            "tollgate_request_events_unacknowledged_total",
            "tollgate_publish_queue_depth",
            "tollgate_publish_failures_total",
            "tollgate_publish_queue_full_total",
            "tollgate_publish_dropped_total",
        ],
    ),
];

/// A label's value in a sample's labels as written (`a="1",b="2"`).
pub fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\"")?.strip_suffix('"'))
}

/// The sampled lag of each partition the projector `consumer` of this
/// process holds, from `tollgate_projector_partition_lag_offsets`.
pub fn partition_lag(all: &[Sample], consumer: &str) -> BTreeMap<i32, String> {
    all.iter()
        .filter(|s| s.name == "tollgate_projector_partition_lag_offsets")
        .filter(|s| label(&s.labels, "consumer") == Some(consumer))
        .filter_map(|s| Some((label(&s.labels, "partition")?.parse().ok()?, s.value.clone())))
        .collect()
}

/// The projector's lag histogram: how many batches, and the bucket bound
/// under which half and 99 % of them fell.
#[derive(Debug, Clone, PartialEq)]
pub struct Lag {
    pub count: u64,
    pub p50: Option<String>,
    pub p99: Option<String>,
}

/// The lag histogram's summary, from its buckets.
pub fn lag(all: &[Sample]) -> Option<Lag> {
    let count: u64 = all.iter().find(|s| s.name == "tollgate_projector_lag_seconds_count")?.value.parse().ok()?;
    let buckets: Vec<(String, u64)> = all
        .iter()
        .filter(|s| s.name == "tollgate_projector_lag_seconds_bucket")
        .filter_map(|s| {
            let le = s.labels.split_once("le=\"")?.1.split_once('"')?.0.to_owned();
            Some((le, s.value.parse().ok()?))
        })
        .collect();
    // The first bound whose cumulative count reaches the share (of 100, rounded up).
    let bound = |share: u64| {
        let need = (count * share).div_ceil(100);
        buckets.iter().find(|(_, n)| *n >= need).map(|(le, _)| le.clone())
    };
    Some(Lag { count, p50: bound(50).filter(|_| count > 0), p99: bound(99).filter(|_| count > 0) })
}

/// How long the page waits for the log to say where it ends.
const ENDS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) async fn health_page(session: Session, State(s): State<AppState>) -> Response {
    let text = crate::telemetry::render();
    let all = samples(&text);
    let x = &s.settings.exports;
    let offsets = match s.stores.ledger.offsets(&x.consumer, &x.topic).await {
        Ok(offsets) => offsets,
        Err(e) => return failure(service::Error::from(e)),
    };
    // How far the fold is behind: the log's ends now against the stored
    // offsets, when this process reads its log back; else what a projector
    // of this process last sampled.
    let behind = match s.view.log_ends(ENDS_WAIT).await {
        Some(ends) => behind_ends(&ends, &offsets),
        None => partition_lag(&all, &x.consumer),
    };
    html(StatusCode::OK, view(&session.csrf, &all, &offsets, &behind, &x.consumer, &x.topic))
}

/// Per partition, how far the log's end is past the stored offset.
pub fn behind_ends(ends: &BTreeMap<i32, i64>, offsets: &BTreeMap<i32, i64>) -> BTreeMap<i32, String> {
    ends.iter()
        .map(|(p, end)| (*p, end.saturating_sub(offsets.get(p).copied().unwrap_or(0)).max(0).to_string()))
        .collect()
}

fn view(
    csrf: &str,
    all: &[Sample],
    offsets: &BTreeMap<i32, i64>,
    behind: &BTreeMap<i32, String>,
    consumer: &str,
    topic: &str,
) -> Markup {
    let lag = lag(all);
    page(
        "Pipeline health",
        Some(csrf),
        &[],
        html! {
            h1 { "Pipeline health" }
            p { "The numbers " a href="/metrics" { "/metrics" } " serves for this process, since it started. "
                "A projector or notifier running in another process reports on its own " code { "/metrics" } "." }
            section #partitions aria-labelledby="partitions-title" {
                h2 #partitions-title { "Position and lag per partition" }
                @if offsets.is_empty() { p { "The projector " code { (consumer) } " has folded nothing of " code { (topic) } " yet." } } @else {
                    table {
                        caption { "The next record of " code { (topic) } " the projector " code { (consumer) } " will fold, and how far the log's end is past it" }
                        thead { tr { th scope="col" { "Partition" } th scope="col" class="num" { "Next offset" }
                            th scope="col" class="num" { "Behind the end (offsets)" } } }
                        tbody { @for (p, o) in offsets { tr data-partition=(p) { th scope="row" { (p) } td.num { (o) }
                            td.num.lag { @match behind.get(p) { Some(v) => (v), None => "—" } } } } }
                    }
                    @if behind.is_empty() { p.note { "The log did not say where it ends, and no projector in this process "
                        "samples the lag; each projector reports " code { "tollgate_projector_partition_lag_offsets" }
                        " on its own " code { "/metrics" } "." } }
                }
            }
            section #lag aria-labelledby="lag-title" {
                h2 #lag-title { "Projector lag" }
                @match &lag {
                    Some(l) if l.count > 0 => p #lag-summary data-batches=(l.count) {
                        "Receipt to fold, oldest fact of each batch, over " (l.count) " batches: half within "
                        (l.p50.as_deref().unwrap_or("?")) " s, 99 % within " (l.p99.as_deref().unwrap_or("?")) " s."
                    },
                    _ => p #lag-summary { "No batch folded by this process." },
                }
            }
            @for (id, title, names) in SECTIONS {
                section id=(id) aria-labelledby=(format!("{id}-title")) {
                    h2 id=(format!("{id}-title")) { (title) }
                    @let rows: Vec<&Sample> = all.iter().filter(|s| names.contains(&s.name.as_str())).collect();
                    @if rows.is_empty() { p { "Nothing recorded." } } @else {
                        table {
                            thead { tr { th scope="col" { "Metric" } th scope="col" { "Labels" } th scope="col" class="num" { "Value" } } }
                            tbody { @for r in rows {
                                tr data-metric=(r.name) data-labels=(r.labels) {
                                    th scope="row" { code { (r.name) } } td { code { (r.labels) } } td.num { (r.value) }
                                }
                            } }
                        }
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prometheus_text_is_read_into_samples_and_the_lag_summarised() {
        let text = "# TYPE tollgate_dead_letters_total counter\n\
                    tollgate_dead_letters_total{reason=\"malformed\"} 3\n\
                    tollgate_view_reseeds_total 2\n\
                    tollgate_projector_lag_seconds_bucket{le=\"0.1\"} 50\n\
                    tollgate_projector_lag_seconds_bucket{le=\"0.5\"} 98\n\
                    tollgate_projector_lag_seconds_bucket{le=\"1\"} 100\n\
                    tollgate_projector_lag_seconds_bucket{le=\"+Inf\"} 100\n\
                    tollgate_projector_lag_seconds_sum 12.5\n\
                    tollgate_projector_lag_seconds_count 100\n";
        let all = samples(text);
        assert_eq!(
            all[0],
            Sample {
                name: "tollgate_dead_letters_total".into(),
                labels: "reason=\"malformed\"".into(),
                value: "3".into()
            }
        );
        assert_eq!(
            all[1],
            Sample { name: "tollgate_view_reseeds_total".into(), labels: String::new(), value: "2".into() }
        );
        assert_eq!(lag(&all), Some(Lag { count: 100, p50: Some("0.1".into()), p99: Some("1".into()) }));
        assert_eq!(lag(&samples("")), None);
        let lags = samples(
            "tollgate_projector_partition_lag_offsets{consumer=\"projector\",partition=\"0\"} 12\n\
             tollgate_projector_partition_lag_offsets{consumer=\"projector\",partition=\"3\"} 0\n\
             tollgate_projector_partition_lag_offsets{consumer=\"replay-7\",partition=\"0\"} 99\n",
        );
        assert_eq!(partition_lag(&lags, "projector"), BTreeMap::from([(0, "12".to_owned()), (3, "0".to_owned())]));
        assert_eq!(label("consumer=\"a\",partition=\"10\"", "partition"), Some("10"));
        let ends = BTreeMap::from([(0, 10), (1, 4), (2, 5)]);
        let offsets = BTreeMap::from([(0, 7), (1, 4)]);
        assert_eq!(
            behind_ends(&ends, &offsets),
            BTreeMap::from([(0, "3".to_owned()), (1, "0".to_owned()), (2, "5".to_owned())]),
            "a partition never folded is behind by its whole length"
        );
    }
}
