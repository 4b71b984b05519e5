-- settle.lua: records settled facts of one project as pending and releases
-- their reservations (View::settle), the whole slice in one call.
--
-- Why a script: a reservation must turn into its real delta in one step (never
-- counted twice, never in neither), and "add unless this event is already
-- pending" must be atomic so the same event id counts once.
--
-- ARGV[1]   base "P{p}:" (for the zsets of a reservation, found at run time)
-- ARGV[2]   TTL of an event index (ms)
-- ARGV[3]   S, the number of settlements; then per settlement:
--             event id, reservation id ('' = none), D = number of deltas,
--             then per delta 5 values: counter name, expire-at (ms, '' = never),
--             req, calls, rows (decimal strings; one delta per counter)
-- KEYS, walked in the same order: per settlement
--             P{p}:ev:<event>, P{p}:res:<rid> (only when a reservation is given),
--             P{p}:c:<name> per delta
-- Returns the number of settlements whose deltas were added (not already pending).

local base = ARGV[1]
local ttl = ARGV[2]
local s = tonumber(ARGV[3])
local a, k = 4, 1
local added = 0

for _ = 1, s do
  local rid, d = ARGV[a + 1], tonumber(ARGV[a + 2])
  a = a + 3
  local evkey = KEYS[k]
  k = k + 1
  if rid ~= '' then
    release(base, KEYS[k], rid)
    k = k + 1
  end
  local fresh = redis.call('EXISTS', evkey) == 0
  local wrote = false
  for _ = 1, d do
    local name, exp, req, calls, rows = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    a = a + 5
    local ckey = KEYS[k]
    k = k + 1
    if fresh and (req ~= '0' or calls ~= '0' or rows ~= '0') then
      add_pending(ckey, '', req, calls, rows)
      expire_at(ckey, exp)
      redis.call('HSET', evkey, name, req .. ',' .. calls .. ',' .. rows)
      wrote = true
    end
  end
  if wrote then
    redis.call('PEXPIRE', evkey, ttl)
    added = added + 1
  end
end

return added
