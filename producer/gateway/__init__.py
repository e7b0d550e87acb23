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

The parts: :mod:`~producer.gateway.app` (create_app), :mod:`~producer.gateway.openai` and
:mod:`~producer.gateway.health` (routers), :mod:`~producer.gateway.models` (pydantic request
bodies), :mod:`~producer.gateway.replies` (response objects), :mod:`~producer.gateway.streaming`
(SSE), :mod:`~producer.gateway.events` (reading several requests), :mod:`~producer.gateway.errors`,
:mod:`~producer.gateway.metrics`, :mod:`~producer.gateway.state`.
"""

from producer.gateway.app import ROUTERS, create_app, serve
from producer.gateway.errors import APIError, error_body

__all__ = ["ROUTERS", "APIError", "create_app", "error_body", "serve"]
