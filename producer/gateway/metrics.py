"""The gateway's own Prometheus metrics and the middleware that counts and times every request."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from producer.types import Result


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

    def usage(self, results: list[Result]) -> dict[str, int]:
        """Count the tokens of finished requests; their OpenAI ``usage`` object."""
        p = sum(r.usage.prompt_tokens for r in results)
        c = sum(r.usage.completion_tokens for r in results)
        cached = sum(r.usage.cached_tokens for r in results)
        self.tokens.labels("prompt").inc(p)
        self.tokens.labels("completion").inc(c)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}


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
