"""The model's own attention outside engine steps.

``Engine(model)`` switches the model to ``tokenq_paged``. The registered function is paged
attention only inside an engine step (the ``tokenq`` keyword argument carries the step's
layout); anywhere else (the user's ``model.generate(...)``, a plain forward) it hands the
call to the implementation the model had before, and the registered mask function builds
that implementation's masks. The same model object serves both.

Which implementation that was is kept on the model (so a deep copy keeps it too); a hook
around the model's forward makes it, and whether this forward is an engine step, known to
the attention and mask functions, which see only a layer or the config.
"""

from __future__ import annotations

import contextvars
import sys
import threading

import torch

NAME = "tokenq_paged"
# When no hooked model's forward is running (a submodule called on its own): the modeling
# file's own eager attention, exact for every family (soft-capping, sinks and all).
UNKNOWN = "eager"

# (the engine step's StepMeta or None, the implementation outside steps) for the forward now running
_context: contextvars.ContextVar[tuple[object, str] | None] = contextvars.ContextVar("tokenq_context", default=None)
_tokens = threading.local()  # each thread's stack of _context tokens (forwards nest, threads interleave)


def adopt(model: torch.nn.Module) -> None:
    """Switch ``model`` to tokenq's attention, remembering the implementation it had."""
    impl = model.config._attn_implementation
    if impl != NAME:
        model._tokenq_previous = impl or "sdpa"
    elif not hasattr(model, "_tokenq_previous"):  # loaded straight into tokenq's: transformers' default stands in
        model._tokenq_previous = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
    if impl != NAME:
        model.set_attn_implementation(NAME)
    if not getattr(model, "_tokenq_hooked", False):
        model.register_forward_pre_hook(_enter, with_kwargs=True)
        model.register_forward_hook(_leave, with_kwargs=True, always_call=True)
        model._tokenq_hooked = True


def _enter(module, args, kwargs):
    ctx = (kwargs.get("tokenq"), getattr(module, "_tokenq_previous", UNKNOWN))
    _tokens.__dict__.setdefault("stack", []).append(_context.set(ctx))


def _leave(module, args, kwargs, output):
    stack = _tokens.__dict__.get("stack")
    if stack:
        _context.reset(stack.pop())


def _previous() -> str:
    ctx = _context.get()
    return UNKNOWN if ctx is None else ctx[1]


def step_meta():
    """The StepMeta of the engine step now running, for layers whose callers drop the keyword
    arguments on the way down (stablelm's and nemotron's decoder layers); None outside steps."""
    ctx = _context.get()
    return None if ctx is None else ctx[0]


def attention(module: torch.nn.Module):
    """The attention function ``module`` used before tokenq's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = _previous()
    if impl not in ("eager", NAME) and impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:  # a modeling file without one: transformers' SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return own


def mask(*args, **kwargs):
    """The mask the previous implementation would get; none inside an engine step."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    ctx = _context.get()
    if ctx is not None and ctx[0] is not None:
        return None
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(_previous())
    if fn is None or fn is mask:  # an implementation without a mask function of its own needs none
        return None
    return fn(*args, **kwargs)
