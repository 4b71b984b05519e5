-- Renews a live permit: its lease end becomes now + its lease, in both its
-- holder's zset and the installation's. A lapsed one is reaped instead.
--
-- KEYS[1]  the installation's zset   KEYS[2] the index hash
-- ARGV[1]  now (ms)   ARGV[2] permit id
-- ARGV[3]  the start of every holder's zset key (same hash tag)
-- Returns {1, token, lease end, holder} renewed, {0, 0, 0, ''} not held.
local now = tonumber(ARGV[1])
local id = ARGV[2]
local rec = redis.call('HGET', KEYS[2], id)
if not rec then return {0, 0, 0, ''} end
local holder, lease, token = string.match(rec, '^(.*)|(%d+)|(%d+)$')
local score = redis.call('ZSCORE', KEYS[1], id)
if not holder or not score or tonumber(score) <= now then
  redis.call('ZREM', KEYS[1], id)
  if holder then redis.call('ZREM', ARGV[3] .. holder, id) end
  redis.call('HDEL', KEYS[2], id)
  return {0, 0, 0, ''}
end
local ends = now + tonumber(lease)
redis.call('ZADD', KEYS[1], 'XX', ends, id)
redis.call('ZADD', ARGV[3] .. holder, 'XX', ends, id)
return {1, tonumber(token), ends, holder}
