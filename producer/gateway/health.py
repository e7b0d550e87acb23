"""``GET /health`` (pings Redis, counts live workers; open without the API key) and
``GET /metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio

import redis
from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producer.gateway.state import Gateway, gateway

router = APIRouter()


@router.get("/health")
async def health(gw: Gateway = Depends(gateway)) -> JSONResponse:
    try:
        r = gw.client.redis
        await asyncio.wait_for(r.ping(), 5.0)
        workers = 0
        async for _ in r.scan_iter(match=gw.client.keys.worker_pattern, count=1000):
            workers += 1
    except (redis.RedisError, OSError, asyncio.TimeoutError) as e:
        return JSONResponse({"status": "unavailable", "redis": f"{type(e).__name__}: {e}"}, status_code=503)
    return JSONResponse({"status": "ok", "redis": "ok", "workers": workers})


@router.get("/metrics")
async def prometheus(gw: Gateway = Depends(gateway)) -> Response:
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
