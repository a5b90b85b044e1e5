"""vLLM's logit processors, applied by the sampler between the allowed_token_ids mask and
temperature, in vLLM v1's order: bad_words, min_tokens, logit_bias, then the penalties
(repetition, then frequency and presence).

Each processor touches few (row, id) entries: a ban list, a bias list, the distinct ids of a
row's history. So `LogitProcessing.build` lists those entries once per step and `apply` reads and
writes only them, with element-wise ops: a row's result never depends on the other rows, and a
row without these fields is not touched at all.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from freetoken.core import SamplingParams

_NEG_INF = float("-inf")

History = tuple[list[int], list[int]]  # (prompt ids, output ids so far)


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def long_tensor(*lists: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The lists' ints end to end in a long tensor on `device`, through an array: several times
    faster than torch.tensor on a list (~8x at 512 ints), which converts one object at a time."""
    buffer = array("q")
    for ids in lists:
        if isinstance(ids, list):
            buffer.fromlist(ids)  # twice extend's speed
        else:
            buffer.extend(ids)
    flat = torch.frombuffer(buffer, dtype=torch.long) if buffer else torch.empty(0, dtype=torch.long)
    return flat.to(device)


def _bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """Last ids of the words whose other ids end the output (vLLM's
    `_apply_bad_words_single_batch`: output ids only, never the prompt)."""
    banned = []
    for word in words:
        if len(word) > len(output) + 1:
            continue
        prefix = word[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def uses_processors(params: Sequence[SamplingParams]) -> bool:
    """Does any row use a logit processor (and so need its history)?"""
    return any(p.bad_words_token_ids or p.min_tokens > 0 or p.logit_bias or _uses_penalties(p)
               for p in params)


@dataclass
class Penalties:
    """One entry per distinct (row, id) of a penalised row's output, and of its prompt when it
    has a repetition penalty; each field is [N], aligned with `rows`."""

    rows: torch.Tensor  # long
    ids: torch.Tensor  # long
    repetition: torch.Tensor  # the row's repetition_penalty (1.0 leaves the logit as it is)
    frequency: torch.Tensor  # frequency_penalty * count in the output
    presence: torch.Tensor  # presence_penalty where the id is in the output, else 0

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[History], vocab_size: int,
              device: torch.device) -> Penalties | None:
        rows = [i for i, p in enumerate(params) if _uses_penalties(p)]
        rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
        # Each history token becomes the key row * V + id, counted 1 in the output, 0 in the
        # prompt (which only the repetition penalty reads); torch.unique merges them per row.
        keys, weights = [], []
        for chosen, part, weight in ((rows, 1, 1), (rep_rows, 0, 0)):
            lists = [histories[i][part] for i in chosen]
            ids = long_tensor(*lists)
            owner = torch.tensor(chosen, dtype=torch.long).repeat_interleave(
                torch.tensor([len(ids_) for ids_ in lists], dtype=torch.long))
            keys.append(owner * vocab_size + ids)
            weights.append(torch.full_like(ids, weight))
        unique, where = torch.unique(torch.cat(keys), return_inverse=True)
        if unique.numel() == 0:  # penalised rows with nothing in their history yet
            return None
        counts = torch.zeros_like(unique).index_add_(0, where, torch.cat(weights))
        entry_rows = unique // vocab_size

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32)[entry_rows]

        # float32 products, as vLLM's penalty * bin count on the device
        frequency = per_row([p.frequency_penalty for p in params]) * counts.float()
        presence = per_row([p.presence_penalty for p in params]) * (counts > 0).float()
        return cls(*(t.to(device) for t in (
            entry_rows, unique % vocab_size, per_row([p.repetition_penalty for p in params]),
            frequency, presence)))

    def apply(self, x: torch.Tensor) -> None:
        v = x[self.rows, self.ids]
        v = torch.where(v > 0, v / self.repetition, v * self.repetition)
        x[self.rows, self.ids] = v - self.frequency - self.presence


@dataclass
class LogitProcessing:
    """A batch's processor entries (None: no row needs that processor)."""

    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, bias)
    penalties: Penalties | None

    @classmethod
    def build(cls, params: list[SamplingParams], histories: list[History] | None,
              eos_token_ids: tuple[int, ...], vocab_size: int,
              device: torch.device) -> LogitProcessing | None:
        """None when no row uses a processor; else `histories` must be given."""
        if not uses_processors(params):
            return None
        assert histories is not None and len(histories) == len(params), "one history per row"

        def on_device(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        # bad_words and min_tokens both ban, so one index_put does them in either order.
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, (p, history) in enumerate(zip(params, histories)):
            ids = _bad_word_bans(p.bad_words_token_ids, history[1])
            if len(history[1]) < p.min_tokens:
                ids += p.stop_token_ids + ([] if p.ignore_eos else list(eos_token_ids))
            ban_rows += [i] * len(ids)
            ban_ids += ids
        banned = None
        if ban_ids:
            banned = on_device(ban_rows, torch.long), on_device(ban_ids, torch.long)

        biased = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        bias = None
        if biased:
            rows, ids, values = zip(*biased)
            bias = (on_device(rows, torch.long), on_device(ids, torch.long),
                    on_device(values, torch.float32))

        penalties = None
        if any(_uses_penalties(p) for p in params):
            penalties = Penalties.build(params, histories, vocab_size, device)
        if banned is None and bias is None and penalties is None:
            return None
        return cls(banned, bias, penalties)

    def apply(self, x: torch.Tensor) -> None:
        """Process fp32 logits `x` [B, V] in place."""
        if self.banned is not None:
            x[self.banned] = _NEG_INF
        if self.bias is not None:
            rows, ids, bias = self.bias
            x[rows, ids] += bias
        if self.penalties is not None:
            self.penalties.apply(x)
