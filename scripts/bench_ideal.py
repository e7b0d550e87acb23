"""The "ideal" baseline of the benchmark: a hand-written functional forward of the same
weights, with no scheduler and a static KV cache.

Every prompt is prefilled alone (one forward each, SDPA causal), then every step runs one
batched decode forward over exactly the live sequences. The KV cache is static: one slot
of ``max_len`` positions per sequence, and live sequences are kept in the first slots
(when one finishes, the last live one moves into its slot), so decode attention reads
the cache in place as a strided view, never a gathered copy. It uses the same operations
as the transformers model (separate q/k/v and gate/up projections, the same RoPE and
RMSNorm), so the gap between it and tokenq's engine is what scheduling, paging and batch
building cost, not kernel choices.

Llama-style models only (Llama, Mistral without a sliding window, SmolLM2): the configs the
benchmark runs.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class IdealLlama:
    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in ("llama", "mistral"):
            raise ValueError(f"the ideal forward covers Llama-style models, not {cfg.model_type!r}")
        if getattr(cfg, "sliding_window", None):
            raise ValueError("the ideal forward does not do sliding windows")
        m = model.model
        self.embed = m.embed_tokens.weight
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, eps1=layer.input_layernorm.variance_epsilon,
                q=a.q_proj.weight, k=a.k_proj.weight, v=a.v_proj.weight, o=a.o_proj.weight,
                qb=a.q_proj.bias, kb=a.k_proj.bias, vb=a.v_proj.bias, ob=a.o_proj.bias,
                ln2=layer.post_attention_layernorm.weight, eps2=layer.post_attention_layernorm.variance_epsilon,
                gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight,
            ))
        self.norm, self.norm_eps = m.norm.weight, m.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.inv_freq = m.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(m.rotary_emb, "attention_scaling", 1.0))
        self.H = cfg.num_attention_heads
        self.KV = cfg.num_key_value_heads or self.H
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.scaling = self.D ** -0.5
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.vocab_size = cfg.vocab_size

    # ------------------------------------------------------------------ pieces

    @staticmethod
    def _rms(x, w, eps):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return w * x.to(dt)

    def _rope(self, pos: torch.Tensor):
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    @staticmethod
    def _rot(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

    def _qkv(self, L, h, cos, sin):
        """h [N, hidden] -> q [N, H, D], k/v [N, KV, D] with RoPE (cos/sin [N, 1, D])."""
        N = h.shape[0]
        x = self._rms(h, L["ln1"], L["eps1"])
        q = F.linear(x, L["q"], L["qb"]).view(N, self.H, self.D)
        k = F.linear(x, L["k"], L["kb"]).view(N, self.KV, self.D)
        v = F.linear(x, L["v"], L["vb"]).view(N, self.KV, self.D)
        return self._rot(q, cos, sin), self._rot(k, cos, sin), v

    def _mlp(self, L, h, attn):
        h = h + F.linear(attn, L["o"], L["ob"])
        x = self._rms(h, L["ln2"], L["eps2"])
        return h + F.linear(F.silu(F.linear(x, L["gate"])) * F.linear(x, L["up"]), L["down"])

    def _logits(self, h):
        return F.linear(self._rms(h, self.norm, self.norm_eps), self.lm_head)

    # ------------------------------------------------------------------ forwards

    def prefill(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """Prompt ``ids`` [T] into cache slot ``slot``; returns the last position's logits [vocab]."""
        T = ids.shape[0]
        cos, sin = self._rope(torch.arange(T, device=self.device))
        cos, sin = cos[:, None], sin[:, None]
        h = F.embedding(ids, self.embed)
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, h, cos, sin)
            self.kc[li, slot, :, :T] = k.transpose(0, 1)
            self.vc[li, slot, :, :T] = v.transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=self.scaling, enable_gqa=True,
            )
            h = self._mlp(L, h, o[0].transpose(0, 1).reshape(T, -1))
        return self._logits(h[-1:])[0]

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, Lmax: int) -> torch.Tensor:
        """One token for each of the first ``n`` slots (ids/pos [n]); returns logits [n, vocab].

        Attention reads the static cache in place: ``kc[layer, :n, :, :Lmax]`` is a view."""
        n = ids.shape[0]
        cos, sin = self._rope(pos)
        cos, sin = cos[:, None], sin[:, None]
        valid = torch.arange(Lmax, device=self.device)[None, :] <= pos[:, None]  # [n, Lmax]
        neg = torch.zeros(n, Lmax, dtype=self.dtype, device=self.device).masked_fill_(~valid, float("-inf"))
        neg = neg[:, None, None, :]  # [n, 1, 1, Lmax]
        rows = torch.arange(n, device=self.device)
        g = self.H // self.KV
        h = F.embedding(ids, self.embed)
        for li, L in enumerate(self.layers):
            q, k, v = self._qkv(L, h, cos, sin)
            kc, vc = self.kc[li], self.vc[li]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            K, V = kc[:n, :, :Lmax], vc[:n, :, :Lmax]  # [n, KV, Lmax, D] views
            s = torch.matmul(q.view(n, self.KV, g, self.D), K.transpose(-1, -2)).mul_(self.scaling).add_(neg)
            o = torch.matmul(torch.softmax(s, dim=-1), V)  # [n, KV, g, D]
            h = self._mlp(L, h, o.reshape(n, -1))
        return self._logits(h)

    # ------------------------------------------------------------------ the run

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], out_lens: list[int], on_token=None) -> tuple[list[list[int]], list[list[float]]]:
        """Greedy generation of ``out_lens[i]`` tokens for every prompt (EOS ignored).

        Returns the tokens and each token's time.perf_counter() stamp. ``on_token(n)`` is
        called with the number of tokens produced after each forward (a progress bar)."""
        n = len(prompts)
        max_len = max(len(p) + o for p, o in zip(prompts, out_lens))
        shape = (len(self.layers), n, self.KV, max_len, self.D)
        self.kc = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.vc = torch.zeros(shape, dtype=self.dtype, device=self.device)
        outs: list[list[int]] = [[] for _ in range(n)]
        stamps: list[list[float]] = [[] for _ in range(n)]
        # 1. Prefill every prompt alone, each in its own slot.
        for i, p in enumerate(prompts):
            logits = self.prefill(i, torch.tensor(p, device=self.device))
            outs[i].append(int(logits.argmax()))
            stamps[i].append(time.perf_counter())
            if on_token:
                on_token(1)
        # 2. Decode: slot j holds request live[j]; finished ones are swapped out of the live prefix.
        live = [i for i in range(n) if out_lens[i] > 1]
        for j, i in enumerate(live):  # compact: live request j into slot j
            if i != j:
                self.kc[:, j] = self.kc[:, i]
                self.vc[:, j] = self.vc[:, i]
        while live:
            ids = torch.tensor([outs[i][-1] for i in live], device=self.device)
            pos = torch.tensor([len(prompts[i]) + len(outs[i]) - 1 for i in live], device=self.device)
            Lmax = int(pos.max()) + 1
            toks = self.decode(ids, pos, Lmax).argmax(-1).tolist()
            now = time.perf_counter()
            for i, t in zip(live, toks):
                outs[i].append(t)
                stamps[i].append(now)
            if on_token:
                on_token(len(live))
            done = [j for j, i in enumerate(live) if len(outs[i]) >= out_lens[i]]
            for j in reversed(done):  # swap the last live sequence into the finished one's slot
                last = len(live) - 1
                if j != last:
                    upto = len(prompts[live[last]]) + len(outs[live[last]])
                    self.kc[:, j, :, :upto] = self.kc[:, last, :, :upto]
                    self.vc[:, j, :, :upto] = self.vc[:, last, :, :upto]
                    live[j] = live[last]
                live.pop()
        del self.kc, self.vc
        return outs, stamps
