//! The log on Kafka (any Kafka-protocol broker).
//!
//! [`KafkaLog`] publishes usage facts, Avro single-object encoded, keyed by
//! project so one project's events stay ordered in one partition, with an
//! idempotent producer and `acks=all`: `publish` returns only once every
//! record has a delivery report. [`KafkaReader`] reads by explicit partition
//! assignment from offsets the store keeps; Kafka's own committed offsets are
//! never used (`enable.auto.commit=false`), so the store's transaction is the
//! only place progress is recorded. Each record read carries its Kafka
//! timestamp (create or log-append time, whichever the topic keeps).
//!
//! Dead letters go to the `dlq` topic with the original key and bytes and
//! headers naming the reason and the source (topic, partition, offset). A
//! publisher that may have written one already (its earlier attempt failed
//! or was cut short) asks [`LogReader::dead_lettered_since`], which reads the
//! DLQ from a [mark](LogReader::dead_letter_mark) taken before that attempt
//! to its end, with a consumer of its own (assigned, never committing).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use meter::{DlqMark, Log, LogReader, LogRecord, PortError, PortResult, UsageFact};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use tracing::{Instrument, info_span};

/// Where the log is and what its topics are called.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// `host:port[,host:port…]`.
    pub brokers: String,
    /// Prepended to `usage`, `audit` and `dlq`.
    pub topic_prefix: String,
    /// Partitions of each topic when Tollgate creates it.
    pub partitions: i32,
    /// Replication factor when Tollgate creates a topic.
    pub replication: i32,
}

impl KafkaConfig {
    pub fn new(brokers: impl Into<String>, topic_prefix: impl Into<String>) -> Self {
        KafkaConfig { brokers: brokers.into(), topic_prefix: topic_prefix.into(), partitions: 3, replication: 1 }
    }
    pub fn usage_topic(&self) -> String {
        format!("{}usage", self.topic_prefix)
    }
    pub fn audit_topic(&self) -> String {
        format!("{}audit", self.topic_prefix)
    }
    pub fn dlq_topic(&self) -> String {
        format!("{}dlq", self.topic_prefix)
    }

    fn client(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("broker.address.family", "v4")
            .set("socket.keepalive.enable", "true");
        c
    }

    /// Creates the usage, audit and dead-letter topics if they are missing.
    pub async fn ensure_topics(&self) -> PortResult<()> {
        let admin: AdminClient<DefaultClientContext> = self.client().create().map_err(kafka_err)?;
        let names = [self.usage_topic(), self.audit_topic(), self.dlq_topic()];
        let topics: Vec<NewTopic<'_>> = names
            .iter()
            .map(|n| NewTopic::new(n, self.partitions, TopicReplication::Fixed(self.replication)))
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = admin.create_topics(&topics, &opts).await.map_err(kafka_err)?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(PortError::Transient(format!("creating topic {name}: {code}")));
                }
            }
        }
        Ok(())
    }

    /// The idempotent, `acks=all` producer every writer uses.
    pub fn producer(&self) -> PortResult<FutureProducer> {
        self.client()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .set("message.timeout.ms", "30000")
            .set("queue.buffering.max.messages", "200000")
            .create()
            .map_err(kafka_err)
    }
}

/// Sorts a driver error into transient or permanent, once.
pub fn kafka_err(e: KafkaError) -> PortError {
    match &e {
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) => PortError::Permanent(e.to_string()),
        KafkaError::MessageProduction(code) | KafkaError::AdminOp(code)
            if matches!(
                code,
                RDKafkaErrorCode::MessageSizeTooLarge
                    | RDKafkaErrorCode::InvalidMessage
                    | RDKafkaErrorCode::TopicAuthorizationFailed
                    | RDKafkaErrorCode::UnknownTopicOrPartition
            ) =>
        {
            PortError::Permanent(e.to_string())
        }
        _ => PortError::Transient(e.to_string()),
    }
}

/// Publishes usage facts.
#[derive(Clone)]
pub struct KafkaLog {
    producer: FutureProducer,
    topic: String,
}

impl KafkaLog {
    pub fn new(config: &KafkaConfig) -> PortResult<Self> {
        Ok(KafkaLog { producer: config.producer()?, topic: config.usage_topic() })
    }

    /// Publishes raw bytes under a key (tests use it to put malformed records on the log).
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) -> PortResult<()> {
        self.producer
            .send(FutureRecord::to(&self.topic).key(key).payload(payload), Timeout::After(Duration::from_secs(30)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| kafka_err(e))
    }
}

