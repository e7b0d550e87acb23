"""The compiled forward: a Llama-family decoder as one Inductor graph, token dimension dynamic.

The eager fast path (worker/fastpath.py) runs each of the model's small elementwise ops
(RoPE, RMSNorm's casts, SiLU times up, residual adds) as its own ATen call: some 60 a
layer, 15-35 us each in bfloat16 on a CPU, more time than the layer's GEMMs at decode
sizes. Here the same computation is written once as plain tensor code over the model's
weights and compiled whole by Inductor, which fuses those ops into a few loops, packs the
frozen weights for oneDNN and merges nothing the code does not merge itself (q/k/v and
gate/up are concatenated here). bf16 linears are packed into AMX tiles instead on a CPU with
AMX, for AVX512-BF16 dot products on one without, and float32 for AVX-512 or AVX2 FMAs and
MKL's SGEMM (worker/csrc/packed_gemm.cpp): the faster kernels there at decode row counts.
The graph holds no weight, so a restart finds it in Inductor's cache. On a CPU with no bf16
products at all, bf16 weights are widened to float32 for those float32 kernels (oneDNN
emulates bf16 there, at a fifth of float32's rate). Inductor's own frozen oneDNN linears
remain where the native library cannot be built. SiLU times up is a native op where
the attention is (worker/csrc/activations.cpp: Inductor's loop spent more on its exp than on
reading and writing the values).

One graph serves every step:

- The packed token row ``[T]`` is the only dynamic size. Steps of one token are padded to
  two (Inductor specialises sizes 0 and 1: a second graph otherwise), and where the linears
  are oneDNN's, steps of a size not run at start to a multiple of ROW_STEP (oneDNN builds a
  kernel for each new row count); the attention op computes the real rows only and the
  padding rows' output is dropped.
- Attention is an opaque custom op, ``tokenq::paged_attention(q, k, v, layer)``, that
  reads the step's layout (a :class:`worker.attention.StepMeta`) and the cache from this
  module's step context, not from its arguments: nothing per step becomes a guard, and
  the cache, written in place by the op, is never copied by functionalisation.
- The LM head runs after the graph, on the rows that sample only (their count varies
  independently of T), as a oneDNN-packed linear.

Exactness against the eager engine (same weights, same StepMeta, the same attention code)
is tested in tests/test_fastpath.py (200 requests per family, step logits within 1e-4) and
tests/test_compiled.py (every batch shape, no recompilation); only the order of floating-point
operations inside fused loops and GEMMs differs. On CUDA (docs/cuda.md) the same graph is
built, with Triton kernels and cuBLAS GEMMs, and its decode steps are replayed as CUDA graphs
(worker/cuda_graphs.py: ``hidden`` is what they capture). Families whose layers are not
the Llama shape and float64 run the eager fast path instead (``why_not``), said in one log line.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import weakref

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn

from worker import attention, fastpath, native, screened_head, tuning
from worker.models import max_exact_len
from worker.probe import expected_windows

COMPILED_DTYPES = (torch.float32, torch.bfloat16)
# The activation modules that are SiLU (torch's, and transformers' ACT2FN["silu"]): their layers'
# SiLU times up goes to tokenq_native::silu_mul where the native ops serve
SILUS = ("SiLU", "SiLUActivation")
MIN_ROWS = 2  # see the module docstring: sizes 0 and 1 would specialise the graph
# Steps whose size was not run at start (warm_sizes: every decode batch size) are padded up to a
# multiple of this many rows where the linears are oneDNN's. oneDNN builds a primitive (a JIT'd
# kernel) for each new row count of each GEMM shape: 1-8 ms each, some 20 ms a step for
# SmolLM2's four shapes at a new size, and its cache holds 1,024 primitives, so mixed steps of
# every size from 1 to max_num_batched_tokens kept missing it while serving (1,300 sizes of one
# shape run twice in a row: 8.2 s the second time, 0.34 s for 300 it still held). Multiples of
# 16 (an AMX tile's rows) cap the sizes at 2,048 / 16 = 128 for the default budget; the padding
# rows cost at most 15 rows of work a step and no attention (see paged_attention_op).
ROW_STEP = 16
MAX_DECODERS = 128  # compiled decoders one process may hold (see CompiledForward)
# The RoPE table covers the model's whole exact length up to this many positions, so that
# engines on one model with different cache sizes (hence different max_model_len) share one
# graph instead of compiling their own (the table's length is a size of the graph); 32 MB at
# most, for head size 128 in float32. Past it, the table is as long as the engine needs.
TABLE_LEN = 32768

# The step now running through the compiled graph, per thread (engines may step in threads of
# their own): .step = (StepMeta, per-layer attention settings), set by CompiledForward.__call__
# around the graph call and read by the attention op, which runs in the caller's thread.
_context = threading.local()


@torch.library.custom_op("tokenq::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q [T, H, D], k/v [T, kvh, D] (RoPE applied) -> [T, H * D]; writes k/v into the cache.
    Rows past the step's real tokens (padding) are not computed and come back zero."""
    meta, specs = _context.step
    n = meta.write_pages.shape[0]
    scaling, window, softcap = specs[layer]
    o = attention.paged(layer, q[:n].transpose(0, 1)[None], k[:n].transpose(0, 1)[None], v[:n].transpose(0, 1)[None],
                        meta, scaling, window, softcap, None)[0]
    if q.shape[0] == n:  # no padding row: paged()'s fresh output, viewed (no copy)
        return o.reshape(n, -1)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    out[:n] = o.reshape(n, -1)
    out[n:] = 0
    return out


