"""The Lua scripts of the worker, each registered once (EVALSHA) and called through one typed
function that owns its KEYS/ARGV layout. Each runs atomically in Redis, so no other worker can
act on the same entry in between.
"""

from __future__ import annotations

from typing import Any

import redis

# Publish a request's final entry, XACK and XDEL its request entry, only while this worker
# still owns the entry, or when nobody does and the result stream has no final entry yet
# (Redis lost the entry: the request still gets its answer). A worker frozen past
# claim_idle_s whose entry another worker claimed (and may have finished) publishes no
# second final entry; nor does a transaction re-sent after its reply was lost.
# KEYS: request stream, result stream. ARGV: group, entry id, consumer, maxlen, ttl, fields...
FINALIZE = """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and p[1] then
  if p[1][2] ~= ARGV[3] then return 0 end
else
  for _, e in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'type' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return 0 end
    end
  end
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[2], ARGV[5])
if ok then redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) end
pcall(redis.call, 'XDEL', KEYS[1], ARGV[2])
return 1
"""

# Append one entry to each of several result streams and refresh their TTL: a whole step's
# token entries in one command. KEYS: result streams. ARGV: maxlen, ttl, then per stream: the
# number of field/value strings, the strings.
PUBLISH_TOKENS = """
local i = 3
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[i])
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, i + 1, i + n))
  redis.call('EXPIRE', key, ARGV[2])
  i = i + 1 + n
end
return #KEYS
"""

# Reset the idle time of entries this consumer owns (IDLE ARGV[3] ms when given: a release),
# never taking one another consumer owns. Returns {ids owned by someone else, ids nobody owns}.
# KEYS: request stream. ARGV: group, consumer, idle ms or '', entry ids...
TOUCH = """
local lost, gone = {}, {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if ok and p[1] then
    if p[1][2] ~= ARGV[2] then
      lost[#lost + 1] = id
    elseif ARGV[3] == '' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[3], 'JUSTID')
    end
  else
    gone[#gone + 1] = id
  end
end
return {lost, gone}
"""

_LAST_DELIVERED = """
local function last_delivered(key, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', key)
  if not ok then return nil end
  for _, g in ipairs(groups) do
    local name, last
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if name == group then return last end
  end
  return nil
end
"""

# The ids of the first ARGV[2] entries no worker has read yet, per stream (for aging).
# KEYS: request streams. ARGV: group, count.
UNREAD = _LAST_DELIVERED + """
local out = {}
for i, key in ipairs(KEYS) do
  local last = last_delivered(key, ARGV[1])
  local ids = {}
  if last then
    for _, e in ipairs(redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', ARGV[2])) do ids[#ids + 1] = e[1] end
  end
  out[i] = ids
end
return out
"""

# Answer entries that expired (or were cancelled) while unread: XDEL each one that no worker
# has read (its id is past the group's last-delivered id) and publish its final entry. One
# whose result stream exists already (a reused id) is left for the pull path to refuse.
# KEYS: request stream, then one result stream per entry. ARGV: group, maxlen, ttl, then per
# entry: its id, the number of field values, the field values. Returns the ids answered.
EXPIRE_UNREAD = _LAST_DELIVERED + """
local function after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if not am or not bm then return false end
  if #am ~= #bm then return #am > #bm end
  if am ~= bm then return am > bm end
  if #as ~= #bs then return #as > #bs end
  return as > bs
end
local last = last_delivered(KEYS[1], ARGV[1])
if not last then return {} end
local done, i, k = {}, 4, 2
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  if after(id, last) and redis.call('EXISTS', KEYS[k]) == 0 and redis.call('XDEL', KEYS[1], id) == 1 then
    redis.call('XADD', KEYS[k], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, i + 2, i + 1 + n))
    redis.call('EXPIRE', KEYS[k], ARGV[3])
    done[#done + 1] = id
  end
  i = i + 2 + n
  k = k + 1
end
return done
"""

Client = Any  # a redis.Redis or a pipeline of one


def _flat(entry: dict[str, str]) -> list[str]:
    return [x for kv in entry.items() for x in kv]


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class Scripts:
    """The scripts registered on one connection. Each method takes the client to run on (the
    connection itself, or a pipeline that queues the call) and returns what Redis answered
    (on a pipeline: the pipeline; the answer comes with ``execute()``)."""

    def __init__(self, r: redis.Redis):
        self._finalize = r.register_script(FINALIZE)
        self._publish_tokens = r.register_script(PUBLISH_TOKENS)
        self._touch = r.register_script(TOUCH)
        self._unread = r.register_script(UNREAD)
        self._expire_unread = r.register_script(EXPIRE_UNREAD)

    def finalize(self, c: Client, *, stream: str, entry_id: str, reply_to: str, group: str, consumer: str,
                 maxlen: int, ttl_s: int, entry: dict[str, str]) -> Any:
        """Final entry + XACK + XDEL if the entry is still ours; 1 when published, 0 when skipped."""
        return self._finalize(keys=[stream, reply_to], args=[group, entry_id, consumer, maxlen, ttl_s, *_flat(entry)],
                              client=c)

    def publish_tokens(self, c: Client, entries: list[tuple[str, dict[str, str]]], *, maxlen: int, ttl_s: int) -> Any:
        """One entry on each of several result streams (a key may appear once)."""
        args: list[Any] = [maxlen, ttl_s]
        for _, entry in entries:
            flat = _flat(entry)
            args += [len(flat), *flat]
        return self._publish_tokens(keys=[k for k, _ in entries], args=args, client=c)

    def touch(self, c: Client, stream: str, entry_ids: list[str], *, group: str, consumer: str,
              idle_ms: int | None = None) -> Any:
        """Reset (or with ``idle_ms`` set) the idle time of our entries; see :func:`touched`."""
        return self._touch(keys=[stream], args=[group, consumer, "" if idle_ms is None else idle_ms, *entry_ids],
                           client=c)

    def unread(self, c: Client, streams: list[str], *, group: str, count: int) -> list[list[str]]:
        """Per stream, the ids of its first ``count`` entries no worker has read yet."""
        reply = self._unread(keys=streams, args=[group, count], client=c)
        return [[_s(i) for i in ids] for ids in reply or []]

    def expire_unread(self, c: Client, stream: str, finals: list[tuple[str, str, dict[str, str]]], *, group: str,
                      maxlen: int, ttl_s: int) -> list[str]:
        """Delete and answer each (entry id, result key, final entry) still unread; the ids answered."""
        args: list[Any] = [group, maxlen, ttl_s]
        for entry_id, _, entry in finals:
            flat = _flat(entry)
            args += [entry_id, len(flat), *flat]
        done = self._expire_unread(keys=[stream, *[k for _, k, _ in finals]], args=args, client=c)
        return [_s(i) for i in done or []]


def touched(reply: Any) -> tuple[set[str], set[str]]:
    """A touch reply as (ids another consumer owns, ids nobody owns)."""
    lost, gone = reply
    return {_s(i) for i in lost}, {_s(i) for i in gone}
