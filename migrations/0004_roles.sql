-- Roles (ADR-0011): grant templates with a quota of their own. A key takes
-- its role's grants (narrowed, never widened) and its quota, counted on the
-- key's own counter; signed-in users named with the role get one counter each.
CREATE TABLE roles (
    id          text        PRIMARY KEY,
    project_id  text        NOT NULL REFERENCES projects (id),
    name        text        NOT NULL,
    grants      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- {"calls","rows","per"} or NULL.
    quota       jsonb       NULL,
    -- Administrators and break-glass callers: never limited or counted.
    exempt      boolean     NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL
);

CREATE INDEX roles_project_idx ON roles (project_id);

ALTER TABLE api_keys ADD COLUMN role_id text NULL REFERENCES roles (id);
