//! Quota alerts end to end (issue 10, items 2, 3 and 8; DESIGN §2.11 and
//! §12): `quota.exceeded` and `quota.nearly_used` are made by the fold, in
//! its transaction, from the log — never by a gateway — and delivered to a
//! receiver on a local port that checks every signature with an
//! implementation of its own (`testkit::webhooks`).
//!
//! - two gateways and 64 clients against an enforce `calls` quota: each
//!   alert exactly once at the receiver and in the outbox;
//! - `nearly_used` at 80 and at 100 %, once each, re-armed in the next
//!   window (the window is the event time's: events are posted at times in
//!   two windows), on `tollgate dev` (the SQLite store);
//! - a monitor quota fires `quota.exceeded` with `mode: monitor` and writes
//!   one audit entry;
//! - `tollgate replay` and `--swap` re-send nothing;
//! - a projector `kill -9`ed between the fold and the delivery, and again
//!   mid-batch, loses no alert and duplicates none.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::Utc;
use serde_json::{Value, json};
use testkit::webhooks::Receiver;

use crate::harness::*;

const ALLOW_PRIVATE: (&str, &str) = ("TOLLGATE_WEBHOOK_ALLOW_PRIVATE", "true");
const FAST_NOTIFIER: [(&str, &str); 1] = [("TOLLGATE_NOTIFY_POLL", "50ms")];

/// Subscribes `url` to `quota.*` of a project; the endpoint's secret.
async fn subscribe(env: &Env, project: &str, url: &str) -> String {
    let (s, w) = env
        .admin_post(&format!("/v1/projects/{project}/webhooks"), json!({"url": url, "event_types": ["quota.*"]}))
        .await;
    assert_eq!(s, 201, "{w}");
    w["secret"].as_str().expect("secret").to_owned()
}

/// The quota alerts the receiver got: (type, body), in arrival order.
fn alerts(receiver: &Receiver) -> Vec<(String, Value)> {
    receiver
        .received()
        .into_iter()
        .map(|r| {
            let body: Value = serde_json::from_slice(&r.body).expect("a JSON body");
            (body["type"].as_str().expect("a type").to_owned(), body)
        })
        .filter(|(t, _)| t.starts_with("quota."))
        .collect()
}

/// What each alert is about: (quota, window key, type, threshold) → how
/// many times it arrived.
fn tally(got: &[(String, Value)]) -> BTreeMap<(String, String, String, Option<u64>), usize> {
    let mut out = BTreeMap::new();
    for (t, b) in got {
        let d = &b["data"];
        let k = (
            d["quota_id"].as_str().expect("quota_id").to_owned(),
            d["window_key"].as_str().expect("window_key").to_owned(),
            t.clone(),
            d["threshold"].as_u64(),
        );
        *out.entry(k).or_insert(0) += 1;
    }
    out
}

/// The three alerts of a quota used up in one window, once each.
fn once_each(quota: &str, window_key: &str) -> BTreeMap<(String, String, String, Option<u64>), usize> {
    [("quota.exceeded", None), ("quota.nearly_used", Some(80)), ("quota.nearly_used", Some(100))]
        .into_iter()
        .map(|(t, th)| ((quota.to_owned(), window_key.to_owned(), t.to_owned(), th), 1))
        .collect()
}

/// The outbox of the environment's PostgreSQL store (`shadow`: the
/// replay's shadow schema): (dedup keys, deliveries).
async fn outbox(env: &Env, shadow: bool) -> (Vec<String>, i64) {
    let (keys_sql, deliveries_sql) = if shadow {
        (
            "SELECT dedup_key FROM tollgate_shadow.notification_messages WHERE dedup_key IS NOT NULL ORDER BY dedup_key",
            "SELECT COUNT(*) FROM tollgate_shadow.webhook_deliveries",
        )
    } else {
        (
            "SELECT dedup_key FROM notification_messages WHERE dedup_key IS NOT NULL ORDER BY dedup_key",
            "SELECT COUNT(*) FROM webhook_deliveries",
        )
    };
    let pool = sqlx::PgPool::connect(&env.db_url).await.expect("connect");
    let keys: Vec<String> = sqlx::query_scalar(keys_sql).fetch_all(&pool).await.expect("the outbox");
    let deliveries: i64 = sqlx::query_scalar(deliveries_sql).fetch_one(&pool).await.expect("deliveries");
    pool.close().await;
    (keys, deliveries)
}

/// The window key a quota's checks count in now.
async fn window_key(env: &Env, quota: &str) -> String {
    let (s, q) = env.admin_get(&format!("/v1/quotas/{quota}")).await;
    assert_eq!(s, 200, "{q}");
    q["current_usage"]["window_key"].as_str().expect("window key").to_owned()
}

