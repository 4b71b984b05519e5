-- Export schedules (migrations/0017_export_schedules.sql, adapted to
-- SQLite). See the PostgreSQL file for why each column is there.

CREATE TABLE export_schedules (
    id            TEXT    NOT NULL PRIMARY KEY,
    -- A JSON array of project ids; NULL for every project.
    projects      TEXT    NULL,
    period_kind   TEXT    NOT NULL,
    dimensions    TEXT    NOT NULL,
    grace_secs    INTEGER NOT NULL CHECK (grace_secs >= 0),
    format        TEXT    NOT NULL,
    destination   TEXT    NOT NULL,
    cadence       TEXT    NOT NULL,
    timezone      TEXT    NOT NULL,
    enabled       INTEGER NOT NULL,
    next_run_at   TEXT    NOT NULL,
    last_run_at   TEXT    NULL,
    claimed_by    TEXT    NULL,
    claimed_until TEXT    NULL,
    created_at    TEXT    NOT NULL,
    updated_at    TEXT    NOT NULL
) STRICT;

CREATE INDEX export_schedules_due_idx ON export_schedules (next_run_at) WHERE enabled;

ALTER TABLE export_runs ADD COLUMN schedule_id TEXT NULL;

CREATE INDEX export_runs_schedule_idx ON export_runs (schedule_id, started_at) WHERE schedule_id IS NOT NULL;
