-- seed.lua: loads a project's durable totals into the view (View::seed).
--
-- Why a script: the totals and the loaded marker appear together; a check
-- never sees the marker without the totals (it would admit against zero).
--
-- KEYS[1]       P{p}:loaded
-- KEYS[2..]     P{p}:c:<name> per counter
-- ARGV          per counter 1 + #FIELDS values: expire-at (ms, '' = never),
--               then the durable totals in FIELDS order (decimal strings)
-- Totals are raised as raise_totals says: a sum is never lowered, the
-- footprint only by one that reflects more storage facts. Returns the
-- number of counters.

local a = 1
for i = 2, #KEYS do
  raise_totals(KEYS[i], a + 1)
  expire_at(KEYS[i], ARGV[a])
  a = a + 1 + #FIELDS
end
redis.call('SET', KEYS[1], '1')
return #KEYS - 1
