//! Webhooks: endpoints, the notifications they subscribe to, and the rules
//! of delivery (Standard Webhooks v1), with no I/O.
//!
//! A **notification** is enqueued once: its dedup key (quota, window key,
//! kind, threshold) is unique in the store's outbox, so whoever enqueues it
//! — a fold, a redelivered batch, a replay — adds it at most once. Its body
//! (`{"type","timestamp","data"}`) and its id (the `webhook-id` header) are
//! fixed when it is enqueued, so every attempt, resend and replay sends the
//! same bytes under the same id; only `webhook-timestamp` and the signature
//! are of the attempt.
//!
//! A **delivery** is one message to one endpoint. After a failed attempt
//! [`decide`] says what comes next, from the attempt's outcome, the number
//! of attempts so far, a jitter drawn by the caller and the caller's `at`:
//! the schedule is [`RETRY_DELAYS`] (5 s, 5 min, 30 min, 2 h, 5 h, 10 h,
//! 10 h) with ±20 % jitter, at least [`SLOW_DOWN`] after a 429 or a timeout,
//! a `Retry-After` honoured within [base, 2 × base]; a 410 disables the
//! endpoint, and so does an endpoint that has failed (every attempt, every
//! message) for [`FAILING_DISABLES_AFTER`].

use chrono::{DateTime, Duration, SecondsFormat, Utc};
use serde_json::{Value, json};

use crate::error::{FieldError, named};
use crate::ids::{MessageId, ProjectId, WebhookId};

/// The event types an endpoint may name exactly.
pub const EVENT_TYPES: [&str; 5] = [QUOTA_EXCEEDED, QUOTA_NEARLY_USED, EXPORT_COMPLETED, EXPORT_FAILED, WEBHOOK_TEST];
pub const QUOTA_EXCEEDED: &str = "quota.exceeded";
pub const QUOTA_NEARLY_USED: &str = "quota.nearly_used";
/// A billing export run ended complete or partial (see [`crate::export::schedule::notification`]).
pub const EXPORT_COMPLETED: &str = "export.completed";
/// A billing export run failed.
pub const EXPORT_FAILED: &str = "export.failed";
/// The wildcards an endpoint may name: a family of event types, or all.
pub const WILDCARDS: [&str; 3] = ["quota.*", "export.*", "*"];
pub const WEBHOOK_TEST: &str = "webhook.test";

/// Most event types one endpoint names.
pub const MAX_EVENT_TYPES: usize = 16;

/// The waits after the 1st, 2nd, … failed attempt; after the last one a
/// delivery has failed for good (8 attempts in all).
pub const RETRY_DELAYS: [Duration; 7] = [
    Duration::seconds(5),
    Duration::minutes(5),
    Duration::minutes(30),
    Duration::hours(2),
    Duration::hours(5),
    Duration::hours(10),
    Duration::hours(10),
];

/// The least wait after a 429 or a timeout.
pub const SLOW_DOWN: Duration = Duration::seconds(60);

/// An endpoint whose attempts have all failed for this long is disabled.
pub const FAILING_DISABLES_AFTER: Duration = Duration::days(5);

/// How long a rotated-out secret keeps signing beside the new one.
pub const ROTATION_OVERLAP: Duration = Duration::hours(24);

/// The most of a response body an attempt keeps.
pub const RESPONSE_EXCERPT: usize = 2048;

/// The event types of an endpoint: exact names of [`EVENT_TYPES`] or
/// [`WILDCARDS`]; at least one, each once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTypes(Vec<String>);

impl EventTypes {
    /// Checks a list, refusing it by `field` (`event_types[1]`).
    pub fn parse(list: Vec<String>, field: &str) -> Result<EventTypes, FieldError> {
        if list.is_empty() || list.len() > MAX_EVENT_TYPES {
            return Err(FieldError::new(field, format!("must hold 1 to {MAX_EVENT_TYPES} event types")));
        }
        let mut seen: Vec<String> = Vec::with_capacity(list.len());
        for (i, t) in list.into_iter().enumerate() {
            if !(WILDCARDS.contains(&t.as_str()) || EVENT_TYPES.contains(&t.as_str())) {
                return Err(FieldError::new(
                    format!("{field}[{i}]"),
                    format!("must be one of {}, {}", EVENT_TYPES.join(", "), WILDCARDS.join(", ")),
                ));
            }
            if seen.contains(&t) {
                return Err(FieldError::new(format!("{field}[{i}]"), "is given more than once"));
            }
            seen.push(t);
        }
        Ok(EventTypes(seen))
    }

