//! The `WebhookStore` conformance suite: endpoints and the notification
//! outbox, the same behaviour on PostgreSQL (a database of its own per
//! test, skipped when PostgreSQL does not answer unless
//! `TOLLGATE_REQUIRE_SERVICES` is set) and on the embedded SQLite store (a
//! fresh file per test).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use chrono::{DateTime, Duration, Utc};
use meter::webhook::{QUOTA_EXCEEDED, QUOTA_NEARLY_USED, dedup_key};
use meter::{
    ApiKeyId, Attempt, AuditAction, AuditDetail, AuditEntry, AuditId, DeliveryStatus, DueDelivery, Endpoint,
    EndpointChange, EventId, EventKind, EventTypes, FoldBatch, LoggedBreach, MessageId, Metric, Mode, Next,
    Notification, OffsetMove, PortError, Project, ProjectId, Quota, QuotaId, QuotaPlan, QuotaSpec, Scope, Store,
    UsageFact, WebhookId, WindowKind,
};
use serde_json::json;
use store::{PgStore, SqliteStore};

macro_rules! conformance {
    ($fixture:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $test() {
                let Some(db) = $fixture.await else { return };
                super::$test(db.store.clone()).await;
            }
        )*
    };
}

macro_rules! suite {
    ($fixture:expr) => {
        conformance!($fixture;
            endpoints_round_trip_and_change,
            an_endpoint_change_writes_its_audit_entry_only_if_it_happened,
            a_notification_is_enqueued_once_to_the_endpoints_that_want_it,
            a_claimed_delivery_is_not_claimed_again_until_its_claim_lapses,
            an_attempt_is_recorded_only_by_the_claimant_and_schedules_the_next,
            disabling_an_endpoint_writes_one_audit_entry_and_stops_its_deliveries,
            the_delivery_log_pages_by_message_and_resend_and_recover_requeue,
            concurrent_claims_never_share_a_delivery,
            a_fold_enqueues_its_quota_alerts_once_however_often_its_facts_come,
            a_projects_quota_notifications_page_by_message_whoever_took_them,
        );
    };
}

mod pg {
    use super::*;
    suite!(PgDb::new());
}

