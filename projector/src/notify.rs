//! The notifier: delivers the notification outbox to webhook endpoints,
//! following Standard Webhooks v1.
//!
//! Each [`Notifier::step`] claims the deliveries due now (a lease, so
//! several notifier processes never send one delivery at once; a notifier
//! killed mid-delivery leaves a claim that lapses, and another takes the
//! delivery then), attempts each, and records the attempt with what follows
//! it ([`meter::webhook::decide`]): success, a retry at a jittered time, a
//! final failure, or the endpoint disabled (with a `webhook.endpoint_disabled`
//! audit entry). Deliveries are rows, so nothing is lost across restarts;
//! a delivery whose notifier died after sending and before recording is
//! sent again, under the same `webhook-id`, which is what a receiver
//! deduplicates on.
//!
//! Every attempt is signed afresh: `webhook-id` is the message's id (stable
//! across retries, resends and replays), `webhook-timestamp` the attempt's
//! time in seconds (the injected clock's), `webhook-signature` one
//! `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` per live secret,
//! space-separated (the previous secret signs beside the new one for 24 h
//! after a rotation). Requests time out after 15 s and follow no redirect.
//! Private, loopback and link-local addresses are refused (the URL's
//! literal address, and every address its name resolves to, checked by the
//! client's own resolver so a name cannot change its answer between the
//! check and the connection) unless [`NotifierConfig::allow_private`].

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chrono::{DateTime, Utc};
use hmac::{Hmac, KeyInit, Mac};
use meter::webhook::{self, Outcome, SECRET_PREFIX};
use meter::{
    Attempt, AuditAction, AuditDetail, AuditEntry, AuditId, Clock, DueDelivery, EndpointChange, PortResult,
    WebhookStore,
};
use sha2::Sha256;
use tracing::{debug, info, warn};

/// Tunables of the notifier.
#[derive(Debug, Clone)]
pub struct NotifierConfig {
    /// This notifier's name on its claims (unique per process).
    pub claimant: String,
    /// How long a claim lasts: longer than an attempt may take.
    pub lease: chrono::Duration,
    /// Most deliveries claimed (and attempted concurrently) per step.
    pub batch: usize,
    /// An attempt's timeout.
    pub timeout: Duration,
    /// Deliver to private, loopback and link-local addresses too.
    pub allow_private: bool,
    /// How long [`Notifier::run`] waits when nothing is due.
    pub poll: Duration,
}

impl Default for NotifierConfig {
    fn default() -> Self {
        NotifierConfig {
            claimant: format!("notifier-{}", uuid::Uuid::new_v4().simple()),
            lease: chrono::Duration::seconds(60),
            batch: 32,
            timeout: Duration::from_secs(15),
            allow_private: false,
            poll: Duration::from_millis(250),
        }
    }
}

/// Why the notifier could not be built.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("building the HTTP client: {0}")]
    Client(String),
}

/// Whether an address is private, loopback, link-local or otherwise not a
/// public destination (unspecified, broadcast, shared, unique-local).
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_private(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            v6.is_loopback() || v6.is_unspecified() || (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80
        }
    }
}

/// Checks an endpoint URL: `http` or `https`, a host, no credentials, and
/// (unless `allow_private`) no private, loopback or link-local literal
/// address nor `localhost`. Names are checked again when resolved, at
/// delivery. Returns the URL as parsed, or why not.
pub fn check_url(raw: &str, allow_private: bool) -> Result<reqwest::Url, String> {
    if raw.len() > 2048 {
        return Err("must be at most 2048 characters".into());
    }
    let url = reqwest::Url::parse(raw).map_err(|e| format!("is not a valid URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("must be an http or https URL".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not carry credentials".into());
    }
    let host = match url.host() {
        None => return Err("must name a host".into()),
        Some(h) => h,
    };
    if !allow_private {
        let private = match host {
            url::Host::Ipv4(ip) => is_private(IpAddr::V4(ip)),
            url::Host::Ipv6(ip) => is_private(IpAddr::V6(ip)),
            url::Host::Domain(d) => {
                let d = d.trim_end_matches('.').to_ascii_lowercase();
                d == "localhost" || d.ends_with(".localhost")
            }
        };
        if private {
            return Err("must not be a private, loopback or link-local address \
                        (TOLLGATE_WEBHOOK_ALLOW_PRIVATE allows them)"
                .into());
        }
    }
    Ok(url)
}

/// The key bytes of a `whsec_…` secret.
fn key_of(secret: &str) -> Option<Vec<u8>> {
    STANDARD.decode(secret.strip_prefix(SECRET_PREFIX)?).ok()
}

/// A new secret: `whsec_` and the base64 of 24 random bytes.
pub fn new_secret() -> String {
    let bytes: [u8; 24] = rand::random();
    format!("{SECRET_PREFIX}{}", STANDARD.encode(bytes))
}