#[async_trait]
impl Log for KafkaLog {
    async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
        let mut payloads = Vec::with_capacity(facts.len());
        for f in facts {
            let bytes = schemas::encode_usage(f).map_err(|e| PortError::Permanent(e.to_string()))?;
            payloads.push((f.project_id.as_str(), bytes));
        }
        let sends = payloads.iter().map(|(key, bytes)| {
            self.producer
                .send(FutureRecord::to(&self.topic).key(*key).payload(bytes), Timeout::After(Duration::from_secs(30)))
        });
        let results = futures::future::join_all(sends)
            .instrument(info_span!("datastore", op = "kafka.publish", n = facts.len()))
            .await;
        for r in results {
            r.map_err(|(e, _)| kafka_err(e))?;
        }
        Ok(())
    }
}

/// Reads the usage topic from explicit offsets, and dead-letters what cannot be folded.
pub struct KafkaReader {
    consumer: StreamConsumer,
    dlq: FutureProducer,
    /// Reads the DLQ back (its marks, and what is past one).
    dlq_reader: Arc<BaseConsumer>,
    topic: String,
    dlq_topic: String,
}

/// How long reading the DLQ back may take before it is a transient failure.
const DLQ_SCAN_DEADLINE: Duration = Duration::from_secs(30);
/// How long one dead letter's publish may take before it fails.
pub const DLQ_TIMEOUT: Duration = Duration::from_secs(10);

impl KafkaReader {
    pub fn new(config: &KafkaConfig, group: &str) -> PortResult<Self> {
        let consumer: StreamConsumer = config
            .client()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "20")
            .create()
            .map_err(kafka_err)?;
        let dlq_reader: BaseConsumer = config
            .client()
            .set("group.id", format!("{group}-dlq"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "20")
            .create()
            .map_err(kafka_err)?;
        // Its own producer, with a shorter delivery timeout than the usage
        // producer's: a dead letter's publisher holds a lease on it (see the
        // projector), which must outlast one attempt.
        let dlq = config
            .client()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .set("message.timeout.ms", DLQ_TIMEOUT.as_millis().to_string())
            .create()
            .map_err(kafka_err)?;
        Ok(KafkaReader {
            consumer,
            dlq,
            dlq_reader: Arc::new(dlq_reader),
            topic: config.usage_topic(),
            dlq_topic: config.dlq_topic(),
        })
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }
}

#[async_trait]
impl LogReader for KafkaReader {
    async fn partitions(&mut self) -> PortResult<Vec<i32>> {
        // A short blocking call, made at start-up only.
        let md = self.consumer.fetch_metadata(Some(&self.topic), Duration::from_secs(10)).map_err(kafka_err)?;
        let topic = md
            .topics()
            .iter()
            .find(|t| t.name() == self.topic)
            .ok_or_else(|| PortError::Transient(format!("topic {} not in metadata", self.topic)))?;
        if let Some(e) = topic.error() {
            return Err(PortError::Transient(format!("topic {}: {e:?}", self.topic)));
        }
        Ok(topic.partitions().iter().map(|p| p.id()).collect())
    }

    async fn seek(&mut self, positions: &BTreeMap<i32, i64>) -> PortResult<()> {
        let mut tpl = TopicPartitionList::new();
        for (p, o) in positions {
            tpl.add_partition_offset(&self.topic, *p, Offset::Offset(*o)).map_err(kafka_err)?;
        }
        self.consumer.assign(&tpl).map_err(kafka_err)
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> PortResult<Vec<LogRecord>> {
        let mut out = Vec::new();
        let first = match tokio::time::timeout(wait, self.consumer.recv()).await {
            Err(_) => return Ok(out),
            Ok(r) => r.map_err(kafka_err)?,
        };
        out.push(record_of(&first));
        drop(first);
        while out.len() < max {
            match self.consumer.recv().now_or_never() {
                Some(Ok(m)) => out.push(record_of(&m)),
                Some(Err(e)) => return Err(kafka_err(e)),
                None => break,
            }
        }
        Ok(out)
    }

    async fn dead_letter(&mut self, record: &LogRecord, reason: &str) -> PortResult<()> {
        let partition = record.partition.to_string();
        let offset = record.offset.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header { key: "tollgate-reason", value: Some(reason) })
            .insert(Header { key: "tollgate-source-topic", value: Some(&self.topic) })
            .insert(Header { key: "tollgate-source-partition", value: Some(&partition) })
            .insert(Header { key: "tollgate-source-offset", value: Some(&offset) });
        let mut rec = FutureRecord::to(&self.dlq_topic).payload(&record.payload).headers(headers);
        if let Some(k) = &record.key {
            rec = rec.key(k);
        }
        self.dlq.send(rec, Timeout::After(DLQ_TIMEOUT)).await.map(|_| ()).map_err(|(e, _)| kafka_err(e))
    }

