//! Webhooks end to end: an endpoint subscribed through the admin API, a
//! receiver on a local port that holds every delivery to the Standard
//! Webhooks spec with an implementation of its own (`testkit::webhooks`),
//! on `tollgate dev` (which runs the notifier) and on `tollgate notify`
//! processes over PostgreSQL, one of them `kill -9`ed mid-delivery.

use std::time::Duration;

use serde_json::json;
use testkit::webhooks::Receiver;

use crate::harness::*;

/// Subscribes `url` to every event of a new project; (project, endpoint, secret).
async fn subscribe(env: &Env, url: &str) -> (String, String, String) {
    let (s, p) = env.admin_post("/v1/projects", json!({"name": "hooks"})).await;
    assert_eq!(s, 201, "{p}");
    let project = p["id"].as_str().expect("project id").to_owned();
    let (id, secret) = env.webhook(&project, url).await;
    (project, id, secret)
}

/// `tollgate dev`: a test fire reaches a local receiver, signed; the
/// delivery log shows the attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_dev_delivers_a_signed_test_message() {
    let mut env = Env::dev().await;
    env.start_gateway().await;
    let receiver = Receiver::start(vec![]).await;
    let (_, wh, secret) = subscribe(&env, &receiver.url("/hook")).await;
    let (s, t) = env.admin_post(&format!("/v1/webhooks/{wh}/test"), json!({})).await;
    assert_eq!(s, 202, "{t}");
    let message = t["message_id"].as_str().expect("message id").to_owned();
    env.eventually(10, "the test message at the receiver", || async { !receiver.received().is_empty() }).await;
    receiver.verify_all(&[&secret]);
    let got = receiver.received();
    assert_eq!(got[0].id, message);
    let body: serde_json::Value = serde_json::from_slice(&got[0].body).expect("a JSON body");
    assert_eq!(body["type"], "webhook.test");
    env.eventually(10, "the attempt in the delivery log", || async {
        let (_, d) = env.admin_get(&format!("/v1/webhooks/{wh}/deliveries")).await;
        d["data"][0]["status"] == "succeeded" && d["data"][0]["attempts"][0]["status_code"] == 204
    })
    .await;
}

/// `tollgate notify` over PostgreSQL: one notifier `kill -9`ed while the
/// receiver holds its request loses nothing (another delivers the message,
/// under the same webhook-id, once the claim lapses); then two notifiers
/// deliver 40 messages, each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_notifiers_killed_mid_delivery_lose_nothing_and_never_send_twice() {
    let Some(mut env) = Env::new().await else { return };
    env.extra_env.push(("TOLLGATE_WEBHOOK_ALLOW_PRIVATE".into(), "true".into()));
    env.start_gateway().await;
    let receiver = Receiver::start(vec![]).await;
    receiver.delay_next(vec![Duration::from_secs(60)]);
    let (_, wh, secret) = subscribe(&env, &receiver.url("/hook")).await;
    let short = [("TOLLGATE_WEBHOOK_TIMEOUT", "2s"), ("TOLLGATE_NOTIFY_LEASE", "3s"), ("TOLLGATE_NOTIFY_POLL", "50ms")];
    let first = env.start_notifier_with(&short);
    let (s, t) = env.admin_post(&format!("/v1/webhooks/{wh}/test"), json!({})).await;
    assert_eq!(s, 202, "{t}");
    let message = t["message_id"].as_str().expect("message id").to_owned();
    env.eventually(15, "the first attempt at the receiver", || async { !receiver.received().is_empty() }).await;
    env.kill(first);
    env.start_notifier_with(&short);
    env.start_notifier_with(&short);
    env.eventually(20, "the message delivered by another notifier", || async {
        let (_, d) = env.admin_get(&format!("/v1/webhooks/{wh}/deliveries")).await;
        d["data"][0]["status"] == "succeeded"
    })
    .await;
    let got = receiver.received();
    assert!(got.len() >= 2 && got.iter().all(|r| r.id == message), "one webhook-id across notifiers: {got:?}");

    let mut fired = Vec::new();
    for _ in 0..40 {
        let (s, t) = env.admin_post(&format!("/v1/webhooks/{wh}/test"), json!({})).await;
        assert_eq!(s, 202);
        fired.push(t["message_id"].as_str().expect("message id").to_owned());
    }
    env.eventually(30, "40 messages at the receiver", || async { receiver.received().len() >= got.len() + 40 }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut later: Vec<String> = receiver.received().into_iter().skip(got.len()).map(|r| r.id).collect();
    later.sort();
    fired.sort();
    assert_eq!(later, fired, "each message exactly once with two notifiers running");
    receiver.verify_all(&[&secret]);
}
