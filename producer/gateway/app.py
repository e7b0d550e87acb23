"""The gateway app: shared state, middleware, error handlers and the routers."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from common.settings import Settings
from producer.aio import AsyncClient
from producer.gateway import errors, health, openai
from producer.gateway.metrics import MetricsMiddleware
from producer.gateway.state import Gateway

# The routers every app serves; another part adds its own with ``create_app(routers=...)`` or
# by appending here before the app is made.
ROUTERS: list[APIRouter] = [openai.router, health.router]


def create_app(settings: Settings | None = None, *, client: AsyncClient | None = None,
               routers: Iterable[APIRouter] = ()) -> FastAPI:
    """The gateway app for ``settings`` (default: from the environment)."""
    gw = Gateway(settings or Settings.from_env(), given_client=client)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.client  # noqa: B018 - connect at start
        try:
            yield
        finally:
            await gw.aclose()

    app = FastAPI(title="tokenq gateway", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(MetricsMiddleware, metrics=gw.metrics)
    errors.install(app)
    for router in [*ROUTERS, *routers]:
        app.include_router(router)
    app.state.gateway = gw
    app.state.settings = gw.settings
    app.state.metrics = gw.metrics
    return app


def serve(settings: Settings, log_level: str = "info") -> None:
    """Run the gateway with uvicorn until interrupted (``tokenq gateway``)."""
    import uvicorn

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level)
