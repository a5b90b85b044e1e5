"""Continuous batching on the default model: invariance, late joiners, aborts, a full pool."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import WeightsConfig
from freetoken.core import SamplingParams
from freetoken.scheduler.factory import build_scheduler
from freetoken.message import UserMsg
from freetoken.models.registry import load_model
from tests.model_fixtures import default_folder, default_model

pytestmark = pytest.mark.slow  # the default model

PROMPTS = [
    "Hi",
    "The quick brown fox",
    "Write a haiku about the sea and the wind over the waves",
    "1, 2, 3,",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached",
    "Translate to French: good morning",
    "What is the square root of 144? The answer is",
    "A list of fruits: apple, banana,",
    # Decoding requests attend in groups by key length rounded up to engine.DECODE_KV_BLOCK
    # (64): these two start in different groups and the first moves to the next one mid-decode.
    "Count with me: " + ", ".join(str(n) for n in range(1, 18)),
    "Numbers: " + " ".join(str(n) for n in range(100, 130)),
]


def _greedy(max_tokens=12):
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)


def _run(scheduler, until_done=True):
    out: dict[int, list] = {}
    while scheduler.has_work:
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).extend(zip(msg.token_ids, msg.logprobs))
    return out


def _ids(prompt):
    return default_model().tokenizer.encode(prompt)


def _loaded_on(kernel: str, dtype: str, gguf_weights: str | None = None, folder=None):
    """The default model (its blocks dequantized with `gguf_weights="float32"`), or `folder`'s,
    with every dense linear on `kernel` (the probe still decides its row rule); skips where that
    kernel keeps no rule on this CPU."""
    if (kernel, dtype, gguf_weights, folder) == ("auto", "float32", None, None):
        loaded = default_model()
    else:
        weights = WeightsConfig(gguf_weights=gguf_weights, linear_kernel=None if kernel == "auto" else kernel)
        loaded = load_model(folder or default_folder(), dtype=dtype, device="cpu", weights=weights)
    plan = loaded.model.kernel_plan
    forced_elsewhere = kernel != "auto" and not all(v.startswith(kernel) for v in plan.kernels.values())
    if not plan.invariant or forced_elsewhere:
        pytest.skip(f"{kernel}: not batch-invariant or cannot run on this CPU ({plan.kernels})")
    return loaded


# The GGUF's blocks on the quantized kernel, then dense layers as an HF folder's on the kernels
# the probe picks here (auto), and forced onto each bfloat16 unit.
LOADS = [("auto", "float32", None), ("auto", "float32", "float32"), ("auto", "bfloat16", None),
         ("amx", "bfloat16", None), ("avx512_bf16", "bfloat16", None)]


@pytest.mark.parametrize("kernel,dtype,gguf_weights", LOADS)
def test_batched_greedy_equals_each_alone_bit_for_bit(kernel, dtype, gguf_weights):
    loaded = _loaded_on(kernel, dtype, gguf_weights)
    assert 52 <= len(_ids(PROMPTS[-2])) <= 63 and len(_ids(PROMPTS[-1])) > 64
    # bfloat16 on a CPU without its units is emulated, 5-10x float32's time: six prompts, the two
    # that cross a decode group among them.
    prompts = PROMPTS if dtype == "float32" else PROMPTS[:4] + PROMPTS[-2:]
    alone = {}
    for uid, prompt in enumerate(prompts):
        scheduler = build_scheduler(loaded, kv_slots=1024, prefix_cache=False)
        scheduler.add(UserMsg(uid, _ids(prompt), _greedy()))
        alone.update(_run(scheduler))
    scheduler = build_scheduler(loaded, kv_slots=1024, prefix_cache=False)
    for uid, prompt in enumerate(prompts):
        scheduler.add(UserMsg(uid, _ids(prompt), _greedy()))
    together = _run(scheduler)
    for uid in alone:
        assert [t for t, _ in together[uid]] == [t for t, _ in alone[uid]]
        for (_, a), (_, b) in zip(together[uid], alone[uid]):
            assert a.logprob == b.logprob and a.top_logprobs == b.top_logprobs


@pytest.mark.parametrize("kernel,dtype,model", [("auto", "float32", None), ("auto", "bfloat16", None),
                                                ("grouped", "bfloat16", None), ("amx", "bfloat16", None),
                                                ("avx512_bf16", "bfloat16", None),
                                                ("grouped", "bfloat16", "tiny_granite_path")])
def test_label_scores_are_the_same_from_the_heads_label_columns_or_the_whole_head(kernel, dtype, model, request,
                                                                                  monkeypatch):
    """Scoring requests that allow two labels: in a step of such rows alone the LM head computes
    the labels' columns only (engine.MAX_LOGIT_COLUMNS); beside an unmasked request it computes
    every column. The same tokens and logprobs, bit for bit (float32: the default GGUF's head on
    its Q8_0 blocks; the tiny Granite's logits divided by its logits_scaling in bfloat16)."""
    loaded = _loaded_on(kernel, dtype, folder=model and request.getfixturevalue(model))
    encode = loaded.tokenizer.encode
    head, taken = loaded.model.lm_head, []
    at = head.logits_at
    # Each label's last token: one in the default vocabulary, a split word's in the tiny Granite's.
    labels = [encode(t, add_special_tokens=False)[-1] for t in (" Yes", " No")]
    if at(torch.zeros(1, head.in_features, dtype=getattr(torch, dtype)), labels) is None:
        pytest.skip(f"the head's kernel here computes whole heads only ({loaded.model.kernel_plan.kernels})")
    monkeypatch.setattr(head, "logits_at", lambda x, columns: taken.append(at(x, columns)) or taken[-1],
                        raising=False)
    scoring = SamplingParams(temperature=0, max_tokens=1, logprobs=2, allowed_token_ids=labels)
    runs = []
    for extra in (False, True):
        scheduler = build_scheduler(loaded, kv_slots=1024, prefix_cache=False)
        for uid, prompt in enumerate(PROMPTS[:4]):
            scheduler.add(UserMsg(uid, encode(prompt), scoring))
        if extra:
            scheduler.add(UserMsg(99, encode(PROMPTS[4]), _greedy(1)))
        runs.append(_run(scheduler))
        if not extra:  # the first run took the labels' columns
            assert taken and all(logits is not None for logits in taken)
    for uid in range(4):
        [(token, lp)] = runs[0][uid]
        [(token_whole, lp_whole)] = runs[1][uid]
        assert token == token_whole and token in labels
        assert lp.logprob == lp_whole.logprob and lp.top_logprobs == lp_whole.top_logprobs


def test_request_joining_mid_decode_matches_alone():
    loaded = default_model()
    scheduler = build_scheduler(loaded, kv_slots=1024)
    scheduler.add(UserMsg(0, _ids(PROMPTS[4]), _greedy(20)))
    out: dict[int, list] = {}
    for _ in range(5):
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).append(msg.token_ids[0])
    scheduler.add(UserMsg(1, _ids(PROMPTS[2]), _greedy(8)))
    for uid, pairs in _run(scheduler).items():
        out.setdefault(uid, []).extend(t for t, _ in pairs)
    alone = build_scheduler(loaded, kv_slots=1024)
    alone.add(UserMsg(1, _ids(PROMPTS[2]), _greedy(8)))
    assert out[1] == [t for t, _ in _run(alone)[1]]
    assert len(out[0]) == 20


