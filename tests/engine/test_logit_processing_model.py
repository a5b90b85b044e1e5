"""Logit processors through the scheduler on the tiny random Qwen3: 12-token greedy runs equal a
step-by-step loop over transformers' logits with the rule applied in plain torch."""

from __future__ import annotations

import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.message import UserMsg
from freetoken.models.registry import load_model
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import hf_reference, tiny_random_folder
from tests.support.logit_rules import reference

TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(tiny_random_folder("qwen3")), dtype="float32", device="cpu")


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, **fields)


_reference_runs: dict[str, list[int]] = {}


def _reference_run(prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    key = repr((prompt, params, eos))  # several cases share their run without the processor
    if key not in _reference_runs:
        _reference_runs[key] = _reference_loop(prompt, params, eos)
    return _reference_runs[key]


def _reference_loop(prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    model = hf_reference(tiny_random_folder("qwen3"))
    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        token = int(reference(logits, params, prompt, output, eos).argmax())
        output.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            break
    return output


def _engine_run(loaded, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    scheduler = build_scheduler(loaded, kv_slots=1024, prefix_cache=False)
    for uid, (prompt, params) in enumerate(requests):
        assert scheduler.add(UserMsg(uid, prompt, params)) == []
    out: list[list[int]] = [[] for _ in requests]
    while scheduler.has_work:
        for msg in scheduler.step():
            out[msg.uid] += msg.token_ids
    return out


def _cases(plain: list[int], eos: int) -> dict[str, tuple[dict, dict]]:
    """name -> (fields of the run without the processor, the processor's fields), chosen from
    the plain run's tokens so that each processor changes the output (the random model never
    repeats a token by itself, hence the penalties that favour repeats)."""
    return {
        "repetition_penalty": ({}, dict(repetition_penalty=0.7)),
        "frequency_penalty": ({}, dict(frequency_penalty=-0.2)),
        "presence_penalty": ({}, dict(presence_penalty=-0.5)),
        "logit_bias": ({}, dict(logit_bias={plain[0]: -1.0, plain[4]: 0.05})),
        "min_tokens_stop_ids": (dict(stop_token_ids=[plain[0], plain[3]]), dict(min_tokens=5)),
        "min_tokens_eos": (dict(logit_bias={eos: 5.0}), dict(min_tokens=5)),
        "bad_words": ({}, dict(bad_words_token_ids=[[plain[2], plain[3]], [plain[7]]])),
        "all": (dict(stop_token_ids=[plain[6]]),
                dict(repetition_penalty=1.3, frequency_penalty=-0.3, presence_penalty=0.1,
                     logit_bias={plain[1]: 0.02}, min_tokens=3,
                     bad_words_token_ids=[[plain[0], plain[1]], [plain[8]]])),
    }


@pytest.fixture(scope="module")
def cases(tiny) -> tuple[list[int], dict[str, tuple[SamplingParams, SamplingParams]]]:
    """The prompt, and name -> (params without the processor, params with it)."""
    prompt = tiny.tokenizer.encode(TEXT)
    eos = tiny.eos_token_ids[0]
    plain = _reference_run(prompt, _greedy(), tuple(tiny.eos_token_ids))
    return prompt, {name: (_greedy(**without), _greedy(**without, **fields))
                    for name, (without, fields) in _cases(plain, eos).items()}


CASE_NAMES = list(_cases(plain=[0] * 12, eos=0))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_greedy_run_equals_reference_loop(tiny, cases, name: str) -> None:
    prompt, by_name = cases
    without, params = by_name[name]
    eos = tuple(tiny.eos_token_ids)
    expected = _reference_run(prompt, params, eos)
    assert expected != _reference_run(prompt, without, eos)  # the processor matters here
    assert _engine_run(tiny, [(prompt, params)]) == [expected]


def test_processed_rows_batched_equal_reference(tiny, cases) -> None:
    prompt, by_name = cases
    params = [p for pair in by_name.values() for p in pair]
    eos = tuple(tiny.eos_token_ids)
    expected = [_reference_run(prompt, p, eos) for p in params]
    assert _engine_run(tiny, [(prompt, p) for p in params]) == expected
