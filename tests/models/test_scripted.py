"""ScriptedForCausalLM: logits checked against the closed form, computed here with math."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.fixtures import build_models as bm
from freetoken.core import Batch, Req, SamplingParams
from freetoken.models.scripted import ScriptedForCausalLM

V = 248320
THINK, END_THINK, IM_END, ENDOFTEXT, NN = 248068, 248069, 248046, 248044, 271
# "Let me think.</think>\n\nUse a <b> tag." on the Qwen3.5 vocabulary (see seed 003).
SEED_TEXT = "Let me think.</think>\n\nUse a <b> tag."
SEED_IDS = [9764, 728, 1683, 13, 248069, 271, 9947, 264, 361, 65, 29, 4619, 13]


def closed_form(target_logit: float, a: float, alts: list[float], base: float) -> float:
    """log softmax of a logit `target_logit` among A, the alternatives and V-1-n base ids."""
    z = math.exp(a) + sum(math.exp(x) for x in alts) + (V - 1 - len(alts)) * math.exp(base)
    return target_logit - math.log(z)


def req(prompt: list[int], output: list[int] | None = None, uid: int = 0) -> Req:
    return Req(uid=uid, prompt_ids=prompt, params=SamplingParams(), output_ids=output or [])


def step(model: ScriptedForCausalLM, *reqs: Req) -> torch.Tensor:
    batch = Batch(reqs=list(reqs), new_ids=[r.all_ids[-1:] for r in reqs], logit_reqs=list(reqs))
    return model(batch, None)


def run(model: ScriptedForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decode n tokens, appending each argmax as the engine would."""
    r = req(prompt)
    for _ in range(n):
        r.output_ids.append(int(step(model, r).argmax(-1)))
    return r.output_ids


@pytest.fixture(scope="module")
def load(qwen35_tokenizer: Any, make_scripted_model: Callable[..., Path]) -> Callable[..., Any]:
    def load(outputs: list[dict[str, Any]], **opts: Any) -> ScriptedForCausalLM:
        return ScriptedForCausalLM.from_folder(make_scripted_model(outputs, **opts),
                                               qwen35_tokenizer)  # fmt: skip

    return load


@pytest.fixture(scope="module")
def prompt(qwen35_tokenizer: Any) -> Callable[..., list[int]]:
    def encode(user: str, **kwargs: Any) -> list[int]:
        text = qwen35_tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True,
            **kwargs,
        )
        return qwen35_tokenizer.encode(text, add_special_tokens=False)

    return encode


def test_logprobs_match_closed_form(load: Callable[..., Any], prompt: Any) -> None:
    model = load([{"trigger": None, "text": SEED_TEXT}],
                 alternatives=[[END_THINK, 8.0], [NN, 6.0]])  # fmt: skip
    p = prompt("Hi")
    for j, t in enumerate(SEED_IDS + [IM_END]):
        logits = step(model, req(p, SEED_IDS[:j]))
        assert logits.dtype == torch.float32 and logits.shape == (1, V)
        lp = torch.log_softmax(logits[0].double(), -1)
        alts = [x for i, x in ((END_THINK, 8.0), (NN, 6.0)) if i != t]  # skipped when == t_j
        assert lp[t].item() == pytest.approx(closed_form(10.0, 10.0, alts, 0.0), abs=1e-6)
        assert model.logprob(req(p, SEED_IDS[:j]), t) == pytest.approx(lp[t].item(), abs=1e-6)
        if t != END_THINK:
            expected = closed_form(8.0, 10.0, alts, 0.0)
            assert lp[END_THINK].item() == pytest.approx(expected, abs=1e-6)
        other = 7 if t != 7 else 8
        assert lp[other].item() == pytest.approx(closed_form(0.0, 10.0, alts, 0.0), abs=1e-6)
        assert int(logits.argmax()) == t


def test_custom_logits_and_no_alternatives(load: Callable[..., Any]) -> None:
    model = load([{"trigger": None, "token_ids": [5, 6]}], scripted_logit=3.0, base_logit=-1.0)
    lp = torch.log_softmax(step(model, req([1, 2, 3]))[0].double(), -1)
    assert lp[5].item() == pytest.approx(closed_form(3.0, 3.0, [], -1.0), abs=1e-9)
    assert lp[6].item() == pytest.approx(closed_form(-1.0, 3.0, [], -1.0), abs=1e-9)


def test_markers_are_single_scripted_tokens(load: Callable[..., Any]) -> None:
    text = "<think>\nx</think>\n\n<tool_call>\n{}\n</tool_call>"
    model = load([{"trigger": None, "text": text}])
    out = run(model, [1], 12)
    assert out[0] == THINK and END_THINK in out and 248058 in out and 248059 in out
    assert out.index(END_THINK) + 1 == out.index(NN)


def test_trigger_selection(load: Callable[..., Any], prompt: Any) -> None:
    model = load([
        {"trigger": None, "token_ids": [30]},  # the default, even though listed first
        {"trigger": "weather", "token_ids": [10, 11]},
        {"trigger": "Paris", "token_ids": [20]},
    ])  # fmt: skip
    assert run(model, prompt("What is the weather in Paris?"), 3) == [10, 11, IM_END]
    assert run(model, prompt("Tell me about Paris"), 2) == [20, IM_END]
    assert run(model, prompt("Hello"), 2) == [30, IM_END]
    # Triggers may match template text too, specials included.
    model = load([{"trigger": "<think>\n\n</think>", "token_ids": [40]},
                  {"trigger": None, "token_ids": [41]}])  # fmt: skip
    assert run(model, prompt("Hi"), 1) == [41]
    assert run(model, prompt("Hi", enable_thinking=False), 1) == [40]


