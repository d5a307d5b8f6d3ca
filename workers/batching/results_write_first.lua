-- results_write_first: store a batch's final results, each unless its request has one stored
-- already: the first write wins (workers.batching.completion.ResultWriter; loaded there as
-- _WRITE_FIRST); then, in the same call, ack the batch's messages (kombu's ZREM + HDEL,
-- workers.consumer.lease) and apply the commands that go with the acks (a tenant's max_queued
-- release, shared.tenant_quota). One call per settled group: the per-request work below is a
-- few commands, the call's own cost (a round trip, argument parsing, the script's setup) is
-- paid once.
--
-- KEYS[1]         kombu's unacked index (read only when ARGV[3] > 0)
-- KEYS[2]         kombu's unacked hash (idem)
-- KEYS[2i+1]      request i's final marker (fleet:final:<id>), i = 1..n
-- KEYS[2i+2]      its result document (Celery's celery-task-meta-<id>)
-- KEYS[2n+2+j]    the key of extra command j (j = 1..e)
-- ARGV[1]         "0": do not PUBLISH (the caller publishes once a replica has the writes)
-- ARGV[2]         n, the number of results
-- ARGV[3]         m, the number of delivery tags to ack
-- ARGV[4i]        request i's encoded result meta (JSON)
-- ARGV[4i+1]      TTL of both its keys, seconds (0: none)
-- ARGV[4i+2]      "1": keep a document stored already (Celery's own REVOKED, from its revoke
--                 command)
-- ARGV[4i+3]      its write's token (one per outcome, kept across its retries)
-- ARGV[4n+4 ..]   the m delivery tags, then per extra command: its name, its argument count
--                 c, and c arguments (after its key)
--
-- Returns, per request: 1 written; 2 this token's earlier write stands (its reply was lost);
-- 0 another write's stands, or the stored document was kept.
--
-- Keys touched, per request: KEYS[2i+1] GET, then SET token (EX ttl); KEYS[2i+2] EXISTS (keep
-- "1" only), SETEX or SET the meta, and PUBLISH the meta on the channel named KEYS[2i+2]
-- (Celery's result channel). The document is written before the marker: a command refused
-- after the first write leaves a document without a marker (the retry writes both), never a
-- marker without a document. Requests before a refused command keep their writes (Redis
-- scripts are not all-or-nothing); the caller retries the whole call, and those requests'
-- tokens then answer 2. The acks come after every write: a refused write acks nothing (each
-- request is acked only once its result, or another copy's, is stored), and acking again
-- on a retry removes nothing more.

local publish = ARGV[1] ~= '0'
local n, m = tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 1, n do
  local marker, doc = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local a = 4 * i
  local meta, ttl, keep, token = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local expires = ttl ~= '0'  -- ttl passed on as given: a Lua number would be formatted
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
local t = 4 * n + 4
if m > 0 then
  redis.call('ZREM', KEYS[1], unpack(ARGV, t, t + m - 1))
  redis.call('HDEL', KEYS[2], unpack(ARGV, t, t + m - 1))
end
t = t + m
for k = 2 * n + 3, #KEYS do
  local name, c = ARGV[t], tonumber(ARGV[t + 1])
  redis.call(name, KEYS[k], unpack(ARGV, t + 2, t + 1 + c))
  t = t + 2 + c
end
return out
