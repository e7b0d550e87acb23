"""OpenAI-compatible HTTP gateway in front of the queue (``tokenq gateway``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (pings Redis), ``GET /metrics`` (Prometheus).

Extensions to OpenAI's request body: ``priority`` (``high``/``normal``/``low``, or the
``X-Priority`` header), ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``timeout_s``, and
``request_id`` (the tokenq request id, so ``tokenq cancel`` can reach it; ``-<i>`` is appended
per prompt of a batch). Every response carries the tokenq ids in ``X-Request-Id``.
Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (checked here with the wire protocol's own validation, or reported by the worker as
``invalid_request`` / ``too_long``), 401 for a missing or wrong API key, 404 for an unknown
model or route, 500 when the worker fails, 503 when Redis is unreachable, 504 when a
request's ``timeout_s`` passed before a worker started it. A client that disconnects has its
requests cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import INVALID_REQUEST, TOO_LONG
from common.keys import LEVELS, priority_of
from common.protocol import ID_RE
from common.settings import Settings
from producer.aio import AsyncClient, AsyncHandle
from producer.types import GenerationError, Result

log = logging.getLogger("tokenq.gateway")

MAX_PROMPTS = 64  # prompts in one /v1/completions request (OpenAI's batch form)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
FIRST_EVENT_WAIT_S = 10.0  # a stream's status waits this long for the request's first entry
KEEPALIVE_S = 15.0  # an SSE comment goes out after this long without an event
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "priority", "timeout_s", "prompt", "messages", "input_ids", "id")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _generation_error(e: GenerationError) -> APIError:
    if e.code in (INVALID_REQUEST, TOO_LONG):
        return APIError(400, e.message, "invalid_request_error", None, e.code)
    if e.code in ("timeout", "wait_timeout"):
        return APIError(504, e.message, "timeout_error", None, "timeout")
    if e.code == "unavailable":
        return APIError(503, e.message, "service_unavailable", None, "unavailable")
    return APIError(500, e.message or "the worker failed", "server_error", None, e.code or "internal")


def _param_of(message: str) -> str | None:
    """The field a validation message is about (its first word, when that is a field name)."""
    head = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return head if head in SAMPLING_FIELDS else None


# ---------------------------------------------------------------------------- metrics


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenq_gateway_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("tokenq_gateway_request_duration_seconds",
                                 "HTTP request latency (to the last byte) by route", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.tokens = Counter("tokenq_gateway_tokens", "tokens served through the gateway", ["kind"],
                              registry=self.registry)


class MetricsMiddleware:
    """Pure ASGI: counts every request and times it to its last byte (streams included)."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(scope["method"], name, str(status[0])).inc()
            self.metrics.latency.labels(scope["method"], name).observe(time.perf_counter() - start)


