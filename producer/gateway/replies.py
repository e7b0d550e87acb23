"""The OpenAI response objects: completion and chat completion, whole or as stream chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from producer.aio import AsyncHandle
from producer.types import Result


@dataclass
class Reply:
    """What one OpenAI request became: its handles and what every response object of it carries."""

    chat: bool
    model: str
    handles: list[AsyncHandle]
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

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
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                        "logprobs": None, "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        else:
            choices = [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
                       for i, r in enumerate(results)]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage}

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        """One streamed chunk (``usage`` only when the client asked for it)."""
        d = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": choices}
        if self.include_usage:
            d["usage"] = usage
        return d

    def delta(self, i: int, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        """The choice of one streamed chunk."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
