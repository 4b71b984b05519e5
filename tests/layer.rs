//! The tower layer, driven through `oneshot` (no sockets), on both kinds of
//! backend: the distributed ones (PostgreSQL, Redis and a Kafka-protocol
//! broker on 127.0.0.1, with a fresh database, Redis prefix and topic prefix
//! per test) and the embedded ones (`gateway::embedded::Embedded`: SQLite log
//! and store in two fresh files, the in-memory view, the projector on a
//! thread of its own).
//! It lives in the root package, which builds every backend: `gateway`'s
//! own tests need only the embedded ones. A distributed test is skipped,
//! with its reason, when a service does not answer (`testkit`), unless
//! `TOLLGATE_REQUIRE_SERVICES` is set.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::get;
use chrono::{Timelike, Utc};
use gateway::service::provisioning::{self, KeyQuota, NewApiKey, NewProject, Starter};
use gateway::state::SystemClock;
use gateway::{AppState, Settings, TollgateLayer};
use meter::{ApiKey, CounterKey, Dimension, Grants, Metric, Principal, Project, Quota, View, WindowKind, window_at};
use serde_json::Value;
use store::{KafkaConfig, KafkaLog, PgStore, RedisView};
use tower::ServiceExt;

/// A time zone whose current day has run for two hours and has two left,
/// so a `day` window never turns over during a test.
fn safe_timezone() -> chrono_tz::Tz {
    let zones = [
        (chrono_tz::Tz::UTC, 0i64),
        (chrono_tz::Asia::Tokyo, 9),
        (chrono_tz::America::New_York, -5),
        (chrono_tz::Asia::Kolkata, 5),
    ];
    let h = Utc::now().hour() as i64;
    zones.into_iter().find(|(_, off)| (2..=21).contains(&(h + off).rem_euclid(24))).map_or(chrono_tz::Tz::UTC, |z| z.0)
}

/// One isolated environment with a project and a key in it.
struct Env {
    state: AppState,
    view: Arc<dyn View>,
    /// The embedded deployment and its data directory, kept alive.
    _embedded: Option<(gateway::embedded::Embedded, std::path::PathBuf)>,
    project: Project,
    key: ApiKey,
    secret: String,
    /// How many times a handler ran.
    hits: Arc<AtomicUsize>,
    /// The distributed deployment's database and Redis keys, dropped with it.
    _services: Option<(testkit::TestDb, testkit::RedisPrefix)>,
}

/// Which backends a test runs on.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Distributed,
    Embedded,
}

/// `None` when the backends cannot run here (the test is then skipped).
async fn env(backend: Backend) -> Option<Env> {
    match backend {
        Backend::Distributed => distributed().await,
        Backend::Embedded => Some(embedded().await),
    }
}

/// Who the tests' quotas are audited as.
fn tester() -> Principal {
    Principal::new("admin", "layer-test")
}

/// A project and a key in it, created through the provisioning service.
async fn project_and_key(state: &AppState) -> (Project, ApiKey, String) {
    let starter = Starter {
        project: NewProject { name: "layer".into(), timezone: safe_timezone() },
        key: NewApiKey { name: "k".into(), ..NewApiKey::default() },
        quota: None,
    };
    let made = provisioning::provision(state, starter, &tester()).await.expect("create project and key");
    (made.project, made.key, made.secret)
}

