"""ScriptedForCausalLM: a test model whose logits are a closed-form function of a script.

A request's output is chosen from the prompt and then read off a script, so engine, sampler,
logprob and parser tests know every token and every logprob in advance.

Folder format (config.json; tests/fixtures/build_models.py::build_scripted writes it)::

    {"architectures": ["ScriptedForCausalLM"], "model_type": "scripted",
     "vocab_size": V,
     "scripted_logit": A,                  # default 10.0
     "base_logit": b,                      # default 0.0
     "alternatives": [[id, a_i], ...],     # default []
     "script": {"outputs": [{"trigger": "text" | null, "text": "..."},
                            {"trigger": "text" | null, "token_ids": [...]}, ...],
                "eos_token_id": id,        # default: the tokenizer's eos
                "cycle": false}}

plus the tokenizer files. Entry texts are encoded once at load with the folder's tokenizer
(add_special_tokens=False), so `<think>`, `</think>` and `<tool_call>` become their single ids.

Script selection: the prompt ids are decoded (special tokens kept) and the first entry whose
non-null trigger occurs in that text is used; otherwise the first entry with a null trigger;
otherwise the empty script. The scripted token at output position j = len(req.output_ids) is
t_j = script[j] while j < len(script); after that it is `eos_token_id`, or script[j % len] when
`cycle` is true.

Logits of the row: t_j gets A; each alternative id i != t_j gets a_i; every other id of the
vocabulary gets b. With n_alt the number of alternatives different from t_j:

    logprob(t_j) = A - log(e^A + sum_{alt != t_j} e^{a_i} + (V - 1 - n_alt) e^b)

and an alternative's logprob is the same expression with a_i in place of the leading A.

Prompt rows (Batch.prompt_rows, for prompt logprobs) have no scripted token: each alternative i
gets a_i and every other id b, whatever the position, so with n the number of alternatives

    logprob(i) = logit_i - log(sum_alt e^{a_i} + (V - n) e^b).

Only req.prompt_ids and req.output_ids are read; there is no state between calls.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch

from freetoken.core import Batch, Req
from freetoken.models.causal_lm import CausalLM

DEFAULT_SCRIPTED_LOGIT = 10.0
DEFAULT_BASE_LOGIT = 0.0


class ScriptTokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class ScriptEntry:
    trigger: str | None
    token_ids: tuple[int, ...]


class ScriptedForCausalLM(CausalLM):
    # Smallest KV geometry the engine can allocate a pool for; the pool is never read.
    num_layers = 1
    num_kv_heads = 1
    head_dim = 8

    def __init__(self, config: dict[str, Any], tokenizer: ScriptTokenizer | None = None) -> None:
        """Without a tokenizer the script is read by `post_load` (the loader's hook)."""
        super().__init__()
        self.config = config
        self.scripted_logit = float(config.get("scripted_logit", DEFAULT_SCRIPTED_LOGIT))
        self.base_logit = float(config.get("base_logit", DEFAULT_BASE_LOGIT))
        self.max_position_embeddings = int(config.get("max_position_embeddings", 8192))
        if tokenizer is not None:
            self.post_load(tokenizer, torch.float32, torch.device("cpu"))

    @classmethod
    def from_hf(cls, hf_config: dict) -> ScriptedForCausalLM:
        return cls(hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def post_load(self, tokenizer: ScriptTokenizer, dtype: torch.dtype, device: torch.device) -> None:
        """Encode the script's texts with the folder's tokenizer (it has no weights to load)."""
        config = self.config
        script = config.get("script") or {}
        eos = script.get("eos_token_id", tokenizer.eos_token_id)
        if eos is None:
            raise ValueError("scripted model needs script.eos_token_id or a tokenizer eos")
        self.eos_token_id = self._check_id(int(eos))
        self.cycle = bool(script.get("cycle", False))
        self.entries = [self._entry(e, tokenizer) for e in script.get("outputs") or []]

        alts = [(self._check_id(int(i)), float(a)) for i, a in config.get("alternatives") or []]
        if len({i for i, _ in alts}) != len(alts):
            raise ValueError(f"duplicate alternative ids: {alts}")
        # Buffers, so .to(device) moves them and the output follows.
        self.register_buffer("alt_ids", torch.tensor([i for i, _ in alts], dtype=torch.long, device=device),
                             persistent=False)  # fmt: skip
        self.register_buffer("alt_logits", torch.tensor([a for _, a in alts], dtype=torch.float32,
                                                        device=device), persistent=False)  # fmt: skip
        self.alternatives = dict(alts)
        self._tokenizer = tokenizer
        # The prompt never changes during a request; decode it once, not every step.
        self._script_for = lru_cache(maxsize=4096)(self._select)

    @classmethod
    def from_folder(
        cls, path: str | Path, tokenizer: ScriptTokenizer | None = None
    ) -> ScriptedForCausalLM:
        config = json.loads((Path(path) / "config.json").read_text())
        if config.get("model_type") != "scripted":
            raise ValueError(f"{path}: model_type {config.get('model_type')!r} is not 'scripted'")
        if tokenizer is None:  # transformers only where no tokenizer is given (the tests give one)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(config, tokenizer)

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        return token_id

    def _entry(self, raw: dict[str, Any], tokenizer: ScriptTokenizer) -> ScriptEntry:
        if ("text" in raw) == ("token_ids" in raw):
            raise ValueError(f"script entry needs exactly one of 'text' and 'token_ids': {raw}")
        trigger = raw.get("trigger")
        if trigger is not None and not isinstance(trigger, str):
            raise ValueError(f"trigger must be a string or null: {raw}")
        if "text" in raw:
            ids = tokenizer.encode(raw["text"], add_special_tokens=False)
        else:
            ids = raw["token_ids"]
        return ScriptEntry(trigger, tuple(self._check_id(int(i)) for i in ids))

    def _select(self, prompt_ids: tuple[int, ...]) -> tuple[int, ...]:
        text = self._tokenizer.decode(list(prompt_ids))
        for entry in self.entries:
            if entry.trigger is not None and entry.trigger in text:
                return entry.token_ids
        default = next((e for e in self.entries if e.trigger is None), None)
        return default.token_ids if default else ()

    def script_for(self, prompt_ids: list[int]) -> tuple[int, ...]:
        """The script a prompt selects (before eos / cycling)."""
        return self._script_for(tuple(prompt_ids))

    def scripted_token(self, req: Req) -> int:
        """t_j for j = len(req.output_ids)."""
        script, j = self.script_for(req.prompt_ids), len(req.output_ids)
        if j < len(script):
            return script[j]
        return script[j % len(script)] if self.cycle and script else self.eos_token_id

    def logprob(self, req: Req, token_id: int) -> float:
        """Closed-form logprob of `token_id` at the request's next position (see docstring)."""
        target = self.scripted_token(req)
        alts = {i: a for i, a in self.alternatives.items() if i != target}
        log_z = math.log(
            math.exp(self.scripted_logit)
            + sum(math.exp(a) for a in alts.values())
            + (self.vocab_size - 1 - len(alts)) * math.exp(self.base_logit)
        )
        if token_id == target:
            return self.scripted_logit - log_z
        return alts.get(token_id, self.base_logit) - log_z

    def forward(self, batch: Batch, ctx: object = None) -> torch.Tensor:
        """float32 logits, a row per batch.logit_reqs then per prompt row of batch.prompt_rows,
        [rows, vocab_size]; `ctx` (attention state) unused."""
        device = self.alt_ids.device
        targets = torch.tensor([self.scripted_token(r) for r in batch.logit_reqs],
                               dtype=torch.long, device=device)  # fmt: skip
        rows = len(targets) + sum(n for _, n in batch.prompt_rows)
        logits = torch.full((rows, self.vocab_size), self.base_logit,
                            dtype=torch.float32, device=device)  # fmt: skip
        if self.alt_ids.numel():
            logits.index_copy_(1, self.alt_ids, self.alt_logits.expand(rows, -1))
        # Written last, so an alternative equal to t_j is overridden by the scripted logit.
        logits[: len(targets)].scatter_(1, targets[:, None], self.scripted_logit)
        return logits
