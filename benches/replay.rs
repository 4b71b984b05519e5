//! `tollgate replay` benchmark: the rate at which the command rebuilds the
//! aggregates from offset 0 into a shadow schema, against a raw consumer
//! reading the same topic (DESIGN §8: a replay at least 0.6 × the raw
//! consumer), in one run on one machine.
//!
//! It puts `REPLAY_N` call events of `PROJECTS` projects on a topic of its
//! own (raw, pre-encoded, straight to the broker), folds them live with the
//! projector (PostgreSQL, an in-memory view), reads the topic with a plain
//! rdkafka consumer, then runs the `tollgate replay` binary against the same
//! database and topic and reads its own rate (records/s of the rebuild) and
//! its wall time (start-up, the shadow schema's migrations and the row by
//! row comparison included). The replay must find no difference.
//!
//! Run it with `cargo bench --bench replay` (services up, as `scripts/test`
//! starts them) or `scripts/bench`. Under `cargo test --all-targets` it
//! returns at once. It prints a markdown report and writes it to
//! `target/bench-replay.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use meter::{ApiKeyId, EventId, EventKind, ProjectId, UsageFact};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use store::{KafkaConfig, KafkaReader, MemoryView, PgStore};

mod support;
use support::{AnyResult, bench_main};

const REPLAY_N: usize = 100_000;
const PROJECTS: usize = 20;

fn main() {
    bench_main("replay", run);
}

struct Rate {
    records: u64,
    secs: f64,
}

impl Rate {
    fn per_sec(&self) -> f64 {
        self.records as f64 / self.secs.max(1e-9)
    }
}

