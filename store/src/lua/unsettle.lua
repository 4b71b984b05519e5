-- unsettle.lua: takes back the pending deltas of events that never reached
-- the log (View::unsettle).
--
-- Why a script: each event's contributions are read from its index and
-- subtracted from every counter with nothing in between, so a concurrent
-- settle or fold of the same event never sees half of it.
--
-- KEYS      P{p}:ev:<event> per event
-- ARGV[1]   base "P{p}:" (the counters named in an index are found at run time)
-- Returns the number of events given.

for i = 1, #KEYS do
  drop_event(ARGV[1], KEYS[i])
end
return #KEYS
