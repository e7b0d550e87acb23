"""tokenq's logprobs (common/outputs.py wire form) in OpenAI's response shapes.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (with ``echo``,
the prompt's tokens first; the very first has no logprob). Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}``. A token without text (a worker without a
tokenizer) is named ``token_id:N``, as vLLM does.
"""

from __future__ import annotations

from typing import Any


def _text(e: dict[str, Any]) -> str:
    return e["token"] if "token" in e else f"token_id:{e['id']}"


def completion(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """A completions ``logprobs`` object for ``entries``; text offsets start at ``offset``."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        t = _text(e)
        tokens.append(t)
        lps.append(e.get("logprob"))
        tops.append({_text(x): x["logprob"] for x in e["top"]} if e.get("logprob") is not None else None)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def merge_completion(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects one after the other (prompt, then output)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat ``logprobs`` object: one content item per token, its top alternatives inside."""
    def item(e: dict[str, Any]) -> dict[str, Any]:
        t = _text(e)
        return {"token": t, "logprob": e["logprob"], "bytes": list(t.encode("utf-8"))}

    return {"content": [{**item(e), "top_logprobs": [item(x) for x in e["top"]]} for e in entries], "refusal": None}
