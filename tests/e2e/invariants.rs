//! The invariants every fault test asserts (DESIGN §10), read from the
//! system's own records rather than from what the test hoped happened:
//!
//! - **acknowledged ⊆ log**: every event a gateway answered 2xx for is on
//!   the usage topic;
//! - **log = folded ∪ DLQ**: every record on the usage topic was folded (its
//!   id is in the store's dedup set) or dead-lettered (the DLQ names its
//!   partition and offset);
//! - **no double count**: the durable totals equal a fold of the distinct
//!   events on the log done here, by `meter`'s rules, record by record;
//! - **admitted ≤ limit** is the test's own count of 200s against its quota.
//!
//! The log is read from offset 0 to each partition's high watermark with a
//! consumer of its own (assigned, never committing).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use meter::{Fold, PriceBook, UsageFact};
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Offset, TopicPartitionList};

use crate::harness::{Env, Mode};

/// One record read from a topic.
#[derive(Debug, Clone)]
pub struct Seen {
    pub partition: i32,
    pub offset: i64,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

impl Seen {
    /// The usage fact it carries, if it decodes.
    pub fn fact(&self) -> Option<UsageFact> {
        schemas::decode_usage(&self.payload).ok()
    }
}

/// Every record of `topic` from offset 0 to the high watermark each
/// partition had when this was called.
pub fn read_topic(brokers: &str, topic: &str) -> Vec<Seen> {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("invariants-{}", testkit::unique_id()))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).expect("topic metadata");
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    let mut ends = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        let (_, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks");
        if high > 0 {
            ends.insert(p, high);
            tpl.add_partition_offset(topic, p, Offset::Offset(0)).expect("assign");
        }
    }
    let mut out = Vec::new();
    if ends.is_empty() {
        return out;
    }
    consumer.assign(&tpl).expect("assign");
    let mut next: BTreeMap<i32, i64> = ends.keys().map(|p| (*p, 0)).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while next.iter().any(|(p, o)| *o < ends[p]) {
        assert!(std::time::Instant::now() < deadline, "reading {topic} to its end took over 60 s");
        let m = match consumer.poll(Duration::from_millis(200)) {
            None => continue,
            Some(Ok(m)) => m,
            // A consumer reports a broker it lost touch with (a shared
            // broker under the suite's load: AllBrokersDown) and reconnects
            // by itself; the deadline bounds how long that may take.
            Some(Err(e)) => {
                eprintln!("reading {topic}: {e}; polling on");
                continue;
            }
        };
        if m.offset() >= ends[&m.partition()] {
            continue;
        }
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                    .collect()
            })
            .unwrap_or_default();
        next.insert(m.partition(), m.offset() + 1);
        out.push(Seen {
            partition: m.partition(),
            offset: m.offset(),
            payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
            headers,
        });
    }
    out
}

/// The usage topic and the dead-letter topic, read to their ends.
pub struct LogAudit {
    pub usage: Vec<Seen>,
    pub dlq: Vec<Seen>,
}

impl LogAudit {
    pub async fn of(env: &Env) -> LogAudit {
        assert_eq!(env.mode, Mode::Distributed, "the log audit reads Kafka");
        let (brokers, prefix) = (env.brokers.clone(), env.topic_prefix.clone());
        tokio::task::spawn_blocking(move || LogAudit {
            usage: read_topic(&brokers, &format!("{prefix}usage")),
            dlq: read_topic(&brokers, &format!("{prefix}dlq")),
        })
        .await
        .expect("reading the log")
    }

    /// The distinct facts on the usage topic (the first record of an id wins,
    /// as in the fold), with where they are.
    pub fn facts(&self) -> Vec<(i32, i64, UsageFact)> {
        let mut seen = BTreeSet::new();
        self.usage
            .iter()
            .filter_map(|r| r.fact().map(|f| (r.partition, r.offset, f)))
            .filter(|(_, _, f)| seen.insert((f.project_id.clone(), f.id.clone())))
            .collect()
    }

