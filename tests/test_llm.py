"""The offline API over the same scheduler: ids, text, finish reasons, stop strings."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from tests.model_fixtures import default_folder, hf_reference

pytestmark = pytest.mark.slow  # the default model


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", kv_slots=4096)


def test_greedy_matches_transformers_and_reports_length(llm):
    prompt = "The capital of France is"
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf_reference(default_folder()).generate(
            torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.token_ids == ref[0, len(ids):].tolist()
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.finish_reason == "length"


def test_stop_string_ends_the_request(llm):
    prompt = "Count: 1, 2, 3,"
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [free] = llm.generate([prompt], params)
    stop = free.text[4:7]
    [cut] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                  stop_strs=[stop]))
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 30


def test_batch_of_id_prompts_in_order(llm):
    prompts = [llm.tokenizer.encode(p) for p in ("Hello", "One two three", "Paris is")]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    singles = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == [s.token_ids for s in singles]
    assert all(len(o.logprobs) == 4 and o.logprobs[0].top_ids for o in outs)


def test_engine_failure_is_reported_on_its_prompt_only(llm, monkeypatch):
    ok, bad = llm.tokenizer.encode("Hello"), llm.tokenizer.encode("Paris is")
    model = llm.scheduler.engine.model

    def faulty(batch, ctx):
        if any(r.prompt_ids == bad for r in batch.reqs):
            raise RuntimeError("boom")
        return model(batch, ctx)

    monkeypatch.setattr(llm.scheduler.engine, "model", faulty)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    good, failed = llm.generate([ok, bad], params)
    assert failed.finish_reason == "error" and "boom" in failed.error and failed.token_ids == []
    assert good.finish_reason == "length" and good.error is None and len(good.token_ids) == 4
