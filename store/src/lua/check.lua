-- check.lua: one admission check of one project (View::check).
--
-- Why a script: counting the request, reading every counter, comparing every
-- limit and reserving on all counters (or none) must happen with nothing in
-- between, or two gateways could both take the last slot. One script is one
-- atomic step and one round trip.
--
-- KEYS[1]        P{p}:loaded (seeded only if it holds this server's run_id)
-- KEYS[2]        P{p}:ev:<request event>
-- KEYS[3]        P{p}:res:<reservation id>
-- KEYS[2+2i]     P{p}:c:<n_i>   for counter i = 1..N (the plan's counters, in order)
-- KEYS[3+2i]     P{p}:r:<n_i>
-- ARGV[1]        now (ms)
-- ARGV[2]        lease_until (ms): the reservation's score
-- ARGV[3]        reservation id
-- ARGV[4]        when the reservation's keys may expire (ms): lease + grace
-- ARGV[5]        when the event index may expire (ms): now + its TTL
-- ARGV[6]        N; then per counter 4 values: name, expire-at (ms, '' = never),
--                counts the request ('1'/'0'), reserved when admitted ('1'/'0')
-- then           L; then per limit 6 values: counter index (1-based), kind
--                (cap|blackout|probe), fields (short names joined by ','),
--                limit, need, enforce ('1'/'0')
-- then           the estimate an admitted check holds on each reserving
--                counter besides one call: a value list ('' = none)
-- Derived keys (same hash tag): P{p}:e:<n_i>, the estimates held on counter i.
--
-- A limit reads its counter as meter's LimitKind says, with v(f) =
-- max(0, t_f + p_f) for each of its fields f:
--   cap       used = sum of v(f) (+ live reservations when calls is among the
--             fields, + the live reservations' estimates of its other
--             fields); refuses when enforce and used + need > limit
--   blackout  used = sum of v(f) when v(llm_p) = 0 (nothing in the window is
--             priced), else 0; refuses like a cap
--   probe     used as a cap; never refuses
-- Sums and comparisons are doubles (see common.lua for what is exact).
--
-- Returns nil when the project is not seeded (and changes nothing), else
-- decimal strings { admitted ('1'/'0'), used_1, ..., used_L, then per limit
-- durable_j, settled_j, reserved_j }, each used after this request was
-- counted and before this check's own reservation. The split (meter's
-- UsageParts): durable = sum of max(0, t_f), settled = sum of v(f) - durable,
-- reserved = the live reservations (and estimates) the limit counted.
-- A refused check reserves nothing; the request count stays (a refused
-- request is still a request). A malformed plan is refused with an error
-- before anything is written.
-- Idempotent per request event and reservation id: a retried check neither
-- counts its request twice nor counts its own earlier reservation.

if not seeded(KEYS[1]) then
  return false
end

local now = ARGV[1]
local lease = ARGV[2]
local rid = ARGV[3]
local n = tonumber(ARGV[6])
local prefix = string.sub(KEYS[1], 1, #KEYS[1] - #'loaded')

-- The limits, read (and checked) before anything is written.
local a = 7 + 4 * n
local limits = {}
for j = 1, tonumber(ARGV[a]) do
  local b = a + 1 + 6 * (j - 1)
  local ci, kind = tonumber(ARGV[b]), ARGV[b + 1]
  if not ci or ci < 1 or ci > n then
    return redis.error_reply('tollgate: limit ' .. j .. ' names counter ' .. ARGV[b] .. ' of ' .. n)
  end
  if kind ~= 'cap' and kind ~= 'blackout' and kind ~= 'probe' then
    return redis.error_reply('tollgate: unknown limit kind ' .. kind)
  end
  local fields = {}
  for _, name in ipairs(split(ARGV[b + 2])) do
    local f = FIELD_AT[name]
    if not f then
      return redis.error_reply('tollgate: the view has no counter field ' .. name)
    end
    fields[#fields + 1] = f
  end
  limits[j] = {
    ci = ci, kind = kind, fields = fields,
    limit = tonumber(ARGV[b + 3]), need = tonumber(ARGV[b + 4]), enforce = ARGV[b + 5] == '1',
  }
end
local estimate = ARGV[a + 1 + 6 * #limits] or ''
if not valid_list(split(estimate)) then
  return redis.error_reply('tollgate: bad estimate ' .. estimate)
end

-- Purge expired leases; count the request once per event and counter (and
-- not at all once the request event is folded: its tombstone).
-- The ended leases are listed first (usually none, so one command) and
-- their estimates dropped with them. Whether the event is folded is read
-- only once a counter counts the request.
local names, reserves = {}, {}
local counted = false
local folded
a = 7
for i = 1, n do
  local ckey, rkey = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  names[i], reserves[i] = ARGV[a], ARGV[a + 3]
  local exp, counts = ARGV[a + 1], ARGV[a + 2]
  a = a + 4
  local ended = redis.call('ZRANGEBYSCORE', rkey, '-inf', now)
  if #ended > 0 then
    redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
    hdel_all(prefix .. 'e:' .. names[i], ended)
  end
  if counts == '1' and folded == nil then
    folded = redis.call('HEXISTS', KEYS[2], TOMBSTONE) == 1
  end
  if counts == '1' and not folded and redis.call('HSETNX', KEYS[2], names[i], '1') == 1 then
    redis.call('HINCRBY', ckey, P_FIELDS[REQ], 1)
    expire_at(ckey, exp)
    counted = true
  end
end
if counted then
  redis.call('PEXPIREAT', KEYS[2], ARGV[5])
end

-- What each counter holds now, read only for the fields some limit needs:
-- v(f), and its folded part max(0, t_f) for the split.
local seen, seen_t = {}, {}
local function read(i, f)
  local c = seen[i]
  if not c then
    c = {}
    seen[i] = c
    seen_t[i] = {}
  end
  if c[f] == nil then
    local h = redis.call('HMGET', KEYS[2 + 2 * i], T_FIELDS[f], P_FIELDS[f])
    c[f] = math.max(0, num(h[1]) + num(h[2]))
    seen_t[i][f] = math.max(0, num(h[1]))
  end
end
local function value(i, f)
  read(i, f)
  return seen[i][f]
end
local function durable(i, f)
  read(i, f)
  return seen_t[i][f]
end

-- Live reservations on a counter, without this check's own (a retry).
local function live(i)
  local rkey = KEYS[3 + 2 * i]
  local held = redis.call('ZCARD', rkey)
  if redis.call('ZSCORE', rkey, rid) then
    held = held - 1
  end
  return held
end

-- The estimates of the live reservations on a counter, without this
-- check's own, per field (after the purge every lease left is live).
local held_est = {}
local function estimated(i, f)
  local e = held_est[i]
  if not e then
    e = {}
    held_est[i] = e
    local ekey, rkey = prefix .. 'e:' .. names[i], KEYS[3 + 2 * i]
    local kv = redis.call('HGETALL', ekey)
    for k = 1, #kv, 2 do
      if kv[k] ~= rid and redis.call('ZSCORE', rkey, kv[k]) then
        for g, v in ipairs(split(kv[k + 1])) do
          e[g] = (e[g] or 0) + (tonumber(v) or 0)
        end
      end
    end
  end
  return math.max(0, e[f] or 0)
end

local admitted = true
local out = { '1' }
local parts = {}
for j, l in ipairs(limits) do
  local used, base, kept, reserved = 0, 0, 0, 0
  for _, f in ipairs(l.fields) do
    used = used + value(l.ci, f)
    base = base + value(l.ci, f)
    kept = kept + durable(l.ci, f)
    if l.kind ~= 'blackout' then
      local held
      if f == CALLS then held = live(l.ci) else held = estimated(l.ci, f) end
      used = used + held
      reserved = reserved + held
    end
  end
  if l.kind == 'blackout' and value(l.ci, LLM_P) > 0 then
    used = 0
  end
  out[j + 1] = string.format('%.0f', used)
  parts[#parts + 1] = string.format('%.0f', kept)
  parts[#parts + 1] = string.format('%.0f', base - kept)
  parts[#parts + 1] = string.format('%.0f', reserved)
  if l.enforce and l.kind ~= 'probe' and used + l.need > l.limit then
    admitted = false
  end
end

if admitted then
  local held = false
  for i = 1, n do
    if reserves[i] == '1' then
      local rkey = KEYS[3 + 2 * i]
      redis.call('ZADD', rkey, lease, rid)
      extend_expiry(rkey, ARGV[4], false)
      if estimate ~= '' then
        local ekey = prefix .. 'e:' .. names[i]
        redis.call('HSET', ekey, rid, estimate)
        extend_expiry(ekey, ARGV[4], false)
      end
      redis.call('SADD', KEYS[3], names[i])
      held = true
    end
  end
  if held then
    extend_expiry(KEYS[3], ARGV[4], true)
  end
else
  out[1] = '0'
end

for _, v in ipairs(parts) do
  out[#out + 1] = v
end
return out
