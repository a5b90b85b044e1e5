"""The MTP head drafts what the Qwen3.5 MTP module computes: checked against a reference built
from the checkpoint's raw `mtp.*` tensors, transformers' own Qwen3.5 decoder layer, norms and
rotary embedding, and the main model's final-norm hidden states from transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from freetoken.config import SpeculativeConfig
from freetoken.core import SamplingParams
from freetoken.message import UserMsg
from freetoken.scheduler.factory import build_scheduler
from tests.model_fixtures import hf_reference, loaded_fp32

MTP = SpeculativeConfig(num_speculative_tokens=3, method="mtp")


class ReferenceMtp:
    """vLLM's Qwen3_5MultiTokenPredictor over a whole sequence, in transformers' modules."""

    def __init__(self, folder):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        self.model = hf_reference(folder)
        config = self.model.config
        config._attn_implementation = "eager"
        state = {k.removeprefix("mtp."): v for k, v in load_file(folder / "model.safetensors").items()
                 if k.startswith("mtp.")}
        full = config.layer_types.index("full_attention")  # a layer index whose type is attention
        self.layer = hf.Qwen3_5DecoderLayer(config, full).eval()
        self.layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in state.items()
                                    if k.startswith("layers.0.")})
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = hf.Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.norms[name].weight.data.copy_(state[f"{name}.weight"])
        self.fc = state["fc.weight"]
        self.rotary = hf.Qwen3_5TextRotaryEmbedding(config)

    @torch.no_grad()
    def drafts(self, ids: list[int], k: int) -> list[int]:
        """The k greedy drafts after `ids`: pairs (main state at i, token i + 1) for every i,
        then the head's own output paired with each token it drafts."""
        states = self.model.model(torch.tensor([ids])).last_hidden_state[0]
        hidden, tokens, drafts = list(states[:-1]), list(ids[1:]), []
        for _ in range(k):
            out = self._forward(torch.stack(hidden), torch.tensor(tokens))
            drafts.append(int(self.model.lm_head(out[-1]).argmax()))
            hidden.append(out[-1])
            tokens.append(drafts[-1])
        return drafts

    def _forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        n = len(tokens)
        embedded = self.model.model.embed_tokens(tokens)
        x = torch.cat([self.norms["pre_fc_norm_embedding"](embedded),
                       self.norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ self.fc.T
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.layer(x[None], position_embeddings=self.rotary(x[None], positions),
                       attention_mask=mask, position_ids=positions)
        return self.norms["norm"](x[0] if isinstance(x, torch.Tensor) else x[0][0])


def _greedy(scheduler, prompts: list[list[int]], lengths: list[int]) -> dict[int, list[int]]:
    for uid, (ids, n) in enumerate(zip(prompts, lengths)):
        scheduler.add(UserMsg(uid, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    out: dict[int, list[int]] = {}
    while scheduler.has_work:
        for msg in scheduler.step():
            out.setdefault(msg.uid, []).extend(msg.token_ids)
    return out


@pytest.mark.slow
def test_mtp_drafts_are_the_reference_modules_drafts(tiny_hybrid_path, monkeypatch):
    folder = tiny_hybrid_path("qwen3_5_mtp")
    loaded = loaded_fp32(folder)
    # Two requests, one over several prefill chunks, so that the pass runs batched and chunked;
    # a third, longer, whose drafts are all wrong: it stops drafting, and the others' drafts
    # read the head's K/V of a pass that skips its rows, then no pass at all.
    prompts = [loaded.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3), [5, 6, 7], [8, 9, 10, 11]]
    lengths = [10, 10, 24]
    plain = _greedy(build_scheduler(loaded, kv_slots=512), prompts, lengths)
    scheduler = build_scheduler(loaded, kv_slots=512, speculative=MTP, max_prefill_tokens=16)
    drafter, seen, retiring = scheduler.engine.drafter, [], []
    real = drafter.draft

    def recorded(reqs, lengths):
        # The head's drafts are recorded, then replaced by the plain continuation, wrong at its
        # end every other time: accepted pairs are then rewritten from the main model's states,
        # which the later drafts read.
        out = []
        for req, drafts in zip(reqs, real(reqs, lengths)):
            seen.append((list(req.all_ids), drafts))
            uid = prompts.index(req.prompt_ids)
            done = len(req.output_ids)
            oracle = plain[uid][done : done + len(drafts)]
            if uid == 2:
                oracle, retiring[:] = [t + 1 for t in oracle], [req]
            elif len(seen) % 2:
                oracle[-1] += 1
            out.append(oracle)
        return out

    passes, steps = [], 0
    store = loaded.model.mtp.store
    monkeypatch.setattr(drafter, "draft", recorded)
    monkeypatch.setattr(loaded.model.mtp, "store", lambda *a: passes.append(len(a[-1].input_ids)) or store(*a))
    forward = scheduler.engine.forward_batch

    def counted(batch):
        nonlocal steps
        steps += 1
        return forward(batch)

    monkeypatch.setattr(scheduler.engine, "forward_batch", counted)
    assert _greedy(scheduler, prompts, lengths) == plain
    assert 0 < scheduler.stats()["spec_decode_num_accepted_tokens"] and len(seen) >= 4
    # Retired within its first steps; its last ones, alone, ran no pass.
    [late] = retiring
    assert not late.drafting and sum(ids[:4] == prompts[2] for ids, _ in seen) <= 8
    assert len(passes) < steps - 5
    reference = ReferenceMtp(folder)
    for ids, drafts in seen:
        assert drafts == reference.drafts(ids, len(drafts)), ids


@pytest.mark.slow
def test_mtp_is_refused_for_a_model_without_an_mtp_head(tiny_hybrid_path):
    with pytest.raises(ValueError, match="method 'mtp' needs a checkpoint with MTP weights"):
        build_scheduler(loaded_fp32(tiny_hybrid_path()), kv_slots=64, speculative=MTP)