/// `clients` clients check and settle through the gateways in turn until
/// each was refused twice; how many were admitted.
async fn rush(env: &Env, clients: usize, pid: &str, kid: &str, secret: &str) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let gw = env.gateways[c % env.gateways.len()].clone();
        let (http, pid, kid, secret, admitted) =
            (env.http.clone(), pid.to_owned(), kid.to_owned(), secret.to_owned(), admitted.clone());
        tasks.push(tokio::spawn(async move {
            let mut refused = 0;
            let mut i = 0;
            while refused < 2 {
                let r = check(&http, &gw, &secret, json!({})).await;
                match r.status().as_u16() {
                    200 => {
                        let b: Value = r.json().await.expect("a check body");
                        let res = b["reservation_id"].as_str().expect("a reservation").to_owned();
                        let (s, b) =
                            post_events(&http, &gw, vec![call_event(&format!("c{c}-{i}"), &pid, &kid, Some(&res), 1)])
                                .await;
                        assert_eq!(s, 202, "{b}");
                        admitted.fetch_add(1, Ordering::SeqCst);
                        i += 1;
                    }
                    429 => refused += 1,
                    s => panic!("check answered {s}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client");
    }
    admitted.load(Ordering::SeqCst)
}

/// Two gateways, 64 clients, one enforce `calls` quota: it admits exactly
/// its limit, and each of its three alerts reaches the receiver once,
/// signed, and is in the outbox once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_two_gateways_and_64_clients_fire_each_alert_once() {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push((ALLOW_PRIVATE.0.into(), ALLOW_PRIVATE.1.into()));
    env.start_gateway().await;
    env.start_gateway().await;
    env.start_projector();
    env.start_notifier_with(&FAST_NOTIFIER);
    let receiver = Receiver::start(vec![]).await;
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let hook = subscribe(&env, &pid, &receiver.url("/hook")).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 150}))
        .await;
    assert_eq!(rush(&env, 64, &pid, &kid, &secret).await, 150, "exact admission");
    let day = window_key(&env, &qid).await;
    env.eventually(60, "three alerts at the receiver", || async { alerts(&receiver).len() >= 3 }).await;
    // Every refused check's breach is folded too: nothing more comes.
    env.eventually(60, "the fold of every call", || async { env.durable(&pid, "p", "day").await.1 == 150 }).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = alerts(&receiver);
    assert_eq!(tally(&got), once_each(&qid, &day), "{got:?}");
    receiver.verify_all(&[&hook]);
    let (keys, deliveries) = outbox(&env, false).await;
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert_eq!(deliveries, 3);
    let exceeded = &got.iter().find(|(t, _)| t == "quota.exceeded").expect("exceeded").1;
    let d = &exceeded["data"];
    assert_eq!(
        (d["project_id"].as_str(), d["scope"].as_str(), d["metric"].as_str(), d["window"].as_str()),
        (Some(pid.as_str()), Some("project"), Some("calls"), Some("day"))
    );
    assert_eq!(
        (d["limit"].as_u64(), d["mode"].as_str(), d["scope_ref"].clone()),
        (Some(150), Some("enforce"), Value::Null)
    );
    assert!(d["observed_value"].as_u64().is_some_and(|v| v >= 150), "{d}");
    let warning = &got.iter().find(|(_, b)| b["data"]["threshold"] == 80).expect("warning").1;
    assert_eq!(
        (warning["data"]["severity"].as_str(), warning["data"]["observed_value"].as_u64()),
        (Some("warning"), Some(120))
    );
    assert!(warning["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{warning}");
}

