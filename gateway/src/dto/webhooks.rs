//! Webhook bodies: endpoints (`/v1/projects/{id}/webhooks`,
//! `/v1/webhooks/{id}`), secret rotation, the delivery log, resend,
//! recover and the test fire.

use chrono::{DateTime, Utc};
use meter::{Attempt, DeliveryLog, Endpoint, EventTypes, FieldError, MessageId};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{Flag, Text, nullable, required, timestamp};
use crate::service::Page;
use crate::service::webhooks::{DeliveriesQuery, EndpointPatch, MAX_DELIVERIES_PAGE, NewEndpoint, WithSecret};

/// Most characters of a description.
const MAX_DESCRIPTION: usize = 1000;

fn event_types(v: Vec<Text>) -> Result<EventTypes, FieldError> {
    EventTypes::parse(v.into_iter().map(|Text(t)| t).collect(), "event_types")
}

fn description(d: Option<String>) -> Result<Option<String>, FieldError> {
    match d {
        Some(d) if d.chars().count() > MAX_DESCRIPTION => {
            Err(FieldError::new("description", format!("must be at most {MAX_DESCRIPTION} characters")))
        }
        d => Ok(d),
    }
}

/// `POST /v1/projects/{id}/webhooks`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"url": "https://hooks.example.com/tollgate", "event_types": ["quota.*"],
                          "description": "alerts to the on-call channel"}))]
pub struct EndpointBody {
    /// An http or https URL without credentials; private, loopback and
    /// link-local addresses are refused unless the server allows them.
    #[schema(value_type = String)]
    pub url: Option<Text>,
    /// Exact event types (`quota.exceeded`, `quota.nearly_used`,
    /// `export.completed`, `export.failed`, `webhook.test`), `quota.*`,
    /// `export.*` or `*`.
    #[schema(value_type = Vec<String>)]
    pub event_types: Option<Vec<Text>>,
    #[schema(value_type = Option<String>)]
    pub description: Option<Text>,
    /// Default true.
    #[schema(value_type = Option<bool>)]
    pub enabled: Option<Flag>,
}

impl TryFrom<EndpointBody> for NewEndpoint {
    type Error = FieldError;
    fn try_from(b: EndpointBody) -> Result<NewEndpoint, FieldError> {
        Ok(NewEndpoint {
            url: required(b.url, "url")?.0,
            event_types: event_types(required(b.event_types, "event_types")?)?,
            description: description(b.description.map(|Text(d)| d))?,
            enabled: b.enabled.is_none_or(|Flag(f)| f),
        })
    }
}

/// `PATCH /v1/webhooks/{id}`: the fields to change.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"enabled": true, "event_types": ["quota.exceeded"]}))]
pub struct EndpointPatchBody {
    #[schema(value_type = Option<String>)]
    pub url: Option<Text>,
    #[schema(value_type = Option<Vec<String>>)]
    pub event_types: Option<Vec<Text>>,
    /// `null` clears it.
    #[serde(default, deserialize_with = "nullable")]
    #[schema(value_type = Option<String>)]
    pub description: Option<Option<String>>,
    /// Enabling an endpoint that delivery disabled sends its pending deliveries again.
    #[schema(value_type = Option<bool>)]
    pub enabled: Option<Flag>,
}

impl TryFrom<EndpointPatchBody> for EndpointPatch {
    type Error = FieldError;
    fn try_from(b: EndpointPatchBody) -> Result<EndpointPatch, FieldError> {
        Ok(EndpointPatch {
            url: b.url.map(|Text(u)| u),
            event_types: b.event_types.map(event_types).transpose()?,
            description: b.description.map(description).transpose()?,
            enabled: b.enabled.map(|Flag(f)| f),
        })
    }
}

/// A webhook endpoint (its secret is shown only when created or rotated).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"id": "wh_0197a3c7", "project_id": "proj_0197a3c2", "url": "https://hooks.example.com/tollgate",
    "event_types": ["quota.*"], "description": null, "enabled": true, "disabled_reason": null,
    "created_at": "2026-07-07T12:00:00Z", "updated_at": "2026-07-07T12:00:00Z"}))]