async fn embedded() -> Env {
    let id = testkit::unique_id();
    let dir = std::env::temp_dir().join(format!("tg-layer-{id}"));
    std::fs::create_dir_all(&dir).expect("data dir");
    let mut settings = Settings::new("admin-token-layer", "gateway-token-layer");
    settings.instance = format!("layer-{id}");
    let e = gateway::embedded::Embedded::open(&dir.join("tollgate.db"), settings, Arc::new(SystemClock))
        .await
        .expect("open the embedded deployment");
    let (project, key, secret) = project_and_key(&e.state).await;
    let (state, view) = (e.state.clone(), e.state.view.clone());
    Env { state, view, _embedded: Some((e, dir)), project, key, secret, hits: Arc::default(), _services: None }
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some((_, dir)) = &self._embedded {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

async fn distributed() -> Option<Env> {
    use testkit::Service::{Kafka, Postgres, Redis};
    if !testkit::available(&[Postgres, Redis, Kafka]) {
        return None;
    }
    let id = testkit::unique_id();
    let db = testkit::TestDb::new("tg_layer").await;
    let store = PgStore::connect(&db.url).await.expect("connect test database");
    store.migrate().await.expect("migrate");
    let keys = testkit::RedisPrefix::new("tglayer");
    let view = Arc::new(RedisView::connect(&keys.url, &keys.prefix).await.expect("connect redis"));
    let mut kcfg = KafkaConfig::new(testkit::env::kafka(), testkit::topic_prefix("tglayer"));
    // A busy shared broker can take longer than the 2 s default to acknowledge.
    kcfg.publish = store::PublishOptions { timeout: Duration::from_secs(30), ..store::PublishOptions::default() };
    let mut attempt = 0;
    while let Err(e) = kcfg.ensure_topics().await {
        attempt += 1;
        assert!(attempt < 10, "creating topics: {e}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let log = KafkaLog::new(&kcfg).expect("kafka producer");

    let mut settings = Settings::new("admin-token-layer", "gateway-token-layer");
    settings.instance = format!("layer-{id}");
    let view: Arc<dyn View> = view;
    let state = AppState::new(Arc::new(store), view.clone(), Arc::new(log), Arc::new(SystemClock), settings);
    let (project, key, secret) = project_and_key(&state).await;
    Some(Env { state, view, _embedded: None, project, key, secret, hits: Arc::default(), _services: Some((db, keys)) })
}

impl Env {
    /// An enforce quota on this key, `day` window, through the quota
    /// service (which forgets the project's cached configuration).
    async fn quota(&self, metric: Metric, limit: u64) -> Quota {
        let q = KeyQuota { metric, window: WindowKind::Day, limit };
        provisioning::key_quota(&self.state, &self.key, q, &tester()).await.expect("create quota")
    }

    /// A service with the layer: `/reports` returns 7 rows, `/bad-rows` a
    /// rows header that is no number, `/fail` a 500, `/nothing` no header.
    fn app(&self) -> Router {
        let hit = |hits: Arc<AtomicUsize>| {
            move || {
                hits.fetch_add(1, Ordering::SeqCst);
            }
        };
        let (a, b, c, d) =
            (hit(self.hits.clone()), hit(self.hits.clone()), hit(self.hits.clone()), hit(self.hits.clone()));
        Router::new()
            .route(
                "/reports",
                get(move || async move {
                    a();
                    ([("x-tollgate-rows", "7")], "seven rows")
                }),
            )
            .route(
                "/bad-rows",
                get(move || async move {
                    b();
                    ([("x-tollgate-rows", "lots")], "some rows")
                }),
            )
            .route(
                "/fail",
                get(move || async move {
                    c();
                    (StatusCode::INTERNAL_SERVER_ERROR, [("x-tollgate-rows", "3")], "boom")
                }),
            )
            .route(
                "/nothing",
                get(move || async move {
                    d();
                    "ok"
                }),
            )
            .layer(TollgateLayer::new(self.state.clone()))
    }

    async fn get(&self, path: &str) -> Response {
        self.get_with(path, Some(("authorization", format!("Bearer {}", self.secret)))).await
    }

    async fn get_with(&self, path: &str, header: Option<(&str, String)>) -> Response {
        let mut req = Request::get(path);
        if let Some((n, v)) = header {
            req = req.header(n, v);
        }
        self.app().oneshot(req.body(Body::empty()).expect("request")).await.expect("infallible")
    }

    /// The key's `day` counter in the view.
    async fn usage(&self) -> meter::Totals {
        self.usage_of(&self.key).await
    }

    /// A key's `day` counter in the view.
    async fn usage_of(&self, key: &ApiKey) -> meter::Totals {
        let now = Utc::now();
        let w = window_at(WindowKind::Day, self.project.timezone, now);
        let counter =
            CounterKey { dimension: Dimension::ApiKey(key.id.clone()), window: WindowKind::Day, window_key: w.key };
        let u = self.view.usage(&self.project.id, &counter, now).await.expect("view usage").expect("seeded");
        let mut t = u.durable;
        t.add(u.pending);
        assert_eq!(u.reserved_calls, 0, "no reservation left held");
        t
    }
}

impl Env {
    /// Another key of this project, with these grants: its secret.
    async fn key_with(&self, grants: Grants) -> String {
        self.bounded_key(grants).await.1
    }

    /// Another key of this project, with these grants and a `rows` quota
    /// (so its counter is in the view): the key and its secret.
    async fn bounded_key(&self, grants: Grants) -> (ApiKey, String) {
        let new = NewApiKey { name: "bounded".into(), role_id: None, grants };
        let made =
            provisioning::create_api_key(&self.state, &self.project.id, new, &tester()).await.expect("create key");
        let q = KeyQuota { metric: Metric::Rows, window: WindowKind::Day, limit: 1_000_000 };
        provisioning::key_quota(&self.state, &made.key, q, &tester()).await.expect("create quota");
        (made.key, made.secret)
    }

    /// The key's rows once `expected` (a stream is settled by a task of its
    /// own when its body ends), or what they are after 5 s.
    async fn rows_soon(&self, key: &ApiKey, expected: u64) -> (u64, u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let u = self.usage_of(key).await;
            if u.rows == expected || tokio::time::Instant::now() > deadline {
                return (u.calls, u.rows);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A service whose pages and streams report `n` rows (`/page/{n}`: a JSON
/// array, `/text/{n}`: plain text, `/rows/{n}`: a JSON Lines stream; a
/// `/slow-rows` stream sends a row every 200 ms, 20 in all).
fn paging_app(state: &AppState) -> Router {
    use axum::extract::Path;
    use axum::response::IntoResponse;
    let rows_header = |n: u64| [("x-tollgate-rows", n.to_string())];
    Router::new()
        .route(
            "/page/{n}",
            get(move |Path(n): Path<u64>| async move {
                (rows_header(n), axum::Json((0..n).map(|i| serde_json::json!({"i": i})).collect::<Vec<_>>()))
            }),
        )
        .route("/text/{n}", get(move |Path(n): Path<u64>| async move { (rows_header(n), "row\n".repeat(n as usize)) }))
        .route(
            "/rows/{n}",
            get(|Path(n): Path<u64>| async move {
                // Rows split across frames, two and a half rows per frame.
                let text: String = (0..n).map(|i| format!("{{\"i\":{i}}}\n")).collect();
                let frames: Vec<Result<axum::body::Bytes, std::convert::Infallible>> =
                    text.as_bytes().chunks(20).map(|c| Ok(axum::body::Bytes::copy_from_slice(c))).collect();
                let mut res = Body::from_stream(futures::stream::iter(frames)).into_response();
                res.extensions_mut().insert(gateway::layer::RowStream);
                res
            }),
        )
        .route(
            "/slow-rows",
            get(|| async {
                let rows = futures::stream::unfold(0u64, |i| async move {
                    if i == 20 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Some((
                        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(format!("{{\"i\":{i}}}\n"))),
                        i + 1,
                    ))
                });
                let mut res = Body::from_stream(rows).into_response();
                res.extensions_mut().insert(gateway::layer::RowStream);
                res
            }),
        )
        .layer(TollgateLayer::new(state.clone()))
}

async fn text_of(res: Response) -> String {
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
    String::from_utf8(bytes.to_vec()).expect("utf-8")
}

/// `max_rows` 5: a JSON page of 8 is cut to 5 with `X-Has-More`, one of 5
/// is sent whole, a text body of 8 is refused and counts nothing; the rows
/// counted never pass 5 a call.
async fn a_page_is_cut_to_max_rows(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let (key, secret) = env.bounded_key(Grants { max_rows: Some(5), ..Grants::default() }).await;
    let app = paging_app(&env.state);

    let res = send(&app, "/page/8", &secret).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "x-has-more"), Some("true"));
    let page = body_json(res).await;
    assert_eq!(page, serde_json::json!([{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}, {"i": 4}]));
    assert_eq!(env.usage_of(&key).await.rows, 5, "the rows sent, not the rows reported");

    let res = send(&app, "/page/5", &secret).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(header(&res, "x-has-more").is_none(), "a page within max_rows is not cut");
    assert_eq!(body_json(res).await.as_array().map(Vec::len), Some(5));
    assert_eq!(env.usage_of(&key).await.rows, 10);

    let res = send(&app, "/text/8", &secret).await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = body_json(res).await;
    assert_eq!(body["error"]["code"], "ROWS_OVER_LIMIT", "{body}");
    let u = env.usage_of(&key).await;
    assert_eq!((u.calls, u.rows), (2, 10), "a refused page counts nothing");
}

/// `max_rows` 4: a stream of 10 rows stops after 4 with the ROWS mark; a
/// stream of exactly 4 ends with no mark; rows are counted as sent.
async fn a_stream_stops_at_max_rows(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let (key, secret) = env.bounded_key(Grants { max_rows: Some(4), ..Grants::default() }).await;
    let app = paging_app(&env.state);

    let res = send(&app, "/rows/10", &secret).await;
    assert_eq!(res.status(), StatusCode::OK);
    let text = text_of(res).await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        vec![r#"{"i":0}"#, r#"{"i":1}"#, r#"{"i":2}"#, r#"{"i":3}"#, r#"{"limit":4,"mark":"ROWS"}"#],
        "{text}"
    );
    assert_eq!(env.rows_soon(&key, 4).await, (1, 4));

    let res = send(&app, "/rows/4", &secret).await;
    let text = text_of(res).await;
    assert_eq!(text.lines().count(), 4, "no mark when the stream ends at the bound: {text}");
    assert_eq!(env.rows_soon(&key, 8).await, (2, 8));
}

/// `query_timeout` 1 s: a stream sending a row every 200 ms ends at 1 s
/// with the TIME mark, the rows before it counted.
async fn a_stream_stops_at_its_query_timeout(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let (key, secret) = env.bounded_key(Grants { query_timeout: Some(1), ..Grants::default() }).await;
    let app = paging_app(&env.state);
    let started = std::time::Instant::now();
    let text = text_of(send(&app, "/slow-rows", &secret).await).await;
    let took = started.elapsed();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.last().copied(), Some(r#"{"limit_ms":1000,"mark":"TIME"}"#), "{text}");
    let rows = (lines.len() - 1) as u64;
    assert!((1..=5).contains(&rows), "{rows} rows in 1 s at one per 200 ms: {text}");
    assert!(took < Duration::from_secs(3), "stopped at the bound, not at the stream's end: {took:?}");
    assert_eq!(env.rows_soon(&key, rows).await, (1, rows));
}

async fn send(app: &Router, path: &str, secret: &str) -> Response {
    let req = Request::get(path).header("authorization", format!("Bearer {secret}")).body(Body::empty());
    app.clone().oneshot(req.expect("request")).await.expect("infallible")
}

/// Asks `path` until it is answered 200 (a permit freed by a finished or
/// dropped body is released by a task of its own), for at most 5 s.
async fn admitted_soon(app: &Router, path: &str, secret: &str) -> Response {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let res = send(app, path, secret).await;
        if res.status() == StatusCode::OK || tokio::time::Instant::now() > deadline {
            return res;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn assert_too_many_concurrent(res: Response) {
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    let body = body_json(res).await;
    assert_eq!(body["error"]["code"], "TOO_MANY_CONCURRENT", "{body}");
    assert_eq!(
        (body["error"]["meta"]["limit"].clone(), body["error"]["meta"]["whose"].clone()),
        (1.into(), "api_key".into()),
        "{body}"
    );
}

/// `max_concurrent` 1: a response whose body is still being sent holds the
/// key's slot; the body's end frees it, and so does a body dropped unread.
async fn a_permit_is_held_for_the_life_of_the_response_body(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let secret = env.key_with(Grants { max_concurrent: Some(1), ..Grants::default() }).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<axum::body::Bytes>(1);
    let rx = Arc::new(tokio::sync::Mutex::new(Some(rx)));
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let rx = rx.clone();
                async move {
                    let rx = rx.lock().await.take().expect("one stream");
                    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
                        rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
                    }))
                }
            }),
        )
        .route("/nothing", get(|| async { "ok" }))
        .layer(TollgateLayer::new(env.state.clone()));

    let streaming = send(&app, "/stream", &secret).await;
    assert_eq!(streaming.status(), StatusCode::OK);
    assert_too_many_concurrent(send(&app, "/nothing", &secret).await).await;
    // Still held a while later: nothing but the body's end frees it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_too_many_concurrent(send(&app, "/nothing", &secret).await).await;
    // A frame sent and read: the body goes on, and so does its hold.
    use futures::StreamExt;
    let mut body = streaming.into_body().into_data_stream();
    tx.send(axum::body::Bytes::from_static(b"part")).await.expect("the stream reads");
    assert_eq!(body.next().await.expect("a frame").expect("data"), &b"part"[..]);
    // (Long enough for a release, which runs in a task of its own.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_too_many_concurrent(send(&app, "/nothing", &secret).await).await;
    drop(tx);
    assert!(body.next().await.is_none(), "the stream ended");

    let unread = admitted_soon(&app, "/nothing", &secret).await;
    assert_eq!(unread.status(), StatusCode::OK, "the finished body freed the slot");
    // Its body, not read yet, holds the slot; dropping it frees it.
    assert_too_many_concurrent(send(&app, "/nothing", &secret).await).await;
    drop(unread);
    let res = admitted_soon(&app, "/nothing", &secret).await;
    assert_eq!(res.status(), StatusCode::OK, "the dropped body freed the slot");
}

/// A handler past the key's `query_timeout` is cancelled and answered
/// `503 heavy-request-timed-out`; the call counts nothing.
async fn a_handler_past_its_query_timeout_is_cancelled(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let secret = env.key_with(Grants { query_timeout: Some(1), ..Grants::default() }).await;
    let finished = Arc::new(AtomicUsize::new(0));
    let f = finished.clone();
    let app = Router::new()
        .route(
            "/slow",
            get(move || {
                let f = f.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(4)).await;
                    f.fetch_add(1, Ordering::SeqCst);
                    "late"
                }
            }),
        )
        .layer(TollgateLayer::new(env.state.clone()));
    let started = std::time::Instant::now();
    let res = send(&app, "/slow", &secret).await;
    let took = started.elapsed();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = body_json(res).await;
    assert_eq!(body["error"]["code"], "heavy-request-timed-out", "{body}");
    assert!(took >= Duration::from_millis(950) && took < Duration::from_secs(3), "answered after {took:?}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(finished.load(Ordering::SeqCst), 0, "the handler was cancelled, not left running");
}

/// `X-Tollgate-Explain: 1`: the admitted call's response carries the
/// check's explanation in the same header; a refused one's body carries it
/// beside the unchanged `error`; without the header, neither.
async fn a_call_asking_to_be_explained_is(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let q = env.quota(Metric::Calls, 1).await;
    let ask = |explain: bool| {
        let mut req = Request::get("/nothing").header("authorization", format!("Bearer {}", env.secret));
        if explain {
            req = req.header("x-tollgate-explain", "1");
        }
        env.app().oneshot(req.body(Body::empty()).expect("request"))
    };
    let res = ask(true).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::OK);
    let list: Value = serde_json::from_str(header(&res, "x-tollgate-explain").expect("explained")).expect("json");
    let e = &list.as_array().expect("a list")[0];
    assert_eq!(
        (e["quota_id"].clone(), e["used"].clone(), e["limit"].clone()),
        (q.id.as_str().into(), 0.into(), 1.into()),
        "{list}"
    );
    assert_eq!(e["verdict"], "within", "{list}");

    let refused = ask(true).await.expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = body_json(refused).await;
    assert_eq!(body["error"]["code"], "QUOTA_EXCEEDED", "{body}");
    assert_eq!(
        (body["explain"][0]["verdict"].clone(), body["explain"][0]["reported"].clone()),
        ("refused".into(), true.into()),
        "{body}"
    );

    let plain = ask(false).await.expect("infallible");
    let body = body_json(plain).await;
    assert!(body.get("explain").is_none(), "{body}");

    // A value that is no flag is refused before anything is checked.
    let hits = env.hits.load(Ordering::SeqCst);
    let req = Request::get("/nothing")
        .header("authorization", format!("Bearer {}", env.secret))
        .header("x-tollgate-explain", "please")
        .body(Body::empty())
        .expect("request");
    let res = env.app().oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = body_json(res).await;
    assert_eq!(body["error"]["meta"]["field"], "x-tollgate-explain", "{body}");
    assert_eq!(env.hits.load(Ordering::SeqCst), hits, "the service was not called");
}

