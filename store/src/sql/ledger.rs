//! The ledger over SQL: the fold of a batch, its offsets, the durable
//! totals, and the reports read from them.
//!
//! [`Ledger::fold_batch`] is **one transaction** with a fixed number of
//! statements per batch, never one per event: one or two per partition for
//! the fence, one for the time zones, one for the dedup set (in a savepoint,
//! made again when some of its events were there already), one for the
//! prices its tokens events name (every version: meter prices each fact as
//! of its receipt), one upsert of the sums, one for their unpriced rows, one
//! for their breakdown by model (`model_usage`), four for the storage
//! footprint, one for the batch's dead letters and one for the newest
//! receipt folded; and, for a batch with new facts, one for its projects'
//! quotas, then per quota notification due (rare: a handful per quota and
//! window) its insert into the outbox and fan-out to the endpoints, and per
//! monitor breach its audit entry (see `meter::alert`). A notification thus
//! commits with the fold that caused it, or not at all, and its dedup key
//! makes a redelivered batch, a second gateway's breach or a replay add
//! nothing. `meter::ledger` computes what they write; this module
//! only reads what that needs and persists it. That is what makes the fold
//! exactly-once: a redelivered batch is fenced by its offsets, and a resent
//! event id adds nothing.
//!
//! **Nothing overflows.** Every sum the fold adds saturates at the bounds of
//! a 64-bit integer, in SQL (a `CASE` that compares before it adds, the same
//! on both databases, evaluated branch by branch), so a counter that would
//! pass `i64::MAX` — a project spending more than ~$9.2M in one monthly
//! counter — stays at it rather than failing the batch. The footprint's
//! stored deltas are summed in two halves (the high and low 32 bits of each,
//! exact for 2^31 rows) and joined in Rust, exactly, because SQLite's `sum()`
//! fails on an overflow and PostgreSQL's is `numeric`; meter saturates the
//! footprint only once it is summed, so it is the same whatever batches
//! its facts came in.
//!
//! **Dead letters** are kept in `dead_letters` in the fold's transaction,
//! the one that moves the offsets past them, and published by the projector
//! from there ([`Ledger::claim_dead_letters`] and the two after it), so a
//! record is never skipped and a letter is never lost between the DLQ and
//! the offsets.
//!
//! The footprint is not a sum: the fold keeps every storage fact
//! (`storage_facts`), reads what the project already holds (its newest
//! snapshot, the deltas after it and after the batch's newest snapshot,
//! summed, and their count: one row per project whatever their number) and
//! sets the footprint meter merges from it and the facts it kept, so facts
//! may arrive in any order. The footprint rows are locked (created if need
//! be), in project order, before that read: two transactions folding
//! storage facts of one project then go one after the other, the second
//! reading the first's facts (each statement of a PostgreSQL READ COMMITTED
//! transaction reads what committed before it; SQLite's write lock
//! serialises folds anyway).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::LazyLock;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use meter::correction::Delta;
use meter::{
    BatchFold, Counted, Counter, CounterKey, DeadLetter, Dimension, DlqMark, EventId, Field, FoldBatch, FoldReport,
    Ledger, ModelUsageChange, ModelUsageRow, PendingDeadLetter, Population, PortError, PortResult, Posting, PriceBook,
    ProjectId, ReportStore, StoredFootprint, Target, Totals, Usd, WindowKind,
};

use super::prices::{PRICE_COLUMNS, insert_unpriced, price, price_key};
use super::{Backend, Rec, Rows, SqlStore, Stmt, corrupt, each, error, limit};

/// The `usage_aggregates` column of each field of [`Totals`] (the match is
/// exhaustive, so a new field does not compile until it has a column).
fn column(f: Field) -> &'static str {
    match f {
        Field::Requests => "requests",
        Field::Calls => "calls",
        Field::Rows => "rows",
        Field::Tokens => "tokens",
        Field::CostLlmTokens => "cost_llm_tokens",
        Field::CostComputeExecution => "cost_compute_execution",
        Field::CostApiRequest => "cost_api_request",
        Field::CostStorage => "cost_storage",
        Field::LlmEvents => "llm_events",
        Field::LlmPriced => "llm_priced",
        Field::LlmUnpriced => "llm_unpriced",
        Field::StorageEvents => "storage_events",
        Field::Storage => "storage",
    }
}

/// A counter's columns, then every field of [`Totals`] in `Field::ALL`
/// order, quoted (`"rows"` is a keyword).
pub(crate) static AGGREGATE_COLUMNS: LazyLock<String> = LazyLock::new(|| {
    let fields = Field::ALL.map(|f| format!("\"{}\"", column(f)));
    format!("project_id, dimension, window_kind, window_key, resets_at, {}", fields.join(", "))
});

pub(crate) const MODEL_USAGE_COLUMNS: &str = "provider, model, component, meter_type, embedding, priced_quantity, \
                                   unpriced_quantity, cost_picos";

pub(crate) fn totals<B: Backend>(r: &Rec<'_, B>) -> PortResult<Totals> {
    let mut t = Totals::default();
    for f in Field::ALL {
        let v = r.int(column(f))?;
        // Every field is a sum but the footprint, which deltas before any
        // snapshot can take below zero.
        if v < 0 && f != Field::Storage {
            return Err(corrupt(column(f), &v.to_string()));
        }
        t.set(f, v);
    }
    Ok(t)
}

pub(crate) fn counter_key<B: Backend>(r: &Rec<'_, B>) -> PortResult<CounterKey> {
    let dimension = r.text("dimension")?;
    Ok(CounterKey {
        dimension: Dimension::decode(&dimension).ok_or_else(|| corrupt("dimension", &dimension))?,
        window: r.parse("window_kind")?,
        window_key: r.text("window_key")?,
    })
}

fn counter<B: Backend>(r: &Rec<'_, B>) -> PortResult<(Counter, Totals)> {
    Ok((Counter { key: counter_key(r)?, resets_at: r.opt_time("resets_at")? }, totals(r)?))
}