mod sqlite {
    use super::*;
    suite!(SqliteDb::new());
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

const T0: &str = "2026-07-07T12:00:00Z";

fn endpoint(id: &str, project: &str, types: &[&str]) -> Endpoint {
    Endpoint {
        id: WebhookId::parse(id).expect("id"),
        project_id: ProjectId::parse(project).expect("id"),
        url: format!("http://127.0.0.1:9/{id}"),
        event_types: EventTypes::parse(types.iter().map(|t| t.to_string()).collect(), "event_types").expect("types"),
        description: Some("d".into()),
        enabled: true,
        disabled_reason: None,
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
        previous_secret: None,
        failing_since: None,
        created_at: utc(T0),
        updated_at: utc(T0),
    }
}

fn notification(id: &str, project: &str, kind: &str, window: &str, at: DateTime<Utc>) -> Notification {
    Notification::new(
        MessageId::parse(id).expect("id"),
        ProjectId::parse(project).expect("id"),
        kind,
        json!({"quota_id": "quota_1", "window_key": window}),
        Some(dedup_key("quota_1", window, kind, (kind == QUOTA_NEARLY_USED).then_some(80))),
        at,
    )
}

async fn setup(s: &dyn Store, projects: &[&str]) {
    for p in projects {
        s.create_project(&Project {
            id: ProjectId::parse(*p).expect("id"),
            name: p.to_string(),
            timezone: chrono_tz::Tz::UTC,
            created_at: utc(T0),
        })
        .await
        .expect("project");
    }
}

fn attempt(d: &DueDelivery, status: Option<u16>, at: DateTime<Utc>) -> Attempt {
    Attempt { number: d.attempts + 1, at, status_code: status, latency_ms: 7, response: "ok".into() }
}

/// An admin's change to an endpoint, audited.
fn change(id: &str, action: AuditAction, before: Option<&Endpoint>, after: Option<&Endpoint>) -> AuditEntry {
    meter::admin_change(
        AuditId::parse(id).expect("id"),
        &ProjectId::parse("proj_1").expect("id"),
        action,
        "wh_a",
        AuditDetail::WebhookChange { before: before.map(Into::into), after: after.map(Into::into) },
        &meter::Principal::new("admin", "test"),
        utc(T0),
    )
}

/// Subscribing, changing and deleting an endpoint write their entries to the
/// audit outbox in the same transaction; a change that finds no endpoint,
/// or a create that is refused, writes none.
async fn an_endpoint_change_writes_its_audit_entry_only_if_it_happened(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    let a = endpoint("wh_a", "proj_1", &["*"]);
    let created = change("aud_1", AuditAction::CreateWebhook, None, Some(&a));
    s.create_endpoint(&a, std::slice::from_ref(&created)).await.expect("create");
    assert!(s.create_endpoint(&a, &[change("aud_2", AuditAction::CreateWebhook, None, Some(&a))]).await.is_err());
    let mut off = a.clone();
    off.enabled = false;
    let updated = change("aud_3", AuditAction::UpdateWebhook, Some(&a), Some(&off));
    assert!(s.update_endpoint(&off, std::slice::from_ref(&updated)).await.expect("update"));
    let deleted = change("aud_4", AuditAction::DeleteWebhook, Some(&off), None);
    assert!(s.delete_endpoint(&a.id, std::slice::from_ref(&deleted)).await.expect("delete"));
    assert!(
        !s.delete_endpoint(&a.id, &[change("aud_5", AuditAction::DeleteWebhook, Some(&off), None)])
            .await
            .expect("again")
    );
    assert!(
        !s.update_endpoint(&off, &[change("aud_6", AuditAction::UpdateWebhook, Some(&a), Some(&off))])
            .await
            .expect("gone")
    );
    let outbox = s.unpublished_audit(10).await.expect("outbox");
    assert_eq!(outbox, vec![created, updated, deleted]);
    // No secret is in an entry.
    let json = serde_json::to_string(&outbox[0].detail).expect("json");
    assert!(!json.contains("whsec_"), "{json}");
}

async fn endpoints_round_trip_and_change(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1", "proj_2"]).await;
    let a = endpoint("wh_a", "proj_1", &["quota.*"]);
    let b = endpoint("wh_b", "proj_1", &["*"]);
    let c = endpoint("wh_c", "proj_2", &["quota.exceeded"]);
    for e in [&b, &a, &c] {
        s.create_endpoint(e, &[]).await.expect("create");
    }
    assert_eq!(s.endpoint(&a.id).await.expect("read"), Some(a.clone()));
    assert_eq!(s.endpoints(&a.project_id).await.expect("list"), vec![a.clone(), b.clone()], "in id order");
    let mut changed = a.clone();
    changed.url = "https://hooks.example.com/x".into();
    changed.event_types = EventTypes::parse(vec!["quota.exceeded".into()], "event_types").expect("types");
    changed.description = None;
    changed.enabled = false;
    changed.previous_secret = Some(("whsec_old".into(), utc(T0) + Duration::hours(24)));
    changed.updated_at = utc(T0) + Duration::minutes(1);
    assert!(s.update_endpoint(&changed, &[]).await.expect("update"));
    assert_eq!(s.endpoint(&a.id).await.expect("read"), Some(changed.clone()));
    assert!(s.delete_endpoint(&a.id, &[]).await.expect("delete"));
    assert!(!s.delete_endpoint(&a.id, &[]).await.expect("delete again"));
    assert_eq!(s.endpoint(&a.id).await.expect("read"), None);
    assert!(!s.update_endpoint(&changed, &[]).await.expect("update a deleted one"));
    assert!(s.create_endpoint(&b, &[]).await.is_err(), "an id is unique");
}

async fn a_notification_is_enqueued_once_to_the_endpoints_that_want_it(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1", "proj_2"]).await;
    let all = endpoint("wh_all", "proj_1", &["*"]);
    let exceeded = endpoint("wh_exc", "proj_1", &["quota.exceeded"]);
    let nearly = endpoint("wh_near", "proj_1", &["quota.nearly_used"]);
    let mut off = endpoint("wh_off", "proj_1", &["*"]);
    off.enabled = false;
    let other = endpoint("wh_other", "proj_2", &["*"]);
    for e in [&all, &exceeded, &nearly, &off, &other] {
        s.create_endpoint(e, &[]).await.expect("create");
    }
    let at = utc(T0);
    let n = notification("msg_1", "proj_1", QUOTA_EXCEEDED, "2026-07-07", at);
    assert!(s.enqueue(&n, None).await.expect("enqueue"));
    // The same dedup key under another id (a second gateway, a replay): nothing.
    let again = notification("msg_2", "proj_1", QUOTA_EXCEEDED, "2026-07-07", at + Duration::seconds(1));
    assert!(!s.enqueue(&again, None).await.expect("enqueue again"));
    assert!(!s.enqueue(&n, None).await.expect("the same message again"));
    let due = s.claim_deliveries("n1", at, at + Duration::seconds(60), 100).await.expect("claim");
    let to: Vec<&str> = due.iter().map(|d| d.endpoint.id.as_str()).collect();
    assert_eq!(to.len(), 2, "{to:?}");
    assert!(to.contains(&"wh_all") && to.contains(&"wh_exc"));
    for d in &due {
        assert_eq!(d.message, n, "the message as enqueued, body and all");
        assert_eq!((d.tries, d.attempts), (0, 0));
    }
    // Another window is another notification; one not yet due is not claimed.
    let later = notification("msg_3", "proj_1", QUOTA_NEARLY_USED, "2026-07-08", at + Duration::hours(1));
    assert!(s.enqueue(&later, None).await.expect("enqueue"));
    assert!(s.claim_deliveries("n1", at, at + Duration::seconds(60), 100).await.expect("claim").is_empty());
    // A test message goes to the one endpoint named, whatever its types.
    let test = Notification::test(MessageId::parse("msg_t").expect("id"), &nearly, at);
    assert!(s.enqueue(&test, Some(&nearly.id)).await.expect("enqueue a test"));
    let due = s.claim_deliveries("n1", at, at + Duration::seconds(60), 100).await.expect("claim");
    assert_eq!(due.len(), 1);
    assert_eq!((due[0].endpoint.id.as_str(), due[0].message.test), ("wh_near", true));
}

async fn a_claimed_delivery_is_not_claimed_again_until_its_claim_lapses(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    s.create_endpoint(&endpoint("wh_a", "proj_1", &["*"]), &[]).await.expect("create");
    let at = utc(T0);
    s.enqueue(&notification("msg_1", "proj_1", QUOTA_EXCEEDED, "w1", at), None).await.expect("enqueue");
    let lease = Duration::seconds(60);
    assert_eq!(s.claim_deliveries("n1", at, at + lease, 10).await.expect("claim").len(), 1);
    assert!(s.claim_deliveries("n2", at, at + lease, 10).await.expect("claim").is_empty(), "held by n1");
    assert!(
        s.claim_deliveries("n1", at + Duration::seconds(30), at + lease, 10).await.expect("claim").is_empty(),
        "not even by n1 while it holds it"
    );
    // n1 died: its claim lapses and n2 takes the delivery.
    let later = at + lease + Duration::seconds(1);
    let due = s.claim_deliveries("n2", later, later + lease, 10).await.expect("claim");
    assert_eq!(due.len(), 1);
    // n1's late record is refused; n2's is kept.
    let n1 = s
        .record_attempt(
            "n1",
            &due[0],
            &attempt(&due[0], Some(200), later),
            &Next::Succeeded,
            &EndpointChange::Healthy,
            None,
        )
        .await
        .expect("record");
    assert_eq!(n1, None, "n1 lost its claim");
    let n2 = s
        .record_attempt(
            "n2",
            &due[0],
            &attempt(&due[0], Some(200), later),
            &Next::Succeeded,
            &EndpointChange::Healthy,
            None,
        )
        .await
        .expect("record");
    assert_eq!(n2, Some(false));
    let log = s.deliveries(&due[0].endpoint.id, None, 10).await.expect("log");
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].status, DeliveryStatus::Succeeded);
    assert_eq!(log[0].attempts.len(), 1, "the refused record wrote nothing");
}

