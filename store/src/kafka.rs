//! The log on Kafka (any Kafka-protocol broker).
//!
//! [`KafkaLog`] publishes usage facts, Avro single-object encoded, keyed by
//! project so one project's events stay in one partition, with idempotent
//! producers and `acks=all`: `publish` is acknowledged only once
//! every record has a successful delivery report. It never waits longer than
//! the publish timeout, and not at all when the producer knows the broker is
//! down; what is not acknowledged stays queued and is sent again until it is
//! (the [`outbox`](crate::outbox), see [`KafkaLog`]). [`KafkaReader`] reads by explicit partition
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use meter::{
    AuditEntry, AuditLog, DlqMark, Log, LogReader, LogRecord, LogTail, PortError, PortResult, ProjectId, UsageFact,
};
use rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, OwnedResourceSpecifier, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};
use tracing::{Instrument, info_span, warn};

use crate::outbox::{OutRecord, Outbox, PublishOptions, Transport};

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
    /// How long librdkafka keeps trying to deliver one record before it
    /// reports it failed (`message.timeout.ms`); zero (the default) is
    /// never. This is not how long a publish waits (that is
    /// [`PublishOptions::timeout`]): a record librdkafka gives up on is sent
    /// again by [`KafkaLog`]'s queue anyway. Never is the better default: the
    /// idempotent producer retries with the record's sequence number, so it
    /// lands once and in order; and when a finite timeout expires on a record
    /// in flight, librdkafka bumps the producer epoch on its own (KIP-360),
    /// which the tansu 0.6 broker does not support (its storage panics on
    /// the next produce and it accepts no record until restarted). Set it
    /// only for a broker that handles epoch bumps (Apache Kafka ≥ 2.5).
    pub message_timeout: Duration,
    /// How [`KafkaLog`] publishes wait and queue.
    pub publish: PublishOptions,
    /// How long the usage topic keeps records, when Tollgate creates it:
    /// forever by default, since a replay rebuilds from offset 0.
    pub usage_retention: Retention,
    /// How long the dead-letter topic keeps records (forever by default:
    /// each is an acknowledged event the fold could not take).
    pub dlq_retention: Retention,
    /// How long the audit topic keeps records (forever by default: the audit
    /// log is folded from it, and a rebuilt store gets back what it kept).
    pub audit_retention: Retention,
}

/// How long a topic keeps its records (`retention.ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Never deleted (`retention.ms=-1`).
    Forever,
    /// Deleted once older than this.
    For(Duration),
}

impl Retention {
    /// The topic's `retention.ms`: `-1` for forever; at least 1 ms.
    pub fn retention_ms(&self) -> String {
        match self {
            Retention::Forever => "-1".to_owned(),
            Retention::For(d) => d.as_millis().clamp(1, i64::MAX as u128).to_string(),
        }
    }
}

impl std::str::FromStr for Retention {
    type Err = String;

    /// `forever`, or a duration as humantime reads it (`90days`, `400d`, `12h`).
    fn from_str(s: &str) -> Result<Retention, String> {
        if s.trim().eq_ignore_ascii_case("forever") {
            return Ok(Retention::Forever);
        }
        match humantime::parse_duration(s.trim()) {
            Ok(d) if !d.is_zero() => Ok(Retention::For(d)),
            _ => Err(format!("{s:?} is neither `forever` nor a positive duration such as `90days`")),
        }
    }
}

