use std::collections::BTreeMap;

use chrono::Duration;
use proptest::prelude::*;

use super::*;
use crate::ids::{ApiKeyId, EventId, QuotaId};
use crate::quota::{Metric, QuotaSpec};
use crate::usage::{LoggedBreach, counters_for};
use crate::window::WindowKind;

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).expect("test timestamp").with_timezone(&Utc)
}

fn project() -> ProjectId {
    ProjectId::parse("proj_1").expect("id")
}

fn quota(id: &str, scope: Scope, scope_ref: Option<&str>, metric: Metric, mode: Mode, limit: u64) -> Quota {
    let t0 = utc("2026-01-01T00:00:00Z");
    Quota {
        id: QuotaId::parse(id).expect("quota id"),
        spec: QuotaSpec {
            project_id: project(),
            scope,
            scope_ref: scope_ref.map(str::to_owned),
            metric,
            window: if metric == Metric::StorageBytes { WindowKind::Current } else { WindowKind::Day },
            limit,
            mode,
            meter_type: None,
            on_unpriced: None,
        },
        created_at: t0,
        updated_at: t0,
    }
}

fn calls(q: &str, mode: Mode, limit: u64) -> Quota {
    quota(q, Scope::Project, None, Metric::Calls, mode, limit)
}

/// A successful call at `at`, received a second later.
fn call(n: usize, actor: Option<&str>, at: DateTime<Utc>) -> UsageFact {
    UsageFact {
        api_key_id: Some(ApiKeyId::parse("key_1").expect("id")),
        actor_id: actor.map(str::to_owned),
        received_at: Some(at + Duration::seconds(1)),
        ..UsageFact::new(EventId::parse(format!("call-{n}")).expect("id"), project(), EventKind::Call, at)
    }
}

/// A store's outbox and counters, as the fold keeps them across batches.
#[derive(Default)]
struct Model {
    counters: HashMap<(ProjectId, CounterKey), Totals>,
    outbox: BTreeMap<String, Notification>,
    audit: BTreeMap<String, AuditEntry>,
}

impl Model {
    fn fold(&mut self, quotas: &[Quota], batch: &[UsageFact]) {
        let zones: HashMap<ProjectId, Tz> = [(project(), Tz::UTC)].into_iter().collect();
        let book = PriceBook::default();
        let facts: Vec<&UsageFact> = batch.iter().collect();
        let before = self.counters.clone();
        let alerts = quota_notifications(&BatchAlerts {
            quotas,
            zones: &zones,
            book: &book,
            facts: &facts,
            before: &before,
            footprints: &HashMap::new(),
        });
        for f in batch {
            for (c, d) in counters_for(f, Tz::UTC, &book) {
                self.counters.entry((f.project_id.clone(), c.key)).or_default().add(d);
            }
        }
        for n in alerts.notifications {
            let key = n.dedup_key.clone().expect("a quota notification has a dedup key");
            self.outbox.entry(key).or_insert(n);
        }
        for e in alerts.audit {
            self.audit.entry(e.once_key().expect("once")).or_insert(e);
        }
    }
}

fn one_batch(quotas: &[Quota], facts: &[UsageFact]) -> Alerts {
    let zones: HashMap<ProjectId, Tz> = [(project(), Tz::UTC)].into_iter().collect();
    let refs: Vec<&UsageFact> = facts.iter().collect();
    quota_notifications(&BatchAlerts {
        quotas,
        zones: &zones,
        book: &PriceBook::default(),
        facts: &refs,
        before: &HashMap::new(),
        footprints: &HashMap::new(),
    })
}

fn body(n: &Notification) -> Value {
    serde_json::from_str(&n.body).expect("json body")
}

