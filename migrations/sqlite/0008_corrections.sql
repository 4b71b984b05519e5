-- Corrections (issue 9, item 8): see migrations/0008_corrections.sql. The
-- dedup set keeps, for every call and tokens event, what it counts now
-- (meter's `Counted` as JSON; '' for events that cannot be corrected).
ALTER TABLE processed_events ADD COLUMN counted TEXT NOT NULL DEFAULT '';