/// `tollgate dev`: `nearly_used` at 80 and at 100 % once each, then again
/// in the next window (events at times in two hours of a `rolling_1h`
/// quota); more usage in a used-up window adds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_dev_nearly_used_at_80_and_100_re_armed_in_the_next_window() {
    let mut env = Env::dev().await;
    env.start_gateway().await;
    let receiver = Receiver::start(vec![]).await;
    let (pid, kid, _) = env.project_with_key("UTC").await;
    let hook = subscribe(&env, &pid, &receiver.url("/hook")).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "api_key", "scope_ref": kid, "metric": "calls",
                      "window": "rolling_1h", "limit": 5}))
        .await;
    let now = Utc::now();
    let earlier = now - chrono::Duration::hours(2);
    let at = |id: String, t: chrono::DateTime<Utc>| {
        let mut e = call_event(&id, &pid, &kid, None, 1);
        e["occurred_at"] = json!(t.to_rfc3339());
        e
    };
    let hour = |t: chrono::DateTime<Utc>| t.format("%Y-%m-%dT%H:00Z").to_string();
    let (s, b) = post_events(&env.http, env.gw(), (0..5).map(|i| at(format!("a{i}"), earlier)).collect()).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(30, "the first window's three alerts", || async { alerts(&receiver).len() >= 3 }).await;
    let (s, b) = post_events(&env.http, env.gw(), (0..7).map(|i| at(format!("b{i}"), now)).collect()).await;
    assert_eq!(s, 202, "{b}");
    env.eventually(30, "the next window's three alerts", || async { alerts(&receiver).len() >= 6 }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = alerts(&receiver);
    let mut want = once_each(&qid, &hour(earlier));
    want.extend(once_each(&qid, &hour(now)));
    assert_eq!(tally(&got), want, "{got:?}");
    receiver.verify_all(&[&hook]);
    for (t, b) in &got {
        let d = &b["data"];
        let expected = match d["threshold"].as_u64() {
            Some(80) => (4, Some("warning")),
            Some(100) => (5, Some("critical")),
            _ => (5, None),
        };
        assert_eq!((d["observed_value"].as_u64(), d["severity"].as_str()), (Some(expected.0), expected.1), "{t}: {b}");
        assert_eq!((d["scope"].as_str(), d["scope_ref"].as_str()), (Some("api_key"), Some(kid.as_str())));
    }
}

/// A monitor quota never refuses; going over it fires `quota.exceeded`
/// with `mode: monitor` and writes one `quotas:MonitorBreach` entry, from
/// the fold (on `tollgate dev`, and on `serve` + `project` + `notify`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_monitor_quota_fires_and_audits_once_dev() {
    monitor(Mode::Dev).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_monitor_quota_fires_and_audits_once() {
    monitor(Mode::Distributed).await;
}

async fn monitor(mode: Mode) {
    let Some(mut env) = Env::of(mode).await else { return };
    env.extra_env.push((ALLOW_PRIVATE.0.into(), ALLOW_PRIVATE.1.into()));
    env.start_gateway().await;
    if mode == Mode::Distributed {
        env.start_gateway().await;
        env.start_projector();
        env.start_notifier_with(&FAST_NOTIFIER);
    }
    let receiver = Receiver::start(vec![]).await;
    let (pid, _, secret) = env.project_with_key(safe_timezone()).await;
    let hook = subscribe(&env, &pid, &receiver.url("/hook")).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "requests", "window": "day", "limit": 2,
                      "mode": "monitor"}))
        .await;
    for i in 0..6 {
        let gw = env.gateways[i % env.gateways.len()].clone();
        assert_eq!(check(&env.http, &gw, &secret, json!({})).await.status().as_u16(), 200, "monitor never refuses");
    }
    env.eventually(30, "the monitor quota's alerts", || async { alerts(&receiver).len() >= 3 }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = alerts(&receiver);
    let day = window_key(&env, &qid).await;
    assert_eq!(tally(&got), once_each(&qid, &day), "{got:?}");
    receiver.verify_all(&[&hook]);
    let exceeded = &got.iter().find(|(t, _)| t == "quota.exceeded").expect("exceeded").1["data"];
    assert_eq!(exceeded["mode"].as_str(), Some("monitor"));
    // One gateway: the third request is the first over the limit. Two: each
    // publishes its request events in the background, so the log may hold
    // the fourth check's (its breach observed 4) before the third's; the
    // alert is the log's first sighting, whichever that is, and the audit
    // entry says the same.
    let observed = exceeded["observed_value"].as_u64().expect("observed_value");
    match mode {
        Mode::Dev => assert_eq!(observed, 3, "{exceeded}"),
        Mode::Distributed => assert!((3..=6).contains(&observed), "{exceeded}"),
    }
    // The breach's audit entry, written by the same fold, reaches the audit
    // log through the audit topic.
    let is_breach = |e: &Value| e["action"] == "quotas:MonitorBreach";
    let log = env.audit_when(&pid, 30, "the monitor breach", |e| e.iter().any(is_breach)).await;
    let breaches: Vec<&Value> = log.iter().filter(|e| is_breach(e)).collect();
    assert_eq!(breaches.len(), 1, "{log:?}");
    assert_eq!(
        (breaches[0]["resource"].as_str(), breaches[0]["detail"]["observed_value"].as_u64()),
        (Some(qid.as_str()), Some(observed))
    );
}