@paged_attention_op.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class _Compiled(Exception):
    """The graph is compiled; this call was only to compile it (CompiledForward._compile_dry)."""


class _Inductor:
    """The Inductor backend, as torch.compile's "inductor", except that while ``dry`` is set the
    compiled graph returns at once (raising _Compiled) instead of running: Dynamo has kept the
    graph by then, and the next call with these shapes runs it. (It holds nothing of the
    CompiledForward: Dynamo's cache keeps it, and the decoder's packed weights are freed with
    the CompiledForward.)"""

    dry = False

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)

        def call(*args):
            if self.dry:
                raise _Compiled
            return compiled(*args)

        return call


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach(), requires_grad=False)


def _cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in ts):
        return None
    return torch.cat([t.detach() for t in ts])


class _Layer(nn.Module):
    """One decoder layer's weights: q/k/v and gate/up concatenated (one GEMM each). With
    ``packed``, the four weights are packed by worker/csrc/packed_gemm.cpp and the graph
    names them by handle (``*_h``; None: F.linear on the weight, which Inductor packs for oneDNN)."""

    def __init__(self, layer: nn.Module, packed: bool = False):
        super().__init__()
        at, mlp = layer.self_attn, layer.mlp
        self.q_size = at.q_proj.out_features
        self.kv_size = at.k_proj.out_features
        self.head_dim = at.head_dim
        self.qkv_w = _param(_cat(at.q_proj.weight, at.k_proj.weight, at.v_proj.weight))
        biases = (at.q_proj.bias, at.k_proj.bias, at.v_proj.bias)
        self.qkv_b = None if all(b is None for b in biases) else _param(torch.cat(
            [b.detach() if b is not None else m.weight.new_zeros(m.out_features)
             for b, m in zip(biases, (at.q_proj, at.k_proj, at.v_proj))]))
        self.o_w, self.o_b = _param(at.o_proj.weight), _param(at.o_proj.bias)
        self.gate_up_w = _param(_cat(mlp.gate_proj.weight, mlp.up_proj.weight))
        self.gate_up_b = None if mlp.gate_proj.bias is None else _param(_cat(mlp.gate_proj.bias, mlp.up_proj.bias))
        self.down_w, self.down_b = _param(mlp.down_proj.weight), _param(mlp.down_proj.bias)
        self.ln1, self.ln2 = _param(layer.input_layernorm.weight), _param(layer.post_attention_layernorm.weight)
        self.eps = layer.input_layernorm.variance_epsilon
        qn, kn = getattr(at, "q_norm", None), getattr(at, "k_norm", None)
        self.q_norm = None if qn is None else _param(qn.weight)
        self.k_norm = None if kn is None else _param(kn.weight)
        self.norm_eps = None if qn is None else qn.variance_epsilon
        self.act = mlp.act_fn
        self.silu = type(mlp.act_fn).__name__ in SILUS
        self.qkv_h = self.o_h = self.gate_up_h = self.down_h = None
        wide = None if packed else _widened(self.o_w)
        if wide is not None:  # bf16 on a CPU without native bf16 GEMMs: float32 copies, as the eager fast path
            for name in ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b", "down_w", "down_b"):
                t = getattr(self, name)
                setattr(self, name, None if t is None else _param(t.to(wide)))
        self.gemm_shapes: list[tuple[int, int, int]] = []  # packed: (handle, out, in) of each linear
        if packed:
            self.qkv_h, self.o_h = native.gemm_pack(self.qkv_w), native.gemm_pack(self.o_w)
            self.gate_up_h, self.down_h = native.gemm_pack(self.gate_up_w), native.gemm_pack(self.down_w)
            self.gemm_shapes = [(h, *w.shape) for h, w in zip(self.handles(), (self.qkv_w, self.o_w, self.gate_up_w,
                                                                              self.down_w))]
            self.qkv_w = self.gate_up_w = None  # the concatenated copies (o and down share the model's)

    def handles(self) -> list[int]:
        return [h for h in (self.qkv_h, self.o_h, self.gate_up_h, self.down_h) if h is not None]


