//! A small axum service metered in-process by [`TollgateLayer`].
//!
//! `GET /reports` returns some rows and reports how many in `x-tollgate-rows`;
//! the layer identifies the caller by API key, refuses over-quota calls with
//! the documented 429, counts the call and its rows, and strips the header.
//! `GET /broken` fails with 500: the layer releases its reservation and counts
//! nothing.
//!
//! ```text
//! cargo run -p gateway --example embedded_service
//! curl -i -H 'Authorization: Bearer <printed secret>' http://127.0.0.1:3000/reports
//! ```
//!
//! At start-up it creates a demo project, an API key and a quota of
//! 5 calls a day on that key through the Store port, and prints the secret.
//!
//! Backends: for now PostgreSQL, Redis and Kafka, from `TOLLGATE_DATABASE_URL`,
//! `TOLLGATE_REDIS_URL` and `TOLLGATE_KAFKA_BROKERS` (local defaults). Only
//! [`backends`] knows which; see there for the switch to the embedded ones.

use std::error::Error;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Extension, Json, Router};
use chrono::Utc;
use gateway::hot::Admission;
use gateway::state::{SystemClock, hash_secret, new_id, random_token};
use gateway::{AppState, Settings, TollgateLayer};
use meter::{ApiKey, ApiKeyId, Grants, Log, Mode, Project, ProjectId, Quota, QuotaId, QuotaSpec, Scope, Store, View};
use serde_json::json;

type Ports = (Arc<dyn Store>, Arc<dyn View>, Arc<dyn Log>);

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The ports the layer runs on: the only place that names a technology.
///
/// To run with no external service, replace the body with the embedded
/// backends (as `tollgate dev` does in src/main.rs's `dev` module), e.g.:
///
/// ```ignore
/// let store = store::SqliteStore::open("tollgate-example.db").await?;
/// store.migrate().await?;
/// let log = store::SqliteLog::new(store.pool().clone(), "tollgate.");
/// log.ensure_schema().await?;
/// let view = store::MemoryView::new();
/// Ok((Arc::new(store), Arc::new(view), Arc::new(log)))
/// ```
///
/// (The embedded view lives in this process, so a separate projector cannot
/// fold into it; run the projector in-process too, as `tollgate dev` does,
/// or let the view's pending deltas carry the window.)
async fn backends() -> Result<Ports, Box<dyn Error>> {
    let database_url = env("TOLLGATE_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate");
    let redis_url = env("TOLLGATE_REDIS_URL", "redis://127.0.0.1:6379");
    let brokers = env("TOLLGATE_KAFKA_BROKERS", "127.0.0.1:9092");
    let store = store::PgStore::connect(&database_url).await?;
    store.migrate().await?;
    let view = store::RedisView::connect(&redis_url, &env("TOLLGATE_REDIS_PREFIX", "tg:")).await?;
    let kafka = store::KafkaConfig::new(brokers, env("TOLLGATE_TOPIC_PREFIX", "tollgate."));
    kafka.ensure_topics().await?;
    let log = store::KafkaLog::new(&kafka)?;
    Ok((Arc::new(store), Arc::new(view), Arc::new(log)))
}

/// A demo project, key (its secret is returned) and a quota of 5 calls a day.
async fn demo(store: &dyn Store) -> Result<String, Box<dyn Error>> {
    let now = Utc::now();
    let project = Project {
        id: ProjectId::parse(new_id("proj"))?,
        name: "embedded-example".into(),
        timezone: chrono_tz::Tz::UTC,
        created_at: now,
    };
    store.create_project(&project).await?;
    let secret = format!("tg_{}", random_token(40));
    let key = ApiKey {
        id: ApiKeyId::parse(new_id("key"))?,
        project_id: project.id.clone(),
        name: "example".into(),
        prefix: secret.chars().take(10).collect(),
        grants: Grants { max_rows: Some(50), ..Grants::default() },
        created_at: now,
    };
    store.create_api_key(&key, &hash_secret(&secret)).await?;
    let quota = Quota {
        id: QuotaId::parse(new_id("quota"))?,
        spec: QuotaSpec {
            project_id: project.id.clone(),
            scope: Scope::ApiKey,
            scope_ref: Some(key.id.to_string()),
            metric: meter::Metric::Calls,
            window: meter::WindowKind::Day,
            limit: 5,
            mode: Mode::Enforce,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: now,
        updated_at: now,
    };
    store.create_quota(&quota).await?;
    Ok(secret)
}

/// Returns up to the key's `max_rows` rows and says how many it returned.
async fn reports(Extension(admission): Extension<Admission>) -> impl IntoResponse {
    let max = admission.key.grants.max_rows.unwrap_or(100).min(3);
    let rows: Vec<_> = (1..=max).map(|i| json!({ "id": i, "total": i * 100 })).collect();
    ([("x-tollgate-rows", rows.len().to_string())], Json(json!({ "rows": rows })))
}

async fn broken() -> impl IntoResponse {
    (StatusCode::INTERNAL_SERVER_ERROR, "the report database is down")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt().with_env_filter(env("RUST_LOG", "info")).init();
    let (store, view, log) = backends().await?;
    let secret = demo(store.as_ref()).await?;

    // The admin and gateway tokens guard Tollgate's own HTTP API, which this
    // service does not expose; the layer does not use them.
    let settings = Settings::new(random_token(32), random_token(32));
    let state = AppState::new(store, view, log, Arc::new(SystemClock), settings);

    let app =
        Router::new().route("/reports", get(reports)).route("/broken", get(broken)).layer(TollgateLayer::new(state));

    let listen = env("EXAMPLE_LISTEN", "127.0.0.1:3000");
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    println!("try: curl -i -H 'Authorization: Bearer {secret}' http://{listen}/reports   (5 calls a day)");
    axum::serve(listener, app).await?;
    Ok(())
}
