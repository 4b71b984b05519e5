-- Export schedules (issue 11 item 6): export definitions the notifier runs
-- on a cadence (`meter::export::schedule`). A notifier claims a due
-- schedule (`claimed_by`, `claimed_until`: a lease, so two notifiers never
-- run one schedule at once, and a notifier that dies mid-run leaves a claim
-- that lapses), runs one export per project, and sets `next_run_at`.
--
-- A run a schedule started names it (`export_runs.schedule_id`); deleting
-- the schedule keeps its runs, which still count for their exports.

CREATE TABLE export_schedules (
    -- `exs_…`.
    id            text COLLATE "C" PRIMARY KEY,
    -- The project ids, a JSON array; NULL for every project.
    projects      jsonb       NULL,
    -- `day` or `calendar_month`.
    period_kind   text        NOT NULL,
    -- The customer dimensions, `+`-joined in order (`api_key+user`).
    dimensions    text        NOT NULL,
    grace_secs    bigint      NOT NULL CHECK (grace_secs >= 0),
    -- csv, jsonl, parquet.
    format        text        NOT NULL,
    -- A relative directory under the notifier's export directory.
    destination   text        NOT NULL,
    -- hourly, daily, monthly.
    cadence       text        NOT NULL,
    -- The IANA zone of the cadence's boundaries.
    timezone      text        NOT NULL,
    enabled       boolean     NOT NULL,
    next_run_at   timestamptz NOT NULL,
    last_run_at   timestamptz NULL,
    claimed_by    text        NULL,
    claimed_until timestamptz NULL,
    created_at    timestamptz NOT NULL,
    updated_at    timestamptz NOT NULL
);

CREATE INDEX export_schedules_due_idx ON export_schedules (next_run_at) WHERE enabled;

ALTER TABLE export_runs ADD COLUMN schedule_id text NULL;

CREATE INDEX export_runs_schedule_idx ON export_runs (schedule_id, started_at) WHERE schedule_id IS NOT NULL;
