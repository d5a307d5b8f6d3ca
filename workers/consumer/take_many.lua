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
--   KEYS[1..n]  RPOP with a count (Redis 6.2 or later): what may be taken in one pop; a
--               message whose properties cannot be read, and those popped after it, are
--               RPUSHed back where they were and the take stops there (kombu's own fetch takes
--               it next); under a byte budget the messages popped beyond it go back the same
--               way (each pop asks for as many as the sizes taken so far say would fit)
--   KEYS[n+1]   HSET <delivery tag> = [<message>,<exchange>,<routing key>]: kombu's entry,
--               the message's JSON kept byte for byte
--   KEYS[n+2]   ZADD ARGV[2] <delivery tag>
--
-- The delivery tag and delivery_info are read from the message's tail, where the producer's
-- JSON puts "properties" (docs/message-layout.md): decoding a 10 MiB message would stall
-- every client of Redis (single-threaded) for tens of milliseconds. The fleet's producer
-- writes that tail compact, and plain searches of its last 512 bytes read it (fast: pattern
-- matching a 1 KiB message costs Redis more than moving it); any other spelling (kombu's
-- blanks after `:` and `,`, a restored message's extra `redelivered`) is read by patterns
-- over the last 4 KiB; only a message of at most 64 KiB whose tail holds neither is decoded
-- (cjson).
--
-- The unacked entries are written after the pops, one HSET and one ZADD for all of them.

local n = #KEYS - 2
local hash, index = KEYS[n + 1], KEYS[n + 2]
local left = tonumber(ARGV[1])
local budget = tonumber(ARGV[3] or '0')
local taken = 0
local out = {}
-- the compact tail: ..."delivery_info":{"exchange":"<ex>","routing_key":"<rk>"},...
-- "delivery_tag":"<tag>"}}; nil when the message is spelt otherwise
local function plain_string(item, from)
  local close = string.find(item, '"', from, true)
  if not close then return nil end
  local value = string.sub(item, from, close - 1)
  if string.find(value, '\\', 1, true) then return nil end
  return value, close
end
local function compact_props(item)
  local at = string.find(item, '"delivery_tag":"', -512, true)
  if not at then return nil end
  local tag, close = plain_string(item, at + 16)
  if not tag or tag == '' or close ~= #item - 2 or string.sub(item, -2) ~= '}}' then
    return nil
  end
  local info = string.find(item, '"delivery_info":{"exchange":"', -512, true)
  if not info then return nil end
  local ex, c1 = plain_string(item, info + 29)
  if not ex or string.sub(item, c1, c1 + 16) ~= '","routing_key":"' then return nil end
  local rk, c2 = plain_string(item, c1 + 17)
  if not rk or string.sub(item, c2, c2 + 1) ~= '"}' then return nil end
  return tag, ex, rk
end
local function props(item)
  local tag, ex, rk = compact_props(item)
  if tag then return tag, ex, rk end
  local tail = string.sub(item, -4096)
  tag = string.match(tail, '"delivery_tag"%s*:%s*"([^"\]+)"')
  local info = string.match(tail, '"delivery_info"%s*:%s*(%b{})')
  if tag and info then
    ex = string.match(info, '"exchange"%s*:%s*"([^"\]*)"')
    rk = string.match(info, '"routing_key"%s*:%s*"([^"\]*)"')
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
local entries, scores = {}, {}
-- a JSON string of a value that needs no escape (the compact tail's, and most others)
local function quoted(v)
  if string.find(v, '^[%w%.%-_:]*$') then return '"' .. v .. '"' end
  return cjson.encode(v)
end
local function record()
  for i = 1, #entries, 2000 do  -- unpack's C stack is limited: at most 1,000 pairs a call
    redis.call('HSET', hash, unpack(entries, i, math.min(i + 1999, #entries)))
    redis.call('ZADD', index, unpack(scores, i, math.min(i + 1999, #scores)))
  end
end
-- the popped items from ``from`` on go back where they were, the first of them at the list's
-- right end again (RPUSH appends its arguments in turn: the last one ends rightmost)
local function restore(key, items, from)
  local back = {}
  for i = #items, from, -1 do back[#back + 1] = items[i] end
  for i = 1, #back, 1000 do
    redis.call('RPUSH', key, unpack(back, i, math.min(i + 999, #back)))
  end
end
for k = 1, n do
  local key = KEYS[k]
  local sized = 0  -- messages taken from this list so far (their bytes are in ``taken``)
  while left > 0 and (budget <= 0 or taken < budget) do
    -- as many as may be taken in one pop; under a byte budget, as many as the messages
    -- taken so far say would fit (one at first), so that few are popped only to go back
    local want = left
    if budget > 0 then
      want = 1
      if sized > 0 then
        want = math.max(1, math.min(left, math.floor((budget - taken) * sized / taken)))
      end
    end
    local items = redis.call('RPOP', key, want)
    if not items then break end
    for i, item in ipairs(items) do
      if budget > 0 and taken >= budget then
        restore(key, items, i)
        break
      end
      local tag, ex, rk = props(item)
      if not tag then
        restore(key, items, i)
        record()
        return out
      end
      entries[#entries + 1] = tag
      entries[#entries + 1] = '[' .. item .. ',' .. quoted(ex) .. ',' .. quoted(rk) .. ']'
      scores[#scores + 1] = ARGV[2]
      scores[#scores + 1] = tag
      out[#out + 1] = key
      out[#out + 1] = item
      left = left - 1
      taken = taken + #item
      sized = sized + 1
    end
    if #items < want then break end  -- the list is empty
  end
  if left == 0 or (budget > 0 and taken >= budget) then break end
end
record()
return out