async fn an_attempt_is_recorded_only_by_the_claimant_and_schedules_the_next(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    let e = endpoint("wh_a", "proj_1", &["*"]);
    s.create_endpoint(&e, &[]).await.expect("create");
    let at = utc(T0);
    s.enqueue(&notification("msg_1", "proj_1", QUOTA_EXCEEDED, "w1", at), None).await.expect("enqueue");
    let lease = Duration::seconds(60);
    let due = s.claim_deliveries("n1", at, at + lease, 10).await.expect("claim");
    let retry = at + Duration::seconds(5);
    let recorded = s
        .record_attempt(
            "n1",
            &due[0],
            &attempt(&due[0], Some(500), at),
            &Next::RetryAt(retry),
            &EndpointChange::Failing(at),
            None,
        )
        .await
        .expect("record");
    assert_eq!(recorded, Some(false));
    assert_eq!(s.endpoint(&e.id).await.expect("read").expect("there").failing_since, Some(at));
    assert!(
        s.claim_deliveries("n1", at + Duration::seconds(4), at + lease, 10).await.expect("claim").is_empty(),
        "not due yet"
    );
    let due = s.claim_deliveries("n2", retry, retry + lease, 10).await.expect("claim");
    assert_eq!((due.len(), due[0].tries, due[0].attempts), (1, 1, 1), "claim released, counts kept");
    assert_eq!(due[0].endpoint.failing_since, Some(at));
    // A second failure keeps the first failure's time; a success clears it.
    s.record_attempt(
        "n2",
        &due[0],
        &attempt(&due[0], None, retry),
        &Next::RetryAt(retry + Duration::minutes(5)),
        &EndpointChange::Failing(retry),
        None,
    )
    .await
    .expect("record");
    assert_eq!(s.endpoint(&e.id).await.expect("read").expect("there").failing_since, Some(at));
    let third = retry + Duration::minutes(5);
    let due = s.claim_deliveries("n2", third, third + lease, 10).await.expect("claim");
    s.record_attempt(
        "n2",
        &due[0],
        &attempt(&due[0], Some(204), third),
        &Next::Succeeded,
        &EndpointChange::Healthy,
        None,
    )
    .await
    .expect("record");
    assert_eq!(s.endpoint(&e.id).await.expect("read").expect("there").failing_since, None);
    let log = s.deliveries(&e.id, None, 10).await.expect("log");
    let numbers: Vec<(u32, Option<u16>)> = log[0].attempts.iter().map(|a| (a.number, a.status_code)).collect();
    assert_eq!(numbers, vec![(1, Some(500)), (2, None), (3, Some(204))]);
    assert_eq!(log[0].attempts[0], attempt(&DueDelivery { tries: 0, attempts: 0, ..due[0].clone() }, Some(500), at));
    assert_eq!((log[0].status, log[0].next_attempt_at), (DeliveryStatus::Succeeded, None));
}

