"""Loading models (the bundled ones, local directories, hub ids) and the checks that a
model's family can be served exactly by paged attention on a packed row.
"""

from __future__ import annotations

import logging
import os

import torch

from worker.bundled import BUNDLED, bundled_dir, cache_dir, smollm2_dir  # noqa: F401 - (re-exported)
from worker.fastpath import cpu_has_native_bf16

log = logging.getLogger("tokenq.models")

# Families (transformers modeling modules, found from the class a model resolves to, so
# exaone and internlm3 count as llama) whose parity with generate tests/test_families.py
# checks. Others are served when the start-up probe (worker/probe.py) passes.
TESTED_FAMILIES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi", "phi3", "olmo", "olmo2", "olmo3",
    "granite", "granitemoe", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt", "cohere", "cohere2", "starcoder2",
    "qwen3_moe", "mixtral", "qwen2_moe", "glm", "glm4", "smollm3", "exaone4", "helium", "gpt_oss", "granite_swa",
    "granitemoe_swa",
)
# Families that must not run on the packed row, and why (the probe catches most of them too).
_BYPASS = "its attention does not go through transformers' attention interface (it would attend across the packed row)"
_RECURRENT = "it has recurrent/linear-attention layers that would scan the packed row as one sequence"
REFUSED_FAMILIES = {
    "falcon": "falcon's attention bypasses transformers' attention interface up to transformers 5.24, and its "
              "parity with generate through tokenq is not tested on later versions",
    "bloom": _BYPASS, "mpt": _BYPASS, "gpt_neo": _BYPASS,
    "deepseek_v2": "multi-head latent attention: K and V head sizes differ",
    "deepseek_v3": "multi-head latent attention: K and V head sizes differ",
    "gemma4": "head sizes vary per layer",
    "llama4": "its chunked attention exists only in the mask",
    "qwen3_next": _RECURRENT, "jamba": _RECURRENT, "falcon_h1": _RECURRENT, "bamba": _RECURRENT,
    "granitemoehybrid": _RECURRENT, "zamba": _RECURRENT, "zamba2": _RECURRENT, "lfm2": _RECURRENT,
    "nemotron_h": _RECURRENT, "minimax": _RECURRENT, "mamba": _RECURRENT, "mamba2": _RECURRENT,
    "falcon_mamba": _RECURRENT, "recurrent_gemma": _RECURRENT, "rwkv": _RECURRENT, "xlstm": _RECURRENT,
    "plamo2": _RECURRENT,
}
# Layer types the engine attends like the model does; anything else (linear attention, mamba,
# chunked attention, ...) is refused.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE variants whose frequencies do not depend on the positions in the batch.
STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")

DEFAULT_MODEL = "smollm2"


class UnsupportedModelError(ValueError):
    pass


def family(model_or_class) -> str:
    """The transformers modeling module a model (or model class) comes from: ``llama`` for
    ``transformers.models.llama.modeling_llama.LlamaForCausalLM``, whatever its model_type."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else cls.__module__


def model_class(config):
    """The causal-LM class transformers builds for ``config`` (None if it has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def _rope_entries(config) -> list[dict]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())  # one per layer type
    return [rope]


def _rope_type(r: dict) -> str:
    return r.get("rope_type") or r.get("type") or "default"


def max_exact_len(config) -> int:
    """The longest sequence the engine serves exactly as generate alone does: transformers'
    ``dynamic`` RoPE equals the default up to max_position_embeddings (the engine's cap
    anyway) and ``longrope`` uses its short factors up to original_max_position_embeddings;
    past those, their frequencies would follow the longest sequence packed in the step."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2**31
    for r in _rope_entries(config):
        if _rope_type(r) == "longrope":
            limit = min(limit, r.get("original_max_position_embeddings") or limit)
    return limit


def refusal(config, model=None) -> str | None:
    """Why the engine cannot serve this model exactly (None: nothing known against it).
    ``model`` (or the class ``config`` resolves to) names the family."""
    cls = model if model is not None else model_class(config)
    why = REFUSED_FAMILIES.get(family(cls) if cls is not None else getattr(config, "model_type", None))
    if why is None and (not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False)):
        why = "its attention is bidirectional"
    if why is None and getattr(config, "attention_chunk_size", None):
        why = "its chunked attention exists only in the mask"
    bad = next((t for t in getattr(config, "layer_types", None) or () if t not in ATTENTION_LAYER_TYPES), None)
    if why is None and bad is not None:
        why = f"it has {bad!r} layers (only {' and '.join(ATTENTION_LAYER_TYPES)} are served)"
    unknown = next((_rope_type(r) for r in _rope_entries(config) if _rope_type(r) not in STATIC_ROPE + ("dynamic", "longrope")), None)
    if why is None and unknown is not None:
        why = f"its RoPE type {unknown!r} is unknown to tokenq"
    return why


def check_supported(config, model=None) -> None:
    """Refuse, before anything runs, what is known not to work; the probe checks the rest at start."""
    why = refusal(config, model)
    if why is not None:
        cls = model if model is not None else model_class(config)
        fam = family(cls) if cls is not None else getattr(config, "model_type", None)
        raise UnsupportedModelError(f"model family {fam!r} is not supported by tokenq's paged attention: {why}")


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16 (cpu_has_native_bf16), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("auto", "", None):
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def resolve_device(device: str) -> torch.device:
    if device in ("auto", "", None):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str | torch.dtype = "auto"):
    """(model, tokenizer) ready for the engine: eval mode, on ``device``, paged attention selected
    (outside engine steps the model attends as transformers' default does).

    The tokenizer is None for a local directory that has none (then only input_ids work)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from worker import attention, fallback

    path = str(bundled_dir(name)) if name in BUNDLED else name
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.path.isdir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=offline)
    check_supported(config)
    # loaded with transformers' default attention, which the model keeps outside engine steps
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=offline)
    model.to(dev).eval()
    attention.register()
    fallback.adopt(model)
    tokenizer = None
    if not os.path.isdir(path) or any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
    else:  # weights without a tokenizer: the worker serves input_ids only
        log.warning("no tokenizer in %s: requests must send input_ids", path)
    return model, tokenizer
