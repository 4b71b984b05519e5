//! `/openapi.json` is the API: every route of `gateway::app(..)` is in it
//! (and nothing else), every request body, response body and error body is
//! described, with an example, and every example — and every answer the
//! API actually gives on a walk through every route — validates against the
//! schema the document gives it (JSON Schema 2020-12, formats checked).

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use gateway::state::SystemClock;
use gateway::{AppState, Settings};
use serde_json::{Value, json};
use store::{MemoryView, SqliteLog, SqliteStore};
use tower::ServiceExt;
use utoipa::OpenApi;

fn document() -> Value {
    serde_json::to_value(gateway::ApiDoc::openapi()).expect("the document is JSON")
}

const METHODS: [&str; 5] = ["get", "put", "post", "delete", "patch"];

/// Every (method, path) the document describes.
fn documented(doc: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for m in METHODS {
            if item.get(m).is_some() {
                out.push((m.to_uppercase(), path.clone()));
            }
        }
    }
    out.sort();
    out
}

/// A validator for `schema`, resolving `#/components/…` in the document.
fn validator(doc: &Value, schema: &Value) -> jsonschema::Validator {
    let mut root = schema.clone();
    let Value::Object(obj) = &mut root else { panic!("a schema is an object: {schema}") };
    obj.insert("components".into(), doc["components"].clone());
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .build(&root)
        .unwrap_or_else(|e| panic!("schema {schema} does not compile: {e}"))
}

fn check(doc: &Value, schema: &Value, instance: &Value, what: &str) {
    let v = validator(doc, schema);
    let errors: Vec<String> = v.iter_errors(instance).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "{what}: {instance} does not validate against {schema}: {errors:?}");
}

/// The examples a schema node carries (`example`, and `examples` as a list).
fn schema_examples(node: &Value) -> Vec<Value> {
    let mut out: Vec<Value> = node.get("example").cloned().into_iter().collect();
    if let Some(Value::Array(list)) = node.get("examples") {
        out.extend(list.iter().cloned());
    }
    out
}

/// Checks every example in a schema and its subschemas.
fn check_schema_examples(doc: &Value, node: &Value, at: &str, count: &mut usize) {
    let Value::Object(obj) = node else { return };
    for ex in schema_examples(node) {
        check(doc, node, &ex, at);
        *count += 1;
    }
    if let Some(Value::Object(props)) = obj.get("properties") {
        for (name, p) in props {
            check_schema_examples(doc, p, &format!("{at}.{name}"), count);
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(sub) = obj.get(key) {
            check_schema_examples(doc, sub, &format!("{at}.{key}"), count);
        }
    }
    for key in ["oneOf", "anyOf", "allOf"] {
        if let Some(Value::Array(list)) = obj.get(key) {
            for (i, sub) in list.iter().enumerate() {
                check_schema_examples(doc, sub, &format!("{at}.{key}[{i}]"), count);
            }
        }
    }
}

/// The component a `$ref` names.
fn referenced<'a>(doc: &'a Value, schema: &Value) -> Option<&'a Value> {
    let name = schema.get("$ref")?.as_str()?.strip_prefix("#/components/schemas/")?;
    doc["components"]["schemas"].get(name)
}

/// Checks a media type's examples; returns whether it has one (its own, or
/// its schema's).
fn check_media_examples(doc: &Value, media: &Value, at: &str, count: &mut usize) -> bool {
    let schema = &media["schema"];
    let mut examples: Vec<Value> = media.get("example").cloned().into_iter().collect();
    if let Some(Value::Object(named)) = media.get("examples") {
        examples.extend(named.values().filter_map(|e| e.get("value").cloned()));
    }
    for ex in &examples {
        check(doc, schema, ex, at);
        *count += 1;
    }
    !examples.is_empty() || referenced(doc, schema).is_some_and(|c| !schema_examples(c).is_empty())
}

#[test]
fn every_route_is_documented_and_nothing_else() {
    let doc = document();
    let mut routed: Vec<(String, String)> =
        gateway::routes::routes().into_iter().map(|(m, p)| (m.to_string(), p.to_owned())).collect();
    routed.sort();
    assert_eq!(documented(&doc), routed, "the document's operations are exactly the router's routes");
}