async fn disabling_an_endpoint_writes_one_audit_entry_and_stops_its_deliveries(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    let e = endpoint("wh_a", "proj_1", &["*"]);
    s.create_endpoint(&e, &[]).await.expect("create");
    let at = utc(T0);
    for (i, w) in ["w1", "w2", "w3"].iter().enumerate() {
        s.enqueue(&notification(&format!("msg_{i}"), "proj_1", QUOTA_EXCEEDED, w, at), None).await.expect("enqueue");
    }
    let due = s.claim_deliveries("n1", at, at + Duration::seconds(60), 2).await.expect("claim");
    assert_eq!(due.len(), 2);
    let audit = |id: &str| AuditEntry {
        id: AuditId::parse(id).expect("id"),
        project_id: Some(e.project_id.clone()),
        action: AuditAction::WebhookEndpointDisabled,
        principal: None,
        resource: e.id.to_string(),
        detail: AuditDetail::WebhookEndpointDisabled { url: e.url.clone(), reason: "410".into() },
        created_at: at,
    };
    let gone = EndpointChange::Disable("the endpoint answered 410 Gone".into());
    let first = s
        .record_attempt("n1", &due[0], &attempt(&due[0], Some(410), at), &Next::Failed, &gone, Some(&audit("aud_1")))
        .await
        .expect("record");
    assert_eq!(first, Some(true));
    let second = s
        .record_attempt("n1", &due[1], &attempt(&due[1], Some(410), at), &Next::Failed, &gone, Some(&audit("aud_2")))
        .await
        .expect("record");
    assert_eq!(second, Some(false), "already disabled");
    // In the audit outbox, in the attempt's transaction (the relay takes it to the topic).
    let entries = s.unpublished_audit(10).await.expect("audit outbox");
    assert_eq!(entries, vec![audit("aud_1")]);
    let stored = s.endpoint(&e.id).await.expect("read").expect("there");
    assert!(!stored.enabled);
    assert_eq!(stored.disabled_reason.as_deref(), Some("the endpoint answered 410 Gone"));
    // The third delivery waits, unclaimed, until the endpoint is enabled again.
    let later = at + Duration::hours(1);
    assert!(s.claim_deliveries("n1", later, later + Duration::seconds(60), 10).await.expect("claim").is_empty());
    let enabled = Endpoint { enabled: true, disabled_reason: None, ..stored };
    s.update_endpoint(&enabled, &[]).await.expect("enable");
    assert_eq!(s.claim_deliveries("n1", later, later + Duration::seconds(60), 10).await.expect("claim").len(), 1);
}