    /// A stored list, trusted.
    pub fn stored(list: Vec<String>) -> EventTypes {
        EventTypes(list)
    }

    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    /// Whether an event of this type is wanted.
    pub fn matches(&self, event_type: &str) -> bool {
        self.0.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => event_type.starts_with(prefix),
            None => p == event_type,
        })
    }
}

/// A signing secret: `whsec_` and the base64 of its key bytes.
pub const SECRET_PREFIX: &str = "whsec_";

/// A subscriber's endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub id: WebhookId,
    pub project_id: ProjectId,
    pub url: String,
    pub event_types: EventTypes,
    pub description: Option<String>,
    pub enabled: bool,
    /// Why the endpoint was disabled by delivery (a 410, five days of
    /// failures); `None` when enabled, or disabled by an admin.
    pub disabled_reason: Option<String>,
    /// The current signing secret (`whsec_…`).
    pub secret: String,
    /// The secret rotated out, signing beside the new one until `until`.
    pub previous_secret: Option<(String, DateTime<Utc>)>,
    /// Since when every attempt to this endpoint failed (`None` after a success).
    pub failing_since: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl Endpoint {
    /// The secrets an attempt at `at` is signed with: the current one, and
    /// the previous one while its overlap lasts.
    pub fn signing_secrets(&self, at: DateTime<Utc>) -> Vec<&str> {
        let mut out = vec![self.secret.as_str()];
        if let Some((old, until)) = &self.previous_secret
            && at < *until
        {
            out.push(old.as_str());
        }
        out
    }
}

/// One notification: what every endpoint of its project that wants its type
/// receives, with the same id and body each time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub id: MessageId,
    pub project_id: ProjectId,
    pub event_type: String,
    /// What makes it enqueued once (`None` for a test message, never deduplicated).
    pub dedup_key: Option<String>,
    /// The body, exactly as signed and sent.
    pub body: String,
    /// A `webhook.test` fired by an admin.
    pub test: bool,
    pub created_at: DateTime<Utc>,
}

impl Notification {
    /// A notification of `event_type` with `data`, stamped `at`: the body is
    /// `{"type","timestamp","data"}`.
    pub fn new(
        id: MessageId,
        project_id: ProjectId,
        event_type: &str,
        data: Value,
        dedup_key: Option<String>,
        at: DateTime<Utc>,
    ) -> Notification {
        let body = json!({
            "type": event_type,
            "timestamp": at.to_rfc3339_opts(SecondsFormat::Millis, true),
            "data": data,
        });
        Notification {
            id,
            project_id,
            event_type: event_type.to_owned(),
            dedup_key,
            body: body.to_string(),
            test: false,
            created_at: at,
        }
    }

    /// A `webhook.test` message for one endpoint, marked as a test.
    pub fn test(id: MessageId, endpoint: &Endpoint, at: DateTime<Utc>) -> Notification {
        let data = json!({"test": true, "endpoint_id": endpoint.id, "project_id": endpoint.project_id});
        Notification { test: true, ..Notification::new(id, endpoint.project_id.clone(), WEBHOOK_TEST, data, None, at) }
    }
}

/// The dedup key of a quota notification: (quota, window key, kind,
/// threshold), `-` for no threshold.
pub fn dedup_key(quota: &str, window_key: &str, kind: &str, threshold: Option<u32>) -> String {
    match threshold {
        Some(t) => format!("{quota}/{window_key}/{kind}/{t}"),
        None => format!("{quota}/{window_key}/{kind}/-"),
    }
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeliveryStatus {
    /// Waiting for its next attempt.
    Pending,
    Succeeded,
    /// Failed for good (schedule exhausted, or its endpoint disabled).
    Failed,
}

impl DeliveryStatus {
    pub const ALL: [DeliveryStatus; 3] = [DeliveryStatus::Pending, DeliveryStatus::Succeeded, DeliveryStatus::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Succeeded => "succeeded",
            DeliveryStatus::Failed => "failed",
        }
    }
}

