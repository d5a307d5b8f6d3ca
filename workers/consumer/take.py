"""The atomic take of ``workers.consumer.channel.Channel``: one Lua script that pops up to a
window's free slots of messages from a channel's priority lists and records each in kombu's unacked
hash and index in the same step, so no message is ever out of Redis without its unacked entry.

Run by ``Channel._take`` (``register_script``); a take Redis refuses before it runs raises
:class:`TakeRefused`.
"""

from __future__ import annotations

__all__ = ["TAKE_MANY", "TakeRefused"]

# Takes up to ARGV[1] messages, and at most ARGV[3] bytes of them (always at least one),
# walking the priority lists (all KEYS but the last two) in order and emptying each before
# the next, and records each in kombu's unacked hash and index (the last two KEYS) in the
# same atomic step, so no message is ever out of Redis without its unacked entry. The entry
# is kombu's format, ``[payload, exchange, routing_key]`` with the payload's JSON kept byte
# for byte, scored with ARGV[2] (the worker's clock, as kombu scores it).
# The delivery tag and info are read from the payload's last 4 KiB, where kombu's JSON puts
# ``properties`` (after the body): Redis is single-threaded, and decoding a whole 10 MiB
# payload here would stall every client for tens of milliseconds. Only a small payload
# whose tail does not have them is decoded; one that cannot be read is pushed back where
# it was and the walk stops: kombu's own path takes it next.
# Returns a flat array: key, item, key, item, ...
TAKE_MANY = """
local n = #KEYS - 2
local hash, index = KEYS[n + 1], KEYS[n + 2]
local left = tonumber(ARGV[1])
local budget = tonumber(ARGV[3] or '0')
local taken = 0
local out = {}
local function props(item)
  local tail = string.sub(item, -4096)
  local tag = string.match(tail, '"delivery_tag"%s*:%s*"([^"\\]+)"')
  local info = string.match(tail, '"delivery_info"%s*:%s*(%b{})')
  if tag and info then
    local ex = string.match(info, '"exchange"%s*:%s*"([^"\\]*)"')
    local rk = string.match(info, '"routing_key"%s*:%s*"([^"\\]*)"')
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
"""


class TakeRefused(Exception):
    """Redis refused the take script (nothing was taken).

    Args:
        reason: the refusal (``workers.batching.refusals.REASONS``: the take writes, so Redis
            refusing writes refuses it), or ``None`` for any other error reply.
    """

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason or "refused")
        self.reason = reason