async fn the_delivery_log_pages_by_message_and_resend_and_recover_requeue(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    let e = endpoint("wh_a", "proj_1", &["*"]);
    s.create_endpoint(&e, &[]).await.expect("create");
    let at = utc(T0);
    for i in 0..5 {
        let n =
            notification(&format!("msg_{i}"), "proj_1", QUOTA_EXCEEDED, &format!("w{i}"), at + Duration::minutes(i));
        s.enqueue(&n, None).await.expect("enqueue");
    }
    let now = at + Duration::hours(1);
    let due = s.claim_deliveries("n1", now, now + Duration::seconds(60), 10).await.expect("claim");
    assert_eq!(due.len(), 5);
    for (i, d) in due.iter().enumerate() {
        let (status, next) = if i < 3 { (Some(500), Next::Failed) } else { (Some(200), Next::Succeeded) };
        s.record_attempt("n1", d, &attempt(d, status, now), &next, &EndpointChange::Healthy, None)
            .await
            .expect("record");
    }
    let first = s.deliveries(&e.id, None, 2).await.expect("page");
    let ids: Vec<&str> = first.iter().map(|l| l.message.id.as_str()).collect();
    assert_eq!(ids, vec!["msg_0", "msg_1"]);
    let rest = s.deliveries(&e.id, Some(&first[1].message.id), 10).await.expect("page");
    let ids: Vec<&str> = rest.iter().map(|l| l.message.id.as_str()).collect();
    assert_eq!(ids, vec!["msg_2", "msg_3", "msg_4"]);
    assert_eq!(rest[0].status, DeliveryStatus::Failed);
    // Recover what failed among the messages of [at+1min, at+3min): msg_1, msg_2.
    let n = s.recover(&e.id, at + Duration::minutes(1), at + Duration::minutes(3), now).await.expect("recover");
    assert_eq!(n, 2);
    // Resend a delivered one.
    assert!(s.resend(&e.id, &MessageId::parse("msg_4").expect("id"), now).await.expect("resend"));
    assert!(!s.resend(&e.id, &MessageId::parse("msg_nope").expect("id"), now).await.expect("resend"));
    let due = s.claim_deliveries("n1", now, now + Duration::seconds(60), 10).await.expect("claim");
    let mut ids: Vec<&str> = due.iter().map(|d| d.message.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, vec!["msg_1", "msg_2", "msg_4"]);
    assert!(due.iter().all(|d| d.tries == 0 && d.attempts == 1), "a fresh schedule, the log kept");
}

async fn concurrent_claims_never_share_a_delivery(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    s.create_endpoint(&endpoint("wh_a", "proj_1", &["*"]), &[]).await.expect("create");
    let at = utc(T0);
    for i in 0..200 {
        let n = notification(&format!("msg_{i:03}"), "proj_1", QUOTA_EXCEEDED, &format!("w{i}"), at);
        s.enqueue(&n, None).await.expect("enqueue");
    }
    let claims = (0..8).map(|k| {
        let s = s.clone();
        tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = s.claim_deliveries(&format!("n{k}"), at, at + Duration::seconds(60), 7).await.expect("claim");
                if got.is_empty() {
                    return mine;
                }
                mine.extend(got.into_iter().map(|d| d.message.id.to_string()));
            }
        })
    });
    let mut all: Vec<String> = Vec::new();
    for c in claims {
        all.extend(c.await.expect("task"));
    }
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!((total, all.len()), (200, 200), "every delivery claimed exactly once");
}

