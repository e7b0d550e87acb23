"""The Batch API's routes: ``/v1/files`` and ``/v1/batches``, as OpenAI defines them.

``POST /v1/files`` (multipart: ``file``, ``purpose=batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``, ``metadata``, and
tokenq's ``priority``: the queue level of the batch's requests, ``low`` unless set),
``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.

The gateway includes :data:`router`; its :func:`lifespan` (FastAPI runs an included router's
inside the app's) holds the store and this process's :class:`~producer.batch.runner.BatchRunner`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from common.keys import LEVELS, priority_of
from common.redis import connect_async
from common.settings import Settings
from producer.batch.store import Store, StoreError
from producer.gateway.errors import APIError, bad
from producer.gateway.state import check_auth, json_body

UPLOAD_SLACK = 64 * 1024  # multipart framing around the file, allowed over the size cap


def store_of(request: Request) -> Store:
    if (refused := request.app.state.batch_refused) is not None:
        raise _api_error(refused)  # a Redis Cluster: the Batch API answers 501, the rest of the gateway serves
    return request.app.state.batch_store


def _api_error(e: StoreError) -> APIError:
    return APIError(e.status, e.message, "invalid_request_error", e.param, e.code)


async def _call(coro: Any) -> Any:
    try:
        return await coro
    except StoreError as e:
        raise _api_error(e) from None


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """While the app serves: the store for the routes and a runner carrying batches, on a Redis
    connection of their own (the runner's blocking reads never hold up the interactive routes')."""
    from producer.batch.runner import BatchRunner  # here: the gateway package imports this module

    settings: Settings = app.state.settings
    r = connect_async(settings.redis_url)
    runner = None
    app.state.batch_refused = None
    try:
        app.state.batch_store = Store.of(r, settings)
    except StoreError as e:
        app.state.batch_refused = e
    else:
        runner = BatchRunner(r, settings, metrics=getattr(app.state, "metrics", None))
        runner.start()
        app.state.batch_runner = runner
    try:
        yield
    finally:
        if runner is not None:
            await runner.aclose()
        await r.aclose()


router = APIRouter(dependencies=[Depends(check_auth)], lifespan=lifespan)


# ---------------------------------------------------------------------------- files


@router.post("/v1/files")
async def create_file(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
    store = store_of(request)
    size = int(request.headers.get("content-length") or 0)
    if size > store.max_file_bytes + UPLOAD_SLACK:
        raise APIError(413, f"the upload is {size} bytes; files of at most {store.max_file_bytes} are accepted",
                       "invalid_request_error", "file", "file_too_large")
    data = await file.read(store.max_file_bytes + 1)
    return await _call(store.put_file(data, filename=file.filename or "upload.jsonl", purpose=purpose))


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None) -> dict[str, Any]:
    return await _call(store_of(request).list_files(purpose))


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> dict[str, Any]:
    return await _call(store_of(request).get_file(file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> StreamingResponse:
    chunks = await _call(store_of(request).file_content(file_id))
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    return await _call(store_of(request).delete_file(file_id))


# ---------------------------------------------------------------------------- batches


@router.post("/v1/batches")
async def create_batch(request: Request, body: Any = Depends(json_body)) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    raw = body.get("priority", "low")
    try:
        priority = LEVELS[priority_of(raw)]
    except ValueError:
        raise bad(f"priority must be one of {', '.join(LEVELS)}, got {raw!r}", "priority") from None
    b = await _call(store_of(request).create_batch(
        input_file_id=body.get("input_file_id"), endpoint=body.get("endpoint"),
        completion_window=body.get("completion_window", "24h"), metadata=body.get("metadata"), priority=priority))
    request.app.state.batch_runner.wake()
    return b


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise bad(f"limit must be in [1, 100], got {limit}", "limit")
    return await _call(store_of(request).list_batches(after, limit))


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return await _call(store_of(request).get_batch(batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return await _call(store_of(request).cancel_batch(batch_id))
