-- inflight_begin: before a batch runs, for each of its requests: is its final result stored
-- already (then it is not run, only acked), and if not, count this run of it
-- (workers.batching.execution.InFlight.begin; loaded there as _BEGIN).
--
-- KEYS[2i-1]  request i's final marker (fleet:final:<id>)
-- KEYS[2i]    request i's in-flight counter (fleet:deliveries:<id>)
-- ARGV[1]     the counters' TTL, seconds
-- ARGV[i+1]   "1": count request i (its first run in this delivery); anything else: do not
--
-- Returns, per request: -1 (its final marker exists), its counter after INCR (counted), or
-- 0 (not counted).
--
-- Keys touched: each final marker EXISTS; a counted request's counter INCR, then EXPIRE
-- ARGV[1].

local out = {}
for i = 1, #KEYS / 2 do
  if redis.call('EXISTS', KEYS[2 * i - 1]) == 1 then
    out[i] = -1
  elseif ARGV[i + 1] == '1' then
    out[i] = redis.call('INCR', KEYS[2 * i])
    redis.call('EXPIRE', KEYS[2 * i], ARGV[1])
  else
    out[i] = 0
  end
end
return out
