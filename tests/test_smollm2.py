"""The real default model (SmolLM2-135M-Instruct) in float32: the engine's greedy output equals
transformers' generate on each prompt alone, with chunked prefill and requests joining late."""

from __future__ import annotations

import copy

import pytest
from engine_helpers import drive, make_engine

from common.protocol import SamplingParams

pytestmark = pytest.mark.smollm


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    import torch

    from worker import attention
    from worker.models import load

    model, tokenizer = load(smollm2_dir, device="cpu", dtype="float32")
    assert model.config._attn_implementation == attention.NAME and model.dtype == torch.float32
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    return model, ref, tokenizer


def _generate(ref, prompt, max_tokens, eos: bool):
    import torch

    ids = torch.tensor([prompt])
    kw = {} if eos else {"eos_token_id": None}
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                       pad_token_id=ref.generation_config.pad_token_id or 0, **kw)
    return out[0, len(prompt):].tolist()


def test_smollm2_greedy_parity(smollm2):
    model, ref, tok = smollm2
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    if not isinstance(chat, list):
        chat = chat["input_ids"]
    prompts = [
        tok.encode("The quick brown fox"),
        list(chat),
        tok.encode("def fibonacci(n):\n    "),
        tok.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who"),
    ]
    max_tokens = [10, 24, 8, 12]
    engine = make_engine(model, tok, page_size=16, num_pages=64, max_num_seqs=2, max_num_batched_tokens=16)
    arrivals = {0: [("p0", prompts[0], SamplingParams(max_tokens=max_tokens[0], temperature=0, ignore_eos=True)),
                    ("chat", prompts[1], SamplingParams(max_tokens=max_tokens[1], temperature=0))],
                2: [("p2", prompts[2], SamplingParams(max_tokens=max_tokens[2], temperature=0, ignore_eos=True)),
                    ("p3", prompts[3], SamplingParams(max_tokens=max_tokens[3], temperature=0, ignore_eos=True))]}
    run = drive(engine, arrivals)
    for rid, p, m in zip(["p0", "chat", "p2", "p3"], prompts, max_tokens):
        expected = _generate(ref, p, m, eos=rid == "chat")
        assert run.tokens(rid) == expected, (rid, tok.decode(run.tokens(rid)), tok.decode(expected))
        assert run.text(rid) == tok.decode(expected, skip_special_tokens=True)
    assert any(start > 0 and n > 1 for s in run.steps for _, start, n, _ in s.scheduled)  # chunked prefill happened
    # the instruct model answers and stops with its EOS token, like generate
    chat_ids = run.tokens("chat")
    assert run.reason("chat") == "stop" and chat_ids[-1] in engine.eos_token_ids and len(chat_ids) < max_tokens[1]
    assert "Paris" in run.text("chat")