#[test]
fn every_body_is_described_with_an_example_that_validates() {
    let doc = document();
    let mut count = 0;
    for (name, schema) in doc["components"]["schemas"].as_object().expect("schemas") {
        check_schema_examples(&doc, schema, &format!("components.schemas.{name}"), &mut count);
    }
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for m in METHODS {
            let Some(op) = item.get(m) else { continue };
            let at = format!("{} {path}", m.to_uppercase());
            if let Some(body) = op.get("requestBody") {
                let media = &body["content"]["application/json"];
                assert!(media.is_object(), "{at}: a JSON request body");
                assert!(
                    check_media_examples(&doc, media, &format!("{at} request"), &mut count),
                    "{at}: request example"
                );
            }
            let responses = op["responses"].as_object().expect("responses");
            assert!(responses.keys().any(|s| s.starts_with('2')), "{at}: a success response");
            for (status, response) in responses {
                let at = format!("{at} {status}");
                assert!(response["description"].as_str().is_some_and(|d| !d.is_empty()), "{at}: a description");
                let Some(content) = response.get("content").and_then(Value::as_object) else {
                    assert!(status == "204", "{at}: only a 204 has no body");
                    continue;
                };
                for (kind, media) in content {
                    assert!(check_media_examples(&doc, media, &format!("{at} {kind}"), &mut count), "{at}: an example");
                }
                if !status.starts_with('2') {
                    assert_eq!(
                        content["application/json"]["schema"]["$ref"], "#/components/schemas/ErrorBody",
                        "{at}: an error answers the error body"
                    );
                }
            }
            if op.get("security").is_some() {
                for status in ["400", "401"] {
                    let needed = status == "401" || op.get("requestBody").is_some();
                    assert!(!needed || responses.contains_key(status), "{at}: documents {status}");
                }
            }
        }
    }
    assert!(count > 60, "only {count} examples checked");
}

