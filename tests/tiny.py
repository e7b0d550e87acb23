"""Tiny randomly initialised transformer models built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 512


def tiny_config(family: str = "llama", **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "qwen3":
        # mixed full / sliding-window layers, q/k norms
        cfg = Qwen3Config(**{**common, "num_hidden_layers": 3}, head_dim=16, use_sliding_window=True, sliding_window=24,
                          layer_types=["full_attention", "sliding_attention", "full_attention"])
    elif family == "mistral":
        cfg = MistralConfig(**common, sliding_window=32)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str = "llama", dtype=torch.float64, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    # Random init gives near-uniform logits; sharpen them so greedy argmax has clear winners.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = (
    "Once upon a time there was a little queue. It held requests of every priority, high and low, "
    "and a worker took tokens from it one step at a time. The quick brown fox jumps over the lazy dog. "
    "Paged attention keeps keys and values in pages; continuous batching mixes prefill and decode. "
    "0123456789 !?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~` caf\u00e9 na\u00efve \u00fcber \u4f60\u597d \U0001f600"
)


def tiny_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE tokenizer trained here on a few sentences: ids < vocab_size, any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(path, family: str = "llama", dtype=torch.float32, seed: int = 0, **overrides) -> str:
    """A tiny model + tokenizer as a local transformers directory (what ``--model`` takes)."""
    model = tiny_model(family, dtype=dtype, seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)
