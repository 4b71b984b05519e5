-- Projectors sharing the usage topic's partitions (issue 14 item 4,
-- `meter::share`): each projector is a member with a lease it renews on
-- every heartbeat, and each partition has at most one owner. An owner whose
-- membership lapsed owns nothing: its partitions are free for the others.
-- These rows spread the work; what makes each record folded once is the
-- offsets in `consumer_offsets`, moved in the fold's own transaction.

CREATE TABLE projector_members (
    consumer   text        NOT NULL,
    topic      text        NOT NULL,
    member     text        NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (consumer, topic, member)
);

CREATE TABLE partition_owners (
    consumer  text    NOT NULL,
    topic     text    NOT NULL,
    partition integer NOT NULL,
    -- A member's name, or NULL when free.
    owner     text    NULL,
    PRIMARY KEY (consumer, topic, partition)
);
