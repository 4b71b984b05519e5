//! Webhook endpoints and the notification outbox over SQL
//! (`migrations/0010_webhooks.sql`).
//!
//! A message is enqueued once by its unique dedup key, with its deliveries,
//! in one transaction ([`enqueue_in`], which a fold can call inside its own
//! transaction so a notification commits with the fold that caused it).
//! Deliveries are claimed with one `UPDATE … WHERE <claimable> AND key IN
//! (SELECT … LIMIT n)`: on PostgreSQL a row another notifier claimed
//! meanwhile is re-checked against the `WHERE` after its lock and skipped;
//! SQLite's write lock serialises claims anyway. An attempt is recorded only
//! by the claimant still holding the claim.

use std::collections::HashMap;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use meter::{
    Attempt, AuditEntry, DeliveryLog, DeliveryStatus, DueDelivery, Endpoint, EndpointChange, EventTypes, MessageId,
    Next, Notification, PortError, PortResult, ProjectId, WebhookId, WebhookStore,
};

use super::config::insert_audit;
use super::{Backend, Rec, Rows, SqlStore, Stmt, each, error, limit};

const ENDPOINT_COLUMNS: &str = "id, project_id, url, event_types, description, enabled, disabled_reason, secret, \
                                previous_secret, previous_secret_until, failing_since, created_at, updated_at";
const MESSAGE_COLUMNS: &str = "id, project_id, event_type, dedup_key, body, is_test, created_at";
const ATTEMPT_COLUMNS: &str = "endpoint_id, message_id, number, at, status_code, latency_ms, response";

fn endpoint<B: Backend>(r: &Rec<'_, B>) -> PortResult<Endpoint> {
    let previous_secret = match (r.get::<Option<String>>("previous_secret")?, r.opt_time("previous_secret_until")?) {
        (Some(s), Some(until)) => Some((s, until)),
        _ => None,
    };
    Ok(Endpoint {
        id: r.id("id")?,
        project_id: r.id("project_id")?,
        url: r.text("url")?,
        event_types: EventTypes::stored(r.json("event_types")?),
        description: r.get("description")?,
        enabled: r.get("enabled")?,
        disabled_reason: r.get("disabled_reason")?,
        secret: r.text("secret")?,
        previous_secret,
        failing_since: r.opt_time("failing_since")?,
        created_at: r.time("created_at")?,
        updated_at: r.time("updated_at")?,
    })
}

fn message<B: Backend>(r: &Rec<'_, B>) -> PortResult<Notification> {
    Ok(Notification {
        id: r.id("id")?,
        project_id: r.id("project_id")?,
        event_type: r.text("event_type")?,
        dedup_key: r.get("dedup_key")?,
        body: r.text("body")?,
        test: r.get("is_test")?,
        created_at: r.time("created_at")?,
    })
}

fn attempt<B: Backend>(r: &Rec<'_, B>) -> PortResult<(MessageId, Attempt)> {
    let status_code = match r.get::<Option<i64>>("status_code")? {
        None => None,
        Some(c) => Some(u16::try_from(c).map_err(|_| super::corrupt("status_code", &c.to_string()))?),
    };
    Ok((
        r.id("message_id")?,
        Attempt {
            number: u32::try_from(r.count("number")?).map_err(|_| super::corrupt("number", "too large"))?,
            at: r.time("at")?,
            status_code,
            latency_ms: r.count("latency_ms")?,
            response: r.text("response")?,
        },
    ))
}

fn count_u32(r: &Rec<'_, impl Backend>, column: &str) -> PortResult<u32> {
    let v = r.count(column)?;
    u32::try_from(v).map_err(|_| super::corrupt(column, &v.to_string()))
}

/// Binds what can change of an endpoint, in the order of [`CHANGEABLE`].
fn bind_changeable(stmt: Stmt, e: &Endpoint) -> PortResult<Stmt> {
    let (prev, prev_until) = match &e.previous_secret {
        Some((s, until)) => (Some(s.as_str()), Some(*until)),
        None => (None, None),
    };
    Ok(stmt
        .text(&e.url)
        .json(&e.event_types.as_slice())?
        .opt_text(e.description.as_deref())
        .flag(e.enabled)
        .opt_text(e.disabled_reason.as_deref())
        .text(&e.secret)
        .opt_text(prev)
        .opt_time(prev_until)
        .opt_time(e.failing_since)
        .time(e.updated_at))
}

