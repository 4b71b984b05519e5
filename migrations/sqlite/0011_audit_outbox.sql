-- The audit trail from the log (migrations/0011_audit_outbox.sql, adapted
-- to SQLite): the audit outbox, and the audit log without its reference to
-- projects (SQLite drops a constraint by rebuilding the table).

CREATE TABLE audit_outbox (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    id             TEXT    NOT NULL UNIQUE,
    project_id     TEXT    NOT NULL,
    action         TEXT    NOT NULL,
    principal_type TEXT    NULL,
    principal_id   TEXT    NULL,
    resource       TEXT    NOT NULL,
    detail         TEXT    NOT NULL,
    once_key       TEXT    NULL UNIQUE,
    created_at     TEXT    NOT NULL,
    published_at   TEXT    NULL
) STRICT;

CREATE INDEX audit_outbox_pending_idx ON audit_outbox (seq) WHERE published_at IS NULL;

INSERT INTO audit_outbox (id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at)
SELECT id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at
FROM audit_log ORDER BY id;

CREATE TABLE audit_log_folded (
    id             TEXT    NOT NULL PRIMARY KEY,
    project_id     TEXT    NOT NULL,
    action         TEXT    NOT NULL,
    principal_type TEXT    NULL,
    principal_id   TEXT    NULL,
    resource       TEXT    NOT NULL,
    detail         TEXT    NOT NULL,
    once_key       TEXT    NULL UNIQUE,
    created_at     TEXT    NOT NULL
) STRICT;

INSERT INTO audit_log_folded SELECT id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at FROM audit_log;
DROP TABLE audit_log;
ALTER TABLE audit_log_folded RENAME TO audit_log;
CREATE INDEX audit_log_project_idx ON audit_log (project_id, id);