def _widened(w: torch.Tensor) -> torch.dtype | None:
    """The dtype the decoder's oneDNN linears multiply ``w``'s dtype in, where not its own:
    float32 for bf16 on a CPU without native bf16 GEMMs (worker/fastpath.py's pack_dtype), where
    the packed kernels do not take them (the native library could not be built; where it is,
    they widen bf16 themselves).
    Inductor would leave such bf16 linears to an emulated GEMM: small's bf16 bench on an AVX2
    EPYC ran 42 output tok/s against float32's 217-235."""
    pack = fastpath.pack_dtype(w.dtype, w.device)
    return pack if pack is not None and pack != w.dtype else None


def _linear(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, handle: int | None) -> torch.Tensor:
    if handle is None:
        if w.dtype != x.dtype:  # widened (_widened): the products in float32, each output rounded back
            return F.linear(x.to(w.dtype), w, b).to(x.dtype)
        return F.linear(x, w, b)
    y = torch.ops.tokenq_native.gemm_packed(x, handle)
    return y if b is None else y + b


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: normalised in float32, cast back, times the weight
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D]: transformers' x * cos + rotate_half(x) * sin, each half
    # computed where it lands. Written with rotate_half's cat of a slice, Inductor copied the
    # halves into a buffer first (four more loops over q and k): 0.61 -> 0.37 ms for a small
    # layer's q and k at 2,048 tokens, bf16, the same bits
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), dim=-1)


