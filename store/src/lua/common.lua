-- common.lua: the helpers of the view's function library (RedisView puts
-- them after the field prelude and before the functions, each of which is
-- one of the other files, wrapped as `function(KEYS, ARGV) ... end`); not a
-- library on its own. The rules these scripts follow are meter's reference
-- model of the view (meter/src/view/model.rs); a property test
-- (store/tests/view_model.rs) checks them against it.
--
-- Key layout (P = prefix, p = project id, n = CounterKey::encode()):
--   P{p}:c:<n>        hash  t_<f> (durable, from the projector) and
--                           p_<f> (pending: settled, not folded) for each
--                           field f of FIELDS below; a missing field is 0
--   P{p}:r:<n>        zset  reservation id -> lease expiry (ms)
--   P{p}:e:<n>        hash  reservation id -> the estimate it holds on the
--                           counter besides one call (a value list); only
--                           beside its lease in r:<n>, same expiry written
--   P{p}:res:<rid>    set   the counter names a reservation holds; once
--                           released, a tombstone: the one member '~'
--   P{p}:ev:<event>   hash  counter name -> the value list that event added
--                           to that counter's pending (see below); once the
--                           event is folded, a tombstone: the one field '~'
--   P{p}:loaded       the run_id of the Redis server that seeded the
--                     project (a marker another server wrote, restored from
--                     a snapshot, is not trusted: see seeded())
-- All keys of a project share the hash tag {p}, so keys a script derives at
-- run time (from `base` = "P{p}:") live in the same cluster slot.
--
-- A value list is signed decimals joined by ',' in FIELDS order, trailing
-- zeros left out (a call with 7 rows is "0,1,7", a request "1"). Leaving the
-- zeros out keeps the event indexes small, and it is why the three-value
-- lists "req,calls,rows" of older versions still read correctly.
--
-- Numbers: amounts travel as decimal strings and are written with
-- HSET/HINCRBY from those strings, so what is stored is exact (i64 pending,
-- u64 durable sums). Durable sums are compared as canonical decimal strings
-- (exact for every u64). Sums and limit comparisons in a check are done in
-- Lua numbers (doubles): exact up to 2^53 (about 9.007e15). Counts and bytes
-- stay far below that; costs are picodollars, so a cost comparison above
-- about $9,007 is approximate, off by at most the doubles' spacing there (at
-- most 4,096 picodollars below 2^64, i.e. under a millionth of a cent).

-- The counter fields: FIELDS, their short names in meter's Field::ALL order
-- (Field::as_str); FIELD_AT (short name -> position); T_FIELDS and P_FIELDS
-- (the durable and pending hash fields, 't_<f>' and 'p_<f>', in FIELDS
-- order); and the positions REQ, CALLS, LLM_P, STO_N and STO are not
-- written here: RedisView generates them from Field::ALL as literal tables
-- and puts them at the top of the library, so the list has one definition
-- (no script names a field itself). All are sums except sto, the storage
-- footprint (absolute when durable, a delta when pending), which sto_n (the
-- storage facts it reflects) orders.

-- a > b for canonical non-negative decimal strings.
local function dec_gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end

