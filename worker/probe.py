"""The start-up probe: before a model is served, run it the way the engine will and refuse it
if anything shows it would be served wrongly.

Two short sequences go through the engine's runner packed in one row (a prefill step, then a
decode step) while every attention call is recorded, and each alone. The probe checks that
every layer called tokenq's attention exactly once, with a known layer index, only keyword
arguments the engine handles, K/V shapes that fit the cache, and the sliding window the
config gives that layer; and that packing changed no logit (learned positions read from
the wrong place, a mask or a recurrent state that spans the row would).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from common.protocol import SamplingParams
from worker import attention
from worker.cache import KVCache
from worker.models import UnsupportedModelError
from worker.runner import ModelRunner
from worker.scheduler import ScheduledSeq, SchedulerOutput
from worker.sequence import Sequence

# Keyword arguments paged attention implements.
HANDLED = ("scaling", "dropout", "sliding_window", "softcap", "s_aux")
# Passed along by the models' forwards; nothing to do with how attention is computed.
PASSED_ALONG = ("position_ids", "cache_position", "use_cache", "past_key_values", "position_embeddings", "return_dict",
                "output_attentions", "output_hidden_states", "output_router_logits", "is_causal")
PROMPTS = ([11, 12, 13, 14, 15], [21, 22, 23])
# Packing may move rounding only: max |logit difference| <= tolerance * max(1, max |logit|).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # float64 models may route MoE in float32
HALF_TOLERANCE = 5e-2

log = logging.getLogger("tokenq.probe")


@dataclass
class Call:
    layer: object  # the module's layer_idx (None: it has none)
    is_causal: bool
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    kwargs: dict


def expected_windows(config, num_layers: int) -> list[int | None]:
    """The sliding window each layer's mask uses in transformers, from the config."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[:num_layers]]
    if not getattr(config, "use_sliding_window", True):
        window = None
    return [window] * num_layers


def _refuse(model, why: str):
    raise UnsupportedModelError(f"{type(model).__name__} failed tokenq's start-up probe: {why}")


def check_calls(model, config, calls: list[Call], num_layers: int, num_kv_heads: int, head_dim: int,
                complete: bool = True) -> None:
    """Refuse unless ``calls`` (one forward's) show every layer attending once as the engine
    does; ``complete=False`` checks only the calls made (the forward failed after them)."""
    windows = expected_windows(config, num_layers)
    seen: dict[int, int] = {}
    for c in calls:
        if not isinstance(c.layer, int) or not 0 <= c.layer < num_layers:
            _refuse(model, f"an attention call has layer index {c.layer!r} (the model has {num_layers} layers)")
        where = f"layer {c.layer}"
        seen[c.layer] = seen.get(c.layer, 0) + 1
        if not c.is_causal or c.kwargs.get("is_causal") is False:
            _refuse(model, f"{where}: its attention is not causal")
        for name, value in c.kwargs.items():
            if name not in HANDLED and name not in PASSED_ALONG and value is not None:
                _refuse(model, f"{where}: keyword argument {name!r} (={value!r:.40}) is not handled by tokenq's attention")
        if c.kwargs.get("dropout"):
            _refuse(model, f"{where}: dropout {c.kwargs['dropout']} (the model is in training mode?)")
        if c.kwargs.get("output_attentions"):
            _refuse(model, f"{where}: output_attentions is asked for")
        if c.k[-1] != c.v[-1] or c.k[-1] != head_dim or c.q[-1] != head_dim:
            _refuse(model, f"{where}: query/key/value head sizes {c.q[-1]}/{c.k[-1]}/{c.v[-1]}, the cache holds {head_dim}")
        if c.k[1] != num_kv_heads or c.q[1] % c.k[1]:
            _refuse(model, f"{where}: {c.q[1]} query and {c.k[1]} key/value heads, the cache holds {num_kv_heads}")
        got = c.kwargs.get("sliding_window")
        if got != windows[c.layer]:
            _refuse(model, f"{where}: its attention gets sliding_window={got!r}, its config says {windows[c.layer]!r}")
    missing = [i for i in range(num_layers) if i not in seen]
    if missing and complete:
        _refuse(model, f"layer {missing[0]} never called tokenq's attention (its attention bypasses the interface, or it is not attention)")
    twice = next((i for i, n in seen.items() if n != 1), None)
    if twice is not None:
        _refuse(model, f"layer {twice} called the attention {seen[twice]} times in one forward")


def steps(runner: ModelRunner, prompts, record: list | None = None) -> dict[int, list[torch.Tensor]]:
    """Prompts as the engine runs them, in one packed row: a prefill step, then a decode step.
    Returns each prompt's last-token logits of both steps."""
    ps = runner.cache.page_size
    seqs, first = [], 0
    for i, p in enumerate(prompts):
        s = Sequence(f"probe-{i}", list(p), len(p), SamplingParams(max_tokens=2), 1, i, 0.0, 0)
        n = math.ceil((len(p) + 1) / ps)
        s.block_table = list(range(first, first + n))
        first += n
        seqs.append(s)
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    for step in range(2):
        out = SchedulerOutput(scheduled=[ScheduledSeq(s, s.num_computed, s.num_tokens - s.num_computed, True) for s in seqs])
        if step == 0 and record is not None:
            with attention.recording() as calls:
                try:
                    rows, order, _ = runner.execute(out)
                finally:
                    record.extend(calls)
        else:
            rows, order, _ = runner.execute(out)
        for row, sched in zip(rows, order):
            logits[int(sched.seq.request_id.split("-")[1])].append(row.float())
        for s in seqs:
            s.num_computed = s.num_tokens
            s.token_ids.append(s.token_ids[0])  # any token in the vocabulary
    return logits


@torch.inference_mode()
def probe(model, config, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, device, dtype) -> None:
    """Raise UnsupportedModelError, naming the layer and argument, if the engine would serve
    ``model`` differently from transformers."""
    vocab = getattr(config, "vocab_size", 64)
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    pages = sum(math.ceil((len(p) + 1) / page_size) for p in prompts)
    cache = KVCache(num_layers=num_layers, num_pages=pages, page_size=page_size, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, dtype=dtype, device=device)
    raw: list = []

    def calls():
        return [Call(getattr(m, "layer_idx", None), bool(getattr(m, "is_causal", True)), tuple(q), tuple(k), tuple(v), kw)
                for m, q, k, v, kw in raw]

    try:
        packed = steps(ModelRunner(model, cache), prompts, raw)
    except Exception as e:  # noqa: BLE001 - any failure here is a reason to refuse
        check_calls(model, config, calls(), num_layers, num_kv_heads, head_dim, complete=False)  # a clearer reason first
        _refuse(model, f"a packed forward raised {type(e).__name__}: {e}")
    check_calls(model, config, calls(), num_layers, num_kv_heads, head_dim)
    tol = TOLERANCE.get(dtype, HALF_TOLERANCE)
    worst = 0.0
    for i, p in enumerate(prompts):
        alone = steps(ModelRunner(model, cache), [p])[0]
        for step, (a, b) in enumerate(zip(alone, packed[i])):
            err = (a - b).abs().max().item()
            scale = max(1.0, a.abs().max().item())
            worst = max(worst, err / scale)
            if not err <= tol * scale:
                kind = "prefill" if step == 0 else "decode"
                _refuse(model, f"packing two sequences in one row changes the {kind} logits of sequence {i} by {err:.3g} "
                               "(positions, masks or state cross the sequences)")
    log.info("start-up probe passed: %d layers attend through tokenq; packing moved logits by %.2g of their scale "
             "(tolerance %.0e)", num_layers, worst, tol)
