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
    return _ready(AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype))


def _ready(model):
    # Random init gives near-uniform logits; sharpen them so greedy argmax has clear winners.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
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


# ---------------------------------------------------------------------------- every family

_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, tie_word_embeddings=False)
_GPT2_LIKE = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=2048, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
_SLIDING = dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# model_type -> (config overrides on top of its base, the base). Settings that bite: sliding
# windows of 12 (prompts and decodes cross them), soft-capping at 5, partial rotary, layers
# without RoPE, MoE with 4 experts and top-2 routing.
FAMILY_CONFIGS: dict[str, dict] = {
    "gemma": dict(),
    "gemma2": dict(**_SLIDING, attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16),
    "gemma3_text": dict(**_SLIDING, query_pre_attn_scalar=16),
    "phi": dict(partial_rotary_factor=0.5, num_key_value_heads=4),
    "phi3": dict(sliding_window=12),
    "olmo": dict(),
    "olmo2": dict(),
    "olmo3": dict(**_SLIDING),
    "granite": dict(embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=0.5),
    "granitemoe": dict(**_MOE, embedding_multiplier=2.0, attention_multiplier=0.2),
    "gpt2": dict(),
    "gpt_bigcode": dict(multi_query=True),
    "gpt_neox": dict(rotary_pct=0.25, num_key_value_heads=4),
    "gptj": dict(rotary_dim=8),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, num_key_value_heads=4),
    "cohere": dict(),
    "cohere2": dict(**_SLIDING),
    "starcoder2": dict(sliding_window=12, use_bias=True),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(**_MOE, sliding_window=12),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "glm": dict(partial_rotary_factor=0.5),
    "glm4": dict(partial_rotary_factor=0.5),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "exaone4": dict(**_SLIDING),
    "helium": dict(),
    "gpt_oss": dict(**_SLIDING, **_MOE, num_key_value_heads=2),
    "granite_swa": dict(**_SLIDING),
    "granitemoe_swa": dict(**_SLIDING, **_MOE),
    "exaone": dict(),  # loads as LlamaForCausalLM
    "internlm3": dict(),  # loads as LlamaForCausalLM
}
_GPT2_BASE = ("gpt2", "gpt_bigcode", "gptj")


def family_config(model_type: str, **overrides):
    from transformers import AutoConfig

    base = _GPT2_LIKE if model_type in _GPT2_BASE else _LLAMA_LIKE
    kw = {**base, **FAMILY_CONFIGS.get(model_type, {}), **overrides}
    cfg = AutoConfig.for_model(model_type, **kw)
    return cfg


def family_model(model_type: str, dtype=torch.float64, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    # MoE experts: the eager loop (transformers' grouped_mm kernel takes no float64)
    return _ready(AutoModelForCausalLM.from_config(family_config(model_type, **overrides), dtype=dtype,
                                                   experts_implementation="eager"))


def save_family(path, model_type: str, dtype=torch.float32, seed: int = 0, **overrides) -> str:
    """A tiny model of any family in FAMILY_CONFIGS + tokenizer, as a local directory."""
    model = family_model(model_type, dtype=dtype, seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


# Further model types that call the attention interface like Llama, on _LLAMA_LIKE as it is
# ("@mha": the family has no grouped K/V, so no num_key_value_heads either). stablelm's and
# nemotron's decoder layers drop the keyword arguments; ernie4_5_moe, exaone_moe, glm4_moe,
# solar_open, laguna, kolibri1, hy_v3 route their experts in float32 even in a float64 model.
OTHER_FAMILIES = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "bitnet", "cohere2_moe", "cwm", "doge",
    "ernie4_5", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "fuyu", "glm4_moe", "granitemoeshared",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "iquestcoder", "jais2", "kolibri1", "laguna", "mellum",
    "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "nanochat", "nemotron", "olmoe", "phimoe",
    "seed_oss", "solar_open", "stablelm", "vaultgemma", "biogpt@mha", "ctrl@mha", "persimmon@mha",
    "modernbert-decoder@mha",
)


def other_family_model(name: str, dtype=torch.float64, seed: int = 0):
    model_type, _, variant = name.partition("@")
    kw = dict(_LLAMA_LIKE, num_key_value_heads=_LLAMA_LIKE["num_attention_heads"]) if variant == "mha" else _LLAMA_LIKE
    from transformers import AutoConfig

    torch.manual_seed(seed)
    return _ready(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=dtype,
                                                   experts_implementation="eager"))
