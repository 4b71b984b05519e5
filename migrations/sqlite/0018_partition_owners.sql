-- Projectors sharing the usage topic's partitions: see
-- migrations/0018_partition_owners.sql.

CREATE TABLE projector_members (
    consumer   TEXT NOT NULL,
    topic      TEXT NOT NULL,
    member     TEXT NOT NULL,
    expires_at TEXT NOT NULL,
    PRIMARY KEY (consumer, topic, member)
) STRICT;

CREATE TABLE partition_owners (
    consumer  TEXT    NOT NULL,
    topic     TEXT    NOT NULL,
    partition INTEGER NOT NULL,
    owner     TEXT    NULL,
    PRIMARY KEY (consumer, topic, partition)
) STRICT;