/// A project's worth of answers, one or more per route, over the embedded
/// backends; each must validate against the document's schema for its
/// route and status.
#[tokio::test]
async fn every_answer_matches_the_document() {
    let dir = std::env::temp_dir().join(format!("tollgate-openapi-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let store = SqliteStore::open(&dir.join("t.db")).await.expect("open");
    store.migrate().await.expect("migrate");
    let log = SqliteLog::new(store.pool().clone(), "tollgate.");
    log.ensure_schema().await.expect("log schema");
    let (store, log) = (Arc::new(store), Arc::new(log));
    let mut settings = Settings::new("adm", "gw");
    settings.exports.dir = dir.join("exports");
    settings.exports.topic = log.usage_topic().to_owned();
    let state = AppState::new(store.clone(), Arc::new(MemoryView::new()), log.clone(), Arc::new(SystemClock), settings);
    let app = gateway::app(state);
    let doc = document();
    let mut seen = std::collections::BTreeSet::new();
    let mut call = async |method: Method, template: &str, uri: &str, token: Option<&str>, body: Option<Value>| {
        let mut req = Request::builder().method(method.clone()).uri(uri);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req.body(body.map_or_else(Body::empty, |b| Body::from(b.to_string()))).expect("request");
        let res = app.clone().oneshot(req).await.expect("response");
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 22).await.expect("body");
        let op = &doc["paths"][template][method.as_str().to_lowercase()];
        let response = &op["responses"][status.as_str()];
        assert!(response.is_object(), "{method} {uri} answered {status}, which {template} does not document");
        seen.insert((method.to_string(), template.to_owned()));
        let value = match response.get("content") {
            None => {
                assert!(bytes.is_empty(), "{method} {uri}: a body where none is documented");
                Value::Null
            }
            Some(content) if content.get("application/json").is_some() => {
                let v: Value = serde_json::from_slice(&bytes).expect("a JSON answer");
                check(&doc, &content["application/json"]["schema"], &v, &format!("{method} {uri} {status}"));
                v
            }
            Some(_) => Value::String(String::from_utf8_lossy(&bytes).into_owned()),
        };
        (status, value)
    };
    let adm = Some("adm");
    let gw = Some("gw");

    let (s, _) = call(Method::GET, "/healthz", "/healthz", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::GET, "/openapi.json", "/openapi.json", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, m) = call(Method::GET, "/metrics", "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(m.as_str().is_some(), "the Prometheus text: {m}");

    let (s, p) = call(
        Method::POST,
        "/v1/projects",
        "/v1/projects",
        adm,
        Some(json!({"name": "acme", "timezone": "Asia/Kathmandu"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    let pid = p["id"].as_str().expect("project id").to_owned();
    let (s, _) =
        call(Method::POST, "/v1/projects", "/v1/projects", adm, Some(json!({"name": "x", "timezone": "Mars/Olympus"})))
            .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::POST, "/v1/projects", "/v1/projects", None, Some(json!({"name": "x"}))).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(Method::GET, "/v1/projects/{id}", &format!("/v1/projects/{pid}"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::GET, "/v1/projects/{id}", "/v1/projects/proj_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let roles = format!("/v1/projects/{pid}/roles");
    let (s, role) = call(Method::POST, "/v1/projects/{id}/roles", &roles, adm,
        Some(json!({"name": "analyst", "grants": {"max_rows": 500, "query_timeout": 30}, "quota": {"calls": 2, "per": "day"}}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let rid = role["id"].as_str().expect("role id").to_owned();
    let (s, _) = call(
        Method::POST,
        "/v1/projects/{id}/roles",
        &roles,
        adm,
        Some(json!({"name": "x", "quota": {"per": "week"}})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::GET, "/v1/roles/{id}", &format!("/v1/roles/{rid}"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::GET, "/v1/roles/{id}", "/v1/roles/role_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let keys = format!("/v1/projects/{pid}/api-keys");
    let (s, k) = call(Method::POST, "/v1/projects/{id}/api-keys", &keys, adm, Some(json!({"name": "k"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let (kid, secret) = (k["id"].as_str().expect("id").to_owned(), k["secret"].as_str().expect("secret").to_owned());
    let (s, k2) = call(
        Method::POST,
        "/v1/projects/{id}/api-keys",
        &keys,
        adm,
        Some(json!({"name": "partner", "role_id": rid, "grants": {"max_rows": 1000}})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    let kid2 = k2["id"].as_str().expect("id").to_owned();
    let (s, _) = call(
        Method::POST,
        "/v1/projects/{id}/api-keys",
        "/v1/projects/proj_nope/api-keys",
        adm,
        Some(json!({"name": "k"})),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(
        Method::POST,
        "/v1/projects/{id}/api-keys",
        &keys,
        adm,
        Some(json!({"name": "k", "grants": {"max_rows": 0}})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, d) = call(Method::GET, "/v1/api-keys/{id}", &format!("/v1/api-keys/{kid2}"), adm, None).await;
    assert_eq!((s, d["effective_limits"]["max_rows"].clone()), (StatusCode::OK, json!(500)));
    let (s, _) = call(Method::GET, "/v1/api-keys/{id}", "/v1/api-keys/key_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let grants = "/v1/api-keys/{id}/grants";
    let (s, g) = call(
        Method::PUT,
        grants,
        &format!("/v1/api-keys/{kid2}/grants"),
        adm,
        Some(json!({"role_id": rid, "grants": {"max_rows": 800, "max_concurrent": 3}})),
    )
    .await;
    assert_eq!((s, g["effective_limits"]["max_rows"].clone()), (StatusCode::OK, json!(500)));
    let (s, _) = call(
        Method::PUT,
        grants,
        &format!("/v1/api-keys/{kid2}/grants"),
        adm,
        Some(json!({"grants": {"max_rows": 0}})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::PUT, grants, "/v1/api-keys/key_nope/grants", adm, Some(json!({}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let q = json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 1});
    let (s, quota) = call(Method::POST, "/v1/quotas", "/v1/quotas", adm, Some(q.clone())).await;
    assert_eq!(s, StatusCode::CREATED);
    let qid = quota["id"].as_str().expect("quota id").to_owned();
    let (s, _) = call(Method::POST, "/v1/quotas", "/v1/quotas", adm, Some(q)).await;
    assert_eq!(s, StatusCode::CONFLICT);
    let cost = json!({"project_id": pid, "scope": "project", "metric": "cost_usd", "window": "day", "limit": "0.01"});
    let (s, _) = call(Method::POST, "/v1/quotas", "/v1/quotas", adm, Some(cost)).await;
    assert_eq!(s, StatusCode::CREATED);
    let storage =
        json!({"project_id": pid, "scope": "project", "metric": "storage_bytes", "window": "current", "limit": 1000});
    let (s, _) = call(Method::POST, "/v1/quotas", "/v1/quotas", adm, Some(storage)).await;
    assert_eq!(s, StatusCode::CREATED);
    let (s, _) =
        call(Method::POST, "/v1/quotas", "/v1/quotas", adm, Some(json!({"project_id": pid, "window": "week"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, list) = call(Method::GET, "/v1/quotas", &format!("/v1/quotas?project_id={pid}"), adm, None).await;
    assert_eq!((s, list["data"].as_array().map(Vec::len)), (StatusCode::OK, Some(3)));
    let (s, _) = call(Method::GET, "/v1/quotas", "/v1/quotas", adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let check_uri = "/v1/check";
    let (s, _) =
        call(Method::POST, check_uri, check_uri, gw, Some(json!({"api_key": secret, "storage_bytes_delta": 5000})))
            .await;
    assert_eq!(s, StatusCode::CONFLICT, "over the storage quota; nothing reserved");
    let (s, c) =
        call(Method::POST, check_uri, check_uri, gw, Some(json!({"api_key": secret, "storage_bytes_delta": 10}))).await;
    assert_eq!(s, StatusCode::OK, "{c}");
    let (s, _) = call(Method::POST, check_uri, check_uri, gw, Some(json!({"api_key": secret}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    let (s, _) = call(Method::POST, check_uri, check_uri, gw, Some(json!({"api_key": "tg_nope"}))).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(Method::POST, check_uri, check_uri, gw, Some(json!({"user": "alice", "role_id": rid}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, c) =
        call(Method::POST, check_uri, check_uri, gw, Some(json!({"user": "user:alice", "role_id": rid}))).await;
    assert_eq!((s, c["limits"]["max_rows"].clone()), (StatusCode::OK, json!(500)));
    let (s, c) = call(Method::POST, check_uri, check_uri, gw, Some(json!({"break_glass": true}))).await;
    assert_eq!((s, c["exempt"].clone()), (StatusCode::OK, json!(true)));

    // A permit: taken, refused over the cap, renewed, released.
    let (s, k3) = call(
        Method::POST,
        "/v1/projects/{id}/api-keys",
        &keys,
        adm,
        Some(json!({"name": "heavy", "grants": {"max_concurrent": 1}})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    let heavy = json!({"api_key": k3["secret"], "permit": true});
    let (s, c) = call(Method::POST, check_uri, check_uri, gw, Some(heavy.clone())).await;
    assert_eq!(s, StatusCode::OK, "{c}");
    let permit = c["permit"]["id"].as_str().expect("a permit").to_owned();
    let (s, c) = call(Method::POST, check_uri, check_uri, gw, Some(heavy)).await;
    assert_eq!((s, c["error"]["code"].clone()), (StatusCode::TOO_MANY_REQUESTS, json!("TOO_MANY_CONCURRENT")));
    let renew = "/v1/permits/{id}/renew";
    let (s, _) = call(Method::POST, renew, &format!("/v1/permits/{permit}/renew"), gw, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::DELETE, "/v1/permits/{id}", &format!("/v1/permits/{permit}"), gw, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(Method::DELETE, "/v1/permits/{id}", &format!("/v1/permits/{permit}"), gw, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::POST, renew, &format!("/v1/permits/{permit}/renew"), gw, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let now = chrono::Utc::now().to_rfc3339();
    let events = json!({"events": [
        {"id": "e1", "type": "call", "project_id": pid, "api_key_id": kid, "occurred_at": now, "rows": 3},
        {"id": "e1", "type": "call", "project_id": pid, "api_key_id": kid, "occurred_at": now, "rows": 3},
        {"id": "e2", "type": "tokens", "project_id": pid, "occurred_at": now,
         "tokens": [{"provider": "openai", "model": "mystery", "input": 10, "output": 10}]},
    ]});
    let (s, a) = call(Method::POST, "/v1/events", "/v1/events", gw, Some(events)).await;
    assert_eq!((s, a), (StatusCode::ACCEPTED, json!({"accepted": 2, "duplicates": 1})));
    let bad = json!({"events": [{"id": "e3", "type": "call", "project_id": pid, "occurred_at": now, "rows": -3}]});
    let (s, _) = call(Method::POST, "/v1/events", "/v1/events", gw, Some(bad)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let (s, got) = call(Method::GET, "/v1/quotas/{id}", &format!("/v1/quotas/{qid}"), adm, None).await;
    assert_eq!((s, got["current_usage"].is_object()), (StatusCode::OK, true), "{got}");
    let (s, _) = call(Method::GET, "/v1/quotas/{id}", "/v1/quotas/quota_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(
        Method::PATCH,
        "/v1/quotas/{id}",
        &format!("/v1/quotas/{qid}"),
        adm,
        Some(json!({"window": "rolling_1h"})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(
        Method::PATCH,
        "/v1/quotas/{id}",
        &format!("/v1/quotas/{qid}"),
        adm,
        Some(json!({"limit": 5, "mode": "monitor"})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::PATCH, "/v1/quotas/{id}", "/v1/quotas/quota_nope", adm, Some(json!({"limit": 5}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let put = format!("/v1/projects/{pid}/quotas");
    let doc_body = json!({"quotas": [{"scope": "project", "metric": "calls", "window": "day", "limit": 100}]});
    let (s, plan) =
        call(Method::PUT, "/v1/projects/{id}/quotas", &format!("{put}?dry_run=true"), adm, Some(doc_body.clone()))
            .await;
    assert_eq!((s, plan["deleted"].clone()), (StatusCode::OK, json!(3)));
    let (s, _) =
        call(Method::PUT, "/v1/projects/{id}/quotas", &put, adm, Some(json!({"quotas": [{"colour": 1}]}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) =
        call(Method::PUT, "/v1/projects/{id}/quotas", "/v1/projects/proj_nope/quotas", adm, Some(doc_body)).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let prices = json!({"prices": [{"provider": "openai", "model": "gpt-4o", "component": "input_tokens", "unit_price_usd": "0.0000025"}]});
    let (s, _) = call(Method::PUT, "/v1/prices", "/v1/prices", adm, Some(prices)).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::PUT, "/v1/prices", "/v1/prices", adm, Some(json!({"prices": []}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::GET, "/v1/prices", "/v1/prices?model=gpt-4o", adm, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::GET, "/v1/prices", "/v1/prices?colour=red", adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::GET, "/v1/exceptions", &format!("/v1/exceptions?project_id={pid}"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) =
        call(Method::GET, "/v1/exceptions", &format!("/v1/exceptions?project_id={pid}&limit=0"), adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    for group in ["model", "actor", "agent", "api_key"] {
        let (s, _) =
            call(Method::GET, "/v1/usage", &format!("/v1/usage?project_id={pid}&group_by={group}"), adm, None).await;
        assert_eq!(s, StatusCode::OK);
    }
    let (s, _) = call(Method::GET, "/v1/usage", "/v1/usage?project_id=proj_nope&group_by=model", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::GET, "/v1/usage", &format!("/v1/usage?project_id={pid}"), adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    // The audit log holds what the audit folder folded from the audit
    // topic: relay the outbox the changes above wrote, and fold it.
    let relay = projector::audit::AuditRelay::new(store.clone(), log.clone(), Arc::new(SystemClock), 100);
    assert!(relay.drain().await.expect("relay") >= 2, "the quota changes above are in the outbox");
    let config = projector::audit::AuditConfig::new(log.audit_topic());
    let mut folder = projector::audit::AuditFolder::new(log.audit_reader(), store.clone(), config);
    folder.start().await.expect("start the audit folder");
    while folder.step().await.expect("fold the audit topic").read > 0 {}
    let (s, page) = call(Method::GET, "/v1/audit", &format!("/v1/audit?project_id={pid}&limit=1"), adm, None).await;
    assert_eq!((s, page["next"].is_string()), (StatusCode::OK, true));
    let (s, _) = call(Method::GET, "/v1/audit", &format!("/v1/audit?project_id={pid}&page=0"), adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::GET, "/v1/audit", "/v1/audit?project_id=proj_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // The price write above is installation-wide: no project, its own scope.
    let (s, inst) = call(Method::GET, "/v1/audit", "/v1/audit?scope=installation", adm, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        (inst["data"][0]["action"].as_str(), inst["data"][0]["project_id"].is_null()),
        (Some("prices:PutPrices"), true),
        "{inst}"
    );
    let both = format!("/v1/audit?scope=installation&project_id={pid}");
    let (s, e) = call(Method::GET, "/v1/audit", &both, adm, None).await;
    assert_eq!((s, e["error"]["meta"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("project_id")));

    // Exports: a run, read back, its file; bad input; unknown ids.
    let export = json!({"project_id": pid, "period": "day", "dimensions": ["project", "actor"], "format": "csv"});
    let (s, run) = call(Method::POST, "/v1/exports", "/v1/exports", adm, Some(export)).await;
    assert_eq!((s, run["status"].as_str()), (StatusCode::CREATED, Some("complete")), "{run}");
    let id = run["id"].as_str().expect("run id").to_owned();
    let (s, _) = call(Method::GET, "/v1/exports/{id}", &format!("/v1/exports/{id}"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, file) = call(Method::GET, "/v1/exports/{id}/file", &format!("/v1/exports/{id}/file"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(file.as_str().is_some_and(|f| f.starts_with("export_run_id,")), "{file}");
    let bad = json!({"project_id": pid, "period": "week", "dimensions": ["project"], "format": "csv"});
    let (s, _) = call(Method::POST, "/v1/exports", "/v1/exports", adm, Some(bad)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let nope = json!({"project_id": "proj_nope", "period": "day", "dimensions": ["project"], "format": "csv"});
    let (s, _) = call(Method::POST, "/v1/exports", "/v1/exports", adm, Some(nope)).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::GET, "/v1/exports/{id}", "/v1/exports/exr_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::GET, "/v1/exports/{id}/file", "/v1/exports/exr_nope/file", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Export schedules: define, list, read, change, run now, delete; bad input; unknown ids.
    let sched = json!({"project_ids": [pid], "period": "day", "dimensions": ["api_key"], "format": "csv",
                       "destination": "finance/daily", "cadence": "daily"});
    let (s, x) = call(Method::POST, "/v1/export-schedules", "/v1/export-schedules", adm, Some(sched.clone())).await;
    assert_eq!((s, x["timezone"].as_str()), (StatusCode::CREATED, Some("Asia/Kathmandu")), "{x}");
    let xid = x["id"].as_str().expect("schedule id").to_owned();
    let mut bad = sched.clone();
    bad["destination"] = json!("../up");
    let (s, e) = call(Method::POST, "/v1/export-schedules", "/v1/export-schedules", adm, Some(bad)).await;
    assert_eq!((s, e["error"]["meta"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("destination")));
    let mut nope = sched.clone();
    nope["project_ids"] = json!(["proj_nope"]);
    let (s, _) = call(Method::POST, "/v1/export-schedules", "/v1/export-schedules", adm, Some(nope)).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, l) = call(Method::GET, "/v1/export-schedules", "/v1/export-schedules?limit=1", adm, None).await;
    assert_eq!((s, l["data"][0]["id"].as_str()), (StatusCode::OK, Some(xid.as_str())));
    let (s, _) = call(Method::GET, "/v1/export-schedules", "/v1/export-schedules?limit=0", adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let one = format!("/v1/export-schedules/{xid}");
    let (s, d) = call(Method::GET, "/v1/export-schedules/{id}", &one, adm, None).await;
    assert_eq!((s, d["runs"].as_array().map(Vec::len)), (StatusCode::OK, Some(0)), "{d}");
    let (s, _) = call(Method::GET, "/v1/export-schedules/{id}", "/v1/export-schedules/exs_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, r) = call(Method::POST, "/v1/export-schedules/{id}/run", &format!("{one}/run"), adm, None).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{r}");
    let (s, _) =
        call(Method::POST, "/v1/export-schedules/{id}/run", "/v1/export-schedules/exs_nope/run", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, p) = call(
        Method::PATCH,
        "/v1/export-schedules/{id}",
        &one,
        adm,
        Some(json!({"enabled": false, "cadence": "hourly"})),
    )
    .await;
    assert_eq!((s, p["enabled"].as_bool(), p["cadence"].as_str()), (StatusCode::OK, Some(false), Some("hourly")));
    let (s, _) = call(Method::PATCH, "/v1/export-schedules/{id}", &one, adm, Some(json!({"cadence": "weekly"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) =
        call(Method::PATCH, "/v1/export-schedules/{id}", "/v1/export-schedules/exs_nope", adm, Some(json!({}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::POST, "/v1/export-schedules/{id}/run", &format!("{one}/run"), adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "a disabled schedule does not run");
    let (s, _) = call(Method::DELETE, "/v1/export-schedules/{id}", &one, adm, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(Method::DELETE, "/v1/export-schedules/{id}", &one, adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Webhooks: an endpoint (a public URL: this state refuses private ones),
    // its secret once, a test fire, the delivery log, resend, recover, rotation.
    let hooks = format!("/v1/projects/{pid}/webhooks");
    let body = json!({"url": "https://hooks.example.com/tollgate", "event_types": ["quota.*", "webhook.test"]});
    let (s, w) = call(Method::POST, "/v1/projects/{id}/webhooks", &hooks, adm, Some(body)).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(w["secret"].as_str().is_some_and(|s| s.starts_with("whsec_")), "{w}");
    let wid = w["id"].as_str().expect("webhook id").to_owned();
    let private = json!({"url": "http://127.0.0.1:9000/hook", "event_types": ["*"]});
    let (s, e) = call(Method::POST, "/v1/projects/{id}/webhooks", &hooks, adm, Some(private)).await;
    assert_eq!((s, e["error"]["meta"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("url")));
    let bad = json!({"url": "https://hooks.example.com/", "event_types": ["quota.exceded"]});
    let (s, e) = call(Method::POST, "/v1/projects/{id}/webhooks", &hooks, adm, Some(bad)).await;
    assert_eq!((s, e["error"]["meta"]["field"].as_str()), (StatusCode::BAD_REQUEST, Some("event_types[0]")));
    let (s, _) = call(
        Method::POST,
        "/v1/projects/{id}/webhooks",
        "/v1/projects/proj_nope/webhooks",
        adm,
        Some(json!({"url": "https://hooks.example.com/", "event_types": ["*"]})),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, l) = call(Method::GET, "/v1/projects/{id}/webhooks", &hooks, adm, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(l["data"][0].get("secret").is_none(), "never shown again");
    let (s, _) = call(Method::GET, "/v1/projects/{id}/webhooks", "/v1/projects/proj_nope/webhooks", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let one = format!("/v1/webhooks/{wid}");
    let (s, _) = call(Method::GET, "/v1/webhooks/{id}", &one, adm, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(Method::GET, "/v1/webhooks/{id}", "/v1/webhooks/wh_nope", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, p2) = call(Method::PATCH, "/v1/webhooks/{id}", &one, adm, Some(json!({"description": "on-call"}))).await;
    assert_eq!((s, p2["description"].as_str()), (StatusCode::OK, Some("on-call")));
    let (s, _) = call(Method::PATCH, "/v1/webhooks/{id}", &one, adm, Some(json!({"url": "ftp://x/"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::PATCH, "/v1/webhooks/{id}", "/v1/webhooks/wh_nope", adm, Some(json!({}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, r) =
        call(Method::POST, "/v1/webhooks/{id}/rotate-secret", &format!("{one}/rotate-secret"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(r["previous_secret_expires_at"].is_string() && r["secret"] != w["secret"], "{r}");
    let (s, _) =
        call(Method::POST, "/v1/webhooks/{id}/rotate-secret", "/v1/webhooks/wh_nope/rotate-secret", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, t) = call(Method::POST, "/v1/webhooks/{id}/test", &format!("{one}/test"), adm, None).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let mid = t["message_id"].as_str().expect("message id").to_owned();
    let (s, _) = call(Method::POST, "/v1/webhooks/{id}/test", "/v1/webhooks/wh_nope/test", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, d) = call(Method::GET, "/v1/webhooks/{id}/deliveries", &format!("{one}/deliveries"), adm, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!((d["data"][0]["message_id"].as_str(), d["data"][0]["test"].as_bool()), (Some(mid.as_str()), Some(true)));
    assert_eq!(d["data"][0]["payload"]["type"], "webhook.test");
    let (s, _) =
        call(Method::GET, "/v1/webhooks/{id}/deliveries", &format!("{one}/deliveries?limit=0"), adm, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(Method::GET, "/v1/webhooks/{id}/deliveries", "/v1/webhooks/wh_nope/deliveries", adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let resend = "/v1/webhooks/{id}/deliveries/{message_id}/resend";
    let (s, _) = call(Method::POST, resend, &format!("{one}/deliveries/{mid}/resend"), adm, None).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (s, _) = call(Method::POST, resend, &format!("{one}/deliveries/msg_nope/resend"), adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let recover = format!("{one}/recover");
    let (s, rc) =
        call(Method::POST, "/v1/webhooks/{id}/recover", &recover, adm, Some(json!({"since": "2026-01-01T00:00:00Z"})))
            .await;
    assert_eq!((s, rc["resent"].as_u64()), (StatusCode::ACCEPTED, Some(0)));
    let (s, _) =
        call(Method::POST, "/v1/webhooks/{id}/recover", &recover, adm, Some(json!({"since": "yesterday"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = call(
        Method::POST,
        "/v1/webhooks/{id}/recover",
        "/v1/webhooks/wh_nope/recover",
        adm,
        Some(json!({"since": "2026-01-01T00:00:00Z"})),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::DELETE, "/v1/webhooks/{id}", &one, adm, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(Method::DELETE, "/v1/webhooks/{id}", &one, adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let (s, _) = call(Method::DELETE, "/v1/quotas/{id}", &format!("/v1/quotas/{qid}"), adm, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(Method::DELETE, "/v1/quotas/{id}", &format!("/v1/quotas/{qid}"), adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = call(Method::DELETE, "/v1/api-keys/{id}", &format!("/v1/api-keys/{kid}"), adm, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(Method::DELETE, "/v1/api-keys/{id}", &format!("/v1/api-keys/{kid}"), adm, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let all: std::collections::BTreeSet<(String, String)> = documented(&doc).into_iter().collect();
    assert_eq!(seen, all, "the walk reaches every route");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The checks above can fail: the document's schemas are strict (unknown
/// properties, missing ones, wrong types and bad timestamps are refused).
#[test]
fn the_schemas_refuse_what_the_api_never_answers() {
    let doc = document();
    let schema = |name: &str| json!({"$ref": format!("#/components/schemas/{name}")});
    let refused = |name: &str, v: Value| assert!(!validator(&doc, &schema(name)).is_valid(&v), "{name} took {v}");
    refused("ErrorBody", json!({"error": {"code": "X", "message": "m", "meta": {"colour": "red"}}}));
    refused("ErrorBody", json!({"error": {"code": "X", "message": "m"}}));
    refused("CheckResponse", json!({"allowed": "yes", "reservation_id": null}));
    refused("ProjectView", json!({"id": "p", "name": "n", "timezone": "UTC", "created_at": "yesterday"}));
    refused("CheckBody", json!({"api_key": 5}));
    let ok = json!({"error": {"code": "NOT_FOUND", "message": "m", "meta": {}}});
    assert!(validator(&doc, &schema("ErrorBody")).is_valid(&ok));
}
