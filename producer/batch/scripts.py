"""The Lua scripts that move a batch on: every write a runner makes is one of them, fenced by its lease.

A runner holds ``{prefix}:batch:{id}:lease`` (a random token, with a TTL it renews). Each script
first checks that the lease still holds the caller's token, so a runner that lost its lease
(paused, partitioned, or simply slower than the one that took over) can write nothing. Within
a script, queueing a line's requests and recording them in the batch's in-flight hash happen
together, as do writing a line's output and removing it from the in-flight hash: a line is
queued once and written once, whichever runner carries the batch and however often it changes
hands.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio

from common.keys import Keys

# Replies of FEED and FINISH.
OK, SKIPPED, LOST_LEASE, WRONG_STATUS = 1, 0, -1, -2

_LEASE_OK = """
local function lease_ok(key, token)
  return token == '' or redis.call('GET', key) == token
end
"""

# KEYS: lease, batch, inflight, error lines, request stream
# ARGV: token, line index, kind (req|err|skip), ttl, allowed statuses (comma-separated), payload
#   req: payload = JSON array of requests, each a flat [field, value, ...] array
#   err: payload = the error-file line
FEED = _LEASE_OK + """
if not lease_ok(KEYS[1], ARGV[1]) then return -1 end
local status = redis.call('HGET', KEYS[2], 'status')
if not status or not string.find(',' .. ARGV[5] .. ',', ',' .. status .. ',', 1, true) then return -2 end
if redis.call('HGET', KEYS[2], 'next') ~= ARGV[2] then return 0 end
if ARGV[3] == 'req' then
  local reqs = cjson.decode(ARGV[6])
  for _, f in ipairs(reqs) do redis.call('XADD', KEYS[5], '*', unpack(f)) end
  redis.call('HSET', KEYS[3], ARGV[2], #reqs)
  redis.call('EXPIRE', KEYS[3], ARGV[4])
elseif ARGV[3] == 'err' then
  redis.call('RPUSH', KEYS[4], ARGV[6])
  redis.call('EXPIRE', KEYS[4], ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'failed', 1)
  redis.call('HINCRBY', KEYS[2], 'err_lines', 1)
  redis.call('HINCRBY', KEYS[2], 'err_bytes', #ARGV[6] + 1)
end
redis.call('HSET', KEYS[2], 'next', tonumber(ARGV[2]) + 1)
return 1
"""

# KEYS: lease, batch, inflight, the output or error lines, then the line's result streams
# ARGV: token, line index, kind (out|err), the line, ttl
FINISH = _LEASE_OK + """
if not lease_ok(KEYS[1], ARGV[1]) then return -1 end
if redis.call('HDEL', KEYS[3], ARGV[2]) == 0 then return 0 end
redis.call('RPUSH', KEYS[4], ARGV[4])
redis.call('EXPIRE', KEYS[4], ARGV[5])
redis.call('HINCRBY', KEYS[2], ARGV[3] == 'out' and 'completed' or 'failed', 1)
redis.call('HINCRBY', KEYS[2], ARGV[3] .. '_lines', 1)
redis.call('HINCRBY', KEYS[2], ARGV[3] .. '_bytes', #ARGV[4] + 1)
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
"""

# KEYS: lease, batch, active batches
# ARGV: token ('' for no lease: the API's cancel), allowed statuses, new status, timestamp field, now,
#       JSON object of more fields to set, 1 when the new status is final
TRANSITION = _LEASE_OK + """
if not lease_ok(KEYS[1], ARGV[1]) then return -1 end
local status = redis.call('HGET', KEYS[2], 'status')
if not status or not string.find(',' .. ARGV[2] .. ',', ',' .. status .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[2], 'status', ARGV[3], ARGV[4], ARGV[5])
for k, v in pairs(cjson.decode(ARGV[6])) do redis.call('HSET', KEYS[2], k, v) end
if ARGV[7] == '1' then redis.call('SREM', KEYS[3], redis.call('HGET', KEYS[2], 'id')) end
return 1
"""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

FINAL = ("completed", "failed", "expired", "cancelled")


def run(r: redis.asyncio.Redis, text: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
    """Run a script by its SHA (loaded when the server lacks it); ``client`` may be a pipeline of ``r``."""
    cache = r.__dict__.setdefault("_tokenq_batch_scripts", {})
    if text not in cache:
        cache[text] = r.register_script(text)
    return cache[text](keys=keys, args=args, client=client)


def transition(r: redis.asyncio.Redis, keys: Keys, batch_id: str, token: str | None, statuses: tuple[str, ...],
               status: str, stamp: str, fields: dict[str, Any] | None = None) -> Any:
    """Move the batch to ``status`` (stamping ``stamp``) if it is in one of ``statuses``; 1 if it moved."""
    return run(r, TRANSITION, [keys.batch_lease(batch_id), keys.batch(batch_id), keys.batches_active],
               [token or "", ",".join(statuses), status, stamp, int(time.time()),
                json.dumps({k: str(v) for k, v in (fields or {}).items()}), "1" if status in FINAL else "0"])
