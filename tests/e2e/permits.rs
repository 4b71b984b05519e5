//! Concurrency permits (`max_concurrent`, ADR-0011 §1 and ADR-0196) end to
//! end, on each backend (`TOLLGATE_PERMITS=redis`, `postgres`; the memory
//! one under `tollgate dev`): the cap holds across gateway processes, a
//! holder that dies is freed when its lease lapses and not before, a renewed
//! permit outlives three leases, the installation's cap spans keys, a
//! permit and its reservation are taken both or neither, and exempt callers
//! take no slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use serde_json::{Value, json};

use crate::harness::*;

async fn post(env: &Env, gw: &str, path: &str, body: Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = env.http.post(format!("{gw}{path}")).bearer_auth(GATEWAY).json(&body).send().await.expect("request");
    let (s, h) = (r.status().as_u16(), r.headers().clone());
    (s, h, r.json().await.unwrap_or(Value::Null))
}

/// A check asking for a permit; (status, headers, body).
async fn take(env: &Env, gw: &str, body: Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut body = body;
    body["permit"] = json!(true);
    post(env, gw, "/v1/check", body).await
}

async fn delete_permit(http: &reqwest::Client, gw: &str, id: &str) -> u16 {
    let r = http.delete(format!("{gw}/v1/permits/{id}")).bearer_auth(GATEWAY).send().await.expect("delete permit");
    r.status().as_u16()
}

async fn renew(env: &Env, gw: &str, id: &str) -> (u16, Value) {
    let (s, _, b) = post(env, gw, &format!("/v1/permits/{id}/renew"), json!({})).await;
    (s, b)
}

fn permit_id(b: &Value) -> String {
    b["permit"]["id"].as_str().unwrap_or_else(|| panic!("a permit: {b}")).to_owned()
}

fn expires_at(b: &Value) -> DateTime<Utc> {
    b["expires_at"].as_str().and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("expires_at: {b}"))
}

/// A key of `project` with the given grants (and role); (id, secret).
async fn key(env: &Env, project: &str, body: Value) -> (String, String) {
    let (s, k) = env.admin_post(&format!("/v1/projects/{project}/api-keys"), body).await;
    assert_eq!(s, 201, "create key: {k}");
    (k["id"].as_str().expect("key id").to_owned(), k["secret"].as_str().expect("secret").to_owned())
}

async fn role(env: &Env, project: &str, body: Value) -> String {
    let (s, r) = env.admin_post(&format!("/v1/projects/{project}/roles"), body).await;
    assert_eq!(s, 201, "create role: {r}");
    r["id"].as_str().expect("role id").to_owned()
}

