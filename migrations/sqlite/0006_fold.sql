-- migrations/0006_fold.sql, adapted to SQLite: the price book as of
-- receipt, the dead-letter outbox, and how far the fold has come in receipt
-- time.

-- Every price row is a version, recorded when it was put; see the
-- PostgreSQL migration. SQLite cannot change a primary key in place, so the
-- table is rebuilt; rows from before versions count as known since always.
CREATE TABLE prices_versions (
    provider         TEXT    NOT NULL,
    model            TEXT    NOT NULL,
    -- `input_tokens`, `output_tokens`, `cached_tokens`.
    component        TEXT    NOT NULL,
    effective_from   TEXT    NOT NULL,
    -- Picodollars per unit (one token).
    unit_price_picos INTEGER NOT NULL CHECK (unit_price_picos >= 0),
    -- When the book learnt this version.
    recorded_at      TEXT    NOT NULL,
    PRIMARY KEY (provider, model, component, effective_from, recorded_at)
) STRICT, WITHOUT ROWID;

INSERT INTO prices_versions (provider, model, component, effective_from, unit_price_picos, recorded_at)
SELECT provider, model, component, effective_from, unit_price_picos, '0001-01-01T00:00:00.000000Z' FROM prices;

DROP TABLE prices;
ALTER TABLE prices_versions RENAME TO prices;

-- The dead-letter outbox; see the PostgreSQL migration. Bytes are BLOBs,
-- `mark` is JSON text, `published` 0 or 1.
CREATE TABLE dead_letters (
    consumer      TEXT    NOT NULL,
    topic         TEXT    NOT NULL,
    "partition"   INTEGER NOT NULL,
    "offset"      INTEGER NOT NULL,
    key           BLOB    NULL,
    payload       BLOB    NOT NULL,
    reason        TEXT    NOT NULL,
    mark          TEXT    NULL,
    claimed_by    TEXT    NULL,
    claimed_until TEXT    NULL,
    published     INTEGER NOT NULL DEFAULT 0 CHECK (published IN (0, 1)),
    PRIMARY KEY (consumer, topic, "partition", "offset")
) STRICT, WITHOUT ROWID;

CREATE INDEX dead_letters_pending_idx ON dead_letters (consumer, topic, "partition", "offset") WHERE published = 0;

-- The newest receipt time a consumer folded (the dedup set's purge is
-- measured from it).
CREATE TABLE fold_receipts (
    consumer       TEXT NOT NULL,
    topic          TEXT NOT NULL,
    newest_receipt TEXT NOT NULL,
    PRIMARY KEY (consumer, topic)
) STRICT, WITHOUT ROWID;
