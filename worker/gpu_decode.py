"""Paged decode attention on a GPU: one Triton program per (sequence, KV head) walks that
sequence's pages through its block table, with an online softmax.

This is the CUDA counterpart of the CPU's native kernel (worker/csrc/paged_attention.cpp).
Its inputs have fixed shapes for a given number of sequences (block tables padded to one
width, context lengths) and are read on the device, so a decode step can be captured once as
a CUDA graph and replayed (worker/cuda_graphs.py); the torch path (worker/attention.py
``_decode``) plans spans of pages on the host every step and cannot be.

The query heads of one KV head (a grouped-query group) share each page's K and V, loaded
once. Scores, softmax and the weighted sum of V are in float32 whatever the cache's dtype, as
transformers' eager paths do for half precision. Slots past a sequence's context are never
read (a reused page's leftovers, NaN or not, cannot leak in).

Triton is imported on first use: CPU workers never load it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def why_not(device, dtype: torch.dtype, head_dim: int, model=None) -> str | None:
    """Why the kernel does not serve this engine (None: it does)."""
    if torch.device(device).type != "cuda":
        return "it runs on CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"{dtype} (the kernel covers float16, bfloat16 and float32)"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head size {head_dim} (a power of two from 16)"
    if model is not None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "attn_logit_softcapping", None):
            return "soft-capped attention scores"
        if any(getattr(m, "sinks", None) is not None for m in model.modules()):
            return "attention sinks"
    return None


@functools.cache
def _kernel():
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
    if not (kc.stride(3) == 1 and q.stride(2) == 1 and kc.stride() == vc.stride()):
        raise ValueError("the kernel reads head_dim-contiguous q and K/V pools of one layout")
    out = torch.empty_like(q) if out is None else out
    if n:
        decode, pow2 = _kernel()
        decode[(n, kvh)](q, kc, vc, tables, ctx, out,
                         q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), tables.stride(0),
                         out.stride(0), out.stride(1), float(scaling), int(window or 0),
                         G=g, G_PAD=pow2(g), PS=ps, D=D)
    return out
