"""`logprob_token_ids` (vLLM's field): at each generated position the listed ids' logprobs,
against transformers' float32 log-softmax on the same weights, ids far outside the top 20
included; renormalised over `allowed_token_ids` on a masked row."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.core import SamplingParams
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import drain, loaded_fp32, random_prompt, reference_logprobs, tiny_random_folder

TOLERANCE = 1e-4
STEPS = 3


@pytest.fixture(scope="module")
def tiny():
    return loaded_fp32(tiny_random_folder("qwen3"))



def _listed(prompt: list[int]) -> list[int]:
    """Two of the top 3, and ids ranked past 1000 and at the very bottom."""
    order = reference_logprobs(tiny_random_folder("qwen3"), prompt, [])[0].argsort(descending=True)
    return [order[1].item(), order[0].item(), order[1500].item(), order[-1].item()]


def _entries(tiny, requests: dict[int, tuple[list[int], SamplingParams]]) -> dict[int, list]:
    msgs = drain(build_scheduler(tiny, kv_slots=1024), requests)
    return {uid: [(t, e) for m in ms for t, e in zip(m.token_ids, m.logprobs)]
            for uid, ms in msgs.items()}


def test_listed_ids_match_the_full_log_softmax(tiny):
    prompts = {uid: random_prompt(9 + 4 * uid, uid) for uid in range(3)}
    listed = {uid: _listed(p) for uid, p in prompts.items()}
    requests = {uid: (p, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True,
                                        logprobs=0, logprob_token_ids=listed[uid]))
                for uid, p in prompts.items()}
    # A neighbour with a plain top-5 in the same batch keeps its own shape.
    requests[9] = (random_prompt(7, 9), SamplingParams(temperature=0, max_tokens=STEPS, logprobs=5,
                                                 ignore_eos=True))
    runs = _entries(tiny, requests)
    for uid, prompt in prompts.items():
        tokens = [t for t, _ in runs[uid]]
        ref = reference_logprobs(tiny_random_folder("qwen3"), prompt, tokens)
        for step, (token, entry) in enumerate(runs[uid]):
            assert entry.top_ids == listed[uid]
            expected = ref[step, torch.tensor(listed[uid])]
            assert torch.allclose(torch.tensor(entry.top_logprobs), expected, atol=TOLERANCE, rtol=0)
            assert abs(entry.logprob - ref[step, token].item()) <= TOLERANCE
        assert (ref[0].argsort(descending=True) == listed[uid][3]).nonzero().item() > 20
    assert all(len(e.top_ids) == 5 for _, e in runs[9])


def test_allowed_token_ids_renormalise_the_listed_ids(tiny):
    prompt = random_prompt(11, 5)
    listed = _listed(prompt)
    allowed = listed[:3]  # the bottom id is listed but not allowed
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0, allowed_token_ids=allowed,
                            logprob_token_ids=listed)
    (token, entry), = _entries(tiny, {0: (prompt, params)})[0]
    ref = reference_logprobs(tiny_random_folder("qwen3"), prompt, [])[0]
    norm = torch.logsumexp(ref[torch.tensor(allowed)], 0)
    for tid, value in zip(entry.top_ids[:3], entry.top_logprobs[:3]):
        assert abs(value - (ref[tid] - norm).item()) <= TOLERANCE
    assert entry.top_logprobs[3] == -math.inf
    assert token in allowed
