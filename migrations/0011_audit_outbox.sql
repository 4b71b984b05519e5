-- The audit trail from the log (DESIGN §12). Every audit entry is written
-- to this outbox in the transaction of what it records; the audit relay
-- publishes it to the audit topic and sets `published_at`; the audit
-- folder writes `audit_log` from the topic. So `audit_log` is a projection
-- of the topic, and survives a rebuild of the store.

CREATE TABLE audit_outbox (
    -- The order entries were written in: the order the relay publishes.
    seq            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The entry's id (see audit_log.id): what the folder deduplicates on.
    id             text COLLATE "C" NOT NULL UNIQUE,
    project_id     text        NOT NULL,
    action         text        NOT NULL,
    principal_type text        NULL,
    principal_id   text        NULL,
    resource       text        NOT NULL,
    detail         jsonb       NOT NULL,
    -- What makes an entry written at most once (see audit_log.once_key),
    -- unique here so that "once" holds before the log.
    once_key       text        NULL UNIQUE,
    created_at     timestamptz NOT NULL,
    -- When the relay had it acknowledged by the topic; null while pending.
    published_at   timestamptz NULL
);

CREATE INDEX audit_outbox_pending_idx ON audit_outbox (seq) WHERE published_at IS NULL;

-- Entries written before the outbox existed are not on the topic yet: the
-- relay publishes them (the folder finds them in audit_log and adds nothing).
INSERT INTO audit_outbox (id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at)
SELECT id, project_id, action, principal_type, principal_id, resource, detail, once_key, created_at
FROM audit_log ORDER BY id;

-- The folder writes what the topic holds, also into a fresh database whose
-- projects are not there yet: the audit log no longer refers to them.
ALTER TABLE audit_log DROP CONSTRAINT IF EXISTS audit_log_project_id_fkey;