impl KafkaConfig {
    pub fn new(brokers: impl Into<String>, topic_prefix: impl Into<String>) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            topic_prefix: topic_prefix.into(),
            partitions: 3,
            replication: 1,
            message_timeout: Duration::ZERO,
            publish: PublishOptions::default(),
            usage_retention: Retention::Forever,
            dlq_retention: Retention::Forever,
            audit_retention: Retention::Forever,
        }
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

    /// A reader under `group` that positions itself: offsets are never
    /// committed or stored by Kafka (the store keeps them), a partition with
    /// no position starts at its beginning, and a fetch waits at most 20 ms.
    fn reader_client(&self, group: &str) -> ClientConfig {
        let mut c = self.client();
        c.set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "20");
        c
    }

    /// Creates the usage, audit and dead-letter topics if they are missing,
    /// each with its explicit retention (`retention.ms`; the broker's
    /// default, often 7 days, would leave a replay nothing older). Only
    /// `retention.ms` is set, not `cleanup.policy` (Kafka's default is
    /// `delete`): tansu 0.6 deletes only from topics that name
    /// `cleanup.policy=delete`, and it reads `retention.ms=-1` as "older
    /// than 0 s", so naming the policy there would delete the whole log. A
    /// topic that exists already keeps the configuration it has.
    pub async fn ensure_topics(&self) -> PortResult<()> {
        let admin: AdminClient<DefaultClientContext> = self.client().create().map_err(kafka_err)?;
        let names = [
            (self.usage_topic(), self.usage_retention.retention_ms()),
            (self.audit_topic(), self.audit_retention.retention_ms()),
            (self.dlq_topic(), self.dlq_retention.retention_ms()),
        ];
        let topics: Vec<NewTopic<'_>> = names
            .iter()
            .map(|(n, retention)| {
                NewTopic::new(n, self.partitions, TopicReplication::Fixed(self.replication))
                    .set("retention.ms", retention)
            })
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = admin.create_topics(&topics, &opts).await.map_err(kafka_err)?;
        let mut existing = Vec::new();
        for r in results {
            match r {
                Ok(_) => {}
                Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => existing.push(name),
                Err((name, code)) => {
                    return Err(PortError::Transient(format!("creating topic {name}: {code}")));
                }
            }
        }
        // A topic made before (by an older release, or by hand) keeps its
        // retention; say so when it is not the one configured.
        let specs: Vec<ResourceSpecifier<'_>> = existing.iter().map(|n| ResourceSpecifier::Topic(n)).collect();
        if !specs.is_empty()
            && let Ok(described) = admin.describe_configs(&specs, &opts).await
        {
            for config in described.into_iter().flatten() {
                let OwnedResourceSpecifier::Topic(name) = &config.specifier else { continue };
                let want = names.iter().find(|(n, _)| n == name).map(|(_, r)| r.as_str());
                let have = config.get("retention.ms").and_then(|e| e.value.as_deref());
                if let (Some(want), Some(have)) = (want, have)
                    && want != have
                {
                    warn!(topic = %name, retention_ms = have, configured = want, "existing topic keeps its retention");
                }
            }
        }
        Ok(())
    }

    /// The idempotent, `acks=all` producer every writer uses.
    pub fn producer(&self) -> PortResult<FutureProducer> {
        self.producer_config().create().map_err(kafka_err)
    }

    /// The settings of [`KafkaConfig::producer`]. With a finite message
    /// timeout a produce request is given up after it too (librdkafka's
    /// default is 30 s whatever the message timeout). A lost broker is
    /// reconnected to within a second of its return (librdkafka backs off
    /// up to 10 s by default).
    fn producer_config(&self) -> ClientConfig {
        let message_ms = self.message_timeout.as_millis().min(i32::MAX as u128);
        let mut c = self.client();
        c.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .set("message.timeout.ms", message_ms.to_string())
            .set("reconnect.backoff.max.ms", "1000")
            .set("queue.buffering.max.messages", "200000");
        if message_ms > 0 {
            c.set("request.timeout.ms", message_ms.min(30_000).to_string());
        }
        c
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

/// Publishes usage facts, through the [`outbox`](crate::outbox): a publish
/// waits at most [`PublishOptions::timeout`] for its delivery reports, and
/// not at all while the producer knows the broker is down; what is not
/// acknowledged stays queued and is sent again until it is. Cheap to clone
/// (clones share the producers and the queue).
///
/// **Two producers.** Waited publishes go on one with a 2-ms linger, so
/// concurrent ones share produce requests. Records queued without a
/// waiting publish (a check's request event) go out in the outbox pump's
/// attempts; an attempt of at most [`EAGER_MAX`] records (little load) goes
/// on a second producer with no linger, so it leaves at once, and a larger
/// one on the first (so does every attempt until the second producer has
/// its producer id, see [`Producers::eager`]). Each producer keeps its own
/// records in order; a request event and the events published around it
/// may land in either order, and the fold does not depend on it.
///
/// **What the producer knows.** Its [`ProducerState`] is down from the
/// moment librdkafka reports every broker connection down *and* a
/// connection attempt fails (the broker is gone: connections refused; an
/// idle connection the broker closed and the producer reopens is not an
/// outage), or a delivery fails (a finite
/// [`KafkaConfig::message_timeout`] expired, a fatal error); and up again at
/// the next successful delivery. While it is down a publish answers at once.
/// A frozen broker keeps its connections up and answers nothing: the first
/// publish that waits its whole timeout tells the queue (see the
/// [`outbox`](crate::outbox)), and later ones answer at once until a record
/// is acknowledged. A fatal producer error (the idempotent producer can no
/// longer guarantee order or exactly-once for its records) replaces both
/// producers with new ones at the next attempt; queued records go out on
/// them.
#[derive(Clone)]
pub struct KafkaLog {
    outbox: Outbox<KafkaSender>,
}

impl KafkaLog {
    pub fn new(config: &KafkaConfig) -> PortResult<Self> {
        let state = Arc::new(ProducerState::default());
        let mut settings = config.producer_config();
        settings.set("statistics.interval.ms", STATS_MS);
        let mut eager = settings.clone();
        eager.set("linger.ms", "0");
        let producers = Producers::new(&settings, &eager, &state)?;
        let sender = KafkaSender {
            settings,
            eager,
            producers: Arc::new(RwLock::new(Arc::new(producers))),
            state,
            topic: config.usage_topic(),
        };
        Ok(KafkaLog { outbox: Outbox::new(sender, config.publish) })
    }

    /// What the producer knows of the broker.
    pub fn state(&self) -> &ProducerState {
        &self.outbox.transport().state
    }

    /// Records queued and not yet acknowledged.
    pub fn queued(&self) -> usize {
        self.outbox.queued()
    }

    /// Whether the producer of small queued attempts (no linger) has its
    /// producer id, as its last statistics said; until it has, those go
    /// on the batching producer.
    pub fn eager_has_id(&self) -> bool {
        let producers = self.outbox.transport().producers.read().unwrap_or_else(PoisonError::into_inner);
        producers.eager_has_id.load(Ordering::SeqCst)
    }

    /// Whether both producers have their producer ids, as their last
    /// statistics said: a record handed to either goes out at once.
    pub fn has_ids(&self) -> bool {
        let producers = self.outbox.transport().producers.read().unwrap_or_else(PoisonError::into_inner);
        producers.batching_has_id.load(Ordering::SeqCst) && producers.eager_has_id.load(Ordering::SeqCst)
    }

    /// Waits until both producers have their producer ids, at most
    /// `within`; whether they have. A fresh producer gets its id 0.5–1 s
    /// after it is made and holds every record back until then, so a
    /// gateway waits for this before it answers its first check: a request
    /// event published earlier would stay in this process for up to a
    /// second, and a gateway killed meanwhile would take that reservation
    /// with it. With the broker unreachable it waits all of `within`.
    pub async fn wait_for_ids(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.has_ids() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(ID_POLL).await;
        }
    }

    /// Publishes raw bytes under a key (tests use it to put malformed
    /// records on the log); not queued: one attempt, waited for.
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) -> PortResult<()> {
        let sender = self.outbox.transport();
        sender
            .producers()?
            .batching
            .send(FutureRecord::to(&sender.topic).key(key).payload(payload), Timeout::After(Duration::from_secs(30)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| kafka_err(e))
    }
}

