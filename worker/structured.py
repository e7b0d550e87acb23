"""Structured output with xgrammar: grammars compiled off the step loop, token masks per step.

A request's ``structured_outputs`` (common/outputs.py) is compiled on a small thread pool and
cached by its spec, so one slow schema never stalls the batch: the engine keeps the request
out of the scheduler until its grammar is ready. Each sequence then owns a GrammarMatcher that
has accepted exactly its output tokens; it lives on the Sequence, so preemption (recompute or
swap) leaves it as it is, and a request resumed after a crash rebuilds it from the tokens
already published. Masks are xgrammar's CPU token bitmasks, unpacked for the batch at once.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

CACHE_SIZE = 256  # compiled grammars kept (xgrammar's own cache sits under this one)


class Grammars:
    """Compiles structured_outputs specs into xgrammar CompiledGrammars on a thread pool."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int], threads: int = 2):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenq-grammar")
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()

    def submit(self, spec: dict[str, Any]) -> Future:
        key = json.dumps(spec, sort_keys=True)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None and not isinstance(fut.exception(), ValueError)):
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return fut

    def _compiler_once(self):
        with self._lock:  # the tokenizer info is built once, by the first compile
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, spec: dict[str, Any]):
        c = self._compiler_once()
        strict = spec.get("disable_any_whitespace", True)
        try:
            if "json" in spec:
                return c.compile_json_schema(json.dumps(spec["json"]), any_whitespace=not strict)
            if "json_object" in spec:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=not strict)
            if "regex" in spec:
                return c.compile_regex(spec["regex"])
            if "choice" in spec:
                return c.compile_regex("|".join(re.escape(s) for s in spec["choice"]))
            return c.compile_grammar(spec["grammar"])
        except RuntimeError as e:  # xgrammar's parse errors: "[time] file.cc:83: what went wrong"
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            kind = next(iter(spec))
            raise ValueError(f"structured_outputs.{kind} is invalid: {why[:300]}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class GrammarState:
    """One sequence's grammar: the compile future, then its matcher."""

    future: Future
    matcher: Any = None
    terminated: bool = False

    def start(self, output_ids: list[int]) -> None:
        """Build the matcher once compiled, replaying tokens already produced (a resumed request)."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.future.result())
        for t in output_ids:
            self.accept(t)

    def accept(self, token: int) -> None:
        if self.terminated:
            return
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not fit the grammar")
        self.terminated = self.matcher.is_terminated()


def apply_masks(logits: torch.Tensor, seqs) -> None:
    """Tokens the grammar does not allow next go to -inf, for every grammar row at once."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.grammar.terminated]
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bm = xgr.allocate_token_bitmask(len(rows), vocab)
    for r, i in enumerate(rows):
        seqs[i].grammar.matcher.fill_next_token_bitmask(bm, r)
    # bit j of word w allows token 32 * w + j
    bits = (bm[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), -1)[:, :vocab].bool().to(logits.device)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def has_grammar(seqs) -> bool:
    return any(s.grammar is not None and not s.grammar.terminated for s in seqs)
