"""The OpenAI routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

``stream: true`` sends server-sent events (:mod:`producer.gateway.streaming`). A client that
disconnects has its requests cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from producer.aio import AsyncClient, AsyncHandle
from producer.gateway import streaming
from producer.gateway.errors import APIError, bad, generation_error, not_started, param_of
from producer.gateway.events import ClientDisconnected, Events, spawn_cancel, until_disconnected
from producer.gateway.models import ChatCompletionRequest, CompletionRequest, GenerationBody
from producer.gateway.replies import Reply
from producer.gateway.state import Gateway, check_auth, gateway, json_body
from producer.types import Result

router = APIRouter(dependencies=[Depends(check_auth)])


@router.post("/v1/completions")
async def completions(request: Request, gw: Gateway = Depends(gateway), body: Any = Depends(json_body)) -> Response:
    return await answer(request, gw, body, CompletionRequest)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, gw: Gateway = Depends(gateway), body: Any = Depends(json_body)) -> Response:
    return await answer(request, gw, body, ChatCompletionRequest)


@router.get("/v1/models")
async def models(gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(gw)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, gw: Gateway = Depends(gateway)) -> dict[str, Any]:
    if model != gw.settings.model_name:
        raise APIError(404, f"the model {model!r} does not exist", "invalid_request_error", "model", "model_not_found")
    return model_card(gw)


def model_card(gw: Gateway) -> dict[str, Any]:
    return {"id": gw.settings.model_name, "object": "model", "created": gw.started, "owned_by": "tokenq"}


async def submit_all(client: AsyncClient, requests: list[dict[str, Any]]) -> list[AsyncHandle]:
    """Queue every request of one body (all or none); a bad one is a 400 naming its prompt."""
    try:
        return await client.submit_many(requests)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("requests[") and "]: " in msg:
            idx, msg = msg.split("]: ", 1)
            if len(requests) > 1:
                msg = f"prompt {idx[len('requests['):]}: {msg}"
        raise bad(msg, param_of(msg)) from None


async def collect(events: Events, watcher: asyncio.Future | None = None) -> list[Result]:
    """Every request's result, in order; raises the APIError of the first that failed."""
    results: list[Result | None] = [None] * len(events.handles)
    while events.left:
        kind, i, val = await events.get(watcher=watcher)
        if kind == "error":
            raise generation_error(val)
        if kind == "done":
            if val.finish_reason == "timeout":
                raise not_started(val.id)
            results[i] = val
    return [r for r in results if r is not None]


async def answer(request: Request, gw: Gateway, raw: Any, kind: type[GenerationBody]) -> Response:
    if isinstance(raw, dict) and isinstance(raw.get("model"), str):
        gw.check_model(raw["model"])  # an unknown model is a 404 before any other fault
    body = kind.parse(raw)
    reply = Reply(kind.chat, gw.check_model(body.model), [], body.include_usage)
    reply.handles = await submit_all(gw.client, body.requests(request.headers.get("x-priority")))
    events = Events(reply.handles)
    watcher = asyncio.ensure_future(until_disconnected(request))

    def close() -> None:
        events.close()
        spawn_cancel(gw.client, reply.handles, gw.background)

    try:
        if not body.stream:
            results = await collect(events, watcher)
            return JSONResponse(reply.whole(results, gw.metrics.usage(results)), headers=reply.headers)
        first = await streaming.first_event(events, watcher)
    except ClientDisconnected:
        close()
        return Response(status_code=499)
    except BaseException:
        close()
        raise
    finally:
        watcher.cancel()
    return streaming.stream(reply, events, first, gw.metrics.usage, reply.headers, close)
