-- release.lua: frees a reservation without settling it (View::release).
--
-- Why a script: the counters a reservation holds are read from its index and
-- freed in the same step, so no slot is left held by a half-released id.
--
-- KEYS[1]   P{p}:res:<rid>
-- ARGV[1]   base "P{p}:" (the zsets of the reservation are found at run time)
-- ARGV[2]   reservation id
-- ARGV[3]   when the tombstone of a hold this view does not have (lost with
--           a flush) may expire (ms): the release's time + LEASE_GRACE
-- Returns 1.

release(ARGV[1], KEYS[1], ARGV[2], ARGV[3])
return 1
