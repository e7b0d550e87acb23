"""The request bodies of the OpenAI routes as pydantic models, and their translation into
``submit()`` arguments (:class:`~common.protocol.RequestOptions`). Parsing needs no app:
``CompletionRequest.parse(body)`` / ``ChatCompletionRequest.parse(body)`` take the decoded JSON.

A new field is one line in the model (with its validator when it has rules); a field whose
name is a request keyword (``REQUEST_KEYWORDS``) is passed to the queue as it is. Values are
checked for their type here (strict: ``"3"`` is not a number) and for their range by the
protocol's own validation (``build_request``), so the gateway and the worker never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from common.keys import LEVELS, priority_of
from common.protocol import ID_RE, REQUEST_KEYWORDS
from producer.gateway.errors import bad, from_validation

MAX_PROMPTS = 64  # prompts in one /v1/completions request (OpenAI's batch form)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
Number = StrictFloat | StrictInt
# Body fields passed to submit() under their own name; the input, id, max_tokens and priority have rules.
PASSED = frozenset(REQUEST_KEYWORDS) - {"prompt", "input_ids", "messages", "id", "max_tokens", "priority"}


class GenerationBody(BaseModel):
    """What both OpenAI routes share: model, streaming, sampling and tokenq's extensions."""

    model_config = ConfigDict(extra="allow")  # OpenAI clients send more (user, metadata...): ignored

    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # extension; -1 means none (vLLM)
    seed: StrictInt | None = None
    stop: StrictStr | list[Any] | None = None
    stop_token_ids: list[Any] | None = None  # extension
    ignore_eos: StrictBool | None = None  # extension
    timeout_s: Number | None = None  # extension
    cache_salt: StrictStr | None = None  # extension (vLLM's name): prefix-cache sharing only within one salt
    priority: StrictStr | StrictInt | None = None  # extension (or the X-Priority header)
    request_id: Any = None  # extension: the tokenq request id (``-<i>`` appended per prompt of a batch)
    n: StrictInt | None = None
    best_of: Any = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None  # extension (vLLM's)
    min_tokens: StrictInt | None = None  # extension (vLLM's)
    logit_bias: dict[str, Number] | None = None  # token id (as a JSON key) -> bias
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # extension (vLLM's, in the openai client's extra_body)

    chat: ClassVar[bool] = False
    # Fields tokenq does not support (yet): field -> (what is accepted, the message otherwise).
    # Supporting one means taking it out of here and giving it a meaning in ``options``.
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "best_of": (lambda v: v in (None, 1), "best_of must be 1"),
    }

    @classmethod
    def parse(cls, body: Any) -> GenerationBody:
        """The model of a decoded JSON body, or the APIError (400) of its first fault."""
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise from_validation(e) from None

    @field_validator("*")
    @classmethod
    def _supported(cls, v: Any, info: Any) -> Any:
        rule = cls.unsupported.get(info.field_name)
        if rule is not None and not rule[0](v):
            raise ValueError(rule[1])
        return v

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, str) or not ID_RE.match(v) or len(v) > 120):
            raise ValueError("request_id must be 1-120 characters of letters, digits and ._:- "
                             "(starting with a letter or digit)")
        return v

    # ------------------------------------------------------------ into submit() arguments

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def items(self) -> list[dict[str, Any]]:
        """One dict of submit() arguments per prompt (the input: prompt, input_ids or messages)."""
        raise NotImplementedError

    def default_max_tokens(self) -> int | None:
        return self.max_tokens

    def options(self, priority_header: str | None = None) -> dict[str, Any]:
        """The submit() arguments every prompt of this body shares."""
        kw: dict[str, Any] = {name: getattr(self, name) for name in type(self).model_fields
                              if name in PASSED and getattr(self, name) is not None}
        max_tokens = self.default_max_tokens()
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        if isinstance(kw.get("stop"), list) and not kw["stop"]:
            del kw["stop"]
        if kw.get("top_k") == -1:  # vLLM's "no top-k"
            kw["top_k"] = 0
        kw["priority"] = _priority(self.priority, priority_header)
        return kw

    def requests(self, priority_header: str | None = None) -> list[dict[str, Any]]:
        """Every request this body asks for, as submit() arguments (ids from ``request_id``)."""
        items = self.items()
        if self.request_id is not None:
            for i, it in enumerate(items):
                it["id"] = self.request_id if len(items) == 1 else f"{self.request_id}-{i}"
        kw = self.options(priority_header)
        return [{**it, **kw} for it in items]


class CompletionRequest(GenerationBody):
    """``POST /v1/completions``."""

    prompt: Any = None  # a string, strings, token ids, or arrays of token ids (see _prompts)
    echo: StrictBool | None = None
    suffix: Any = None
    logprobs: StrictInt | None = None  # top N per token (0-20); with echo, the prompt's too

    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **GenerationBody.unsupported,
        "suffix": (lambda v: v is None, "suffix is not supported"),
    }

    def items(self) -> list[dict[str, Any]]:
        return _prompts(self.prompt)

    def options(self, priority_header: str | None = None) -> dict[str, Any]:
        kw = super().options(priority_header)
        if self.echo and self.logprobs is not None:
            kw["prompt_logprobs"] = self.logprobs
        return kw

    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ChatCompletionRequest(GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: Any = None  # OpenAI's messages: content as a string or text parts (see _messages)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: Any = None
    functions: Any = None

    chat: ClassVar[bool] = True
    unsupported: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **GenerationBody.unsupported,
        "tools": (lambda v: not v, "tools and function calling are not supported"),
        "functions": (lambda v: not v, "tools and function calling are not supported"),
    }

    def items(self) -> list[dict[str, Any]]:
        return [{"messages": _messages(self.messages)}]

    def options(self, priority_header: str | None = None) -> dict[str, Any]:
        kw = super().options(priority_header)  # (logprobs here is OpenAI's flag, top_logprobs the count)
        kw.pop("logprobs", None)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return kw

    def default_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


def _priority(raw: str | int | None, header: str | None) -> str:
    if raw is None and header is not None:
        raw = int(header) if header.strip().lstrip("-").isdigit() else header.strip().lower()
    if raw is None:
        return "normal"
    try:
        return LEVELS[priority_of(raw)]
    except ValueError:
        raise bad(f"priority must be one of {', '.join(LEVELS)} (or 0-{len(LEVELS) - 1}), got {raw!r}",
                  "priority") from None


def _prompts(p: Any) -> list[dict[str, Any]]:
    """The /v1/completions prompt in any of OpenAI's forms, as submit() arguments."""
    if p is None:
        raise bad("prompt is required", "prompt")
    if isinstance(p, str):
        return [{"prompt": p}]
    if not isinstance(p, list) or not p:
        raise bad("prompt must be a non-empty string or array", "prompt")
    if all(isinstance(x, str) for x in p):
        out = [{"prompt": x} for x in p]
    elif all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        out = [{"input_ids": p}]
    elif all(isinstance(x, list) for x in p):
        out = [{"input_ids": x} for x in p]
    else:
        raise bad("prompt must be a string, an array of strings, an array of token ids, "
                  "or an array of token-id arrays", "prompt")
    if len(out) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", "prompt")
    return out


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content must be a string or an array of text parts", "messages")
    parts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise bad(f"messages[{i}].content[{j}]: only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


def _messages(msgs: Any) -> list[dict[str, str]]:
    """OpenAI chat messages as the protocol's ``{role, content}`` (text only)."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        if m.get("tool_calls") or m.get("function_call"):
            raise bad(f"messages[{i}]: tool calls are not supported", "messages")
        content = _content(i, m.get("content"))
        if not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}].role must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return out
