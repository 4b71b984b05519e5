//! The audit trail from the log (issue 10, item 6), end to end on the real
//! services and on `tollgate dev`: admin changes (a key made and deleted, a
//! role, a quota, a webhook endpoint subscribed and changed), a correction
//! and a webhook endpoint disabled by a 410 each reach the audit topic and
//! `GET /v1/audit` (which reads only what the audit folder folded from the
//! topic, so this fails if the relay or the folder does nothing); the store's audit log emptied (with its folder's
//! offsets) while everything runs is rebuilt from the topic with the same
//! entries; and `tollgate replay` rebuilds it into its shadow and finds no
//! difference.

use std::collections::BTreeMap;

use chrono::Utc;
use serde_json::{Value, json};
use testkit::webhooks::Receiver;

use crate::harness::*;
use crate::replay::{assert_identical, replay, stdout};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audit_entries_reach_the_topic_and_survive_a_rebuild() {
    audit_trail(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audit_entries_reach_the_topic_and_survive_a_rebuild_dev() {
    audit_trail(Mode::Dev).await;
}

const ACTIONS: [&str; 8] = [
    "keys:CreateApiKey",
    "keys:DeleteApiKey",
    "roles:CreateRole",
    "quotas:CreateQuota",
    "webhooks:CreateEndpoint",
    "webhooks:UpdateEndpoint",
    "events:CorrectEvent",
    "webhook.endpoint_disabled",
];

fn has_every_action(entries: &[Value]) -> bool {
    ACTIONS.iter().all(|a| entries.iter().any(|e| e["action"] == *a))
}

/// Runs one statement on the environment's store.
async fn sql(env: &Env, statement: &str) {
    match env.mode {
        Mode::Distributed => {
            let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect test database");
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned())).execute(&pool).await.expect(statement);
            pool.close().await;
        }
        Mode::Dev => {
            let pool = env.sqlite().await;
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned())).execute(&pool).await.expect(statement);
            pool.close().await;
        }
    }
}