/// A row of `usage_aggregates` with its project, as a fold reports it.
fn aggregate<B: Backend>(r: &Rec<'_, B>) -> PortResult<(ProjectId, Counter, Totals)> {
    let (c, t) = counter(r)?;
    Ok((r.id("project_id")?, c, t))
}

pub(crate) fn model_usage_row<B: Backend>(r: &Rec<'_, B>) -> PortResult<ModelUsageRow> {
    Ok(ModelUsageRow {
        key: price_key(r)?,
        meter: r.parse("meter_type")?,
        embedding: r.get("embedding")?,
        priced_quantity: r.count("priced_quantity")?,
        unpriced_quantity: r.count("unpriced_quantity")?,
        cost: Usd(i64::try_from(r.count("cost_picos")?).map_err(|_| corrupt("cost_picos", "out of range"))?),
    })
}

/// (1) The fence: each partition must still be where the batch began.
async fn fence<B: Backend>(c: &mut B::Connection, batch: &FoldBatch) -> PortResult<()> {
    fence_offsets::<B>(c, &batch.consumer, &batch.topic, &batch.offsets).await
}

/// Moves a consumer's offsets on `topic` from where each move says the
/// partition stands to where it ends, in the caller's transaction: a
/// partition no longer at its `from` (another consumer moved it) is
/// [`PortError::Fenced`]. Shared by the fold and the audit folder.
pub(super) async fn fence_offsets<B: Backend>(
    c: &mut B::Connection,
    consumer: &str,
    topic: &str,
    offsets: &[meter::OffsetMove],
) -> PortResult<()> {
    for m in offsets {
        if m.to < m.from {
            return Err(PortError::Permanent(format!(
                "offsets of {}[{}] would move backwards from {} to {}",
                topic, m.partition, m.from, m.to
            )));
        }
        let moved = Stmt::new(
            r#"UPDATE consumer_offsets SET next_offset = $5
               WHERE consumer = $1 AND topic = $2 AND "partition" = $3 AND next_offset = $4"#,
        )
        .text(consumer)
        .text(topic)
        .int(m.partition.into())
        .int(m.from)
        .int(m.to);
        if B::execute(c, moved).await? == 1 {
            continue;
        }
        // No row at `from`: a fresh start may create it; anything else
        // means another consumer moved (or created) it first.
        let create = Stmt::new(
            r#"INSERT INTO consumer_offsets (consumer, topic, "partition", next_offset)
               VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING"#,
        )
        .text(consumer)
        .text(topic)
        .int(m.partition.into())
        .int(m.to);
        if m.from != 0 || B::execute(c, create).await? != 1 {
            return Err(PortError::Fenced(format!(
                "consumer {} on {}[{}] is no longer at offset {}",
                consumer, topic, m.partition, m.from
            )));
        }
    }
    Ok(())
}

