-- inflight_begin: before a batch runs, for each of its requests: is its final result stored
-- already (then it is not run, only acked); the lane's blame record then names the others
-- (workers.batching.admission.InFlight.begin; loaded there as _BEGIN).
--
-- KEYS[i]     request i's final marker (fleet:final:<id>), i = 1..n
-- KEYS[n+1]   the lane's blame record (fleet:blame:<incarnation>:<lane>)
-- KEYS[n+2]   the index of record names (fleet:blame:index)
-- ARGV[1]     the records' TTL, seconds
-- ARGV[2]     "1": SADD KEYS[n+1] to the index (first write, or it may have expired since)
-- ARGV[i+2]   request i's id, encoded (no space)
--
-- Returns, per request: -1 (its final marker exists: not run, not recorded) or 1 (the lane's
-- record names it).
--
-- Keys touched: each final marker EXISTS; KEYS[n+1] SET EX ARGV[1] (to "" when every request
-- has its final result); KEYS[n+2] SADD (ARGV[2]).

local n = #KEYS - 2
local out, run = {}, {}
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[i] = -1
  else
    out[i] = 1
    run[#run + 1] = ARGV[i + 2]
  end
end
redis.call('SET', KEYS[n + 1], table.concat(run, ' '), 'EX', ARGV[1])
if ARGV[2] == '1' then
  redis.call('SADD', KEYS[n + 2], KEYS[n + 1])
end
return out
