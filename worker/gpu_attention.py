"""Paged attention on a GPU, as Triton kernels: decodes and prefill chunks each in one launch a layer.

The CUDA counterparts of the CPU's native kernels (worker/csrc/paged_attention.cpp): they walk
each sequence's pages through its block table, with an online softmax, and read no slot past
what a sequence may see (a reused page's leftovers, NaN or not, cannot leak in).

- ``paged_decode``: one program per (sequence, KV head); the query heads of a grouped-query
  group share each page's K and V, loaded once. Its inputs have fixed shapes for a given
  number of sequences (block tables padded to one width, context lengths) and are read on the
  device, so a decode step can be captured once as a CUDA graph and replayed
  (worker/cuda_graphs.py); the torch path (worker/attention.py ``_decode``) plans spans of
  pages on the host every step and cannot be.
- ``paged_prefill``: every prefill chunk of the step at once. The torch path attends chunk by
  chunk (one SDPA call each, after gathering a cached prefix's pages): a step that prefills 30
  prompts of SmolLM2 made some 900 SDPA calls and their gathers. Here one program takes a block
  of ``BLOCK_M`` query rows of one chunk for one query head and walks the keys it may see (its
  cached prefix, then its own rows up to the causal limit, or the last ``window`` of them),
  ``BLOCK_N`` at a time: no gather, no mask tensor, no launch per chunk. The blocks of all
  chunks form one grid axis (``work``). The step's own K/V are in the pages already (the
  attention op writes them first).

Scores, softmax and sums are in float32 whatever the cache's dtype, as transformers' eager paths
do for half precision; the prefill kernel's products run on tensor cores in the inputs' dtype
(float32 at full IEEE precision, not TF32), its probabilities rounded to the value dtype for the
second product, as flash attention does. Triton is imported on first use: CPU workers never
load it. tests/test_gpu_attention.py checks both against attention over the pages (on a CPU
through Triton's interpreter).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton's interpreter (the tests' CPU runs) multiplies bf16 tiles as their raw bits: under it the
# prefill kernel's products are taken in float32 instead.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 32  # prefill: query rows a program takes
BLOCK_N = 32  # prefill: keys a step of its loop reads


def why_not(device, dtype: torch.dtype, head_dim: int, model=None) -> str | None:
    """Why the kernels do not serve this engine (None: they do)."""
    if torch.device(device).type != "cuda":
        return "it runs on CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"{dtype} (the kernels cover float16, bfloat16 and float32)"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head size {head_dim} (a power of two from 16)"
    if model is not None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "attn_logit_softcapping", None):
            return "soft-capped attention scores"
        if any(getattr(m, "sinks", None) is not None for m in model.modules()):
            return "attention sinks"
    return None


def _check_layout(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
    if not (kc.stride(3) == 1 and q.stride(2) == 1 and kc.stride() == vc.stride()):
        raise ValueError("the kernels read head_dim-contiguous q and K/V pools of one layout")


@functools.cache
def _decode_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr,
               stride_qn, stride_qh, stride_kp, stride_kh, stride_ks, stride_tn, stride_on, stride_oh,
               scaling, window,
               G: tl.constexpr, G_PAD: tl.constexpr, PS: tl.constexpr, D: tl.constexpr):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(ctx_ptr + seq)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        s = tl.arange(0, PS)
        heads = kvh * G + g
        q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < G)[:, None], other=0.0).to(tl.float32)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        start = ctx * 0
        if window > 0:
            start = tl.maximum(ctx - window, 0)
        for p in range(start // PS, (ctx + PS - 1) // PS):
            page = tl.load(tables_ptr + seq * stride_tn + p).to(tl.int64)
            pos = p * PS + s
            valid = (pos < ctx) & (pos >= start)
            at = page * stride_kp + kvh * stride_kh + s[:, None] * stride_ks + d[None, :]
            k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [G_PAD, PS]
            sc = tl.where(valid[None, :], sc, float("-inf"))
            # every page walked holds a valid slot, so the running max is finite from the first
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - m_new)
            w = tl.exp(sc - m_new[:, None])
            total = total * alpha + tl.sum(w, axis=1)
            v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        o = acc / total[:, None]
        tl.store(out_ptr + seq * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])

    return decode, triton.next_power_of_2


def paged_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                 scaling: float, window: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D]; one layer's pool kc/vc [pages, kvh, page_size, D]; tables [n, width] (each
    sequence's pages, padded); ctx [n] (slots each attends, its own token included) -> [n, H, D]
    (into ``out`` when given). Only the last ``window`` slots are attended when it is set."""
    n, H, D = q.shape
    kvh, ps = kc.shape[1], kc.shape[2]
    g = H // kvh
    _check_layout(q, kc, vc)
    out = torch.empty_like(q) if out is None else out
    if n:
        decode, pow2 = _decode_kernel()
        decode[(n, kvh)](q, kc, vc, tables, ctx, out,
                         q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0),
                         out.stride(0), out.stride(1), float(scaling), int(window or 0),
                         G=g, G_PAD=pow2(g), PS=ps, D=D)
    return out