pub struct EndpointView {
    pub id: String,
    pub project_id: String,
    pub url: String,
    pub event_types: Vec<String>,
    pub description: Option<String>,
    pub enabled: bool,
    /// Why delivery disabled it (`410 Gone`, five days failing), if it did.
    pub disabled_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl From<&Endpoint> for EndpointView {
    fn from(e: &Endpoint) -> Self {
        EndpointView {
            id: e.id.to_string(),
            project_id: e.project_id.to_string(),
            url: e.url.clone(),
            event_types: e.event_types.as_slice().to_vec(),
            description: e.description.clone(),
            enabled: e.enabled,
            disabled_reason: e.disabled_reason.clone(),
            created_at: e.created_at,
            updated_at: e.updated_at,
        }
    }
}

/// An endpoint with its signing secret, shown this once.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(example = json!({"id": "wh_0197a3c7", "project_id": "proj_0197a3c2", "url": "https://hooks.example.com/tollgate",
    "event_types": ["quota.*"], "description": null, "enabled": true, "disabled_reason": null,
    "created_at": "2026-07-07T12:00:00Z", "updated_at": "2026-07-07T12:00:00Z",
    "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "previous_secret_expires_at": null}))]
#[serde(deny_unknown_fields)]
pub struct EndpointWithSecretView {
    pub id: String,
    pub project_id: String,
    pub url: String,
    pub event_types: Vec<String>,
    pub description: Option<String>,
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// `whsec_` and base64: the key of every `v1` signature.
    pub secret: String,
    /// After a rotation: until when the previous secret signs too.
    pub previous_secret_expires_at: Option<DateTime<Utc>>,
}

impl From<&WithSecret> for EndpointWithSecretView {
    fn from(w: &WithSecret) -> Self {
        let v = EndpointView::from(&w.endpoint);
        EndpointWithSecretView {
            id: v.id,
            project_id: v.project_id,
            url: v.url,
            event_types: v.event_types,
            description: v.description,
            enabled: v.enabled,
            disabled_reason: v.disabled_reason,
            created_at: v.created_at,
            updated_at: v.updated_at,
            secret: w.endpoint.secret.clone(),
            previous_secret_expires_at: w.endpoint.previous_secret.as_ref().map(|(_, until)| *until),
        }
    }
}

/// A project's endpoints.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"data": [{"id": "wh_0197a3c7", "project_id": "proj_0197a3c2",
    "url": "https://hooks.example.com/tollgate", "event_types": ["quota.*"], "description": null, "enabled": true,
    "disabled_reason": null, "created_at": "2026-07-07T12:00:00Z", "updated_at": "2026-07-07T12:00:00Z"}]}))]
pub struct EndpointList {
    pub data: Vec<EndpointView>,
}

/// `GET /v1/webhooks/{id}/deliveries`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DeliveriesParams {
    /// The `next` of the previous page.
    pub after: Option<String>,
    /// Messages per page, 1 to 100 (default 20).
    #[param(value_type = Option<u64>)]
    pub limit: Option<String>,
}

impl TryFrom<DeliveriesParams> for DeliveriesQuery {
    type Error = FieldError;
    fn try_from(p: DeliveriesParams) -> Result<DeliveriesQuery, FieldError> {
        let limit = match p.limit {
            None => 20,
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_DELIVERIES_PAGE).contains(n))
                .ok_or_else(|| FieldError::new("limit", format!("must be between 1 and {MAX_DELIVERIES_PAGE}")))?,
        };
        let after =
            p.after.map(|a| MessageId::parse(a).map_err(|e| FieldError::new("after", e.to_string()))).transpose()?;
        Ok(DeliveriesQuery { after, limit })
    }
}