def test_no_default_means_immediate_eos(load: Callable[..., Any]) -> None:
    model = load([{"trigger": "never", "token_ids": [10]}], eos_token_id=ENDOFTEXT)
    assert run(model, [1, 2], 2) == [ENDOFTEXT, ENDOFTEXT]


def test_eos_after_script_and_cycle(load: Callable[..., Any]) -> None:
    script = [{"trigger": None, "token_ids": [10, 11, 12]}]
    assert run(load(script), [1], 5) == [10, 11, 12, IM_END, IM_END]
    assert run(load(script, eos_token_id=ENDOFTEXT), [1], 4) == [10, 11, 12, ENDOFTEXT]
    assert run(load(script, cycle=True), [1], 7) == [10, 11, 12, 10, 11, 12, 10]


def test_batch_rows_follow_logit_reqs(load: Callable[..., Any]) -> None:
    model = load([{"trigger": "A", "token_ids": [10, 11]}, {"trigger": None, "token_ids": [20]}])
    a = model._tokenizer.encode("A", add_special_tokens=False)
    r1, r2, r3 = req(a, [10], uid=1), req([5], uid=2), req(a, uid=3)
    # r2 is a chunked prefill that does not sample this step: no row for it.
    batch = Batch(reqs=[r1, r2, r3], new_ids=[[10], [5], a], logit_reqs=[r3, r1])
    logits = model(batch, None)
    assert logits.shape == (2, V)
    assert logits.argmax(-1).tolist() == [10, 11]
    assert step(model, r2).argmax(-1).tolist() == [20]


def test_prompt_rows_follow_sampling_rows(load: Callable[..., Any]) -> None:
    # The configuration of tests/engine/test_prompt_logprobs.py, so the folder is built once.
    model = load([{"trigger": None, "token_ids": [5, 6]}], base_logit=-1.0,
                 alternatives=[[7, 2.0], [8, 1.0]])  # fmt: skip
    r1, r2 = req([1, 2, 3], uid=1), req([4, 5, 6, 7], uid=2)
    batch = Batch(reqs=[r1, r2], new_ids=[[1, 2, 3], [4, 5]], logit_reqs=[r1],
                  prompt_rows=[(r2, 2), (r1, 2)])  # fmt: skip
    logits = model(batch, None)
    assert logits.shape == (5, V) and int(logits[0].argmax()) == 5
    # Any prompt row: the alternatives over a flat base, no scripted token.
    expected = torch.full((V,), -1.0)
    expected[7], expected[8] = 2.0, 1.0
    assert all(torch.equal(row, expected) for row in logits[1:])


def test_folder_config_format(
    make_scripted_model: Callable[..., Path], qwen35_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_scripted_model([{"trigger": None, "text": "hi"}], alternatives=[[7, 1.5]])
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["ScriptedForCausalLM"]
    assert config["model_type"] == "scripted" and config["vocab_size"] == V
    assert config["alternatives"] == [[7, 1.5]]
    assert config["script"] == {"outputs": [{"trigger": None, "text": "hi"}],
                                "eos_token_id": IM_END, "cycle": False}  # fmt: skip
    # Without a tokenizer, from_folder loads the folder's (reuse the loaded one: a load is ~3 s).
    loaded: list[str] = []
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained",
                        lambda p, **kw: loaded.append(p) or qwen35_tokenizer)  # fmt: skip
    model = ScriptedForCausalLM.from_folder(path)
    assert loaded == [str(path)]
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (1, 1, 8)
    assert model.vocab_size == V and model.eos_token_id == IM_END


@pytest.mark.parametrize("outputs, opts", [
    ([{"trigger": None, "text": "a", "token_ids": [1]}], {}),
    ([{"trigger": None}], {}),
    ([{"trigger": 3, "text": "a"}], {}),
    ([{"trigger": None, "token_ids": [V]}], {}),
    ([{"trigger": None, "text": "a"}], {"alternatives": [[5, 1.0], [5, 2.0]]}),
])  # fmt: skip
def test_bad_config_is_rejected(
    outputs: list[dict[str, Any]], opts: dict[str, Any], qwen35_tokenizer: Any
) -> None:
    script = {"outputs": outputs}
    config = {"model_type": "scripted", "vocab_size": V, "script": script, **opts}
    with pytest.raises(ValueError):
        ScriptedForCausalLM(config, qwen35_tokenizer)


def test_default_fixture(scripted_model_path: Path, qwen35_tokenizer: Any, prompt: Any) -> None:
    model = ScriptedForCausalLM.from_folder(scripted_model_path, qwen35_tokenizer)
    assert run(model, prompt("Hi"), len(SEED_IDS) + 1) == SEED_IDS + [IM_END]
    no_think = run(model, prompt("Hi", enable_thinking=False), 8)
    assert qwen35_tokenizer.decode(no_think[: no_think.index(IM_END)]) == "Use a <b> tag."
    out = run(model, prompt("What is the weather in Paris?"), 64)
    assert qwen35_tokenizer.decode(out[: out.index(IM_END)]) == bm.DEFAULT_SCRIPT[0]["text"]
