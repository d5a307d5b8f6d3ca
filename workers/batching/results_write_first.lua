-- results_write_first: store a batch's final results, each unless its request has one stored
-- already: the first write wins (workers.batching.completion.ResultWriter; loaded there as
-- _WRITE_FIRST). One call per batch: the per-request work below is a few commands, the call's
-- own cost (argument parsing, the script's setup) is paid once.
--
-- KEYS[2i-1]  request i's final marker (fleet:final:<id>)
-- KEYS[2i]    its result document (Celery's celery-task-meta-<id>)
-- ARGV[1]     "0": do not PUBLISH (the caller publishes once a replica has the writes)
-- ARGV[4i-2]  request i's encoded result meta (JSON)
-- ARGV[4i-1]  TTL of both its keys, seconds (0: none)
-- ARGV[4i]    "1": keep a document stored already (Celery's own REVOKED, from its revoke
--             command)
-- ARGV[4i+1]  its write's token (one per outcome, kept across its retries)
--
-- Returns, per request: 1 written; 2 this token's earlier write stands (its reply was lost);
-- 0 another write's stands, or the stored document was kept.
--
-- Keys touched, per request: KEYS[2i-1] GET, then SET token (EX ttl); KEYS[2i] EXISTS (keep
-- "1" only), SETEX or SET the meta, and PUBLISH the meta on the channel named KEYS[2i]
-- (Celery's result channel). The document is written before the marker: a command refused
-- after the first write leaves a document without a marker (the retry writes both), never a
-- marker without a document. Requests before a refused command keep their writes (Redis
-- scripts are not all-or-nothing); the caller retries the whole call, and those requests'
-- tokens then answer 2.

local publish = ARGV[1] ~= '0'
local out = {}
for i = 1, #KEYS / 2 do
  local marker, doc = KEYS[2 * i - 1], KEYS[2 * i]
  local a = 4 * i - 2
  local meta, ttl, keep, token = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local expires = tonumber(ttl) > 0  -- ttl passed on as given: a Lua number would be formatted
  local held = redis.call('GET', marker)
  if held then
    out[i] = (held == token) and 2 or 0
  else
    local kept = keep == '1' and redis.call('EXISTS', doc) == 1
    if not kept then
      if expires then
        redis.call('SETEX', doc, ttl, meta)
      else
        redis.call('SET', doc, meta)
      end
    end
    if expires then
      redis.call('SET', marker, token, 'EX', ttl)
    else
      redis.call('SET', marker, token)
    end
    if kept then
      out[i] = 0
    else
      if publish then redis.call('PUBLISH', doc, meta) end
      out[i] = 1
    end
  end
end
return out
