//! Corrections end to end (issue 9, item 8): events, then corrections of
//! them through `POST /v1/events` — an amend, a void, a duplicate, and
//! corrections of an unknown event, of another project's event and of a
//! voided one — checked in `GET /v1/usage`, in the audit trail, in the
//! dead-letter outbox, and in what a quota check admits after the fold.
//! On the real services and on `tollgate dev`.

use chrono::Utc;
use serde_json::{Value, json};

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrections_amend_void_and_refuse() {
    corrections(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrections_amend_void_and_refuse_dev() {
    corrections(Mode::Dev).await;
}

fn correction(id: &str, project: &str, of: &str, extra: Value) -> Value {
    let mut e = json!({
        "id": id, "type": "correction", "project_id": project, "corrects": of,
        "occurred_at": Utc::now().to_rfc3339(),
    });
    if let (Value::Object(b), Value::Object(x)) = (&mut e, extra) {
        b.extend(x);
    }
    e
}

/// The calls and rows `GET /v1/usage` reports for one key this month.
async fn key_usage(env: &Env, project: &str, key: &str) -> (u64, u64) {
    let (s, r) = env.admin_get(&format!("/v1/usage?project_id={project}&group_by=api_key")).await;
    assert_eq!(s, 200, "usage: {r}");
    let row = r["data"].as_array().expect("rows").iter().find(|m| m["api_key_id"] == key).cloned();
    row.map_or((0, 0), |m| (m["calls"].as_u64().expect("calls"), m["rows"].as_u64().expect("rows")))
}

/// The reasons of the dead letters the store holds (both deployments keep
/// them in their store's outbox before publishing them).
async fn dead_letter_reasons(env: &Env) -> Vec<String> {
    let sql = "SELECT reason FROM dead_letters ORDER BY \"offset\"";
    let rows: Vec<(String,)> = match env.mode {
        Mode::Distributed => {
            let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect test database");
            let r = sqlx::query_as(sql).fetch_all(&pool).await.expect("dead letters");
            pool.close().await;
            r
        }
        Mode::Dev => {
            let pool = env.sqlite().await;
            let r = sqlx::query_as(sql).fetch_all(&pool).await.expect("dead letters");
            pool.close().await;
            r
        }
    };
    rows.into_iter().map(|(r,)| r).collect()
}

async fn corrections(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    let gw = env.start_gateway().await;
    env.start_projector();
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let (other, other_key, _) = env.project_with_key(safe_timezone()).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 5}))
        .await;
    let http = env.http.clone();

    // Four calls (18 rows), and one in the other project.
    let calls = vec![
        call_event("c1", &pid, &kid, None, 10),
        call_event("c2", &pid, &kid, None, 5),
        call_event("c3", &pid, &kid, None, 1),
        call_event("c4", &pid, &kid, None, 2),
    ];
    let (s, b) = post_events(&http, &gw, calls).await;
    assert_eq!(s, 202, "{b}");
    let (s, b) = post_events(&http, &gw, vec![call_event("b1", &other, &other_key, None, 7)]).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(60, "the calls folded", || async { key_usage(&env, &pid, &kid).await == (4, 18) }).await;

    // A correction that cannot be right is a 400 naming the field, and writes nothing.
    let bad = [
        (correction("bad1", &pid, "c1", json!({"void": true, "rows": 3})), "events[0].rows"),
        (
            json!({"id": "bad2", "type": "correction", "project_id": pid, "occurred_at": Utc::now().to_rfc3339()}),
            "events[0].corrects",
        ),
        (correction("bad3", &pid, "c1", json!({"api_key_id": kid, "rows": 1})), "events[0].api_key_id"),
        (
            correction("bad4", &pid, "c1", json!({"tokens": [{"provider": "openai", "model": "gpt-4o", "input": 5}]})),
            "events[0].tokens",
        ),
        (correction("bad5", &pid, "bad5", json!({"void": true})), "events[0].corrects"),
    ];
    for (event, field) in bad {
        let (s, b) = post_events(&http, &gw, vec![event]).await;
        assert_eq!(s, 400, "{b}");
        assert_eq!(b["error"]["code"], "INVALID_REQUEST", "{b}");
        assert_eq!(b["error"]["meta"]["field"], field, "{b}");
    }

    // Amend c1 to 3 rows, void c2; the amend sent twice (the same id) counts once.
    let amend = correction("x1", &pid, "c1", json!({"rows": 3}));
    let (s, b) =
        post_events(&http, &gw, vec![amend.clone(), correction("x2", &pid, "c2", json!({"void": true}))]).await;
    assert_eq!((s, b["accepted"].as_u64()), (202, Some(2)), "{b}");
    let (s, b) = post_events(&http, &gw, vec![amend]).await;
    assert_eq!(s, 202, "a resent correction is accepted and folded once: {b}");
    // Accepted at ingest (the store does not hold them), dead-lettered at fold:
    // an unknown event, and another project's.
    let (s, b) = post_events(
        &http,
        &gw,
        vec![
            correction("x3", &pid, "never-sent", json!({"rows": 1})),
            correction("x4", &pid, "b1", json!({"void": true})),
        ],
    )
    .await;
    assert_eq!(s, 202, "{b}");
    env.eventually(60, "the corrections folded", || async { key_usage(&env, &pid, &kid).await == (3, 6) }).await;
    assert_eq!(key_usage(&env, &other, &other_key).await, (1, 7), "the other project's event is untouched");

    // The void is folded: correcting c2 again is refused at ingest.
    let (s, b) = post_events(&http, &gw, vec![correction("x5", &pid, "c2", json!({"rows": 1}))]).await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(b["error"]["meta"]["field"], "events[0].corrects", "{b}");
    assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains("already voided")), "{b}");

    // The refused ones are dead-lettered with their reasons.
    env.eventually(30, "two dead letters", || async { dead_letter_reasons(&env).await.len() == 2 }).await;
    let reasons = dead_letter_reasons(&env).await;
    assert!(reasons[0].contains("no event never-sent of project"), "{reasons:?}");
    assert!(reasons[1].contains("no event b1 of project"), "{reasons:?}");

    // One audit entry per correction folded, naming both ids (once the
    // audit folder has them from the audit topic).
    let a = env
        .audit_when(&pid, 30, "two correction entries", |e| {
            e.iter().filter(|e| e["action"] == "events:CorrectEvent").count() >= 2
        })
        .await;
    let mut named: Vec<(String, String, bool)> = a
        .iter()
        .filter(|e| e["action"] == "events:CorrectEvent")
        .map(|e| {
            let d = &e["detail"];
            assert_eq!(e["resource"], d["original_id"]);
            (
                d["original_id"].as_str().expect("original").to_owned(),
                d["correction_id"].as_str().expect("correction").to_owned(),
                d["void"].as_bool().expect("void"),
            )
        })
        .collect();
    named.sort();
    assert_eq!(named, vec![("c1".into(), "x1".into(), false), ("c2".into(), "x2".into(), true)]);

    // Quota checks see the corrected usage: 3 of 5 used, so two more are
    // admitted and the third is refused. The view has the fold's totals
    // just after the store commits them, which the usage above read.
    env.eventually(30, "the view has the corrected usage", || async {
        env.admin_get(&format!("/v1/quotas/{qid}")).await.1["current_usage"]["count"] == 3
    })
    .await;
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(check(&http, &gw, &secret, json!({})).await.status().as_u16());
    }
    assert_eq!(statuses, vec![200, 200, 429]);
}