async fn body_json(res: Response) -> Value {
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
    serde_json::from_slice(&bytes).expect("json body")
}

fn header<'a>(res: &'a Response, name: &str) -> Option<&'a str> {
    res.headers().get(name).map(|v| v.to_str().expect("ascii header"))
}

async fn a_calls_quota_refuses_exactly_the_call_after_the_limit(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    let q = env.quota(Metric::Calls, 3).await;
    for left in [2, 1, 0] {
        let res = env.get("/nothing").await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(&res, "x-quota-remaining-calls"), Some(left.to_string().as_str()));
        assert!(header(&res, "x-quota-reset").is_some(), "X-Quota-Reset on an admitted call");
    }
    assert_eq!(env.hits.load(Ordering::SeqCst), 3);

    let res = env.get("/nothing").await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = header(&res, "retry-after").expect("Retry-After").parse().expect("seconds");
    assert!(retry > 0 && retry <= 86_400, "retry-after {retry}");
    assert_eq!(header(&res, "x-quota-remaining-calls"), Some("0"));
    assert!(header(&res, "x-quota-reset").is_some());
    let body = body_json(res).await;
    let e = &body["error"];
    assert_eq!(e["code"], "QUOTA_EXCEEDED", "{body}");
    assert_eq!(e["meta"]["quota_id"], q.id.as_str());
    assert_eq!(e["meta"]["metric"], "calls");
    assert_eq!(e["meta"]["limit"], 3);
    assert_eq!(e["meta"]["window"], "day");
    assert!(e["meta"]["resets_at"].is_string(), "{body}");
    assert!(e["message"].as_str().is_some_and(|m| m.contains(env.key.id.as_str())), "{body}");
    assert_eq!(env.hits.load(Ordering::SeqCst), 3, "a refused call does not reach the service");
    assert_eq!(env.usage().await.calls, 3);
}