def test_abort_frees_kv_at_any_point():
    loaded = default_model()
    scheduler = build_scheduler(loaded, kv_slots=512, prefix_cache=False)
    free_at_start = scheduler.engine.kv.num_free
    scheduler.add(UserMsg(0, _ids(PROMPTS[2]), _greedy(50)))
    scheduler.add(UserMsg(1, _ids(PROMPTS[3]), _greedy(50)))
    scheduler.step()
    scheduler.step()
    [msg] = scheduler.abort(0)
    assert msg.finished and msg.finish_reason == "abort"
    assert scheduler.abort(1)[0].finish_reason == "abort"
    assert scheduler.abort(7) == []
    assert not scheduler.has_work
    assert scheduler.engine.kv.num_free == free_at_start


def test_full_pool_queues_and_all_finish():
    loaded = default_model()
    # Room for six of the short prompts, not for their outputs too: the others wait in the queue
    # and the newest running ones are preempted as the outputs grow.
    short = [p for p in PROMPTS if len(_ids(p)) < 20]
    scheduler = build_scheduler(loaded, kv_slots=64, prefix_cache=False)
    for uid, prompt in enumerate(short):
        scheduler.add(UserMsg(uid, _ids(prompt), _greedy(10)))
    peak_running = 0
    finished = {}
    while scheduler.has_work:
        for msg in scheduler.step():
            if msg.finished:
                finished[msg.uid] = msg.finish_reason
        peak_running = max(peak_running, len(scheduler.running))
    assert finished == {uid: "length" for uid in range(len(short))}
    assert 1 <= peak_running < len(short)
    assert scheduler.stats()["preemptions"] > 0
    assert scheduler.engine.kv.num_free == 64