#[async_trait]
impl Log for KafkaLog {
    async fn publish(&self, facts: &[UsageFact]) -> PortResult<()> {
        let records = crate::outbox::usage_records(facts)?;
        self.outbox.publish(records).instrument(info_span!("datastore", op = "kafka.publish", n = facts.len())).await
    }

    fn queue(&self, facts: &[UsageFact]) -> Option<PortResult<()>> {
        Some(crate::outbox::usage_records(facts).and_then(|records| self.outbox.queue(records)))
    }

    async fn flush(&self, timeout: Duration) -> PortResult<()> {
        self.outbox.flush(timeout).await
    }
}

/// How long an audit publish waits for its delivery reports. Nobody waits
/// on the relay, so it is long (a busy broker is not an outage); records
/// still in flight then may land later, and their republish is deduplicated.
pub const AUDIT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes audit entries to the audit topic ([`AuditLog`]): Avro single-object
/// encoded ([`schemas::encode_audit`]), keyed by project (an installation-wide
/// entry by `installation`), with the
/// idempotent `acks=all` producer; a publish waits for every delivery
/// report, at most [`AUDIT_PUBLISH_TIMEOUT`]. Nothing is queued: the audit relay
/// publishes from the store's outbox again until it succeeds. Cheap to clone.
#[derive(Clone)]
pub struct KafkaAuditLog {
    producer: FutureProducer,
    topic: String,
    timeout: Duration,
}

