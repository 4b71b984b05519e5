-- lower.lua: after the projector's durable commit of corrections that took
-- usage back, lowers the durable totals of their counters
-- (View::lower_totals). fold.lua only ever raises a sum, so that a stale
-- fold delivered late cannot take a counter back; a correction is the one
-- fold that must.
--
-- Why a script: every counter of the fold is lowered in one step, so a
-- check never sees some of a correction and not the rest.
--
-- ARGV[1]   base "P{p}:"
-- ARGV[2]   C, the number of counters; then per counter 1 + #FIELDS values:
--             expire-at (ms, '' = never; unused here), then the durable
--             totals in FIELDS order (decimal strings)
-- KEYS[1..C]    P{p}:c:<name> per counter
-- A sum above the given total is set to it; a counter the view does not
-- hold is left alone (not created); the footprint (STO, STO_N) is never
-- touched. Returns C.

local c = tonumber(ARGV[2])
local a = 3
for i = 1, c do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    local cur = redis.call('HMGET', KEYS[i], unpack(T_FIELDS))
    for j = 1, #FIELDS do
      local new = ARGV[a + j]
      if j ~= STO_N and j ~= STO and cur[j] and dec_gt(cur[j], new) then
        redis.call('HSET', KEYS[i], T_FIELDS[j], new)
      end
    end
  end
  a = a + 1 + #FIELDS
end
return c