-- The parts of a comma-separated string ('' has none).
local function split(s)
  local out = {}
  for v in string.gmatch(s, '[^,]+') do
    out[#out + 1] = v
  end
  return out
end

-- Deletes the given fields of a hash (none if it does not exist) in slices
-- small enough for unpack (a lapse of many leases at once can end thousands).
local function hdel_all(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

-- Sets an absolute expiry (ms) unless `at` is '' (the counter never resets).
local function expire_at(key, at)
  if at ~= '' then redis.call('PEXPIREAT', key, at) end
end

-- Moves a key's expiry to `at` (ms) unless it already expires later. A
-- key just made (`fresh`: a reservation's index) has none, and one
-- `PEXPIREAT NX` sets it; any other key's is read first, as most checks
-- find it already later (many leases end in the same millisecond).
local function extend_expiry(key, at, fresh)
  if fresh and redis.call('PEXPIREAT', key, at, 'NX') == 1 then return end
  local cur = redis.call('PEXPIRETIME', key)
  if cur < 0 or cur < tonumber(at) then redis.call('PEXPIREAT', key, at) end
end

-- Raises a counter's durable totals to new ones: args[a .. a+#FIELDS-1]
-- (the calling function's ARGV), decimal strings in FIELDS order.
-- Sums: t = max(current, new), so a late or repeated fold never lowers one.
-- The footprint can go down, so max does not apply: t_sto is replaced when
-- the new one reflects more storage facts (t_sto_n greater, or none stored
-- yet), and t_sto_n moves with it. A total with no storage facts and no
-- footprint says nothing about storage (every flow counter) and leaves both.
-- Zeros are not written where nothing is stored (a missing field reads 0).
local function raise_totals(key, args, a)
  local cur = redis.call('HMGET', key, unpack(T_FIELDS))
  for i = 1, #FIELDS do
    local new = args[a + i - 1]
    if i ~= STO_N and i ~= STO and (cur[i] or new ~= '0') and (not cur[i] or dec_gt(new, cur[i])) then
      redis.call('HSET', key, T_FIELDS[i], new)
    end
  end
  local n, sto = args[a + STO_N - 1], args[a + STO - 1]
  if (n ~= '0' or sto ~= '0') and (not cur[STO_N] or dec_gt(n, cur[STO_N])) then
    redis.call('HSET', key, T_FIELDS[STO_N], n, T_FIELDS[STO], sto)
  end
end

-- -v for a decimal string.
local function neg(v)
  if string.sub(v, 1, 1) == '-' then return string.sub(v, 2) end
  return '-' .. v
end

-- Whether every part of a value list is a decimal integer.
local function valid_list(vals)
  if #vals > #FIELDS then return false end
  for _, v in ipairs(vals) do
    if not string.match(v, '^%-?%d+$') then return false end
  end
  return true
end

-- Adds one contribution (the parts of a value list) to a counter's pending,
-- or takes it back (`back`).
local function add_pending(key, vals, back)
  for i, v in ipairs(vals) do
    if v ~= '0' then
      redis.call('HINCRBY', key, P_FIELDS[i], back and neg(v) or v)
    end
  end
end

-- The field of an event index, or the member of a reservation's, that makes
-- it a tombstone (no counter name starts with '~').
local TOMBSTONE = '~'

-- This server's run_id: it changes when Redis restarts (also from a
-- snapshot) and differs on a promoted replica. It never changes while the
-- server runs, and this library lives in that server's Lua state (loaded
-- again, from the snapshot or by RedisView, after every start), so it is
-- read from `INFO server` once, at the first call that needs it, not at
-- every check (about 5 µs of Redis time each).
local SERVER_ID
local function server_id()
  if not SERVER_ID then
    SERVER_ID = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
  end
  return SERVER_ID
end

-- Whether the project's marker was written by this very server: a marker
-- restored from an older snapshot reads as unseeded, so its old counts are
-- never trusted.
local function seeded(loaded_key)
  return redis.call('GET', loaded_key) == server_id()
end

-- Takes back every pending contribution an event recorded, then forgets the
-- event. A counter that already expired is left alone (not recreated).
local function drop_event(base, evkey)
  local kv = redis.call('HGETALL', evkey)
  for i = 1, #kv, 2 do
    local ckey = base .. 'c:' .. kv[i]
    local vals = split(kv[i + 1])
    if kv[i] ~= TOMBSTONE and valid_list(vals) and redis.call('EXISTS', ckey) == 1 then
      add_pending(ckey, vals, true)
    end
  end
  redis.call('DEL', evkey)
end

-- Frees a reservation on every counter it holds and leaves its index as a
-- tombstone (the one member '~', keeping the hold's expiry), so a seed that
-- read the reservation in the log tail before this does not hold it again.
-- A hold it does not find on a project that is not seeded (the view lost
-- it: the seed to come may read its request event without the call) becomes
-- a tombstone expiring at lost_until (ms); on a seeded project there is
-- none to restore (nothing reserved, or its lease long over).
local function release(base, reskey, rid, lost_until)
  local names = redis.call('SMEMBERS', reskey)
  if #names == 0 then
    if not seeded(base .. 'loaded') then
      redis.call('SADD', reskey, TOMBSTONE)
      redis.call('PEXPIREAT', reskey, lost_until)
    end
    return
  end
  redis.call('SADD', reskey, TOMBSTONE)
  for _, n in ipairs(names) do
    if n ~= TOMBSTONE then
      redis.call('ZREM', base .. 'r:' .. n, rid)
      redis.call('HDEL', base .. 'e:' .. n, rid)
      redis.call('SREM', reskey, n)
    end
  end
end

-- A counter's number from an HMGET field (missing = 0).
local function num(v)
  return tonumber(v or '0') or 0
end