impl KafkaAuditLog {
    pub fn new(config: &KafkaConfig) -> PortResult<Self> {
        Ok(KafkaAuditLog { producer: config.producer()?, topic: config.audit_topic(), timeout: AUDIT_PUBLISH_TIMEOUT })
    }
}

#[async_trait]
impl AuditLog for KafkaAuditLog {
    async fn publish_audit(&self, entries: &[AuditEntry]) -> PortResult<()> {
        let mut sent = Vec::with_capacity(entries.len());
        for e in entries {
            let payload = schemas::encode_audit(e).map_err(|e| PortError::Permanent(e.to_string()))?;
            let record = FutureRecord::to(&self.topic).key(e.log_key()).payload(&payload);
            sent.push(self.producer.send_result(record).map_err(|(e, _)| kafka_err(e))?);
        }
        let reports = async {
            for delivery in sent {
                match delivery.await {
                    Ok(Ok(_)) => {}
                    Ok(Err((e, _))) => return Err(kafka_err(e)),
                    Err(_) => return Err(PortError::Transient("the producer dropped a delivery report".into())),
                }
            }
            Ok(())
        };
        match tokio::time::timeout(self.timeout, reports)
            .instrument(info_span!("datastore", op = "kafka.publish_audit", n = entries.len()))
            .await
        {
            Ok(r) => r,
            Err(_) => {
                Err(PortError::Transient(format!("the audit topic did not acknowledge within {:?}", self.timeout)))
            }
        }
    }
}

/// What a producer knows of its broker, from librdkafka's error callback and
/// its delivery reports (see [`KafkaLog`]).
#[derive(Debug, Default)]
pub struct ProducerState {
    /// Why the broker is taken to be down, while it is.
    down: Mutex<Option<String>>,
    /// librdkafka reported every broker connection down since the last
    /// successful delivery (not an outage by itself: see [`KafkaLog`]).
    all_down: AtomicBool,
    /// A fatal error was reported: the producer must be replaced.
    fatal: AtomicBool,
}

