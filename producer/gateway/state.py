"""What the routes share, kept on ``app.state.gateway``, and the dependencies that hand it out."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field

from fastapi import Request

from common.settings import Settings
from producer.aio import AsyncClient
from producer.gateway.errors import APIError, bad
from producer.gateway.metrics import Metrics


@dataclass
class Gateway:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    given_client: AsyncClient | None = None  # a client the caller owns (tests)
    client_: AsyncClient | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    background: set[asyncio.Task] = field(default_factory=set)  # cancels still being sent

    @property
    def client(self) -> AsyncClient:
        if self.client_ is None:  # made on first use: the app may be served without its lifespan
            s = self.settings
            self.client_ = self.given_client or AsyncClient(s.redis_url, s.prefix, limits=s.limits)
        return self.client_

    async def aclose(self) -> None:
        if self.given_client is None and self.client_ is not None:
            await self.client_.aclose()

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.settings.model_name
        if model != self.settings.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this gateway serves {self.settings.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return model


def gateway(request: Request) -> Gateway:
    """Dependency: the app's shared state."""
    return request.app.state.gateway


def check_auth(request: Request) -> None:
    """Dependency: the bearer API key, when one is set."""
    key = gateway(request).settings.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       "invalid_request_error", None, "invalid_api_key")


async def json_body(request: Request) -> object:
    """Dependency: the decoded JSON body, whatever its content type says (curl -d sends a form's)."""
    import json

    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):
        raise bad("the request body is not valid JSON") from None
