-- results_write_first: store a request's final result unless one is stored already: the
-- first write wins (workers.batching.completion.ResultWriter; loaded there as _WRITE_FIRST).
--
-- KEYS[1]  the request's final marker (fleet:final:<id>)
-- KEYS[2]  its result document (Celery's celery-task-meta-<id>)
-- ARGV[1]  the encoded result meta (JSON)
-- ARGV[2]  TTL of both keys, seconds (0: none)
-- ARGV[3]  "1": keep a document stored already (Celery's own REVOKED, from its revoke command)
-- ARGV[4]  "0": do not PUBLISH (the caller publishes once a replica has the write)
-- ARGV[5]  the write's token (one per outcome, kept across its retries)
--
-- Returns 1: written; 2: this token's earlier write stands (its reply was lost); 0: another
-- write's stands, or the stored document was kept.
--
-- Keys touched: KEYS[1] GET, then SET ARGV[5] (EX ARGV[2]); KEYS[2] EXISTS (with ARGV[3]
-- "1"), SETEX or SET ARGV[1], and PUBLISH ARGV[1] on the channel named KEYS[2] (Celery's
-- result channel). The document is written before the marker: a command refused after the
-- first write leaves a document without a marker (the retry writes both), never a marker
-- without a document.

local ttl = tonumber(ARGV[2])
local held = redis.call('GET', KEYS[1])
if held then
  if held == ARGV[5] then return 2 end
  return 0
end
local kept = ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 1
if not kept then
  if ttl > 0 then
    redis.call('SETEX', KEYS[2], ttl, ARGV[1])
  else
    redis.call('SET', KEYS[2], ARGV[1])
  end
end
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[5], 'EX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[5])
end
if kept then return 0 end
if ARGV[4] ~= '0' then redis.call('PUBLISH', KEYS[2], ARGV[1]) end
return 1
