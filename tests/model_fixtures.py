"""Models shared by the engine, scheduler and offline-API tests, loaded once per process."""

from __future__ import annotations

import functools
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from freetoken.kernels.bf16_linear import UNITS
from freetoken.layers.linear import CANDIDATES
from freetoken.models.loader import weights_folder
from freetoken.models.registry import load_model, model_folder
from freetoken.paths import ModelNotFound, cache_root

# The linear kernels that run float32 (the bfloat16 units' run bfloat16 only), and (kernel, dtype) pairs.
FLOAT32_KERNELS = tuple(k for k in CANDIDATES if k not in UNITS)
KERNEL_DTYPES = [*((k, torch.float32) for k in FLOAT32_KERNELS), *((k, torch.bfloat16) for k in CANDIDATES)]
# A batch of 8 for the tiny checkpoints on the Harmony BPE, each longer than their sliding
# windows of 8.
HARMONY_TEXTS = ["What is the capital of France? The capital is Paris.", "def add(a, b):\n    return a + b",
                 "Write a short poem about the sea, the wind and the stars", "Numbers 0 1 2 3 4 5 6 7 8 9 10 42",
                 "The user asks about the weather in Paris. It is sunny.",
                 "Monday, then Tuesday, then Wednesday, then Friday!",
                 "Tokenizers split text into pieces, then merge the frequent pairs.",
                 "A tiny model predicts the next word, one step at a time, then stops."]


@functools.lru_cache(maxsize=None)
def default_model():
    return load_model(None, dtype="float32", device="cpu")


# A few per process, not all: a test worker that kept every model it met (and transformers'
# copy of each) held ~3 GB by the end of the suite, next to the servers of the e2e tests.
@functools.lru_cache(maxsize=2)
def loaded_fp32(folder: Path):
    return load_model(folder, dtype="float32", device="cpu")


@functools.lru_cache(maxsize=2)
def hf_reference(folder: Path):
    """transformers in float32 on `folder`'s weights (a GGUF's: dequantized by transformers)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(weights_folder(folder), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def tiny_random_folder(arch: str = "qwen3") -> Path:
    """A randomly initialised Qwen3 (q/k norm) or Qwen2 (q/k/v bias), untied head, on the
    default model's tokenizer."""
    import transformers

    name = {"qwen3": "Qwen3", "qwen2": "Qwen2"}[arch]
    folder = cache_root() / "test-models" / f"tiny-random-{arch}-v1"
    if (folder / "model.safetensors").is_file():
        return folder
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        max_position_embeddings=512, rope_theta=10000.0,
    )
    model = getattr(transformers, f"{name}ForCausalLM")(cfg)
    if arch == "qwen2":  # transformers initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")  # xdist workers may build at once
    model.save_pretrained(tmp)
    src = default_folder()
    for name in src.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, tmp / name.name)
    try:
        tmp.replace(folder)
    except OSError:  # the other worker's build landed first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def default_folder() -> Path:
    return model_folder(None)[0]


def reference_logprobs(folder: Path, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF transformers' fp32 log-softmax, teacher-forced: row i is the distribution of the
    token after prompt + output[:i], for i = 0..len(output) ([len(output) + 1, V])."""
    model = hf_reference(folder)
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def drain(scheduler, requests: dict | None = None) -> dict[int, list]:
    """Add `requests` ({uid: (prompt ids, SamplingParams)}) and step `scheduler` until it has
    no work; returns each request's DetokenizeMsgs in order."""
    from freetoken.message import UserMsg

    for uid, (ids, params) in (requests or {}).items():
        assert scheduler.add(UserMsg(uid, ids, params)) == []
    out: dict[int, list] = {}
    while scheduler.has_work:
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).append(msg)
    return out


def greedy_run(scheduler, prompts: dict[int, list[int]], steps: int = 16) -> tuple[dict, dict]:
    """Greedy decode of `prompts` ({uid: ids}) together on `scheduler`, top 5 logprobs:
    ({uid: [(token, TokenLogprob)]}, {uid: prompt tokens the prefix cache supplied})."""
    from freetoken.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, logprobs=5, ignore_eos=True)
    msgs = drain(scheduler, {uid: (ids, params) for uid, ids in prompts.items()})
    runs = {uid: [pair for m in ms for pair in zip(m.token_ids, m.logprobs)] for uid, ms in msgs.items()}
    return runs, {uid: max(m.cached_tokens for m in ms) for uid, ms in msgs.items()}