named!(DeliveryStatus, "delivery status", DeliveryStatus::ALL);

/// A delivery due now, claimed by one notifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueDelivery {
    pub message: Notification,
    pub endpoint: Endpoint,
    /// Attempts made so far since the last resend (what the schedule counts).
    pub tries: u32,
    /// Attempts made in all (the next one is number `attempts + 1`).
    pub attempts: u32,
}

/// One attempt as the delivery log keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// 1, 2, … per delivery, never reused (a resend goes on counting).
    pub number: u32,
    pub at: DateTime<Utc>,
    /// The response's status; `None` if none came (refused, timed out…).
    pub status_code: Option<u16>,
    pub latency_ms: u64,
    /// The first [`RESPONSE_EXCERPT`] bytes of the response body (cut at a
    /// character boundary), or what went wrong.
    pub response: String,
}

/// What an attempt came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx.
    Delivered,
    /// A 410: the subscriber wants no more.
    Gone,
    /// Anything else: another status (with its `Retry-After`, in seconds,
    /// if it gave one), a timeout, no connection.
    Failed { status: Option<u16>, timed_out: bool, retry_after: Option<u64> },
}

impl Outcome {
    /// The outcome of a response's status.
    pub fn of_status(status: u16, retry_after: Option<u64>) -> Outcome {
        match status {
            200..=299 => Outcome::Delivered,
            410 => Outcome::Gone,
            s => Outcome::Failed { status: Some(s), timed_out: false, retry_after },
        }
    }
}

/// What happens to the delivery after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Succeeded,
    RetryAt(DateTime<Utc>),
    Failed,
}

/// What happens to the endpoint after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointChange {
    /// It answered: no longer failing.
    Healthy,
    /// It failed, failing since then (the first failure after a success).
    Failing(DateTime<Utc>),
    /// Disabled, with the reason.
    Disable(String),
}

/// What an attempt decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub next: Next,
    pub endpoint: EndpointChange,
}

/// The wait before the next attempt after the `tries`-th failed one (1 is
/// the first), or `None` once the schedule is exhausted. `jitter` is drawn
/// by the caller from 0 to 1000 (‰ of the ±20 % band: 0 is −20 %, 1000 is
/// +20 %); out-of-range values are clamped.
pub fn retry_delay(tries: u32, outcome: &Outcome, jitter: u32) -> Option<Duration> {
    let index = usize::try_from(tries.checked_sub(1)?).ok()?;
    let base = *RETRY_DELAYS.get(index)?;
    let jitter = i64::from(jitter.min(1000));
    // base × (0.8 + 0.4 × jitter/1000), in milliseconds, exactly.
    let ms = base.num_milliseconds();
    let mut wait = Duration::milliseconds(ms / 1000 * (800 + jitter * 400 / 1000));
    if let Outcome::Failed { status, timed_out, retry_after } = outcome {
        if let Some(secs) = retry_after {
            let asked = Duration::seconds(i64::try_from(*secs).unwrap_or(i64::MAX / 1000).min(i64::MAX / 1000));
            wait = asked.clamp(base, base + base);
        }
        if *timed_out || *status == Some(429) {
            wait = wait.max(SLOW_DOWN);
        }
    }
    Some(wait)
}

