-- The breakdown by model per customer (issue 11: exports bill each
-- customer's tokens by model): every row of `model_usage` now names the
-- dimension it counts, as `usage_aggregates` does (`p` the project,
-- `g:<agent>`, `a:<actor>`), so a tokens event adds to the project's row
-- and to those of its agent and actor. The rows already here are the
-- project's; a replay rebuilds the rest from the log.
ALTER TABLE model_usage ADD COLUMN dimension text NOT NULL DEFAULT 'p';
ALTER TABLE model_usage ALTER COLUMN dimension DROP DEFAULT;
ALTER TABLE model_usage DROP CONSTRAINT model_usage_pkey;
ALTER TABLE model_usage
    ADD PRIMARY KEY (project_id, dimension, window_kind, window_key, provider, model, component, meter_type, embedding);
