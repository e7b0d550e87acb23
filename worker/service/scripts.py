"""The Lua scripts of the worker, each registered once (EVALSHA) and called through one typed
function that owns its KEYS/ARGV layout. Each runs atomically in Redis, so no other worker can
act on the same entry in between.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis

from common.redis import is_cluster

_HAS_FINAL = """
local function has_final(key)
  for _, e in ipairs(redis.call('XRANGE', key, '-', '+')) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'type' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return true end
    end
  end
  return false
end
"""

# Publish a request's final entry, XACK and XDEL its request entry, only while this worker
# still owns the entry, or when nobody does and the result stream has no final entry yet
# (Redis lost the entry: the request still gets its answer). A worker frozen past
# claim_idle_s whose entry another worker claimed (and may have finished) publishes no
# second final entry; nor does a transaction re-sent after its reply was lost.
# KEYS: request stream, result stream. ARGV: group, entry id, consumer, maxlen, ttl, fields...
FINALIZE = _HAS_FINAL + """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and p[1] then
  if p[1][2] ~= ARGV[3] then return 0 end
else
  if has_final(KEYS[2]) then return 0 end
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[2], ARGV[5])
if ok then redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) end
pcall(redis.call, 'XDEL', KEYS[1], ARGV[2])
return 1
"""

# Append one entry to each of several result streams and refresh their TTL: a whole step's
# token entries in one command. KEYS: result streams. ARGV: maxlen, ttl, and the entries as one
# JSON array, per stream its field/value strings in order. One argument rather than one per
# string: redis-py encodes each argument in Python (about 1 us each), and a publication to 64
# streams had some 640, 0.7 ms of the writer thread's CPU beside the engine on a 2-core worker;
# as JSON it costs 0.35 ms, and the server decodes it in C (cjson).
PUBLISH_TOKENS = """
local entries = cjson.decode(ARGV[3])
for i, key in ipairs(KEYS) do
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*', unpack(entries[i]))
  redis.call('EXPIRE', key, ARGV[2])
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

# --- The fence (Redis Cluster, where a request stream and a result stream live in different
# slots and no script may touch both). The fence key sits in the result stream's slot
# (common.keys.fence_key) and holds the owner (the consumer that took or claimed the entry
# last), ``next`` (the seq the next token entry must reach) and ``done``. A worker sets it
# when it takes an entry (only if nobody did) or claims one (always, before it reads what
# was published); every token and final entry is written only while the fence names its
# writer. The XACK + XDEL of the request entry follow as a second step, after the final
# entry is out: a crash in between leaves a pending entry whose result is final, which the
# claimer acknowledges without running it (docs/protocol.md, "Redis Cluster").

# KEYS: fence, result stream. ARGV: owner, 'claim' or 'take', ttl. 1: ours now, 0: someone
# else's (a take refused).
FENCE_TAKE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if ARGV[2] == 'take' and owner and owner ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: result stream, fence. ARGV: owner, seq, number of ids, maxlen, ttl, the fence field
# that holds the choice's next seq ('next', or 'next:<index>' for choice index > 0 of n),
# '1' to write even after a gap, fields... 1 written; 0 refused (another owner, finished, or
# a seq already written: a re-sent flush); {3, next} refused after a gap: the fence
# (replicated with the stream, in the same script) says the entries from ``next`` on were
# lost, e.g. by a failover to a replica that lagged, and the worker re-sends them first
# (worker/service/outbox.py); 4 written after a gap it could not fill. No fence at all (lost
# the same way): adopted, as a claim would.
FENCED_TOKENS = """
local f = redis.call('HMGET', KEYS[2], 'owner', ARGV[6], 'done')
if not f[1] then
  redis.call('HSET', KEYS[2], 'owner', ARGV[1])
elseif f[1] ~= ARGV[1] or f[3] then
  return 0
end
local seq = tonumber(ARGV[2])
local nxt = tonumber(f[2] or '0')
if seq < nxt then return 0 end
if seq > nxt and ARGV[7] ~= '1' then return {3, nxt} end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('HSET', KEYS[2], ARGV[6], seq + tonumber(ARGV[3]))
redis.call('EXPIRE', KEYS[2], ARGV[5])
if seq > nxt then return 4 end
return 1
"""