/// The columns [`bind_changeable`] binds.
const CHANGEABLE: [&str; 10] = [
    "url",
    "event_types",
    "description",
    "enabled",
    "disabled_reason",
    "secret",
    "previous_secret",
    "previous_secret_until",
    "failing_since",
    "updated_at",
];

fn insert_endpoint(e: &Endpoint) -> PortResult<Stmt> {
    let params: Vec<String> = (1..=13).map(|i| format!("${i}")).collect();
    let stmt = Stmt::new(format!(
        "INSERT INTO webhook_endpoints (id, project_id, created_at, {}) VALUES ({})",
        CHANGEABLE.join(", "),
        params.join(", ")
    ))
    .text(e.id.as_str())
    .text(e.project_id.as_str())
    .time(e.created_at);
    bind_changeable(stmt, e)
}

fn update_endpoint(e: &Endpoint) -> PortResult<Stmt> {
    let sets: Vec<String> = CHANGEABLE.iter().enumerate().map(|(i, c)| format!("{c} = ${}", i + 2)).collect();
    let stmt = Stmt::new(format!("UPDATE webhook_endpoints SET {} WHERE id = $1", sets.join(", "))).text(e.id.as_str());
    bind_changeable(stmt, e)
}

/// Enqueues a notification inside the caller's transaction (see
/// [`WebhookStore::enqueue`]): the fold calls this with its own, so a
/// notification commits with the fold that caused it, or not at all.
pub(crate) async fn enqueue_in<B: Backend>(
    conn: &mut B::Connection,
    n: &Notification,
    to: Option<&WebhookId>,
) -> PortResult<bool> {
    // `WHERE true` keeps SQLite from reading ON CONFLICT as part of the SELECT.
    let insert = Stmt::new(format!(
        "INSERT INTO notification_messages ({MESSAGE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT DO NOTHING"
    ))
    .text(n.id.as_str())
    .text(n.project_id.as_str())
    .text(&n.event_type)
    .opt_text(n.dedup_key.as_deref())
    .text(&n.body)
    .flag(n.test)
    .time(n.created_at);
    if B::execute(&mut *conn, insert).await? == 0 {
        return Ok(false);
    }
    let stmt = Stmt::new(format!(
        "SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE project_id = $1 AND enabled \
         AND (CAST($2 AS TEXT) IS NULL OR id = $2) ORDER BY id"
    ))
    .text(n.project_id.as_str())
    .opt_text(to.map(WebhookId::as_str));
    let endpoints = each(&B::fetch(&mut *conn, stmt).await?, endpoint::<B>)?;
    let wanted: Vec<&Endpoint> =
        endpoints.iter().filter(|e| to.is_some() || e.event_types.matches(&n.event_type)).collect();
    if wanted.is_empty() {
        return Ok(true);
    }
    let rows = Rows::new()
        .text("message_id", wanted.iter().map(|_| n.id.as_str()))
        .text("endpoint_id", wanted.iter().map(|e| e.id.as_str()))
        .time("next_attempt_at", wanted.iter().map(|_| n.created_at));
    let deliveries = Stmt::new(
        "INSERT INTO webhook_deliveries (message_id, endpoint_id, status, next_attempt_at) \
         SELECT message_id, endpoint_id, 'pending', next_attempt_at FROM {rows} AS t WHERE true",
    )
    .rows(rows);
    B::execute(&mut *conn, deliveries).await?;
    Ok(true)
}

