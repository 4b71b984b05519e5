-- forget.lua: before a seed, forgets a project held under a marker another
-- server wrote (View::forget_stale): a Redis restored from an older
-- snapshot, or a promoted replica, holds old counts that must not be
-- trusted, nor merged into the seed.
--
-- Why a script: the test of the marker and the removal of every key of the
-- project are one step, so two gateways seeding at once never delete what
-- the other has just seeded. (It walks the project's keys with SCAN inside
-- the script, which blocks Redis for as long as that takes: a project's
-- keys, once, after a restore.)
--
-- KEYS[1]   P{p}:loaded
-- ARGV[1]   a SCAN MATCH pattern of every key of the project ("P{p}:*",
--           glob-escaped)
-- Returns 1 if the project was forgotten, 0 if its marker is this
-- server's or there is none.

local marker = redis.call('GET', KEYS[1])
if not marker or marker == server_id() then
  return 0
end
local cursor = '0'
repeat
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = r[1]
  for _, k in ipairs(r[2]) do
    redis.call('UNLINK', k)
  end
until cursor == '0'
return 1