/// (2) The time zones of the batch's projects.
async fn zones<B: Backend>(c: &mut B::Connection, plan: &BatchFold<'_>) -> PortResult<HashMap<ProjectId, Tz>> {
    let projects = plan.projects();
    if projects.is_empty() {
        return Ok(HashMap::new());
    }
    let stmt = Stmt::new("SELECT id, timezone FROM projects WHERE id IN (SELECT id FROM {rows} AS t)")
        .rows(Rows::new().text("id", projects.into_iter().map(ProjectId::as_str)));
    let rows = B::fetch(c, stmt).await?;
    Ok(each(&rows, |r: &Rec<'_, B>| Ok((r.id("id")?, r.parse("timezone")?)))?.into_iter().collect())
}

/// (3) The dedup set: the candidates' ids it did not know yet, which it now
/// does. When it takes as many rows as there are candidates (they are
/// distinct), they were all new; else it is undone to its savepoint and
/// made again with RETURNING, which reports only the rows inserted.
///
/// Each id is kept with what its event counts ([`Counted`]: a call or
/// tokens event, which a correction may amend or void; `''` for the rest).
async fn dedup<B: Backend>(
    c: &mut B::Connection,
    plan: &BatchFold<'_>,
    zones: &HashMap<ProjectId, Tz>,
) -> PortResult<HashSet<(ProjectId, EventId)>> {
    let candidates = plan.candidates();
    if candidates.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = || {
        let counted = candidates.iter().map(|f| {
            let tz = zones.get(&f.project_id).copied().unwrap_or(Tz::UTC);
            Counted::encode(Counted::of(f, tz).as_ref())
        });
        Rows::new()
            .text("project_id", candidates.iter().map(|f| f.project_id.as_str()))
            .text("event_id", candidates.iter().map(|f| f.id.as_str()))
            .time("occurred_at", candidates.iter().map(|f| f.occurred_at))
            .text("counted", counted)
    };
    // `WHERE true` keeps SQLite from reading ON CONFLICT as a join's ON.
    const INSERT: &str = "INSERT INTO processed_events (project_id, event_id, occurred_at, counted) \
                          SELECT * FROM {rows} AS t WHERE true ON CONFLICT DO NOTHING";
    // Nearly always every candidate is new, and the count says so without
    // a row back per event (SQLite's driver hands each row over on its own,
    // from its thread to this one). On PostgreSQL, an insert that met
    // another transaction's row for the same id waits for it and skips it,
    // so the count falls short and the RETURNING form sorts it out.
    B::execute(c, Stmt::new("SAVEPOINT dedup")).await?;
    let inserted = B::execute(c, Stmt::new(INSERT).rows(rows())).await?;
    if usize::try_from(inserted).is_ok_and(|n| n == candidates.len()) {
        B::execute(c, Stmt::new("RELEASE SAVEPOINT dedup")).await?;
        return Ok(candidates.iter().map(|f| (f.project_id.clone(), f.id.clone())).collect());
    }
    B::execute(c, Stmt::new("ROLLBACK TO SAVEPOINT dedup")).await?;
    let stmt = Stmt::new(format!("{INSERT} RETURNING project_id, event_id")).rows(rows());
    let new = each(&B::fetch(c, stmt).await?, ids::<B>)?.into_iter().collect();
    B::execute(c, Stmt::new("RELEASE SAVEPOINT dedup")).await?;
    Ok(new)
}

/// (3b) What the dedup set holds of the events the batch's corrections
/// name (none: no statement).
async fn targets<B: Backend>(
    c: &mut B::Connection,
    plan: &BatchFold<'_>,
) -> PortResult<HashMap<(ProjectId, EventId), Target>> {
    let wanted = plan.correction_targets();
    if wanted.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = Rows::new()
        .text("project_id", wanted.iter().map(|(p, _)| p.as_str()))
        .text("event_id", wanted.iter().map(|(_, e)| e.as_str()));
    let stmt = Stmt::new(
        "SELECT project_id, event_id, counted FROM processed_events \
         WHERE (project_id, event_id) IN (SELECT project_id, event_id FROM {rows} AS t)",
    )
    .rows(rows);
    let found = each(&B::fetch(c, stmt).await?, |r: &Rec<'_, B>| {
        let counted = r.text("counted")?;
        Ok((ids::<B>(r)?, Target::decode(&counted).map_err(|e| corrupt("counted", &e))?))
    })?;
    Ok(found.into_iter().collect())
}

/// What the dedup set holds of one event, if it holds it (for the gateway's
/// checks of a correction at ingest).
pub(crate) async fn target_of<B: Backend>(
    store: &SqlStore<B>,
    project: &ProjectId,
    event: &EventId,
) -> PortResult<Option<Target>> {
    let stmt = Stmt::new("SELECT counted FROM processed_events WHERE project_id = $1 AND event_id = $2")
        .text(project.as_str())
        .text(event.as_str());
    let Some(row) = store.opt(stmt).await? else { return Ok(None) };
    let counted = Rec::<B>(&row).text("counted")?;
    Target::decode(&counted).map(Some).map_err(|e| corrupt("counted", &e))
}

/// (8b) The corrected originals as they count now, and the refused
/// corrections forgotten (so they can be sent again once their original
/// is folded).
fn recount(posting: &Posting<'_>) -> Vec<Stmt> {
    let mut out = Vec::new();
    let r = &posting.recounts;
    if !r.is_empty() {
        let rows = Rows::new()
            .text("project_id", r.iter().map(|(p, _, _)| p.as_str()))
            .text("event_id", r.iter().map(|(_, e, _)| e.as_str()))
            .text("counted", r.iter().map(|(_, _, c)| Counted::encode(Some(c))));
        out.push(
            Stmt::new(
                "UPDATE processed_events AS d SET counted = t.counted FROM {rows} AS t \
                 WHERE d.project_id = t.project_id AND d.event_id = t.event_id",
            )
            .rows(rows),
        );
    }
    let refused: Vec<_> = posting.refused().map(|(f, _)| f).collect();
    if !refused.is_empty() {
        let rows = Rows::new()
            .text("project_id", refused.iter().map(|f| f.project_id.as_str()))
            .text("event_id", refused.iter().map(|f| f.id.as_str()));
        out.push(
            Stmt::new(
                "DELETE FROM processed_events WHERE (project_id, event_id) IN \
                 (SELECT project_id, event_id FROM {rows} AS t)",
            )
            .rows(rows),
        );
    }
    out
}

fn ids<B: Backend>(r: &Rec<'_, B>) -> PortResult<(ProjectId, EventId)> {
    Ok((r.id("project_id")?, r.id("event_id")?))
}

/// (4) The part of the price book that can price the batch: the rows of
/// the (provider, model) pairs its token entries name, as this transaction
/// reads them. Empty (no statement) when no fact is a tokens event.
async fn price_book<B: Backend>(
    c: &mut B::Connection,
    plan: &BatchFold<'_>,
    targets: &HashMap<(ProjectId, EventId), Target>,
) -> PortResult<PriceBook> {
    let keys = plan.price_keys_with(targets);
    if keys.is_empty() {
        return Ok(PriceBook::default());
    }
    let rows = Rows::new()
        .text("provider", keys.iter().map(|k| k.0.as_str()))
        .text("model", keys.iter().map(|k| k.1.as_str()));
    let stmt = Stmt::new(format!(
        "SELECT {PRICE_COLUMNS} FROM prices WHERE (provider, model) IN (SELECT provider, model FROM {{rows}} AS t)"
    ))
    .rows(rows);
    Ok(PriceBook::with_versions(each(&B::fetch(c, stmt).await?, price::<B>)?))
}

/// `old + add` in SQL, saturating at the bounds of a 64-bit integer. A `CASE`
/// is evaluated branch by branch on both databases, so the addition runs only
/// where it cannot overflow (PostgreSQL would fail the statement; SQLite
/// would make a REAL of it, which a STRICT integer column refuses).
fn saturating_add(old: &str, add: &str) -> String {
    format!(
        "CASE WHEN {add} > 0 THEN CASE WHEN {old} > 9223372036854775807 - {add} THEN 9223372036854775807 \
         ELSE {old} + {add} END \
         WHEN {add} < 0 THEN CASE WHEN {old} < (-9223372036854775807 - 1) - {add} THEN (-9223372036854775807 - 1) \
         ELSE {old} + {add} END \
         ELSE {old} END"
    )
}

/// `old + add` for a sum, which is never negative: saturating at
/// `i64::MAX`, floored at zero (a correction takes back at most what a
/// counter holds). `add` is never `i64::MIN` (meter keeps deltas above it).
fn floored_add(old: &str, add: &str) -> String {
    format!(
        "CASE WHEN {add} < 0 THEN CASE WHEN {old} < -({add}) THEN 0 ELSE {old} + {add} END ELSE {} END",
        saturating_add(old, add)
    )
}

/// A quantity as a 64-bit integer column, saturating.
fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Whether a change takes something back (a correction's): it then goes
/// through an UPDATE of the row the original was folded into, never an insert.
fn takes_back(d: &[i64]) -> bool {
    d.iter().any(|v| *v < 0)
}

/// (5b) The changes that take something back, in one UPDATE (floored at
/// zero), which returns the new absolute totals of every counter it touched.
fn adjust_sums(changes: &[&(ProjectId, Counter, Delta)]) -> Stmt {
    // The batch's columns are named apart from the table's, so that
    // RETURNING names the table's unqualified (SQLite allows nothing else).
    let mut rows = Rows::new()
        .text("d_project", changes.iter().map(|(p, _, _)| p.as_str()))
        .text("d_dimension", changes.iter().map(|(_, c, _)| c.key.dimension.encode()))
        .text("d_window_kind", changes.iter().map(|(_, c, _)| c.key.window.as_str()))
        .text("d_window_key", changes.iter().map(|(_, c, _)| c.key.window_key.as_str()));
    for f in Field::ALL {
        rows = rows.int(delta_column(f), changes.iter().map(|(_, _, d)| d[f.index()]));
    }
    static SQL: LazyLock<String> = LazyLock::new(|| {
        let set = Field::ALL.into_iter().filter(|f| *f != Field::Storage).map(|f| {
            let c = column(f);
            format!("\"{c}\" = {}", floored_add(&format!("a.\"{c}\""), &format!("t.{}", delta_column(f))))
        });
        format!(
            "UPDATE usage_aggregates AS a SET {} FROM {{rows}} AS t \
             WHERE a.project_id = t.d_project AND a.dimension = t.d_dimension AND a.window_kind = t.d_window_kind \
             AND a.window_key = t.d_window_key RETURNING {}",
            set.collect::<Vec<_>>().join(", "),
            *AGGREGATE_COLUMNS
        )
    });
    Stmt::new(SQL.as_str()).rows(rows)
}

/// The batch column of a field's change in [`adjust_sums`].
fn delta_column(f: Field) -> &'static str {
    match f {
        Field::Requests => "d_requests",
        Field::Calls => "d_calls",
        Field::Rows => "d_rows",
        Field::Tokens => "d_tokens",
        Field::CostLlmTokens => "d_cost_llm_tokens",
        Field::CostComputeExecution => "d_cost_compute_execution",
        Field::CostApiRequest => "d_cost_api_request",
        Field::CostStorage => "d_cost_storage",
        Field::LlmEvents => "d_llm_events",
        Field::LlmPriced => "d_llm_priced",
        Field::LlmUnpriced => "d_llm_unpriced",
        Field::StorageEvents => "d_storage_events",
        Field::Storage => "d_storage",
    }
}

/// (5) Adding the sums in one upsert, which returns the new absolute totals
/// of every counter it touched.
fn add_sums(sums: &[&(ProjectId, Counter, Delta)]) -> Stmt {
    let mut rows = Rows::new()
        .text("project_id", sums.iter().map(|(p, _, _)| p.as_str()))
        .text("dimension", sums.iter().map(|(_, c, _)| c.key.dimension.encode()))
        .text("window_kind", sums.iter().map(|(_, c, _)| c.key.window.as_str()))
        .text("window_key", sums.iter().map(|(_, c, _)| c.key.window_key.as_str()))
        .opt_time("resets_at", sums.iter().map(|(_, c, _)| c.resets_at));
    for f in Field::ALL {
        rows = rows.int(column(f), sums.iter().map(|(_, _, d)| d[f.index()]));
    }
    static SQL: LazyLock<String> = LazyLock::new(|| {
        let add = Field::ALL.map(|f| {
            let c = column(f);
            format!("\"{c}\" = {}", saturating_add(&format!("a.\"{c}\""), &format!("excluded.\"{c}\"")))
        });
        format!(
            "INSERT INTO usage_aggregates AS a ({cols}) SELECT * FROM {{rows}} AS t WHERE true \
             ON CONFLICT (project_id, dimension, window_kind, window_key) DO UPDATE SET {add} RETURNING {cols}",
            cols = *AGGREGATE_COLUMNS,
            add = add.join(", ")
        )
    });
    Stmt::new(SQL.as_str()).rows(rows)
}

fn model_rows(adds: &[&ModelUsageChange]) -> Rows {
    Rows::new()
        .text("project_id", adds.iter().map(|m| m.project_id.as_str()))
        .text("dimension", adds.iter().map(|m| m.dimension.encode()))
        .text("window_kind", adds.iter().map(|m| m.window.as_str()))
        .text("window_key", adds.iter().map(|m| m.window_key.as_str()))
        .text("provider", adds.iter().map(|m| m.key.provider.as_str()))
        .text("model", adds.iter().map(|m| m.key.model.as_str()))
        .text("component", adds.iter().map(|m| m.key.component.as_str()))
        .text("meter_type", adds.iter().map(|m| m.meter.as_str()))
        .flag("embedding", adds.iter().map(|m| m.embedding))
        .int("priced_quantity", adds.iter().map(|m| m.priced_quantity))
        .int("unpriced_quantity", adds.iter().map(|m| m.unpriced_quantity))
        .int("cost_picos", adds.iter().map(|m| m.cost_picos))
}

/// (7b) The changes to the breakdown by model that take something back, in
/// one UPDATE, floored at zero.
fn adjust_model_usage(changes: &[&ModelUsageChange]) -> Stmt {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        let set = ["priced_quantity", "unpriced_quantity", "cost_picos"]
            .map(|c| format!("{c} = {}", floored_add(&format!("m.{c}"), &format!("t.{c}"))));
        format!(
            "UPDATE model_usage AS m SET {} FROM {{rows}} AS t \
             WHERE m.project_id = t.project_id AND m.dimension = t.dimension \
             AND m.window_kind = t.window_kind AND m.window_key = t.window_key \
             AND m.provider = t.provider AND m.model = t.model AND m.component = t.component \
             AND m.meter_type = t.meter_type AND m.embedding = t.embedding",
            set.join(", ")
        )
    });
    Stmt::new(SQL.as_str()).rows(model_rows(changes))
}

