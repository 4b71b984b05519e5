-- Claims a permit: reaps every lapsed permit of the installation, then takes
-- one slot of the holder's pool and one of the installation's, or neither.
-- A script, so reap, count and claim are one atomic step for every gateway:
-- two gateways never take the same slot.
--
-- KEYS[1]  the holder's zset (permit id -> lease end, ms)
-- KEYS[2]  the installation's zset (every permit -> lease end, ms)
-- KEYS[3]  the index hash (permit id -> "<holder>|<lease ms>|<token>")
-- KEYS[4]  the fencing-token counter
-- ARGV[1]  now (ms)   ARGV[2] permit id   ARGV[3] lease (ms)
-- ARGV[4]  the holder's cap   ARGV[5] the installation's cap
-- ARGV[6]  the start of every holder's zset key (the holder is appended)
-- ARGV[7]  the holder
-- Returns {1, token, lease end} granted, {0, 0, 0} the holder's pool full,
-- {0, 1, 0} the installation's full.
local now = tonumber(ARGV[1])
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(lapsed) do
  local rec = redis.call('HGET', KEYS[3], id)
  if rec then
    local holder = string.match(rec, '^(.*)|%d+|%d+$')
    if holder then redis.call('ZREM', ARGV[6] .. holder, id) end
    redis.call('HDEL', KEYS[3], id)
  end
end
if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local id = ARGV[2]
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return {0, 0, 0} end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return {0, 1, 0} end
local token = redis.call('INCR', KEYS[4])
local ends = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], ends, id)
redis.call('ZADD', KEYS[2], ends, id)
redis.call('HSET', KEYS[3], id, ARGV[7] .. '|' .. ARGV[3] .. '|' .. token)
return {1, token, ends}