def test_context_limits():
    loaded = default_model()
    scheduler = build_scheduler(loaded, kv_slots=256, max_model_len=16)
    [msg] = scheduler.add(UserMsg(0, list(range(16)), _greedy()))
    assert msg.error_code == "context_length_exceeded" and msg.finished
    [msg] = scheduler.add(UserMsg(1, list(range(100, 110)), _greedy(7)))
    assert msg.finish_reason == "error" and msg.error_code == "context_length_exceeded"
    assert msg.error == ("'max_tokens' or 'max_completion_tokens' is too large: 7. This model's "
                         "maximum context length is 16 tokens and your request has 10 input "
                         "tokens (7 > 16 - 10).")
    assert not scheduler.has_work
    # Without max_tokens a request may use the rest of the context.
    scheduler.add(UserMsg(2, list(range(100, 110)), _greedy(None)))
    out = []
    while scheduler.has_work:
        out += scheduler.step()
    assert out[-1].finish_reason == "length" and sum(len(m.token_ids) for m in out) == 6


def test_kv_pool_limits():
    loaded = default_model()
    scheduler = build_scheduler(loaded, kv_slots=32, max_model_len=64)
    # Within the context but not within the pool: no preemption could ever make room for it.
    for uid, (n, max_tokens) in enumerate([(10, 23), (40, None)]):
        [msg] = scheduler.add(UserMsg(uid, list(range(100, 100 + n)), _greedy(max_tokens)))
        assert msg.finish_reason == "error" and msg.error_code == "context_length_exceeded"
        assert "32" in msg.error and "--kv-cache-tokens" in msg.error
    assert not scheduler.has_work
    # Without max_tokens a request may use the whole pool.
    scheduler.add(UserMsg(2, list(range(100, 110)), _greedy(None)))
    out = []
    while scheduler.has_work:
        out += scheduler.step()
    assert out[-1].finish_reason == "length" and sum(len(m.token_ids) for m in out) == 22


def test_eos_and_stop_token_ids_finish_with_stop():
    loaded = default_model()
    scheduler = build_scheduler(loaded, kv_slots=512)
    first = _run_one(scheduler, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    stop_id = first[2]
    params = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id], ignore_eos=True)
    msgs = []
    scheduler.add(UserMsg(9, _ids(PROMPTS[6]), params))
    while scheduler.has_work:
        msgs += scheduler.step()
    assert [t for m in msgs for t in m.token_ids] == first[:3]
    assert msgs[-1].finish_reason == "stop" and msgs[-1].matched_stop == stop_id


def _run_one(scheduler, params):
    scheduler.add(UserMsg(8, _ids(PROMPTS[6]), params))
    return [t for t, _ in _run(scheduler)[8]]


def test_chunked_prefill_equals_one_shot():
    loaded = default_model()
    ids = _ids(PROMPTS[4] * 4)
    one_shot = build_scheduler(loaded, kv_slots=1024, prefix_cache=False)
    one_shot.add(UserMsg(0, ids, _greedy(6)))
    expected = _run(one_shot)[0]
    chunked = build_scheduler(loaded, kv_slots=1024, prefix_cache=False, max_prefill_tokens=7)
    chunked.add(UserMsg(0, ids, _greedy(6)))
    got, first_step, step = [], None, 0
    while chunked.has_work:
        step += 1
        for msg in chunked.step():
            first_step = first_step or step
            got += list(zip(msg.token_ids, msg.logprobs))
    assert first_step == -(-len(ids) // 7)  # one step per 7-token chunk before the first token
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert max(abs(a.logprob - b.logprob) for (_, a), (_, b) in zip(got, expected)) <= 1e-5
