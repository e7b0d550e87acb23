"""``tokenq-worker``: load a model, build the engine, serve the Redis queue until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

from common.settings import Settings
from worker.tuning import set_openmp_env

set_openmp_env()  # before anything loads torch and its OpenMP runtime

WORKER_FLAGS = [
    "model", "redis_url", "name", "prefix", "device", "dtype", "page_size", "num_pages", "kv_cache_memory",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "admission_policy", "preemption_mode", "soft_limit",
    "swap_pages", "prefix_caching", "fast_path", "claim_idle_s", "max_attempts", "result_ttl_s", "result_maxlen", "replica_wait_ms", "request_shards", "stream_interval_ms", "heartbeat_s", "grace_s", "aging_s",
    "metrics_port", "metrics_host", "max_tokens_limit", "max_prompt_chars", "max_input_ids", "log_level",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenq-worker",
        description="Serve a model from the tokenq Redis queue. Every flag can also be set as TOKENQ_<FLAG>.",
    )
    Settings.add_arguments(p, WORKER_FLAGS)
    return p


def engine_config(s: Settings, device: str):
    from worker.config import EngineConfig

    return EngineConfig(
        page_size=s.page_size,
        num_pages=s.num_pages or None,
        kv_cache_memory=s.kv_cache_memory,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len or None,
        admission_policy=s.admission_policy,
        preemption_mode=s.preemption_mode,
        soft_limit=s.soft_limit,
        swap_pages=s.swap_pages or None,
        enable_prefix_caching=s.prefix_caching == "on",
        device=device,
        check_invariants=False,
        fast_path=s.fast_path == "on",
    )


def _can_bind(host: str, port: int) -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)  # the defaults it shows come from TOKENQ_* variables
        settings = Settings.from_args(args)
    except ValueError as e:
        print(f"tokenq-worker: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.metrics_port and not _can_bind(settings.metrics_host, settings.metrics_port):
        print(f"tokenq-worker: cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
              "the address is in use", file=sys.stderr)  # say so before the slow model load
        return 2
    from worker import models, native  # (torch only: transformers loads with the engine, below)

    try:
        on_cpu = models.resolve_device(settings.device).type == "cpu"
    except RuntimeError:  # not a device: models.load says so below
        on_cpu = False
    if on_cpu:
        # the native kernels build (30 s of g++ on a first start) while the model loads and compiles:
        # started before the imports below (transformers' take 2.5 s)
        native.build_in_background()
    from worker.engine import Engine
    from worker.service import Service
    from worker.tuning import freeze_heap, spare_core, tune_process

    tune_process()
    try:
        model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
    except (OSError, ValueError) as e:
        print(f"tokenq-worker: cannot load model {settings.model!r}: {e}", file=sys.stderr)
        return 2
    device = str(next(model.parameters()).device)
    try:
        engine = Engine(model, tokenizer, engine_config(settings, device))
    except models.UnsupportedModelError as e:  # its family, or the start-up probe, says it cannot be served exactly
        print(f"tokenq-worker: cannot serve model {settings.model!r}: {e}", file=sys.stderr)
        return 2
    service = Service(engine, settings, model_name=settings.model, device=device, write_behind=spare_core(device))
    service.install_signal_handlers()
    if settings.metrics_port:
        from worker.metrics import serve_metrics

        try:
            serve_metrics(service, settings.metrics_port, settings.metrics_host)
        except OSError as e:
            print(f"tokenq-worker: cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {e}",
                  file=sys.stderr)
            return 2
    freeze_heap()
    return service.run()


if __name__ == "__main__":
    sys.exit(main())