# ---------------------------------------------------------------------------- request parsing


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def _unsupported(body: dict[str, Any], chat: bool) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("n must be 1: tokenq returns one choice per prompt", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad("best_of must be 1", "best_of")
    if chat:
        if body.get("logprobs") not in (None, False):
            raise _bad("logprobs are not supported", "logprobs")
        if body.get("top_logprobs") not in (None, 0):
            raise _bad("top_logprobs are not supported", "top_logprobs")
        if body.get("tools") or body.get("functions"):
            raise _bad("tools and function calling are not supported", "tools" if body.get("tools") else "functions")
        rf = body.get("response_format")
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") in (None, "text")):
            raise _bad("only response_format {\"type\": \"text\"} is supported", "response_format")
    else:
        if body.get("logprobs") not in (None, False):
            raise _bad("logprobs are not supported", "logprobs")
        if body.get("echo"):
            raise _bad("echo is not supported", "echo")
        if body.get("suffix") is not None:
            raise _bad("suffix is not supported", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and v != 0:
            raise _bad(f"{name} is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options must be an object", "stream_options")


def _priority(body: dict[str, Any], request: Request) -> str:
    raw = body.get("priority")
    if raw is None:
        raw = request.headers.get("x-priority")
        if raw is not None and raw.strip().lstrip("-").isdigit():
            raw = int(raw)
        elif raw is not None:
            raw = raw.strip().lower()
    if raw is None:
        return "normal"
    try:
        return LEVELS[priority_of(raw)]
    except ValueError:
        raise _bad(f"priority must be one of {', '.join(LEVELS)} (or 0-{len(LEVELS) - 1}), got {raw!r}",
                   "priority") from None


def _sampling(body: dict[str, Any], request: Request, chat: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "timeout_s"):
        v = body.get(name)
        if v is not None:
            kw[name] = v
    if isinstance(kw.get("stop"), list) and not kw["stop"]:
        del kw["stop"]
    if isinstance(kw.get("top_k"), int) and kw["top_k"] == -1:  # vLLM's "no top-k"
        kw["top_k"] = 0
    kw["priority"] = _priority(body, request)
    return kw


def _prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The /v1/completions prompt in any of OpenAI's forms, as submit() arguments."""
    p = body.get("prompt")
    if p is None:
        raise _bad("prompt is required", "prompt")
    if isinstance(p, str):
        return [{"prompt": p}]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            out = [{"prompt": x} for x in p]
        elif all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            out = [{"input_ids": p}]
        elif all(isinstance(x, list) for x in p):
            out = [{"input_ids": x} for x in p]
        else:
            raise _bad("prompt must be a string, an array of strings, an array of token ids, "
                       "or an array of token-id arrays", "prompt")
        if len(out) > MAX_PROMPTS:
            raise _bad(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", "prompt")
        return out
    raise _bad("prompt must be a non-empty string or array", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        if m.get("tool_calls") or m.get("function_call"):
            raise _bad(f"messages[{i}]: tool calls are not supported", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise _bad(f"messages[{i}].content[{j}]: only text content parts are supported", "messages")
            content = "".join(parts)
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or an array of text parts", "messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"messages[{i}].role must be a string", "messages")
        out.append({"role": role, "content": content})
    return out


# ---------------------------------------------------------------------------- reading several handles


class ClientDisconnected(Exception):
    pass


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Events:
    """Chunks and ends of several handles merged into one stream of events:
    ("chunk", index, Chunk) | ("done", index, Result) | ("error", index, GenerationError)."""

    def __init__(self, handles: list[AsyncHandle]):
        self.handles = handles
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(handles)  # handles whose end has not been taken yet
        self.tasks = [asyncio.ensure_future(self._run(i, h)) for i, h in enumerate(handles)]
        self._next: asyncio.Future | None = None

    async def _run(self, i: int, h: AsyncHandle) -> None:
        try:
            async for c in h:
                await self.queue.put(("chunk", i, c))
            await self.queue.put(("done", i, await h.result()))
        except GenerationError as e:
            await self.queue.put(("error", i, e))
        except redis.RedisError as e:
            await self.queue.put(("error", i, GenerationError("unavailable", f"lost Redis: {e}", h.id)))
        except Exception as e:  # never leave a reader waiting for an end that will not come
            log.exception("reading %s failed", h.id)
            await self.queue.put(("error", i, GenerationError("internal", f"reading the result failed: {e}", h.id)))

    async def get(self, timeout: float | None = None, watcher: asyncio.Future | None = None) -> tuple | None:
        """The next event; None after ``timeout`` s (the event is not lost: the next call gets it);
        ClientDisconnected when ``watcher`` (a disconnect watch) finishes first."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.queue.get())
        waits = {self._next} if watcher is None else {self._next, watcher}
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._next in done:
            ev, self._next = self._next.result(), None
            if ev[0] != "chunk":
                self.left -= 1
            return ev
        if watcher is not None and watcher in done:
            raise ClientDisconnected()
        return None

    def close(self) -> None:
        for t in [*self.tasks, self._next]:
            if t is not None:
                t.cancel()


class _SSEResponse(StreamingResponse):
    """A stream whose generator is always closed (so its ``finally`` cancels what is left)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------- the app


def create_app(settings: Settings | None = None, *, client: AsyncClient | None = None) -> FastAPI:
    """The gateway app for ``settings`` (default: from the environment)."""
    from producer.batch import routes as batch_routes  # it imports this module's helpers

    settings = settings or Settings.from_env()
    metrics = Metrics()
    started = int(time.time())
    background: set[asyncio.Task] = set()
    state: dict[str, AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = client or AsyncClient(settings.redis_url, settings.prefix, limits=settings.limits)
        try:
            yield
        finally:
            if client is None:
                await state["client"].aclose()

    app = FastAPI(title="tokenq gateway", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(batch_routes.router)  # /v1/files, /v1/batches, and the batch runner

    def qc() -> AsyncClient:
        if "client" not in state:  # the app is served without its lifespan (some test clients)
            state["client"] = client or AsyncClient(settings.redis_url, settings.prefix, limits=settings.limits)
        return state["client"]

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error_response(APIError(e.status_code, msg, kind), headers=getattr(e, "headers", None))

    @app.exception_handler(redis.RedisError)
    async def _redis_error(request: Request, e: redis.RedisError) -> JSONResponse:
        log.warning("Redis error: %s", e)
        return _error_response(APIError(503, f"the queue (Redis) is unavailable: {type(e).__name__}",
                                        "service_unavailable", None, "unavailable"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, "internal gateway error", "server_error", None, "internal"))

    # ------------------------------------------------------------ helpers
    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           "invalid_request_error", None, "invalid_api_key")

    def check_model(body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return settings.model_name
        if not isinstance(model, str):
            raise _bad("model must be a string", "model")
        if model != settings.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this gateway serves {settings.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return model

    def spawn_cancel(handles: list[AsyncHandle]) -> None:
        """Cancel unfinished requests from a task of its own (safe inside a cancelled scope)."""
        ids = [h.id for h in handles if not h.done]
        if not ids:
            return

        async def go() -> None:
            try:
                for rid in ids:
                    await asyncio.wait_for(qc().cancel(rid), 5.0)
            except Exception as e:  # best effort: the worker's own timeouts still bound the work
                log.warning("could not cancel %s: %s", ids, e)

        t = asyncio.get_running_loop().create_task(go())
        background.add(t)
        t.add_done_callback(background.discard)

    async def submit_all(items: list[dict[str, Any]], kw: dict[str, Any]) -> list[AsyncHandle]:
        try:
            return await qc().submit_many([{**it, **kw} for it in items])
        except ValueError as e:
            msg = str(e)
            if msg.startswith("requests[") and "]: " in msg:
                idx, msg = msg.split("]: ", 1)
                if len(items) > 1:
                    msg = f"prompt {idx[len('requests['):]}: {msg}"
            raise _bad(msg, _param_of(msg)) from None

    def count_usage(results: list[Result]) -> dict[str, int]:
        p = sum(r.usage.prompt_tokens for r in results)
        c = sum(r.usage.completion_tokens for r in results)
        metrics.tokens.labels("prompt").inc(p)
        metrics.tokens.labels("completion").inc(c)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def run(request: Request, chat: bool) -> Response:
        check_auth(request)
        body = await _json_body(request)
        model = check_model(body)
        _unsupported(body, chat)
        stream = body.get("stream")
        stream = False if stream is None else stream
        if not isinstance(stream, bool):
            raise _bad("stream must be a boolean", "stream")
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage")) if stream else False
        items = [{"messages": _messages(body)}] if chat else _prompts(body)
        given_id = body.get("request_id")
        if given_id is not None:
            if not isinstance(given_id, str) or not ID_RE.match(given_id) or len(given_id) > 120:
                raise _bad("request_id must be 1-120 characters of letters, digits and ._:- "
                           "(starting with a letter or digit)", "request_id")
            for i, it in enumerate(items):
                it["id"] = given_id if len(items) == 1 else f"{given_id}-{i}"
        kw = _sampling(body, request, chat)
        handles = await submit_all(items, kw)
        ids = [h.id for h in handles]
        headers = {"X-Request-Id": ",".join(ids)}
        rid = ("chatcmpl-" if chat else "cmpl-") + ids[0]
        created = int(time.time())
        events = _Events(handles)
        watcher = asyncio.ensure_future(_until_disconnected(request))
        first = None
        try:
            if not stream:
                results: list[Result | None] = [None] * len(handles)
                while events.left:
                    kind, i, val = await events.get(watcher=watcher)
                    if kind == "error":
                        raise _generation_error(val)
                    if kind == "done":
                        if val.finish_reason == "timeout":
                            raise _generation_error(GenerationError(
                                "timeout", "no worker started the request within its timeout_s", val.id))
                        results[i] = val
                done = [r for r in results if r is not None]
                usage = count_usage(done)
                if chat:
                    choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                                "logprobs": None, "finish_reason": r.finish_reason} for i, r in enumerate(done)]
                    obj = "chat.completion"
                else:
                    choices = [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
                               for i, r in enumerate(done)]
                    obj = "text_completion"
                return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                                     "system_fingerprint": None, "choices": choices, "usage": usage}, headers=headers)
            # Streaming: wait a little for the first event before answering, so that an error the
            # worker finds at once (too_long, invalid_request) still gets its proper status code.
            # A request still queued after that gets its 200 and keep-alive comments meanwhile.
            first = await events.get(timeout=FIRST_EVENT_WAIT_S, watcher=watcher)
            if first is not None and first[0] == "error":
                raise _generation_error(first[2])
            if first is not None and first[0] == "done" and first[2].finish_reason == "timeout":
                raise _generation_error(GenerationError(
                    "timeout", "no worker started the request within its timeout_s", first[2].id))
        except ClientDisconnected:
            events.close()
            spawn_cancel(handles)
            return Response(status_code=499)
        except BaseException:
            events.close()
            spawn_cancel(handles)
            raise
        finally:
            watcher.cancel()

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
            d: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                                 "system_fingerprint": None, "choices": choices}
            if include_usage:
                d["usage"] = usage
            return _sse(d)

        def choice(i: int, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}

        async def gen() -> AsyncIterator[str]:
            finished: list[Result] = []
            try:
                if chat:
                    yield chunk([choice(i, "", None, role=True) for i in range(len(handles))])
                ev = first
                while True:
                    if ev is None:  # nothing for a while (still queued?): keep proxies from timing out
                        yield ": keep-alive\n\n"
                        ev = await events.get(timeout=KEEPALIVE_S)
                        continue
                    kind, i, val = ev
                    if kind == "chunk":
                        if val.text:
                            yield chunk([choice(i, val.text, None)])
                    elif kind == "done":
                        finished.append(val)
                        yield chunk([choice(i, None if chat else "", val.finish_reason)])
                    else:
                        e = _generation_error(val)
                        yield _sse(error_body(e.message, e.type, e.param, e.code))
                        break
                    if not events.left:
                        break
                    ev = await events.get(timeout=KEEPALIVE_S)
                if include_usage and not events.left and len(finished) == len(handles):
                    yield chunk([], count_usage(finished))
                elif finished:
                    count_usage(finished)
                yield "data: [DONE]\n\n"
            finally:
                events.close()
                spawn_cancel(handles)

        return _SSEResponse(gen(), media_type="text/event-stream",
                            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    def model_card() -> dict[str, Any]:
        return {"id": settings.model_name, "object": "model", "created": started, "owned_by": "tokenq"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict[str, Any]:
        check_auth(request)
        if model != settings.model_name:
            raise APIError(404, f"the model {model!r} does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            r = qc().redis
            await asyncio.wait_for(r.ping(), 5.0)
            workers = 0
            async for _ in r.scan_iter(match=qc().keys.worker_pattern, count=1000):
                workers += 1
        except (redis.RedisError, OSError, asyncio.TimeoutError) as e:
            return JSONResponse({"status": "unavailable", "redis": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse({"status": "ok", "redis": "ok", "workers": workers})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.settings = settings
    app.state.metrics = metrics
    return app


def serve(settings: Settings, log_level: str = "info") -> None:
    """Run the gateway with uvicorn until interrupted (``tokenq gateway``)."""
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level)