impl ProducerState {
    /// Why the broker is taken to be down, if it is.
    pub fn down(&self) -> Option<String> {
        self.down.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn set_down(&self, why: Option<String>) {
        let mut d = self.down.lock().unwrap_or_else(PoisonError::into_inner);
        match (&*d, &why) {
            (None, Some(w)) => warn!(reason = %w, "kafka producer: broker down"),
            (Some(_), None) => tracing::info!("kafka producer: broker up"),
            _ => {}
        }
        *d = why;
    }

    /// A delivery report: success says the broker is up, a failure that it
    /// is not (a timed-out record, a lost connection).
    fn delivered(&self, outcome: Result<(), &KafkaError>) {
        match outcome {
            Ok(()) => {
                self.all_down.store(false, Ordering::SeqCst);
                if self.down.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                    self.set_down(None);
                }
            }
            Err(e) => {
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
                    self.fatal.store(true, Ordering::SeqCst);
                }
                self.set_down(Some(format!("delivery failed: {e}")));
            }
        }
    }
}

/// The producer's client context: librdkafka's global errors reach the
/// [`ProducerState`] (and the log) through it, and, from its statistics
/// (`statistics.interval.ms`), whether it holds its producer id.
struct Tracking {
    state: Arc<ProducerState>,
    /// The producer's last statistics said it has its producer id (state
    /// `Assigned`), so a record it is handed goes out at once. A fresh
    /// producer gets its id only 0.5–1 s after it is made (librdkafka asks
    /// on a 500-ms timer, and again if no broker connection was up), and
    /// holds every record back until then.
    has_id: Arc<AtomicBool>,
}

impl Tracking {
    fn new(state: &Arc<ProducerState>, has_id: &Arc<AtomicBool>) -> Tracking {
        Tracking { state: Arc::clone(state), has_id: Arc::clone(has_id) }
    }
}

/// The part of librdkafka's statistics [`Tracking`] reads.
#[derive(serde::Deserialize)]
struct Stats {
    eos: Option<EosStats>,
}

#[derive(serde::Deserialize)]
struct EosStats {
    idemp_state: String,
}

/// Whether librdkafka's statistics (JSON) say the idempotent producer has
/// its producer id.
fn has_producer_id(statistics: &[u8]) -> bool {
    serde_json::from_slice::<Stats>(statistics).ok().and_then(|s| s.eos).is_some_and(|e| e.idemp_state == "Assigned")
}

impl ClientContext for Tracking {
    fn stats_raw(&self, statistics: &[u8]) {
        self.has_id.store(has_producer_id(statistics), Ordering::SeqCst);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::AllBrokersDown) => self.state.all_down.store(true, Ordering::SeqCst),
            // librdkafka's wording for a refused or failed connect.
            Some(RDKafkaErrorCode::BrokerTransportFailure)
                if self.state.all_down.load(Ordering::SeqCst) && reason.contains("Connect to") =>
            {
                self.state.set_down(Some(format!("all brokers down: {reason}")));
            }
            Some(RDKafkaErrorCode::Fatal) => {
                self.state.fatal.store(true, Ordering::SeqCst);
                self.state.set_down(Some(format!("fatal producer error: {reason}")));
            }
            _ => warn!(error = %error, reason, "kafka producer error"),
        }
    }
}

/// The most records a pump's attempt may hold to go out on the eager
/// producer. The pump holds one attempt on its way at a time, so the
/// records of a check or two at a time mean little load: with no linger,
/// each such attempt is one produce request that leaves at once. Under
/// load an attempt holds many, and the batching producer's 2-ms linger
/// gathers them into one request (the eager one would send the first
/// record alone and the rest behind it: several requests, each a round of
/// the broker's work). BENCHMARKS.md, session 30, has the measurements.
pub const EAGER_MAX: usize = 8;

/// How often the producers report their statistics: how soon after one
/// has its producer id it is known ([`KafkaLog::has_ids`]; the eager one
/// is used from then on).
const STATS_MS: &str = "100";

/// How often [`KafkaLog::wait_for_ids`] looks.
const ID_POLL: Duration = Duration::from_millis(10);

