//! The error body, `{"error":{"code","message","meta"}}`, as it goes over
//! the wire and as `/openapi.json` describes it. Which code, status and
//! meta an error gets is decided in [`crate::error`].

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use super::prices::PriceKeyView;
use super::quotas::LimitView;

/// Every error answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"error": {"code": "INVALID_REQUEST", "message": "events[3].rows: must be a whole number ≥ 0", "meta": {"field": "events[3].rows"}}}))]
pub struct ErrorBody {
    pub error: ErrorDetail,
    /// A refused check that asked to be explained: every limit it evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<crate::dto::check::ExplainedView>>,
}

/// What went wrong.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// `INVALID_REQUEST`, `UNAUTHENTICATED`, `NOT_FOUND`, `QUOTA_EXCEEDED`,
    /// `QUOTA_STORAGE_EXCEEDED`, `QUOTA_UNENFORCEABLE`, `TOO_MANY_CONCURRENT`, `QUOTA_CONFLICT`,
    /// `CONFLICT`, `LOG_UNAVAILABLE`, `VIEW_UNAVAILABLE`, `UNAVAILABLE` or `INTERNAL`.
    #[schema(example = "QUOTA_EXCEEDED")]
    pub code: String,
    /// For people; the code and meta are for programs.
    pub message: String,
    pub meta: ErrorMeta,
}

/// Details of the error, by kind: the field of an `INVALID_REQUEST` (and of
/// an `UNAUTHENTICATED` check), the quota of a refusal, or nothing. (The
/// refusals are boxed so that every `Result` carrying an error stays small.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ErrorMeta {
    Field(FieldMeta),
    Exceeded(Box<ExceededMeta>),
    Storage(Box<StorageMeta>),
    Unenforceable(Box<UnenforceableMeta>),
    Concurrency(Box<ConcurrencyMeta>),
    Heavy(Box<HeavyMeta>),
    None(NoMeta),
}

/// Nothing more to say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NoMeta {}

/// The offending field: its path in the body (`events[3].rows`), or the
/// query parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FieldMeta {
    #[schema(example = "quotas[1].window")]
    pub field: String,
}

/// `QUOTA_EXCEEDED` (429, with `Retry-After`): the quota that refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExceededMeta {
    pub quota_id: String,
    pub metric: String,
    pub limit: LimitView,
    pub window: String,
    /// When the window resets.
    pub resets_at: Option<DateTime<Utc>>,
}

/// `QUOTA_STORAGE_EXCEEDED` (409): waiting is no remedy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StorageMeta {
    pub quota_id: String,
    pub metric: String,
    pub limit: LimitView,
    /// The project's stored footprint before the write.
    pub current_bytes: u64,
}

/// `QUOTA_UNENFORCEABLE` (409): a cost quota over a window that metered AI
/// usage but priced none of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnenforceableMeta {
    pub quota_id: String,
    pub metric: String,
    pub limit: LimitView,
    pub window: String,
    /// Up to 10 (provider, model, component) rows that had no price.
    pub unpriced_rows: Vec<PriceKeyView>,
}

/// `too-many-heavy-requests` (429, `Retry-After: 1`): a heavy endpoint's
/// concurrency cap (see [`crate::heavy`]) is full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"endpoint": "audit", "limit": 2, "whose": "caller"}))]
pub struct HeavyMeta {
    /// The endpoint: `audit`, `usage`, `deliveries` or `exports`.
    pub endpoint: String,
    /// The cap that was full: requests at once.
    pub limit: u32,
    /// `caller` (this caller's cap on the endpoint), `project` (an
    /// export: one per project at a time) or `installation` (all permits
    /// together).
    pub whose: String,
}

/// `TOO_MANY_CONCURRENT` (429, `Retry-After: 1`): a permit pool is full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"limit": 5, "whose": "api_key", "id": "key_0197a3c3"}))]
pub struct ConcurrencyMeta {
    /// The cap reached: permits held at once.
    pub limit: u32,
    /// Whose cap it is: `api_key` (the key's own `max_concurrent`), `role`
    /// (its role's, or a signed-in user's role's) or `installation` (all
    /// permits together).
    #[schema(example = "api_key")]
    pub whose: String,
    /// The key's or role's id; `null` for the installation's.
    pub id: Option<String>,
}
