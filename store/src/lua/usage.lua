-- usage.lua: one counter's state (View::usage).
--
-- Why a script: the loaded marker, the totals and the live reservations are
-- read at one instant, in one round trip. It writes nothing (expired leases
-- are not counted, but are purged only by a check).
--
-- KEYS[1]   P{p}:loaded (seeded only if it holds this server's run_id)
-- KEYS[2]   P{p}:c:<name>
-- KEYS[3]   P{p}:r:<name>
-- KEYS[4]   P{p}:e:<name>
-- ARGV[1]   now (ms)
-- Returns nil when the project is not seeded, else 3 * #FIELDS + 1 decimal
-- strings: the t_<f> in FIELDS order, the p_<f>, the live reservations
-- (lease after now), then the sum of their estimates per field.

if not seeded(KEYS[1]) then
  return false
end
local h = redis.call('HMGET', KEYS[2], unpack(T_FIELDS))
local p = redis.call('HMGET', KEYS[2], unpack(P_FIELDS))
local out = {}
for i = 1, #FIELDS do
  out[i] = h[i] or '0'
  out[#FIELDS + i] = p[i] or '0'
end
out[2 * #FIELDS + 1] = tostring(redis.call('ZCOUNT', KEYS[3], '(' .. ARGV[1], '+inf'))
local est = {}
local kv = redis.call('HGETALL', KEYS[4])
for k = 1, #kv, 2 do
  local lease = redis.call('ZSCORE', KEYS[3], kv[k])
  if lease and tonumber(lease) > tonumber(ARGV[1]) then
    for g, v in ipairs(split(kv[k + 1])) do
      est[g] = (est[g] or 0) + (tonumber(v) or 0)
    end
  end
end
for i = 1, #FIELDS do
  out[2 * #FIELDS + 1 + i] = string.format('%.0f', est[i] or 0)
end
return out
