"""``tokenq-worker``: load a model, build the engine, serve the Redis queue until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

from common.settings import Settings

WORKER_FLAGS = [
    "model", "redis_url", "name", "prefix", "device", "dtype", "page_size", "num_pages", "kv_cache_memory",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "admission_policy", "preemption_mode", "soft_limit",
    "swap_pages", "claim_idle_s", "max_attempts", "result_ttl_s", "result_maxlen", "heartbeat_s", "grace_s",
    "metrics_port", "max_tokens_limit", "max_prompt_chars", "max_input_ids",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenq-worker",
        description="Serve a model from the tokenq Redis queue. Every flag can also be set as TOKENQ_<FLAG>.",
    )
    Settings.add_arguments(p, WORKER_FLAGS)
    p.add_argument("--log-level", default="INFO", help="DEBUG shows every admission decision")
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
        device=device,
        check_invariants=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = Settings.from_args(args)
    except ValueError as e:
        print(f"tokenq-worker: {e}", file=sys.stderr)
        return 2
    from worker import models
    from worker.engine import Engine
    from worker.service import Service

    try:
        model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
    except (OSError, ValueError) as e:
        print(f"tokenq-worker: cannot load model {settings.model!r}: {e}", file=sys.stderr)
        return 2
    device = str(next(model.parameters()).device)
    engine = Engine(model, tokenizer, engine_config(settings, device))
    service = Service(engine, settings, model_name=settings.model, device=device)
    service.install_signal_handlers()
    if settings.metrics_port:
        from worker.metrics import serve_metrics

        serve_metrics(service, settings.metrics_port)
    return service.run()


if __name__ == "__main__":
    sys.exit(main())
