-- Billing exports (issue 11 item 3): the runs of each export, and what they
-- wrote.
--
-- An export is one project's usage per charge period for some customer
-- dimensions; its identity is `export_key` (`<project>/<period>/<dims>`,
-- meter's `ExportSpec::key`). Each run writes only what was folded since
-- the runs before it: `export_lines` holds, per line, the sum of what every
-- run of the export wrote, which the next run subtracts. A run's lines are
-- added in the transaction that records how the run ended, so a run that
-- failed to finish added nothing.
--
-- Neither table is the fold's: a replay neither compares nor swaps them.

CREATE TABLE export_runs (
    -- `exr_…`.
    id             text COLLATE "C" PRIMARY KEY,
    export_key     text COLLATE "C" NOT NULL,
    project_id     text        NOT NULL REFERENCES projects (id),
    -- `day` or `calendar_month`.
    period_kind    text        NOT NULL,
    -- The customer dimensions, `+`-joined in order (`api_key+user`).
    dimensions     text        NOT NULL,
    grace_secs     bigint      NOT NULL CHECK (grace_secs >= 0),
    -- csv, jsonl, parquet.
    format         text        NOT NULL,
    -- running, complete, partial, failed.
    status         text        NOT NULL,
    -- The bound a partial run stopped at: ROWS or TIME.
    mark           text        NULL,
    -- The fold's next offset per partition at the run: {"0": 1234, …}.
    watermark      jsonb       NOT NULL,
    -- The newest receipt time the fold had folded at the run.
    receipt_bound  timestamptz NULL,
    started_at     timestamptz NOT NULL,
    finished_at    timestamptz NULL,
    "rows"         bigint      NOT NULL CHECK ("rows" >= 0),
    bytes          bigint      NOT NULL CHECK (bytes >= 0),
    -- Where the file is, on the host that ran it.
    file           text        NULL,
    -- meter's `Reconciliation`, as JSON.
    reconciliation jsonb       NULL,
    error          text        NULL
);

CREATE INDEX export_runs_project_idx ON export_runs (project_id, started_at);

-- One run per project at a time, whoever starts it (the API, the CLI, a
-- schedule): two at once would both write the same difference. A run
-- that died while running is marked failed once it is past its time
-- bound, before the next one starts.
CREATE UNIQUE INDEX export_runs_one_running_idx ON export_runs (project_id) WHERE status = 'running';

CREATE TABLE export_lines (
    export_key text COLLATE "C" NOT NULL,
    -- The line's own charge period.
    period_key text COLLATE "C" NOT NULL,
    -- The customer (`Dimension::encode`: `p`, `k:<key>`, `a:<actor>`…).
    dimension  text COLLATE "C" NOT NULL,
    -- What it measures (`Item::encode`: `m:<metric>`, `t:<provider>…`).
    item       text COLLATE "C" NOT NULL,
    -- Summed over the runs; a correction can take any of them below zero.
    consumed   bigint      NOT NULL,
    priced     bigint      NOT NULL,
    unpriced   bigint      NOT NULL,
    cost       bigint      NOT NULL,
    PRIMARY KEY (export_key, period_key, dimension, item)
);