fn day_quota(id: &str, metric: Metric, mode: Mode, limit: u64) -> Quota {
    Quota {
        id: QuotaId::parse(id).expect("id"),
        spec: QuotaSpec {
            project_id: ProjectId::parse("proj_1").expect("id"),
            scope: Scope::Project,
            scope_ref: None,
            metric,
            window: WindowKind::Day,
            limit,
            mode,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: utc(T0),
        updated_at: utc(T0),
    }
}

fn fact(id: &str, kind: EventKind, at: DateTime<Utc>) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse("key_1").expect("id")),
        received_at: Some(at + Duration::milliseconds(250)),
        ..UsageFact::new(EventId::parse(id).expect("id"), ProjectId::parse("proj_1").expect("id"), kind, at)
    }
}

fn fold_batch(from: i64, facts: Vec<UsageFact>) -> FoldBatch {
    let to = from + i64::try_from(facts.len()).expect("small");
    FoldBatch {
        consumer: "projector".into(),
        topic: "tollgate.usage".into(),
        offsets: vec![OffsetMove { partition: 0, from, to }],
        facts,
        dead_letters: Vec::new(),
        sources: BTreeMap::new(),
        horizon: None,
    }
}

/// The quota notifications claimed for delivery now: (dedup key, body).
async fn claimed(s: &dyn Store, at: DateTime<Utc>) -> Vec<(String, serde_json::Value)> {
    let due = s.claim_deliveries("n1", at, at + Duration::seconds(60), 100).await.expect("claim");
    let mut out: Vec<_> = due
        .into_iter()
        .map(|d| (d.message.dedup_key.expect("a dedup key"), serde_json::from_str(&d.message.body).expect("json")))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The fold writes the quota alerts of a batch in its own transaction:
/// nearly-used at 80 and 100, exceeded once (for a monitor quota with its
/// audit entry); a batch redelivered at its offsets is fenced, its facts
/// sent again at new offsets are duplicates, and a refused check's breach
/// seen again is a dedup hit: nothing is enqueued twice.
async fn a_fold_enqueues_its_quota_alerts_once_however_often_its_facts_come(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1"]).await;
    s.create_endpoint(&endpoint("wh_q", "proj_1", &["quota.*"]), &[]).await.expect("endpoint");
    let enforce = day_quota("q_calls", Metric::Calls, Mode::Enforce, 5);
    let monitor = day_quota("q_req", Metric::Requests, Mode::Monitor, 2);
    for q in [&enforce, &monitor] {
        s.apply_quotas(&QuotaPlan::create(q.clone()), &[]).await.expect("quota");
    }
    let at = utc(T0);
    let calls: Vec<UsageFact> =
        (0..5).map(|i| fact(&format!("c{i}"), EventKind::Call, at + Duration::seconds(i))).collect();
    s.fold_batch(&fold_batch(0, calls[..3].to_vec())).await.expect("fold");
    assert!(claimed(s.as_ref(), at + Duration::hours(1)).await.is_empty(), "3 of 5 is under 80 %");
    s.fold_batch(&fold_batch(3, calls[3..].to_vec())).await.expect("fold");
    let got = claimed(s.as_ref(), at + Duration::hours(1)).await;
    let keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "q_calls/2026-07-07/quota.exceeded/-",
            "q_calls/2026-07-07/quota.nearly_used/100",
            "q_calls/2026-07-07/quota.nearly_used/80"
        ]
    );
    let warn = &got[2].1;
    assert_eq!(
        (warn["data"]["observed_value"].as_u64(), warn["data"]["severity"].as_str()),
        (Some(4), Some("warning"))
    );
    assert_eq!(warn["timestamp"], "2026-07-07T12:00:03.250Z", "the receipt of the 4th call");
    assert_eq!(got[0].1["data"]["mode"], "enforce");

    // Redelivered at its offsets: fenced. Sent again at new ones: duplicates.
    assert!(matches!(s.fold_batch(&fold_batch(3, calls[3..].to_vec())).await, Err(PortError::Fenced(_))));
    s.fold_batch(&fold_batch(5, calls.clone())).await.expect("the same facts again");
    // A refused check over the enforce quota, seen after it was exceeded.
    let mut refused = fact("r1", EventKind::Request, at + Duration::seconds(9));
    refused.admitted = Some(false);
    refused.breaches = vec![LoggedBreach {
        quota_id: enforce.id.clone(),
        window_key: "2026-07-07".into(),
        limit: 5,
        observed: 6,
        enforce: true,
    }];
    s.fold_batch(&fold_batch(10, vec![refused])).await.expect("fold a refused check");
    // Requests: the refused one above, then three more: over 2 at the third.
    let requests: Vec<UsageFact> =
        (0..3).map(|i| fact(&format!("q{i}"), EventKind::Request, at + Duration::seconds(20 + i))).collect();
    s.fold_batch(&fold_batch(11, requests.clone())).await.expect("fold requests");
    s.fold_batch(&fold_batch(14, requests)).await.expect("the same requests again");
    let got = claimed(s.as_ref(), at + Duration::hours(1)).await;
    let keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "q_req/2026-07-07/quota.exceeded/-",
            "q_req/2026-07-07/quota.nearly_used/100",
            "q_req/2026-07-07/quota.nearly_used/80"
        ],
        "only the monitor quota's, once each"
    );
    assert_eq!(
        (got[0].1["data"]["mode"].as_str(), got[0].1["data"]["observed_value"].as_u64()),
        (Some("monitor"), Some(3))
    );
    // The breach's entry, in the audit outbox with the fold (the relay takes it to the topic).
    let audit = s.unpublished_audit(100).await.expect("audit outbox");
    let breaches: Vec<&AuditEntry> = audit.iter().filter(|e| e.action == AuditAction::MonitorBreach).collect();
    assert_eq!(breaches.len(), 1, "{audit:?}");
    assert_eq!(breaches[0].resource, "q_req");
    assert!(matches!(breaches[0].detail, AuditDetail::QuotaMonitorBreach { observed_value: 3, limit: 2, .. }));
}

