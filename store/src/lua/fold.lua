-- fold.lua: after the projector's durable commit, raises the durable totals,
-- drops the pending deltas of the folded events and leaves their tombstones
-- (View::apply_fold).
--
-- Why a script: the total that now contains an event and the removal of that
-- event's pending delta must be one step; between two separate commands a
-- check would count the event twice (or not at all).
--
-- ARGV[1]   base "P{p}:"
-- ARGV[2]   when the tombstones expire (ms): the fold's time + their TTL
-- ARGV[3]   C, the number of counters; then per counter 1 + #FIELDS values:
--             expire-at (ms, '' = never), then the durable totals in
--             FIELDS order (decimal strings)
-- KEYS[1..C]    P{p}:c:<name> per counter
-- KEYS[C+1..]   P{p}:ev:<event> per folded event
-- Totals are raised as raise_totals says: a sum is never lowered, the
-- footprint only by one that reflects more storage facts (so a stale fold
-- delivered late cannot bring back an old footprint). Each folded event's
-- index becomes a tombstone (its one field '~'), so a settle of it arriving
-- after its fold adds nothing (settle.lua adds only to a missing index).
-- Does not read or set the loaded marker. Returns C.

local base = ARGV[1]
local c = tonumber(ARGV[3])
local a = 4
for i = 1, c do
  raise_totals(KEYS[i], ARGV, a + 1)
  expire_at(KEYS[i], ARGV[a])
  a = a + 1 + #FIELDS
end
for i = c + 1, #KEYS do
  drop_event(base, KEYS[i])
  redis.call('HSET', KEYS[i], TOMBSTONE, '1')
  redis.call('PEXPIREAT', KEYS[i], ARGV[2])
end
return c
