-- Installation-wide audit entries: a write of the price book, which is one
-- for the whole installation, belongs to no project. Its entry has a null
-- project_id, in the outbox and in the folded log alike, and is read with
-- `GET /v1/audit?scope=installation`.

ALTER TABLE audit_outbox ALTER COLUMN project_id DROP NOT NULL;
ALTER TABLE audit_log ALTER COLUMN project_id DROP NOT NULL;

-- The installation's entries in id order, as the project's are read through
-- audit_log_project_idx.
CREATE INDEX audit_log_installation_idx ON audit_log (id) WHERE project_id IS NULL;
