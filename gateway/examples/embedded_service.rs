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
//! 5 calls a day on that key through the provisioning service, and prints
//! the secret.
//!
//! Backends: embedded (no external service): the log and store in
//! `tollgate-example.db` (`EXAMPLE_DATA`), the view in memory, or in Redis
//! when `TOLLGATE_REDIS_URL` is set.

use std::error::Error;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Extension, Json, Router};
use gateway::embedded::Embedded;
use gateway::service::Admission;
use gateway::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
use gateway::state::{SystemClock, random_token};
use gateway::{AppState, Settings, TollgateLayer};
use meter::{Grants, Metric, Principal, WindowKind};
use serde_json::json;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Tollgate in this process: the embedded log and store in one SQLite file
/// and its projector on a thread of its own; the view in memory, or in Redis when
/// `TOLLGATE_REDIS_URL` is set (so several instances share one count).
async fn tollgate(settings: Settings) -> Result<Embedded, Box<dyn Error>> {
    let path = std::path::PathBuf::from(env("EXAMPLE_DATA", "tollgate-example.db"));
    let clock = Arc::new(SystemClock);
    #[cfg(feature = "redis")]
    if let Ok(url) = std::env::var("TOLLGATE_REDIS_URL") {
        let view = store::RedisView::connect(&url, &env("TOLLGATE_REDIS_PREFIX", "tg-example:")).await?;
        return Ok(Embedded::open_with_view(&path, settings, clock, Arc::new(view)).await?);
    }
    #[cfg(not(feature = "redis"))]
    if std::env::var_os("TOLLGATE_REDIS_URL").is_some() {
        return Err("TOLLGATE_REDIS_URL is set but this build has no `redis` feature".into());
    }
    let embedded = Embedded::open(&path, settings, clock).await?;
    Ok(embedded)
}

/// A demo project, key (its secret is returned) and a quota of 5 calls a day.
async fn demo(state: &AppState) -> Result<String, Box<dyn Error>> {
    let starter = Starter {
        project: NewProject { name: "embedded-example".into(), timezone: chrono_tz::Tz::UTC },
        key: NewApiKey {
            name: "example".into(),
            grants: Grants { max_rows: Some(50), ..Grants::default() },
            role_id: None,
        },
        quota: Some(KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: 5 }),
    };
    Ok(provisioning::provision(state, starter, &Principal::new("admin", "example")).await?.secret)
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
    // The admin and gateway tokens guard Tollgate's own HTTP API, which this
    // service does not expose; the layer does not use them.
    let settings = Settings::new(random_token(32), random_token(32));
    let embedded = tollgate(settings).await?;
    let state = embedded.state.clone();
    let secret = demo(&state).await?;

    let app =
        Router::new().route("/reports", get(reports)).route("/broken", get(broken)).layer(TollgateLayer::new(state));

    let listen = env("EXAMPLE_LISTEN", "127.0.0.1:3000");
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    println!("try: curl -i -H 'Authorization: Bearer {secret}' http://{listen}/reports   (5 calls a day)");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    embedded.shutdown().await?;
    Ok(())
}
