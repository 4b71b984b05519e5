-- The token usage breakdown finance reads (`GET /v1/usage?group_by=model`):
-- per project and calendar window (`day`, `calendar_month`, keyed in the
-- project's time zone), the quantity of every (provider, model, component)
-- on each meter, priced and unpriced apart, and the cost of the priced part.
-- The fold adds to it in the same transaction as the aggregates, for the
-- same new (not yet folded) tokens events, so it is exactly-once too.
--
-- Money is bigint picodollars (10^-12 USD). Names that are ordered on are
-- COLLATE "C", as in 0003, so the database orders them bytewise, as Rust does.
CREATE TABLE model_usage (
    project_id        text    NOT NULL,
    -- `day` or `calendar_month`, and its key (`2026-07-07`, `2026-07`).
    window_kind       text    NOT NULL,
    window_key        text    NOT NULL,
    provider          text COLLATE "C" NOT NULL,
    model             text COLLATE "C" NOT NULL,
    -- `input_tokens`, `output_tokens`, `cached_tokens`.
    component         text    NOT NULL,
    -- The meter the tokens events fed (`llm_tokens`, …).
    meter_type        text    NOT NULL,
    embedding         boolean NOT NULL,
    -- Tokens a price covered at their event time, and tokens none did.
    priced_quantity   bigint  NOT NULL DEFAULT 0 CHECK (priced_quantity >= 0),
    unpriced_quantity bigint  NOT NULL DEFAULT 0 CHECK (unpriced_quantity >= 0),
    -- The cost of the priced quantity, in picodollars.
    cost_picos        bigint  NOT NULL DEFAULT 0 CHECK (cost_picos >= 0),
    PRIMARY KEY (project_id, window_kind, window_key, provider, model, component, meter_type, embedding)
);