/// A refusal's body and headers are the documented `TOO_MANY_CONCURRENT`.
fn assert_too_many(s: u16, h: &reqwest::header::HeaderMap, b: &Value, limit: u64, whose: &str, id: Option<&str>) {
    assert_eq!(s, 429, "{b}");
    assert_eq!(b["error"]["code"], "TOO_MANY_CONCURRENT", "{b}");
    assert_eq!(b["error"]["meta"], json!({"limit": limit, "whose": whose, "id": id}), "{b}");
    assert_eq!(h.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"), "Retry-After: 1");
}

// ------------------------------------------------------------ the cap holds

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_concurrent_holds_across_four_gateways_redis() {
    max_concurrent_holds("redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_concurrent_holds_across_four_gateways_postgres() {
    max_concurrent_holds("postgres").await;
}

/// `max_concurrent` 5, four gateway processes, 64 clients that take a
/// permit, hold it 10–50 ms and release it (by `DELETE`, or by settling the
/// call's event with it): a counter of the permits the clients hold never
/// passes 5, and reaches it.
async fn max_concurrent_holds(backend: &str) {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push(("TOLLGATE_PERMITS".into(), backend.into()));
    env.extra_env.push(("TOLLGATE_PERMITS_CAP".into(), "100".into()));
    // As deployed (the default TTL, where the harness reads the store on
    // every lookup): 16 clients per cold gateway share each first load.
    env.extra_env.push(("TOLLGATE_CONFIG_TTL".into(), "1s".into()));
    for _ in 0..4 {
        env.start_gateway().await;
    }
    let (pid, _, _) = env.project_with_key(safe_timezone()).await;
    let (kid, secret) = key(&env, &pid, json!({"name": "partner", "grants": {"max_concurrent": 5}})).await;
    // A calls quota too, so every permit comes with a reservation in the view.
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls", "window": "day", "limit": 100000}))
        .await;

    let held = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let granted = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..64 {
        let gw = env.gateways[c % env.gateways.len()].clone();
        let (http, secret, pid, kid) = (env.http.clone(), secret.clone(), pid.clone(), kid.clone());
        let (held, most, granted, refused) = (held.clone(), most.clone(), granted.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = 0;
            let mut tries = 0;
            while mine < 4 && tries < 400 {
                tries += 1;
                let r = check(&http, &gw, &secret, json!({"permit": true})).await;
                let (status, headers) = (r.status().as_u16(), r.headers().clone());
                let body: Value = r.json().await.expect("check body");
                match status {
                    200 => {
                        let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        granted.fetch_add(1, Ordering::SeqCst);
                        let ms = rand::rng().random_range(10..=50);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        held.fetch_sub(1, Ordering::SeqCst);
                        let id = permit_id(&body);
                        if mine % 2 == 0 {
                            assert_eq!(delete_permit(&http, &gw, &id).await, 204);
                        } else {
                            let mut ev =
                                call_event(&format!("c{c}-{mine}"), &pid, &kid, body["reservation_id"].as_str(), 1);
                            ev["permit_id"] = json!(id);
                            let (s, b) = post_events(&http, &gw, vec![ev]).await;
                            assert_eq!((s, b["permits_released"].clone()), (202, json!(1)), "settle: {b}");
                        }
                        mine += 1;
                    }
                    429 => {
                        refused.fetch_add(1, Ordering::SeqCst);
                        assert_too_many(429, &headers, &body, 5, "api_key", Some(&kid));
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    other => panic!("unexpected status {other}: {body}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 5, "{most} permits held at once, over max_concurrent 5");
    assert!(most >= 4, "the clients reached the cap ({most} at most)");
    assert!(granted.load(Ordering::SeqCst) >= 64, "every client got permits: {granted:?}");
    assert!(refused.load(Ordering::SeqCst) > 0, "64 clients on 5 slots were refused at times");

    // Every permit was given back: exactly 5 again, and each refusal
    // reserved nothing (the quota counts the granted checks only).
    let mut ids = Vec::new();
    for gw in env.gateways.iter().cycle().take(5) {
        let (s, _, b) = take(&env, gw, json!({"api_key": secret})).await;
        assert_eq!(s, 200, "{b}");
        ids.push(permit_id(&b));
    }
    let (s, h, b) = take(&env, env.gw(), json!({"api_key": secret})).await;
    assert_too_many(s, &h, &b, 5, "api_key", Some(&kid));
    let (_, q) = env.admin_get(&format!("/v1/quotas/{qid}")).await;
    let counted = q["current_usage"]["count"].as_u64().expect("count");
    assert_eq!(counted, granted.load(Ordering::SeqCst) + 5, "reservations of granted checks only: {q}");
    for id in ids {
        assert_eq!(delete_permit(&env.http, env.gw(), &id).await, 204);
    }
}

// ------------------------------------------------------------ leases

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_lapses_and_a_renewed_one_holds_redis() {
    leases("redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_lapses_and_a_renewed_one_holds_postgres() {
    leases("postgres").await;
}

/// A key with `max_concurrent` 1 and `query_timeout` 1 s: its lease is 31 s.
/// A holder whose gateway is `kill -9`ed never releases: its slot is
/// refused until the lease lapses, and free from then. Another key's
/// holder renews every 10 s: its slot is still held after three leases,
/// and free once it releases.
async fn leases(backend: &str) {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push(("TOLLGATE_PERMITS".into(), backend.into()));
    env.start_gateway().await;
    let survivor = env.start_gateway().await;
    let (pid, _, _) = env.project_with_key(safe_timezone()).await;
    let grants = json!({"max_concurrent": 1, "query_timeout": 1});
    let (dead_key, dead_secret) = key(&env, &pid, json!({"name": "dies", "grants": grants})).await;
    let (long_key, long_secret) = key(&env, &pid, json!({"name": "streams", "grants": grants})).await;

    let started = Utc::now();
    let (s, _, dead) = take(&env, env.gw(), json!({"api_key": dead_secret})).await;
    assert_eq!(s, 200, "{dead}");
    let dead_until: DateTime<Utc> = dead["permit"]["expires_at"].as_str().and_then(|t| t.parse().ok()).expect("expiry");
    let lease = dead_until - started;
    assert!(lease >= chrono::Duration::seconds(30) && lease <= chrono::Duration::seconds(32), "lease {lease}");
    let (s, _, long) = take(&env, &survivor, json!({"api_key": long_secret})).await;
    assert_eq!(s, 200, "{long}");
    let long_id = permit_id(&long);
    // The holder of the first permit dies with its gateway.
    let first_gateway = 0;
    env.kill(first_gateway);

    let mut dead_freed_at = None;
    let mut renewals = 0;
    let mut next_renewal = Utc::now() + chrono::Duration::seconds(10);
    let end = started + lease * 3 + chrono::Duration::seconds(5);
    while Utc::now() < end {
        let now = Utc::now();
        if now >= next_renewal {
            let (s, b) = renew(&env, &survivor, &long_id).await;
            assert_eq!(s, 200, "renew: {b}");
            assert!(expires_at(&b) > now + chrono::Duration::seconds(29), "renewed a whole lease: {b}");
            renewals += 1;
            next_renewal = now + chrono::Duration::seconds(10);
        }
        let (s, h, b) = take(&env, &survivor, json!({"api_key": long_secret})).await;
        assert_too_many(s, &h, &b, 1, "api_key", Some(&long_key));
        if dead_freed_at.is_none() {
            // The gateway decides between `before` and `after`: a grant
            // means its clock had reached the lease end, a refusal that it
            // had not (the stores keep the lease end to the millisecond).
            let before = Utc::now();
            let (s, h, b) = take(&env, &survivor, json!({"api_key": dead_secret})).await;
            let after = Utc::now();
            if s == 200 {
                assert!(after >= dead_until, "freed by {after}, before its lease ended at {dead_until}");
                dead_freed_at = Some(after);
                assert_eq!(delete_permit(&env.http, &survivor, &permit_id(&b)).await, 204);
            } else {
                assert_too_many(s, &h, &b, 1, "api_key", Some(&dead_key));
                let slack = chrono::Duration::milliseconds(5);
                assert!(before < dead_until + slack, "still held at {before}, after its lease ended at {dead_until}");
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(dead_freed_at.is_some(), "the dead holder's slot was freed");
    assert!(renewals >= 8, "{renewals} renewals");
    assert!(Utc::now() > started + lease * 3, "the renewed permit outlived three leases");
    assert_eq!(delete_permit(&env.http, &survivor, &long_id).await, 204);
    let (s, _, b) = take(&env, &survivor, json!({"api_key": long_secret})).await;
    assert_eq!(s, 200, "free once released: {b}");
    let (s, _) = renew(&env, &survivor, &permit_id(&dead)).await;
    assert_eq!(s, 404, "a lapsed permit cannot be renewed");
}

// ------------------------------------------------------------ the rules

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_rules_redis() {
    rules(Mode::Distributed, "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_rules_postgres() {
    rules(Mode::Distributed, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_rules_dev() {
    rules(Mode::Dev, "memory").await;
}

/// With an installation cap of 7: the 429 body and headers; the
/// installation's cap across two keys; release by `DELETE` and by settle;
/// renew; a refused slot reserves nothing and a refused reservation takes
/// no slot; whose limit (key, role, a signed-in user's own slots); exempt
/// roles and break-glass take none; a key without `max_concurrent` none.
async fn rules(mode: Mode, backend: &str) {
    let Some(mut env) = Env::of(mode).await else { return };
    if mode == Mode::Distributed {
        env.extra_env.push(("TOLLGATE_PERMITS".into(), backend.into()));
    }
    env.extra_env.push(("TOLLGATE_PERMITS_CAP".into(), "7".into()));
    let gw = env.start_gateway().await;
    let (pid, plain_key, plain_secret) = env.project_with_key(safe_timezone()).await;
    let (a_key, a_secret) = key(&env, &pid, json!({"name": "a", "grants": {"max_concurrent": 5}})).await;
    let (_, b_secret) = key(&env, &pid, json!({"name": "b", "grants": {"max_concurrent": 5}})).await;
    let a_quota = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": a_key, "metric": "calls", "window": "day", "limit": 1000}))
        .await;

    // Five for key a; the sixth is the key's limit, and reserves nothing.
    let mut a = Vec::new();
    for _ in 0..5 {
        let (s, _, b) = take(&env, &gw, json!({"api_key": a_secret})).await;
        assert_eq!(s, 200, "{b}");
        assert!(b["permit"]["fencing_token"].as_u64().is_some(), "{b}");
        a.push(b);
    }
    let (s, h, b) = take(&env, &gw, json!({"api_key": a_secret})).await;
    assert_too_many(s, &h, &b, 5, "api_key", Some(&a_key));
    assert!(b["error"]["message"].as_str().is_some_and(|m| m.contains(&a_key)), "{b}");
    let (_, q) = env.admin_get(&format!("/v1/quotas/{a_quota}")).await;
    assert_eq!(q["current_usage"]["count"], 5, "a refused slot reserves nothing: {q}");

    // Two for key b fill the installation's 7; the next is the installation's limit.
    let mut b_held = Vec::new();
    for _ in 0..2 {
        let (s, _, b) = take(&env, &gw, json!({"api_key": b_secret})).await;
        assert_eq!(s, 200, "{b}");
        b_held.push(permit_id(&b));
    }
    let (s, h, b) = take(&env, &gw, json!({"api_key": b_secret})).await;
    assert_too_many(s, &h, &b, 7, "installation", None);

    // A DELETE frees a slot once; key b takes the installation slot it freed.
    let first = permit_id(&a[0]);
    assert_eq!(delete_permit(&env.http, &gw, &first).await, 204);
    assert_eq!(delete_permit(&env.http, &gw, &first).await, 404, "released once");
    let (s, _) = renew(&env, &gw, &first).await;
    assert_eq!(s, 404, "a released permit cannot be renewed");
    let (s, _, b) = take(&env, &gw, json!({"api_key": b_secret})).await;
    assert_eq!(s, 200, "{b}");
    b_held.push(permit_id(&b));

    // Settling the call's event with its permit frees it too (and settles the reservation).
    let second = &a[1];
    let mut ev = call_event("settled-1", &pid, &a_key, second["reservation_id"].as_str(), 2);
    ev["permit_id"] = second["permit"]["id"].clone();
    let (s, b) = post_events(&env.http, &gw, vec![ev.clone()]).await;
    assert_eq!((s, b["permits_released"].clone()), (202, json!(1)), "{b}");
    let (s, b) = post_events(&env.http, &gw, vec![ev]).await;
    assert_eq!((s, b["permits_released"].clone()), (202, json!(0)), "released once: {b}");
    let mut bad = call_event("settled-2", &pid, &a_key, None, 1);
    bad["permit_id"] = json!("not a permit");
    let (s, b) = post_events(&env.http, &gw, vec![bad]).await;
    assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!("events[0].permit_id")), "{b}");
    let (s, _, b) = take(&env, &gw, json!({"api_key": a_secret})).await;
    assert_eq!(s, 200, "the settled permit's slot is free: {b}");
    a.push(b);

    // Renew answers the same permit with a later expiry; an unknown one is 404.
    let third = permit_id(&a[2]);
    let before = a[2]["permit"]["expires_at"].as_str().and_then(|t| t.parse::<DateTime<Utc>>().ok()).expect("expiry");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (s, r) = renew(&env, &gw, &third).await;
    assert_eq!(s, 200, "{r}");
    assert_eq!((r["id"].clone(), r["fencing_token"].clone()), (json!(third), a[2]["permit"]["fencing_token"].clone()));
    assert!(expires_at(&r) > before, "{r}");
    let (s, _) = renew(&env, &gw, "pmt_never").await;
    assert_eq!(s, 404);
    for b in &a[2..] {
        assert_eq!(delete_permit(&env.http, &gw, &permit_id(b)).await, 204);
    }
    for id in &b_held {
        assert_eq!(delete_permit(&env.http, &gw, id).await, 204);
    }

    // Both or neither: a refused reservation takes no slot.
    let (c_key, c_secret) = key(&env, &pid, json!({"name": "c", "grants": {"max_concurrent": 3}})).await;
    let c_quota = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": c_key, "metric": "calls", "window": "day", "limit": 2}))
        .await;
    let mut c = Vec::new();
    for _ in 0..2 {
        let (s, _, b) = take(&env, &gw, json!({"api_key": c_secret})).await;
        assert_eq!(s, 200, "{b}");
        c.push(permit_id(&b));
    }
    for _ in 0..3 {
        let (s, _, b) = take(&env, &gw, json!({"api_key": c_secret})).await;
        assert_eq!((s, b["error"]["code"].clone()), (429, json!("QUOTA_EXCEEDED")), "{b}");
    }
    let (s, q) =
        env.admin_req(reqwest::Method::PATCH, &format!("/v1/quotas/{c_quota}"), Some(json!({"limit": 10}))).await;
    assert_eq!(s, 200, "{q}");
    let (s, _, b) = take(&env, &gw, json!({"api_key": c_secret})).await;
    assert_eq!(s, 200, "the refused reservations left the third slot free: {b}");
    c.push(permit_id(&b));
    let (s, h, b) = take(&env, &gw, json!({"api_key": c_secret})).await;
    assert_too_many(s, &h, &b, 3, "api_key", Some(&c_key));
    let (_, q) = env.admin_get(&format!("/v1/quotas/{c_quota}")).await;
    assert_eq!(q["current_usage"]["count"], 3, "and the refused slot reserved nothing: {q}");
    for id in &c {
        assert_eq!(delete_permit(&env.http, &gw, id).await, 204);
    }

    // Whose limit: the role's when narrower; a signed-in user's slots are its own.
    let narrow = role(&env, &pid, json!({"name": "partner", "grants": {"max_concurrent": 1}})).await;
    let (_, d_secret) = key(&env, &pid, json!({"name": "d", "role_id": narrow, "grants": {"max_concurrent": 3}})).await;
    let (s, _, d) = take(&env, &gw, json!({"api_key": d_secret})).await;
    assert_eq!(s, 200, "{d}");
    let (s, h, b) = take(&env, &gw, json!({"api_key": d_secret})).await;
    assert_too_many(s, &h, &b, 1, "role", Some(&narrow));
    let (s, _, alice) = take(&env, &gw, json!({"user": "user:alice", "role_id": narrow})).await;
    assert_eq!(s, 200, "alice's slots are not the key's: {alice}");
    let (s, h, b) = take(&env, &gw, json!({"user": "user:alice", "role_id": narrow})).await;
    assert_too_many(s, &h, &b, 1, "role", Some(&narrow));
    let (s, _, bob) = take(&env, &gw, json!({"user": "user:bob", "role_id": narrow})).await;
    assert_eq!(s, 200, "bob's slots are his own: {bob}");
    for b in [&d, &alice, &bob] {
        assert_eq!(delete_permit(&env.http, &gw, &permit_id(b)).await, 204);
    }

    // Exempt roles (administrators) and break-glass take no slot; nor does
    // a key without max_concurrent, nor a check that does not ask.
    let admins = role(&env, &pid, json!({"name": "admins", "exempt": true, "grants": {"max_concurrent": 1}})).await;
    let (_, admin_secret) = key(&env, &pid, json!({"name": "admin", "role_id": admins})).await;
    for _ in 0..9 {
        for body in [
            json!({"api_key": admin_secret}),
            json!({"user": "user:root", "role_id": admins}),
            json!({"break_glass": true}),
        ] {
            let (s, _, b) = take(&env, &gw, body).await;
            assert_eq!((s, b["exempt"].clone(), b.get("permit")), (200, json!(true), None), "{b}");
        }
        let (s, _, b) = take(&env, &gw, json!({"api_key": plain_secret})).await;
        assert_eq!((s, b.get("permit")), (200, None), "{plain_key} has no max_concurrent: {b}");
        let (s, _, b) = post(&env, &gw, "/v1/check", json!({"api_key": a_secret})).await;
        assert_eq!((s, b.get("permit")), (200, None), "not asked: {b}");
    }
    // None of those took an installation slot: all 7 are free.
    let (e_key, e_secret) = key(&env, &pid, json!({"name": "e", "grants": {"max_concurrent": 7}})).await;
    for _ in 0..7 {
        let (s, _, b) = take(&env, &gw, json!({"api_key": e_secret})).await;
        assert_eq!(s, 200, "{b}");
    }
    let (s, h, b) = take(&env, &gw, json!({"api_key": e_secret})).await;
    assert_too_many(s, &h, &b, 7, "api_key", Some(&e_key));
    let (s, _, b) = post(&env, &gw, "/v1/check", json!({"api_key": a_secret, "permit": "yes"})).await;
    assert_eq!((s, b["error"]["meta"]["field"].clone()), (400, json!("permit")), "{b}");
}

#[tokio::test]
async fn the_narrowest_of_key_role_and_server_wins() {
    narrowest(Mode::Distributed).await;
}

#[tokio::test]
async fn the_narrowest_of_key_role_and_server_wins_dev() {
    narrowest(Mode::Dev).await;
}

/// The bounds a check answers and a key's detail shows: each the smallest of
/// the key's grant, its role's and the server's setting; a wider grant is
/// accepted and shown beside the effective value.
async fn narrowest(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    for (k, v) in
        [("TOLLGATE_MAX_PAGE_SIZE", "300"), ("TOLLGATE_STREAM_MAX_ROWS", "400"), ("TOLLGATE_QUERY_TIMEOUT", "20s")]
    {
        env.extra_env.push((k.into(), v.into()));
    }
    let gw = env.start_gateway().await;
    let (pid, _, plain) = env.project_with_key(safe_timezone()).await;
    let rid = role(&env, &pid, json!({"name": "analyst", "grants": {"max_rows": 500, "query_timeout": 10}})).await;
    let (wide, wide_secret) =
        key(&env, &pid, json!({"name": "wide", "role_id": rid, "grants": {"max_rows": 1000, "query_timeout": 60}}))
            .await;
    let (narrow, narrow_secret) =
        key(&env, &pid, json!({"name": "narrow", "role_id": rid, "grants": {"max_rows": 100}})).await;

    // (secret, key id, expected {query_timeout, max_rows, stream_max_rows})
    let cases = [
        // The server's page and stream bounds, the role's timeout.
        (
            wide_secret.as_str(),
            Some(wide.as_str()),
            json!({"query_timeout": 10, "max_rows": 300, "stream_max_rows": 400}),
        ),
        // The key's rows, the role's timeout.
        (
            narrow_secret.as_str(),
            Some(narrow.as_str()),
            json!({"query_timeout": 10, "max_rows": 100, "stream_max_rows": 100}),
        ),
        // No grants: the server's.
        (plain.as_str(), None, json!({"query_timeout": 20, "max_rows": 300, "stream_max_rows": 400})),
    ];
    for (secret, id, expected) in cases {
        let (s, _, b) = post(&env, &gw, "/v1/check", json!({"api_key": secret})).await;
        assert_eq!(s, 200, "{b}");
        assert_eq!(b["limits"], expected, "{b}");
        if let Some(id) = id {
            let (s, d) = env.admin_get(&format!("/v1/api-keys/{id}")).await;
            assert_eq!(s, 200, "{d}");
            let mut shown = d["effective_limits"].clone();
            shown.as_object_mut().expect("limits").remove("max_concurrent");
            assert_eq!(shown, expected, "{d}");
        }
    }
    let (_, d) = env.admin_get(&format!("/v1/api-keys/{wide}")).await;
    assert_eq!(d["grants"], json!({"max_rows": 1000, "query_timeout": 60}), "the wider grant is kept and shown: {d}");
}