/// `tollgate replay` folds the log into a shadow whose outbox gets the same
/// alerts (its own, with no endpoint, so nothing is sent), reports the same
/// dedup keys on both sides, and neither it nor `--swap` makes the live
/// notifier send anything again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_replay_and_swap_re_send_nothing() {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push((ALLOW_PRIVATE.0.into(), ALLOW_PRIVATE.1.into()));
    env.start_gateway().await;
    env.start_projector();
    env.start_notifier_with(&FAST_NOTIFIER);
    let receiver = Receiver::start(vec![]).await;
    let (pid, kid, secret) = env.project_with_key(safe_timezone()).await;
    let hook = subscribe(&env, &pid, &receiver.url("/hook")).await;
    let qid = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 20}))
        .await;
    assert_eq!(rush(&env, 8, &pid, &kid, &secret).await, 20);
    env.eventually(60, "three alerts at the receiver", || async { alerts(&receiver).len() >= 3 }).await;
    env.eventually(60, "the fold of every call", || async { env.durable(&pid, "p", "day").await.1 == 20 }).await;
    let (live_keys, deliveries) = outbox(&env, false).await;
    assert_eq!((live_keys.len(), deliveries), (3, 3));

    let out = crate::replay::replay(&env, &[]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && text.contains("no differences"), "{text}");
    assert!(text.contains("0 only live, 0 only in the shadow"), "the shadow made the same alerts: {text}");
    let (shadow_keys, shadow_deliveries) = outbox(&env, true).await;
    assert_eq!(shadow_keys, live_keys, "the same dedup keys");
    assert_eq!(shadow_deliveries, 0, "the shadow has no endpoints: it sends nothing");
    let swapped = crate::replay::replay(&env, &["--swap"]);
    let text = String::from_utf8_lossy(&swapped.stdout).into_owned();
    assert!(text.contains("swapped"), "{text}");
    // The live fold goes on after the swap: refused checks (their breaches
    // folded) in the used-up window add nothing.
    for _ in 0..3 {
        assert_eq!(check(&env.http, env.gw(), &secret, json!({})).await.status().as_u16(), 429);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(outbox(&env, false).await, (live_keys, 3), "the live outbox as it was");
    let got = alerts(&receiver);
    assert_eq!(tally(&got), once_each(&qid, &window_key(&env, &qid).await), "nothing sent again: {got:?}");
    receiver.verify_all(&[&hook]);
}

/// The projector `kill -9`ed after it committed alerts and before any was
/// delivered (no notifier runs yet), then again in the middle of a stream
/// of events that crosses a second quota: once a notifier runs, every
/// alert arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_projector_killed_between_fold_and_delivery_loses_none_and_duplicates_none() {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push((ALLOW_PRIVATE.0.into(), ALLOW_PRIVATE.1.into()));
    env.start_gateway().await;
    let projector = env.start_projector();
    let receiver = Receiver::start(vec![]).await;
    let (pid, kid, _) = env.project_with_key(safe_timezone()).await;
    let hook = subscribe(&env, &pid, &receiver.url("/hook")).await;
    let first = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "day", "limit": 30}))
        .await;
    let second = env
        .quota(json!({"project_id": pid, "scope": "project", "metric": "calls", "window": "rolling_24h",
                      "limit": 400}))
        .await;
    let (s, b) =
        post_events(&env.http, env.gw(), (0..40).map(|i| call_event(&format!("a{i}"), &pid, &kid, None, 1)).collect())
            .await;
    assert_eq!(s, 202, "{b}");
    env.eventually(60, "the first quota's alerts in the outbox", || async { outbox(&env, false).await.0.len() == 3 })
        .await;
    env.kill(projector);
    assert!(receiver.received().is_empty(), "no notifier yet");

    // A stream of events across the second quota's thresholds, the
    // projector killed in the middle of it and started again.
    let mut projector = env.start_projector();
    for round in 0..12 {
        let events = (0..40).map(|i| call_event(&format!("b{round}-{i}"), &pid, &kid, None, 1)).collect();
        let (s, b) = post_events(&env.http, env.gw(), events).await;
        assert_eq!(s, 202, "{b}");
        if round == 5 || round == 9 {
            env.kill(projector);
            projector = env.start_projector();
        }
    }
    env.eventually(90, "the fold of every call", || async { env.durable(&pid, "p", "day").await.1 == 520 }).await;
    env.start_notifier_with(&FAST_NOTIFIER);
    env.eventually(60, "six alerts at the receiver", || async { alerts(&receiver).len() >= 6 }).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = alerts(&receiver);
    let mut want = once_each(&first, &window_key(&env, &first).await);
    want.extend(once_each(&second, &window_key(&env, &second).await));
    assert_eq!(tally(&got), want, "{got:?}");
    receiver.verify_all(&[&hook]);
    let (keys, deliveries) = outbox(&env, false).await;
    assert_eq!((keys.len(), deliveries), (6, 6), "{keys:?}");
}
