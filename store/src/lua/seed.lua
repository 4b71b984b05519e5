-- seed.lua: loads a project's durable totals into the view (View::seed).
--
-- Why a script: the totals and the loaded marker appear together; a check
-- never sees the marker without the totals (it would admit against zero).
--
-- KEYS[1]       P{p}:loaded
-- KEYS[2..]     P{p}:c:<name> per counter
-- ARGV          per counter 4 values: expire-at (ms, '' = never), t_req, t_calls, t_rows
-- A total is never lowered (t = max(current, new)). Returns the number of counters.

local a = 1
for i = 2, #KEYS do
  raise_totals(KEYS[i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
  expire_at(KEYS[i], ARGV[a])
  a = a + 4
end
redis.call('SET', KEYS[1], '1')
return #KEYS - 1
