//! The notifier against a receiver on a local port, on the embedded store
//! and on PostgreSQL (a database of its own; skipped when PostgreSQL does
//! not answer, unless `TOLLGATE_REQUIRE_SERVICES` is set). Time is a
//! `ManualClock`: the tests drive the retry schedule by moving it.
//!
//! The receiver checks every signature with an implementation of the
//! Standard Webhooks spec of its own (HMAC and base64 written out here, not
//! the notifier's), held first to the spec's published test vector.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use meter::webhook::{QUOTA_EXCEEDED, dedup_key};
use meter::{
    AuditAction, Clock, DeliveryStatus, Endpoint, EventTypes, ManualClock, MessageId, Notification, Project, ProjectId,
    Store, WebhookId,
};
use projector::notify::{Notifier, NotifierConfig, new_secret};
use serde_json::json;
use store::{PgStore, SqliteStore};

use testkit::webhooks::{Receiver, expected_signature};

#[test]
fn the_receivers_own_implementation_gives_the_published_vector() {
    assert_eq!(
        expected_signature(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "1614265330",
            br#"{"test": 2432232314}"#
        ),
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    );
}

// ---- fixtures ---------------------------------------------------------------

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("timestamp").with_timezone(&Utc)
}

const T0: &str = "2026-07-07T12:00:00Z";

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A migrated store with a project `proj_1`: SQLite, or PostgreSQL.
enum Db {
    // The second fields are kept for their drop (the file, the database).
    Sqlite(Arc<dyn Store>, #[allow(dead_code)] TempDir),
    Pg(Arc<dyn Store>, #[allow(dead_code)] testkit::TestDb),
}

impl Db {
    fn store(&self) -> Arc<dyn Store> {
        match self {
            Db::Sqlite(s, _) | Db::Pg(s, _) => s.clone(),
        }
    }
}

async fn with_project(store: Arc<dyn Store>) -> Arc<dyn Store> {
    store
        .create_project(&Project {
            id: ProjectId::parse("proj_1").unwrap(),
            name: "p".into(),
            timezone: chrono_tz::Tz::UTC,
            created_at: utc(T0),
        })
        .await
        .expect("project");
    store
}

async fn sqlite() -> Db {
    let dir = std::env::temp_dir().join(format!("tollgate-notify-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let s = SqliteStore::open(&dir.join("t.db")).await.expect("open");
    s.migrate().await.expect("migrate");
    Db::Sqlite(with_project(Arc::new(s)).await, TempDir(dir))
}

async fn pg() -> Option<Db> {
    if !testkit::available(&[testkit::Service::Postgres]) {
        return None;
    }
    let db = testkit::TestDb::new("tgn").await;
    let s = PgStore::connect(&db.url).await.expect("connect");
    s.migrate().await.expect("migrate");
    Some(Db::Pg(with_project(Arc::new(s)).await, db))
}

/// Both backends (PostgreSQL when it answers).
async fn backends() -> Vec<Db> {
    let mut out = vec![sqlite().await];
    out.extend(pg().await);
    out
}

async fn subscribe(store: &dyn Store, id: &str, url: String, secret: &str) -> Endpoint {
    let e = Endpoint {
        id: WebhookId::parse(id).unwrap(),
        project_id: ProjectId::parse("proj_1").unwrap(),
        url,
        event_types: EventTypes::parse(vec!["quota.*".into()], "event_types").unwrap(),
        description: None,
        enabled: true,
        disabled_reason: None,
        secret: secret.to_owned(),
        previous_secret: None,
        failing_since: None,
        created_at: utc(T0),
        updated_at: utc(T0),
    };
    store.create_endpoint(&e, &[]).await.expect("create endpoint");
    e
}

async fn exceeded(store: &dyn Store, id: &str, window: &str, at: DateTime<Utc>) -> Notification {
    let n = Notification::new(
        MessageId::parse(id).unwrap(),
        ProjectId::parse("proj_1").unwrap(),
        QUOTA_EXCEEDED,
        json!({"quota_id": "quota_1", "window_key": window, "limit": 5, "observed_value": 6}),
        Some(dedup_key("quota_1", window, QUOTA_EXCEEDED, None)),
        at,
    );
    assert!(store.enqueue(&n, None).await.expect("enqueue"));
    n
}

fn notifier(store: Arc<dyn Store>, clock: &ManualClock, name: &str) -> Notifier {
    let config = NotifierConfig {
        claimant: name.to_owned(),
        allow_private: true,
        timeout: std::time::Duration::from_secs(2),
        lease: Duration::seconds(5),
        ..NotifierConfig::default()
    };
    Notifier::new(store, Arc::new(clock.clone()), config).expect("notifier")
}

// ---- the tests ----------------------------------------------------------------

/// Failing three times then answering: four attempts under one webhook-id,
/// each with its own timestamp and signature, at waits that grow (5 s,
/// 5 min, 30 min, each within ±20 %); the delivery log shows them all.
#[tokio::test]
async fn a_receiver_failing_three_times_gets_four_attempts_at_growing_jittered_delays() {
    for db in backends().await {
        let store = db.store();
        let receiver = Receiver::start(vec![500, 503, 500]).await;
        let secret = new_secret();
        let e = subscribe(store.as_ref(), "wh_a", receiver.url("/hook"), &secret).await;
        let clock = ManualClock::new(utc(T0));
        let n = exceeded(store.as_ref(), "msg_1", "2026-07-07", utc(T0)).await;
        let notifier = notifier(store.clone(), &clock, "n1");
        let mut attempts_at = Vec::new();
        for _ in 0..10 {
            let r = notifier.step().await.expect("step");
            if r.attempted == 1 {
                attempts_at.push(clock.now());
            }
            if r.delivered == 1 {
                break;
            }
            let log = store.deliveries(&e.id, None, 10).await.expect("log");
            let next = log[0].next_attempt_at.expect("pending, with a next attempt");
            // Not a moment early.
            clock.set(next - Duration::milliseconds(1));
            assert_eq!(notifier.step().await.expect("step").attempted, 0, "not due yet");
            clock.set(next);
        }
        let got = receiver.received();
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|r| r.id == "msg_1" && r.body == n.body.as_bytes() && r.path == "/hook"));
        let stamps: Vec<i64> = got.iter().map(|r| r.timestamp.parse().unwrap()).collect();
        assert_eq!(stamps, attempts_at.iter().map(|t| t.timestamp()).collect::<Vec<_>>(), "the attempt's time");
        receiver.verify_all(&[&secret]);
        let waits: Vec<Duration> = attempts_at.windows(2).map(|w| w[1] - w[0]).collect();
        let bands = [(4, 6), (240, 360), (1440, 2160)];
        for (w, (lo, hi)) in waits.iter().zip(bands) {
            assert!(*w >= Duration::seconds(lo) && *w <= Duration::seconds(hi), "{w} within [{lo}s, {hi}s]");
        }
        assert!(waits.windows(2).all(|p| p[1] > p[0]), "growing: {waits:?}");
        let log = store.deliveries(&e.id, None, 10).await.expect("log");
        assert_eq!(log[0].status, DeliveryStatus::Succeeded);
        let codes: Vec<Option<u16>> = log[0].attempts.iter().map(|a| a.status_code).collect();
        assert_eq!(codes, vec![Some(500), Some(503), Some(500), Some(204)]);
        assert_eq!(log[0].attempts[0].response, "answered 500");
        assert!(store.endpoint(&e.id).await.unwrap().unwrap().failing_since.is_none(), "healthy again");
    }
}

/// A 410 disables the endpoint (with a `webhook.endpoint_disabled` audit
/// entry) and nothing more is sent to it; a redirect is not followed.
#[tokio::test]
async fn a_410_disables_the_endpoint_and_a_redirect_is_not_followed() {
    for db in backends().await {
        let store = db.store();
        let receiver = Receiver::start(vec![302, 410]).await;
        receiver.set_location(receiver.url("/elsewhere"));
        let secret = new_secret();
        let e = subscribe(store.as_ref(), "wh_a", receiver.url("/hook"), &secret).await;
        let clock = ManualClock::new(utc(T0));
        exceeded(store.as_ref(), "msg_1", "w1", utc(T0)).await;
        let notifier = notifier(store.clone(), &clock, "n1");
        assert_eq!(notifier.step().await.expect("step").attempted, 1);
        let log = store.deliveries(&e.id, None, 10).await.expect("log");
        assert_eq!(log[0].attempts[0].status_code, Some(302));
        assert_eq!(log[0].status, DeliveryStatus::Pending, "a redirect is a failure, retried");
        clock.advance(Duration::seconds(10));
        let r = notifier.step().await.expect("step");
        assert_eq!((r.attempted, r.disabled), (1, 1));
        assert!(receiver.received().iter().all(|r| r.path == "/hook"), "never /elsewhere");
        let stored = store.endpoint(&e.id).await.unwrap().unwrap();
        assert!(!stored.enabled);
        assert!(stored.disabled_reason.unwrap().contains("410"));
        let audit = store.unpublished_audit(10).await.expect("audit outbox");
        assert_eq!(audit.len(), 1);
        assert_eq!(audit[0].action, AuditAction::WebhookEndpointDisabled);
        assert_eq!(audit[0].resource, "wh_a");
        // Later notifications are kept for it, not sent.
        exceeded(store.as_ref(), "msg_2", "w2", clock.now()).await;
        clock.advance(Duration::hours(1));
        assert_eq!(notifier.step().await.expect("step").attempted, 0);
        assert_eq!(receiver.received().len(), 2);
    }
}

/// An endpoint whose attempts all fail for five days is disabled, audited.
#[tokio::test]
async fn an_endpoint_failing_for_five_days_is_disabled() {
    let db = sqlite().await;
    let store = db.store();
    let receiver = Receiver::start(vec![500; 100]).await;
    let e = subscribe(store.as_ref(), "wh_a", receiver.url("/hook"), &new_secret()).await;
    let clock = ManualClock::new(utc(T0));
    let notifier = notifier(store.clone(), &clock, "n1");
    // One failing message a day; each runs its schedule out.
    for day in 0..6 {
        let at = utc(T0) + Duration::days(day);
        clock.set(at);
        exceeded(store.as_ref(), &format!("msg_{day}"), &format!("w{day}"), at).await;
        for _ in 0..3 {
            notifier.step().await.expect("step");
            clock.advance(Duration::hours(6));
        }
        if !store.endpoint(&e.id).await.unwrap().unwrap().enabled {
            assert_eq!(day, 5, "disabled on the fifth day of failures, not before");
            let audit = store.unpublished_audit(10).await.expect("audit outbox");
            assert_eq!(audit.len(), 1);
            assert!(audit[0].action == AuditAction::WebhookEndpointDisabled);
            return;
        }
    }
    panic!("never disabled");
}

/// A rotated-out secret signs beside the new one for 24 h, then not.
#[tokio::test]
async fn the_previous_secret_signs_beside_the_new_one_for_a_day() {
    let db = sqlite().await;
    let store = db.store();
    let receiver = Receiver::start(vec![]).await;
    let old = new_secret();
    let mut e = subscribe(store.as_ref(), "wh_a", receiver.url("/hook"), &old).await;
    let new = new_secret();
    e.secret = new.clone();
    e.previous_secret = Some((old.clone(), utc(T0) + Duration::hours(24)));
    store.update_endpoint(&e, &[]).await.expect("rotate");
    let clock = ManualClock::new(utc(T0));
    let notifier = notifier(store.clone(), &clock, "n1");
    exceeded(store.as_ref(), "msg_1", "w1", utc(T0)).await;
    notifier.step().await.expect("step");
    receiver.verify_all(&[&new, &old]);
    assert_eq!(receiver.received()[0].signatures.len(), 2);
    clock.set(utc(T0) + Duration::hours(24));
    exceeded(store.as_ref(), "msg_2", "w2", clock.now()).await;
    notifier.step().await.expect("step");
    let last = receiver.received().pop().unwrap();
    assert_eq!(last.signatures, vec![expected_signature(&new, &last.id, &last.timestamp, &last.body)]);
}

/// Two notifiers stepping at once over many messages: each message reaches
/// the receiver exactly once.
#[tokio::test]
async fn two_notifiers_never_deliver_one_message_twice() {
    for db in backends().await {
        let store = db.store();
        let receiver = Receiver::start(vec![]).await;
        receiver.delay_next(vec![std::time::Duration::from_millis(20); 120]);
        let secret = new_secret();
        subscribe(store.as_ref(), "wh_a", receiver.url("/hook"), &secret).await;
        let clock = ManualClock::new(utc(T0));
        for i in 0..120 {
            exceeded(store.as_ref(), &format!("msg_{i:03}"), &format!("w{i}"), utc(T0)).await;
        }
        let run = |name: &'static str| {
            let n = notifier(store.clone(), &clock, name);
            tokio::spawn(async move {
                let mut idle = 0;
                while idle < 3 {
                    if n.step().await.expect("step").attempted == 0 {
                        idle += 1;
                    }
                }
            })
        };
        let (a, b) = (run("n1"), run("n2"));
        a.await.unwrap();
        b.await.unwrap();
        let mut ids: Vec<String> = receiver.received().into_iter().map(|r| r.id).collect();
        let total = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!((total, ids.len()), (120, 120), "every message once");
        receiver.verify_all(&[&secret]);
    }
}

/// A notifier that dies mid-delivery (its task dropped while the receiver
/// holds the request) loses nothing: its claim lapses, another notifier
/// delivers the message under the same webhook-id.
#[tokio::test]
async fn a_notifier_dying_mid_delivery_loses_nothing() {
    for db in backends().await {
        let store = db.store();
        let receiver = Receiver::start(vec![]).await;
        receiver.delay_next(vec![std::time::Duration::from_secs(30)]);
        let e = subscribe(store.as_ref(), "wh_a", receiver.url("/hook"), &new_secret()).await;
        let clock = ManualClock::new(utc(T0));
        exceeded(store.as_ref(), "msg_1", "w1", utc(T0)).await;
        let dying = notifier(store.clone(), &clock, "n1");
        let task = tokio::spawn(async move { dying.step().await });
        while receiver.received().is_empty() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        task.abort();
        let _ = task.await;
        let other = notifier(store.clone(), &clock, "n2");
        assert_eq!(other.step().await.expect("step").attempted, 0, "n1's claim holds until its lease ends");
        clock.advance(Duration::seconds(6));
        assert_eq!(other.step().await.expect("step").delivered, 1);
        let got = receiver.received();
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|r| r.id == "msg_1"), "one webhook-id");
        let log = store.deliveries(&e.id, None, 10).await.expect("log");
        assert_eq!((log[0].status, log[0].attempts.len()), (DeliveryStatus::Succeeded, 1));
    }
}