#[test]
fn an_enforce_quota_warns_at_80_then_is_critical_and_exceeded_at_its_limit_once() {
    let t0 = utc("2026-07-07T10:00:00Z");
    let facts: Vec<UsageFact> = (0..14).map(|i| call(i, None, t0 + Duration::seconds(i as i64))).collect();
    let got = one_batch(&[calls("q1", Mode::Enforce, 10)], &facts);
    let keys: Vec<_> = got.notifications.iter().map(|n| n.dedup_key.clone().expect("key")).collect();
    assert_eq!(
        keys,
        ["q1/2026-07-07/quota.nearly_used/80", "q1/2026-07-07/quota.nearly_used/100", "q1/2026-07-07/quota.exceeded/-"]
    );
    let warn = body(&got.notifications[0]);
    assert_eq!(warn["type"], "quota.nearly_used");
    assert_eq!(warn["data"]["threshold"], 80);
    assert_eq!(warn["data"]["severity"], "warning");
    assert_eq!(warn["data"]["observed_value"], 8);
    // The 8th call (index 7) crossed it: its receipt is the timestamp.
    assert_eq!(warn["timestamp"], "2026-07-07T10:00:08.000Z");
    let exceeded = body(&got.notifications[2]);
    assert_eq!(
        exceeded["data"],
        json!({
            "quota_id": "q1", "project_id": "proj_1", "scope": "project", "scope_ref": null, "metric": "calls",
            "meter_type": null, "window": "day", "window_key": "2026-07-07", "limit": 10, "observed_value": 10,
            "mode": "enforce",
        })
    );
    assert_eq!(body(&got.notifications[1])["data"]["severity"], "critical");
    assert!(got.audit.is_empty(), "an enforce breach is audited by its 429, not here");
    for n in &got.notifications {
        assert_eq!(n.id, message_id(n.dedup_key.as_deref().expect("key"), n.created_at));
        assert!(n.id.as_str().starts_with("msg_") && n.id.as_str().len() == 36);
    }
}

#[test]
fn a_new_window_re_arms_every_threshold() {
    let day1 = utc("2026-07-07T23:59:00Z");
    let day2 = utc("2026-07-08T00:01:00Z");
    let facts: Vec<UsageFact> =
        (0..5).map(|i| call(i, None, day1)).chain((5..10).map(|i| call(i, None, day2))).collect();
    let got = one_batch(&[calls("q1", Mode::Enforce, 5)], &facts);
    let keys: Vec<_> = got.notifications.iter().map(|n| n.dedup_key.clone().expect("key")).collect();
    assert_eq!(keys.len(), 6, "{keys:?}");
    assert!(keys.iter().take(3).all(|k| k.contains("/2026-07-07/")));
    assert!(keys.iter().skip(3).all(|k| k.contains("/2026-07-08/")));
}

#[test]
fn a_monitor_quota_fires_over_its_limit_with_one_audit_entry() {
    let t0 = utc("2026-07-07T10:00:00Z");
    let facts: Vec<UsageFact> = (0..6).map(|i| call(i, None, t0)).collect();
    let got = one_batch(&[calls("qm", Mode::Monitor, 2)], &facts);
    let exceeded: Vec<_> = got.notifications.iter().filter(|n| n.event_type == QUOTA_EXCEEDED).collect();
    assert_eq!(exceeded.len(), 1);
    let data = &body(exceeded[0])["data"];
    assert_eq!((data["mode"].as_str(), data["observed_value"].as_u64()), (Some("monitor"), Some(3)));
    assert_eq!(got.audit.len(), 1);
    let e = &got.audit[0];
    assert_eq!(e.action.as_str(), "quotas:MonitorBreach");
    assert_eq!(e.once_key().as_deref(), Some("qm/2026-07-07"));
    assert_eq!(e.created_at, facts[2].receipt());
}