/// A directory of its own under the system's temporary one, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("tollgate-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct SqliteDb {
    store: Arc<dyn Store>,
    _dir: TempDir,
}

impl SqliteDb {
    async fn new() -> Option<SqliteDb> {
        let dir = TempDir::new();
        let store = SqliteStore::open(&dir.0.join("tollgate.db")).await.expect("open the test file");
        store.migrate().await.expect("migrate");
        Some(SqliteDb { store: Arc::new(store), _dir: dir })
    }
}

struct PgDb {
    store: Arc<dyn Store>,
    _db: testkit::TestDb,
}

impl PgDb {
    async fn new() -> Option<PgDb> {
        if !testkit::available(&[testkit::Service::Postgres]) {
            return None;
        }
        let db = testkit::TestDb::new("tg").await;
        let store = PgStore::connect(&db.url).await.expect("connect to the test database");
        store.migrate().await.expect("migrate");
        Some(PgDb { store: Arc::new(store), _db: db })
    }
}

/// A project's quota notifications (and only those: not a test or an
/// export message, not another project's) are listed by message id after
/// the cursor, whether or not an endpoint wanted them.
async fn a_projects_quota_notifications_page_by_message_whoever_took_them(s: Arc<dyn Store>) {
    setup(s.as_ref(), &["proj_1", "proj_2"]).await;
    let at = utc(T0);
    for (id, project, kind, window) in [
        ("msg_3", "proj_1", QUOTA_EXCEEDED, "2026-07-07"),
        ("msg_1", "proj_1", QUOTA_NEARLY_USED, "2026-07-07"),
        ("msg_2", "proj_2", QUOTA_EXCEEDED, "2026-07-06"),
        ("msg_4", "proj_1", meter::webhook::EXPORT_COMPLETED, "2026-07-08"),
        ("msg_5", "proj_1", QUOTA_EXCEEDED, "2026-07-08"),
    ] {
        assert!(s.enqueue(&notification(id, project, kind, window, at), None).await.expect("enqueue"));
    }
    let p1 = ProjectId::parse("proj_1").expect("id");
    let ids = |list: Vec<Notification>| list.into_iter().map(|n| n.id.to_string()).collect::<Vec<_>>();
    assert_eq!(ids(s.quota_notifications(&p1, None, 10).await.expect("list")), ["msg_1", "msg_3", "msg_5"]);
    assert_eq!(ids(s.quota_notifications(&p1, None, 2).await.expect("list")), ["msg_1", "msg_3"]);
    let after = MessageId::parse("msg_3").expect("id");
    assert_eq!(ids(s.quota_notifications(&p1, Some(&after), 2).await.expect("list")), ["msg_5"]);
    let listed = s.quota_notifications(&p1, None, 1).await.expect("list").remove(0);
    assert_eq!((listed.event_type.as_str(), listed.project_id), (QUOTA_NEARLY_USED, p1));
}
