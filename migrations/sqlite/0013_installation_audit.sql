-- Installation-wide audit entries (migrations/0013_installation_audit.sql,
-- adapted to SQLite): project_id nullable in the audit outbox and the audit
-- log. SQLite changes a column's constraint by rebuilding the table; the
-- outbox keeps its `seq` (the relay's order) and its AUTOINCREMENT counter.

CREATE TABLE audit_outbox_nullable (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,
    id             TEXT    NOT NULL UNIQUE,
    project_id     TEXT    NULL,
    action         TEXT    NOT NULL,
    principal_type TEXT    NULL,
    principal_id   TEXT    NULL,
    resource       TEXT    NOT NULL,
    detail         TEXT    NOT NULL,
    once_key       TEXT    NULL UNIQUE,
    created_at     TEXT    NOT NULL,
    published_at   TEXT    NULL
) STRICT;

INSERT INTO audit_outbox_nullable
    (seq, id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at, published_at)
SELECT seq, id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at, published_at
FROM audit_outbox ORDER BY seq;
DROP TABLE audit_outbox;
ALTER TABLE audit_outbox_nullable RENAME TO audit_outbox;
CREATE INDEX audit_outbox_pending_idx ON audit_outbox (seq) WHERE published_at IS NULL;

CREATE TABLE audit_log_nullable (
    id             TEXT    NOT NULL PRIMARY KEY,
    project_id     TEXT    NULL,
    action         TEXT    NOT NULL,
    principal_type TEXT    NULL,
    principal_id   TEXT    NULL,
    resource       TEXT    NOT NULL,
    detail         TEXT    NOT NULL,
    once_key       TEXT    NULL UNIQUE,
    created_at     TEXT    NOT NULL
) STRICT;

INSERT INTO audit_log_nullable
SELECT id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at FROM audit_log;
DROP TABLE audit_log;
ALTER TABLE audit_log_nullable RENAME TO audit_log;
CREATE INDEX audit_log_project_idx ON audit_log (project_id, id);
CREATE INDEX audit_log_installation_idx ON audit_log (id) WHERE project_id IS NULL;
