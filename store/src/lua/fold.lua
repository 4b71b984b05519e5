-- fold.lua: after the projector's durable commit, raises the durable totals
-- and drops the pending deltas of the folded events (View::apply_fold).
--
-- Why a script: the total that now contains an event and the removal of that
-- event's pending delta must be one step; between two separate commands a
-- check would count the event twice (or not at all).
--
-- ARGV[1]   base "P{p}:"
-- ARGV[2]   C, the number of counters; then per counter 4 values:
--             expire-at (ms, '' = never), t_req, t_calls, t_rows
-- KEYS[1..C]    P{p}:c:<name> per counter
-- KEYS[C+1..]   P{p}:ev:<event> per folded event
-- A total is never lowered (t = max(current, new)). Does not read or set the
-- loaded marker. Returns C.

local base = ARGV[1]
local c = tonumber(ARGV[2])
local a = 3
for i = 1, c do
  raise_totals(KEYS[i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
  expire_at(KEYS[i], ARGV[a])
  a = a + 4
end
for i = c + 1, #KEYS do
  drop_event(base, KEYS[i])
end
return c