async fn run() -> AnyResult<()> {
    let db = testkit::TestDb::new("tg_bench_replay").await;
    let brokers = testkit::env::kafka();
    let kafka = KafkaConfig::new(&brokers, testkit::topic_prefix("tgbench-replay"));
    kafka.ensure_topics().await?;
    let store = PgStore::connect(&db.url).await?;
    store.migrate().await?;
    let pool = sqlx::PgPool::connect(&db.url).await?;
    let projects: Vec<String> = (0..PROJECTS).map(|i| format!("proj_bench{i}")).collect();
    for p in &projects {
        sqlx::query("INSERT INTO projects (id, name, timezone, created_at) VALUES ($1, 'bench', 'UTC', now())")
            .bind(p)
            .execute(&pool)
            .await?;
    }

    eprintln!("replay: producing {REPLAY_N} events");
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "500000")
        .create()?;
    let topic = kafka.usage_topic();
    let now = Utc::now();
    let key = ApiKeyId::parse("key_bench")?;
    let mut pending = Vec::with_capacity(REPLAY_N);
    for i in 0..REPLAY_N {
        let project = &projects[i % PROJECTS];
        let fact = UsageFact {
            api_key_id: Some(key.clone()),
            rows: 1,
            gateway: "bench".into(),
            received_at: Some(now),
            ..UsageFact::new(
                EventId::parse(format!("ev-{i}"))?,
                ProjectId::parse(project.as_str())?,
                EventKind::Call,
                now - chrono::Duration::seconds(1),
            )
        };
        let bytes = schemas::encode_usage(&fact)?;
        pending.push(
            producer.send_result(FutureRecord::to(&topic).key(project.as_str()).payload(&bytes)).map_err(|(e, _)| e)?,
        );
        if pending.len() >= 10_000 {
            for d in pending.drain(..) {
                d.await?.map_err(|(e, _)| e)?;
            }
        }
    }
    for d in pending.drain(..) {
        d.await?.map_err(|(e, _)| e)?;
    }

    eprintln!("replay: the live fold");
    let live_started = Instant::now();
    let reader = KafkaReader::new(&kafka, "bench-live")?;
    let mut projector = projector::Projector::new(
        reader,
        Arc::new(store.clone()),
        Arc::new(MemoryView::new()),
        Arc::new(gateway::state::SystemClock),
        projector::ProjectorConfig::new(&topic),
    );
    projector.start().await?;
    let mut folded = 0u64;
    // Until it has read them all, or 50 polls in a row bring none (an empty
    // poll while the consumer fetches is no sign of the end).
    let mut idle = 0;
    while folded < REPLAY_N as u64 && idle < 50 {
        let r = projector.step().await?;
        idle = if r.read == 0 { idle + 1 } else { 0 };
        folded += r.read as u64;
    }
    let live = Rate { records: folded, secs: live_started.elapsed().as_secs_f64() };

    eprintln!("replay: raw consumer");
    let raw = raw_consume(&brokers, &topic).await?;

    eprintln!("replay: tollgate replay");
    let started = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("replay")
        .env("TOLLGATE_DATABASE_URL", &db.url)
        .env("TOLLGATE_KAFKA_BROKERS", &brokers)
        .env("TOLLGATE_TOPIC_PREFIX", &kafka.topic_prefix)
        .env("TOLLGATE_LOG", "warn")
        .env_remove("TOLLGATE_DATA_DIR")
        .output()?;
    let wall = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!("tollgate replay failed: {stdout}{}", String::from_utf8_lossy(&out.stderr)).into());
    }
    // "replayed N records in S s (R records/s): …"
    let first = stdout.lines().next().unwrap_or_default();
    let words: Vec<&str> = first.split_whitespace().collect();
    let records: u64 = words.get(1).and_then(|w| w.parse().ok()).ok_or("no record count in the output")?;
    let secs: f64 = words.get(4).and_then(|w| w.parse().ok()).ok_or("no duration in the output")?;
    let replay = Rate { records, secs };
    let command = Rate { records, secs: wall };
    pool.close().await;

    let ratio = replay.per_sec() / raw.per_sec();
    let report = format!(
        "### `tollgate replay` ({REPLAY_N} call events, {PROJECTS} projects, {} partitions)\n\n\
         | what | records | seconds | records/s |\n|---|---:|---:|---:|\n\
         | raw rdkafka consumer, offset 0 to the end | {} | {:.2} | {:.0} |\n\
         | live projector fold (PostgreSQL, memory view) | {} | {:.2} | {:.0} |\n\
         | `tollgate replay`: rebuild into the shadow schema | {} | {:.2} | {:.0} |\n\
         | `tollgate replay`: the whole command (start, migrations, compare) | {} | {:.2} | {:.0} |\n\n\
         replay / raw consumer = **{ratio:.3}** (DESIGN §8 asks ≥ 0.6). Output: `{first}`\n",
        kafka.partitions,
        raw.records,
        raw.secs,
        raw.per_sec(),
        live.records,
        live.secs,
        live.per_sec(),
        replay.records,
        replay.secs,
        replay.per_sec(),
        command.records,
        command.secs,
        command.per_sec(),
    );
    println!("\n{report}");
    let dir =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    let path = std::path::Path::new(&dir).join("bench-replay.md");
    if let Err(e) = std::fs::write(&path, &report) {
        eprintln!("replay: could not write {}: {e}", path.display());
    }
    Ok(())
}

/// Reads the whole topic from offset 0 with a plain consumer (the projector
/// reader's client settings), counting records.
async fn raw_consume(brokers: &str, topic: &str) -> AnyResult<Rate> {
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("bench-raw-{}", testkit::unique_id()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "20")
        .create()?;
    let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut total = 0u64;
    let mut tpl = TopicPartitionList::new();
    for t in md.topics().iter().filter(|t| t.name() == topic) {
        for p in t.partitions() {
            let (_, high) = consumer.fetch_watermarks(topic, p.id(), Duration::from_secs(10))?;
            total += u64::try_from(high).unwrap_or(0);
            tpl.add_partition_offset(topic, p.id(), Offset::Offset(0))?;
        }
    }
    consumer.assign(&tpl)?;
    let start = Instant::now();
    let mut read = 0u64;
    while read < total {
        match tokio::time::timeout(Duration::from_secs(10), consumer.recv()).await {
            Ok(Ok(_)) => read += 1,
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => break,
        }
    }
    Ok(Rate { records: read, secs: start.elapsed().as_secs_f64() })
}
