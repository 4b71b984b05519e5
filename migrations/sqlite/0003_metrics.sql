-- Tokens, cost and storage (migrations/0003_metrics.sql, adapted to SQLite):
-- the new sums of the aggregates, the price book, the unpriced rows of each
-- counter, the storage facts the footprint is recomputed from, and the
-- deduplicated `quota_unpriced` exceptions.
--
-- Money is INTEGER picodollars (10^-12 USD), never a float. Text compares
-- bytewise (SQLite's BINARY collation), as Rust orders the same strings.

-- One column per new field of meter's Totals. Every one is a sum except
-- `storage`, which on the footprint row (`p`/`current`/`current`) is the
-- footprint itself: the newest snapshot plus the deltas after it. (SQLite
-- adds one column per statement.)
ALTER TABLE usage_aggregates ADD COLUMN tokens                 INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN cost_llm_tokens        INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN cost_compute_execution INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN cost_api_request       INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN cost_storage           INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN llm_events             INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN llm_priced             INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN llm_unpriced           INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN storage_events         INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_aggregates ADD COLUMN storage                INTEGER NOT NULL DEFAULT 0;

-- The price book: a unit price per (provider, model, component) from
-- `effective_from` on. An event is priced by the row in effect at its event
-- time, so adding a row never reprices what was already folded.
CREATE TABLE prices (
    provider         TEXT    NOT NULL,
    model            TEXT    NOT NULL,
    -- `input_tokens`, `output_tokens`, `cached_tokens`.
    component        TEXT    NOT NULL,
    effective_from   TEXT    NOT NULL,
    -- Picodollars per unit (one token).
    unit_price_picos INTEGER NOT NULL CHECK (unit_price_picos >= 0),
    PRIMARY KEY (provider, model, component, effective_from)
) STRICT, WITHOUT ROWID;

-- The distinct (provider, model, component) no price covered, per counter:
-- what a blackout refusal and an exception list. Written by the gateway when
-- it accepts an event and by the fold from the log (idempotently).
CREATE TABLE unpriced_rows (
    project_id  TEXT    NOT NULL,
    dimension   TEXT    NOT NULL,
    window_kind TEXT    NOT NULL,
    window_key  TEXT    NOT NULL,
    -- The counter's reset: rows of closed windows can be purged.
    resets_at   TEXT    NULL,
    provider    TEXT    NOT NULL,
    model       TEXT    NOT NULL,
    component   TEXT    NOT NULL,
    PRIMARY KEY (project_id, dimension, window_kind, window_key, provider, model, component)
) STRICT, WITHOUT ROWID;

CREATE INDEX unpriced_rows_resets_at_idx ON unpriced_rows (resets_at);

-- Every folded storage fact of a project, the footprint's source: the fold
-- recomputes it from here (newest snapshot by (occurred_at, event_id), plus
-- the deltas strictly after it) so the order facts arrive in cannot matter.
CREATE TABLE storage_facts (
    project_id  TEXT    NOT NULL,
    event_id    TEXT    NOT NULL,
    kind        TEXT    NOT NULL CHECK (kind IN ('delta', 'snapshot')),
    occurred_at TEXT    NOT NULL,
    -- Added (> 0) or removed (< 0) by a delta; held by a snapshot.
    bytes       INTEGER NOT NULL,
    PRIMARY KEY (project_id, event_id)
) STRICT, WITHOUT ROWID;

CREATE INDEX storage_facts_time_idx ON storage_facts (project_id, occurred_at);

-- One `quota_unpriced` exception per cost quota, counted on each recurrence.
CREATE TABLE quota_exceptions (
    quota_id         TEXT    NOT NULL PRIMARY KEY,
    project_id       TEXT    NOT NULL REFERENCES projects (id),
    -- The quota's limit (picodollars) and window when last filed.
    "limit"          INTEGER NOT NULL,
    window_key       TEXT    NOT NULL,
    llm_events       INTEGER NOT NULL,
    unpriced_events  INTEGER NOT NULL,
    -- JSON text: an array of {provider, model, component}, at most 10.
    unpriced_rows    TEXT    NOT NULL DEFAULT '[]',
    occurrence_count INTEGER NOT NULL CHECK (occurrence_count > 0),
    first_seen       TEXT    NOT NULL,
    last_seen        TEXT    NOT NULL
) STRICT;

-- A project's exceptions, paged by quota id.
CREATE INDEX quota_exceptions_project_idx ON quota_exceptions (project_id, quota_id);
