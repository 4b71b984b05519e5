-- Roles (ADR-0011): see migrations/0004_roles.sql.
CREATE TABLE roles (
    id          TEXT    PRIMARY KEY,
    project_id  TEXT    NOT NULL REFERENCES projects (id),
    name        TEXT    NOT NULL,
    grants      TEXT    NOT NULL DEFAULT '{}',
    quota       TEXT    NULL,
    exempt      INTEGER NOT NULL DEFAULT 0,
    created_at  TEXT    NOT NULL
);

CREATE INDEX roles_project_idx ON roles (project_id);

ALTER TABLE api_keys ADD COLUMN role_id TEXT NULL REFERENCES roles (id);
