//! Webhook endpoints, their delivery log and its recovery.
//!
//! An endpoint's signing secret (`whsec_…`) is answered once, when it is
//! created or rotated, and never read back. A rotation keeps the old secret
//! signing beside the new one for [`ROTATION_OVERLAP`] (24 h), so a
//! subscriber can switch without losing a delivery. URLs are checked here
//! (they depend on configuration: private addresses are refused unless
//! [`Settings::webhook_allow_private`](crate::Settings::webhook_allow_private)),
//! and again by the notifier at delivery.
//!
//! An admin's change to an endpoint (subscribe, change, delete, rotate the
//! secret) is audited as whoever made it, in the change's own transaction;
//! the entry never holds a secret.

use chrono::{DateTime, Utc};
use meter::webhook::ROTATION_OVERLAP;
use meter::{
    AuditAction, AuditDetail, AuditEntry, DeliveryLog, Endpoint, EndpointView, EventTypes, MessageId, Notification,
    Principal, ProjectId, WebhookId, admin_change,
};
use projector::notify::{check_url, new_secret};

use super::{Error, Page, Result, now_micros};
use crate::state::{AppState, new_audit_id, new_message_id, new_webhook_id};

/// Most endpoints per project.
pub const MAX_ENDPOINTS: usize = 100;
/// The largest page of the delivery log.
pub const MAX_DELIVERIES_PAGE: usize = 100;

/// A new endpoint, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEndpoint {
    pub url: String,
    pub event_types: EventTypes,
    pub description: Option<String>,
    pub enabled: bool,
}

/// A change to an endpoint; `None` keeps the field.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointPatch {
    pub url: Option<String>,
    pub event_types: Option<EventTypes>,
    /// `Some(None)` clears it.
    pub description: Option<Option<String>>,
    pub enabled: Option<bool>,
}

/// An endpoint with its secret, answered once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithSecret {
    pub endpoint: Endpoint,
}

/// A page of an endpoint's delivery log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveriesQuery {
    pub after: Option<MessageId>,
    pub limit: usize,
}

fn url(s: &AppState, raw: &str) -> Result<String> {
    check_url(raw, s.settings.webhook_allow_private).map_err(|m| Error::invalid("url", m))?;
    Ok(raw.to_owned())
}

async fn endpoint_of(s: &AppState, id: &WebhookId) -> Result<Endpoint> {
    s.stores.webhooks.endpoint(id).await?.ok_or_else(|| Error::not_found("webhook", id.as_str()))
}

/// The audit entry of an admin's change to endpoint `e`.
fn entry(e: &Endpoint, action: AuditAction, detail: AuditDetail, by: &Principal, at: DateTime<Utc>) -> AuditEntry {
    admin_change(new_audit_id(), &e.project_id, action, e.id.as_str(), detail, by, at)
}

/// Subscribes an endpoint to a project's notifications, audited as `by`;
/// answers its secret.
pub async fn create(s: &AppState, project: &ProjectId, new: NewEndpoint, by: &Principal) -> Result<WithSecret> {
    let url = url(s, &new.url)?;
    if s.stores.tenants.project(project).await?.is_none() {
        return Err(Error::not_found("project", project.as_str()));
    }
    if s.stores.webhooks.endpoints(project).await?.len() >= MAX_ENDPOINTS {
        return Err(Error::invalid("url", format!("a project has at most {MAX_ENDPOINTS} webhook endpoints")));
    }
    let now = now_micros(s.clock.as_ref());
    let endpoint = Endpoint {
        id: new_webhook_id(),
        project_id: project.clone(),
        url,
        event_types: new.event_types,
        description: new.description,
        enabled: new.enabled,
        disabled_reason: None,
        secret: new_secret(),
        previous_secret: None,
        failing_since: None,
        created_at: now,
        updated_at: now,
    };
    let audit = entry(
        &endpoint,
        AuditAction::CreateWebhook,
        AuditDetail::WebhookChange { before: None, after: Some(EndpointView::from(&endpoint)) },
        by,
        now,
    );
    s.stores.webhooks.create_endpoint(&endpoint, &[audit]).await?;
    Ok(WithSecret { endpoint })
}

/// A project's endpoints (404 if there is no such project).
pub async fn list(s: &AppState, project: &ProjectId) -> Result<Vec<Endpoint>> {
    if s.stores.tenants.project(project).await?.is_none() {
        return Err(Error::not_found("project", project.as_str()));
    }
    Ok(s.stores.webhooks.endpoints(project).await?)
}

pub async fn get(s: &AppState, id: &WebhookId) -> Result<Endpoint> {
    endpoint_of(s, id).await
}