/// The usage topic's producers, made and replaced together. Both are
/// idempotent with `acks=all` ([`KafkaConfig::producer`]), share one
/// [`ProducerState`] and report statistics (whether each has its producer
/// id); they differ in their linger.
struct Producers {
    /// `linger.ms` 2: every waited publish, and a pump's attempt of more
    /// than [`EAGER_MAX`] records or made before the eager one has its id.
    batching: FutureProducer<Tracking>,
    batching_has_id: Arc<AtomicBool>,
    /// `linger.ms` 0: a pump's attempt of at most [`EAGER_MAX`] records,
    /// once its statistics said it has its producer id. Before that it
    /// would hold them back for up to a second after the gateway started
    /// (a check's request event then missing from the log for that long:
    /// a gateway killed meanwhile would take its reservations with it).
    eager: FutureProducer<Tracking>,
    eager_has_id: Arc<AtomicBool>,
}

impl Producers {
    fn new(batching: &ClientConfig, eager: &ClientConfig, state: &Arc<ProducerState>) -> PortResult<Producers> {
        let (batching_has_id, eager_has_id) = (Arc::default(), Arc::default());
        Ok(Producers {
            batching: batching.create_with_context(Tracking::new(state, &batching_has_id)).map_err(kafka_err)?,
            batching_has_id,
            eager: eager.create_with_context(Tracking::new(state, &eager_has_id)).map_err(kafka_err)?,
            eager_has_id,
        })
    }

    /// The producer for a pump's attempt of `n` records.
    fn for_queued(&self, n: usize) -> &FutureProducer<Tracking> {
        if n <= EAGER_MAX && self.eager_has_id.load(Ordering::SeqCst) { &self.eager } else { &self.batching }
    }
}

/// One attempt at putting records on the usage topic, for the outbox.
struct KafkaSender {
    settings: ClientConfig,
    /// `settings` with no linger.
    eager: ClientConfig,
    /// Replaced whole after a fatal error.
    producers: Arc<RwLock<Arc<Producers>>>,
    state: Arc<ProducerState>,
    topic: String,
}

impl KafkaSender {
    /// The producers to send with: new ones if either reported a fatal error.
    fn producers(&self) -> PortResult<Arc<Producers>> {
        if self.state.fatal.swap(false, Ordering::SeqCst) {
            warn!("kafka producer: replacing the producers after a fatal error");
            let fresh = Arc::new(Producers::new(&self.settings, &self.eager, &self.state)?);
            *self.producers.write().unwrap_or_else(PoisonError::into_inner) = Arc::clone(&fresh);
            return Ok(fresh);
        }
        Ok(Arc::clone(&self.producers.read().unwrap_or_else(PoisonError::into_inner)))
    }

    /// Queues every record in `producer` first, then waits for each: one
    /// batch on the wire, not one round trip per record.
    async fn send_on(&self, producer: &FutureProducer<Tracking>, records: &[OutRecord]) -> Vec<PortResult<()>> {
        let queued: Vec<_> = records
            .iter()
            .map(|r| {
                producer.send_result(FutureRecord::to(&self.topic).key(&r.key).payload(&r.payload)).map_err(|(e, _)| e)
            })
            .collect();
        let mut out = Vec::with_capacity(records.len());
        for sent in queued {
            out.push(match sent {
                Err(e) => Err(kafka_err(e)),
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => {
                        self.state.delivered(Ok(()));
                        Ok(())
                    }
                    Ok(Err((e, _))) => {
                        self.state.delivered(Err(&e));
                        Err(kafka_err(e))
                    }
                    Err(_) => Err(PortError::Transient("the producer dropped a delivery report".into())),
                },
            });
        }
        out
    }
}

