//! The HTTP API through `gateway::app(..)` and `oneshot` (no sockets), over
//! the embedded backends: a fresh SQLite store and log per test and the
//! in-memory view.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{TimeZone, Utc};
use gateway::{AppState, Settings};
use meter::{
    Component, EventId, EventKind, FoldBatch, Ledger, ManualClock, OffsetMove, Price, PriceKey, PriceStore, Project,
    ProjectId, TenantStore, TokenUsage, UsageFact, Usd,
};
use serde_json::{Value, json};
use store::{MemoryView, SqliteLog, SqliteStore};
use tower::ServiceExt;

/// The app over a fresh embedded store in `dir`, with one folded tokens
/// event at 20:00 UTC on 31 July (1 August in Kathmandu) and the clock
/// an hour later.
async fn app(dir: &std::path::Path) -> axum::Router {
    let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
    store.migrate().await.expect("migrate");
    let at = Utc.with_ymd_and_hms(2026, 7, 31, 20, 0, 0).single().expect("instant");
    let pid = ProjectId::parse("proj_1").expect("id");
    store
        .create_project(&Project {
            id: pid.clone(),
            name: "p".into(),
            timezone: chrono_tz::Asia::Kathmandu,
            created_at: at,
        })
        .await
        .expect("project");
    let key = |c| PriceKey { provider: "openai".into(), model: "gpt-4o".into(), component: c };
    store
        .put_prices(
            &[Price { key: key(Component::InputTokens), unit_price_usd: Usd(2_500_000), effective_from: at }],
            at,
            None,
        )
        .await
        .expect("prices");
    let fact = UsageFact {
        actor_id: Some("user_1".into()),
        agent_id: Some("agent_1".into()),
        tokens: vec![TokenUsage {
            provider: "openai".into(),
            model: "gpt-4o".into(),
            input: 1000,
            output: 7,
            ..TokenUsage::default()
        }],
        ..UsageFact::new(EventId::parse("e1").expect("id"), pid, EventKind::Tokens, at)
    };
    let batch = FoldBatch {
        consumer: "projector".into(),
        topic: "tollgate.usage".into(),
        offsets: vec![OffsetMove { partition: 0, from: 0, to: 1 }],
        facts: vec![fact],
        ..FoldBatch::default()
    };
    store.fold_batch(&batch).await.expect("fold");
    let log = SqliteLog::new(store.pool().clone(), "tollgate.");
    log.ensure_schema().await.expect("log schema");
    let clock = ManualClock::new(at + chrono::Duration::hours(1));
    let state = AppState::new(
        Arc::new(store),
        Arc::new(MemoryView::new()),
        Arc::new(log),
        Arc::new(clock),
        Settings::new("adm", "gw"),
    );
    gateway::app(state)
}

fn temp_dir(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-{what}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

async fn get(app: &axum::Router, uri: &str) -> (StatusCode, Value) {
    let req = Request::get(uri).header("authorization", "Bearer adm").body(Body::empty()).expect("request");
    send(app, req).await
}

async fn send(app: &axum::Router, req: Request<Body>) -> (StatusCode, Value) {
    let res = app.clone().oneshot(req).await.expect("response");
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn usage_reports_the_local_window_by_model_and_by_actor() {
    let dir = temp_dir("usage");
    let app = app(&dir).await;

    let (status, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=model").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body,
        json!({
            "project_id": "proj_1", "window": "calendar_month", "window_key": "2026-08", "group_by": "model",
            "data": [
                { "provider": "openai", "model": "gpt-4o", "component": "input_tokens", "meter_type": "llm_tokens",
                  "embedding": false, "priced_quantity": 1000, "unpriced_quantity": 0, "cost_usd": "0.0025" },
                { "provider": "openai", "model": "gpt-4o", "component": "output_tokens", "meter_type": "llm_tokens",
                  "embedding": false, "priced_quantity": 0, "unpriced_quantity": 7, "cost_usd": "0" },
            ],
        })
    );
    let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=actor&window=day").await;
    assert_eq!(body["window_key"], "2026-08-01");
    assert_eq!(
        body["data"],
        json!([{ "actor_id": "user_1", "requests": 0, "calls": 0, "rows": 0, "tokens": 1007, "cost_usd": "0.0025" }])
    );
    let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=agent&window=day").await;
    assert_eq!(body["data"][0]["agent_id"], "agent_1");
    // The day before, in the project's zone: nothing.
    let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=model&window=day&at=2026-07-31T18:00:00Z").await;
    assert_eq!((body["window_key"].clone(), body["data"].clone()), (json!("2026-07-31"), json!([])));
    let (_, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=api_key").await;
    assert_eq!(body["data"], json!([]));

    let (status, body) = get(&app, "/v1/usage?project_id=proj_9&group_by=model").await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::NOT_FOUND, json!("NOT_FOUND")));
    let (status, body) = get(&app, "/v1/usage?project_id=proj_1&group_by=model&window=current").await;
    assert_eq!((status, body["error"]["meta"]["field"].clone()), (StatusCode::BAD_REQUEST, json!("window")));
    let req = Request::get("/v1/usage?project_id=proj_1&group_by=model").body(Body::empty()).expect("request");
    assert_eq!(app.clone().oneshot(req).await.expect("response").status(), StatusCode::UNAUTHORIZED);
    let _ = std::fs::remove_dir_all(&dir);
}

async fn send_json(app: &axum::Router, method: &str, uri: &str, body: Value) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", "Bearer adm")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    send(app, req).await
}

/// `PUT /v1/api-keys/{id}/grants` replaces what a key is granted, refuses
/// what key creation refuses (naming the field, changing nothing), and
/// answers 404 for a key that is not there.
#[tokio::test]
async fn a_keys_grants_are_replaced_and_refused_as_on_creation() {
    let dir = temp_dir("grants");
    let app = app(&dir).await;
    let (s, k) = send_json(
        &app,
        "POST",
        "/v1/projects/proj_1/api-keys",
        json!({"name": "partner", "grants": {"max_rows": 1000, "max_concurrent": 2}}),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{k}");
    let kid = k["id"].as_str().expect("key id");
    let uri = format!("/v1/api-keys/{kid}/grants");

    let (s, d) = send_json(&app, "PUT", &uri, json!({"grants": {"max_concurrent": 4, "query_timeout": 30}})).await;
    assert_eq!(s, StatusCode::OK, "{d}");
    assert_eq!(d["grants"], json!({"max_concurrent": 4, "query_timeout": 30}), "replaced, not merged: {d}");
    assert_eq!(d["effective_limits"]["max_concurrent"], 4, "{d}");

    for (body, field) in [
        (json!({"grants": {"max_concurrent": 0}}), "grants.max_concurrent"),
        (json!({"grants": {"max_rows": "many"}}), "grants.max_rows"),
        (json!({"grants": {"max_row": 5}}), "grants.max_row"),
        (json!({"name": "renamed"}), "name"),
        (json!({"role_id": "role_nope"}), "role_id"),
    ] {
        let (s, e) = send_json(&app, "PUT", &uri, body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {e}");
        assert_eq!(e["error"]["meta"]["field"], field, "{body}: {e}");
    }
    let (_, d) = get(&app, &format!("/v1/api-keys/{kid}")).await;
    assert_eq!(d["grants"], json!({"max_concurrent": 4, "query_timeout": 30}), "refusals changed nothing: {d}");

    let (s, e) = send_json(&app, "PUT", "/v1/api-keys/key_nope/grants", json!({})).await;
    assert_eq!((s, e["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("NOT_FOUND")));
    let _ = std::fs::remove_dir_all(&dir);
}
