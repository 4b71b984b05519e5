//! The audit trail from the log (issue 10, item 6), end to end on the real
//! services and on `tollgate dev`: admin changes (a key made and deleted, a
//! role, a quota, a webhook endpoint subscribed and changed), a correction
//! and a webhook endpoint disabled by a 410 each reach the audit topic and
//! `GET /v1/audit` (which reads only what the audit folder folded from the
//! topic, so this fails if the relay or the folder does nothing); the store's audit log emptied (with its folder's
//! offsets) while everything runs is rebuilt from the topic with the same
//! entries; and `tollgate replay` rebuilds it into its shadow and finds no
//! difference. A write of prices, which belongs to no project, is audited
//! installation-wide (`GET /v1/audit?scope=installation`) and goes the same
//! way: topic, audit log, replay, rebuild.

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

/// The store loses its audit log and its folder's offsets (`emptied`, a
/// `GET /v1/audit` query, then reads nothing) while the topic stays; the
/// folder is started again (the projector, or `tollgate dev`) and reads the
/// topic from the start.
async fn lose_the_audit_log(env: &mut Env, projector: usize, emptied: &str) {
    if env.mode == Mode::Distributed {
        env.kill(projector);
    }
    sql(env, "DELETE FROM audit_log; DELETE FROM consumer_offsets WHERE consumer = 'tollgate-audit'").await;
    let (_, gone) = env.admin_get(emptied).await;
    assert_eq!(gone["data"], json!([]), "emptied: {gone}");
    match env.mode {
        Mode::Distributed => {
            env.start_projector();
        }
        Mode::Dev => {
            env.restart_dev().await;
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
    let (wh, _) = env.webhook(&pid, &receiver.url("/hook")).await;
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
    lose_the_audit_log(&mut env, projector, &format!("/v1/audit?project_id={pid}")).await;
    let rebuilt = env.audit_when(&pid, 60, "the audit log rebuilt", |e| e.len() >= log.len()).await;
    assert_eq!(rebuilt, log, "the same entries, in the same order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_of_prices_is_audited_installation_wide_and_survives_a_rebuild() {
    price_audit(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_of_prices_is_audited_installation_wide_and_survives_a_rebuild_dev() {
    price_audit(Mode::Dev).await;
}

fn price_row(model: &str, component: &str, usd: &str, from: &str) -> Value {
    json!({"provider": "openai", "model": model, "component": component, "unit_price_usd": usd, "effective_from": from})
}

async fn price_audit(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    let projector = env.start_projector();
    // A project, whose own entry (its key) stays in its own log.
    let (pid, _, _) = env.project_with_key(safe_timezone()).await;

    let first = [price_row("gpt-4o", "input_tokens", "0.0000025", "2026-01-01T00:00:00Z")];
    let (s, b) = env.admin_req(reqwest::Method::PUT, "/v1/prices", Some(json!({"prices": first}))).await;
    assert_eq!(s, 200, "{b}");
    // The same row again, dearer, and a row of a new key.
    let second = [
        price_row("gpt-4o", "input_tokens", "0.000003", "2026-01-01T00:00:00Z"),
        price_row("gpt-4o", "output_tokens", "0.00001", "2026-01-01T00:00:00Z"),
    ];
    let (s, b) = env.admin_req(reqwest::Method::PUT, "/v1/prices", Some(json!({"prices": second}))).await;
    assert_eq!(s, 200, "{b}");
    // Refused: nothing written, nothing audited.
    let bad = [price_row("gpt-4o", "vibes", "1", "2026-01-01T00:00:00Z")];
    let (s, b) = env.admin_req(reqwest::Method::PUT, "/v1/prices", Some(json!({"prices": bad}))).await;
    assert_eq!((s, b["error"]["meta"]["field"].as_str()), (400, Some("prices[0].component")), "{b}");

    let log = env.installation_audit_when(60, "two writes of prices", |e| e.len() >= 2).await;
    assert_eq!(log.len(), 2, "one entry per write: {log:?}");
    for e in &log {
        assert_eq!(
            (e["action"].as_str(), e["project_id"].is_null(), e["resource"].as_str(), e["detail"]["kind"].as_str()),
            (Some("prices:PutPrices"), true, Some("prices"), Some("price_change")),
            "{e}"
        );
        assert_eq!((e["principal_type"].as_str(), e["principal_id"].as_str()), (Some("admin"), Some("admin_token")));
    }
    let rows = |e: &Value| e["detail"]["prices"].as_array().cloned().expect("the rows written");
    let one = json!({"provider": "openai", "model": "gpt-4o", "component": "input_tokens",
                     "unit_price_usd": "0.0000025", "effective_from": "2026-01-01T00:00:00Z",
                     "replaced_unit_price_usd": null});
    assert_eq!(rows(&log[0]), [one]);
    let two = rows(&log[1]);
    assert_eq!(
        two.iter()
            .map(|r| (r["component"].as_str(), r["unit_price_usd"].as_str(), r["replaced_unit_price_usd"].as_str()))
            .collect::<Vec<_>>(),
        [(Some("input_tokens"), Some("0.000003"), Some("0.0000025")), (Some("output_tokens"), Some("0.00001"), None)]
    );

    // Not in the project's log; the project's entry not in the installation's.
    let project_log = env.audit_when(&pid, 60, "the project's key", |e| !e.is_empty()).await;
    assert!(project_log.iter().all(|e| e["action"] != "prices:PutPrices"), "{project_log:?}");
    // Paged by cursor like a project's log.
    let (_, page) = env.admin_get("/v1/audit?scope=installation&limit=1").await;
    assert_eq!((page["data"][0]["id"].clone(), page["next"].clone()), (log[0]["id"].clone(), log[0]["id"].clone()));
    let next = page["next"].as_str().expect("a cursor");
    let (_, page) = env.admin_get(&format!("/v1/audit?scope=installation&limit=1&after={next}")).await;
    assert_eq!((page["data"].clone(), page["next"].clone()), (json!([log[1].clone()]), Value::Null));
    let (_, page) = env.admin_get("/v1/audit?scope=installation&limit=1&page=2").await;
    assert_eq!(page["data"], json!([log[1].clone()]));

    // A scope with a project is refused, naming the field; so is an unknown scope.
    for (q, field) in [
        (format!("scope=installation&project_id={pid}"), "project_id"),
        ("scope=universe".to_owned(), "scope"),
        ("scope=project".to_owned(), "project_id"),
    ] {
        let (s, b) = env.admin_get(&format!("/v1/audit?{q}")).await;
        assert_eq!(s, 400, "{q}: {b}");
        assert_eq!(
            (b["error"]["code"].as_str(), b["error"]["meta"]["field"].as_str()),
            (Some("INVALID_REQUEST"), Some(field)),
            "{q}: {b}"
        );
    }

    // On the topic, as the log shows them, with no project.
    let on_topic: BTreeMap<String, meter::AuditEntry> =
        env.audit_topic().await.into_iter().filter(|e| e.project_id.is_none()).map(|e| (e.id.to_string(), e)).collect();
    assert_eq!(on_topic.len(), log.len(), "every installation entry is on the topic: {on_topic:?}");
    for e in &log {
        let t = on_topic.get(e["id"].as_str().expect("id")).unwrap_or_else(|| panic!("{e} on the topic"));
        assert_eq!((t.action.as_str(), t.resource.as_str()), ("prices:PutPrices", "prices"));
        assert_eq!(serde_json::to_value(&t.detail).expect("detail"), e["detail"], "{e}");
    }

    // `tollgate replay` rebuilds every entry, the installation's included, and finds no difference.
    let replayed = replay(&env, &[]);
    assert_identical(&replayed);
    let total = project_log.len() + log.len();
    assert!(stdout(&replayed).contains(&format!("audit log: {total} entries rebuilt")), "{}", stdout(&replayed));

    // The store loses its audit log: the installation's entries come back
    // from the topic.
    lose_the_audit_log(&mut env, projector, "/v1/audit?scope=installation").await;
    let rebuilt = env.installation_audit_when(60, "the installation's log rebuilt", |e| e.len() >= log.len()).await;
    assert_eq!(rebuilt, log, "the same entries, in the same order");
}