#[async_trait]
impl Transport for KafkaSender {
    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn send(&self, records: &[OutRecord]) -> Vec<PortResult<()>> {
        match self.producers() {
            Ok(p) => self.send_on(&p.batching, records).await,
            Err(e) => records.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// A small attempt of the pump on the eager producer once it has its
    /// producer id, a larger one on the batching producer ([`EAGER_MAX`]).
    async fn send_queued(&self, records: &[OutRecord]) -> Vec<PortResult<()>> {
        match self.producers() {
            Ok(p) => self.send_on(p.for_queued(records.len()), records).await,
            Err(e) => records.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    fn unreachable(&self) -> Option<String> {
        self.state.down()
    }
}

/// Reads the usage topic (or the audit topic, [`KafkaReader::audit`]) from
/// explicit offsets, and dead-letters what cannot be folded.
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
    /// A reader of the usage topic.
    pub fn new(config: &KafkaConfig, group: &str) -> PortResult<Self> {
        Self::on_topic(config, group, &config.usage_topic())
    }

    /// A reader of the audit topic (the audit folder's); what it cannot
    /// decode goes to the same dead-letter topic, naming the audit topic
    /// as its source.
    pub fn audit(config: &KafkaConfig, group: &str) -> PortResult<Self> {
        Self::on_topic(config, group, &config.audit_topic())
    }

    fn on_topic(config: &KafkaConfig, group: &str, topic: &str) -> PortResult<Self> {
        let consumer: StreamConsumer = config.reader_client(group).create().map_err(kafka_err)?;
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
            topic: topic.to_owned(),
            dlq_topic: config.dlq_topic(),
        })
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }
}

#[async_trait]
impl LogReader for KafkaReader {
    async fn ends(&mut self) -> PortResult<BTreeMap<i32, i64>> {
        let (reader, topic) = (Arc::clone(&self.dlq_reader), self.topic.clone());
        // librdkafka's metadata and watermark calls block.
        tokio::task::spawn_blocking(move || ends(&reader, &topic))
            .await
            .map_err(|e| PortError::Transient(format!("reading the usage topic's end: {e}")))?
    }

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

/// Reads a project's tail of the usage topic for a reseed ([`LogTail`]):
/// one consumer of its own, made at the first reseed and kept (no group
/// offsets are read or written; each call assigns afresh), reading each
/// partition from the given offset to the high watermark it had when the
/// call began, keeping the project's records. Calls take turns.
#[derive(Clone)]
pub struct KafkaTail {
    config: KafkaConfig,
    consumer: Arc<Mutex<Option<BaseConsumer>>>,
}

/// How long reading a tail may take before it is a transient failure.
pub const TAIL_DEADLINE: Duration = Duration::from_secs(30);

impl KafkaTail {
    pub fn new(config: &KafkaConfig) -> Self {
        KafkaTail { config: config.clone(), consumer: Arc::new(Mutex::new(None)) }
    }
}

#[async_trait]
impl LogTail for KafkaTail {
    async fn tail(
        &self,
        project: &ProjectId,
        from: &BTreeMap<i32, i64>,
        since: chrono::DateTime<chrono::Utc>,
    ) -> PortResult<Vec<LogRecord>> {
        let (config, slot) = (self.config.clone(), Arc::clone(&self.consumer));
        let since = since.timestamp_millis();
        let (topic, key, from) = (self.config.usage_topic(), project.as_str().as_bytes().to_vec(), from.clone());
        // librdkafka's metadata, watermark and poll calls block.
        tokio::task::spawn_blocking(move || {
            with_tail_consumer(&config, &slot, |consumer| {
                let out = tail_of(consumer, &topic, &key, &from, since);
                // Leave no assignment behind: the next tail assigns afresh.
                let _ = consumer.unassign();
                out
            })
        })
        .instrument(info_span!("datastore", op = "kafka.tail"))
        .await
        .map_err(|e| PortError::Transient(format!("reading the log tail: {e}")))?
    }