async fn audit_trail(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.extra_env.push(("TOLLGATE_WEBHOOK_ALLOW_PRIVATE".into(), "true".into()));
    env.start_gateway().await;
    let projector = env.start_projector();
    if mode == Mode::Distributed {
        env.start_notifier_with(&[("TOLLGATE_NOTIFY_POLL", "50ms")]);
    }
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;

    // Admin changes: a key made and deleted, a role, a quota.
    let (s, k2) = env.admin_post(&format!("/v1/projects/{pid}/api-keys"), json!({"name": "temp"})).await;
    assert_eq!(s, 201, "{k2}");
    let kid2 = k2["id"].as_str().expect("key id").to_owned();
    let (s, _) = env.admin_req(reqwest::Method::DELETE, &format!("/v1/api-keys/{kid2}"), None).await;
    assert_eq!(s, 204);
    let (s, role) = env.admin_post(&format!("/v1/projects/{pid}/roles"), json!({"name": "partner"})).await;
    assert_eq!(s, 201, "{role}");
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 100}))
        .await;
    // A correction: a call, folded, then voided.
    let (s, b) = post_events(&env.http, env.gw(), vec![call_event("c1", &pid, &kid, None, 5)]).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(30, "the call folded", || async { env.durable(&pid, "p", "day").await.1 == 1 }).await;
    let void = json!({
        "id": "x1", "type": "correction", "project_id": pid, "corrects": "c1", "void": true,
        "occurred_at": Utc::now().to_rfc3339(),
    });
    let (s, b) = post_events(&env.http, env.gw(), vec![void]).await;
    assert_eq!(s, 202, "{b}");
    // An endpoint disabled by delivery: it answers 410 to a test fire.
    let receiver = Receiver::start(vec![410]).await;
    let (s, w) = env
        .admin_post(
            &format!("/v1/projects/{pid}/webhooks"),
            json!({"url": receiver.url("/hook"), "event_types": ["*"]}),
        )
        .await;
    assert_eq!(s, 201, "{w}");
    let wh = w["id"].as_str().expect("webhook id").to_owned();
    let (s, p) =
        env.admin_req(reqwest::Method::PATCH, &format!("/v1/webhooks/{wh}"), Some(json!({"description": "ops"}))).await;
    assert_eq!(s, 200, "{p}");
    let (s, t) = env.admin_post(&format!("/v1/webhooks/{wh}/test"), json!({})).await;
    assert_eq!(s, 202, "{t}");

    // Each in GET /v1/audit, once folded from the topic.
    let log =
        env.audit_when(&pid, 60, "the admin changes, a correction and a disabled endpoint", has_every_action).await;
    let find = |action: &str| log.iter().find(|e| e["action"] == action).cloned().expect("the entry");
    let made: Vec<&Value> = log.iter().filter(|e| e["action"] == "keys:CreateApiKey").collect();
    assert_eq!(made.len(), 2, "both keys: {made:?}");
    assert_eq!(made[0]["resource"], kid.as_str());
    assert_eq!(
        (made[0]["principal_type"].as_str(), made[0]["principal_id"].as_str()),
        (Some("admin"), Some("admin_token"))
    );
    assert_eq!(made[1]["detail"]["after"]["name"], "temp");
    assert_eq!(made[1]["detail"]["after"]["prefix"], &k2["secret"].as_str().expect("secret")[..10]);
    let deleted = find("keys:DeleteApiKey");
    assert_eq!((deleted["resource"].as_str(), deleted["detail"]["after"].is_null()), (Some(kid2.as_str()), true));
    assert_eq!(find("roles:CreateRole")["resource"], role["id"]);
    assert_eq!(find("quotas:CreateQuota")["resource"], qid.as_str());
    assert_eq!(find("webhooks:CreateEndpoint")["resource"], wh.as_str());
    let changed = find("webhooks:UpdateEndpoint")["detail"].clone();
    assert_eq!(
        (changed["before"]["description"].clone(), changed["after"]["description"].clone()),
        (Value::Null, json!("ops"))
    );
    let text = serde_json::to_string(&log).expect("json");
    assert!(
        !text.contains("whsec_") && !text.contains(k2["secret"].as_str().expect("secret")),
        "no secret in the audit log"
    );
    assert_eq!(find("events:CorrectEvent")["detail"]["correction_id"], "x1");
    let disabled = find("webhook.endpoint_disabled");
    assert_eq!(disabled["resource"], wh.as_str());
    assert!(disabled["detail"]["reason"].as_str().is_some_and(|r| r.contains("410")), "{disabled}");

    // ... and on the topic, as the log shows them (the topic may hold an
    // entry twice; the log holds it once).
    let on_topic: BTreeMap<String, meter::AuditEntry> = env
        .audit_topic()
        .await
        .into_iter()
        .filter(|e| e.project_id.as_ref().is_some_and(|p| p.as_str() == pid))
        .map(|e| (e.id.to_string(), e))
        .collect();
    assert_eq!(on_topic.len(), log.len(), "every entry of the log is on the topic: {on_topic:?}");
    for e in &log {
        let t = on_topic.get(e["id"].as_str().expect("id")).unwrap_or_else(|| panic!("{e} on the topic"));
        assert_eq!(
            (t.action.as_str(), t.resource.as_str()),
            (e["action"].as_str().expect("action"), e["resource"].as_str().expect("resource"))
        );
        assert_eq!(serde_json::to_value(&t.detail).expect("detail"), e["detail"], "{e}");
    }

    // `tollgate replay` rebuilds the audit log into its shadow from the topic: no difference.
    let replayed = replay(&env, &[]);
    assert_identical(&replayed);
    assert!(stdout(&replayed).contains(&format!("audit log: {} entries rebuilt", log.len())), "{}", stdout(&replayed));

    // The store loses its audit log and its folder's offsets; the folder,
    // started again, reads the topic from the start.
    if mode == Mode::Distributed {
        env.kill(projector);
    }
    sql(&env, "DELETE FROM audit_log; DELETE FROM consumer_offsets WHERE consumer = 'tollgate-audit'").await;
    let (_, gone) = env.admin_get(&format!("/v1/audit?project_id={pid}")).await;
    assert_eq!(gone["data"], json!([]), "emptied: {gone}");
    match mode {
        Mode::Distributed => {
            env.start_projector();
        }
        Mode::Dev => {
            env.restart_dev().await;
        }
    }
    let rebuilt = env.audit_when(&pid, 60, "the audit log rebuilt", |e| e.len() >= log.len()).await;
    assert_eq!(rebuilt, log, "the same entries, in the same order");
}
