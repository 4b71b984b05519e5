//! Projectors sharing the usage topic (issue 14 item 4, `meter::share`):
//! three `tollgate project` processes on a topic of six partitions split
//! them two each; under traffic one is SIGKILLed (its partitions go to the
//! others once its lease lapses) and a fourth joins (it gets its share);
//! every acknowledged event is folded exactly once, which `LogAudit` checks
//! against the log itself.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use crate::harness::*;
use crate::invariants::LogAudit;

const CONSUMER: &str = "tollgate-projector";

/// Each partition's owner, and the live members.
async fn owners(db: &sqlx::PgPool) -> (BTreeMap<i32, Option<String>>, BTreeSet<String>) {
    let rows: Vec<(i32, Option<String>)> =
        sqlx::query_as(r#"SELECT "partition", owner FROM partition_owners WHERE consumer = $1 ORDER BY 1"#)
            .bind(CONSUMER)
            .fetch_all(db)
            .await
            .expect("partition owners");
    let live: Vec<(String,)> =
        sqlx::query_as("SELECT member FROM projector_members WHERE consumer = $1 AND expires_at >= now()")
            .bind(CONSUMER)
            .fetch_all(db)
            .await
            .expect("members");
    (rows.into_iter().collect(), live.into_iter().map(|(m,)| m).collect())
}

/// Whether the six partitions are held two each by `n` live members.
async fn split_among(db: &sqlx::PgPool, n: usize) -> bool {
    let (owners, live) = owners(db).await;
    if owners.len() != 6 || live.len() != n {
        return false;
    }
    let mut held: BTreeMap<&str, usize> = BTreeMap::new();
    for o in owners.values() {
        match o {
            Some(o) if live.contains(o) => *held.entry(o.as_str()).or_default() += 1,
            _ => return false,
        }
    }
    held.len() == n && held.values().all(|&c| c == 6 / n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_projectors_share_six_partitions_through_a_kill_and_a_join() {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push(("TOLLGATE_TOPIC_PARTITIONS".into(), "6".into()));
    env.extra_env.push(("TOLLGATE_PROJECTOR_LEASE".into(), "2s".into()));
    env.start_gateway().await;
    let first = env.start_projector();
    env.start_projector();
    env.start_projector();
    let db = sqlx::PgPool::connect(&env.db_url).await.expect("connect test database");
    env.eventually(30, "six partitions, two per projector", || split_among(&db, 3)).await;

    let mut projects = Vec::new();
    for _ in 0..12 {
        projects.push(env.project_with_key(safe_timezone()).await);
    }
    let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut added = false;
    for batch in 0..30 {
        if batch == 10 {
            env.kill(first);
        }
        if batch == 20 {
            env.start_projector();
            added = true;
        }
        let events: Vec<Value> = projects
            .iter()
            .flat_map(|(pid, kid, _)| {
                (0..10).map(move |i| (pid.clone(), call_event(&format!("b{batch}-{i}"), pid, kid, None, 1)))
            })
            .map(|(pid, e)| {
                sent.entry(pid).or_default().push(e["id"].as_str().expect("id").to_owned());
                e
            })
            .collect();
        let (s, body) = post_events(&env.http, env.gw(), events).await;
        assert_eq!(s, 202, "{body}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(added);
    for (pid, _, _) in &projects {
        env.eventually(90, &format!("{pid}'s 300 calls folded"), || async {
            env.durable(pid, "p", "day").await.1 == 300
        })
        .await;
    }
    env.eventually(30, "the three live projectors holding two partitions each", || split_among(&db, 3)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let audit = LogAudit::of(&env).await;
    assert!(audit.dlq.is_empty(), "nothing dead-lettered: {:?}", audit.dead_lettered());
    audit.assert_accounted(&env).await;
    let partitions: BTreeSet<i32> = audit.facts().iter().map(|(p, _, _)| *p).collect();
    assert!(partitions.len() >= 4, "the traffic spans partitions: {partitions:?}");
    for (pid, _, _) in &projects {
        audit.assert_acknowledged_on_log(pid, &sent[pid]);
        let tz = safe_timezone_of(&env, pid).await;
        audit.assert_folded_once(&env, pid, tz).await;
        assert_eq!(env.durable(pid, "p", "day").await, (0, 300, 300), "{pid}: each call once");
    }
}
