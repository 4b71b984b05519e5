-- The token usage breakdown (migrations/0005_model_usage.sql, adapted to
-- SQLite): per project and calendar window (`day`, `calendar_month`, keyed in
-- the project's time zone), the quantity of every (provider, model,
-- component) on each meter, priced and unpriced apart, and the cost of the
-- priced part. Added to by the fold in the same transaction as the aggregates.
--
-- Money is INTEGER picodollars (10^-12 USD). Text compares bytewise (SQLite's
-- BINARY collation), as Rust orders the same strings.
CREATE TABLE model_usage (
    project_id        TEXT    NOT NULL,
    -- `day` or `calendar_month`, and its key (`2026-07-07`, `2026-07`).
    window_kind       TEXT    NOT NULL,
    window_key        TEXT    NOT NULL,
    provider          TEXT    NOT NULL,
    model             TEXT    NOT NULL,
    -- `input_tokens`, `output_tokens`, `cached_tokens`.
    component         TEXT    NOT NULL,
    -- The meter the tokens events fed (`llm_tokens`, …).
    meter_type        TEXT    NOT NULL,
    -- 0 or 1.
    embedding         INTEGER NOT NULL CHECK (embedding IN (0, 1)),
    -- Tokens a price covered at their event time, and tokens none did.
    priced_quantity   INTEGER NOT NULL DEFAULT 0 CHECK (priced_quantity >= 0),
    unpriced_quantity INTEGER NOT NULL DEFAULT 0 CHECK (unpriced_quantity >= 0),
    -- The cost of the priced quantity, in picodollars.
    cost_picos        INTEGER NOT NULL DEFAULT 0 CHECK (cost_picos >= 0),
    PRIMARY KEY (project_id, window_kind, window_key, provider, model, component, meter_type, embedding)
) STRICT, WITHOUT ROWID;