def teacher_forced_distributions(loaded, ids: list[int]) -> torch.Tensor:
    """The next-token log-distributions (float64) after each of ids[:-1], teacher-forced through
    the engine: [len(ids) - 1, vocabulary]."""
    from freetoken.core import SamplingParams
    from freetoken.engine import engine
    from freetoken.scheduler.factory import build_scheduler

    rows = []

    def keep(logits, targets, ks):
        rows.append(logits.double().log_softmax(-1))
        return scored(logits, targets, ks)

    scored, engine.prompt_logprobs = engine.prompt_logprobs, keep
    try:
        drain(build_scheduler(loaded, kv_slots=len(ids) + 64, prefix_cache=False),
              {0: (ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))})
    finally:
        engine.prompt_logprobs = scored
    return torch.cat(rows)


def assert_same_run(a: list, b: list, tol: float = 1e-5) -> None:
    """Two greedy runs of one request: the same tokens, logprobs (top ones too) within `tol`."""
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert abs(x.logprob - y.logprob) <= tol
        assert x.top_ids == y.top_ids
        assert max(abs(p - q) for p, q in zip(x.top_logprobs, y.top_logprobs)) <= tol


def assert_matches_reference(folder: Path, prompt: list[int], run: list, tol: float = 1e-4) -> None:
    """A greedy run against transformers' fp32 forward on the same weights: each token is the
    reference's argmax, and its logprob and the top ones are within `tol`."""
    tokens = [t for t, _ in run]
    ref = reference_logprobs(folder, prompt, tokens)
    assert ref[:-1].argmax(-1).tolist() == tokens
    for step, (token, entry) in enumerate(run):
        assert abs(ref[step, token].item() - entry.logprob) <= tol
        got = torch.tensor(entry.top_logprobs)
        assert torch.allclose(ref[step, torch.tensor(entry.top_ids)], got, atol=tol, rtol=0)


def assert_greedy_matches_hf(loaded, prompts: list[str], steps: int = 16) -> None:
    """Greedy runs of `prompts` together against transformers' own greedy `generate` on the same
    weights: the same tokens, and each logprob and the top 5 within 1e-4 of its logits."""
    from freetoken.scheduler.factory import build_scheduler

    hf = hf_reference(loaded.folder)
    ids = {uid: loaded.tokenizer.encode(prompt) for uid, prompt in enumerate(prompts)}
    ours, _ = greedy_run(build_scheduler(loaded, kv_slots=2048), ids, steps)
    for uid, prompt_ids in ids.items():
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt_ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
        assert [t for t, _ in ours[uid]] == ref.sequences[0, len(prompt_ids):].tolist()
        for step, (token, lp) in enumerate(ours[uid]):
            ref_lp = torch.log_softmax(ref.logits[step][0].float(), -1)
            assert abs(ref_lp[token].item() - lp.logprob) <= 1e-4
            top = torch.tensor(lp.top_logprobs)
            assert torch.allclose(ref_lp[torch.tensor(lp.top_ids)], top, atol=1e-4)


def assert_batch_matches_alone_and_reference(loaded, texts: list[str], alone_tol: float = 1e-5) -> None:
    """Greedy runs of `texts` together: each equals its run alone (logprobs within `alone_tol`;
    0: bit for bit) and transformers' reference."""
    from freetoken.scheduler.factory import build_scheduler

    prompts = {uid: loaded.tokenizer.encode(text) for uid, text in enumerate(texts)}
    together, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), prompts)
    for uid, ids in prompts.items():
        alone, _ = greedy_run(build_scheduler(loaded, kv_slots=256, prefix_cache=False), {uid: ids})
        assert_same_run(together[uid], alone[uid], alone_tol)
        assert_matches_reference(loaded.folder, ids, together[uid])


def assert_cache_hit_and_chunks_give_the_cold_result(loaded, base: list[int], steps: int = 16) -> dict:
    """`base` and a prompt sharing all but its last 3 tokens, cold, after a prefix-cache warm-up
    and in 5-token prefill chunks: the same runs, and transformers' cold one. Returns the prompt tokens each hit reused."""
    from freetoken.scheduler.factory import build_scheduler

    prompts = {0: base, 1: base[:-3] + loaded.tokenizer.encode(" and back")}
    cold, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False), prompts, steps)
    warm = build_scheduler(loaded, kv_slots=1024)
    greedy_run(warm, {9: base}, steps=4)
    hit, cached = greedy_run(warm, prompts, steps)
    chunked, _ = greedy_run(build_scheduler(loaded, kv_slots=1024, prefix_cache=False,
                                            max_prefill_tokens=5), prompts, steps)
    for uid in prompts:
        assert_same_run(hit[uid], cold[uid])
        assert_same_run(chunked[uid], cold[uid])
        assert_matches_reference(loaded.folder, prompts[uid], cold[uid])
    return cached


