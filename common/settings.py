"""All settings in one place. Every field is a CLI flag (``--page-size``) and an
environment variable (``TOKENQ_PAGE_SIZE``); the flag wins, then the variable, then the default.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from common.keys import DEFAULT_PREFIX
from common.protocol import Limits
from common.redis import redact_url


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Settings:
    # Where the queue lives.
    redis_url: str = _f("redis://localhost:6379/0", "Redis URL (redis://, rediss:// for TLS, user:password@ for AUTH)")
    prefix: str = _f(DEFAULT_PREFIX, "key prefix of every Redis key")
    # The model.
    model: str = _f("smollm2", "model: 'smollm2' (the bundled default), 'gemma3-270m', a local transformers directory or a hub id")
    device: str = _f("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = _f("auto", "float32, bfloat16, float16, float64 or auto (bf16 on CUDA and on CPUs with native bf16, else fp32)")
    name: str = _f("", "worker name (default: host-pid)")
    # The engine.
    page_size: int = _f(16, "tokens per KV-cache page")
    num_pages: int = _f(0, "KV-cache pages (0: derive from --kv-cache-memory)")
    kv_cache_memory: float = _f(1.0, "GiB of memory for the KV cache when --num-pages is 0")
    max_num_seqs: int = _f(64, "most sequences in one step")
    max_num_batched_tokens: int = _f(2048, "most tokens in one step (prefill chunks + decodes)")
    max_model_len: int = _f(0, "longest prompt + output (0: the model's own limit, capped by the cache)")
    admission_policy: str = _f("optimistic", "optimistic (pages for the prompt, preempt later) or reserve (prompt + max_tokens up front)", choices=("optimistic", "reserve"))
    preemption_mode: str = _f("recompute", "recompute or swap (to a host-memory pool)", choices=("recompute", "swap"))
    soft_limit: float = _f(0.9, "cache share above which only high-priority requests are admitted")
    swap_pages: int = _f(0, "host pool pages for swap preemption (0: same as the device pool)")
    prefix_caching: str = _f("on", "reuse the KV cache of prompt prefixes already computed (full pages, shared across requests)",
                             choices=("on", "off"))
    fast_path: str = _f("on", "the compiled forward (one Inductor graph), merged prepacked linear layers and native decode attention (off: the plain eager forward and torch attention; float64 is always eager)", choices=("on", "off"))
    # The Redis loop.
    claim_idle_s: float = _f(30.0, "claim in-flight entries of a dead worker after this idle time")
    max_attempts: int = _f(3, "deliveries before an entry goes to the dead-letter stream")
    result_ttl_s: int = _f(3600, "result streams expire this long after their last entry")
    result_maxlen: int = _f(100_000, "cap on entries per result stream")
    request_shards: int = _f(1, "request streams per priority level (producers and workers must agree; more spread ingest over a cluster's masters)")
    replica_wait_ms: int = _f(0, "Redis Cluster: before a request entry is acknowledged, WAIT up to this long for a replica to hold its final entry (0: off)")
    stream_interval_ms: float = _f(20.0, "publish a request's new tokens at most this often: tokens of faster steps go out together, in one entry; a first token and a request's end at once (0: an entry every step)")
    heartbeat_s: float = _f(2.0, "heartbeat and refresh interval")
    grace_s: float = _f(30.0, "on SIGTERM, let running requests finish for this long")
    aging_s: float = _f(10.0, "no starvation: a low entry waiting this long in Redis ranks (and runs) with normal work (0: strict levels)")
    metrics_port: int = _f(0, "serve Prometheus metrics on this port (0: off)")
    metrics_host: str = _f("0.0.0.0", "address the metrics endpoint binds to (with --metrics-port)")
    log_level: str = _f("info", "log level (debug shows every admission decision)",
                        choices=("debug", "info", "warning", "error", "critical"))
    # Request caps.
    max_tokens_limit: int = _f(4096, "largest max_tokens a request may ask for")
    max_prompt_chars: int = _f(200_000, "longest prompt text (characters)")
    max_input_ids: int = _f(32_768, "longest input_ids array")
    # The HTTP gateway.
    host: str = _f("127.0.0.1", "gateway bind address")
    port: int = _f(8000, "gateway port")
    api_key: str = _f("", "require 'Authorization: Bearer <key>' on the gateway (empty: open)", secret=True)
    model_name: str = _f("tokenq", "model name the gateway reports in /v1/models and responses")
    # Batch jobs (/v1/files, /v1/batches).
    batch_feed_limit: int = _f(256, "most requests of one batch in the queue at once")
    batch_max_file_bytes: int = _f(64 * 1024 * 1024, "largest file /v1/files accepts (bytes)")
    batch_max_requests: int = _f(100_000, "most requests in one batch input file")
    batch_ttl_s: int = _f(7 * 86400, "files and batch records expire this long after they are written")
    batch_lease_s: float = _f(10.0, "a batch whose runner stops renewing its lease this long is taken over")

    @property
    def limits(self) -> Limits:
        return Limits(max_tokens=self.max_tokens_limit, max_prompt_chars=self.max_prompt_chars, max_input_ids=self.max_input_ids)

    @classmethod
    def env_name(cls, name: str) -> str:
        return "TOKENQ_" + name.upper()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(cls.env_name(f.name))
            if raw is not None and raw != "":
                values[f.name] = _convert(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, names: list[str]) -> None:
        """Add ``--flag`` options for the named fields; defaults shown come from the environment."""
        current = cls.from_env()
        by_name = {f.name: f for f in fields(cls)}
        for name in names:
            f = by_name[name]
            kind = type(f.default) if f.default is not MISSING else str
            choices = f.metadata.get("choices")
            parser.add_argument(
                "--" + name.replace("_", "-"),
                type=str.lower if choices and kind is str else kind,
                default=None,
                choices=choices,
                help=f"{f.metadata['help']} [env {cls.env_name(name)}; default: {_shown(f, getattr(current, name))!r}]",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        return cls.from_env(**{k: v for k, v in vars(args).items() if k in {f.name for f in fields(cls)}})


def _shown(f: Any, value: Any) -> Any:
    """A value as --help may print it: secrets and URL passwords hidden."""
    if f.metadata.get("secret") and value:
        return "***"
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def _convert(f: Any, raw: str) -> Any:
    kind = type(f.default)
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{Settings.env_name(f.name)}={raw!r} is not a valid {kind.__name__}") from None
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str) and value.lower() in choices:
        value = value.lower()
    if choices and value not in choices:
        raise ValueError(f"{Settings.env_name(f.name)} must be one of {', '.join(choices)}")
    return value
