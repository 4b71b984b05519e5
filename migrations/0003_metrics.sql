-- Tokens, cost and storage: the new sums of the aggregates, the price book,
-- the unpriced rows of each counter, the storage facts the footprint is
-- recomputed from, and the deduplicated `quota_unpriced` exceptions.
--
-- Money is bigint picodollars (10^-12 USD), never a float. Text that is
-- ordered or paged on (names, ids) is COLLATE "C", so the database orders it
-- bytewise, as Rust orders the same strings, whatever its default collation.

-- One column per new field of meter's Totals. Every one is a sum except
-- `storage`, which on the footprint row (`p`/`current`/`current`) is the
-- footprint itself: the newest snapshot plus the deltas after it.
ALTER TABLE usage_aggregates
    ADD COLUMN tokens                 bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_llm_tokens        bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_compute_execution bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_api_request       bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_storage           bigint NOT NULL DEFAULT 0,
    ADD COLUMN llm_events             bigint NOT NULL DEFAULT 0,
    ADD COLUMN llm_priced             bigint NOT NULL DEFAULT 0,
    ADD COLUMN llm_unpriced           bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage_events         bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage                bigint NOT NULL DEFAULT 0;

-- The price book: a unit price per (provider, model, component) from
-- `effective_from` on. An event is priced by the row in effect at its event
-- time, so adding a row never reprices what was already folded.
CREATE TABLE prices (
    provider         text COLLATE "C" NOT NULL,
    model            text COLLATE "C" NOT NULL,
    -- `input_tokens`, `output_tokens`, `cached_tokens`.
    component        text        NOT NULL,
    effective_from   timestamptz NOT NULL,
    -- Picodollars per unit (one token).
    unit_price_picos bigint      NOT NULL CHECK (unit_price_picos >= 0),
    PRIMARY KEY (provider, model, component, effective_from)
);

-- The distinct (provider, model, component) no price covered, per counter:
-- what a blackout refusal and an exception list. Written by the gateway when
-- it accepts an event and by the fold from the log (idempotently).
CREATE TABLE unpriced_rows (
    project_id  text        NOT NULL,
    dimension   text        NOT NULL,
    window_kind text        NOT NULL,
    window_key  text        NOT NULL,
    -- The counter's reset: rows of closed windows can be purged.
    resets_at   timestamptz NULL,
    provider    text COLLATE "C" NOT NULL,
    model       text COLLATE "C" NOT NULL,
    component   text        NOT NULL,
    PRIMARY KEY (project_id, dimension, window_kind, window_key, provider, model, component)
);

CREATE INDEX unpriced_rows_resets_at_idx ON unpriced_rows (resets_at);

-- Every folded storage fact of a project, the footprint's source: the fold
-- recomputes it from here (newest snapshot by (occurred_at, event_id), plus
-- the deltas strictly after it) so the order facts arrive in cannot matter.
CREATE TABLE storage_facts (
    project_id  text        NOT NULL,
    -- Bytewise, as meter's Footprint breaks a tie between snapshots.
    event_id    text COLLATE "C" NOT NULL,
    kind        text        NOT NULL CHECK (kind IN ('delta', 'snapshot')),
    occurred_at timestamptz NOT NULL,
    -- Added (> 0) or removed (< 0) by a delta; held by a snapshot.
    bytes       bigint      NOT NULL,
    PRIMARY KEY (project_id, event_id)
);

CREATE INDEX storage_facts_time_idx ON storage_facts (project_id, occurred_at);

-- One `quota_unpriced` exception per cost quota, counted on each recurrence.
CREATE TABLE quota_exceptions (
    quota_id         text COLLATE "C" PRIMARY KEY,
    project_id       text        NOT NULL REFERENCES projects (id),
    -- The quota's limit (picodollars) and window when last filed.
    "limit"          bigint      NOT NULL,
    window_key       text        NOT NULL,
    llm_events       bigint      NOT NULL,
    unpriced_events  bigint      NOT NULL,
    -- A JSON array of {provider, model, component}, at most 10.
    unpriced_rows    jsonb       NOT NULL DEFAULT '[]'::jsonb,
    occurrence_count bigint      NOT NULL CHECK (occurrence_count > 0),
    first_seen       timestamptz NOT NULL,
    last_seen        timestamptz NOT NULL
);

-- A project's exceptions, paged by quota id.
CREATE INDEX quota_exceptions_project_idx ON quota_exceptions (project_id, quota_id);
