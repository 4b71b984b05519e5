-- Releases a permit: out of its holder's zset, the installation's and the
-- index, in one step.
--
-- KEYS[1]  the installation's zset   KEYS[2] the index hash
-- ARGV[1]  now (ms)   ARGV[2] permit id
-- ARGV[3]  the start of every holder's zset key (same hash tag)
-- Returns 1 if it was held (its lease not lapsed), else 0.
local now = tonumber(ARGV[1])
local id = ARGV[2]
local rec = redis.call('HGET', KEYS[2], id)
if not rec then return 0 end
local holder = string.match(rec, '^(.*)|%d+|%d+$')
local score = redis.call('ZSCORE', KEYS[1], id)
redis.call('ZREM', KEYS[1], id)
if holder then redis.call('ZREM', ARGV[3] .. holder, id) end
redis.call('HDEL', KEYS[2], id)
if score and tonumber(score) > now then return 1 end
return 0
