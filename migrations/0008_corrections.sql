-- Corrections (issue 9, item 8): a `correction` event amends or voids an
-- earlier call or tokens event by id, folded as the difference between what
-- the original counts now and what it should count. So that the fold stays
-- a function of the log (a replay from offset 0 reads the same originals),
-- the dedup set keeps, for every call and tokens event it holds, what that
-- event counts now: meter's `Counted` as JSON (the event with its latest
-- quantities, the zone its windows were taken in, whether it is voided).
-- Written in the fold's transaction, purged with the id (the dedup
-- horizon); '' for events that cannot be corrected.
ALTER TABLE processed_events ADD COLUMN counted text NOT NULL DEFAULT '';
