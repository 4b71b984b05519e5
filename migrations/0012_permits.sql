-- Concurrency permits (ADR-0196 §2): one row per slot of a holder's pool
-- (`<project>/k:<key>` or `<project>/u:<user>`) and of the installation's
-- (holder `*`). A claim is one INSERT … ON CONFLICT DO UPDATE … WHERE
-- expired over generate_series(1, cap), so two gateways never take the same
-- slot. UNLOGGED: a crash of the database empties it, which frees every
-- permit (the safe direction); nothing here needs to survive one.
CREATE UNLOGGED TABLE heavy_permit (
    holder     TEXT        NOT NULL,
    slot       INTEGER     NOT NULL,
    permit_id  TEXT        NOT NULL,
    token      BIGINT      NOT NULL,
    lease_ms   BIGINT      NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (holder, slot)
);

CREATE INDEX heavy_permit_by_id ON heavy_permit (permit_id);

-- Fencing tokens: each permit's is greater than every earlier one's.
CREATE SEQUENCE heavy_permit_token;
