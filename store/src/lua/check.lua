-- check.lua: one admission check of one project (View::check).
--
-- Why a script: counting the request, reading every counter, comparing every
-- limit and reserving on all counters (or none) must happen with nothing in
-- between, or two gateways could both take the last slot. One script is one
-- atomic step and one round trip.
--
-- KEYS[1]        P{p}:loaded
-- KEYS[2]        P{p}:ev:<request event>
-- KEYS[3]        P{p}:res:<reservation id>
-- KEYS[2+2i]     P{p}:c:<n_i>   for counter i = 1..N (the plan's counters, in order)
-- KEYS[3+2i]     P{p}:r:<n_i>
-- ARGV[1]        now (ms)
-- ARGV[2]        lease_until (ms): the reservation's score
-- ARGV[3]        reservation id
-- ARGV[4]        when the reservation's keys may expire (ms): lease + grace
-- ARGV[5]        TTL of the event index (ms)
-- ARGV[6]        N; then per counter 4 values: name, expire-at (ms, '' = never),
--                counts the request ('1'/'0'), reserved when admitted ('1'/'0')
-- then           L; then per limit 5 values: counter index (1-based), metric
--                (requests|calls|rows), limit, need, enforce ('1'/'0')
--
-- Returns nil when the project is not seeded (and changes nothing), else
-- { admitted (1/0), used_1, ..., used_L }, used = durable + pending (+ live
-- reservations for calls), after this request was counted and before this
-- check's own reservation. A refused check reserves nothing; the request
-- count stays (a refused request is still a request).
-- Idempotent per request event and reservation id: a retried check neither
-- counts its request twice nor counts its own earlier reservation.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end

local now = ARGV[1]
local lease = ARGV[2]
local rid = ARGV[3]
local n = tonumber(ARGV[6])
local a = 7
local names, reserves, exps = {}, {}, {}
local counted = false

for i = 1, n do
  local ckey, rkey = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  names[i], exps[i], reserves[i] = ARGV[a], ARGV[a + 1], ARGV[a + 3]
  local counts = ARGV[a + 2]
  a = a + 4
  redis.call('ZREMRANGEBYSCORE', rkey, '-inf', now)
  if counts == '1' and redis.call('HSETNX', KEYS[2], names[i], '1,0,0') == 1 then
    redis.call('HINCRBY', ckey, 'p_req', 1)
    expire_at(ckey, exps[i])
    counted = true
  end
end
if counted then
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end

-- What each counter holds now.
local req, calls, rows = {}, {}, {}
for i = 1, n do
  local ckey, rkey = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
  local h = redis.call('HMGET', ckey, 't_req', 'p_req', 't_calls', 'p_calls', 't_rows', 'p_rows')
  local live = redis.call('ZCARD', rkey)
  if redis.call('ZSCORE', rkey, rid) then
    live = live - 1
  end
  req[i] = math.max(0, num(h[1]) + num(h[2]))
  calls[i] = math.max(0, num(h[3]) + num(h[4])) + live
  rows[i] = math.max(0, num(h[5]) + num(h[6]))
end

local l = tonumber(ARGV[a])
a = a + 1
local out = { 1 }
for j = 1, l do
  local ci, metric = tonumber(ARGV[a]), ARGV[a + 1]
  local limit, need, enforce = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), ARGV[a + 4]
  a = a + 5
  local used
  if metric == 'requests' then
    used = req[ci]
  elseif metric == 'calls' then
    used = calls[ci]
  elseif metric == 'rows' then
    used = rows[ci]
  else
    return redis.error_reply('tollgate: the view does not count ' .. metric)
  end
  out[j + 1] = used
  if enforce == '1' and used + need > limit then
    out[1] = 0
  end
end

if out[1] == 1 then
  local held = false
  for i = 1, n do
    if reserves[i] == '1' then
      local rkey = KEYS[3 + 2 * i]
      redis.call('ZADD', rkey, lease, rid)
      extend_expiry(rkey, ARGV[4])
      redis.call('SADD', KEYS[3], names[i])
      held = true
    end
  end
  if held then
    extend_expiry(KEYS[3], ARGV[4])
  end
end

return out