    async fn ends(&self) -> PortResult<BTreeMap<i32, i64>> {
        let (config, slot, topic) = (self.config.clone(), Arc::clone(&self.consumer), self.config.usage_topic());
        tokio::task::spawn_blocking(move || with_tail_consumer(&config, &slot, |consumer| ends(consumer, &topic)))
            .instrument(info_span!("datastore", op = "kafka.ends"))
            .await
            .map_err(|e| PortError::Transient(format!("reading the usage topic's end: {e}")))?
    }
}

/// Runs `f` on the tail's consumer, made on first use and kept; calls take turns.
fn with_tail_consumer<T>(
    config: &KafkaConfig,
    slot: &Mutex<Option<BaseConsumer>>,
    f: impl FnOnce(&BaseConsumer) -> PortResult<T>,
) -> PortResult<T> {
    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
    if slot.is_none() {
        let consumer: BaseConsumer = config.reader_client("tollgate-view-seed").create().map_err(kafka_err)?;
        *slot = Some(consumer);
    }
    match slot.as_ref() {
        Some(consumer) => f(consumer),
        None => Err(PortError::Transient("no tail consumer".into())),
    }
}

/// The records keyed `key` of `topic` from `from` (or from the first
/// record timestamped at or after `since`, ms, when that is earlier) to the
/// ends it has now.
fn tail_of(
    reader: &BaseConsumer,
    topic: &str,
    key: &[u8],
    from: &BTreeMap<i32, i64>,
    since: i64,
) -> PortResult<Vec<LogRecord>> {
    let ends = ends(reader, topic)?;
    let mut by_time = TopicPartitionList::new();
    for &p in ends.keys() {
        by_time.add_partition_offset(topic, p, Offset::Offset(since)).map_err(kafka_err)?;
    }
    let by_time = reader.offsets_for_times(by_time, Duration::from_secs(10)).map_err(kafka_err)?;
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for (&p, &end) in &ends {
        // No record that recent: the partition's end.
        let recent = match by_time.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o,
            _ => end,
        };
        let start = from.get(&p).copied().unwrap_or(0).min(recent);
        if start < end {
            tpl.add_partition_offset(topic, p, Offset::Offset(start)).map_err(kafka_err)?;
            next.insert(p, start);
        }
    }
    let mut out = Vec::new();
    if next.is_empty() {
        return Ok(out);
    }
    reader.assign(&tpl).map_err(kafka_err)?;
    let started = std::time::Instant::now();
    loop {
        if next.iter().all(|(p, o)| *o >= ends[p]) {
            return Ok(out);
        }
        if started.elapsed() > TAIL_DEADLINE {
            return Err(PortError::Transient(format!("reading the tail of {topic} took over {TAIL_DEADLINE:?}")));
        }
        let Some(m) = reader.poll(Duration::from_millis(100)) else { continue };
        let m = m.map_err(kafka_err)?;
        // Past the end taken at the start: a later record is the fold's, not the seed's.
        if m.offset() >= ends.get(&m.partition()).copied().unwrap_or(0) {
            next.insert(m.partition(), m.offset() + 1);
            continue;
        }
        next.insert(m.partition(), m.offset() + 1);
        if m.key() == Some(key) {
            out.push(record_of(&m));
        }
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

#[cfg(test)]
mod tests {
    use super::has_producer_id;

    /// The statistics librdkafka writes (cut down to the fields around the
    /// one read): only the `Assigned` state counts as having an id.
    #[test]
    fn a_producer_has_its_id_only_in_the_assigned_state() {
        let stats = |state: &str| {
            format!(
                r#"{{"name": "rdkafka#producer-2", "type": "producer", "ts": 1, "brokers": {{}}, "topics": {{}},
                "eos": {{ "idemp_state": "{state}", "idemp_stateage": 12, "txn_state": "Init", "txn_stateage": 12,
                "txn_may_enq": false, "producer_id": 7, "producer_epoch": 0, "epoch_cnt": 1 }}}}"#
            )
        };
        assert!(has_producer_id(stats("Assigned").as_bytes()));
        for state in ["Init", "RequestPID", "WaitTransport", "WaitPID", "DrainReset", "DrainBump"] {
            assert!(!has_producer_id(stats(state).as_bytes()), "{state}");
        }
        assert!(!has_producer_id(br#"{"name": "rdkafka#producer-1", "type": "producer"}"#), "no eos section");
        assert!(!has_producer_id(b"not json"));
    }
}
