"""The engine's fast forward: the same transformers model, with faster linear layers.

The runner calls a copy of the model whose ``nn.Linear`` layers are replaced; every other
module and every tensor is shared with the caller's model, which stays as it was (its own
``generate`` is the exact reference the tests compare against). Two changes, both exact in
what they compute (only the summation order inside a GEMM can differ):

- Merged projections: q/k/v of an attention layer, and gate/up of an MLP, read the same
  input; one GEMM over their concatenated weights replaces three (two), and each
  projection returns its slice of the result. Fewer, larger GEMMs run closer to peak on
  the small row counts of decode steps.
- Prepacked weights (CPU, oneDNN): every weight is reordered once into oneDNN's blocked
  layout, so each step's GEMM skips MKL's per-call packing. On a 2-core AVX2 machine this
  took a decode-sized GEMM (64 x 576 by 576 x 1536) from about 100 to 130 GFLOP/s and the
  LM head (64 x 576 by 576 x 49152) from 44 to 95. oneDNN packs float32 everywhere and
  bfloat16 only where the CPU has native bf16 (AVX512-BF16 / AMX / AVX-NE-CONVERT); on
  other CPUs bf16 weights are packed as float32 (see pack_dtype).
- Fused RMSNorm: Llama-style RMSNorms become one ``F.rms_norm`` kernel instead of six.

Where it cannot apply (float64, which the exact parity tests use; a dtype oneDNN refuses
here) the engine runs the model as it is and says why in one log line.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("tokenq.fastpath")

# oneDNN's hint for the row count the packed weight will mostly see; measured: it hardly
# matters (within noise from 1 to 2048 rows).
PACK_BATCH_HINT = 64
# A oneDNN call costs about 25 us more than F.linear's (measured, 1 thread): for a small
# weight at a few rows that outweighs the packing it saves, so such calls take F.linear on
# the plain weight (kept only for weights this small: no memory to speak of).
PLAIN_MAX_ROWS = 16
PLAIN_MAX_WEIGHT = 512 * 1024  # elements
# The families whose fast path tests/test_fastpath.py checks against the eager path; any
# other model runs eager (its projections may be shared, called twice, or not Llama-shaped).
FAST_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (projections sharing one input) that are merged into one GEMM, by attribute name
MERGED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# RMSNorm classes whose forward is exactly weight * (x / rms(x)) in float32 (Gemma's 1 + weight is not)
PLAIN_RMSNORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")

_onednn_ok: dict[torch.dtype, bool] = {}


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks and multiplies ``dtype`` on this CPU, correctly (probed once)."""
    if dtype not in _onednn_ok:
        ok = False
        if torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16):
            try:
                g = torch.Generator().manual_seed(0)
                w = torch.randn(24, 40, generator=g).to(dtype)
                x = torch.randn(5, 40, generator=g).to(dtype)
                y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 5), None, "none", [], "")
                ok = torch.allclose(y.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
            except RuntimeError:
                ok = False
        _onednn_ok[dtype] = ok
    return _onednn_ok[dtype]


class FastLinear(nn.Module):
    """``F.linear(x, weight, bias)`` through a weight packed once by oneDNN in dtype ``pack``
    (the input is cast to it and the output back when they differ), or as it is (None)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: torch.dtype | None):
        super().__init__()
        weight = weight.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.pack = pack
        # plain attributes, not parameters: the packed tensor is opaque to state_dict and .to()
        bias = None if bias is None else bias.detach()
        self.plain = None  # (weight, bias) for F.linear at a few rows (see PLAIN_MAX_ROWS)
        if pack is None:
            self.w, self.b = weight, bias
        else:
            self.w = torch.ops.mkldnn._reorder_linear_weight(weight.to(pack), PACK_BATCH_HINT)
            self.b = None if bias is None else bias.to(pack)
            if pack == weight.dtype and weight.numel() <= PLAIN_MAX_WEIGHT:
                self.plain = (weight, bias)
        self.plain_max = PLAIN_MAX_ROWS * self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pack is None:
            return F.linear(x, self.w, self.b)
        if self.plain is not None and x.numel() <= self.plain_max:
            return F.linear(x, *self.plain)
        if x.dtype != self.pack:
            return torch.ops.mkldnn._linear_pointwise(x.to(self.pack), self.w, self.b, "none", [], "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")


class FastRMSNorm(nn.Module):
    """transformers' Llama-style RMSNorm as one fused kernel (``F.rms_norm``): normalised in
    float32, cast back, times the weight, as the module it replaces computes it."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon
        self.shape = (norm.weight.shape[-1],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)


class MergedLinear:
    """One GEMM for several projections of the same input; each takes its slice.

    The first projection called with an input computes all of them; the others, called
    with that same tensor, return their slice of the result (the result is dropped once
    each has had it). A projection called with another tensor computes afresh, so the
    outcome never depends on call order."""

    def __init__(self, linears: list[nn.Linear], pack: torch.dtype | None):
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
        self.linear = FastLinear(weight, bias, pack)
        ends = [0]
        for m in linears:
            ends.append(ends[-1] + m.out_features)
        self.bounds = list(zip(ends, ends[1:]))
        self._x = self._y = None
        self._left = 0

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self._x is not x or not self._left:
            self._x, self._y, self._left = x, self.linear(x), len(self.bounds)
        a, b = self.bounds[i]
        y = self._y[..., a:b]
        self._left -= 1
        if not self._left:
            self._x = self._y = None
        return y


class MergedPart(nn.Module):
    def __init__(self, group: MergedLinear, index: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features = group.linear.in_features
        self.out_features = group.bounds[index][1] - group.bounds[index][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)


def pack_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype oneDNN packs and multiplies ``dtype`` weights in here (None: it does not).

    bfloat16 on a CPU without native bf16 GEMMs (no AVX512-BF16, no AMX): float32, which runs
    faster there than oneDNN's emulated bf16 (2 AVX2 cores: 140 against 6 GFLOP/s, where oneDNN
    refuses bf16; 2 Intel Ice Lake cores: 320 against 66); the product of bf16 values is the same
    up to summation order, and each output is rounded back to bf16."""
    if device.type != "cpu":
        return None
    if dtype == torch.bfloat16 and not cpu_has_native_bf16() and onednn_packs(torch.float32):
        return torch.float32
    return dtype if onednn_packs(dtype) else None


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 GEMMs run natively (about 2x float32's rate); elsewhere
    oneDNN emulates bf16, slower than float32."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(torch.cpu._is_avx512_bf16_supported() or (amx is not None and amx()))


def why_not(model: nn.Module, device: torch.device) -> str | None:
    """Why the fast path does not apply to ``model`` on ``device`` (None: it does)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in FAST_FAMILIES:
        return f"the fast path covers the {', '.join(FAST_FAMILIES)} families (tested against eager), not {kind!r}"
    dtype = next(model.parameters()).dtype
    if dtype not in FAST_DTYPES:
        return f"{dtype} runs the exact eager path (the fast path covers {', '.join(str(d) for d in FAST_DTYPES)})"
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        return "the model has no nn.Linear layers"
    return None


def _merge(module: nn.Module, pack: torch.dtype | None) -> int:
    """Merge the sibling projections of ``module`` (see MERGED); returns how many groups."""
    n = 0
    for names in MERGED:
        mods = [getattr(module, a, None) for a in names]
        if not all(type(m) is nn.Linear for m in mods) or len({m.in_features for m in mods}) != 1:
            continue
        if len({(m.weight.dtype, m.weight.device) for m in mods}) != 1:
            continue
        group = MergedLinear(mods, pack)
        for i, a in enumerate(names):
            setattr(module, a, MergedPart(group, i))
        n += 1
    return n


def build(model: nn.Module, device: torch.device) -> tuple[nn.Module, str]:
    """(the model the runner calls, a one-line description of what it is).

    The copy shares every parameter and buffer with ``model``; only its linear layers are
    new objects (a packed weight is the one extra copy of a weight)."""
    reason = why_not(model, device)
    if reason is not None:
        return model, f"eager ({reason})"
    dtype = next(model.parameters()).dtype
    pack = pack_dtype(dtype, device)
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    fast = copy.deepcopy(model, memo)
    merged = 0
    for m in list(fast.modules()):
        merged += _merge(m, pack)
    single = norms = 0
    for m in list(fast.modules()):
        for name, child in list(m.named_children()):
            if type(child) is nn.Linear:
                setattr(m, name, FastLinear(child.weight, child.bias, pack))
                single += 1
            elif type(child).__name__ in PLAIN_RMSNORMS and hasattr(child, "variance_epsilon"):
                setattr(m, name, FastRMSNorm(child))
                norms += 1
    if pack is None:
        kind = "plain" + (f" (oneDNN packs no {dtype} on this CPU)" if device.type == "cpu" else "")
    else:
        kind = "oneDNN-prepacked" + (f" in {pack} (no native {dtype} GEMM on this CPU)" if pack != dtype else "")
    return fast, f"fast: {merged} merged projection groups + {single} linears, {kind} weights; {norms} fused RMSNorms"


def forward_model(model: nn.Module, device: torch.device, enabled: bool = True) -> nn.Module:
    """The model the engine's runner calls: the fast copy, or ``model`` itself (logged once)."""
    if not enabled:
        log.info("forward: eager (the fast path is turned off)")
        return model
    try:
        fast, desc = build(model, device)
    except Exception as e:  # noqa: BLE001 - any module or layout it cannot copy or pack: run the exact eager model
        fast, desc = model, f"eager (the fast path failed to build: {type(e).__name__}: {e})"
    log.info("forward: %s", desc)
    return fast