#[test]
fn a_refused_check_exceeds_before_the_folded_usage_does() {
    let t0 = utc("2026-07-07T10:00:00Z");
    let q = calls("q1", Mode::Enforce, 3);
    // One call folded; a check refused over the limit (the other calls are
    // still reserved, not yet folded).
    let refused = UsageFact {
        api_key_id: Some(ApiKeyId::parse("key_1").expect("id")),
        received_at: Some(t0 + Duration::seconds(5)),
        admitted: Some(false),
        breaches: vec![LoggedBreach {
            quota_id: q.id.clone(),
            window_key: "2026-07-07".into(),
            limit: 3,
            observed: 4,
            enforce: true,
        }],
        ..UsageFact::new(EventId::parse("req-9").expect("id"), project(), EventKind::Request, t0)
    };
    let facts = vec![call(0, None, t0), refused, call(1, None, t0), call(2, None, t0)];
    let got = one_batch(std::slice::from_ref(&q), &facts);
    let exceeded: Vec<_> = got.notifications.iter().filter(|n| n.event_type == QUOTA_EXCEEDED).collect();
    assert_eq!(exceeded.len(), 1, "once, by whichever came first");
    let b = body(exceeded[0]);
    assert_eq!(b["timestamp"], "2026-07-07T10:00:05.000Z");
    assert_eq!(b["data"]["observed_value"], 4);
    assert_eq!(got.notifications.iter().filter(|n| n.event_type == QUOTA_NEARLY_USED).count(), 2);
}

#[test]
fn a_null_ref_actor_quota_fires_for_the_first_actor_to_cross() {
    let t0 = utc("2026-07-07T10:00:00Z");
    let q = quota("qa", Scope::Actor, None, Metric::Calls, Mode::Enforce, 2);
    let facts =
        vec![call(0, Some("bob"), t0), call(1, Some("ann"), t0), call(2, Some("ann"), t0), call(3, Some("bob"), t0)];
    let got = one_batch(&[q], &facts);
    let exceeded: Vec<_> = got.notifications.iter().filter(|n| n.event_type == QUOTA_EXCEEDED).collect();
    assert_eq!(exceeded.len(), 1);
    assert_eq!(body(exceeded[0])["data"]["scope_ref"], "ann");
    // bob's first call already used 50 %, under 80 %: ann crossed 80 first too.
    let warn = got.notifications.iter().find(|n| n.event_type == QUOTA_NEARLY_USED).expect("warning");
    assert_eq!(body(warn)["data"]["scope_ref"], "ann");
}

#[test]
fn storage_is_judged_on_the_footprint_by_the_snapshots_utc_day() {
    let at = utc("2026-07-07T22:30:00+05:45");
    let q = quota("qs", Scope::Project, None, Metric::StorageBytes, Mode::Enforce, 1000);
    let snap = UsageFact {
        storage_bytes: Some(900),
        ..UsageFact::new(EventId::parse("snap-1").expect("id"), project(), EventKind::StorageSnapshot, at)
    };
    let zones: HashMap<ProjectId, Tz> = [(project(), Tz::UTC)].into_iter().collect();
    let facts = [&snap];
    let run = |bytes: i64| {
        let footprints: HashMap<ProjectId, i64> = [(project(), bytes)].into_iter().collect();
        quota_notifications(&BatchAlerts {
            quotas: std::slice::from_ref(&q),
            zones: &zones,
            book: &PriceBook::default(),
            facts: &facts,
            before: &HashMap::new(),
            footprints: &footprints,
        })
    };
    let warn = run(900);
    assert_eq!(warn.notifications.len(), 1);
    assert_eq!(warn.notifications[0].dedup_key.as_deref(), Some("qs/2026-07-07/quota.nearly_used/80"));
    assert_eq!(run(1000).notifications.len(), 3);
    assert!(run(799).notifications.is_empty());
}

#[test]
fn cost_amounts_are_decimal_dollars_and_thresholds_round_up() {
    assert_eq!(threshold(10, 80), 8);
    assert_eq!(threshold(9, 80), 8, "7.2 rounds up");
    assert_eq!(threshold(0, 80), 1);
    assert_eq!(threshold(u64::MAX, 100), u64::MAX);
    let q = quota("qc", Scope::Project, None, Metric::CostUsd, Mode::Enforce, 2_500_000_000_000);
    assert_eq!(amount(&q, 2_500_000_000_000), json!("2.5"));
}

