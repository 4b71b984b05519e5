//! The price book and the `quota_unpriced` exceptions.
//!
//! Prices are decimal dollars per unit (one token) with up to 12 decimal
//! places, never computed with as floats. A row applies from its
//! `effective_from` on; events are priced by their event time, by the
//! gateway when it settles them into the view and by the projector when it
//! folds them. Writing prices forgets this instance's cached book.
//!
//! A write of prices is audited as whoever made it, in the write's own
//! transaction: one installation-wide entry (`prices:PutPrices`, the book
//! belongs to no project) listing every row with the unit price it
//! replaced, read with `GET /v1/audit?scope=installation`.

use chrono::{DateTime, SubsecRound, Utc};
use meter::{Price, PriceAudit, PriceKey, Principal, ProjectId, QuotaId, UnpricedException, Usd};

use super::{Page, Result, now_micros};
use crate::state::{AppState, new_audit_id};

/// Most rows one write of prices may carry.
pub const MAX_PRICES: usize = 1000;

/// The cursor prefix of an exception (its id is `quota_unpriced:<quota id>`).
pub const EXCEPTION_PREFIX: &str = "quota_unpriced:";

/// A price row to write; without `effective_from` it applies from now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPrice {
    pub key: PriceKey,
    pub unit_price_usd: Usd,
    pub effective_from: Option<DateTime<Utc>>,
}

/// Which rows of the book to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PriceFilter {
    pub provider: Option<String>,
    pub model: Option<String>,
}

/// A page of a project's exceptions, ordered by quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExceptionsQuery {
    pub project_id: ProjectId,
    /// The quota of the last exception of the previous page.
    pub after: Option<QuotaId>,
    pub limit: usize,
}

/// Writes price rows, all or nothing (a row with the same key and
/// `effective_from` is replaced), with their audit entry, as `by`; returns
/// them as written (to the microsecond, as stored).
pub async fn put(s: &AppState, rows: Vec<NewPrice>, by: &Principal) -> Result<Vec<Price>> {
    let now = now_micros(s.clock.as_ref());
    let prices: Vec<Price> = rows
        .into_iter()
        .map(|r| Price {
            key: r.key,
            unit_price_usd: r.unit_price_usd,
            effective_from: r.effective_from.map_or(now, |t| t.trunc_subsecs(6)),
        })
        .collect();
    // Recorded now: events received before this never take these rows.
    let audit = PriceAudit { id: new_audit_id(), by: by.clone() };
    s.stores.prices.put_prices(&prices, now, Some(&audit)).await?;
    s.invalidate_prices();
    Ok(prices)
}

/// The price book, every row with its `effective_from`, filtered.
pub async fn book(s: &AppState, filter: &PriceFilter) -> Result<Vec<Price>> {
    let mut rows = s.stores.prices.prices().await?;
    rows.retain(|p| {
        filter.provider.as_ref().is_none_or(|v| *v == p.key.provider)
            && filter.model.as_ref().is_none_or(|v| *v == p.key.model)
    });
    Ok(rows)
}

/// A page of a project's `quota_unpriced` exceptions, one per cost quota.
pub async fn exceptions(s: &AppState, q: &ExceptionsQuery) -> Result<Page<UnpricedException>> {
    let mut items = s.stores.prices.exceptions(&q.project_id, q.after.as_ref(), q.limit + 1).await?;
    let next = if items.len() > q.limit {
        items.truncate(q.limit);
        items.last().map(|e| format!("{EXCEPTION_PREFIX}{}", e.quota_id))
    } else {
        None
    };
    Ok(Page { items, next })
}
