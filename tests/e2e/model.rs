//! The full quota model end to end (issue 4): tokens and cost with priced
//! and unpriced tallies, the blackout rule and its exceptions, storage
//! footprints, per-actor budgets — through the HTTP API, on both the
//! distributed stack and `tollgate dev`.

use chrono::Utc;
use serde_json::{Value, json};

use crate::harness::*;

fn tokens_event(id: &str, project: &str, actor: Option<&str>, model: &str, input: u64, output: u64) -> Value {
    json!({
        "id": id, "type": "tokens", "project_id": project, "agent_id": "support-bot", "actor_id": actor,
        "occurred_at": Utc::now().to_rfc3339(),
        "tokens": [{"provider": "openai", "model": model, "input": input, "output": output, "reasoning": 5}],
    })
}

async fn post_ok(env: &Env, events: Vec<Value>) {
    let (s, b) = post_events(&env.http, env.gw(), events).await;
    assert_eq!(s, 202, "events: {b}");
}

async fn status_and_body(r: reqwest::Response) -> (u16, Value, reqwest::header::HeaderMap) {
    let s = r.status().as_u16();
    let h = r.headers().clone();
    (s, r.json().await.unwrap_or(Value::Null), h)
}

/// The durable priced AI cost (picodollars) of the project's counter in a window.
async fn durable_cost(env: &Env, project: &str, window: &str) -> i64 {
    let sql = "SELECT CAST(COALESCE(SUM(cost_llm_tokens),0) AS BIGINT) FROM usage_aggregates
               WHERE project_id = $1 AND dimension = 'p' AND window_kind = $2";
    match env.mode {
        Mode::Distributed => {
            let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect");
            let r: (i64,) = sqlx::query_as(sql).bind(project).bind(window).fetch_one(&pool).await.expect("read");
            pool.close().await;
            r.0
        }
        Mode::Dev => {
            let pool = env.sqlite().await;
            let r: (i64,) = sqlx::query_as(sql).bind(project).bind(window).fetch_one(&pool).await.expect("read");
            pool.close().await;
            r.0
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_caps_are_exact_and_blackouts_refuse() {
    cost(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_caps_are_exact_and_blackouts_refuse_dev() {
    cost(Mode::Dev).await;
}

async fn cost(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_projector();
    }
    let (pid, _kid, secret) = env.project_with_key("America/New_York").await;

    // Prices are decimal strings; a float-looking number is taken as written.
    let (s, b) = env
        .admin_req(
            reqwest::Method::PUT,
            "/v1/prices",
            Some(json!({"prices": [
                {"provider": "openai", "model": "gpt-4o", "component": "input_tokens", "unit_price_usd": "0.0000025",
                 "effective_from": "2026-01-01T00:00:00Z"},
                {"provider": "openai", "model": "gpt-4o", "component": "output_tokens", "unit_price_usd": 0.00001,
                 "effective_from": "2026-01-01T00:00:00Z"},
            ]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (_, book) = env.admin_get("/v1/prices?model=gpt-4o").await;
    assert_eq!(book["data"][1]["unit_price_usd"], "0.00001", "{book}");
    for (bad, field) in [
        (
            json!({"prices": [{"provider": "openai", "model": "m", "component": "input_tokens", "unit_price_usd": "0.0000000000001"}]}),
            "prices[0].unit_price_usd",
        ),
        (
            json!({"prices": [{"provider": "openai", "model": "m", "component": "vibes", "unit_price_usd": "1"}]}),
            "prices[0].component",
        ),
        (
            json!({"prices": [{"provider": "", "model": "m", "component": "input_tokens", "unit_price_usd": "1"}]}),
            "prices[0].provider",
        ),
    ] {
        let (s, b) = env.admin_req(reqwest::Method::PUT, "/v1/prices", Some(bad)).await;
        assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!(field)), "{b}");
    }

    // A project cost cap of one cent a month (the check blocks at or over it).
    let cap = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "cost_usd", "window": "calendar_month", "limit": "0.01"}))
        .await;
    let (_, q) = env.admin_get(&format!("/v1/quotas/{cap}")).await;
    assert_eq!((q["limit"].clone(), q["on_unpriced"].clone()), (json!("0.01"), json!("block")), "{q}");

    // 1,000 input + 200 output on gpt-4o = $0.0025 + $0.002 = $0.0045; twice is $0.009.
    post_ok(
        &env,
        vec![tokens_event("t1", &pid, None, "gpt-4o", 1000, 200), tokens_event("t2", &pid, None, "gpt-4o", 1000, 200)],
    )
    .await;
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret, json!({})).await).await;
    assert_eq!(s, 200, "$0.009 of $0.01: {b}");
    let (_, q) = env.admin_get(&format!("/v1/quotas/{cap}")).await;
    assert_eq!(q["current_usage"]["count"], "0.009", "{q}");
    post_ok(&env, vec![tokens_event("t3", &pid, None, "gpt-4o", 400, 0)]).await;
    let (s, b, h) = status_and_body(check(&env.http, env.gw(), &secret, json!({})).await).await;
    assert_eq!(s, 429, "$0.01 reached: {b}");
    assert_eq!(b["error"]["code"], "QUOTA_EXCEEDED");
    assert_eq!(
        (b["error"]["meta"]["metric"].clone(), b["error"]["meta"]["limit"].clone()),
        (json!("cost_usd"), json!("0.01"))
    );
    assert!(h.get("retry-after").is_some());
    // The durable fold prices the same events to the same picodollar.
    env.eventually(30, "the cost folded", || async {
        durable_cost(&env, &pid, "calendar_month").await == 10_000_000_000
    })
    .await;

    // Another project: nothing priced. Two unpriced events pass (the
    // exception files from the first); the third makes a blackout.
    let (pid2, _, secret2) = env.project_with_key("Asia/Kathmandu").await;
    let cap2 = env
        .quota(json!({"project_id": pid2, "scope": "project", "metric": "cost_usd", "window": "day", "limit": 25}))
        .await;
    post_ok(
        &env,
        vec![tokens_event("u1", &pid2, None, "mystery", 10, 10), tokens_event("u2", &pid2, None, "mystery", 10, 10)],
    )
    .await;
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret2, json!({})).await).await;
    assert_eq!(s, 200, "two unpriced events pass: {b}");
    let mut exceptions = Value::Null;
    for _ in 0..50 {
        let (_, e) = env.admin_get(&format!("/v1/exceptions?project_id={pid2}")).await;
        exceptions = e;
        if exceptions["data"].as_array().is_some_and(|d| d.len() == 1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let e = &exceptions["data"][0];
    assert_eq!(
        (e["kind"].clone(), e["quota_id"].clone(), e["severity"].clone()),
        (json!("quota_unpriced"), json!(cap2), json!("warning"))
    );
    assert_eq!((e["llm_events"].clone(), e["unpriced_events"].clone()), (json!(2), json!(2)), "{e}");
    assert_eq!(e["unpriced_rows"].as_array().map(Vec::len), Some(2), "input and output of the mystery model: {e}");

    post_ok(&env, vec![tokens_event("u3", &pid2, None, "mystery", 10, 10)]).await;
    let (s, b, h) = status_and_body(check(&env.http, env.gw(), &secret2, json!({})).await).await;
    assert_eq!(s, 409, "three unpriced and none priced: {b}");
    assert_eq!(b["error"]["code"], "QUOTA_UNENFORCEABLE");
    assert!(h.get("retry-after").is_none(), "waiting is no remedy");
    let rows = b["error"]["meta"]["unpriced_rows"].as_array().cloned().unwrap_or_default();
    assert_eq!(rows.len(), 2, "{b}");
    assert!(rows.contains(&json!({"provider": "openai", "model": "mystery", "component": "input_tokens"})), "{b}");
    assert_eq!(b["error"]["meta"]["limit"], "25");

    // Pricing the model's input lifts the blackout: a partly priced window
    // passes, and the exception keeps counting (output is still unpriced).
    let (s, b) = env
        .admin_req(
            reqwest::Method::PUT,
            "/v1/prices",
            Some(json!({"prices": [{"provider": "openai", "model": "mystery", "component": "input_tokens",
                                    "unit_price_usd": "0.000001", "effective_from": "2026-01-01T00:00:00Z"}]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    post_ok(&env, vec![tokens_event("u4", &pid2, None, "mystery", 10, 10)]).await;
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret2, json!({})).await).await;
    assert_eq!(s, 200, "a partly priced window never refuses: {b}");
    let mut count = 0;
    for _ in 0..50 {
        let (_, ex) = env.admin_get(&format!("/v1/exceptions?project_id={pid2}")).await;
        assert_eq!(ex["data"].as_array().map(Vec::len), Some(1), "deduplicated on the quota: {ex}");
        count = ex["data"][0]["occurrence_count"].as_u64().unwrap_or(0);
        if count >= 3 && ex["data"][0]["llm_events"] == json!(4) {
            assert_eq!(ex["data"][0]["unpriced_events"], json!(4), "every event has unpriced output: {ex}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(count >= 3, "one occurrence per check under the degraded cap");

    // Monitor never blocks, whatever on_unpriced says; it still files.
    let (pid3, _, secret3) = env.project_with_key("UTC").await;
    env.quota(json!({"project_id": pid3, "scope": "project", "metric": "cost_usd", "window": "day", "limit": 1,
                     "mode": "monitor", "on_unpriced": "block"}))
        .await;
    post_ok(&env, (1..=3).map(|i| tokens_event(&format!("m{i}"), &pid3, None, "mystery2", 10, 10)).collect()).await;
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret3, json!({})).await).await;
    assert_eq!(s, 200, "monitor never blocks: {b}");
    env.eventually(10, "the monitor quota's exception", || async {
        let (_, ex) = env.admin_get(&format!("/v1/exceptions?project_id={pid3}")).await;
        ex["data"].as_array().is_some_and(|d| d.len() == 1)
    })
    .await;

    // on_unpriced is only for cost_usd; meter types are checked.
    for (body, field) in [
        (
            json!({"project_id": pid2, "scope": "project", "metric": "tokens", "window": "day", "limit": 5, "on_unpriced": "allow"}),
            "on_unpriced",
        ),
        (
            json!({"project_id": pid2, "scope": "project", "metric": "cost_usd", "window": "day", "limit": 5, "meter_type": "gpu"}),
            "meter_type",
        ),
        (
            json!({"project_id": pid2, "scope": "project", "metric": "cost_usd", "window": "day", "limit": "0.0000000000001"}),
            "limit",
        ),
    ] {
        let (s, b) = env.admin_post("/v1/quotas", body).await;
        assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!(field)), "{b}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_and_actor_budgets() {
    storage_and_actors(Mode::Distributed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_and_actor_budgets_dev() {
    storage_and_actors(Mode::Dev).await;
}

async fn storage_and_actors(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_projector();
    }
    let (pid, _kid, secret) = env.project_with_key("UTC").await;

    // Storage: a snapshot of 600 bytes under a 1,000-byte cap.
    let cap = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "storage_bytes", "window": "current", "limit": 1000}))
        .await;
    post_ok(
        &env,
        vec![json!({"id": "snap-1", "type": "storage_snapshot", "project_id": pid, "occurred_at": Utc::now().to_rfc3339(), "storage_bytes": 600})],
    )
    .await;
    env.eventually(30, "the snapshot folded", || async {
        let (_, q) = env.admin_get(&format!("/v1/quotas/{cap}")).await;
        q["current_usage"]["count"] == json!(600)
    })
    .await;
    let (s, b, _) =
        status_and_body(check(&env.http, env.gw(), &secret, json!({"storage_bytes_delta": 400})).await).await;
    assert_eq!(s, 200, "600 + 400 is the limit itself: {b}");
    let (s, b, h) =
        status_and_body(check(&env.http, env.gw(), &secret, json!({"storage_bytes_delta": 401})).await).await;
    assert_eq!(s, 409, "{b}");
    assert_eq!(b["error"]["code"], "QUOTA_STORAGE_EXCEEDED");
    assert_eq!(
        (b["error"]["meta"]["current_bytes"].clone(), b["error"]["meta"]["limit"].clone()),
        (json!(600), json!(1000))
    );
    assert!(b["error"]["meta"].get("resets_at").is_none(), "nothing resets: {b}");
    assert!(h.get("retry-after").is_none());
    // A write's delta settles at once; a delete is never refused.
    post_ok(
        &env,
        vec![json!({"id": "w-1", "type": "storage_delta", "project_id": pid, "occurred_at": Utc::now().to_rfc3339(), "storage_bytes": 400})],
    )
    .await;
    let (s, _, _) = status_and_body(check(&env.http, env.gw(), &secret, json!({"storage_bytes_delta": 1})).await).await;
    assert_eq!(s, 409, "the footprint is now 1,000");
    let (s, _, _) =
        status_and_body(check(&env.http, env.gw(), &secret, json!({"storage_bytes_delta": -5000})).await).await;
    assert_eq!(s, 200, "deletes are never refused");
    let (s, b) = post_events(
        &env.http,
        env.gw(),
        vec![json!({"id": "bad", "type": "storage_snapshot", "project_id": pid, "occurred_at": Utc::now().to_rfc3339(), "storage_bytes": -1})],
    )
    .await;
    assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!("events[0].storage_bytes")), "{b}");

    // Actors: one tokens budget per actor under one null-ref quota.
    env.quota(json!({"project_id": pid, "scope": "actor", "scope_ref": null, "metric": "tokens", "window": "day", "limit": 100}))
        .await;
    post_ok(&env, vec![tokens_event("a1", &pid, Some("alice"), "any", 60, 40)]).await;
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret, json!({"actor_id": "alice"})).await).await;
    assert_eq!(s, 429, "alice used her 100: {b}");
    assert_eq!(
        (b["error"]["meta"]["metric"].clone(), b["error"]["meta"]["limit"].clone()),
        (json!("tokens"), json!(100))
    );
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret, json!({"actor_id": "bob"})).await).await;
    assert_eq!(s, 200, "bob's budget is his own: {b}");

    // Precedence: a project tokens cap and the actor cap both breach; the actor is reported.
    env.quota(
        json!({"project_id": pid, "scope": "project", "metric": "tokens", "window": "calendar_month", "limit": 50}),
    )
    .await;
    // The project's month counter was not watched when the tokens event was
    // settled (no quota read it), so it carries that usage once it is folded.
    env.eventually(10, "the tokens event folded into the project's month", || async {
        env.durable_tokens(&pid, "p", "calendar_month").await >= 100
    })
    .await;
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret, json!({"actor_id": "alice"})).await).await;
    assert_eq!(s, 429);
    assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains("actor")), "{b}");
    let (s, b, _) = status_and_body(check(&env.http, env.gw(), &secret, json!({"actor_id": "bob"})).await).await;
    assert_eq!(s, 429, "the project cap binds bob too: {b}");
    assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains("project")), "{b}");
}
