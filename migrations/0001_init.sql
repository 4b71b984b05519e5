-- Tollgate's durable store: configuration, aggregates, the dedup set and the
-- consumer offsets. The aggregates, the dedup set and the offsets are only
-- ever written together, in one transaction per folded batch.

CREATE TABLE projects (
    id          text        PRIMARY KEY,
    name        text        NOT NULL,
    -- IANA zone name; immutable, calendar windows already folded depend on it.
    timezone    text        NOT NULL DEFAULT 'UTC',
    created_at  timestamptz NOT NULL
);

CREATE TABLE api_keys (
    id          text        PRIMARY KEY,
    project_id  text        NOT NULL REFERENCES projects (id),
    name        text        NOT NULL,
    prefix      text        NOT NULL,
    -- The secret is only ever stored hashed.
    secret_hash text        NOT NULL UNIQUE,
    grants      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL,
    deleted_at  timestamptz NULL
);

CREATE INDEX api_keys_project_idx ON api_keys (project_id);

CREATE TABLE quotas (
    id          text        PRIMARY KEY,
    project_id  text        NOT NULL REFERENCES projects (id),
    scope       text        NOT NULL,
    scope_ref   text        NULL,
    metric      text        NOT NULL,
    "window"    text        NOT NULL,
    "limit"     bigint      NOT NULL CHECK ("limit" > 0),
    mode        text        NOT NULL,
    meter_type  text        NULL,
    on_unpriced text        NULL,
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    -- The identity of a quota (409 QUOTA_CONFLICT); a null scope_ref or
    -- meter_type is a value here, so two "all keys" quotas collide.
    CONSTRAINT quotas_identity_key
        UNIQUE NULLS NOT DISTINCT (project_id, scope, scope_ref, metric, "window", meter_type)
);

-- One row per counter: (project, dimension, window). `dimension` is
-- meter's Dimension::encode (`p`, `k*`, `k:<id>`, `a:<id>`).
CREATE TABLE usage_aggregates (
    project_id  text        NOT NULL,
    dimension   text        NOT NULL,
    window_kind text        NOT NULL,
    window_key  text        NOT NULL,
    -- When the window resets; NULL for windows that never do.
    resets_at   timestamptz NULL,
    requests    bigint      NOT NULL DEFAULT 0,
    calls       bigint      NOT NULL DEFAULT 0,
    "rows"      bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (project_id, dimension, window_kind, window_key)
);

-- Open windows of a project (seeding the view after a flush).
CREATE INDEX usage_aggregates_open_idx ON usage_aggregates (project_id, resets_at);

-- The dedup set: every event id folded within the dedup horizon.
CREATE TABLE processed_events (
    project_id  text        NOT NULL,
    event_id    text        NOT NULL,
    occurred_at timestamptz NOT NULL,
    PRIMARY KEY (project_id, event_id)
);

-- Housekeeping purges ids older than the horizon.
CREATE INDEX processed_events_occurred_at_idx ON processed_events (occurred_at);

-- The next offset to read, per consumer and partition. Kafka's own committed
-- offsets are never used: this row moves in the fold's transaction.
CREATE TABLE consumer_offsets (
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    next_offset bigint      NOT NULL CHECK (next_offset >= 0),
    PRIMARY KEY (consumer, topic, "partition")
);
