"""Files and batch records in Redis (asyncio): what the API reads and writes; runners write the rest.

A file is a hash of its metadata (``{prefix}:file:{id}``) and a list of its lines
(``{prefix}:file:{id}:lines``), so a runner can read line ``i`` of a 100,000-line file without
reading the others. An input file is split on ``\\n`` and joins back byte for byte; an output
file's lines each end with ``\\n`` (its hash says ``eol``). Every key takes ``batch_ttl_s``.
A batch is one hash (:func:`records.batch_fields`), listed in ``{prefix}:batches`` (by creation)
and, while it has work left, in ``{prefix}:batches:active``, where runners find it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio

from common.keys import Keys
from common.redis import is_cluster
from common.settings import Settings
from producer.batch import records, scripts
from producer.batch.records import decode_hash

PUSH_CHUNK = 1000  # lines per RPUSH / LRANGE


# A batch's feed script queues a line's request entries and advances the batch's record in one
# step (so a line is fed once); on a Redis Cluster those keys live in different slots.
CLUSTER_REFUSAL = ("batch jobs need a single Redis server, not a Redis Cluster (a line's request entries and the "
                   "batch's record are written in one script): see docs/protocol.md, 'Batch jobs'")


class StoreError(Exception):
    """A request the store refuses: ``status`` and ``message`` become the HTTP error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class Store:
    def __init__(self, r: redis.asyncio.Redis, keys: Keys, *, ttl_s: int, max_file_bytes: int, model_name: str):
        self.r, self.keys, self.ttl_s, self.max_file_bytes = r, keys, ttl_s, max_file_bytes
        self.model_name = model_name  # recorded in each batch: whichever runner carries it judges ``model`` alike

    @classmethod
    def of(cls, r: redis.asyncio.Redis, settings: Settings) -> Store:
        if is_cluster(r):
            raise StoreError(501, CLUSTER_REFUSAL, code="cluster_unsupported")
        return cls(r, Keys(settings.prefix), ttl_s=settings.batch_ttl_s, max_file_bytes=settings.batch_max_file_bytes,
                   model_name=settings.model_name)

    # ------------------------------------------------------------ files
    async def put_file(self, data: bytes, *, filename: str, purpose: str) -> dict[str, Any]:
        if purpose != "batch":
            raise StoreError(400, f"purpose must be 'batch', got {purpose!r}", "purpose")
        if len(data) > self.max_file_bytes:
            raise StoreError(413, f"the file is {len(data)} bytes; at most {self.max_file_bytes} are accepted",
                             "file", "file_too_large")
        if not data.strip():
            raise StoreError(400, "the file is empty", "file")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise StoreError(400, "the file must be UTF-8 JSONL", "file") from None
        fid, now = records.new_file_id(), int(time.time())
        meta = records.file_fields(fid, filename=filename, purpose=purpose, size=len(data), created_at=now,
                                   expires_at=now + self.ttl_s)
        lines = data.split(b"\n")
        pipe = self.r.pipeline(transaction=True)  # all of it or nothing: no half-uploaded file
        for i in range(0, len(lines), PUSH_CHUNK):
            pipe.rpush(self.keys.file_lines(fid), *lines[i:i + PUSH_CHUNK])
        pipe.hset(self.keys.file(fid), mapping=meta)
        pipe.expire(self.keys.file_lines(fid), self.ttl_s)
        pipe.expire(self.keys.file(fid), self.ttl_s)
        pipe.zadd(self.keys.files, {fid: now})
        await pipe.execute()
        return records.file_object(meta)

    async def file_hash(self, file_id: str) -> dict[str, str]:
        h = decode_hash(await self.r.hgetall(self.keys.file(file_id)))
        if not h:
            raise StoreError(404, f"no file {file_id!r}", "file_id", "not_found")
        return h

    async def get_file(self, file_id: str) -> dict[str, Any]:
        return records.file_object(await self.file_hash(file_id))

    async def list_files(self, purpose: str | None = None) -> dict[str, Any]:
        ids = [records._s(x) for x in await self.r.zrevrange(self.keys.files, 0, -1)]
        data = []
        for fid in ids:
            h = decode_hash(await self.r.hgetall(self.keys.file(fid)))
            if not h:
                await self.r.zrem(self.keys.files, fid)  # expired
            elif purpose is None or h.get("purpose") == purpose:
                data.append(records.file_object(h))
        return {"object": "list", "data": data, "has_more": False}

    async def file_content(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, a chunk of lines at a time (404 raised before the first chunk)."""
        h = await self.file_hash(file_id)
        eol = h.get("eol") == "1"
        key = self.keys.file_lines(file_id)

        async def chunks() -> AsyncIterator[bytes]:
            start = 0
            while True:
                part = await self.r.lrange(key, start, start + PUSH_CHUNK - 1)
                if not part:
                    return
                if eol:
                    yield b"".join(x + b"\n" for x in part)
                else:  # split on \n at upload: the separators go back between lines
                    yield (b"\n" if start else b"") + b"\n".join(part)
                start += len(part)

        return chunks()

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        for raw in await self.r.smembers(self.keys.batches_active):  # a running batch still reads its input
            if records._s(await self.r.hget(self.keys.batch(records._s(raw)), "input_file_id") or b"") == file_id:
                raise StoreError(409, f"file {file_id!r} is the input of batch {records._s(raw)}, which has not "
                                 "ended", "file_id")
        n = await self.r.delete(self.keys.file(file_id), self.keys.file_lines(file_id))
        await self.r.zrem(self.keys.files, file_id)
        if not n:
            raise StoreError(404, f"no file {file_id!r}", "file_id", "not_found")
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------ batches
    async def create_batch(self, *, input_file_id: Any, endpoint: Any, completion_window: Any, metadata: Any,
                           priority: str) -> dict[str, Any]:
        if not isinstance(input_file_id, str):
            raise StoreError(400, "input_file_id is required", "input_file_id")
        if endpoint not in records.ENDPOINTS:
            raise StoreError(400, f"endpoint must be one of {', '.join(records.ENDPOINTS)}, got {endpoint!r}",
                             "endpoint")
        window = records.window_seconds(completion_window)
        if window is None or window > self.ttl_s:
            raise StoreError(400, "completion_window must be '24h' (or <n>s, <n>m, <n>h within the "
                             "store's TTL)", "completion_window")
        why = records.check_metadata(metadata)
        if why:
            raise StoreError(400, why, "metadata")
        f = await self.file_hash(input_file_id)
        if f.get("purpose") != "batch":
            raise StoreError(400, f"file {input_file_id!r} is not a batch input file", "input_file_id")
        bid, now = records.new_batch_id(), int(time.time())
        h = records.batch_fields(bid, input_file_id=input_file_id, endpoint=endpoint, window=completion_window,
                                 metadata=metadata, priority=priority, created_at=now, expires_at=now + window,
                                 model=self.model_name)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(bid), mapping=h)
        pipe.expire(self.keys.batch(bid), self.ttl_s)
        for k in (self.keys.file(input_file_id), self.keys.file_lines(input_file_id)):
            pipe.expire(k, self.ttl_s)  # the input outlives the batch that reads it
        pipe.zadd(self.keys.batches, {bid: time.time()})  # sub-second: listing keeps creation order
        pipe.sadd(self.keys.batches_active, bid)
        await pipe.execute()
        return records.batch_object(h)

    async def batch_hash(self, batch_id: str) -> dict[str, str]:
        h = decode_hash(await self.r.hgetall(self.keys.batch(batch_id)))
        if not h:
            raise StoreError(404, f"no batch {batch_id!r}", "batch_id", "not_found")
        return h

    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        return records.batch_object(await self.batch_hash(batch_id))

    async def list_batches(self, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first, ``limit`` at a time after the batch ``after`` (OpenAI's cursor pagination)."""
        start = 0
        if after:
            rank = await self.r.zrevrank(self.keys.batches, after)
            if rank is None:
                raise StoreError(400, f"no batch {after!r} to list after", "after")
            start = rank + 1
        data: list[dict[str, Any]] = []
        stale: list[str] = []
        has_more = False
        while not has_more:
            ids = [records._s(x) for x in await self.r.zrevrange(self.keys.batches, start, start + limit)]
            if not ids:
                break
            start += len(ids)
            for bid in ids:
                h = decode_hash(await self.r.hgetall(self.keys.batch(bid)))
                if not h:
                    stale.append(bid)  # expired
                elif len(data) == limit:
                    has_more = True
                    break
                else:
                    data.append(records.batch_object(h))
        if stale:
            await self.r.zrem(self.keys.batches, *stale)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        h = await self.batch_hash(batch_id)
        if h["status"] in ("validating", "in_progress"):
            await scripts.transition(self.r, self.keys, batch_id, None, ("validating", "in_progress"), "cancelling",
                                     "cancelling_at")
        elif h["status"] not in ("cancelling", "cancelled"):
            raise StoreError(409, f"batch {batch_id!r} is {h['status']} and cannot be cancelled", "batch_id")
        return await self.get_batch(batch_id)

