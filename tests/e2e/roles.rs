//! Roles and signed-in users (ADR-0011) end to end: a role's quota is each
//! caller's own allowance, limits only narrow, and administrators and the
//! break-glass caller are never limited or counted.

use chrono::Utc;
use serde_json::{Value, json};

use crate::harness::*;

async fn check_body(env: &Env, body: Value) -> (u16, Value) {
    let r = env
        .http
        .post(format!("{}/v1/check", env.gw()))
        .bearer_auth(GATEWAY)
        .json(&body)
        .send()
        .await
        .expect("check request");
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

fn user_call(id: &str, project: &str, user: &str, reservation: &Value) -> Value {
    json!({
        "id": id, "type": "call", "project_id": project, "user": user,
        "occurred_at": Utc::now().to_rfc3339(), "reservation_id": reservation, "rows": 3,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_give_each_caller_its_own_allowance() {
    roles(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_give_each_caller_its_own_allowance_dev() {
    roles(Mode::Dev).await;
}

async fn roles(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_projector();
    }
    let (pid, _, _) = env.project_with_key("Asia/Kathmandu").await;

    let (s, role) = env
        .admin_post(
            &format!("/v1/projects/{pid}/roles"),
            json!({"name": "analyst", "grants": {"max_rows": 500, "query_timeout": 30}, "quota": {"calls": 2, "per": "day"}}),
        )
        .await;
    assert_eq!(s, 201, "{role}");
    let rid = role["id"].as_str().expect("role id").to_owned();
    for (body, field) in [
        (json!({"name": "x", "quota": {"per": "day"}}), "quota"),
        (json!({"name": "x", "quota": {"calls": 0, "per": "day"}}), "quota.calls"),
        (json!({"name": "x", "quota": {"calls": 5, "per": "week"}}), "quota.per"),
        (json!({"name": "x", "exempt": "yes"}), "exempt"),
    ] {
        let (s, b) = env.admin_post(&format!("/v1/projects/{pid}/roles"), body).await;
        assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!(field)), "{b}");
    }

    // Signed-in users: one counter each from the role's quota.
    for _ in 0..2 {
        let (s, b) = check_body(&env, json!({"user": "user:alice", "role_id": rid})).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(b["limits"]["max_rows"], 500, "the role's grants: {b}");
        let (s, b) = post_events(
            &env.http,
            env.gw(),
            vec![user_call(&format!("c-{}", uuid::Uuid::new_v4()), &pid, "user:alice", &b["reservation_id"])],
        )
        .await;
        assert_eq!(s, 202, "{b}");
    }
    let (s, b) = check_body(&env, json!({"user": "user:alice", "role_id": rid})).await;
    assert_eq!(s, 429, "alice used her 2 calls today: {b}");
    assert_eq!(b["error"]["code"], "QUOTA_EXCEEDED");
    assert_eq!(b["error"]["meta"]["quota_id"], format!("role:{rid}:calls"));
    assert_eq!(b["error"]["meta"]["window"], "day");
    let (s, b) = check_body(&env, json!({"user": "user:bob", "role_id": rid})).await;
    assert_eq!(s, 200, "bob's allowance is his own: {b}");
    for (body, field) in [
        (json!({"user": "alice", "role_id": rid}), "user"),
        (json!({"user": "user:alice"}), "role_id"),
        (json!({"user": "user:alice", "role_id": "role_nope"}), "role_id"),
    ] {
        let (s, b) = check_body(&env, body).await;
        assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!(field)), "{b}");
    }

    // A key with the role: the quota on the key's own counter, limits narrowed.
    let (s, k) = env
        .admin_post(
            &format!("/v1/projects/{pid}/api-keys"),
            json!({"name": "partner", "role_id": rid, "grants": {"max_rows": 1000}}),
        )
        .await;
    assert_eq!(s, 201, "{k}");
    let (kid, secret) = (k["id"].as_str().expect("id").to_owned(), k["secret"].as_str().expect("secret").to_owned());
    let (_, detail) = env.admin_get(&format!("/v1/api-keys/{kid}")).await;
    assert_eq!(detail["grants"]["max_rows"], 1000, "{detail}");
    assert_eq!(detail["effective_limits"]["max_rows"], 500, "the smaller of key and role: {detail}");
    assert_eq!(detail["effective_limits"]["query_timeout"], 30, "{detail}");
    assert_eq!(detail["quota"]["calls"], 2, "{detail}");
    for i in 0..2 {
        let r = check(&env.http, env.gw(), &secret, json!({})).await;
        assert_eq!(r.status().as_u16(), 200);
        let b: Value = r.json().await.expect("body");
        let (s, _) = post_events(
            &env.http,
            env.gw(),
            vec![call_event(&format!("k-{i}"), &pid, &kid, b["reservation_id"].as_str(), 1)],
        )
        .await;
        assert_eq!(s, 202);
    }
    let r = check(&env.http, env.gw(), &secret, json!({})).await;
    assert_eq!(r.status().as_u16(), 429, "the key's own 2 calls");
    let (_, detail) = env.admin_get(&format!("/v1/api-keys/{kid}")).await;
    assert_eq!(detail["usage_this_period"]["calls"], 2, "{detail}");

    // Administrators and break-glass: never limited, never counted.
    let (s, admins) =
        env.admin_post(&format!("/v1/projects/{pid}/roles"), json!({"name": "admins", "exempt": true})).await;
    assert_eq!(s, 201);
    env.quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 1})).await;
    for _ in 0..5 {
        let (s, b) = check_body(&env, json!({"user": "user:root", "role_id": admins["id"]})).await;
        assert_eq!((s, b["exempt"].clone()), (200, json!(true)), "{b}");
        let (s, b) = check_body(&env, json!({"break_glass": true})).await;
        assert_eq!((s, b["exempt"].clone()), (200, json!(true)), "{b}");
    }
    // The project's calls so far reach a quota created after them once they
    // are folded (they were settled only where a quota could read them).
    env.eventually(30, "the project cap of 1 call to bind everyone else", || async {
        check_body(&env, json!({"user": "user:carol", "role_id": rid})).await.0 == 429
    })
    .await;
}
