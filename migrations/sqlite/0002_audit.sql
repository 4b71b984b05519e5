-- The audit log (migrations/0002_audit.sql, adapted to SQLite): admin
-- changes to quotas (written in the transaction of the change) and
-- monitor-quota breaches (written once per quota and window).

CREATE TABLE audit_log (
    -- Time-ordered (UUIDv7); text compares bytewise, so id order is time
    -- order. The cursor of a page.
    id             TEXT    NOT NULL PRIMARY KEY,
    project_id     TEXT    NOT NULL REFERENCES projects (id),
    -- `quotas:MonitorBreach`, `quotas:CreateQuota`, …
    action         TEXT    NOT NULL,
    -- Both null when no principal authorised it (a monitor breach).
    principal_type TEXT    NULL,
    principal_id   TEXT    NULL,
    -- The quota the entry is about.
    resource       TEXT    NOT NULL,
    -- JSON text tagged by `kind` (`quota_monitor_breach`, `quota_change`).
    detail         TEXT    NOT NULL,
    -- What makes an entry written at most once: `<quota id>/<window key>`
    -- for a monitor breach; null (never colliding) for the rest.
    once_key       TEXT    NULL UNIQUE,
    created_at     TEXT    NOT NULL
) STRICT;

CREATE INDEX audit_log_project_idx ON audit_log (project_id, id);
