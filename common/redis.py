"""Redis connections with the retry and timeout settings every tokenq part uses."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)
# redis-py's cluster client follows MOVED/ASK itself and, on a dead node or CLUSTERDOWN,
# refreshes its slot map and retries, but at once: its retries are spent before a replica
# is promoted (node_timeout plus an election, seconds). So each command is retried with a
# backoff for up to FAILOVER_WINDOW_S.
FAILOVER_WINDOW_S = 20.0
CLUSTER_RETRIES = 3
CLUSTER_BACKOFF = dict(cap=1.0, base=0.1)
CLUSTER_OPTS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval")
_CLUSTER_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
                      redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError)


class _Backoff:
    """Waits between tries of one command until FAILOVER_WINDOW_S has passed (then re-raise)."""

    def __init__(self) -> None:
        self.until = time.monotonic() + FAILOVER_WINDOW_S
        self.wait = CLUSTER_BACKOFF["base"]

    def next(self, e: Exception) -> float:
        if time.monotonic() + self.wait > self.until:
            raise e
        w, self.wait = self.wait, min(self.wait * 2, CLUSTER_BACKOFF["cap"])
        return w


def _known_keys(args: tuple) -> list | None:
    """The keys of the commands whose keys redis-py would ask the server for: XREAD /
    XREADGROUP (the first half of what follows STREAMS) and, in a cluster pipeline, EVAL /
    EVALSHA (numkeys after the script).

    For these "movable keys" commands redis-py sends COMMAND GETKEYS to its default node: one
    more round trip per command (a pipeline of N scripts became N+1 round trips), and one
    that fails for as long as the default node is a dead master. Read them here instead."""
    cmd = str(args[0]).upper()
    if cmd in ("EVAL", "EVALSHA"):
        n = int(args[2]) if len(args) > 2 else 0
        return list(args[3:3 + n]) or None
    start = {"XREAD": 1, "XREADGROUP": 4}.get(cmd)
    if start is None:
        return None
    for i in range(start, len(args)):
        if isinstance(args[i], (str, bytes)) and args[i].upper() in ("STREAMS", b"STREAMS"):
            rest = args[i + 1:]
            return list(rest[:len(rest) // 2])
    return None


class Cluster(redis.cluster.RedisCluster):
    """A RedisCluster that rides through a failover (see FAILOVER_WINDOW_S)."""

    def execute_command(self, *args, **kwargs):
        backoff = _Backoff()
        while True:
            try:
                return super().execute_command(*args, **kwargs)
            except _CLUSTER_RETRYABLE as e:
                time.sleep(backoff.next(e))
                # redis-py moves off a dead default node only when the command itself was sent
                # there; an error before that (finding a command's keys) would repeat forever.
                self.replace_default_node()

    def _get_command_keys(self, *args):
        keys = _known_keys(args)
        return keys if keys is not None else super()._get_command_keys(*args)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        pipe._get_command_keys = self._get_command_keys  # redis-py's pipeline is its own RedisCluster
        return pipe


class AsyncCluster(redis.asyncio.cluster.RedisCluster):
    """The asyncio twin of :class:`Cluster`."""

    async def execute_command(self, *args, **kwargs):
        backoff = _Backoff()
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            except _CLUSTER_RETRYABLE as e:
                await asyncio.sleep(backoff.next(e))
                self.replace_default_node()

    async def _determine_slot(self, command: str, *args):
        keys = _known_keys((command, *args))
        if not keys:
            return await super()._determine_slot(command, *args)
        slots = {self.keyslot(k) for k in keys}
        if len(slots) != 1:
            raise redis.exceptions.RedisClusterException(f"{command} - all keys must map to the same key slot")
        return slots.pop()


def is_cluster_url(url: str, timeout: float = 5.0) -> bool:
    """Whether the server at ``url`` runs in cluster mode (INFO cluster: ``cluster_enabled:1``).

    A server that cannot be reached counts as a single Redis (the caller's client retries
    and connects later, as it always has)."""
    try:
        probe = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return str(probe.info("cluster").get("cluster_enabled", 0)) == "1"
        finally:
            probe.close()
    except (redis.RedisError, OSError):
        return False


def is_cluster(r) -> bool:
    """Whether ``r`` (a client or a pipeline, sync or asyncio) talks to a Redis Cluster."""
    return isinstance(r, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster,
                          redis.asyncio.cluster.ClusterPipeline))


def _cluster_opts(kwargs: dict) -> dict:
    opts = {k: v for k, v in kwargs.items() if k in CLUSTER_OPTS}
    opts.setdefault("socket_connect_timeout", 5)
    opts["retry"] = Retry(ExponentialBackoff(**CLUSTER_BACKOFF), CLUSTER_RETRIES)
    return opts


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``url`` (redis://, rediss://, with user:password@ when AUTH is on): a
    ``RedisCluster`` when the server is a cluster node (any node's URL will do), else a Redis.

    Replies stay bytes: prompts may be binary (msgpack) and ids are decoded where needed.
    """
    if is_cluster_url(url):
        return Cluster.from_url(url, **_cluster_opts(kwargs))
    opts = dict(
        socket_connect_timeout=5,
        socket_keepalive=True,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 3),
        retry_on_error=list(_RETRYABLE),
    )
    opts.update(kwargs)
    return redis.Redis.from_url(url, **opts)


def redact_url(url: str) -> str:
    """The URL without its password (for logs and messages): ``redis://user:***@host:port/db``."""
    try:
        parts = urlsplit(url)
        if parts.password:
            host = parts.netloc.rsplit("@", 1)[-1]
            return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    except ValueError:
        pass
    return url


def connect_async(url: str, **kwargs) -> redis.asyncio.Redis:
    """The asyncio twin of :func:`connect` (the cluster check itself is one short sync call)."""
    if is_cluster_url(url):
        return AsyncCluster.from_url(url, **_cluster_opts(kwargs))
    opts = dict(socket_connect_timeout=5, socket_keepalive=True, health_check_interval=15)
    opts.update(kwargs)
    return redis.asyncio.Redis.from_url(url, **opts)


def xautoclaim_entries(reply) -> tuple[bytes, list]:
    """(next start id, claimed entries) from XAUTOCLAIM; Redis 6.2 replies with 2 items, 7 with 3."""
    if isinstance(reply, (list, tuple)):
        nxt, entries = reply[0], reply[1]
    else:  # pragma: no cover - redis-py may parse it into a dict in some versions
        nxt, entries = reply.get("next"), reply.get("entries", [])
    return nxt, [e for e in entries if e and e[1] is not None]
