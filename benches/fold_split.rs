//! Projectors sharing the partitions (issue 14 item 4): the fold rate of
//! 1, 2 and 3 `tollgate project` processes over the same backlog, against a
//! raw consumer reading the same topic, in one run on one machine.
//!
//! It puts `N` call events of `PROJECTS` projects on a topic of its own of
//! `PARTITIONS` partitions (raw, pre-encoded, straight to the broker). For
//! each count of projectors it makes a fresh PostgreSQL database (the same
//! projects), starts that many `tollgate project` processes (Redis view
//! under a key prefix of its own, metrics off) and times them from spawn
//! until the offsets they store cover the whole backlog: start-up, the
//! first heartbeats and the split included, as an operator adding
//! projectors to a backlog would see it.
//!
//! Run it with `cargo bench --bench fold_split` (services up, as
//! `scripts/test` starts them) or `scripts/bench`. Under `cargo test
//! --all-targets` it returns at once. It prints a markdown report and
//! writes it to `target/bench-fold-split.md`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chrono::Utc;
use meter::{ApiKeyId, EventId, EventKind, ProjectId, UsageFact};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use store::KafkaConfig;

mod support;
use support::{AnyResult, bench_main, loadavg};

const N: usize = 120_000;
const PROJECTS: usize = 48;
const PARTITIONS: i32 = 6;

fn main() {
    bench_main("fold_split", run);
}

/// Kills the processes it holds when dropped.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn run() -> AnyResult<()> {
    let brokers = testkit::env::kafka();
    let mut kafka = KafkaConfig::new(&brokers, testkit::topic_prefix("tgbench-split"));
    kafka.partitions = PARTITIONS;
    kafka.ensure_topics().await?;
    let topic = kafka.usage_topic();
    let projects: Vec<String> = (0..PROJECTS).map(|i| format!("proj_bench{i}")).collect();

    eprintln!("fold_split: producing {N} events on {PARTITIONS} partitions");
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "500000")
        .create()?;
    let now = Utc::now();
    let key = ApiKeyId::parse("key_bench")?;
    let mut pending = Vec::new();
    for i in 0..N {
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

    let load = loadavg();
    let raw = raw_consume(&brokers, &topic).await?;
    let mut rows = Vec::new();
    for count in 1..=3 {
        eprintln!("fold_split: {count} projector(s)");
        let (secs, per) = fold_with(count, &kafka, &projects).await?;
        rows.push((count, secs, per));
    }
    let one = rows.first().map(|r| N as f64 / r.1).unwrap_or(1.0);
    let mut report = format!(
        "### Fold rate by projectors sharing the partitions ({N} call events, {PROJECTS} projects, {PARTITIONS} partitions)\n\n\
         Load average before: {load}. Raw rdkafka consumer, offset 0 to the end: {:.0} records/s.\n\n\
         | projectors | seconds | records/s | × one projector | × raw consumer | partitions held |\n|---|---:|---:|---:|---:|---|\n",
        raw
    );
    for (count, secs, per) in &rows {
        let rate = N as f64 / secs;
        report.push_str(&format!(
            "| {count} | {secs:.2} | {rate:.0} | {:.2} | {:.3} | {per} |\n",
            rate / one,
            rate / raw
        ));
    }
    println!("\n{report}");
    let dir =
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").into());
    let path = std::path::Path::new(&dir).join("bench-fold-split.md");
    if let Err(e) = std::fs::write(&path, &report) {
        eprintln!("fold_split: could not write {}: {e}", path.display());
    }
    Ok(())
}

/// Folds the backlog with `count` projector processes into a fresh
/// database: the seconds from spawn to the last offset stored, and how
/// many partitions each member held at the end.
async fn fold_with(count: usize, kafka: &KafkaConfig, projects: &[String]) -> AnyResult<(f64, String)> {
    let db = testkit::TestDb::new("tg_bench_split").await;
    let store = store::PgStore::connect(&db.url).await?;
    store.migrate().await?;
    let pool = sqlx::PgPool::connect(&db.url).await?;
    for p in projects {
        sqlx::query("INSERT INTO projects (id, name, timezone, created_at) VALUES ($1, 'bench', 'UTC', now())")
            .bind(p)
            .execute(&pool)
            .await?;
    }
    let keys = testkit::RedisPrefix {
        url: testkit::env::redis_url(),
        prefix: format!("tgbench-split:{}:", testkit::unique_id()),
    };
    let started = Instant::now();
    let mut procs = Procs(Vec::new());
    for _ in 0..count {
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("project")
            .env("TOLLGATE_DATABASE_URL", &db.url)
            .env("TOLLGATE_KAFKA_BROKERS", &kafka.brokers)
            .env("TOLLGATE_TOPIC_PREFIX", &kafka.topic_prefix)
            .env("TOLLGATE_TOPIC_PARTITIONS", PARTITIONS.to_string())
            .env("TOLLGATE_REDIS_URL", &keys.url)
            .env("TOLLGATE_REDIS_PREFIX", &keys.prefix)
            .env("TOLLGATE_METRICS_LISTEN", "off")
            .env("TOLLGATE_PROJECTOR_LEASE", "2s")
            .env("TOLLGATE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()?;
        procs.0.push(child);
    }
    let topic = kafka.usage_topic();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (done,): (Option<i64>,) = sqlx::query_as(
            "SELECT CAST(SUM(next_offset) AS BIGINT) FROM consumer_offsets WHERE consumer = 'tollgate-projector' AND topic = $1",
        )
        .bind(&topic)
        .fetch_one(&pool)
        .await?;
        if done.unwrap_or(0) >= N as i64 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{count} projectors folded {done:?} of {N} in 10 minutes").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let held: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT owner, COUNT(*) FROM partition_owners WHERE consumer = 'tollgate-projector' GROUP BY owner ORDER BY 2 DESC",
    )
    .fetch_all(&pool)
    .await?;
    let per: Vec<String> =
        held.iter().map(|(o, n)| if o.is_some() { n.to_string() } else { format!("{n} free") }).collect();
    drop(procs);
    pool.close().await;
    Ok((secs, per.join(" + ")))
}

/// Reads the whole topic from offset 0 with a plain consumer: records/s.
async fn raw_consume(brokers: &str, topic: &str) -> AnyResult<f64> {
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
    Ok(read as f64 / start.elapsed().as_secs_f64().max(1e-9))
}