async fn rows_are_counted_from_the_header_and_the_header_is_stripped(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    env.quota(Metric::Rows, 1000).await;
    let res = env.get("/reports").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(header(&res, "x-tollgate-rows").is_none(), "rows header stripped");
    assert_eq!(header(&res, "x-quota-remaining-rows"), Some("1000"), "headers of the admission");
    let bytes = axum::body::to_bytes(res.into_body(), 1024).await.expect("body");
    assert_eq!(&bytes[..], b"seven rows");
    let u = env.usage().await;
    assert_eq!((u.calls, u.rows), (1, 7));

    // A rows value that is no number counts the call with 0 rows.
    let res = env.get("/bad-rows").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(header(&res, "x-tollgate-rows").is_none(), "bad rows header stripped too");
    assert_eq!(header(&res, "x-quota-remaining-rows"), Some("993"));
    let u = env.usage().await;
    assert_eq!((u.calls, u.rows), (2, 7));
}

async fn a_failing_handler_releases_its_reservation_and_counts_nothing(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    env.quota(Metric::Calls, 1).await;
    let res = env.get("/fail").await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR, "the service's own answer");
    assert!(header(&res, "x-tollgate-rows").is_none());
    assert_eq!(header(&res, "x-quota-remaining-calls"), Some("0"));
    let bytes = axum::body::to_bytes(res.into_body(), 1024).await.expect("body");
    assert_eq!(&bytes[..], b"boom");
    let u = env.usage().await;
    assert_eq!((u.calls, u.rows), (0, 0), "a failed call counts nothing");

    let res = env.get("/reports").await;
    assert_eq!(res.status(), StatusCode::OK, "the released slot admits the next call");
    let res = env.get("/reports").await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(env.hits.load(Ordering::SeqCst), 2);
    let u = env.usage().await;
    assert_eq!((u.calls, u.rows), (1, 7));
}

