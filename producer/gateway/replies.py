"""The OpenAI response objects: completion and chat completion, whole or as stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from producer.aio import AsyncHandle
from producer.gateway import logprobs as openai_logprobs
from producer.types import Choice, Chunk, Result


@dataclass
class Reply:
    """What one OpenAI request became: its handles and what every response object of it carries."""

    chat: bool
    model: str
    handles: list[AsyncHandle]
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1  # choices per prompt: choice j of prompt i is OpenAI's choice i * n + j
    logprobs: bool = False  # the client asked for logprobs
    echo: list[str] | None = None  # completions with echo: each prompt's text
    _streamed: dict[int, int] = field(default_factory=dict)  # streamed choice -> characters sent so far
    _ended: set[int] = field(default_factory=set)  # streamed choices whose finish_reason went out

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.handles[0].id

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": ",".join(h.id for h in self.handles)}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def whole(self, results: list[Result], usage: dict[str, int]) -> dict[str, Any]:
        """The non-streaming response body."""
        choices = [self._choice(i, r, c) for i, r in enumerate(results) for c in _choices(r)]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage}

    def _choice(self, i: int, r: Result, c: Choice) -> dict[str, Any]:
        index = i * self.n + c.index
        if self.chat:
            lp = openai_logprobs.chat(c.logprobs or []) if self.logprobs else None
            return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        echo = self.echo[i] if self.echo else ""
        lp = None
        if self.logprobs:
            head = openai_logprobs.completion(r.prompt_logprobs) if self.echo and r.prompt_logprobs else None
            lp = openai_logprobs.merge_completion(head, openai_logprobs.completion(c.logprobs or [], len(echo)))
        return {"index": index, "text": echo + c.text, "logprobs": lp, "finish_reason": c.finish_reason}

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        """One streamed chunk (``usage`` only when the client asked for it)."""
        d = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            d["usage"] = usage
        return d

    def streamed(self, i: int, c: Chunk) -> dict[str, Any] | None:
        """The streamed choice of chunk ``c`` of prompt ``i`` (None when it carries nothing)."""
        index = i * self.n + c.index
        text = c.text
        lps = c.logprobs
        if self.echo and index not in self._streamed:  # the prompt comes first
            text = self.echo[i] + text
        if not self.chat and self.echo and c.prompt_logprobs:
            lps = c.prompt_logprobs + (lps or [])
        finish = c.finish_reason if self.n > 1 else None
        if finish:
            self._ended.add(index)
        if not text and not finish and not (self.logprobs and lps):
            return None
        offset = self._streamed.get(index, 0)
        self._streamed[index] = offset + len(text)
        lp = None
        if self.logprobs:
            lp = openai_logprobs.chat(lps or []) if self.chat else openai_logprobs.completion(lps or [], offset)
        return self.delta(index, text, finish, logprobs=lp)

    def ends(self, i: int, r: Result) -> list[dict[str, Any]]:
        """The final streamed choices of prompt ``i``: those whose end did not go out yet."""
        out = []
        for c in _choices(r):
            index = i * self.n + c.index
            if index not in self._ended:
                self._ended.add(index)
                out.append(self.delta(index, None if self.chat else "", c.finish_reason))
        return out

    def delta(self, i: int, text: str | None, finish: str | None, role: bool = False, logprobs: Any = None) -> dict[str, Any]:
        """The choice of one streamed chunk."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


def _choices(r: Result) -> list[Choice]:
    return r.choices or [Choice(0, r.text, r.token_ids, r.finish_reason, r.logprobs)]
