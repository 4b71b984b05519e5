-- usage.lua: one counter's state (View::usage).
--
-- Why a script: the loaded marker, the totals and the live reservations are
-- read at one instant, in one round trip. It writes nothing (expired leases
-- are not counted, but are purged only by a check).
--
-- KEYS[1]   P{p}:loaded (seeded only if it holds this server's run_id)
-- KEYS[2]   P{p}:c:<name>
-- KEYS[3]   P{p}:r:<name>
-- ARGV[1]   now (ms)
-- Returns nil when the project is not seeded, else 2 * #FIELDS + 1 decimal
-- strings: the t_<f> in FIELDS order, the p_<f>, then the live reservations
-- (lease after now).

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
return out
