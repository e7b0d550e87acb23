"""The batch runner every gateway runs: finds active batches, takes their leases, carries them.

Any number of runners (gateways, or ``tokenq batch submit --wait``) share one Redis: each scans
``{prefix}:batches:active`` and tries ``SET {prefix}:batch:{id}:lease <token> NX PX`` on batches
no runner holds; the one that wins carries the batch and renews the lease every third of
``batch_lease_s``. A runner that dies (SIGKILL included) stops renewing, its lease expires, and
the next runner to scan takes the batch over where Redis says it stands.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid

import redis
import redis.asyncio

from common.keys import Keys
from common.settings import Settings
from producer.batch import scripts
from producer.batch.carrier import Carrier, LeaseLost
from producer.batch.records import batch_error, decode_hash
from producer.gateway.metrics import Metrics
from producer.types import build_request

log = logging.getLogger("tokenq.batch")

SCAN_S = 0.5  # how often active batches are looked for
MAX_CARRIED = 8  # batches one runner carries at once (the others are left to other runners, or later)


class BatchRunner:
    def __init__(self, r: redis.asyncio.Redis, settings: Settings, *, name: str | None = None,
                 only: set[str] | None = None, metrics: Metrics | None = None):
        self.r, self.s = r, settings
        self.usage = (metrics or Metrics()).usage  # batch tokens count where the gateway's do
        self.only = only  # carry just these batches (``tokenq batch submit --wait``), or any
        self.keys = Keys(settings.prefix)
        self.name = name or f"runner-{uuid.uuid4().hex[:8]}"
        self.prepare = functools.partial(build_request, keys=self.keys, limits=settings.limits)
        self.carried: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Scan now (a batch was just created here): no wait for the next scan to start it."""
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self.carried.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        down = False  # say so once when Redis goes away, and once when it is back
        while True:
            try:
                await self.scan()
                if down:
                    log.info("batch runner %s: Redis is back", self.name)
                down = False
            except (redis.RedisError, OSError) as e:
                if not down:
                    log.warning("batch runner %s: Redis: %s (batches wait until it is back)", self.name, e)
                down = True
            try:
                await asyncio.wait_for(self._wake.wait(), SCAN_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def scan(self) -> None:
        for raw in await self.r.smembers(self.keys.batches_active):
            bid = raw.decode() if isinstance(raw, bytes) else raw
            if bid in self.carried or len(self.carried) >= MAX_CARRIED or (self.only and bid not in self.only):
                continue
            if not await self.r.exists(self.keys.batch(bid)):
                await self.r.srem(self.keys.batches_active, bid)  # expired
                continue
            token = f"{self.name}:{uuid.uuid4().hex}"
            if await self.r.set(self.keys.batch_lease(bid), token, nx=True, px=self.lease_ms):
                t = asyncio.get_running_loop().create_task(self.carry(bid, token))
                self.carried[bid] = t
                t.add_done_callback(lambda _t, b=bid: self.carried.pop(b, None))

    @property
    def lease_ms(self) -> int:
        return max(100, int(self.s.batch_lease_s * 1000))

    async def carry(self, bid: str, token: str) -> None:
        c = Carrier(self.r, self.keys, self.s, bid, token, self.prepare, self.usage)
        keeper = asyncio.get_running_loop().create_task(self.keep_lease(c))
        try:
            log.info("batch %s: carried by %s", bid, self.name)
            await c.carry()
        except LeaseLost:
            log.warning("batch %s: %s lost its lease; another runner carries it on", bid, self.name)
        except (redis.RedisError, OSError) as e:
            log.warning("batch %s: Redis failed (%s); the lease goes back for a runner to retry", bid, e)
        except Exception as e:  # a bug must not leave the batch stuck: it fails, with the reason
            log.exception("batch %s failed in %s", bid, self.name)
            await self.fail(bid, token, e)
        finally:
            keeper.cancel()
            try:
                await scripts.run(self.r, scripts.RELEASE, [self.keys.batch_lease(bid)], [token])
            except (redis.RedisError, OSError):
                pass  # it expires on its own

    async def keep_lease(self, c: Carrier) -> None:
        while True:
            await asyncio.sleep(self.s.batch_lease_s / 3)
            try:
                ok = await scripts.run(self.r, scripts.RENEW, [self.keys.batch_lease(c.bid)], [c.token, self.lease_ms])
            except (redis.RedisError, OSError) as e:
                log.warning("batch %s: could not renew the lease: %s", c.bid, e)
                continue
            if not ok:
                c.lost = True
                return

    async def fail(self, bid: str, token: str, e: Exception) -> None:
        h = decode_hash(await self.r.hgetall(self.keys.batch(bid)))
        statuses = tuple(s for s in ("validating", "in_progress", "finalizing", "cancelling") if s == h.get("status"))
        if statuses:
            await scripts.transition(self.r, self.keys, bid, token, statuses, "failed", "failed_at",
                                     {"errors": json.dumps([batch_error("internal", f"the batch runner failed: {e}")])})