async fn a_missing_or_unknown_key_is_unauthenticated(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    env.quota(Metric::Calls, 10).await;
    for h in [
        None,
        Some(("authorization", "Bearer tg_not-a-key".to_owned())),
        Some(("x-api-key", "tg_not-a-key".to_owned())),
        Some(("authorization", "Basic abc".to_owned())),
    ] {
        let res = env.get_with("/reports", h.clone()).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{h:?}");
        assert_eq!(header(&res, "www-authenticate"), Some("Bearer"));
        let body = body_json(res).await;
        assert_eq!(body["error"]["code"], "UNAUTHENTICATED", "{body}");
        assert!(body["error"]["message"].is_string() && body["error"]["meta"].is_object(), "{body}");
    }
    assert_eq!(env.hits.load(Ordering::SeqCst), 0, "never reaches the service");

    // The key in x-api-key works as well as a bearer token.
    let res = env.get_with("/reports", Some(("x-api-key", env.secret.clone()))).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(env.hits.load(Ordering::SeqCst), 1);
}

async fn concurrent_calls_admit_exactly_the_quota(backend: Backend) {
    let Some(env) = env(backend).await else { return };
    env.quota(Metric::Calls, 30).await;
    let app = env.app();
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let app = app.clone();
        let auth = format!("Bearer {}", env.secret);
        tasks.push(tokio::spawn(async move {
            let req = Request::get("/reports").header("authorization", auth).body(Body::empty()).expect("request");
            app.oneshot(req).await.expect("infallible").status()
        }));
    }
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        match t.await.expect("task") {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            s => panic!("unexpected status {s}"),
        }
    }
    assert_eq!((ok, refused), (30, 70));
    assert_eq!(env.hits.load(Ordering::SeqCst), 30);
    let u = env.usage().await;
    assert_eq!((u.calls, u.rows), (30, 210));
}