    async fn dead_letter_mark(&mut self) -> PortResult<DlqMark> {
        let (reader, topic) = (Arc::clone(&self.dlq_reader), self.dlq_topic.clone());
        // librdkafka's metadata and watermark calls block.
        tokio::task::spawn_blocking(move || ends(&reader, &topic))
            .await
            .map_err(|e| PortError::Transient(format!("reading the DLQ's end: {e}")))?
    }

    async fn dead_lettered_since(&mut self, mark: &DlqMark) -> PortResult<BTreeSet<(i32, i64)>> {
        let (reader, dlq, source, mark) =
            (Arc::clone(&self.dlq_reader), self.dlq_topic.clone(), self.topic.clone(), mark.clone());
        tokio::task::spawn_blocking(move || sources_since(&reader, &dlq, &source, &mark))
            .instrument(info_span!("datastore", op = "kafka.dlq_scan"))
            .await
            .map_err(|e| PortError::Transient(format!("reading the DLQ: {e}")))?
    }
}

/// The high watermark of every partition of `topic`.
fn ends(reader: &BaseConsumer, topic: &str) -> PortResult<DlqMark> {
    let md = reader.fetch_metadata(Some(topic), Duration::from_secs(10)).map_err(kafka_err)?;
    let t = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| PortError::Transient(format!("topic {topic} not in metadata")))?;
    if let Some(e) = t.error() {
        return Err(PortError::Transient(format!("topic {topic}: {e:?}")));
    }
    let mut out = DlqMark::new();
    for p in t.partitions() {
        let (_, high) = reader.fetch_watermarks(topic, p.id(), Duration::from_secs(10)).map_err(kafka_err)?;
        out.insert(p.id(), high);
    }
    Ok(out)
}

/// The (partition, offset) each dead letter of `source` on `dlq` past `mark`
/// names, read to the ends the topic has now.
fn sources_since(reader: &BaseConsumer, dlq: &str, source: &str, mark: &DlqMark) -> PortResult<BTreeSet<(i32, i64)>> {
    let ends = ends(reader, dlq)?;
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for (&p, &end) in &ends {
        // A partition the mark does not know is read from its start.
        let from = mark.get(&p).copied().unwrap_or(0);
        if from < end {
            tpl.add_partition_offset(dlq, p, Offset::Offset(from)).map_err(kafka_err)?;
            next.insert(p, from);
        }
    }
    let mut found = BTreeSet::new();
    if next.is_empty() {
        return Ok(found);
    }
    reader.assign(&tpl).map_err(kafka_err)?;
    let started = std::time::Instant::now();
    let outcome = loop {
        if next.iter().all(|(p, o)| *o >= ends[p]) {
            break Ok(());
        }
        if started.elapsed() > DLQ_SCAN_DEADLINE {
            break Err(PortError::Transient(format!("reading {dlq} to its end took over {DLQ_SCAN_DEADLINE:?}")));
        }
        let Some(m) = reader.poll(Duration::from_millis(100)) else { continue };
        let m = match m {
            Ok(m) => m,
            Err(e) => break Err(kafka_err(e)),
        };
        next.insert(m.partition(), m.offset() + 1);
        let header = |name: &str| {
            m.headers()?
                .iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        if header("tollgate-source-topic").as_deref() != Some(source) {
            continue;
        }
        let partition = header("tollgate-source-partition").and_then(|v| v.parse().ok());
        let offset = header("tollgate-source-offset").and_then(|v| v.parse().ok());
        if let (Some(p), Some(o)) = (partition, offset) {
            found.insert((p, o));
        }
    };
    // Leave no assignment behind: the next scan assigns afresh.
    let _ = reader.unassign();
    outcome.map(|()| found)
}

fn record_of<M: Message>(m: &M) -> LogRecord {
    LogRecord {
        partition: m.partition(),
        offset: m.offset(),
        key: m.key().map(<[u8]>::to_vec),
        payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        timestamp: m
            .timestamp()
            .to_millis()
            .filter(|ms| *ms >= 0)
            .and_then(chrono::DateTime::<chrono::Utc>::from_timestamp_millis),
    }
}
