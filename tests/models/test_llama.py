"""Our forward against transformers on the same weights (an independent implementation)."""

from __future__ import annotations

import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.scheduler.factory import build_scheduler
from freetoken.message import UserMsg
from freetoken.models.registry import load_model
from tests.model_fixtures import default_model, hf_reference, tiny_random_folder

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           # 54 tokens: decoding crosses 64 keys, where a request's padded key block grows
           # (engine.DECODE_KV_BLOCK).
           "Count with me: " + ", ".join(str(n) for n in range(1, 17))]


def _decode_with_engine(loaded, prompts, steps):
    scheduler = build_scheduler(loaded, kv_slots=2048)
    for uid, prompt in enumerate(prompts):
        ids = loaded.tokenizer.encode(prompt)
        params = SamplingParams(temperature=0, max_tokens=steps, logprobs=5, ignore_eos=True)
        scheduler.add(UserMsg(uid, ids, params))
    out = {uid: [] for uid in range(len(prompts))}
    while scheduler.has_work:
        for msg in scheduler.step():
            out[msg.uid] += list(zip(msg.token_ids, msg.logprobs))
    return out


def _check_against_hf(loaded, steps=16, prompts=PROMPTS):
    hf = hf_reference(loaded.folder)
    ours = _decode_with_engine(loaded, prompts, steps)
    for uid, prompt in enumerate(prompts):
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        ref_tokens = ref.sequences[0, len(ids):].tolist()
        assert [t for t, _ in ours[uid]] == ref_tokens
        for step, (token, lp) in enumerate(ours[uid]):
            ref_lp = torch.log_softmax(ref.logits[step][0].float(), -1)
            assert abs(ref_lp[token].item() - lp.logprob) <= 1e-4
            top = torch.tensor(lp.top_logprobs)
            assert torch.allclose(ref_lp[torch.tensor(lp.top_ids)], top, atol=1e-4)


@pytest.mark.slow
def test_default_model_matches_transformers():
    _check_against_hf(default_model())


def test_tiny_random_qwen3_matches_transformers():
    loaded = load_model(tiny_random_folder("qwen3"), dtype="float32", device="cpu")
    assert loaded.model.cfg.qk_norm and not loaded.model.cfg.tie_word_embeddings
    _check_against_hf(loaded)


def test_tiny_random_qwen2_matches_transformers():
    loaded = load_model(tiny_random_folder("qwen2"), dtype="float32", device="cpu")
    assert loaded.model.cfg.attention_bias and not loaded.model.cfg.qk_norm
    _check_against_hf(loaded)
