"""The model's own attention outside engine steps.

``Engine(model)`` switches the model to ``tokenq_paged``. The registered function is paged
attention only inside an engine step (the ``tokenq`` keyword argument carries the step's
layout); anywhere else (the user's ``model.generate(...)``, a plain forward) it hands the
call to the implementation the model had before, and the registered mask function builds
that implementation's masks. The same model object serves both.
"""

from __future__ import annotations

import contextvars
import sys
import weakref

import torch

NAME = "tokenq_paged"

# config id -> (weak reference to the config, the implementation it had before tokenq's)
_previous: dict[int, tuple[weakref.ref, str]] = {}
# True while a model runs an engine step: its masks are then the engine's (none built)
_in_step = contextvars.ContextVar("tokenq_in_step", default=False)


def _configs(model: torch.nn.Module):
    """The model's config and every config its submodules carry (sub-configs included)."""
    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen[id(cfg)] = cfg
    return list(seen.values())


def previous(config, default: str | None = "sdpa") -> str | None:
    entry = _previous.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    return default


def adopt(model: torch.nn.Module) -> None:
    """Switch ``model`` to tokenq's attention, remembering what each of its configs used."""
    for cfg in _configs(model):
        impl = cfg._attn_implementation
        if impl != NAME:
            _previous[id(cfg)] = (weakref.ref(cfg), impl or "sdpa")
        elif previous(cfg, None) is None:  # loaded straight into tokenq's: transformers' default stands in
            _previous[id(cfg)] = (weakref.ref(cfg), "sdpa" if getattr(model, "_supports_sdpa", True) else "eager")
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    if not getattr(model, "_tokenq_hooked", False):
        model.register_forward_pre_hook(_enter, with_kwargs=True)
        model.register_forward_hook(_leave, with_kwargs=True, always_call=True)
        model._tokenq_hooked = True


def _enter(module, args, kwargs):
    if kwargs.get("tokenq") is not None:
        module._tokenq_token = _in_step.set(True)


def _leave(module, args, kwargs, output):
    token = module.__dict__.pop("_tokenq_token", None)
    if token is not None:
        _in_step.reset(token)


def attention(module: torch.nn.Module):
    """The attention function ``module`` used before tokenq's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = getattr(module, "config", None)
    impl = previous(cfg) if cfg is not None else "sdpa"
    if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS and impl != NAME:
        return ALL_ATTENTION_FUNCTIONS[impl]
    # eager: the modeling file's own function (softcap, sinks and the like are in there)
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return own


def mask(*args, config=None, **kwargs):
    """The mask the previous implementation would get; none inside an engine step."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if _in_step.get():
        return None
    impl = previous(config) if config is not None else "sdpa"
    fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(impl) if impl != NAME else None
    if fn is None:  # an implementation without a mask function of its own needs no mask
        return None
    return fn(*args, config=config, **kwargs)
