-- seed.lua: seeds a project from the log's state (View::seed): the durable
-- totals, the log tail's unfolded facts and its live reservations, then the
-- loaded marker.
--
-- Why a script: a check must never see the marker without everything the
-- seed restores (it would admit against too little), and "add unless this
-- event is already indexed" must be atomic, as in settle.lua.
--
-- KEYS[1]   P{p}:loaded
-- ARGV[1]   base "P{p}:" (every other key is derived from it: all share the
--           project's hash tag)
-- ARGV[2]   when a written event index may expire (ms): the seed's time + TTL
-- ARGV[3]   the seed's time (ms): holds whose lease is not after it are skipped
-- ARGV[4]   C; then per counter 2 + #FIELDS values: name, expire-at (ms,
--           '' = never), then the durable totals in FIELDS order
-- then      S; then per fact: event id, D, then per delta 3 values: counter
--           name, expire-at, the delta as a value list (common.lua)
-- then      H; then per reservation: id, lease end (ms), when its keys may
--           expire (ms), its estimate (a value list, '' = none), N, then N
--           counter names
-- Totals are raised as raise_totals says; a fact whose event is already
-- indexed (settled since the loss, or a tombstone: folded since) adds
-- nothing; reservations are held as check.lua holds them, but not one
-- already indexed (held, or released since the tail was read). The marker is set
-- to this server's run_id. Returns the number of facts added.

local base = ARGV[1]
local ev_expire_at = ARGV[2]
local at = tonumber(ARGV[3])
local a = 4

for _ = 1, tonumber(ARGV[a]) do
  local ckey = base .. 'c:' .. ARGV[a + 1]
  raise_totals(ckey, ARGV, a + 3)
  expire_at(ckey, ARGV[a + 2])
  a = a + 2 + #FIELDS
end
a = a + 1

local added = 0
local s = tonumber(ARGV[a])
a = a + 1
for _ = 1, s do
  local evkey = base .. 'ev:' .. ARGV[a]
  local d = tonumber(ARGV[a + 1])
  a = a + 2
  local fresh = redis.call('EXISTS', evkey) == 0
  local wrote = false
  for _ = 1, d do
    local name, exp, list = ARGV[a], ARGV[a + 1], ARGV[a + 2]
    a = a + 3
    if fresh and list ~= '' then
      local vals = split(list)
      if not valid_list(vals) then
        return redis.error_reply('tollgate: bad value list ' .. list)
      end
      local ckey = base .. 'c:' .. name
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

local h = tonumber(ARGV[a])
a = a + 1
for _ = 1, h do
  local rid, lease, until_, estimate, n = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], tonumber(ARGV[a + 4])
  a = a + 5
  if not valid_list(split(estimate)) then
    return redis.error_reply('tollgate: bad estimate ' .. estimate)
  end
  local reskey = base .. 'res:' .. rid
  -- Not one already indexed: held since the tail was read, or released
  -- since (a tombstone, see release in common.lua).
  local live = tonumber(lease) > at and redis.call('EXISTS', reskey) == 0
  local held = false
  for _ = 1, n do
    local name = ARGV[a]
    a = a + 1
    if live then
      local rkey = base .. 'r:' .. name
      redis.call('ZADD', rkey, lease, rid)
      extend_expiry(rkey, until_, false)
      if estimate ~= '' then
        local ekey = base .. 'e:' .. name
        redis.call('HSET', ekey, rid, estimate)
        extend_expiry(ekey, until_, false)
      end
      redis.call('SADD', reskey, name)
      held = true
    end
  end
  if held then
    extend_expiry(reskey, until_, true)
  end
end

redis.call('SET', KEYS[1], server_id())
return added
