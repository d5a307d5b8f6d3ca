-- queue_stats: every queue's waiting messages per priority step, its reserved (delivered,
-- not acked) messages and its oldest submit time, in one atomic read
-- (shared.queue_stats.QueueReader, for fleet exporter; loaded there as _SCRIPT).
--
-- KEYS[(q-1)*ns+s]  queue q's list of priority step s (steps in order, queue after queue)
-- KEYS[#KEYS]       kombu's unacked hash ("unacked")
-- ARGV[1]           number of queues, nq
-- ARGV[2]           number of priority steps, ns
-- ARGV[2+q]         queue q's name (the routing key its messages carry)
--
-- Returns nq rows {waiting at step 1, ..., waiting at step ns, reserved, oldest submit time
-- in epoch ms (-1: none)}, then one last row {reserved messages of queues not named}.
--
-- Keys touched, read only: each list LLEN, and LINDEX -1 and 0 (its two ends); the hash
-- HGETALL. A message's submit time is the last "fleet_submitted_ms" header in its last
-- 8 KiB; an unacked entry's queue is its routing key, the entry's last JSON string
-- (docs/message-layout.md).

local nq, ns = tonumber(ARGV[1]), tonumber(ARGV[2])
local hash = KEYS[#KEYS]
local function sent_ms(item)
  local tail = string.sub(item, -8192)
  local last = nil
  for v in string.gmatch(tail, '"fleet_submitted_ms"%s*:%s*([%d%.eE%+%-]+)') do last = v end
  return last and tonumber(last) or nil
end
local rows, oldest, index = {}, {}, {}
for q = 1, nq do
  index[ARGV[2 + q]] = q
  local row = {}
  for s = 1, ns do
    local key = KEYS[(q - 1) * ns + s]
    local n = redis.call('LLEN', key)
    row[s] = n
    if n > 0 then
      for _, at in ipairs({-1, 0}) do
        local item = redis.call('LINDEX', key, at)
        local t = item and sent_ms(item)
        if t and (oldest[q] == nil or t < oldest[q]) then oldest[q] = t end
      end
    end
  end
  row[ns + 1] = 0
  rows[q] = row
end
local other = 0
local all = redis.call('HGETALL', hash)
for i = 2, #all, 2 do
  local v = all[i]
  local rk = string.match(string.sub(v, -512), ',%s*"([^"]*)"%s*%]%s*$')
  local q = rk and index[rk]
  if q then
    rows[q][ns + 1] = rows[q][ns + 1] + 1
    local t = sent_ms(v)
    if t and (oldest[q] == nil or t < oldest[q]) then oldest[q] = t end
  else
    other = other + 1
  end
end
for q = 1, nq do
  rows[q][ns + 2] = oldest[q] and math.floor(oldest[q]) or -1
end
rows[nq + 1] = {other}
return rows