class Decoder(nn.Module):
    """The decoder up to the final norm: ids [T], positions [T] -> hidden states [T, hidden]."""

    def __init__(self, model: nn.Module, max_len: int, attend, packed: bool = False, silu_mul=None):
        super().__init__()
        self.attend = attend  # the attention op: tokenq_native::attend or tokenq::paged_attention
        # SiLU times up for SiLU layers: tokenq_native::silu_mul beside the native attention op
        # where it is vectorised (worker/csrc/activations.cpp: a cheaper exp and reciprocal than
        # Inductor's loop takes), else Inductor's loop
        self.silu_mul = silu_mul
        inner = model.model
        self.embed = _param(inner.embed_tokens.weight)
        self.layers = nn.ModuleList(_Layer(layer, packed) for layer in inner.layers)
        handles = [h for L in self.layers for h in L.handles()]
        if handles:  # the packed copies live in the native library until the decoder goes
            weakref.finalize(self, _release, handles)
        self.norm = _param(inner.norm.weight)
        self.eps = inner.norm.variance_epsilon
        dtype = self.embed.dtype
        # cos/sin for every position the engine can reach, computed by the model's own rotary
        # module: exactly the values its eager forward uses, for every RoPE type the engine
        # serves (max_len is capped where "dynamic" and "longrope" would start to depend on
        # the sequence length: worker/models.max_exact_len)
        with torch.no_grad():
            pos = torch.arange(max_len, device=self.embed.device)[None]
            cos, sin = inner.rotary_emb(self.embed[:1].to(dtype), pos)
        self.register_buffer("cos", cos[0].to(dtype), persistent=False)
        self.register_buffer("sin", sin[0].to(dtype), persistent=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        residual = None
        for i, L in enumerate(self.layers):
            residual = h if residual is None else residual + h
            x = _rms_norm(residual, L.ln1, L.eps)
            qkv = _linear(x, L.qkv_w, L.qkv_b, L.qkv_h)
            q, k, v = qkv.split([L.q_size, L.kv_size, L.kv_size], dim=-1)
            q = q.reshape(q.shape[0], -1, L.head_dim)
            k = k.reshape(k.shape[0], -1, L.head_dim)
            v = v.reshape(v.shape[0], -1, L.head_dim)
            if L.q_norm is not None:
                q, k = _rms_norm(q, L.q_norm, L.norm_eps), _rms_norm(k, L.k_norm, L.norm_eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            a = self.attend(q, k, v, i)
            h = _linear(a, L.o_w, L.o_b, L.o_h)
            residual = residual + h
            x = _rms_norm(residual, L.ln2, L.eps)
            gate_up = _linear(x, L.gate_up_w, L.gate_up_b, L.gate_up_h)
            if L.silu and self.silu_mul is not None:
                a = self.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                a = L.act(gate) * up
            h = _linear(a, L.down_w, L.down_b, L.down_h)
        return _rms_norm(residual + h, self.norm, self.eps)


def _release(handles: list[int]) -> None:
    for h in handles:
        native.gemm_release(h)


def why_not(model: nn.Module, device: torch.device) -> str | None:
    """Why the compiled forward does not apply (None: it does)."""
    if device.type not in ("cpu", "cuda"):
        return f"the compiled forward is built for CPU and CUDA, not {device.type}"
    reason = fastpath.why_not(model, device)
    if reason is not None:
        return reason
    dtype = next(model.parameters()).dtype
    if dtype not in COMPILED_DTYPES:
        return f"{dtype} is not compiled (float32 and bfloat16 are)"
    inner = getattr(model, "model", None)
    if getattr(inner, "rotary_emb", None) is None:
        return "the model has no rotary embedding module"
    for layer in getattr(inner, "layers", []):
        at, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if at is None or mlp is None or not all(type(getattr(at, a, None)) is nn.Linear for a in names):
            return f"layer {type(layer).__name__} is not Llama-shaped"
        if not all(type(getattr(mlp, a, None)) is nn.Linear for a in ("gate_proj", "up_proj", "down_proj")):
            return f"MLP {type(mlp).__name__} is not gate/up/down"
        if type(layer.input_layernorm).__name__ not in fastpath.PLAIN_RMSNORMS:
            return f"norm {type(layer.input_layernorm).__name__} is not Llama's RMSNorm"
    if getattr(model.config, "final_logit_softcapping", None):
        return "final logit soft-capping"
    return None


class CompiledForward:
    """``forward(ids [T], positions [T], keep [S], meta) -> logits [S, vocab]``, through the
    compiled decoder and a packed LM head."""

    def __init__(self, model: nn.Module, max_len: int, head: nn.Module, native_attention: bool,
                 packed: bool | None = None, native_steps: bool = False):
        """``packed``: linears through worker/csrc/packed_gemm.cpp; by default as packed_linears says.
        ``native_steps``: the steps' native library serves the engine (native decode attention)."""
        config = model.config
        layers = model.model.layers
        windows = expected_windows(config, len(layers))
        self.specs = [(L.self_attn.scaling, windows[i], getattr(config, "attn_logit_softcapping", None))
                      for i, L in enumerate(layers)]
        # Attention through the native kernels' C++ op (worker/native.py: the step's layout set
        # for the thread once a step, no Python per layer) where they serve every step, decodes
        # and prefills; else the Python op above.
        self.native = native_attention
        self.scales = [float(sc) for sc, _, _ in self.specs]
        self.windows = [int(w or 0) for _, w, _ in self.specs]
        attend = torch.ops.tokenq_native.attend if native_attention else torch.ops.tokenq.paged_attention
        self.packed = packed_linears(model) if packed is None else packed
        # some linears are oneDNN's (packed by Inductor, or steps past the packed kernel's rows,
        # but for MKL's): each new row count costs a primitive (ROW_STEP)
        w = next(model.parameters())
        self.onednn = w.device.type == "cpu" and (not self.packed or native.packed_gemm_onednn(w.dtype))
        silu_mul = None
        if native_attention and native.silu_mul_vectorised():
            silu_mul = torch.ops.tokenq_native.silu_mul
        self.decoder = Decoder(model, max_len, attend, self.packed, silu_mul).eval()
        if self.packed:
            tuning.trim_heap()  # the concatenated weights the packed copies were made from
        self.head = head  # the eager fast model's (worker/fastpath.py: already packed for oneDNN)
        # greedy steps' picks through the head screened in bf16 (worker/screened_head.py), where
        # it serves: its kernel is in the steps' native library
        out = model.get_output_embeddings()
        self.screened: screened_head.ScreenedHead | None = None
        self.screen_note = screened_head.why_not(out, w.device) if native_steps else "no native kernels"
        if self.screen_note is None:
            try:
                self.screened = screened_head.ScreenedHead(out.weight)
            except Exception as e:  # noqa: BLE001 - a weight it cannot pack: the head's logits serve
                self.screen_note = f"it failed to build: {type(e).__name__}: {e}"
        # Each decoder is its own graph (its weights frozen into it, or its packed weights'
        # handles constants of it; Dynamo guards on the instance), but all share
        # Decoder.forward's code object, whose cache Dynamo caps at recompile_limit entries (8):
        # more than that many engines on different models in one process (a test run) would
        # fail to compile.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_DECODERS)
        # With the native attention op, the graph is compiled by a first call that does not run it
        # (hidden): that library may still be building (worker/native.py).
        self.backend = _Inductor() if native_attention else "inductor"
        self.graph = torch.compile(self.decoder, fullgraph=True, dynamic=False, backend=self.backend)
        self.compile_s: float | None = None
        self.warm_sizes: set[int] = set()  # step sizes (tokens) already run once (see warm_sizes)

    compiled_dry = False  # the graph compiled by a call that did not run it

    def _compile_dry(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Compile the graph for these inputs without running it, then wait for the native
        attention kernel it calls (worker/native.py builds it in the background meanwhile).
        Raises where it could not be built (get() then leaves the compiled forward off)."""
        self.backend.dry = True
        try:
            self.graph(ids, positions)
        except _Compiled:
            pass
        finally:
            self.backend.dry = False
        self.compiled_dry = True
        if native.load() is None:
            raise RuntimeError(f"the native attention kernel did not build: {native.error()}")

    def linears(self) -> str:
        """Which kernel runs the decoder's linears (for the engine's log line)."""
        if self.packed:
            return native.packed_gemm_kernel(self.decoder.embed.dtype)
        if not self.onednn:
            return "Inductor's (cuBLAS)"
        wide, own = self.decoder.layers[0].o_w.dtype, self.decoder.embed.dtype
        return "oneDNN, packed by Inductor" + (f" in {wide} (no native {own} GEMMs here)" if wide != own else "")

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, meta) -> torch.Tensor:
        return self.head(self.hidden(ids, positions, meta).index_select(0, keep))

    def picks(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, meta) -> torch.Tensor:
        """The ``keep`` rows' greedy picks [S] through the screened head (a step whose sampled
        rows are all plain greedy: worker/sampler.py's plain_greedy)."""
        return self.screened.picks(self.hidden(ids, positions, meta).index_select(0, keep))

    def greedy_head(self) -> str:
        """How greedy steps pick (for the engine's log line)."""
        return "screened in bf16" if self.screened is not None else f"the head's logits ({self.screen_note})"

    def rows(self, T: int) -> int:
        """The rows the graph runs for a step of ``T`` tokens (padding past T: MIN_ROWS, ROW_STEP)."""
        if T < MIN_ROWS:
            return MIN_ROWS
        if not self.onednn or T in self.warm_sizes:
            return T
        return -(-T // ROW_STEP) * ROW_STEP

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The decoder's output [T, hidden] for the step (padding rows, if any, at the end)."""
        T = ids.shape[0]
        rows = self.rows(T)
        if rows > T:
            ids = torch.cat([ids, ids.new_zeros(rows - T)])
            positions = torch.cat([positions, positions.new_zeros(rows - T)])
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        if self.native:
            if not self.compiled_dry:
                self._compile_dry(ids, positions)
            native.set_step(meta, self.scales, self.windows)
        else:
            _context.step = (meta, self.specs)
        try:
            return self.graph(ids, positions)
        finally:
            if self.native:
                native.clear_step()
            else:
                _context.step = None


def packed_linears(model: nn.Module) -> bool:
    """Whether the decoder's linears go through worker/csrc/packed_gemm.cpp: on a CPU where it
    has a kernel for them (bf16: AMX or AVX512-BF16, else widened; float32: AVX-512 or AVX2
    panels, else MKL's on Intel and oneDNN's on AMD, held by handle rather than frozen into the
    graph).
    Asked only there: anywhere else the question would build the CPU kernels for nothing."""
    w = next(model.parameters())
    return w.device.type == "cpu" and w.dtype in COMPILED_DTYPES and native.packed_gemm_preferred(w.dtype)


# model -> {(RoPE table length, attention kernels, packed linears): CompiledForward}: engines on
# the same model share one graph (it holds no per-engine state: the cache and layout come with
# each step)
_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def table_len(max_len: int, model_len: int) -> int:
    """Positions the RoPE table covers for an engine of ``max_len`` on a model of exact length
    ``model_len`` (see TABLE_LEN): the same for every engine on the model up to TABLE_LEN."""
    return max(max_len, min(model_len, TABLE_LEN))


def get(model: nn.Module, max_len: int, device: torch.device, eager: nn.Module, shape: dict,
        native_decode: bool, native_prefill: bool) -> tuple[CompiledForward | None, str]:
    """(the compiled forward, warmed up and checked, and how long that took) or (None, why not).
    ``max_len`` is the longest sequence the engine serves (positions 0 .. max_len - 1);
    ``native_*``: whether the engine's runner attends through the native kernels."""
    if os.environ.get("TOKENQ_COMPILE", "1") == "0":
        return None, "TOKENQ_COMPILE=0"
    reason = why_not(model, device)
    if reason is not None:
        return None, reason
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    length = table_len(max_len, max_exact_len(config))
    kernels = (native_decode, native_prefill)
    dtype = next(model.parameters()).dtype
    packed = packed_linears(model)
    known = _built.setdefault(model, {})
    if (length, kernels, packed) in known:
        return known[length, kernels, packed], "compiled earlier for this model"
    try:
        fwd = CompiledForward(model, length, eager.get_output_embeddings(), native_decode and native_prefill, packed,
                              native_decode)
        reason = warm_up(fwd, model, eager, shape, device, dtype, kernels)
    except Exception as e:  # noqa: BLE001 - a layout it cannot read, an op Inductor refuses: the eager fast path serves
        return None, f"it failed to build: {type(e).__name__}: {e}"
    if reason is not None:
        return None, reason
    known[length, kernels, packed] = fwd
    return fwd, f"compiled and checked in {fwd.compile_s:.1f} s; linears: {fwd.linears()}; greedy head: {fwd.greedy_head()}"


def warm_up(fwd: CompiledForward, model: nn.Module, eager: nn.Module, shape: dict, device, dtype,
            kernels: tuple[bool, bool]) -> str | None:
    """Compile the graph (a prefill step, a decode step of two sequences and one of a single
    sequence, on a scratch cache) and check its logits on the same steps. Returns why it
    cannot serve (None: it can); the compile time is in fwd.compile_s.

    float32: within the probe's tolerance of the eager fast model's logits. Half precision:
    two bf16 forwards that round in different places differ by more than either differs from
    the exact result (SmolLM2: graph and eager 2.1 apart, each within 1.4 of float64), so the
    graph is held to the exact result instead: its logits must be no further from a float32
    evaluation of the same weights by the model's own layers than twice the eager forward's
    are (a wrong graph is off by the logits' whole scale)."""
    from worker.cache import KVCache
    from worker.probe import HALF_TOLERANCE, PROMPTS, TOLERANCE, steps
    from worker.runner import ModelRunner

    vocab = eager.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    pages = sum(-(-(len(p) + 2) // shape["page_size"]) for p in prompts)
    cache = KVCache(num_pages=pages, dtype=dtype, device=device, **shape)
    t = time.perf_counter()
    # Freezing (weights as constants: Inductor packs them for oneDNN and fuses activations into
    # the GEMMs) is read from the global config when the graph compiles, not from options. Only
    # where Inductor runs the linears: where the packed kernels take them all, the graph names
    # them by handle and holds no weight matrix, and freezing only cost time (SmolLM2 float32 on
    # an AMD EPYC: a first compile 33.4 s against 27.5 s without; a restart 16-24 s against 5 s,
    # as the C++ wrapper names frozen constants by address and was rebuilt at every start),
    # decode steps level (1 to 64 sequences, tiny, small and SmolLM2, interleaved).
    # emulate_precision_casts: a fused loop rounds its intermediates to bf16 where the eager
    # model does (closer to the eager forward, and to the exact result, than without).
    # cpp.dynamic_threads: every fused loop gets a parallel region. Inductor otherwise decides
    # by the token count of the step it traced (a few tokens here: every loop on one thread,
    # and a 2048-token prefill's SiLU took 2 ms a layer); tracing a long step instead gave the
    # same code but, measured, 40% slower prefill and decode steps (not understood).
    # cpp.vec_isa_ok: Inductor otherwise builds and loads a test program for each vector ISA
    # the CPU reports, in every process (1.4 s of each start); where the native linears built
    # with -march=native, this compiler already handles this CPU's instruction sets.
    # cpp_wrapper (CPU): the graph's calls (30 layers x a dozen kernels and GEMMs for SmolLM2)
    # made from C++ rather than from a Python wrapper, which spent about 5 ms of every step (a
    # SmolLM2 bf16 decode step at 64 sequences 74 -> 71.5 ms, at 1 sequence 22 -> 20.7). Not
    # on CUDA, where CUDA graphs take that cost away from decode steps (docs/cuda.md).
    # cpp_wrapper_build_separate: the kernels compiled apart from the wrapper, so Inductor's
    # cache keeps them; where weights are frozen the wrapper names their addresses and is built
    # again at every start (3.5 s for SmolLM2 this way, 9 s as one file with the kernels).
    # aot_inductor.compile_wrapper_opt_level: the separately built wrapper (its calls only; the
    # kernels keep -O3) at -O0 rather than -O1: g++ took 1.2 s over it instead of 3.4 s for
    # SmolLM2, its decode steps as fast (AMD EPYC, Zen 4, bf16, median of 30 steps in two
    # rounds: 1 sequence 10.9 and 11.4 ms against 12.6 and 13.4; 64 sequences 71.6 and 72.6
    # against 71.3 and 72.9; tiny float32 at 1 sequence 1.15 and 1.03 against 0.96 and 1.11).
    options = dict(freezing=not fwd.packed, emulate_precision_casts=True)
    if torch.device(device).type == "cpu":  # (CPU-only settings: a CUDA machine's torch may not know them)
        options.update(cpp_wrapper=True, cpp_wrapper_build_separate=True,
                       **{"cpp.dynamic_threads": True, "cpp.vec_isa_ok": True if native.load_linears() is not None else None,
                          "aot_inductor.compile_wrapper_opt_level": "O0"})
    with inductor_config.patch(**options):
        got = steps(ModelRunner(None, cache, *kernels, compiled=fwd), prompts)
        steps(ModelRunner(None, cache, *kernels, compiled=fwd), prompts[:1])  # T = 1 (padded)
    fwd.compile_s = time.perf_counter() - t
    want = steps(ModelRunner(eager, cache, *kernels), prompts)
    if dtype == torch.float32:
        tol = TOLERANCE[dtype]
        for i in want:
            for a, b in zip(got[i], want[i]):
                err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
                if not err <= tol * scale:
                    return f"its logits differ from the eager forward's by {err:.3g} (tolerance {tol * scale:.3g})"
        return None
    cache32 = KVCache(num_pages=pages, dtype=torch.float32, device=device, **shape)
    exact = steps(ModelRunner(None, cache32, *kernels, compiled=_Reference(model)), prompts)
    scale = max(1.0, max(b.abs().max().item() for i in exact for b in exact[i]))
    err_graph = max((a - b).abs().max().item() for i in exact for a, b in zip(got[i], exact[i]))
    err_eager = max((a - b).abs().max().item() for i in exact for a, b in zip(want[i], exact[i]))
    allowed = 2 * err_eager + TOLERANCE[torch.float32] * scale
    if not err_graph <= allowed or not err_graph <= HALF_TOLERANCE * scale * 4:
        return (f"its logits are {err_graph:.3g} from a float32 evaluation of the same weights, the eager "
                f"forward's {err_eager:.3g} (allowed {min(allowed, HALF_TOLERANCE * scale * 4):.3g})")
    return None


def warm_sizes(fwd: CompiledForward, shape: dict, device, dtype, kernels: tuple[bool, bool], sizes) -> float:
    """Make each step size in ``sizes`` (tokens) one the graph has met; returns the seconds it
    took. oneDNN makes a primitive for each new row count of each GEMM shape the first time it
    meets it (0.5-1 ms each): a worker's first decode steps, one batch size after another, paid
    that while serving (a tiny model's first 1.7 s of work took 0.2 s longer than the same work
    again); here it is paid at start instead.

    Where every linear of the graph is a packed kernel's (``fwd.packed``), those primitives are
    all a size needs (the graph's other loops take any size), and they depend on the GEMM's
    shape, not its weights: each distinct linear shape and the LM head run once per size, on
    zeros. Running the whole graph at every size took 4.3 s of a SmolLM2 worker's start in
    float32 and 2.0 s in bf16, shape by shape 1.1 and 0.5 s (AMD EPYC, Zen 4); after it, small's
    decode steps at every size from 1 to 64 ran no slower the first time than again (2.81 against
    2.85 s). Elsewhere Inductor's own oneDNN linears, with their fused epilogues, are met by
    running the graph, on a scratch cache."""
    todo = sorted(set(sizes) - fwd.warm_sizes - {0})
    if not todo:
        return 0.0
    t = time.perf_counter()
    if fwd.packed:
        shapes = {(out, k): h for L in fwd.decoder.layers for h, out, k in L.gemm_shapes}
        hidden = fwd.decoder.embed.shape[1]
        for n in todo:
            fwd.warm_sizes.add(n)  # run as n rows, not padded (CompiledForward.rows)
            for (_, k), h in shapes.items():
                torch.ops.tokenq_native.gemm_packed(torch.zeros(n, k, dtype=dtype, device=device), h)
            fwd.head(torch.zeros(n, hidden, dtype=dtype, device=device))
            if fwd.screened is not None:
                fwd.screened.warm(n)
        return time.perf_counter() - t

    from common.protocol import SamplingParams
    from worker.cache import KVCache
    from worker.runner import ModelRunner
    from worker.scheduler import ScheduledSeq, SchedulerOutput
    from worker.sequence import Sequence

    runner = ModelRunner(None, KVCache(num_pages=max(todo), dtype=dtype, device=device, **shape), *kernels, compiled=fwd)
    for n in todo:  # a step of n one-token prompts: n rows through every GEMM
        fwd.warm_sizes.add(n)  # run as n rows, not padded (CompiledForward.rows)
        seqs = [Sequence(f"warm-{i}", [1], 1, SamplingParams(max_tokens=1), 1, i, 0.0, 0) for i in range(n)]
        for i, s in enumerate(seqs):
            s.block_table = [i]
        runner.execute(SchedulerOutput(scheduled=[ScheduledSeq(s, 0, 1, True) for s in seqs]))
    return time.perf_counter() - t


def warm_budget(fwd: CompiledForward, shape: dict, device, dtype, kernels: tuple[bool, bool], tokens: int,
                max_len: int) -> float:
    """Run the graph once on a step of ``tokens`` prompt tokens (the step budget), on a scratch
    cache; returns the seconds it took. A step's buffers are largest at the budget, and the
    first steps that size page-faulted them in while serving (tiny in float32: 15,500 faults,
    a first 2,048-token step of 91 ms against 63-69 for the same step later); glibc keeps them
    once freed (worker/tuning.py), so they are paid here, at start, instead (as vLLM's start-up
    runs a step at its token budget)."""
    from common.protocol import SamplingParams
    from worker.cache import KVCache
    from worker.runner import ModelRunner
    from worker.scheduler import ScheduledSeq, SchedulerOutput
    from worker.sequence import Sequence

    t = time.perf_counter()
    ps = shape["page_size"]
    lens = []  # prompts of up to 512 tokens (and within the model's positions), as a step holds them
    while sum(lens) < tokens:
        lens.append(min(512, max_len, tokens - sum(lens)))
    runner = ModelRunner(None, KVCache(num_pages=sum(-(-n // ps) for n in lens), dtype=dtype, device=device, **shape),
                         *kernels, compiled=fwd)
    seqs, page = [], 0
    for i, n in enumerate(lens):
        s = Sequence(f"warm-budget-{i}", [1] * n, n, SamplingParams(max_tokens=1), 1, i, 0.0, 0)
        s.block_table = list(range(page, page + -(-n // ps)))
        page += len(s.block_table)
        seqs.append(s)
    runner.execute(SchedulerOutput(scheduled=[ScheduledSeq(s, 0, len(s.token_ids), True) for s in seqs]))
    return time.perf_counter() - t


class _Reference:
    """warm_up's exact result for a half-precision graph: the model's own (transformers) layers,
    each copied up to float32 just for its turn (never a float32 copy of the whole model), the
    hidden states in float32 throughout, the LM head cast up a block of rows at a time."""

    screened = None  # always the head's logits

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, ids, positions, keep, meta):
        inner = self.model.model
        h = F.embedding(ids, inner.embed_tokens.weight).float()[None]
        pos = positions[None]
        rope = inner.rotary_emb(h, pos)
        for layer in inner.layers:
            out = copy.deepcopy(layer).float()(h, position_ids=pos, position_embeddings=rope, tokenq=meta)
            h = out[0] if isinstance(out, tuple) else out
        h = copy.deepcopy(inner.norm).float()(h)[0].index_select(0, keep)
        w = self.model.get_output_embeddings().weight
        return torch.cat([F.linear(h, w[i:i + 8192].float()) for i in range(0, w.shape[0], 8192)], dim=-1)


def compile_count() -> int:
    """Graphs Dynamo has compiled in this process (a test asserts none is added after warm-up)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