#[tokio::test]
async fn a_calls_quota_refuses_exactly_the_call_after_the_limit_distributed() {
    a_calls_quota_refuses_exactly_the_call_after_the_limit(Backend::Distributed).await;
}

#[tokio::test]
async fn a_calls_quota_refuses_exactly_the_call_after_the_limit_embedded() {
    a_calls_quota_refuses_exactly_the_call_after_the_limit(Backend::Embedded).await;
}

#[tokio::test]
async fn rows_are_counted_from_the_header_and_the_header_is_stripped_distributed() {
    rows_are_counted_from_the_header_and_the_header_is_stripped(Backend::Distributed).await;
}

#[tokio::test]
async fn rows_are_counted_from_the_header_and_the_header_is_stripped_embedded() {
    rows_are_counted_from_the_header_and_the_header_is_stripped(Backend::Embedded).await;
}

#[tokio::test]
async fn a_failing_handler_releases_its_reservation_and_counts_nothing_distributed() {
    a_failing_handler_releases_its_reservation_and_counts_nothing(Backend::Distributed).await;
}

#[tokio::test]
async fn a_failing_handler_releases_its_reservation_and_counts_nothing_embedded() {
    a_failing_handler_releases_its_reservation_and_counts_nothing(Backend::Embedded).await;
}

#[tokio::test]
async fn a_missing_or_unknown_key_is_unauthenticated_distributed() {
    a_missing_or_unknown_key_is_unauthenticated(Backend::Distributed).await;
}

