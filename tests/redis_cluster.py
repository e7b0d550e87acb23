"""A real Redis Cluster on loopback for tests: N masters with one replica each.

Started from ``redis-server --cluster-enabled yes`` processes and ``redis-cli --cluster create``,
the way an operator builds one; nothing is simulated. ``kill_master`` SIGKILLs a master so its
replica is promoted by the cluster's own failover.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def _free_ports(n: int) -> list[int]:
    """n free ports whose cluster-bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class Node:
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


@dataclass
class LocalCluster:
    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1500
    nodes: list[Node] = field(default_factory=list)
    workdir: Path | None = None

    @property
    def url(self) -> str:
        """The URL of one live node: the client discovers the rest."""
        return next(n.url for n in self.nodes if n.proc.poll() is None)

    def start(self) -> LocalCluster:
        exe = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if not exe or not cli:
            raise RuntimeError("redis-server and redis-cli must be on PATH for a cluster")
        self.workdir = Path(tempfile.mkdtemp(prefix="tokenq-cluster-"))
        for port in _free_ports(self.masters * (1 + self.replicas)):
            d = self.workdir / str(port)
            d.mkdir()
            proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                 "--appendonly", "no", "--save", "", "--dir", str(d), "--logfile", str(d / "log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.nodes.append(Node(port, proc))
        for n in self.nodes:
            _wait(lambda n=n: n.client().ping(), 20, f"node {n.port} did not start")
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every live node reports cluster_state:ok and agrees all slots are served."""
        def ok() -> bool:
            for n in self.live():
                info = n.client().cluster("info")
                if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                    return False
            return True
        _wait(ok, timeout, "cluster did not reach state ok")

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def master_of(self, key: str) -> Node:
        c = self.live()[0].client()
        slot = c.cluster("keyslot", key)
        for n in self.live():
            role = n.client().execute_command("ROLE")
            if role[0] == b"master":
                for start, end in _slot_ranges(n.client()):
                    if start <= slot <= end:
                        return n
        raise LookupError(f"no master serves slot {slot}")

    def kill_master(self, key: str) -> Node:
        """SIGKILL the master serving ``key``; return once a replica has taken over its slots."""
        victim = self.master_of(key)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        time.sleep(self.node_timeout_ms / 1000)
        self.wait_ok(timeout=60)
        return victim

    def cleanup(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait(10)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _slot_ranges(client: redis.Redis) -> list[tuple[int, int]]:
    me = client.execute_command("CLUSTER", "MYID").decode()
    out = []
    for line in client.execute_command("CLUSTER", "NODES").decode().splitlines():
        parts = line.split()
        if parts[0] != me:
            continue
        for s in parts[8:]:
            if s.startswith("["):
                continue
            a, _, b = s.partition("-")
            out.append((int(a), int(b or a)))
    return out


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(what)