/// The `v1,<base64>` signature of one attempt with one secret, or `None`
/// if the secret is not `whsec_` and base64.
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &str) -> Option<String> {
    let key = key_of(secret)?;
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&key).ok()?;
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body.as_bytes());
    Some(format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes())))
}

/// The `webhook-signature` header: one signature per secret, space-separated.
pub fn signature_header(secrets: &[&str], id: &str, timestamp: i64, body: &str) -> String {
    secrets.iter().filter_map(|s| sign(s, id, timestamp, body)).collect::<Vec<_>>().join(" ")
}

/// The client's resolver: the system's, without private addresses unless
/// they are allowed, so what is checked is what is connected to.
struct PublicResolver;

impl reqwest::dns::Resolve for PublicResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> = addrs.into_iter().filter(|a| !is_private(a.ip())).collect();
            if public.is_empty() {
                let e: Box<dyn std::error::Error + Send + Sync> =
                    format!("{host} resolves to no public address").into();
                return Err(e);
            }
            Ok(Box::new(public.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Delivers the outbox; cheap to share (`Arc`), one per process.
pub struct Notifier {
    webhooks: Arc<dyn WebhookStore>,
    clock: Arc<dyn Clock>,
    client: reqwest::Client,
    config: NotifierConfig,
}

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotifyReport {
    pub attempted: usize,
    pub delivered: usize,
    pub disabled: usize,
}

impl Notifier {
    pub fn new(
        webhooks: Arc<dyn WebhookStore>,
        clock: Arc<dyn Clock>,
        config: NotifierConfig,
    ) -> Result<Notifier, NotifyError> {
        let mut builder = reqwest::Client::builder()
            .timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("tollgate-webhooks/", env!("CARGO_PKG_VERSION")));
        if !config.allow_private {
            builder = builder.dns_resolver(Arc::new(PublicResolver));
        }
        let client = builder.build().map_err(|e| NotifyError::Client(e.to_string()))?;
        Ok(Notifier { webhooks, clock, client, config })
    }

    pub fn config(&self) -> &NotifierConfig {
        &self.config
    }

    /// One round: claims what is due now, attempts each (concurrently), and
    /// records every attempt with what follows it.
    pub async fn step(&self) -> PortResult<NotifyReport> {
        let at = self.clock.now();
        let due = self
            .webhooks
            .claim_deliveries(&self.config.claimant, at, at + self.config.lease, self.config.batch)
            .await?;
        let mut report = NotifyReport::default();
        if due.is_empty() {
            return Ok(report);
        }
        let results = futures::future::join_all(due.iter().map(|d| self.deliver(d))).await;
        for r in results {
            let (delivered, disabled) = r?;
            report.attempted += 1;
            report.delivered += usize::from(delivered);
            report.disabled += usize::from(disabled);
        }
        metrics::counter!("tollgate_webhook_attempts_total").increment(report.attempted as u64);
        metrics::counter!("tollgate_webhook_deliveries_total").increment(report.delivered as u64);
        Ok(report)
    }

    /// Runs steps until `shutdown` resolves (between steps), waiting
    /// [`NotifierConfig::poll`] whenever nothing was due or the store failed.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> PortResult<()> {
        tokio::pin!(shutdown);
        info!(claimant = %self.config.claimant, "notifier running");
        loop {
            let idle = match self.step().await {
                Ok(r) => r.attempted == 0,
                Err(e) if e.is_transient() => {
                    warn!(error = %e, "notifier: store unavailable; retrying");
                    true
                }
                Err(e) => return Err(e),
            };
            if idle {
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(self.config.poll) => {}
                }
            } else if futures::poll!(&mut shutdown).is_ready() {
                return Ok(());
            }
        }
    }

    /// One attempt of a claimed delivery, recorded. Whether it was
    /// delivered, and whether it disabled the endpoint.
    async fn deliver(&self, d: &DueDelivery) -> PortResult<(bool, bool)> {
        let at = self.clock.now();
        let (outcome, status_code, response, latency) = self.attempt(d, at).await;
        let tries = d.tries.saturating_add(1);
        let jitter: u32 = rand::random_range(0..=1000);
        let decision = webhook::decide(tries, &outcome, jitter, d.endpoint.failing_since, at);
        let attempt = Attempt {
            number: d.attempts.saturating_add(1),
            at,
            status_code,
            latency_ms: u64::try_from(latency.as_millis()).unwrap_or(u64::MAX),
            response: webhook::excerpt(&response),
        };
        let audit = match &decision.endpoint {
            EndpointChange::Disable(reason) => Some(AuditEntry {
                id: new_audit_id(),
                project_id: Some(d.endpoint.project_id.clone()),
                action: AuditAction::WebhookEndpointDisabled,
                principal: None,
                resource: d.endpoint.id.to_string(),
                detail: AuditDetail::WebhookEndpointDisabled { url: d.endpoint.url.clone(), reason: reason.clone() },
                created_at: at,
            }),
            _ => None,
        };
        let recorded = self
            .webhooks
            .record_attempt(&self.config.claimant, d, &attempt, &decision.next, &decision.endpoint, audit.as_ref())
            .await?;
        let Some(disabled) = recorded else {
            warn!(message = %d.message.id, endpoint = %d.endpoint.id, "notifier: claim lost before the attempt was recorded");
            return Ok((false, false));
        };
        if disabled {
            warn!(endpoint = %d.endpoint.id, url = %d.endpoint.url, "webhook endpoint disabled");
        }
        debug!(message = %d.message.id, endpoint = %d.endpoint.id, status = ?status_code, next = ?decision.next, "webhook attempt");
        Ok((matches!(outcome, Outcome::Delivered), disabled))
    }

    /// Sends one attempt: its outcome, status, response excerpt (or error) and latency.
    async fn attempt(&self, d: &DueDelivery, at: DateTime<Utc>) -> (Outcome, Option<u16>, String, Duration) {
        let started = Instant::now();
        let refused = |why: String| (Outcome::Failed { status: None, timed_out: false, retry_after: None }, None, why);
        let (outcome, status, text) = match check_url(&d.endpoint.url, self.config.allow_private) {
            Err(why) => refused(format!("url {why}")),
            Ok(url) => {
                let id = d.message.id.as_str();
                let ts = at.timestamp();
                let signature = signature_header(&d.endpoint.signing_secrets(at), id, ts, &d.message.body);
                let sent = self
                    .client
                    .post(url)
                    .header("content-type", "application/json")
                    .header("webhook-id", id)
                    .header("webhook-timestamp", ts.to_string())
                    .header("webhook-signature", signature)
                    .body(d.message.body.clone())
                    .send()
                    .await;
                match sent {
                    Ok(res) => {
                        let status = res.status().as_u16();
                        let retry_after = res
                            .headers()
                            .get("retry-after")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.trim().parse::<u64>().ok());
                        let text = read_excerpt(res).await;
                        (Outcome::of_status(status, retry_after), Some(status), text)
                    }
                    Err(e) => {
                        let timed_out = e.is_timeout();
                        (Outcome::Failed { status: None, timed_out, retry_after: None }, None, error_chain(&e))
                    }
                }
            }
        };
        (outcome, status, text, started.elapsed())
    }
}