impl<B: Backend> SqlStore<B> {
    /// Messages and endpoints by id.
    async fn messages_and_endpoints(
        &self,
        keys: &[(MessageId, WebhookId)],
    ) -> PortResult<(HashMap<MessageId, Notification>, HashMap<WebhookId, Endpoint>)> {
        let ids = Rows::new().text("id", keys.iter().map(|(m, _)| m.as_str()));
        let messages = Stmt::new(format!(
            "SELECT {MESSAGE_COLUMNS} FROM notification_messages WHERE id IN (SELECT id FROM {{rows}} AS t)"
        ))
        .rows(ids);
        let messages = each(&self.all(messages).await?, message::<B>)?;
        let ids = Rows::new().text("id", keys.iter().map(|(_, e)| e.as_str()));
        let endpoints = Stmt::new(format!(
            "SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE id IN (SELECT id FROM {{rows}} AS t)"
        ))
        .rows(ids);
        let endpoints = each(&self.all(endpoints).await?, endpoint::<B>)?;
        Ok((
            messages.into_iter().map(|m| (m.id.clone(), m)).collect(),
            endpoints.into_iter().map(|e| (e.id.clone(), e)).collect(),
        ))
    }
}

#[async_trait]
impl<B: Backend> WebhookStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "create_endpoint"))]
    async fn create_endpoint(&self, endpoint: &Endpoint, audit: &[AuditEntry]) -> PortResult<()> {
        self.run_audited(insert_endpoint(endpoint)?, audit).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "endpoint"))]
    async fn endpoint(&self, id: &WebhookId) -> PortResult<Option<Endpoint>> {
        let stmt =
            Stmt::new(format!("SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE id = $1")).text(id.as_str());
        self.opt(stmt).await?.as_ref().map(|r| endpoint(&Rec::<B>(r))).transpose()
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "endpoints"))]
    async fn endpoints(&self, project: &ProjectId) -> PortResult<Vec<Endpoint>> {
        let stmt =
            Stmt::new(format!("SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE project_id = $1 ORDER BY id"))
                .text(project.as_str());
        each(&self.all(stmt).await?, endpoint::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "update_endpoint"))]
    async fn update_endpoint(&self, endpoint: &Endpoint, audit: &[AuditEntry]) -> PortResult<bool> {
        Ok(self.run_audited(update_endpoint(endpoint)?, audit).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "delete_endpoint"))]
    async fn delete_endpoint(&self, id: &WebhookId, audit: &[AuditEntry]) -> PortResult<bool> {
        let mut tx = B::begin(self.pool()).await.map_err(error::<B>)?;
        // Attempts and deliveries first: SQLite enforces the cascade only
        // where foreign keys are on, so nothing relies on it.
        let attempts = Stmt::new("DELETE FROM webhook_attempts WHERE endpoint_id = $1").text(id.as_str());
        B::execute(&mut *tx, attempts).await?;
        let deliveries = Stmt::new("DELETE FROM webhook_deliveries WHERE endpoint_id = $1").text(id.as_str());
        B::execute(&mut *tx, deliveries).await?;
        let gone =
            B::execute(&mut *tx, Stmt::new("DELETE FROM webhook_endpoints WHERE id = $1").text(id.as_str())).await?;
        if gone == 1 {
            for entry in audit {
                B::execute(&mut *tx, insert_audit(entry)?).await?;
            }
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(gone == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "enqueue"))]
    async fn enqueue(&self, notification: &Notification, to: Option<&WebhookId>) -> PortResult<bool> {
        let mut tx = B::begin(self.pool()).await.map_err(error::<B>)?;
        let enqueued = enqueue_in::<B>(&mut tx, notification, to).await?;
        tx.commit().await.map_err(error::<B>)?;
        Ok(enqueued)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "claim_deliveries"))]
    async fn claim_deliveries(
        &self,
        claimant: &str,
        at: DateTime<Utc>,
        until: DateTime<Utc>,
        max: usize,
    ) -> PortResult<Vec<DueDelivery>> {
        let stmt = Stmt::new(
            "UPDATE webhook_deliveries SET claimed_by = $1, claimed_until = $3
             WHERE status = 'pending' AND next_attempt_at <= $2 AND (claimed_until IS NULL OR claimed_until < $2)
               AND (endpoint_id, message_id) IN (
                 SELECT d.endpoint_id, d.message_id FROM webhook_deliveries d
                 JOIN webhook_endpoints e ON e.id = d.endpoint_id
                 WHERE e.enabled AND d.status = 'pending' AND d.next_attempt_at <= $2
                   AND (d.claimed_until IS NULL OR d.claimed_until < $2)
                 ORDER BY d.next_attempt_at, d.message_id LIMIT $4)
             RETURNING endpoint_id, message_id, tries, attempts",
        )
        .text(claimant)
        .time(at)
        .time(until)
        .int(limit(max));
        let claimed = each(&self.all(stmt).await?, |r: &Rec<'_, B>| {
            Ok((
                r.id::<MessageId>("message_id")?,
                r.id::<WebhookId>("endpoint_id")?,
                count_u32(r, "tries")?,
                count_u32(r, "attempts")?,
            ))
        })?;
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<(MessageId, WebhookId)> = claimed.iter().map(|(m, e, _, _)| (m.clone(), e.clone())).collect();
        let (messages, endpoints) = self.messages_and_endpoints(&keys).await?;
        let mut out = Vec::with_capacity(claimed.len());
        for (m, e, tries, attempts) in claimed {
            let (Some(message), Some(endpoint)) = (messages.get(&m), endpoints.get(&e)) else {
                return Err(PortError::Permanent(format!("delivery of {m} to {e} has no message or endpoint")));
            };
            out.push(DueDelivery { message: message.clone(), endpoint: endpoint.clone(), tries, attempts });
        }
        out.sort_by(|a, b| a.message.id.cmp(&b.message.id));
        Ok(out)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "record_attempt"))]
    async fn record_attempt(
        &self,
        claimant: &str,
        delivery: &DueDelivery,
        attempt: &Attempt,
        next: &Next,
        change: &EndpointChange,
        disabled_audit: Option<&AuditEntry>,
    ) -> PortResult<Option<bool>> {
        let (message, endpoint) = (delivery.message.id.as_str(), delivery.endpoint.id.as_str());
        let mut tx = B::begin(self.pool()).await.map_err(error::<B>)?;
        let (status, next_at) = match next {
            Next::Succeeded => (DeliveryStatus::Succeeded, attempt.at),
            Next::RetryAt(t) => (DeliveryStatus::Pending, *t),
            Next::Failed => (DeliveryStatus::Failed, attempt.at),
        };
        let update = Stmt::new(
            "UPDATE webhook_deliveries SET status = $4, next_attempt_at = $5, tries = tries + 1, \
             attempts = attempts + 1, claimed_by = NULL, claimed_until = NULL \
             WHERE endpoint_id = $1 AND message_id = $2 AND claimed_by = $3",
        )
        .text(endpoint)
        .text(message)
        .text(claimant)
        .text(status.as_str())
        .time(next_at);
        if B::execute(&mut *tx, update).await? != 1 {
            // Dropped without a commit: nothing written.
            return Ok(None);
        }
        let insert =
            Stmt::new(format!("INSERT INTO webhook_attempts ({ATTEMPT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"))
                .text(endpoint)
                .text(message)
                .int(i64::from(attempt.number))
                .time(attempt.at);
        let insert = insert
            .opt_int(attempt.status_code.map(i64::from))
            .int(super::to_i64("latency_ms", attempt.latency_ms)?)
            .text(&attempt.response);
        B::execute(&mut *tx, insert).await?;
        let mut disabled = false;
        match change {
            EndpointChange::Healthy => {
                let s = Stmt::new("UPDATE webhook_endpoints SET failing_since = NULL WHERE id = $1").text(endpoint);
                B::execute(&mut *tx, s).await?;
            }
            EndpointChange::Failing(since) => {
                let s = Stmt::new(
                    "UPDATE webhook_endpoints SET failing_since = $2 WHERE id = $1 AND failing_since IS NULL",
                )
                .text(endpoint)
                .time(*since);
                B::execute(&mut *tx, s).await?;
            }
            EndpointChange::Disable(reason) => {
                let s = Stmt::new(
                    "UPDATE webhook_endpoints SET enabled = false, disabled_reason = $2, updated_at = $3 \
                     WHERE id = $1 AND enabled",
                )
                .text(endpoint)
                .text(reason)
                .time(attempt.at);
                disabled = B::execute(&mut *tx, s).await? == 1;
                if disabled && let Some(entry) = disabled_audit {
                    B::execute(&mut *tx, insert_audit(entry)?).await?;
                }
            }
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(Some(disabled))
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "quota_notifications"))]
    async fn quota_notifications(
        &self,
        project: &ProjectId,
        after: Option<&MessageId>,
        max: usize,
    ) -> PortResult<Vec<Notification>> {
        let stmt = Stmt::new(format!(
            "SELECT {MESSAGE_COLUMNS} FROM notification_messages              WHERE project_id = $1 AND event_type IN ($2, $3) AND (CAST($4 AS TEXT) IS NULL OR id > $4)              ORDER BY id LIMIT $5"
        ))
        .text(project.as_str())
        .text(meter::webhook::QUOTA_EXCEEDED)
        .text(meter::webhook::QUOTA_NEARLY_USED)
        .opt_text(after.map(MessageId::as_str))
        .int(limit(max));
        each(&self.all(stmt).await?, message::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "deliveries"))]
    async fn deliveries(
        &self,
        endpoint: &WebhookId,
        after: Option<&MessageId>,
        max: usize,
    ) -> PortResult<Vec<DeliveryLog>> {
        let cols: Vec<String> = MESSAGE_COLUMNS.split(", ").map(|c| format!("m.{c}")).collect();
        let stmt = Stmt::new(format!(
            "SELECT {}, d.status, d.next_attempt_at FROM webhook_deliveries d \
             JOIN notification_messages m ON m.id = d.message_id \
             WHERE d.endpoint_id = $1 AND (CAST($2 AS TEXT) IS NULL OR d.message_id > $2) \
             ORDER BY d.message_id LIMIT $3",
            cols.join(", ")
        ))
        .text(endpoint.as_str())
        .opt_text(after.map(MessageId::as_str))
        .int(limit(max));
        let mut logs = each(&self.all(stmt).await?, |r: &Rec<'_, B>| {
            let status: DeliveryStatus = r.parse("status")?;
            Ok(DeliveryLog {
                message: message(r)?,
                next_attempt_at: (status == DeliveryStatus::Pending).then(|| r.time("next_attempt_at")).transpose()?,
                status,
                attempts: Vec::new(),
            })
        })?;
        if logs.is_empty() {
            return Ok(logs);
        }
        let ids = Rows::new().text("id", logs.iter().map(|l| l.message.id.as_str()));
        let stmt = Stmt::new(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM webhook_attempts WHERE endpoint_id = $1 \
             AND message_id IN (SELECT id FROM {{rows}} AS t) ORDER BY message_id, number"
        ))
        .text(endpoint.as_str())
        .rows(ids);
        let mut by_message: HashMap<MessageId, Vec<Attempt>> = HashMap::new();
        for (m, a) in each(&self.all(stmt).await?, attempt::<B>)? {
            by_message.entry(m).or_default().push(a);
        }
        for l in &mut logs {
            l.attempts = by_message.remove(&l.message.id).unwrap_or_default();
        }
        Ok(logs)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "resend"))]
    async fn resend(&self, endpoint: &WebhookId, message: &MessageId, at: DateTime<Utc>) -> PortResult<bool> {
        let stmt = Stmt::new(
            "UPDATE webhook_deliveries SET status = 'pending', tries = 0, next_attempt_at = $3 \
             WHERE endpoint_id = $1 AND message_id = $2",
        )
        .text(endpoint.as_str())
        .text(message.as_str())
        .time(at);
        Ok(self.run(stmt).await? == 1)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "recover"))]
    async fn recover(
        &self,
        endpoint: &WebhookId,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        at: DateTime<Utc>,
    ) -> PortResult<u64> {
        let stmt = Stmt::new(
            "UPDATE webhook_deliveries SET status = 'pending', tries = 0, next_attempt_at = $4 \
             WHERE endpoint_id = $1 AND status = 'failed' AND message_id IN ( \
                 SELECT id FROM notification_messages WHERE created_at >= $2 AND created_at < $3)",
        )
        .text(endpoint.as_str())
        .time(since)
        .time(until)
        .time(at);
        self.run(stmt).await
    }
}
