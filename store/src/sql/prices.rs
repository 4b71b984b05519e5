//! The price book over SQL, the unpriced rows of each counter and the
//! `quota_unpriced` exceptions. Money is 64-bit integer picodollars
//! ([`Usd`]), never a float.
//!
//! The book is append-only in time: `put_prices` inserts versions recorded
//! at its `at` (a row with the same key and `effective_from` as an earlier
//! one is a new version, never an overwrite), `prices` reads the current
//! book (of each key and `effective_from`, the latest version) and the fold
//! reads every version of the keys it prices, as of each fact's receipt.
//!
//! A write of prices is audited in its own transaction: the book is held
//! still against other writers, the rows of the keys written are read, and
//! `meter::price_change` makes the entry from them (what each row
//! replaced), which goes to the audit outbox with the rows.

use std::collections::{BTreeMap, BTreeSet};

use async_trait::async_trait;
use chrono::{DateTime, SubsecRound, Utc};
use meter::{
    AuditEntry, CounterKey, PortError, PortResult, Price, PriceAudit, PriceBook, PriceKey, PriceStore, PriceVersion,
    ProjectId, QuotaId, UnpricedException, UnpricedRow, Usd, price_change,
};

use super::{Backend, Rec, Rows, SqlStore, Stmt, each, error, to_i64};

pub(super) const PRICE_COLUMNS: &str = "provider, model, component, effective_from, unit_price_picos, recorded_at";
const EXCEPTION_COLUMNS: &str = r#"quota_id, project_id, "limit", window_key, llm_events, unpriced_events, unpriced_rows, occurrence_count, first_seen, last_seen"#;

// A component's rank in meter's `Component` order (input, output, cached),
// which is not the order of its names: `unpriced_rows` reads back in
// `PriceKey` order.
const COMPONENT_RANK: &str = "CASE component WHEN 'input_tokens' THEN 0 WHEN 'output_tokens' THEN 1 \
                              WHEN 'cached_tokens' THEN 2 ELSE 3 END";

pub(super) fn price_key<B: Backend>(r: &Rec<'_, B>) -> PortResult<PriceKey> {
    Ok(PriceKey { provider: r.text("provider")?, model: r.text("model")?, component: r.parse("component")? })
}

/// A row of `prices`: one version of a price.
pub(super) fn price<B: Backend>(r: &Rec<'_, B>) -> PortResult<PriceVersion> {
    Ok(PriceVersion {
        price: Price {
            key: price_key(r)?,
            unit_price_usd: Usd(r.int("unit_price_picos")?),
            effective_from: r.time("effective_from")?,
        },
        recorded_at: r.time("recorded_at")?,
    })
}

/// Inserting unpriced rows of counters in one statement (`None` for no
/// rows); rows already known are skipped.
pub(super) fn insert_unpriced<'a>(rows: impl IntoIterator<Item = (&'a ProjectId, &'a UnpricedRow)>) -> Option<Stmt> {
    let rows: Vec<_> = rows.into_iter().collect();
    if rows.is_empty() {
        return None;
    }
    let batch = Rows::new()
        .text("project_id", rows.iter().map(|(p, _)| p.as_str()))
        .text("dimension", rows.iter().map(|(_, r)| r.counter.key.dimension.encode()))
        .text("window_kind", rows.iter().map(|(_, r)| r.counter.key.window.as_str()))
        .text("window_key", rows.iter().map(|(_, r)| r.counter.key.window_key.as_str()))
        .opt_time("resets_at", rows.iter().map(|(_, r)| r.counter.resets_at))
        .text("provider", rows.iter().map(|(_, r)| r.key.provider.as_str()))
        .text("model", rows.iter().map(|(_, r)| r.key.model.as_str()))
        .text("component", rows.iter().map(|(_, r)| r.key.component.as_str()));
    // `WHERE true` keeps SQLite from reading ON CONFLICT as a join's ON.
    Some(
        Stmt::new(
            "INSERT INTO unpriced_rows \
                 (project_id, dimension, window_kind, window_key, resets_at, provider, model, component) \
             SELECT * FROM {rows} AS t WHERE true ON CONFLICT DO NOTHING",
        )
        .rows(batch),
    )
}

