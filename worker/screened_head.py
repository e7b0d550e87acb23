"""A float32 LM head's greedy picks, screened in bf16.

At a decode step the LM head is a fifth to a quarter of a float32 model's GEMM work (small:
32,000 x 768 against 6.3 M weights a layer x 12; SmolLM2: 49,152 x 576 against 30 layers of
3.5 M), and a greedy row needs only its largest logit. Where bf16 GEMMs run at twice float32's
rate (AVX512-BF16 on AMD, AMX), the head runs in bf16 instead: each approximate logit is
within a bound of the exact one (worker/csrc/greedy.cpp, ``screened_argmax``), so only the few
tokens whose bound reaches the row's best can be the largest; those are computed again in
float32 and the largest of them is the pick. The pick is the float32 head's, bar the near ties
where two float32 summation orders could disagree (tests/test_screened_head.py).

It serves a step only when every row it samples is plain greedy (``sampler.plain_greedy``): no
temperature, logprobs, penalties, bias or grammar, which need the logits themselves; other
steps take the float32 head. Measured on an AMD EPYC (Zen 4, 2 cores), 64 rows: SmolLM2's head
17.9 ms in float32 against 9.6 in bf16, small's 15.7 against 8.1.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from worker import native


def why_not(head: nn.Module, device: torch.device) -> str | None:
    """Why the head's greedy picks are not screened here (None: they are)."""
    w = getattr(head, "weight", None)
    if device.type != "cpu":
        return "not on a CPU"
    if w is None or w.dtype != torch.float32:
        return f"the head is {str(getattr(w, 'dtype', 'not a linear')).removeprefix('torch.')}, not float32"
    if getattr(head, "bias", None) is not None:
        return "the head has a bias"
    if not native.bf16_double_rate():  # (False where the linears' library is not there)
        return "bf16 GEMMs run no faster than float32 here"
    return None


class ScreenedHead:
    """``picks(h [S, d] float32) -> [S]``: the index of each row's largest ``h @ weight.T``."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().contiguous()  # the model's own (no copy)
        self.norms = self.weight.double().norm(dim=1).float()  # |w_j| (the bound allows for its rounding)
        self.handle = native.gemm_pack(self.weight.to(torch.bfloat16))
        weakref.finalize(self, native.gemm_release, self.handle)

    def picks(self, h: torch.Tensor) -> torch.Tensor:
        approx = torch.ops.tokenq_native.gemm_packed(h.to(torch.bfloat16), self.handle)
        return native.screened_argmax(approx, h, self.weight, self.norms)

    def warm(self, rows: int) -> None:
        """Meet a step of ``rows`` rows once (oneDNN's primitive for it, past the packed kernel's rows)."""
        torch.ops.tokenq_native.gemm_packed(torch.zeros(rows, self.weight.shape[1], dtype=torch.bfloat16), self.handle)