/// (7) Adding the breakdown by model in one upsert, saturating.
fn add_model_usage(adds: &[&ModelUsageChange]) -> Stmt {
    let rows = model_rows(adds);
    static SQL: LazyLock<String> = LazyLock::new(|| {
        let add = ["priced_quantity", "unpriced_quantity", "cost_picos"]
            .map(|c| format!("{c} = {}", saturating_add(&format!("m.{c}"), &format!("excluded.{c}"))));
        format!(
            "INSERT INTO model_usage AS m (project_id, dimension, window_kind, window_key, {MODEL_USAGE_COLUMNS}) \
             SELECT * FROM {{rows}} AS t WHERE true \
             ON CONFLICT (project_id, dimension, window_kind, window_key, provider, model, component, meter_type, \
             embedding) \
             DO UPDATE SET {}",
            add.join(", ")
        )
    });
    Stmt::new(SQL.as_str()).rows(rows)
}

/// A sum read in two halves (`sum(x >> 32)` and `sum(x & 4294967295)`, each
/// exact in 64 bits for 2^31 rows), joined exactly.
fn joined(hi: i64, lo: i64) -> i128 {
    i128::from(hi) * (1i128 << 32) + i128::from(lo)
}

/// (8) The footprint of every project with new storage facts: lock its
/// row, read what it holds, keep the new facts, set what meter merged.
async fn set_footprints<B: Backend>(
    c: &mut B::Connection,
    posting: &Posting<'_>,
) -> PortResult<Vec<(ProjectId, Counter, Totals)>> {
    if posting.footprint_reads.is_empty() {
        return Ok(Vec::new());
    }
    let footprint = CounterKey::footprint();
    let projects = || posting.footprint_reads.iter().map(|r| r.project_id.as_str());
    let at_footprint = |stmt: Stmt| {
        stmt.text(footprint.dimension.encode()).text(footprint.window.as_str()).text(&footprint.window_key)
    };

    // (a) Lock (creating them if need be) the footprint rows, in project order.
    let lock = Stmt::new(
        "INSERT INTO usage_aggregates AS a (project_id, dimension, window_kind, window_key) \
         SELECT project_id, $1, $2, $3 FROM {rows} AS t WHERE true \
         ON CONFLICT (project_id, dimension, window_kind, window_key) DO UPDATE SET storage = a.storage",
    );
    B::execute(c, at_footprint(lock).rows(Rows::new().text("project_id", projects()))).await?;

    // (b) What each project holds, as `StoredFootprint` defines it.
    let read = Stmt::new(
        "SELECT r.fp_project, s.occurred_at AS snapshot_at, s.event_id AS snapshot_id, s.bytes AS snapshot_bytes,
                CAST(COALESCE((SELECT sum(d.bytes >> 32) FROM storage_facts d
                               WHERE d.project_id = r.fp_project AND d.kind = 'delta'
                                 AND (s.occurred_at IS NULL OR d.occurred_at > s.occurred_at)), 0) AS BIGINT)
                    AS after_snapshot_hi,
                CAST(COALESCE((SELECT sum(d.bytes & 4294967295) FROM storage_facts d
                               WHERE d.project_id = r.fp_project AND d.kind = 'delta'
                                 AND (s.occurred_at IS NULL OR d.occurred_at > s.occurred_at)), 0) AS BIGINT)
                    AS after_snapshot_lo,
                CAST(COALESCE((SELECT sum(d.bytes >> 32) FROM storage_facts d
                               WHERE d.project_id = r.fp_project AND d.kind = 'delta' AND d.occurred_at > r.cut), 0)
                     AS BIGINT) AS after_cut_hi,
                CAST(COALESCE((SELECT sum(d.bytes & 4294967295) FROM storage_facts d
                               WHERE d.project_id = r.fp_project AND d.kind = 'delta' AND d.occurred_at > r.cut), 0)
                     AS BIGINT) AS after_cut_lo,
                (SELECT count(*) FROM storage_facts n WHERE n.project_id = r.fp_project) AS events
         FROM (SELECT t.project_id AS fp_project, t.cut,
                      (SELECT x.event_id FROM storage_facts x WHERE x.project_id = t.project_id AND x.kind = 'snapshot'
                       ORDER BY x.occurred_at DESC, x.event_id DESC LIMIT 1) AS snapshot_id
               FROM {rows} AS t) AS r
         LEFT JOIN storage_facts s ON s.project_id = r.fp_project AND s.event_id = r.snapshot_id",
    )
    .rows(Rows::new().text("project_id", projects()).opt_time("cut", posting.footprint_reads.iter().map(|r| r.cut)));
    let stored: BTreeMap<ProjectId, StoredFootprint> = each(&B::fetch(c, read).await?, |r: &Rec<'_, B>| {
        let snapshot = match (r.opt_time("snapshot_at")?, r.opt_id("snapshot_id")?, r.get("snapshot_bytes")?) {
            (Some(at), Some(id), Some(bytes)) => Some((at, id, bytes)),
            _ => None,
        };
        let stored = StoredFootprint {
            snapshot,
            after_snapshot: joined(r.int("after_snapshot_hi")?, r.int("after_snapshot_lo")?),
            after_cut: joined(r.int("after_cut_hi")?, r.int("after_cut_lo")?),
            events: r.count("events")?,
        };
        Ok((r.id("fp_project")?, stored))
    })?
    .into_iter()
    .collect();

    // (c) Keep the new facts; RETURNING says which were not already kept.
    let s = &posting.storage;
    let keep = Stmt::new(
        "INSERT INTO storage_facts (project_id, event_id, kind, occurred_at, bytes) \
         SELECT * FROM {rows} AS t WHERE true ON CONFLICT DO NOTHING RETURNING project_id, event_id",
    )
    .rows(
        Rows::new()
            .text("project_id", s.iter().map(|f| f.project_id.as_str()))
            .text("event_id", s.iter().map(|f| f.event_id.as_str()))
            .text("kind", s.iter().map(|f| f.kind.as_str()))
            .time("occurred_at", s.iter().map(|f| f.occurred_at))
            .int("bytes", s.iter().map(|f| f.bytes)),
    );
    let kept: HashSet<(ProjectId, EventId)> = each(&B::fetch(c, keep).await?, ids::<B>)?.into_iter().collect();

    // (d) Set (not add) each footprint.
    let footprints = posting.footprints(&stored, &kept);
    let events: Vec<i64> = footprints.iter().map(|(_, f)| clamp(f.events())).collect();
    let set = Stmt::new(format!(
        "UPDATE usage_aggregates AS a SET storage = f.fp_bytes, storage_events = f.fp_events FROM {{rows}} AS f \
         WHERE a.project_id = f.fp_project AND a.dimension = $1 AND a.window_kind = $2 AND a.window_key = $3 \
         RETURNING {}",
        *AGGREGATE_COLUMNS
    ));
    let rows = Rows::new()
        .text("fp_project", footprints.iter().map(|(p, _)| p.as_str()))
        .int("fp_bytes", footprints.iter().map(|(_, f)| f.bytes()))
        .int("fp_events", events);
    each(&B::fetch(c, at_footprint(set).rows(rows)).await?, aggregate::<B>)
}

