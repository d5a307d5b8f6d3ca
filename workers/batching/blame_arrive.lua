-- blame_arrive: an arrival group's decode record is written, and the deaths of its
-- redelivered members are counted (workers.batching.admission.InFlight.arrive; loaded there as
-- _ARRIVE). Only called when some member was redelivered; otherwise a plain SET does.
--
-- KEYS[1]   this incarnation's decode record (fleet:blame:<incarnation>:decode)
-- KEYS[2]   the index of record names (fleet:blame:index)
-- ARGV[1]   the records' TTL, seconds
-- ARGV[2]   the decode record: the group's ids, encoded, space-separated
-- ARGV[3]   "1": SADD KEYS[1] to the index (first write, or it may have expired since)
-- ARGV[4]   this incarnation's record prefix (fleet:blame:<incarnation>:)
-- ARGV[5..] the encoded ids to count
--
-- Returns, per id of ARGV[5..]: how many other incarnations have a record naming it (each
-- died with it decoding or running, or still runs it).
--
-- Keys touched: KEYS[1] SET EX; KEYS[2] SADD (ARGV[3]), SMEMBERS, SREM of names whose record
-- expired; every other incarnation's record named by the index GET, and EXPIRE ARGV[1] when it
-- names a counted id (the blame lives as long as the message keeps coming back). The records
-- are read by the names the index holds, not declared in KEYS: a standalone Redis (or
-- Sentinel) only, not a Redis Cluster.

local ttl = tonumber(ARGV[1])
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
if ARGV[3] == '1' then
  redis.call('SADD', KEYS[2], KEYS[1])
end
local own = ARGV[4]
local records = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if string.sub(name, 1, #own) ~= own then
    local ids = redis.call('GET', name)
    if not ids then
      redis.call('SREM', KEYS[2], name)
    elseif ids ~= '' then
      local incarnation = string.match(name, '^(.*):[^:]*$') or name
      records[#records + 1] = {name, incarnation, ' ' .. ids .. ' '}
    end
  end
end
local out = {}
for i = 5, #ARGV do
  local needle = ' ' .. ARGV[i] .. ' '
  local seen, deaths = {}, 0
  for _, rec in ipairs(records) do
    if string.find(rec[3], needle, 1, true) then
      redis.call('EXPIRE', rec[1], ttl)
      if not seen[rec[2]] then
        seen[rec[2]] = true
        deaths = deaths + 1
      end
    end
  end
  out[#out + 1] = deaths
end
return out
