-- Webhooks (migrations/0010_webhooks.sql, adapted to SQLite): subscribers'
-- endpoints and the notification outbox. See the PostgreSQL file for why
-- each column is there.

CREATE TABLE webhook_endpoints (
    id                    TEXT    NOT NULL PRIMARY KEY,
    project_id            TEXT    NOT NULL REFERENCES projects (id),
    url                   TEXT    NOT NULL,
    event_types           TEXT    NOT NULL,
    description           TEXT    NULL,
    enabled               INTEGER NOT NULL,
    disabled_reason       TEXT    NULL,
    secret                TEXT    NOT NULL,
    previous_secret       TEXT    NULL,
    previous_secret_until TEXT    NULL,
    failing_since         TEXT    NULL,
    created_at            TEXT    NOT NULL,
    updated_at            TEXT    NOT NULL
) STRICT;

CREATE INDEX webhook_endpoints_project_idx ON webhook_endpoints (project_id, id);

CREATE TABLE notification_messages (
    id          TEXT    NOT NULL PRIMARY KEY,
    project_id  TEXT    NOT NULL REFERENCES projects (id),
    event_type  TEXT    NOT NULL,
    dedup_key   TEXT    NULL UNIQUE,
    body        TEXT    NOT NULL,
    is_test     INTEGER NOT NULL,
    created_at  TEXT    NOT NULL
) STRICT;

CREATE INDEX notification_messages_created_idx ON notification_messages (project_id, created_at);

CREATE TABLE webhook_deliveries (
    message_id      TEXT    NOT NULL REFERENCES notification_messages (id) ON DELETE CASCADE,
    endpoint_id     TEXT    NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    status          TEXT    NOT NULL,
    tries           INTEGER NOT NULL DEFAULT 0,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT    NOT NULL,
    claimed_by      TEXT    NULL,
    claimed_until   TEXT    NULL,
    PRIMARY KEY (endpoint_id, message_id)
) STRICT;

CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';

CREATE TABLE webhook_attempts (
    endpoint_id      TEXT    NOT NULL,
    message_id       TEXT    NOT NULL,
    number           INTEGER NOT NULL,
    at               TEXT    NOT NULL,
    status_code      INTEGER NULL,
    latency_ms       INTEGER NOT NULL,
    response         TEXT    NOT NULL,
    PRIMARY KEY (endpoint_id, message_id, number),
    FOREIGN KEY (endpoint_id, message_id) REFERENCES webhook_deliveries (endpoint_id, message_id) ON DELETE CASCADE
) STRICT;
