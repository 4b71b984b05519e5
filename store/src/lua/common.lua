-- common.lua: helpers prepended (by RedisView) to every view script; not a
-- script on its own.
--
-- Key layout (P = prefix, p = project id, n = CounterKey::encode()):
--   P{p}:c:<n>        hash  t_req t_calls t_rows (durable, from the projector)
--                           p_req p_calls p_rows (pending: settled, not folded)
--   P{p}:r:<n>        zset  reservation id -> lease expiry (ms)
--   P{p}:res:<rid>    set   the counter names a reservation holds
--   P{p}:ev:<event>   hash  counter name -> "req,calls,rows" pending of that event
--   P{p}:loaded       the project's durable totals were seeded here
-- All keys of a project share the hash tag {p}, so keys a script derives at
-- run time (from `base` = "P{p}:") live in the same cluster slot.
--
-- Numbers: amounts travel as decimal strings and are written with
-- HSET/HINCRBY from those strings, so what is stored is exact (i64). Sums and
-- limit comparisons are done in Lua numbers (doubles): exact below 2^53.
-- Durable totals are compared as canonical decimal strings (exact for u64).

-- a > b for canonical non-negative decimal strings.
local function dec_gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end

-- Sets an absolute expiry (ms) unless `at` is '' (the counter never resets).
local function expire_at(key, at)
  if at ~= '' then redis.call('PEXPIREAT', key, at) end
end

-- Moves a key's expiry to `at` (ms) unless it already expires later.
local function extend_expiry(key, at)
  local cur = redis.call('PEXPIRETIME', key)
  if cur < 0 or cur < tonumber(at) then redis.call('PEXPIREAT', key, at) end
end

-- t_* = max(current, new): a durable total never goes down.
local function raise_totals(key, req, calls, rows)
  local cur = redis.call('HMGET', key, 't_req', 't_calls', 't_rows')
  local new = { req, calls, rows }
  local fields = { 't_req', 't_calls', 't_rows' }
  for i = 1, 3 do
    if not cur[i] or dec_gt(new[i], cur[i]) then
      redis.call('HSET', key, fields[i], new[i])
    end
  end
end

-- Adds (sign '') or subtracts (sign '-') one contribution to a counter's pending.
local function add_pending(key, sign, req, calls, rows)
  if req ~= '0' then redis.call('HINCRBY', key, 'p_req', sign .. req) end
  if calls ~= '0' then redis.call('HINCRBY', key, 'p_calls', sign .. calls) end
  if rows ~= '0' then redis.call('HINCRBY', key, 'p_rows', sign .. rows) end
end

-- Takes back every pending contribution an event recorded, then forgets the
-- event. A counter that already expired is left alone (not recreated).
local function drop_event(base, evkey)
  local kv = redis.call('HGETALL', evkey)
  for i = 1, #kv, 2 do
    local ckey = base .. 'c:' .. kv[i]
    local req, calls, rows = string.match(kv[i + 1], '^(%d+),(%d+),(%d+)$')
    if req and redis.call('EXISTS', ckey) == 1 then
      add_pending(ckey, '-', req, calls, rows)
    end
  end
  redis.call('DEL', evkey)
end

-- Frees a reservation on every counter it holds.
local function release(base, reskey, rid)
  local names = redis.call('SMEMBERS', reskey)
  for _, n in ipairs(names) do
    redis.call('ZREM', base .. 'r:' .. n, rid)
  end
  redis.call('DEL', reskey)
end

-- A counter's numbers from HMGET fields (missing = 0).
local function num(v)
  return tonumber(v or '0') or 0
end

