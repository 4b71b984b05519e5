-- The breakdown by model per customer (as migrations/0014): every row names
-- the dimension it counts (`p` the project, `g:<agent>`, `a:<actor>`). The
-- key changes, so the table is rebuilt; the rows already here are the
-- project's.
CREATE TABLE model_usage_by_dimension (
    project_id        TEXT    NOT NULL,
    dimension         TEXT    NOT NULL,
    window_kind       TEXT    NOT NULL,
    window_key        TEXT    NOT NULL,
    provider          TEXT    NOT NULL,
    model             TEXT    NOT NULL,
    component         TEXT    NOT NULL,
    meter_type        TEXT    NOT NULL,
    embedding         INTEGER NOT NULL CHECK (embedding IN (0, 1)),
    priced_quantity   INTEGER NOT NULL DEFAULT 0 CHECK (priced_quantity >= 0),
    unpriced_quantity INTEGER NOT NULL DEFAULT 0 CHECK (unpriced_quantity >= 0),
    cost_picos        INTEGER NOT NULL DEFAULT 0 CHECK (cost_picos >= 0),
    PRIMARY KEY (project_id, dimension, window_kind, window_key, provider, model, component, meter_type, embedding)
) STRICT, WITHOUT ROWID;

INSERT INTO model_usage_by_dimension
SELECT project_id, 'p', window_kind, window_key, provider, model, component, meter_type, embedding,
       priced_quantity, unpriced_quantity, cost_picos
FROM model_usage;

DROP TABLE model_usage;
ALTER TABLE model_usage_by_dimension RENAME TO model_usage;