#[test]
fn totals_before_take_the_batch_back_and_never_go_below_zero() {
    let key =
        CounterKey { dimension: crate::usage::Dimension::Project, window: WindowKind::Day, window_key: "d".into() };
    let c = Counter { key: key.clone(), resets_at: None };
    let after = vec![(project(), c.clone(), Totals { calls: 7, ..Totals::default() })];
    let mut d = [0i64; 13];
    d[Field::Calls.index()] = 3;
    d[Field::Rows.index()] = 5;
    let before = totals_before(&after, &[(project(), c, d)]);
    let t = before.get(&(project(), key)).expect("counter");
    assert_eq!((t.calls, t.rows), (4, 0));
}

proptest! {
    /// However the log is cut into batches, and with any batch folded
    /// again from where it began, the outbox holds the same notifications,
    /// byte for byte. (A batch redelivered to a store is fenced, and its
    /// facts sent again are duplicates: neither is walked at all.)
    #[test]
    fn batches_and_redeliveries_make_the_same_notifications(
        n in 0usize..40,
        limit in 0u64..25,
        monitor in any::<bool>(),
        cuts in proptest::collection::vec(0usize..40, 0..6),
        again in proptest::collection::vec(any::<bool>(), 8),
        breach_at in proptest::option::of(0usize..40),
    ) {
        let t0 = utc("2026-07-07T23:58:00Z");
        let mode = if monitor { Mode::Monitor } else { Mode::Enforce };
        let quotas = vec![calls("q1", mode, limit), quota("qa", Scope::Actor, None, Metric::Calls, mode, limit / 2)];
        let mut facts: Vec<UsageFact> = (0..n)
            .map(|i| call(i, Some(if i % 3 == 0 { "a" } else { "b" }), t0 + Duration::seconds(10 * i as i64)))
            .collect();
        if let Some(at) = breach_at.filter(|a| *a < facts.len()) {
            let f = &facts[at];
            let b = LoggedBreach {
                quota_id: quotas[0].id.clone(),
                window_key: window_at(WindowKind::Day, Tz::UTC, f.occurred_at).key,
                limit,
                observed: limit + 1,
                enforce: !monitor,
            };
            let req = UsageFact {
                breaches: vec![b],
                admitted: Some(monitor),
                ..UsageFact::new(EventId::parse("req-x").expect("id"), project(), EventKind::Request, f.occurred_at)
            };
            facts.insert(at, req);
        }
        let mut whole = Model::default();
        whole.fold(&quotas, &facts);
        let mut cut: Vec<usize> = cuts.into_iter().filter(|c| *c <= facts.len()).collect();
        cut.push(0);
        cut.push(facts.len());
        cut.sort_unstable();
        cut.dedup();
        let mut split = Model::default();
        for (i, w) in cut.windows(2).enumerate() {
            let batch = &facts[w[0]..w[1]];
            let counters = split.counters.clone();
            split.fold(&quotas, batch);
            if again.get(i).copied().unwrap_or(false) {
                // Folded again from where it began (a fold rolled back and
                // redone): the same notifications, byte for byte, which the
                // outbox already holds.
                let outbox = split.outbox.clone();
                split.counters = counters;
                split.fold(&quotas, batch);
                prop_assert_eq!(&outbox, &split.outbox);
            }
        }
        prop_assert_eq!(&whole.outbox, &split.outbox);
        prop_assert_eq!(&whole.audit, &split.audit);
        // Each kind at most once per quota and window, and exceeded only
        // at or over the limit.
        for n in whole.outbox.values() {
            let b: Value = serde_json::from_str(&n.body).expect("json");
            let observed = b["data"]["observed_value"].as_u64().expect("observed");
            if n.event_type == QUOTA_EXCEEDED {
                prop_assert!(observed >= b["data"]["limit"].as_u64().expect("limit"));
            }
        }
    }
}