def assert_harmony_cache_hit_and_chunks(loaded) -> None:
    """assert_cache_hit_and_chunks_give_the_cold_result on two HARMONY_TEXTS joined, whose cached
    prefixes are much longer than the sliding windows of 8 of the tiny gpt-oss and Mistral."""
    base = loaded.tokenizer.encode(HARMONY_TEXTS[0] + " " + HARMONY_TEXTS[3])
    cached = assert_cache_hit_and_chunks_give_the_cold_result(loaded, base)
    assert cached[0] >= len(base) - 1 and cached[1] >= len(base) - 4 > 2 * 8


def random_prompt(n: int, seed: int) -> list[int]:
    """n token ids drawn from the middle of the default vocabulary, the same for a seed."""
    r = random.Random(seed)
    return [r.randrange(1000, 40000) for _ in range(n)]


def assert_config_edit_is_named(gguf: Path, tmp_path: Path, edits: list[tuple[dict[str, str], str]]) -> None:
    """The GGUF's cached config with each edit (text replacements) made in turn on the last,
    each load refused with a message matching the edit's pattern."""
    changed = tmp_path / "config"
    shutil.copytree(model_folder(gguf)[0], changed, symlinks=True)
    config = (changed / "config.json").read_text()
    for replacements, message in edits:
        for old, new in replacements.items():
            config = config.replace(old, new)
        (changed / "config.json").write_text(config)
        with pytest.raises(ModelNotFound, match=message):
            load_model(changed, device="cpu")


def stored_bytes(gguf: Path, kept: tuple[str, ...]) -> dict[str, int]:
    """What loading `gguf` holds by format, counted from the file alone: its tensors in the
    block formats `kept` as stored, every other one as float32."""
    from gguf import GGUFReader

    stored: dict[str, int] = {}
    for t in GGUFReader(gguf).tensors:
        block = t.tensor_type.name in kept
        key = t.tensor_type.name if block else "float32"
        stored[key] = stored.get(key, 0) + (int(t.n_bytes) if block else int(t.n_elements) * 4)
    return stored


def assert_family_gguf_matches_reference(name: str, formats: set[str]):
    """tests/fixtures/build_models.py's family GGUF `name` (build_family_gguf) loaded with its
    blocks kept as stored (its weights held in `formats`): greedy runs of four HARMONY_TEXTS
    together, against transformers float32 on the blocks' dequantized weights (the builder's
    `ref` folder); the loaded model."""
    from freetoken.config import WeightsConfig
    from freetoken.scheduler.factory import build_scheduler
    from tests.fixtures import build_models as bm

    built = bm.cached_gguf(name)
    loaded = load_model(built / "model.gguf", dtype="float32", device="cpu", weights=WeightsConfig(gguf_weights="quantized"))
    assert set(loaded.model.weight_bytes) == formats
    prompts = {uid: loaded.tokenizer.encode(text) for uid, text in enumerate(HARMONY_TEXTS[:4])}
    together, _ = greedy_run(build_scheduler(loaded, kv_slots=512, prefix_cache=False), prompts, steps=8)
    for uid, ids in prompts.items():
        assert_matches_reference(built / "ref", ids, together[uid])
    return loaded


def assert_holds_stored_bytes_and_matches_reference(model, stored: dict[str, int],
                                                    prompts: dict[int, list[int]]) -> dict:
    """`model` reports the weight bytes by format `stored` (the file's), itself and through
    /v1/stats' scheduler, and its greedy batch of `prompts` matches HF on its folder; that run."""
    from freetoken.scheduler.factory import build_scheduler

    assert model.model.weight_bytes == stored
    scheduler = build_scheduler(model, kv_slots=256, prefix_cache=False)
    assert scheduler.stats()["weight_bytes"] == stored
    together, _ = greedy_run(scheduler, prompts, steps=6)
    for uid, ids in prompts.items():
        assert_matches_reference(model.folder, ids, together[uid])
    return together
