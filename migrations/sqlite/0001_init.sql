-- Tollgate's embedded store (`tollgate dev`): the tables of
-- migrations/0001_init.sql, adapted to SQLite. The aggregates, the dedup set
-- and the consumer offsets are only ever written together, in one
-- transaction per folded batch.
--
-- Timestamps are TEXT in one fixed form, RFC 3339 in UTC with exactly six
-- fractional digits (`2026-07-07T12:31:10.000000Z`), so comparing and sorting
-- the text compares and sorts the instants. SqliteStore writes every one.
-- Tables are STRICT: a value of the wrong type is an error, not a coercion.

CREATE TABLE projects (
    id          TEXT    NOT NULL PRIMARY KEY,
    name        TEXT    NOT NULL,
    -- IANA zone name; immutable, calendar windows already folded depend on it.
    timezone    TEXT    NOT NULL DEFAULT 'UTC',
    created_at  TEXT    NOT NULL
) STRICT;

CREATE TABLE api_keys (
    id          TEXT    NOT NULL PRIMARY KEY,
    project_id  TEXT    NOT NULL REFERENCES projects (id),
    name        TEXT    NOT NULL,
    prefix      TEXT    NOT NULL,
    -- The secret is only ever stored hashed.
    secret_hash TEXT    NOT NULL UNIQUE,
    -- JSON text.
    grants      TEXT    NOT NULL DEFAULT '{}',
    created_at  TEXT    NOT NULL,
    deleted_at  TEXT    NULL
) STRICT;

CREATE INDEX api_keys_project_idx ON api_keys (project_id);

CREATE TABLE quotas (
    id          TEXT    NOT NULL PRIMARY KEY,
    project_id  TEXT    NOT NULL REFERENCES projects (id),
    scope       TEXT    NOT NULL,
    scope_ref   TEXT    NULL,
    metric      TEXT    NOT NULL,
    "window"    TEXT    NOT NULL,
    "limit"     INTEGER NOT NULL CHECK ("limit" > 0),
    mode        TEXT    NOT NULL,
    meter_type  TEXT    NULL,
    on_unpriced TEXT    NULL,
    created_at  TEXT    NOT NULL,
    updated_at  TEXT    NOT NULL
) STRICT;

-- The identity of a quota (409 QUOTA_CONFLICT). PostgreSQL says UNIQUE NULLS
-- NOT DISTINCT; SQLite treats NULLs as distinct in a unique index, so each
-- nullable column enters as its value with NULL folded to '' plus whether it
-- is NULL: two "all keys" quotas collide, and NULL still differs from ''.
CREATE UNIQUE INDEX quotas_identity_key ON quotas (
    project_id,
    scope,
    ifnull(scope_ref, ''),
    scope_ref IS NULL,
    metric,
    "window",
    ifnull(meter_type, ''),
    meter_type IS NULL
);

CREATE INDEX quotas_project_idx ON quotas (project_id, created_at, id);

-- One row per counter: (project, dimension, window). `dimension` is
-- meter's Dimension::encode (`p`, `k*`, `k:<id>`, `a:<id>`).
CREATE TABLE usage_aggregates (
    project_id  TEXT    NOT NULL,
    dimension   TEXT    NOT NULL,
    window_kind TEXT    NOT NULL,
    window_key  TEXT    NOT NULL,
    -- When the window resets; NULL for windows that never do.
    resets_at   TEXT    NULL,
    requests    INTEGER NOT NULL DEFAULT 0,
    calls       INTEGER NOT NULL DEFAULT 0,
    "rows"      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (project_id, dimension, window_kind, window_key)
) STRICT, WITHOUT ROWID;

-- Open windows of a project (seeding the view after a flush).
CREATE INDEX usage_aggregates_open_idx ON usage_aggregates (project_id, resets_at);

-- The dedup set: every event id folded within the dedup horizon.
CREATE TABLE processed_events (
    project_id  TEXT    NOT NULL,
    event_id    TEXT    NOT NULL,
    occurred_at TEXT    NOT NULL,
    PRIMARY KEY (project_id, event_id)
) STRICT, WITHOUT ROWID;

-- Housekeeping purges ids older than the horizon.
CREATE INDEX processed_events_occurred_at_idx ON processed_events (occurred_at);

-- The next offset to read, per consumer and partition, moved in the fold's
-- transaction.
CREATE TABLE consumer_offsets (
    consumer    TEXT    NOT NULL,
    topic       TEXT    NOT NULL,
    "partition" INTEGER NOT NULL,
    next_offset INTEGER NOT NULL CHECK (next_offset >= 0),
    PRIMARY KEY (consumer, topic, "partition")
) STRICT, WITHOUT ROWID;
