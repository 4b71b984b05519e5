//! Tenants and their credentials: projects, API keys and the per-key limits
//! (grants) a key or a role can narrow.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::ids::{ApiKeyId, ProjectId, RoleId};

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Project {
    pub id: ProjectId,
    pub name: String,
    /// Immutable after creation: calendar windows already folded depend on it.
    pub timezone: Tz,
    pub created_at: DateTime<Utc>,
}

/// Per-key limits a key or role can narrow (ADR-0011 §1).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_timeout: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u64>,
}

/// An API key; its secret is only ever stored hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: ApiKeyId,
    pub project_id: ProjectId,
    pub name: String,
    /// The first characters of the secret, to recognise it in a list.
    pub prefix: String,
    pub grants: Grants,
    /// The role it takes grants and a quota from, if any.
    pub role_id: Option<RoleId>,
    pub created_at: DateTime<Utc>,
}