fn exception_row<B: Backend>(r: &Rec<'_, B>) -> PortResult<UnpricedException> {
    Ok(UnpricedException {
        project_id: r.id("project_id")?,
        quota_id: r.id("quota_id")?,
        limit: r.count("limit")?,
        window_key: r.text("window_key")?,
        llm_events: r.count("llm_events")?,
        unpriced_events: r.count("unpriced_events")?,
        unpriced_rows: r.json("unpriced_rows")?,
        occurrence_count: r.count("occurrence_count")?,
        first_seen: r.time("first_seen")?,
        last_seen: r.time("last_seen")?,
    })
}

#[async_trait]
impl<B: Backend> PriceStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "put_prices", prices = prices.len()))]
    async fn put_prices(
        &self,
        prices: &[Price],
        at: DateTime<Utc>,
        audit: Option<&PriceAudit>,
    ) -> PortResult<Option<AuditEntry>> {
        // One row per key and instant, the last one winning as in
        // `PriceBook::insert`: one upsert may not touch a row twice. The
        // instants are keyed as stored, to the microsecond.
        let mut unique: BTreeMap<(&PriceKey, DateTime<Utc>), Usd> = BTreeMap::new();
        for p in prices {
            unique.insert((&p.key, p.effective_from.trunc_subsecs(6)), p.unit_price_usd);
        }
        if unique.is_empty() {
            return Ok(None);
        }
        let recorded_at = at.trunc_subsecs(6);
        let rows = Rows::new()
            .text("provider", unique.keys().map(|(k, _)| k.provider.as_str()))
            .text("model", unique.keys().map(|(k, _)| k.model.as_str()))
            .text("component", unique.keys().map(|(k, _)| k.component.as_str()))
            .time("effective_from", unique.keys().map(|(_, at)| *at))
            .int("unit_price_picos", unique.values().map(|u| u.picos()))
            .time("recorded_at", unique.keys().map(|_| recorded_at));
        // One statement: all the rows or none. A new version of each row;
        // only a second put within the same microsecond replaces one.
        let stmt = Stmt::new(format!(
            "INSERT INTO prices ({PRICE_COLUMNS}) SELECT * FROM {{rows}} AS t WHERE true \
             ON CONFLICT (provider, model, component, effective_from, recorded_at) \
             DO UPDATE SET unit_price_picos = excluded.unit_price_picos"
        ))
        .rows(rows);
        let Some(audit) = audit else { return self.run(stmt).await.map(|_| None) };

        // Dropping `tx` without committing rolls everything back.
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        if let Some(lock) = B::LOCK_PRICE_BOOK {
            B::execute(&mut *tx, Stmt::new(lock)).await?;
        }
        // The book as it stands, of the keys written: what the rows replace.
        let keys: BTreeSet<&PriceKey> = unique.keys().map(|(k, _)| *k).collect();
        let key_rows = Rows::new()
            .text("provider", keys.iter().map(|k| k.provider.as_str()))
            .text("model", keys.iter().map(|k| k.model.as_str()))
            .text("component", keys.iter().map(|k| k.component.as_str()));
        let read = Stmt::new(format!(
            "SELECT {PRICE_COLUMNS} FROM prices WHERE (provider, model, component) IN \
             (SELECT provider, model, component FROM {{rows}} AS t)"
        ))
        .rows(key_rows);
        let before = PriceBook::with_versions(each(&B::fetch(&mut *tx, read).await?, price::<B>)?);
        // As stored: to the microsecond.
        let written: Vec<Price> =
            prices.iter().map(|p| Price { effective_from: p.effective_from.trunc_subsecs(6), ..p.clone() }).collect();
        let entry = price_change(audit.id.clone(), &before, &written, &audit.by, recorded_at);
        B::execute(&mut *tx, stmt).await?;
        if let Some(e) = &entry {
            B::execute(&mut *tx, super::config::insert_audit(e)?).await?;
        }
        tx.commit().await.map_err(error::<B>)?;
        Ok(entry)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "prices"))]
    async fn prices(&self) -> PortResult<Vec<Price>> {
        let rows = self.all(Stmt::new(format!("SELECT {PRICE_COLUMNS} FROM prices"))).await?;
        // The current book, ordered by key (meter's order of components,
        // not their names') then effective_from.
        Ok(PriceBook::with_versions(each(&rows, price::<B>)?).prices().collect())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "record_unpriced", rows = rows.len()))]
    async fn record_unpriced(&self, project: &ProjectId, rows: &[UnpricedRow]) -> PortResult<()> {
        match insert_unpriced(rows.iter().map(|r| (project, r))) {
            Some(stmt) => self.run(stmt).await.map(drop),
            None => Ok(()),
        }
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "unpriced_rows"))]
    async fn unpriced_rows(
        &self,
        project: &ProjectId,
        counter: &CounterKey,
        limit: usize,
    ) -> PortResult<Vec<PriceKey>> {
        let stmt = Stmt::new(format!(
            "SELECT provider, model, component FROM unpriced_rows \
             WHERE project_id = $1 AND dimension = $2 AND window_kind = $3 AND window_key = $4 \
             ORDER BY provider, model, {COMPONENT_RANK} LIMIT $5"
        ))
        .text(project.as_str())
        .text(counter.dimension.encode())
        .text(counter.window.as_str())
        .text(&counter.window_key)
        .int(super::limit(limit));
        each(&self.all(stmt).await?, price_key::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "file_exception"))]
    async fn file_exception(&self, exception: &UnpricedException) -> PortResult<UnpricedException> {
        let e = exception;
        // One upsert, so concurrent filings of one quota each count once.
        // The project is part of the match: a quota id filed under another
        // project is a bug, not a recurrence.
        let stmt = Stmt::new(format!(
            r#"INSERT INTO quota_exceptions AS x ({EXCEPTION_COLUMNS})
               VALUES ($1, $2, $3, $4, $5, $6, $7, 1, $8, $9)
               ON CONFLICT (quota_id) DO UPDATE SET
                   "limit" = excluded."limit",
                   window_key = excluded.window_key,
                   llm_events = excluded.llm_events,
                   unpriced_events = excluded.unpriced_events,
                   unpriced_rows = excluded.unpriced_rows,
                   occurrence_count = x.occurrence_count + 1,
                   last_seen = excluded.last_seen
               WHERE x.project_id = excluded.project_id
               RETURNING {EXCEPTION_COLUMNS}"#
        ))
        .text(e.quota_id.as_str())
        .text(e.project_id.as_str())
        .int(to_i64("limit", e.limit)?)
        .text(&e.window_key)
        .int(to_i64("llm_events", e.llm_events)?)
        .int(to_i64("unpriced_events", e.unpriced_events)?)
        .json(&e.unpriced_rows)?
        .time(e.first_seen)
        .time(e.last_seen);
        match self.opt(stmt).await? {
            Some(row) => exception_row(&Rec::<B>(&row)),
            None => Err(PortError::Permanent(format!(
                "quota {} has an exception filed under another project than {}",
                e.quota_id, e.project_id
            ))),
        }
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "exceptions"))]
    async fn exceptions(
        &self,
        project: &ProjectId,
        after: Option<&QuotaId>,
        limit: usize,
    ) -> PortResult<Vec<UnpricedException>> {
        let stmt = Stmt::new(format!(
            "SELECT {EXCEPTION_COLUMNS} FROM quota_exceptions \
             WHERE project_id = $1 AND (CAST($2 AS TEXT) IS NULL OR quota_id > $2) ORDER BY quota_id LIMIT $3"
        ))
        .text(project.as_str())
        .opt_text(after.map(QuotaId::as_str))
        .int(super::limit(limit));
        each(&self.all(stmt).await?, exception_row::<B>)
    }
}