    /// `(partition, offset)` of every usage record the DLQ holds, with its reason.
    pub fn dead_lettered(&self) -> HashMap<(i32, i64), String> {
        self.dlq
            .iter()
            .filter_map(|r| {
                let p = r.headers.get("tollgate-source-partition")?.parse().ok()?;
                let o = r.headers.get("tollgate-source-offset")?.parse().ok()?;
                Some(((p, o), r.headers.get("tollgate-reason").cloned().unwrap_or_default()))
            })
            .collect()
    }

    /// **acknowledged ⊆ log**: every id in `acked` is an event of `project` on the log.
    pub fn assert_acknowledged_on_log(&self, project: &str, acked: &[String]) {
        let on_log: BTreeSet<String> = self
            .usage
            .iter()
            .filter_map(Seen::fact)
            .filter(|f| f.project_id.as_str() == project)
            .map(|f| f.id.to_string())
            .collect();
        let missing: Vec<&String> = acked.iter().filter(|id| !on_log.contains(*id)).collect();
        assert!(
            missing.is_empty(),
            "{} acknowledged events are not on the log: {:?}",
            missing.len(),
            &missing[..missing.len().min(10)]
        );
    }

    /// **log = folded ∪ DLQ**: every usage record is folded (in the store's
    /// dedup set) or dead-lettered with a reason; a record in both is a bug too.
    pub async fn assert_accounted(&self, env: &Env) {
        let folded = folded_ids(env).await;
        let dead = self.dead_lettered();
        let mut lost = Vec::new();
        for r in &self.usage {
            let in_dlq = dead.contains_key(&(r.partition, r.offset));
            let in_fold = r.fact().is_some_and(|f| folded.contains(&(f.project_id.to_string(), f.id.to_string())));
            if !in_dlq && !in_fold {
                lost.push((r.partition, r.offset));
            }
        }
        assert!(
            lost.is_empty(),
            "{} records neither folded nor dead-lettered: {:?}",
            lost.len(),
            &lost[..lost.len().min(10)]
        );
        for (at, reason) in &dead {
            assert!(!reason.is_empty(), "dead letter {at:?} has no reason");
        }
    }

    /// **no double count**: the durable totals of `project` (every counter)
    /// equal a fold, done here, of its distinct, not dead-lettered events on
    /// the log. Prices are not applied (tests that price tokens compare cost
    /// their own way).
    pub async fn assert_folded_once(&self, env: &Env, project: &str, tz: chrono_tz::Tz) {
        let dead = self.dead_lettered();
        let mut fold = Fold::new();
        for (p, o, f) in self.facts() {
            if f.project_id.as_str() == project && !dead.contains_key(&(p, o)) {
                fold.apply(&f, tz, &PriceBook::default());
            }
        }
        let expected: BTreeMap<String, (u64, u64, u64)> = fold
            .totals()
            .filter(|(_, c, _)| c.resets_at.is_some())
            .map(|(_, c, t)| (c.key.encode(), (t.requests, t.calls, t.rows)))
            .filter(|(_, v)| *v != (0, 0, 0))
            .collect();
        let stored = stored_totals(env, project).await;
        assert_eq!(stored, expected, "durable totals of {project} differ from a fold of its log");
    }
}

/// `(project, event id)` of everything the store folded.
pub async fn folded_ids(env: &Env) -> BTreeSet<(String, String)> {
    let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect test database");
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT project_id, event_id FROM processed_events").fetch_all(&pool).await.expect("dedup set");
    pool.close().await;
    rows.into_iter().collect()
}

/// The durable (requests, calls, rows) of every flow counter of a project,
/// by `CounterKey::encode`, zero rows left out.
pub async fn stored_totals(env: &Env, project: &str) -> BTreeMap<String, (u64, u64, u64)> {
    let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect test database");
    let rows: Vec<(String, String, String, i64, i64, i64)> = sqlx::query_as(
        r#"SELECT dimension, window_kind, window_key, requests, calls, "rows" FROM usage_aggregates
           WHERE project_id = $1 AND resets_at IS NOT NULL"#,
    )
    .bind(project)
    .fetch_all(&pool)
    .await
    .expect("aggregates");
    pool.close().await;
    rows.into_iter()
        .map(|(d, k, w, r, c, n)| (format!("{d}|{k}|{w}"), (r as u64, c as u64, n as u64)))
        .filter(|(_, v)| *v != (0, 0, 0))
        .collect()
}
