//! The audit log as the admin API reads it: a project's entries, or the
//! installation-wide ones (writes of the price book, which belongs to no
//! project), in time order, paged by cursor (`after`), or by page number
//! while the page stays within the first [`MAX_PAGED_ROWS`] rows (deeper
//! offsets cost the store a scan each; a cursor does not).
//!
//! It reads what the audit folder folded from the audit topic (see
//! `meter::audit`): an entry made by a change appears here about one poll
//! of the folder later, and every entry survives a rebuild of the store.

use meter::{AuditEntry, AuditId, ProjectId};

use super::{Error, Page, Result};
use crate::state::AppState;

/// The most rows a page number may reach; past it, page by cursor.
pub const MAX_PAGED_ROWS: u64 = 10_000;
/// The largest page.
pub const MAX_PAGE: u64 = 1000;

/// Whose entries to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuditScope {
    /// One project's.
    Project(ProjectId),
    /// The installation's: entries of no project (writes of prices).
    Installation,
}

impl AuditScope {
    /// The project, if the scope is one.
    pub fn project(&self) -> Option<&ProjectId> {
        match self {
            AuditScope::Project(p) => Some(p),
            AuditScope::Installation => None,
        }
    }
}

/// A page of a project's audit log, or of the installation's, its bounds
/// checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditQuery {
    pub scope: AuditScope,
    pub after: Option<AuditId>,
    /// Entries per page, 1 to [`MAX_PAGE`].
    pub limit: u64,
    /// Entries skipped after the cursor (a page number's offset), with
    /// `skip + limit` ≤ [`MAX_PAGED_ROWS`].
    pub skip: u64,
}

/// A page of a project's audit log (404 if there is no such project), or of
/// the installation's.
pub async fn page(s: &AppState, q: &AuditQuery) -> Result<Page<AuditEntry>> {
    if let AuditScope::Project(project) = &q.scope
        && s.stores.tenants.project(project).await?.is_none()
    {
        return Err(Error::not_found("project", project.as_str()));
    }
    // One more than a page, to know whether another follows.
    let want = usize::try_from(q.skip + q.limit + 1).unwrap_or(usize::MAX);
    let rows = s.stores.audit.audit(q.scope.project(), q.after.as_ref(), want).await?;
    let more = rows.len() == want;
    let skip = usize::try_from(q.skip).unwrap_or(usize::MAX);
    let limit = usize::try_from(q.limit).unwrap_or(usize::MAX);
    let items: Vec<AuditEntry> = rows.into_iter().skip(skip).take(limit).collect();
    let next = if more { items.last().map(|e| e.id.to_string()) } else { None };
    Ok(Page { items, next })
}