/// What follows the `tries`-th attempt (1 is the first) of a delivery to an
/// endpoint failing since `failing_since`, made at `at`.
pub fn decide(
    tries: u32,
    outcome: &Outcome,
    jitter: u32,
    failing_since: Option<DateTime<Utc>>,
    at: DateTime<Utc>,
) -> Decision {
    match outcome {
        Outcome::Delivered => Decision { next: Next::Succeeded, endpoint: EndpointChange::Healthy },
        Outcome::Gone => Decision {
            next: Next::Failed,
            endpoint: EndpointChange::Disable("the endpoint answered 410 Gone".to_owned()),
        },
        Outcome::Failed { .. } => {
            let since = failing_since.unwrap_or(at).min(at);
            if at - since >= FAILING_DISABLES_AFTER {
                return Decision {
                    next: Next::Failed,
                    endpoint: EndpointChange::Disable(format!(
                        "every attempt failed for {} days",
                        FAILING_DISABLES_AFTER.num_days()
                    )),
                };
            }
            let next = match retry_delay(tries, outcome, jitter) {
                Some(wait) => Next::RetryAt(at + wait),
                None => Next::Failed,
            };
            Decision { next, endpoint: EndpointChange::Failing(since) }
        }
    }
}

/// The first [`RESPONSE_EXCERPT`] bytes of a text, cut at a character boundary.
pub fn excerpt(text: &str) -> String {
    if text.len() <= RESPONSE_EXCERPT {
        return text.to_owned();
    }
    let mut end = RESPONSE_EXCERPT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).expect("timestamp").with_timezone(&Utc)
    }

    fn failed(status: Option<u16>, timed_out: bool, retry_after: Option<u64>) -> Outcome {
        Outcome::Failed { status, timed_out, retry_after }
    }

    #[test]
    fn event_types_take_exact_names_and_the_wildcards() {
        let t = |v: &[&str]| EventTypes::parse(v.iter().map(|s| s.to_string()).collect(), "event_types");
        let q = t(&["quota.*"]).expect("quota.*");
        assert!(q.matches("quota.exceeded") && q.matches("quota.nearly_used") && !q.matches("webhook.test"));
        assert!(t(&["*"]).expect("*").matches("webhook.test"));
        let exact = t(&["quota.exceeded"]).expect("exact");
        assert!(exact.matches("quota.exceeded") && !exact.matches("quota.nearly_used"));
        let e = t(&["quota.exceded"]).expect_err("unknown");
        assert_eq!(e.field, "event_types[0]");
        assert_eq!(t(&["*", "*"]).expect_err("twice").field, "event_types[1]");
        assert_eq!(t(&[]).expect_err("empty").field, "event_types");
        assert!(t(&["quota.e*"]).is_err(), "only the listed wildcards");
        let x = t(&["export.*"]).expect("export.*");
        assert!(x.matches("export.completed") && x.matches("export.failed") && !x.matches("quota.exceeded"));
        assert!(t(&["export.failed"]).expect("exact").matches("export.failed"));
    }

    #[test]
    fn the_schedule_is_jittered_within_twenty_percent() {
        let plain = failed(Some(500), false, None);
        for (i, base) in RETRY_DELAYS.iter().enumerate() {
            let tries = u32::try_from(i + 1).expect("small");
            let low = retry_delay(tries, &plain, 0).expect("scheduled");
            let mid = retry_delay(tries, &plain, 500).expect("scheduled");
            let high = retry_delay(tries, &plain, 1000).expect("scheduled");
            assert_eq!(low, *base * 8 / 10);
            assert_eq!(mid, *base);
            assert_eq!(high, *base * 12 / 10);
        }
        assert_eq!(retry_delay(8, &plain, 500), None, "eight attempts in all");
        assert_eq!(retry_delay(0, &plain, 500), None);
        assert_eq!(retry_delay(1, &plain, 5000), Some(Duration::seconds(6)), "jitter clamped");
    }

    #[test]
    fn a_429_or_a_timeout_waits_at_least_a_minute_and_retry_after_is_bounded() {
        assert_eq!(retry_delay(1, &failed(Some(429), false, None), 500), Some(Duration::seconds(60)));
        assert_eq!(retry_delay(1, &failed(None, true, None), 0), Some(Duration::seconds(60)));
        // The second wait is 5 min: Retry-After within [5 min, 10 min].
        assert_eq!(retry_delay(2, &failed(Some(503), false, Some(1)), 500), Some(Duration::minutes(5)));
        assert_eq!(retry_delay(2, &failed(Some(503), false, Some(420)), 500), Some(Duration::minutes(7)));
        assert_eq!(retry_delay(2, &failed(Some(503), false, Some(99_999)), 500), Some(Duration::minutes(10)));
        assert_eq!(retry_delay(2, &failed(Some(503), false, Some(u64::MAX)), 500), Some(Duration::minutes(10)));
        // A 429 with a short Retry-After on the first wait (5 s): at least 60 s.
        assert_eq!(retry_delay(1, &failed(Some(429), false, Some(7)), 500), Some(Duration::seconds(60)));
    }

    #[test]
    fn a_410_disables_and_five_days_of_failures_disable() {
        let now = at("2026-03-10T00:00:00Z");
        let gone = decide(1, &Outcome::of_status(410, None), 500, None, now);
        assert_eq!(gone.next, Next::Failed);
        assert!(matches!(gone.endpoint, EndpointChange::Disable(_)));
        let ok = decide(3, &Outcome::of_status(204, None), 500, Some(now), now);
        assert_eq!(ok, Decision { next: Next::Succeeded, endpoint: EndpointChange::Healthy });
        let first = decide(1, &Outcome::of_status(500, None), 500, None, now);
        assert_eq!(first.next, Next::RetryAt(now + Duration::seconds(5)));
        assert_eq!(first.endpoint, EndpointChange::Failing(now));
        let later = decide(2, &Outcome::of_status(500, None), 500, Some(now - Duration::days(4)), now);
        assert_eq!(later.endpoint, EndpointChange::Failing(now - Duration::days(4)));
        let dead = decide(2, &Outcome::of_status(500, None), 500, Some(now - Duration::days(5)), now);
        assert_eq!(dead.next, Next::Failed);
        assert!(matches!(dead.endpoint, EndpointChange::Disable(_)));
        let exhausted = decide(8, &Outcome::of_status(500, None), 500, Some(now), now);
        assert_eq!(exhausted.next, Next::Failed);
    }

    #[test]
    fn a_body_is_type_timestamp_and_data_and_the_old_secret_signs_for_a_day() {
        let now = at("2026-03-10T00:00:00Z");
        let n = Notification::new(
            MessageId::parse("msg_1").expect("id"),
            ProjectId::parse("proj_1").expect("id"),
            QUOTA_EXCEEDED,
            json!({"quota_id": "quota_1"}),
            Some(dedup_key("quota_1", "2026-03-10", "quota.exceeded", None)),
            now,
        );
        let body: Value = serde_json::from_str(&n.body).expect("json");
        assert_eq!(
            body,
            json!({"type": "quota.exceeded", "timestamp": "2026-03-10T00:00:00.000Z", "data": {"quota_id": "quota_1"}})
        );
        assert_eq!(n.dedup_key.as_deref(), Some("quota_1/2026-03-10/quota.exceeded/-"));
        let mut e = Endpoint {
            id: WebhookId::parse("wh_1").expect("id"),
            project_id: n.project_id.clone(),
            url: "http://127.0.0.1:1/".into(),
            event_types: EventTypes::stored(vec!["*".into()]),
            description: None,
            enabled: true,
            disabled_reason: None,
            secret: "whsec_new".into(),
            previous_secret: Some(("whsec_old".into(), now + ROTATION_OVERLAP)),
            failing_since: None,
            created_at: now,
            updated_at: now,
        };
        assert_eq!(e.signing_secrets(now), vec!["whsec_new", "whsec_old"]);
        assert_eq!(e.signing_secrets(now + ROTATION_OVERLAP), vec!["whsec_new"]);
        e.previous_secret = None;
        assert_eq!(e.signing_secrets(now), vec!["whsec_new"]);
        let t = Notification::test(MessageId::parse("msg_2").expect("id"), &e, now);
        assert!(t.test && t.dedup_key.is_none() && t.event_type == WEBHOOK_TEST);
    }

    #[test]
    fn an_excerpt_is_at_most_two_kilobytes_on_a_character_boundary() {
        assert_eq!(excerpt("short"), "short");
        let long = "é".repeat(2000);
        let cut = excerpt(&long);
        assert!(cut.len() <= RESPONSE_EXCERPT && cut.len() >= RESPONSE_EXCERPT - 1);
        assert!(long.starts_with(&cut));
    }
}
