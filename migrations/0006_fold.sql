-- A fold nothing stops and no clock can change (issue 9): the price book as
-- of receipt, the dead-letter outbox, and how far the fold has come in
-- receipt time.

-- Every price row is a version, recorded when it was put (`recorded_at`, set
-- by the store from its caller's clock): the fold prices a fact only with
-- the versions recorded at or before the fact's receipt, so a row put later
-- (with an earlier `effective_from`, or replacing a row of the same key and
-- `effective_from`) never re-prices what was received before it. Rows from
-- before versions count as known since always.
ALTER TABLE prices ADD COLUMN recorded_at timestamptz NOT NULL DEFAULT '0001-01-01T00:00:00Z';
ALTER TABLE prices ALTER COLUMN recorded_at DROP DEFAULT;
ALTER TABLE prices DROP CONSTRAINT prices_pkey;
ALTER TABLE prices ADD PRIMARY KEY (provider, model, component, effective_from, recorded_at);

-- The dead-letter outbox: every record a fold did not fold, with why,
-- written in the fold's transaction (the same one that moves the offsets
-- past it), then published to the dead-letter topic by the projector, once.
-- `mark` is where the topic ended (JSON, next offset per partition) before
-- the first attempt: a letter with a mark may be there already, so it is
-- looked for past the mark before it is published again. `claimed_by` and
-- `claimed_until` keep two publishers off one letter.
CREATE TABLE dead_letters (
    consumer      text        NOT NULL,
    topic         text        NOT NULL,
    "partition"   integer     NOT NULL,
    "offset"      bigint      NOT NULL,
    key           bytea       NULL,
    payload       bytea       NOT NULL,
    reason        text        NOT NULL,
    mark          jsonb       NULL,
    claimed_by    text        NULL,
    claimed_until timestamptz NULL,
    published     boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (consumer, topic, "partition", "offset")
);

CREATE INDEX dead_letters_pending_idx ON dead_letters (consumer, topic, "partition", "offset") WHERE NOT published;

-- The newest receipt time a consumer folded: what the dedup set's purge is
-- measured from (the fold's own position, never a wall clock).
CREATE TABLE fold_receipts (
    consumer       text        NOT NULL,
    topic          text        NOT NULL,
    newest_receipt timestamptz NOT NULL,
    PRIMARY KEY (consumer, topic)
);
