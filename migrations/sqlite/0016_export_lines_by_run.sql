-- What an export wrote, per run: see migrations/0016_export_lines_by_run.sql.
-- TEXT compares bytewise here (BINARY), so the slice indexes need no collation.

CREATE TABLE export_run_lines (
    run_id     TEXT    NOT NULL REFERENCES export_runs (id) ON DELETE CASCADE,
    export_key TEXT    NOT NULL,
    period_key TEXT    NOT NULL,
    dimension  TEXT    NOT NULL,
    item       TEXT    NOT NULL,
    consumed   INTEGER NOT NULL,
    priced     INTEGER NOT NULL,
    unpriced   INTEGER NOT NULL,
    cost       INTEGER NOT NULL,
    PRIMARY KEY (run_id, period_key, dimension, item)
) STRICT, WITHOUT ROWID;

INSERT INTO export_run_lines (run_id, export_key, period_key, dimension, item, consumed, priced, unpriced, cost)
SELECT (
    SELECT id FROM export_runs r
    WHERE r.export_key = l.export_key AND r.status IN ('complete', 'partial')
    ORDER BY r.started_at DESC, r.id DESC LIMIT 1
), l.export_key, l.period_key, l.dimension, l.item, l.consumed, l.priced, l.unpriced, l.cost
FROM export_lines l
WHERE EXISTS (
    SELECT 1 FROM export_runs r WHERE r.export_key = l.export_key AND r.status IN ('complete', 'partial')
);

DROP TABLE export_lines;
ALTER TABLE export_run_lines RENAME TO export_lines;

CREATE INDEX export_lines_line_idx ON export_lines (export_key, period_key, dimension);
CREATE INDEX export_runs_key_idx ON export_runs (export_key, status, started_at);

CREATE INDEX usage_aggregates_slice_idx ON usage_aggregates (project_id, window_kind, window_key, dimension);
CREATE INDEX model_usage_slice_idx ON model_usage (project_id, window_kind, window_key, dimension);
