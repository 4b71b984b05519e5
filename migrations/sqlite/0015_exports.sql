-- Billing exports (migrations/0015_exports.sql, adapted to SQLite): the runs
-- of each export, and what they wrote, summed per line. See the PostgreSQL
-- file for why each column is there. Neither table is the fold's.

CREATE TABLE export_runs (
    id             TEXT    NOT NULL PRIMARY KEY,
    export_key     TEXT    NOT NULL,
    project_id     TEXT    NOT NULL REFERENCES projects (id),
    period_kind    TEXT    NOT NULL,
    dimensions     TEXT    NOT NULL,
    grace_secs     INTEGER NOT NULL CHECK (grace_secs >= 0),
    format         TEXT    NOT NULL,
    status         TEXT    NOT NULL,
    mark           TEXT    NULL,
    -- A JSON object: partition → next offset.
    watermark      TEXT    NOT NULL,
    receipt_bound  TEXT    NULL,
    started_at     TEXT    NOT NULL,
    finished_at    TEXT    NULL,
    "rows"         INTEGER NOT NULL CHECK ("rows" >= 0),
    bytes          INTEGER NOT NULL CHECK (bytes >= 0),
    file           TEXT    NULL,
    -- meter's `Reconciliation`, as JSON.
    reconciliation TEXT    NULL,
    error          TEXT    NULL
) STRICT;

CREATE INDEX export_runs_project_idx ON export_runs (project_id, started_at);

-- One run per project at a time, whoever starts it (the API, the CLI, a
-- schedule): two at once would both write the same difference. A run
-- that died while running is marked failed once it is past its time
-- bound, before the next one starts.
CREATE UNIQUE INDEX export_runs_one_running_idx ON export_runs (project_id) WHERE status = 'running';

CREATE TABLE export_lines (
    export_key TEXT    NOT NULL,
    period_key TEXT    NOT NULL,
    dimension  TEXT    NOT NULL,
    item       TEXT    NOT NULL,
    consumed   INTEGER NOT NULL,
    priced     INTEGER NOT NULL,
    unpriced   INTEGER NOT NULL,
    cost       INTEGER NOT NULL,
    PRIMARY KEY (export_key, period_key, dimension, item)
) STRICT, WITHOUT ROWID;
