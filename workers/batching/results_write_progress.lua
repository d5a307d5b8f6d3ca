-- results_write_progress: store a request's progress state unless its final result is
-- stored: a slow copy reporting late would hide the final result from pollers
-- (workers.batching.completion.ResultWriter; loaded there as _WRITE_PROGRESS). Published on
-- the result key's channel too, as the final result is (results_write_first.lua): what
-- subscribed clients follow (producer.client.subscriptions).
--
-- KEYS[1]  the request's final marker (fleet:final:<id>)
-- KEYS[2]  its result document (Celery's celery-task-meta-<id>), and the channel of that name
-- ARGV[1]  the encoded progress meta (JSON)
-- ARGV[2]  TTL, seconds
--
-- Returns 1: written; 0: the final marker exists, nothing written.
--
-- Keys touched: KEYS[1] EXISTS; KEYS[2] SETEX, PUBLISH.

if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SETEX', KEYS[2], tonumber(ARGV[2]), ARGV[1])
redis.call('PUBLISH', KEYS[2], ARGV[1])
return 1