@functools.cache
def _prefill_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefill(q_ptr, k_ptr, v_ptr, tables_ptr, starts_ptr, lens_ptr, rows_ptr, work_ptr, out_ptr,
                stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_tc, stride_ot, stride_oh,
                scaling, window,
                G: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                IEEE: tl.constexpr, UPCAST: tl.constexpr):
        w = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // G
        chunk = tl.load(work_ptr + 2 * w)
        block = tl.load(work_ptr + 2 * w + 1)
        start = tl.load(starts_ptr + chunk)  # tokens of the sequence cached before the chunk
        n = tl.load(lens_ptr + chunk)
        row0 = tl.load(rows_ptr + chunk)  # the chunk's first row in q and out
        m_idx = block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m_idx < n
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (row0 + m_idx)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=m_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qpos = start + m_idx  # each row's position in its sequence
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        hi = start + tl.minimum((block + 1) * BLOCK_M, n)  # keys past the block's last row are never seen
        lo = hi * 0
        if window > 0:
            lo = tl.maximum(start + block * BLOCK_M - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        for k0 in range(lo, hi, BLOCK_N):
            kpos = k0 + tl.arange(0, BLOCK_N)
            k_ok = kpos < hi
            page = tl.load(tables_ptr + chunk * stride_tc + kpos // PS, mask=k_ok, other=0).to(tl.int64)
            at = page[:, None] * stride_kp + kvh * stride_kh + (kpos % PS)[:, None] * stride_ks + d[None, :]
            k = tl.load(k_ptr + at, mask=k_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scaling
            see = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
            if window > 0:
                see = see & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet (padding rows)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + at, mask=k_ok[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        o = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + (row0 + m_idx)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])

    return prefill


def work(lens: list[int]) -> list[int]:
    """The grid's (chunk, block) pairs, flattened, for chunks of ``lens`` query rows."""
    out: list[int] = []
    for c, n in enumerate(lens):
        for b in range(-(-n // BLOCK_M)):
            out += (c, b)
    return out


def paged_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor,
                  lens: torch.Tensor, rows: torch.Tensor, work_pairs: torch.Tensor, scaling: float, window: int | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]: the step's prefill rows, chunk after chunk; one layer's pool kc/vc [pages, kvh,
    page_size, D], the chunks' K/V already in it; per chunk its block table (tables [C, width]),
    cached prefix (starts [C]), length (lens [C]) and first row in q (rows [C]); ``work_pairs``
    from ``work``. -> [T, H, D] (into ``out`` when given)."""
    T, H, D = q.shape
    kvh, ps = kc.shape[1], kc.shape[2]
    _check_layout(q, kc, vc)
    out = torch.empty_like(q) if out is None else out
    if T:
        _prefill_kernel()[(work_pairs.shape[0] // 2, H)](
            q, kc, vc, tables, starts, lens, rows, work_pairs, out,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0),
            out.stride(0), out.stride(1), float(scaling), int(window or 0),
            G=H // kvh, PS=ps, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
            UPCAST=_INTERPRETED and q.dtype == torch.bfloat16)
    return out