# KEYS: result stream, fence. ARGV: owner, maxlen, ttl, k, then k pairs (fence field, the next
# seq the writer's own token entries reached), fields... 1 written; 2 written before by this
# owner (ack again); 0 refused (another owner, or a final exists already); {3, field, next}
# refused: token entries this writer sent were lost (a failover), to be re-sent first. No
# fence (Redis lost it, or an entry answered unread): written if no final is there yet and no
# token entry is missing.
FENCED_FINAL = _HAS_FINAL + """
local f = redis.call('HMGET', KEYS[2], 'owner', 'done')
if f[1] then
  if f[1] ~= ARGV[1] then return 0 end
  if f[2] then return 2 end
else
  if has_final(KEYS[1]) then return 0 end
end
local k = tonumber(ARGV[4])
for i = 0, k - 1 do
  local field, want = ARGV[5 + 2 * i], tonumber(ARGV[6 + 2 * i])
  local have = tonumber(redis.call('HGET', KEYS[2], field) or '0')
  if have < want then return {3, field, have} end
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 5 + 2 * k))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], 'done', 1)
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""

# XDEL each entry no worker has read yet; the ids deleted (the cluster half of EXPIRE_UNREAD).
# KEYS: request stream. ARGV: group, entry ids...
DELETE_UNREAD = _LAST_DELIVERED + """
local last = last_delivered(KEYS[1], ARGV[1])
if not last then return {} end
local lm, ls = string.match(last, '^(%d+)-(%d+)$')
local done = {}
for i = 2, #ARGV do
  local m, q = string.match(ARGV[i], '^(%d+)-(%d+)$')
  local later = m and (#m > #lm or (#m == #lm and (m > lm or (m == lm and tonumber(q) > tonumber(ls)))))
  if later and redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then done[#done + 1] = ARGV[i] end
end
return done
"""

Client = Any  # a redis.Redis or a pipeline of one


def next_field(index: int) -> str:
    """The fence field holding choice ``index``'s next seq."""
    return "next" if index == 0 else f"next:{index}"


def _flat(entry: dict[str, str]) -> list[str]:
    return [x for kv in entry.items() for x in kv]


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class Scripts:
    """The scripts registered on one connection. Each method takes the client to run on (the
    connection itself, or a pipeline that queues the call) and returns what Redis answered
    (on a pipeline: the pipeline; the answer comes with ``execute()``)."""

    def __init__(self, r: redis.Redis):
        self.cluster = is_cluster(r)
        run = _Eval if self.cluster else r.register_script
        hot = _Eval if self.cluster else _Sha
        self._finalize = hot(FINALIZE)  # the two of every step's flush (worker/service/outbox.py)
        self._publish_tokens = hot(PUBLISH_TOKENS)
        self._touch = run(TOUCH)
        self._unread = run(UNREAD)
        self._expire_unread = run(EXPIRE_UNREAD)
        self._fence_take = run(FENCE_TAKE)
        self._fenced_tokens = run(FENCED_TOKENS)
        self._fenced_final = run(FENCED_FINAL)
        self._delete_unread = run(DELETE_UNREAD)

    def load(self, r: redis.Redis) -> None:
        """Load the step's scripts (after a NOSCRIPT: the server restarted or was flushed)."""
        for script in (self._finalize, self._publish_tokens):
            if isinstance(script, _Sha):
                r.script_load(script.script)

    def fence_take(self, c: Client, *, fence: str, reply_to: str, owner: str, claim: bool, ttl_s: int) -> Any:
        """Make ``owner`` the fence's owner (``claim``: always; else only if nobody is); 1 or 0."""
        return self._fence_take(keys=[fence, reply_to], args=[owner, "claim" if claim else "take", ttl_s], client=c)

    def fenced_tokens(self, c: Client, *, reply_to: str, fence: str, owner: str, seq: int, n_ids: int, maxlen: int,
                      ttl_s: int, entry: dict[str, str], gap_ok: bool = False) -> Any:
        """One token entry, only while ``owner`` holds the fence and ``seq`` is the next of its
        choice (each of n choices counts its own seqs); 1, 0, [3, next] (a gap) or 4."""
        return self._fenced_tokens(keys=[reply_to, fence], args=[owner, seq, n_ids, maxlen, ttl_s,
                                                                 next_field(int(entry.get("index", 0))),
                                                                 "1" if gap_ok else "0", *_flat(entry)], client=c)

    def fenced_final(self, c: Client, *, reply_to: str, fence: str, owner: str, maxlen: int, ttl_s: int,
                     entry: dict[str, str], expect: dict[str, int] | None = None) -> Any:
        """The final entry, only while ``owner`` holds the fence and each fence field of
        ``expect`` reached its value; 1 written, 2 written before, 0 refused, [3, field, next]."""
        pairs = [x for kv in (expect or {}).items() for x in kv]
        return self._fenced_final(keys=[reply_to, fence], args=[owner, maxlen, ttl_s, len(pairs) // 2, *pairs,
                                                                *_flat(entry)], client=c)

    def delete_unread(self, c: Client, stream: str, entry_ids: list[str], *, group: str) -> list[str]:
        """XDEL those of ``entry_ids`` no worker has read yet; the ids deleted."""
        return [_s(i) for i in self._delete_unread(keys=[stream], args=[group, *entry_ids], client=c) or []]

    def finalize(self, c: Client, *, stream: str, entry_id: str, reply_to: str, group: str, consumer: str,
                 maxlen: int, ttl_s: int, entry: dict[str, str]) -> Any:
        """Final entry + XACK + XDEL if the entry is still ours; 1 when published, 0 when skipped."""
        return self._finalize(keys=[stream, reply_to], args=[group, entry_id, consumer, maxlen, ttl_s, *_flat(entry)],
                              client=c)

    def publish_tokens(self, c: Client, entries: list[tuple[str, dict[str, str]]], *, maxlen: int, ttl_s: int) -> Any:
        """One entry on each of several result streams (a key may appear once)."""
        # ensure_ascii=False: the strings travel as the UTF-8 that XADD would store, not as \u escapes
        packed = json.dumps([_flat(entry) for _, entry in entries], ensure_ascii=False, separators=(",", ":"))
        return self._publish_tokens(keys=[k for k, _ in entries], args=[maxlen, ttl_s, packed], client=c)

    def touch(self, c: Client, stream: str, entry_ids: list[str], *, group: str, consumer: str,
              idle_ms: int | None = None) -> Any:
        """Reset (or with ``idle_ms`` set) the idle time of our entries; see :func:`touched`."""
        return self._touch(keys=[stream], args=[group, consumer, "" if idle_ms is None else idle_ms, *entry_ids],
                           client=c)

    def unread(self, c: Client, streams: list[str], *, group: str, count: int) -> list[list[str]]:
        """Per stream, the ids of its first ``count`` entries no worker has read yet (one call
        per stream, so each touches one slot; one round trip per node)."""
        pipe = c.pipeline(transaction=False)
        for stream in streams:
            self._unread(keys=[stream], args=[group, count], client=pipe)
        return [[_s(i) for i in reply[0]] if reply else [] for reply in pipe.execute()]

    def expire_unread(self, c: Client, stream: str, finals: list[tuple[str, str, dict[str, str]]], *, group: str,
                      maxlen: int, ttl_s: int) -> list[str]:
        """Delete and answer each (entry id, result key, final entry) still unread; the ids answered."""
        args: list[Any] = [group, maxlen, ttl_s]
        for entry_id, _, entry in finals:
            flat = _flat(entry)
            args += [entry_id, len(flat), *flat]
        done = self._expire_unread(keys=[stream, *[k for _, k, _ in finals]], args=args, client=c)
        return [_s(i) for i in done or []]


class _Sha:
    """A script run by EVALSHA alone. redis-py's registered scripts, queued on a pipeline, make
    its execute() send SCRIPT EXISTS first: one more round trip on every step's flush. Here a
    NOSCRIPT (a restarted or flushed server) is answered instead: a direct call loads the
    script and runs it again; the outbox re-sends the operations it refused (Outbox._flush_once)."""

    def __init__(self, script: str):
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    def __call__(self, keys: list[str], args: list[Any], client: Client) -> Any:
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:  # a direct call (a pipeline's errors come with execute())
            client.script_load(self.script)
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


class _Eval:
    """A script sent whole (EVAL) each call: on a cluster, a node promoted by a failover has
    none of the scripts loaded, and redis-py's cluster pipeline does not reload them."""

    def __init__(self, script: str):
        self.script = script

    def __call__(self, keys: list[str], args: list[Any], client: Client) -> Any:
        return client.execute_command("EVAL", self.script, len(keys), *keys, *args)


def touched(reply: Any) -> tuple[set[str], set[str]]:
    """A touch reply as (ids another consumer owns, ids nobody owns)."""
    lost, gone = reply
    return {_s(i) for i in lost}, {_s(i) for i in gone}