/// (8c) The quota alerts the batch makes due (`meter::alert`): the quotas
/// of the projects it folded new facts for are read (one statement, none
/// without new facts), and what each touched counter held before the batch
/// is its new total less the batch's change. Each notification is then one
/// insert into the outbox (plus its fan-out to the project's endpoints):
/// notifications are rare, a handful per quota and window, never one per
/// event.
async fn alerts<B: Backend>(
    c: &mut B::Connection,
    posting: &Posting<'_>,
    zones: &HashMap<ProjectId, Tz>,
    book: &PriceBook,
    totals: &[(ProjectId, Counter, Totals)],
    changes: &[(ProjectId, Counter, Delta)],
) -> PortResult<meter::alert::Alerts> {
    let facts = posting.new_facts();
    let projects: std::collections::BTreeSet<&str> = facts.iter().map(|f| f.project_id.as_str()).collect();
    if projects.is_empty() {
        return Ok(meter::alert::Alerts::default());
    }
    let stmt = Stmt::new(format!(
        "SELECT {} FROM quotas WHERE project_id IN (SELECT id FROM {{rows}} AS t) ORDER BY project_id, id",
        super::config::QUOTA_COLUMNS
    ))
    .rows(Rows::new().text("id", projects));
    let quotas = each(&B::fetch(c, stmt).await?, super::config::quota::<B>)?;
    if quotas.is_empty() {
        return Ok(meter::alert::Alerts::default());
    }
    let footprint = CounterKey::footprint();
    let footprints: HashMap<ProjectId, i64> =
        totals.iter().filter(|(_, k, _)| k.key == footprint).map(|(p, _, t)| (p.clone(), t.storage)).collect();
    let before = meter::alert::totals_before(totals, changes);
    Ok(meter::alert::quota_notifications(&meter::alert::BatchAlerts {
        quotas: &quotas,
        zones,
        book,
        facts: &facts,
        before: &before,
        footprints: &footprints,
    }))
}

