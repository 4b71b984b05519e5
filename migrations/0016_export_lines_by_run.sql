-- What an export wrote, per run (issue 11 item 2: bounded memory): a run
-- records its lines slice by slice as it writes them, against its id,
-- instead of adding them all to one sum per line as it ends. A line counts
-- for the next runs once its run ends `complete` or `partial`; the lines of
-- a run that failed are dropped as it ends, and those of a run that died
-- running never count (the run is marked failed later). Each run writes a
-- line at most once.
--
-- The sums already here become the lines of their export's newest complete
-- or partial run (what they are the sum of), so the next run subtracts them
-- as before.
--
-- The fold's counters and breakdown rows are read by a period's slice of
-- customers, bytewise: an index in that order.

CREATE TABLE export_run_lines (
    run_id     text COLLATE "C" NOT NULL REFERENCES export_runs (id) ON DELETE CASCADE,
    export_key text COLLATE "C" NOT NULL,
    -- The line's own charge period.
    period_key text COLLATE "C" NOT NULL,
    -- The customer (`Dimension::encode`: `p`, `k:<key>`, `a:<actor>`…).
    dimension  text COLLATE "C" NOT NULL,
    -- What it measures (`Item::encode`: `m:<metric>`, `t:<provider>…`).
    item       text COLLATE "C" NOT NULL,
    -- What the run wrote; a correction can be below zero.
    consumed   bigint      NOT NULL,
    priced     bigint      NOT NULL,
    unpriced   bigint      NOT NULL,
    cost       bigint      NOT NULL,
    PRIMARY KEY (run_id, period_key, dimension, item)
);

INSERT INTO export_run_lines (run_id, export_key, period_key, dimension, item, consumed, priced, unpriced, cost)
SELECT r.id, l.export_key, l.period_key, l.dimension, l.item, l.consumed, l.priced, l.unpriced, l.cost
FROM export_lines l
JOIN LATERAL (
    SELECT id FROM export_runs
    WHERE export_key = l.export_key AND status IN ('complete', 'partial')
    ORDER BY started_at DESC, id DESC LIMIT 1
) r ON true;

DROP TABLE export_lines;
ALTER TABLE export_run_lines RENAME TO export_lines;

CREATE INDEX export_lines_line_idx ON export_lines (export_key, period_key, dimension);
CREATE INDEX export_runs_key_idx ON export_runs (export_key, status, started_at);

CREATE INDEX usage_aggregates_slice_idx
    ON usage_aggregates (project_id, window_kind, window_key, dimension COLLATE "C");
CREATE INDEX model_usage_slice_idx
    ON model_usage (project_id, window_kind, window_key, dimension COLLATE "C");