/// The first [`webhook::RESPONSE_EXCERPT`] bytes of a response body, read
/// no further than that.
async fn read_excerpt(mut res: reqwest::Response) -> String {
    let mut buf: Vec<u8> = Vec::new();
    while buf.len() < webhook::RESPONSE_EXCERPT {
        match res.chunk().await {
            Ok(Some(c)) => buf.extend_from_slice(&c),
            _ => break,
        }
    }
    buf.truncate(webhook::RESPONSE_EXCERPT);
    String::from_utf8_lossy(&buf).into_owned()
}

/// An error with its causes, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// A new audit-entry id, time-ordered: `aud_` and a UUIDv7, always in the
/// id alphabet (the documented invariant of the `expect`).
fn new_audit_id() -> AuditId {
    AuditId::parse(format!("aud_{}", uuid::Uuid::now_v7().simple())).expect("a new id is in the id alphabet")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_test_vector_signs_as_published() {
        let sig = sign(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#,
        );
        assert_eq!(sig.as_deref(), Some("v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="));
        assert_eq!(sign("not-a-secret", "msg", 1, "{}"), None);
        let both = signature_header(
            &["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", &new_secret()],
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#,
        );
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0], "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn urls_are_http_without_credentials_and_public_unless_allowed() {
        assert!(check_url("https://hooks.example.com/tollgate", false).is_ok());
        assert!(check_url("ftp://example.com/", false).is_err());
        assert!(check_url("https://user:pw@example.com/", false).is_err());
        assert!(check_url("https://user@example.com/", false).is_err());
        assert!(check_url("not a url", false).is_err());
        for private in [
            "http://127.0.0.1:9/",
            "http://10.1.2.3/",
            "http://192.168.0.1/",
            "http://172.16.0.1/",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]/",
            "http://[fe80::1]/",
            "http://[fd00::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://0.0.0.0/",
            "http://localhost:8080/",
            "http://api.localhost/",
        ] {
            assert!(check_url(private, false).is_err(), "{private} is refused");
            assert!(check_url(private, true).is_ok(), "{private} is allowed by configuration");
        }
        assert!(!is_private("8.8.8.8".parse().expect("ip")));
        assert!(!is_private("2001:4860:4860::8888".parse().expect("ip")));
    }
}