#[tokio::test]
async fn a_missing_or_unknown_key_is_unauthenticated_embedded() {
    a_missing_or_unknown_key_is_unauthenticated(Backend::Embedded).await;
}

#[tokio::test]
async fn concurrent_calls_admit_exactly_the_quota_distributed() {
    concurrent_calls_admit_exactly_the_quota(Backend::Distributed).await;
}

#[tokio::test]
async fn concurrent_calls_admit_exactly_the_quota_embedded() {
    concurrent_calls_admit_exactly_the_quota(Backend::Embedded).await;
}

#[tokio::test]
async fn a_permit_is_held_for_the_life_of_the_response_body_distributed() {
    a_permit_is_held_for_the_life_of_the_response_body(Backend::Distributed).await;
}

#[tokio::test]
async fn a_permit_is_held_for_the_life_of_the_response_body_embedded() {
    a_permit_is_held_for_the_life_of_the_response_body(Backend::Embedded).await;
}

#[tokio::test]
async fn a_handler_past_its_query_timeout_is_cancelled_distributed() {
    a_handler_past_its_query_timeout_is_cancelled(Backend::Distributed).await;
}

#[tokio::test]
async fn a_handler_past_its_query_timeout_is_cancelled_embedded() {
    a_handler_past_its_query_timeout_is_cancelled(Backend::Embedded).await;
}

#[tokio::test]
async fn a_page_is_cut_to_max_rows_distributed() {
    a_page_is_cut_to_max_rows(Backend::Distributed).await;
}

#[tokio::test]
async fn a_page_is_cut_to_max_rows_embedded() {
    a_page_is_cut_to_max_rows(Backend::Embedded).await;
}

#[tokio::test]
async fn a_stream_stops_at_max_rows_distributed() {
    a_stream_stops_at_max_rows(Backend::Distributed).await;
}

#[tokio::test]
async fn a_stream_stops_at_max_rows_embedded() {
    a_stream_stops_at_max_rows(Backend::Embedded).await;
}

#[tokio::test]
async fn a_stream_stops_at_its_query_timeout_distributed() {
    a_stream_stops_at_its_query_timeout(Backend::Distributed).await;
}

#[tokio::test]
async fn a_stream_stops_at_its_query_timeout_embedded() {
    a_stream_stops_at_its_query_timeout(Backend::Embedded).await;
}

#[tokio::test]
async fn a_call_asking_to_be_explained_is_explained_distributed() {
    a_call_asking_to_be_explained_is(Backend::Distributed).await;
}

#[tokio::test]
async fn a_call_asking_to_be_explained_is_explained_embedded() {
    a_call_asking_to_be_explained_is(Backend::Embedded).await;
}