/// (9) The batch's dead letters, kept as pending (the fence makes each
/// position folded once, so a letter is never kept twice).
fn keep_dead_letters(batch: &FoldBatch, refused: &[DeadLetter]) -> Option<Stmt> {
    let d: Vec<&DeadLetter> = batch.dead_letters.iter().chain(refused).collect();
    if d.is_empty() {
        return None;
    }
    let rows = Rows::new()
        .int("partition", d.iter().map(|l| i64::from(l.partition)))
        .int("offset", d.iter().map(|l| l.offset))
        .opt_bytes("key", d.iter().map(|l| l.key.clone()))
        .bytes("payload", d.iter().map(|l| l.payload.clone()))
        .text("reason", d.iter().map(|l| l.reason.as_str()));
    Some(
        Stmt::new(
            r#"INSERT INTO dead_letters (consumer, topic, "partition", "offset", key, payload, reason)
               SELECT $1, $2, t."partition", t."offset", t.key, t.payload, t.reason FROM {rows} AS t WHERE true
               ON CONFLICT DO NOTHING"#,
        )
        .text(&batch.consumer)
        .text(&batch.topic)
        .rows(rows),
    )
}

/// (10) The newest receipt folded, which only moves forward.
fn note_receipt(batch: &FoldBatch) -> Option<Stmt> {
    let newest = batch.newest_receipt()?;
    Some(
        Stmt::new(
            "INSERT INTO fold_receipts AS w (consumer, topic, newest_receipt) VALUES ($1, $2, $3) \
             ON CONFLICT (consumer, topic) DO UPDATE SET newest_receipt = \
             CASE WHEN excluded.newest_receipt > w.newest_receipt THEN excluded.newest_receipt \
             ELSE w.newest_receipt END",
        )
        .text(&batch.consumer)
        .text(&batch.topic)
        .time(newest),
    )
}

/// Positions (partition, offset) as a batch of rows.
fn positions(letters: &[(i32, i64)]) -> Rows {
    Rows::new().int("p", letters.iter().map(|(p, _)| i64::from(*p))).int("o", letters.iter().map(|(_, o)| *o))
}

fn pending<B: Backend>(r: &Rec<'_, B>) -> PortResult<PendingDeadLetter> {
    let p = r.int("partition")?;
    Ok(PendingDeadLetter {
        letter: DeadLetter {
            partition: i32::try_from(p).map_err(|_| corrupt("partition", &p.to_string()))?,
            offset: r.int("offset")?,
            key: r.get("key")?,
            payload: r.get("payload")?,
            reason: r.text("reason")?,
        },
        mark: r.opt_json::<DlqMark>("mark")?,
    })
}