/// One attempt of a delivery.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttemptView {
    pub number: u32,
    pub at: DateTime<Utc>,
    /// The response's status; `null` if none came (refused, timed out).
    pub status_code: Option<u16>,
    pub latency_ms: u64,
    /// The first 2 KB of the response body, or what went wrong.
    pub response: String,
}

impl From<&Attempt> for AttemptView {
    fn from(a: &Attempt) -> Self {
        AttemptView {
            number: a.number,
            at: a.at,
            status_code: a.status_code,
            latency_ms: a.latency_ms,
            response: a.response.clone(),
        }
    }
}

/// One message of the delivery log, with its attempts.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliveryView {
    /// The `webhook-id` of every attempt.
    pub message_id: String,
    pub event_type: String,
    /// A `webhook.test` fired by an admin.
    pub test: bool,
    /// `pending`, `succeeded` or `failed`.
    pub status: String,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    /// The body sent: `{"type","timestamp","data"}`.
    #[schema(value_type = Object)]
    pub payload: serde_json::Value,
    pub attempts: Vec<AttemptView>,
}

impl From<&DeliveryLog> for DeliveryView {
    fn from(l: &DeliveryLog) -> Self {
        DeliveryView {
            message_id: l.message.id.to_string(),
            event_type: l.message.event_type.clone(),
            test: l.message.test,
            status: l.status.as_str().to_owned(),
            next_attempt_at: l.next_attempt_at,
            created_at: l.message.created_at,
            payload: serde_json::from_str(&l.message.body).unwrap_or(serde_json::Value::Null),
            attempts: l.attempts.iter().map(AttemptView::from).collect(),
        }
    }
}

/// A page of the delivery log, in time order.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"data": [{"message_id": "msg_0197a3c9", "event_type": "quota.exceeded", "test": false,
    "status": "succeeded", "next_attempt_at": null, "created_at": "2026-07-07T12:00:00Z",
    "payload": {"type": "quota.exceeded", "timestamp": "2026-07-07T12:00:00.000Z", "data": {"quota_id": "quota_0197a3c4"}},
    "attempts": [{"number": 1, "at": "2026-07-07T12:00:00Z", "status_code": 500, "latency_ms": 12, "response": "oops"},
                 {"number": 2, "at": "2026-07-07T12:00:05Z", "status_code": 204, "latency_ms": 9, "response": ""}]}],
    "next": null}))]
pub struct DeliveryPage {
    pub data: Vec<DeliveryView>,
    /// The cursor of the next page (`after`), or `null` on the last.
    pub next: Option<String>,
}

impl From<&Page<DeliveryLog>> for DeliveryPage {
    fn from(p: &Page<DeliveryLog>) -> Self {
        DeliveryPage { data: p.items.iter().map(DeliveryView::from).collect(), next: p.next.clone() }
    }
}

/// `POST /v1/webhooks/{id}/recover`: resend what finally failed of the
/// messages created in `[since, until)`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"since": "2026-07-07T00:00:00Z", "until": "2026-07-08T00:00:00Z"}))]
pub struct RecoverBody {
    #[schema(value_type = DateTime<Utc>)]
    pub since: Option<Text>,
    /// Default: now.
    #[schema(value_type = Option<DateTime<Utc>>)]
    pub until: Option<Text>,
}

/// `[since, until)`; no `until` is until now (the service's clock).
impl TryFrom<RecoverBody> for (DateTime<Utc>, Option<DateTime<Utc>>) {
    type Error = FieldError;
    fn try_from(b: RecoverBody) -> Result<Self, FieldError> {
        let since = timestamp(&required(b.since, "since")?.0, "since")?;
        let until = b.until.map(|Text(t)| timestamp(&t, "until")).transpose()?;
        Ok((since, until))
    }
}

/// How many deliveries were made pending again.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"resent": 3}))]
pub struct RecoverView {
    pub resent: u64,
}

/// A message queued for delivery.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"message_id": "msg_0197a3c9"}))]
pub struct QueuedView {
    pub message_id: String,
}
