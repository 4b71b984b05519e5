-- settle.lua: records settled facts of one project as pending and releases
-- their reservations (View::settle), the whole slice in one call.
--
-- Why a script: a reservation must turn into its real delta in one step (never
-- counted twice, never in neither), and "add unless this event is already
-- pending" must be atomic so the same event id counts once.
--
-- ARGV[1]   base "P{p}:" (for the zsets of a reservation, found at run time)
-- ARGV[2]   when a written event index may expire (ms): the settle's time +
--           the index's TTL
-- ARGV[3]   when the tombstone of a hold this view does not have (lost with
--           a flush) may expire (ms): the settle's time + LEASE_GRACE
-- ARGV[4]   S, the number of settlements; then per settlement:
--             event id, reservation id ('' = none), D = number of deltas,
--             then per delta 3 values: counter name, expire-at (ms, '' =
--             never), the delta as a value list (see common.lua; '' = all
--             zero; one delta per counter; sto may be negative)
-- KEYS, walked in the same order: per settlement
--             P{p}:ev:<event>, P{p}:res:<rid> (only when a reservation is given),
--             P{p}:c:<name> per delta
-- The event index keeps each value list as given, so unsettle and fold take
-- back exactly what was added, every field included.
-- Returns the number of settlements whose deltas were added (not already pending).

local base = ARGV[1]
local ev_expire_at = ARGV[2]
local lost_until = ARGV[3]
local s = tonumber(ARGV[4])
local a, k = 5, 1
local added = 0

for _ = 1, s do
  local rid, d = ARGV[a + 1], tonumber(ARGV[a + 2])
  a = a + 3
  local evkey = KEYS[k]
  k = k + 1
  if rid ~= '' then
    release(base, KEYS[k], rid, lost_until)
    k = k + 1
  end
  local fresh = redis.call('EXISTS', evkey) == 0
  local wrote = false
  for _ = 1, d do
    local name, exp, list = ARGV[a], ARGV[a + 1], ARGV[a + 2]
    a = a + 3
    local ckey = KEYS[k]
    k = k + 1
    if fresh and list ~= '' then
      local vals = split(list)
      if not valid_list(vals) then
        return redis.error_reply('tollgate: bad value list ' .. list)
      end
      add_pending(ckey, vals, false)
      expire_at(ckey, exp)
      redis.call('HSET', evkey, name, list)
      wrote = true
    end
  end
  if wrote then
    redis.call('PEXPIREAT', evkey, ev_expire_at)
    added = added + 1
  end
end

return added