#[async_trait]
impl<B: Backend> Ledger for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "offsets"))]
    async fn offsets(&self, consumer: &str, topic: &str) -> PortResult<BTreeMap<i32, i64>> {
        let rows = each(&self.all(offsets_stmt(consumer, topic)).await?, offset_row::<B>)?;
        Ok(rows.into_iter().collect())
    }

    #[tracing::instrument(
        name = "datastore",
        level = "debug",
        skip_all,
        fields(db = B::SPAN_DB, op = "fold_batch", facts = batch.facts.len(), partitions = batch.offsets.len())
    )]
    async fn fold_batch(&self, batch: &FoldBatch) -> PortResult<FoldReport> {
        // Dropping `tx` without committing rolls everything back, so every
        // early return below changes nothing. (On SQLite the transaction
        // begins IMMEDIATE: a second writer waits for the write lock, up to
        // the busy timeout, then reads the offsets this one wrote.)
        let _turn = self.write_turn().await;
        let mut tx = B::begin(&self.pool).await.map_err(error::<B>)?;
        fence::<B>(&mut *tx, batch).await?;
        let plan = BatchFold::new(&batch.facts);
        let zones = zones::<B>(&mut *tx, &plan).await?;
        let new = dedup::<B>(&mut *tx, &plan, &zones).await?;
        let targets = targets::<B>(&mut *tx, &plan).await?;
        let book = price_book::<B>(&mut *tx, &plan, &targets).await?;
        let horizon = batch.horizon.unwrap_or(meter::usage::DEFAULT_DEDUP_HORIZON);
        let posting =
            plan.post_with(&new, &zones, &book, &targets, horizon).map_err(|e| PortError::Permanent(e.to_string()))?;
        // A refused correction is dead-lettered as its record; a batch
        // that cannot say which record it was is refused whole.
        let mut refused = Vec::new();
        for (i, why) in &posting.refusals {
            let Some(src) = batch.sources.get(i) else {
                return Err(PortError::Permanent(format!("invalid: {why}")));
            };
            refused.push(DeadLetter {
                partition: src.partition,
                offset: src.offset,
                key: src.key.clone(),
                payload: src.payload.clone(),
                reason: format!("invalid: {why}"),
            });
        }

        let mut report = posting.report();
        let changes = posting.counter_changes();
        let (back, add): (Vec<_>, Vec<_>) = changes.iter().partition(|(_, _, d)| takes_back(d));
        if !add.is_empty() {
            report.totals = each(&B::fetch(&mut *tx, add_sums(&add)).await?, aggregate::<B>)?;
        }
        if !back.is_empty() {
            report.lowered = each(&B::fetch(&mut *tx, adjust_sums(&back)).await?, aggregate::<B>)?;
            report.totals.extend(report.lowered.iter().cloned());
        }
        if let Some(stmt) = insert_unpriced(posting.unpriced.iter().map(|(p, r)| (p, r))) {
            B::execute(&mut *tx, stmt).await?;
        }
        let models = posting.model_changes();
        let (back, add): (Vec<_>, Vec<_>) =
            models.iter().partition(|m| takes_back(&[m.priced_quantity, m.unpriced_quantity, m.cost_picos]));
        if !add.is_empty() {
            B::execute(&mut *tx, add_model_usage(&add)).await?;
        }
        if !back.is_empty() {
            B::execute(&mut *tx, adjust_model_usage(&back)).await?;
        }
        report.totals.extend(set_footprints::<B>(&mut *tx, &posting).await?);
        report.totals.sort_by(|a, b| (&a.0, &a.1.key).cmp(&(&b.0, &b.1.key)));
        for stmt in recount(&posting) {
            B::execute(&mut *tx, stmt).await?;
        }
        let alerts = alerts::<B>(&mut *tx, &posting, &zones, &book, &report.totals, &changes).await?;
        for n in &alerts.notifications {
            // A dedup hit (already enqueued by an earlier fold) is no error.
            super::webhooks::enqueue_in::<B>(&mut *tx, n, None).await?;
        }
        for entry in posting.audit.iter().chain(&alerts.audit) {
            B::execute(&mut *tx, super::config::insert_audit(entry)?).await?;
        }
        for stmt in [keep_dead_letters(batch, &refused), note_receipt(batch)].into_iter().flatten() {
            B::execute(&mut *tx, stmt).await?;
        }

        tx.commit().await.map_err(error::<B>)?;
        Ok(report)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "claim_dead_letters"))]
    async fn claim_dead_letters(
        &self,
        consumer: &str,
        topic: &str,
        claimant: &str,
        at: DateTime<Utc>,
        until: DateTime<Utc>,
        max: usize,
    ) -> PortResult<Vec<PendingDeadLetter>> {
        // One UPDATE: on PostgreSQL a row another claimer took meanwhile is
        // re-checked against the WHERE after its lock, and skipped.
        let claimable = r#"consumer = $1 AND topic = $2 AND NOT published
               AND (claimed_by IS NULL OR claimed_by = $3 OR claimed_until < $4)"#;
        let stmt = Stmt::new(format!(
            r#"UPDATE dead_letters SET claimed_by = $3, claimed_until = $5
               WHERE {claimable} AND ("partition", "offset") IN (
                   SELECT "partition", "offset" FROM dead_letters WHERE {claimable}
                   ORDER BY "partition", "offset" LIMIT $6)
               RETURNING CAST("partition" AS BIGINT) AS "partition", "offset", key, payload, reason, mark"#
        ))
        .text(consumer)
        .text(topic)
        .text(claimant)
        .time(at)
        .time(until)
        .int(limit(max));
        let mut out = each(&self.all(stmt).await?, pending::<B>)?;
        out.sort_by_key(|p| (p.letter.partition, p.letter.offset));
        Ok(out)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "mark_dead_letters"))]
    async fn mark_dead_letters(
        &self,
        consumer: &str,
        topic: &str,
        letters: &[(i32, i64)],
        mark: &DlqMark,
    ) -> PortResult<()> {
        if letters.is_empty() {
            return Ok(());
        }
        let stmt = Stmt::new(
            r#"UPDATE dead_letters SET mark = $3
               WHERE consumer = $1 AND topic = $2 AND mark IS NULL
                 AND ("partition", "offset") IN (SELECT CAST(p AS INTEGER), o FROM {rows} AS t)"#,
        )
        .text(consumer)
        .text(topic)
        .json(mark)?
        .rows(positions(letters));
        self.run(stmt).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "dead_letters_published"))]
    async fn dead_letters_published(&self, consumer: &str, topic: &str, letters: &[(i32, i64)]) -> PortResult<()> {
        if letters.is_empty() {
            return Ok(());
        }
        let stmt = Stmt::new(
            r#"UPDATE dead_letters SET published = true, claimed_by = NULL, claimed_until = NULL
               WHERE consumer = $1 AND topic = $2
                 AND ("partition", "offset") IN (SELECT CAST(p AS INTEGER), o FROM {rows} AS t)"#,
        )
        .text(consumer)
        .text(topic)
        .rows(positions(letters));
        self.run(stmt).await.map(drop)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "purge_processed"))]
    async fn purge_processed(
        &self,
        consumer: &str,
        topic: &str,
        keep: chrono::Duration,
        at: DateTime<Utc>,
    ) -> PortResult<u64> {
        let stmt = Stmt::new("SELECT newest_receipt FROM fold_receipts WHERE consumer = $1 AND topic = $2")
            .text(consumer)
            .text(topic);
        let Some(row) = self.opt(stmt).await? else { return Ok(0) };
        let newest = Rec::<B>(&row).time("newest_receipt")?;
        let Some(cutoff) = newest.min(at).checked_sub_signed(keep) else { return Ok(0) };
        self.purge_processed_before(cutoff).await
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "totals"))]
    async fn totals(&self, project: &ProjectId, counters: &[CounterKey]) -> PortResult<Vec<(CounterKey, Totals)>> {
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let wanted = Rows::new()
            .text("dimension", counters.iter().map(|c| c.dimension.encode()))
            .text("window_kind", counters.iter().map(|c| c.window.as_str()))
            .text("window_key", counters.iter().map(|c| c.window_key.as_str()));
        let stmt = Stmt::new(format!(
            "SELECT {} FROM usage_aggregates WHERE project_id = $1 AND (dimension, window_kind, window_key) IN \
             (SELECT dimension, window_kind, window_key FROM {{rows}} AS t)",
            *AGGREGATE_COLUMNS
        ))
        .text(project.as_str())
        .rows(wanted);
        let found: HashMap<CounterKey, Totals> =
            each(&self.all(stmt).await?, |r: &Rec<'_, B>| Ok((counter_key(r)?, totals(r)?)))?.into_iter().collect();
        Ok(counters.iter().map(|c| (c.clone(), found.get(c).copied().unwrap_or_default())).collect())
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "open_totals"))]
    async fn open_totals(&self, project: &ProjectId, at: DateTime<Utc>) -> PortResult<Vec<(Counter, Totals)>> {
        each(&self.all(open_totals_stmt(project, at)).await?, counter::<B>)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "correction_target"))]
    async fn correction_target(&self, project: &ProjectId, event: &EventId) -> PortResult<Option<Target>> {
        target_of(self, project, event).await
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "seed_totals"))]
    async fn seed_totals(
        &self,
        project: &ProjectId,
        consumer: &str,
        topic: &str,
        at: DateTime<Utc>,
    ) -> PortResult<(BTreeMap<i32, i64>, Vec<(Counter, Totals)>)> {
        // One snapshot for both reads: a fold commits its totals and its
        // offsets together, so these totals are exactly the log below them.
        let mut tx = B::begin_snapshot(&self.pool).await.map_err(error::<B>)?;
        let offsets = each(&B::fetch(&mut *tx, offsets_stmt(consumer, topic)).await?, offset_row::<B>)?;
        let totals = each(&B::fetch(&mut *tx, open_totals_stmt(project, at)).await?, counter::<B>)?;
        tx.commit().await.map_err(error::<B>)?;
        Ok((offsets.into_iter().collect(), totals))
    }
}

