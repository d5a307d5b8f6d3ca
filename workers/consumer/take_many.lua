-- take_many: take up to a window's free slots of messages from a worker channel's priority
-- lists and record each as unacked in kombu's structures, in one atomic step, so no message
-- is ever out of Redis without its unacked entry (workers.consumer.channel.Channel._take;
-- loaded by workers.consumer.channel as TAKE_MANY).
--
-- KEYS[1..n]  the channel's priority lists, in the order they are emptied: priority step
--             first, queue after queue within a step (the order kombu's BRPOP names them)
-- KEYS[n+1]   kombu's unacked hash ("unacked")
-- KEYS[n+2]   kombu's unacked index ("unacked_index"), a sorted set
-- ARGV[1]     most messages to take
-- ARGV[2]     the score each is recorded with: the worker's clock, seconds (as kombu's
--             QoS.append scores it)
-- ARGV[3]     most payload bytes to take; the first message is always taken (0: no limit)
--
-- Returns a flat array: list key, message, list key, message, ... in the order taken.
--
-- Keys touched:
--   KEYS[1..n]  RPOP; a message whose properties cannot be read is RPUSHed back where it
--               was and the take stops there (kombu's own fetch takes it next)
--   KEYS[n+1]   HSET <delivery tag> = [<message>,<exchange>,<routing key>]: kombu's entry,
--               the message's JSON kept byte for byte
--   KEYS[n+2]   ZADD ARGV[2] <delivery tag>
--
-- The delivery tag and delivery_info are read from the message's last 4 KiB, where the
-- producer's JSON puts "properties" (docs/message-layout.md): decoding a 10 MiB message
-- would stall every client of Redis (single-threaded) for tens of milliseconds. Only a
-- message of at most 64 KiB whose tail does not hold them is decoded (cjson).

local n = #KEYS - 2
local hash, index = KEYS[n + 1], KEYS[n + 2]
local left = tonumber(ARGV[1])
local budget = tonumber(ARGV[3] or '0')
local taken = 0
local out = {}
local function props(item)
  local tail = string.sub(item, -4096)
  local tag = string.match(tail, '"delivery_tag"%s*:%s*"([^"\]+)"')
  local info = string.match(tail, '"delivery_info"%s*:%s*(%b{})')
  if tag and info then
    local ex = string.match(info, '"exchange"%s*:%s*"([^"\]*)"')
    local rk = string.match(info, '"routing_key"%s*:%s*"([^"\]*)"')
    if ex and rk then return tag, ex, rk end
  end
  if #item > 65536 then return nil end
  local ok, msg = pcall(cjson.decode, item)
  local p = ok and type(msg) == 'table' and msg['properties']
  local i = type(p) == 'table' and p['delivery_info']
  if type(p) ~= 'table' or type(p['delivery_tag']) ~= 'string' or type(i) ~= 'table' then
    return nil
  end
  return p['delivery_tag'], i['exchange'], i['routing_key']
end
for k = 1, n do
  local key = KEYS[k]
  while left > 0 and (budget <= 0 or taken < budget) do
    local item = redis.call('RPOP', key)
    if not item then break end
    local tag, ex, rk = props(item)
    if not tag then
      redis.call('RPUSH', key, item)
      return out
    end
    local entry = '[' .. item .. ',' .. cjson.encode(ex) .. ',' .. cjson.encode(rk) .. ']'
    redis.call('HSET', hash, tag, entry)
    redis.call('ZADD', index, ARGV[2], tag)
    out[#out + 1] = key
    out[#out + 1] = item
    left = left - 1
    taken = taken + #item
  end
  if left == 0 or (budget > 0 and taken >= budget) then break end
end
return out
