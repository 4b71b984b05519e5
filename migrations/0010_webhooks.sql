-- Webhooks (issue 10): subscribers' endpoints, and the notification outbox
-- a notifier delivers from (Standard Webhooks v1).
--
-- A message is enqueued once: `dedup_key` (quota, window key, kind,
-- threshold) is unique, so a fold, a redelivered batch and a replay add it
-- at most once; a test message has none. Its id is the `webhook-id` of every
-- attempt, its body the exact bytes signed and sent.
--
-- A delivery is one message to one endpoint: a row, so it survives any
-- restart. A notifier claims due deliveries (`claimed_by`, `claimed_until`)
-- before it sends them, so two notifiers never send one at once; a claim
-- that lapses (its notifier died) is taken by another. Every attempt is a
-- row of `webhook_attempts`, the delivery log.

CREATE TABLE webhook_endpoints (
    id                    text COLLATE "C" PRIMARY KEY,
    project_id            text        NOT NULL REFERENCES projects (id),
    url                   text        NOT NULL,
    -- JSON list: exact names, `quota.*` or `*`.
    event_types           jsonb       NOT NULL,
    description           text        NULL,
    enabled               boolean     NOT NULL,
    -- Why delivery disabled it (410, five days failing); null otherwise.
    disabled_reason       text        NULL,
    secret                text        NOT NULL,
    -- The secret rotated out, signing beside the new one until then.
    previous_secret       text        NULL,
    previous_secret_until timestamptz NULL,
    -- Since when every attempt failed; null after a success.
    failing_since         timestamptz NULL,
    created_at            timestamptz NOT NULL,
    updated_at            timestamptz NOT NULL
);

CREATE INDEX webhook_endpoints_project_idx ON webhook_endpoints (project_id, id);

CREATE TABLE notification_messages (
    -- Time-ordered (UUIDv7): the cursor of the delivery log.
    id          text COLLATE "C" PRIMARY KEY,
    project_id  text        NOT NULL REFERENCES projects (id),
    event_type  text        NOT NULL,
    dedup_key   text        NULL UNIQUE,
    body        text        NOT NULL,
    is_test     boolean     NOT NULL,
    created_at  timestamptz NOT NULL
);

CREATE INDEX notification_messages_created_idx ON notification_messages (project_id, created_at);

CREATE TABLE webhook_deliveries (
    message_id      text COLLATE "C" NOT NULL REFERENCES notification_messages (id) ON DELETE CASCADE,
    endpoint_id     text COLLATE "C" NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    -- pending, succeeded, failed
    status          text        NOT NULL,
    -- Attempts since the last resend (what the schedule counts) and in all.
    tries           bigint      NOT NULL DEFAULT 0,
    attempts        bigint      NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL,
    claimed_by      text        NULL,
    claimed_until   timestamptz NULL,
    PRIMARY KEY (endpoint_id, message_id)
);

CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';

CREATE TABLE webhook_attempts (
    endpoint_id      text COLLATE "C" NOT NULL,
    message_id       text COLLATE "C" NOT NULL,
    number           bigint      NOT NULL,
    at               timestamptz NOT NULL,
    status_code      bigint      NULL,
    latency_ms       bigint      NOT NULL,
    response         text        NOT NULL,
    PRIMARY KEY (endpoint_id, message_id, number),
    FOREIGN KEY (endpoint_id, message_id) REFERENCES webhook_deliveries (endpoint_id, message_id) ON DELETE CASCADE
);