/// The consumer's next offsets, per partition.
pub(crate) fn offsets_stmt(consumer: &str, topic: &str) -> Stmt {
    Stmt::new(
        r#"SELECT CAST("partition" AS BIGINT) AS "partition", next_offset FROM consumer_offsets
           WHERE consumer = $1 AND topic = $2"#,
    )
    .text(consumer)
    .text(topic)
}

pub(crate) fn offset_row<B: Backend>(r: &Rec<'_, B>) -> PortResult<(i32, i64)> {
    let p = r.int("partition")?;
    Ok((i32::try_from(p).map_err(|_| corrupt("partition", &p.to_string()))?, r.int("next_offset")?))
}

/// Every counter of a project whose window is open at `at`. `resets_at IS
/// NULL` keeps the windows that never reset: the storage footprint.
fn open_totals_stmt(project: &ProjectId, at: DateTime<Utc>) -> Stmt {
    Stmt::new(format!(
        "SELECT {} FROM usage_aggregates WHERE project_id = $1 AND (resets_at IS NULL OR resets_at > $2) \
         ORDER BY dimension, window_kind, window_key",
        *AGGREGATE_COLUMNS
    ))
    .text(project.as_str())
    .time(at)
}

#[async_trait]
impl<B: Backend> ReportStore for SqlStore<B> {
    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "model_usage"))]
    async fn model_usage(
        &self,
        project: &ProjectId,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<ModelUsageRow>> {
        let stmt = Stmt::new(format!(
            "SELECT {MODEL_USAGE_COLUMNS} FROM model_usage \
             WHERE project_id = $1 AND dimension = 'p' AND window_kind = $2 AND window_key = $3"
        ))
        .text(project.as_str())
        .text(window.as_str())
        .text(window_key);
        let mut out = each(&self.all(stmt).await?, model_usage_row::<B>)?;
        // meter's orders (components and meters are not in name order).
        out.sort_by(|a, b| (&a.key, a.meter, a.embedding).cmp(&(&b.key, b.meter, b.embedding)));
        Ok(out)
    }

    #[tracing::instrument(name = "datastore", level = "debug", skip_all, fields(db = B::SPAN_DB, op = "population_totals"))]
    async fn population_totals(
        &self,
        project: &ProjectId,
        population: Population,
        window: WindowKind,
        window_key: &str,
    ) -> PortResult<Vec<(CounterKey, Totals)>> {
        // A comparison of the leading characters, not LIKE: the prefix is
        // text, never a pattern (and SQLite's LIKE ignores ASCII case).
        let stmt = Stmt::new(format!(
            "SELECT {} FROM usage_aggregates WHERE project_id = $1 AND window_kind = $2 AND window_key = $3 \
             AND substr(dimension, 1, length($4)) = $4",
            *AGGREGATE_COLUMNS
        ))
        .text(project.as_str())
        .text(window.as_str())
        .text(window_key)
        .text(population.encoded_prefix());
        let mut out = each(&self.all(stmt).await?, |r: &Rec<'_, B>| Ok((counter_key(r)?, totals(r)?)))?;
        out.sort_by(|a, b| a.0.dimension.cmp(&b.0.dimension));
        Ok(out)
    }
}
