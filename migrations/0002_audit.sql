-- The audit log: admin changes to quotas (written in the transaction of the
-- change) and monitor-quota breaches (written once per quota and window).

CREATE TABLE audit_log (
    -- Time-ordered (UUIDv7); compared bytewise so that id order is time
    -- order whatever the database's collation. The cursor of a page.
    id             text COLLATE "C" PRIMARY KEY,
    project_id     text        NOT NULL REFERENCES projects (id),
    -- `quotas:MonitorBreach`, `quotas:CreateQuota`, …
    action         text        NOT NULL,
    -- Both null when no principal authorised it (a monitor breach).
    principal_type text        NULL,
    principal_id   text        NULL,
    -- The quota the entry is about.
    resource       text        NOT NULL,
    -- Tagged by `kind` (`quota_monitor_breach`, `quota_change`).
    detail         jsonb       NOT NULL,
    -- What makes an entry written at most once: `<quota id>/<window key>`
    -- for a monitor breach; null (never colliding) for the rest.
    once_key       text        NULL UNIQUE,
    created_at     timestamptz NOT NULL
);

CREATE INDEX audit_log_project_idx ON audit_log (project_id, id);