/// Changes an endpoint, audited as `by`. Enabling one that delivery
/// disabled clears why, and its pending deliveries go out again.
pub async fn patch(s: &AppState, id: &WebhookId, patch: EndpointPatch, by: &Principal) -> Result<Endpoint> {
    let mut e = endpoint_of(s, id).await?;
    let before = EndpointView::from(&e);
    if let Some(raw) = &patch.url {
        e.url = url(s, raw)?;
    }
    if let Some(t) = patch.event_types {
        e.event_types = t;
    }
    if let Some(d) = patch.description {
        e.description = d;
    }
    if let Some(enabled) = patch.enabled {
        if enabled && !e.enabled {
            e.disabled_reason = None;
            e.failing_since = None;
        }
        e.enabled = enabled;
    }
    e.updated_at = now_micros(s.clock.as_ref());
    let after = EndpointView::from(&e);
    let audit = entry(
        &e,
        AuditAction::UpdateWebhook,
        AuditDetail::WebhookChange { before: Some(before), after: Some(after) },
        by,
        e.updated_at,
    );
    if !s.stores.webhooks.update_endpoint(&e, &[audit]).await? {
        return Err(Error::not_found("webhook", id.as_str()));
    }
    Ok(e)
}

/// Deletes an endpoint and its deliveries, audited as `by`.
pub async fn delete(s: &AppState, id: &WebhookId, by: &Principal) -> Result<()> {
    let e = endpoint_of(s, id).await?;
    let audit = entry(
        &e,
        AuditAction::DeleteWebhook,
        AuditDetail::WebhookChange { before: Some(EndpointView::from(&e)), after: None },
        by,
        now_micros(s.clock.as_ref()),
    );
    if !s.stores.webhooks.delete_endpoint(id, &[audit]).await? {
        return Err(Error::not_found("webhook", id.as_str()));
    }
    Ok(())
}

/// A new secret, audited as `by`; the old one keeps signing beside it for 24 h.
pub async fn rotate_secret(s: &AppState, id: &WebhookId, by: &Principal) -> Result<WithSecret> {
    let mut e = endpoint_of(s, id).await?;
    let now = now_micros(s.clock.as_ref());
    let old = std::mem::replace(&mut e.secret, new_secret());
    let previous_valid_until = now + ROTATION_OVERLAP;
    e.previous_secret = Some((old, previous_valid_until));
    e.updated_at = now;
    let audit = entry(
        &e,
        AuditAction::RotateWebhookSecret,
        AuditDetail::WebhookSecretRotated { previous_valid_until },
        by,
        now,
    );
    if !s.stores.webhooks.update_endpoint(&e, &[audit]).await? {
        return Err(Error::not_found("webhook", id.as_str()));
    }
    Ok(WithSecret { endpoint: e })
}

/// A page of an endpoint's delivery log, each message with its attempts.
pub async fn deliveries(s: &AppState, id: &WebhookId, q: &DeliveriesQuery) -> Result<Page<DeliveryLog>> {
    endpoint_of(s, id).await?;
    let mut items = s.stores.webhooks.deliveries(id, q.after.as_ref(), q.limit + 1).await?;
    let next = if items.len() > q.limit {
        items.truncate(q.limit);
        items.last().map(|l| l.message.id.to_string())
    } else {
        None
    };
    Ok(Page { items, next })
}

/// A page of a project's quota notifications — its breaches
/// (`quota.exceeded`) and near breaches (`quota.nearly_used`), as the
/// notifier enqueued them from the fold — oldest first, whether or not an
/// endpoint took them (404 if there is no such project).
pub async fn breaches(
    s: &AppState,
    project: &ProjectId,
    after: Option<&MessageId>,
    limit: usize,
) -> Result<Page<Notification>> {
    if s.stores.tenants.project(project).await?.is_none() {
        return Err(Error::not_found("project", project.as_str()));
    }
    let mut items = s.stores.webhooks.quota_notifications(project, after, limit + 1).await?;
    let next = if items.len() > limit {
        items.truncate(limit);
        items.last().map(|n| n.id.to_string())
    } else {
        None
    };
    Ok(Page { items, next })
}

/// Sends a message to an endpoint again (also one that succeeded), now,
/// with a fresh schedule.
pub async fn resend(s: &AppState, id: &WebhookId, message: &MessageId) -> Result<()> {
    endpoint_of(s, id).await?;
    if !s.stores.webhooks.resend(id, message, now_micros(s.clock.as_ref())).await? {
        return Err(Error::not_found("message", message.as_str()));
    }
    Ok(())
}

/// Resends every message of `[since, until)` that finally failed to reach
/// the endpoint; how many.
pub async fn recover(s: &AppState, id: &WebhookId, since: DateTime<Utc>, until: Option<DateTime<Utc>>) -> Result<u64> {
    let now = now_micros(s.clock.as_ref());
    let until = until.unwrap_or(now);
    if until <= since {
        return Err(Error::invalid("until", "must be after since"));
    }
    endpoint_of(s, id).await?;
    Ok(s.stores.webhooks.recover(id, since, until, now).await?)
}

/// Fires a `webhook.test` message at one endpoint; its id.
pub async fn test(s: &AppState, id: &WebhookId) -> Result<MessageId> {
    let e = endpoint_of(s, id).await?;
    let message = Notification::test(new_message_id(), &e, now_micros(s.clock.as_ref()));
    s.stores.webhooks.enqueue(&message, Some(&e.id)).await?;
    Ok(message.id)
}