/// A `tollgate dev` data file from before the log had a file of its own
/// (the log's tables in the store's file, a projector's offsets stored
/// against them): opened by `Embedded`, its log moves beside it with its
/// offsets, so the projector neither folds a record again nor skips a new
/// one, and the quota stays exact across the move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_data_file_keeps_its_log_and_offsets_when_the_log_moves() {
    use projector::{Projector, ProjectorConfig};
    use store::{MemoryView, SqliteLog, SqliteStore};

    let id = testkit::unique_id();
    let dir = std::env::temp_dir().join(format!("tg-layer-upgrade-{id}"));
    std::fs::create_dir_all(&dir).expect("data dir");
    let path = dir.join("tollgate.db");
    let settings = || {
        let mut s = Settings::new("admin-token-layer", "gateway-token-layer");
        s.instance = format!("layer-{id}");
        s
    };
    let app = |state: &AppState| {
        Router::new().route("/nothing", get(|| async { "ok" })).layer(TollgateLayer::new(state.clone()))
    };
    let call = async |app: &Router, secret: &str| {
        let req = Request::get("/nothing").header("authorization", format!("Bearer {secret}"));
        app.clone().oneshot(req.body(Body::empty()).expect("request")).await.expect("infallible").status()
    };
    let durable_calls = async |state: &AppState, project: &Project, key: &ApiKey| {
        let now = Utc::now();
        let w = window_at(WindowKind::Day, project.timezone, now);
        let counter =
            CounterKey { dimension: Dimension::ApiKey(key.id.clone()), window: WindowKind::Day, window_key: w.key };
        state.view.usage(&project.id, &counter, now).await.expect("usage").map_or(0, |u| u.durable.calls)
    };
    /// One number read from the SQLite file at `file`.
    async fn scalar(file: &std::path::Path, sql: &'static str) -> i64 {
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(file);
        let pool = sqlx::SqlitePool::connect_with(options).await.expect("open the file");
        let n = sqlx::query_scalar(sql).fetch_one(&pool).await.expect("read the file");
        pool.close().await;
        n
    }
    // The usage topic's: the audit relay `Embedded::open` starts may append
    // the outbox's audit entries to the moved log at once, after ours.
    const LAST_OFFSET: &str = r#"SELECT MAX("offset") FROM log_records WHERE topic = 'tollgate.usage'"#;
    let folded = async |state: &AppState, project: &Project, key: &ApiKey, n: u64| {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while durable_calls(state, project, key).await != n {
            assert!(tokio::time::Instant::now() < deadline, "{n} calls not folded in 20 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };

    // The old layout, as `Embedded::open` made it: one file, one pool.
    let (project, key, secret, last_offset) = {
        let store = SqliteStore::open(&path).await.expect("open");
        store.migrate().await.expect("migrate");
        let log = SqliteLog::new(store.pool().clone(), "tollgate.");
        log.ensure_schema().await.expect("log schema");
        let reader = log.reader();
        let topic = log.usage_topic().to_owned();
        let store: Arc<dyn meter::Store> = Arc::new(store);
        let view: Arc<dyn View> = Arc::new(MemoryView::new());
        let clock: Arc<dyn meter::Clock> = Arc::new(SystemClock);
        let state = AppState::new(store.clone(), view.clone(), Arc::new(log), clock.clone(), settings());
        let (project, key, secret) = project_and_key(&state).await;
        let q = KeyQuota { metric: Metric::Calls, window: WindowKind::Day, limit: 8 };
        provisioning::key_quota(&state, &key, q, &tester()).await.expect("create quota");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let projector = Projector::new(reader, store, view, clock, ProjectorConfig::new(topic));
        let task = tokio::spawn(projector.run(async move {
            let _ = stopped.await;
        }));
        let app = app(&state);
        for _ in 0..5 {
            assert_eq!(call(&app, &secret).await, StatusCode::OK);
        }
        folded(&state, &project, &key, 5).await;
        let _ = stop.send(());
        task.await.expect("projector task").expect("projector stopped cleanly");
        (project, key, secret, scalar(&path, LAST_OFFSET).await)
    };

    let e = gateway::embedded::Embedded::open(&path, settings(), Arc::new(SystemClock))
        .await
        .expect("open the old data file");
    let moved = scalar(&gateway::embedded::log_path(&path), LAST_OFFSET).await;
    assert_eq!(moved, last_offset, "the log moved with its offsets");

    let app = app(&e.state);
    for _ in 0..3 {
        assert_eq!(call(&app, &secret).await, StatusCode::OK, "5 + 3 of 8: admitted");
    }
    assert_eq!(call(&app, &secret).await, StatusCode::TOO_MANY_REQUESTS, "the 9th call of 8");
    folded(&e.state, &project, &key, 8).await;
    e.shutdown().await.expect("shutdown");
    let left = scalar(&path, "SELECT COUNT(*) FROM sqlite_master WHERE name = 'log_records'").await;
    assert_eq!(left, 0, "the data file keeps no log");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The embedded projector folds on a thread of its own: with the only
/// thread of the runtime that opened it busy (this test's, blocked below),
/// a published call is still folded, its offset stored.
#[tokio::test]
async fn the_embedded_projector_folds_while_the_opening_runtime_is_busy() {
    let env = embedded().await;
    let Some((_, dir)) = &env._embedded else { unreachable!("an embedded env") };
    let db = dir.join("tollgate.db");
    let fact = meter::UsageFact {
        api_key_id: Some(env.key.id.clone()),
        ..meter::UsageFact::new(
            meter::EventId::parse(format!("busy-{}", testkit::unique_id())).expect("an event id"),
            env.project.id.clone(),
            meter::EventKind::Call,
            Utc::now(),
        )
    };
    let consumer = projector::ProjectorConfig::new("tollgate.usage").consumer;
    let before = env.state.stores.ledger.offsets(&consumer, "tollgate.usage").await.expect("offsets before");
    let before = before.values().copied().max().unwrap_or(0);
    env.state.log.publish(std::slice::from_ref(&fact)).await.expect("published");
    // Blocks this runtime's one thread; another runtime, on a thread of its
    // own, watches the store's offsets for the fold.
    let folded = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        rt.block_on(async {
            let store = store::SqliteStore::open(&db).await.expect("the store");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while tokio::time::Instant::now() < deadline {
                let offsets = meter::Ledger::offsets(&store, &consumer, "tollgate.usage").await.expect("offsets");
                if offsets.values().any(|&next| next > before) {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            false
        })
    })
    .join()
    .expect("the watching thread");
    assert!(folded, "nothing folded while the runtime that opened the deployment was busy");
}
