"""Recurrent state of linear-attention layers, beside the KV pool (hybrid models).

A slot holds, for every linear layer, the conv state (the last K - 1 conv inputs) and the
delta-rule state [heads, k_dim, v_dim], the whole past of a request in a fixed size. A running
request owns one slot; the prefix cache owns snapshot slots (the state at a chunk boundary of
a cached prefix), copied into a request's own slot on a hit. Slots are preallocated with
`torch.empty`: untouched slots cost no memory.

A step never writes a slot while it runs: the layers stage their new states in the step's
`LinearContext` and the engine commits them once the step has sampled, so a step that raises
can be run again (request by request) from the states it started from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The delta rule's chunk: prompts run in chunks at multiples of it from the sequence start
# (layers/delta_rule.py), so a state snapshot on a boundary resumes bit for bit; the
# scheduler cuts prefills and takes snapshots there (scheduler/states.py).
CHUNK = 64  # as transformers' torch fallback and the FLA kernels


@dataclass(frozen=True)
class StateShape:
    layers: int  # linear-attention layers
    conv: tuple[int, int]  # (K - 1, conv channels)
    recurrent: tuple[int, int, int]  # (value heads, k_dim, v_dim)


@dataclass
class PrefillPiece:
    """A request's prompt tokens in this step: rows [row, row + n) of the step, from `start`."""

    row: int
    n: int
    start: int
    slot: int
    snapshots: dict[int, int]  # boundary position -> snapshot slot to fill


@dataclass
class LinearContext:
    pool: StatePool
    prefills: list[PrefillPiece]
    decode_rows: torch.Tensor | None  # [B] rows of decoding requests (a drafted one's first)
    decode_slots: torch.Tensor | None  # [B] their slots
    # Speculative verification: round j >= 1 runs row j of the decoding requests that have more
    # than j rows, (their indices among the B [m], their rows [m]), after round j - 1.
    draft_rounds: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    decoding: list = field(default_factory=list)  # the B requests (core.Req), in order
    # (layer, slots [n], conv [n, K-1, C], recurrent [n, H, dk, dv], round) written at commit;
    # a round j >= 1 entry also names its requests' indices among the B, to keep or drop.
    staged: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None]] = \
        field(default_factory=list)


class StatePool:
    def __init__(self, num_slots: int, shape: StateShape, dtype: torch.dtype, device: torch.device):
        self.shape, self.num_slots, self.device = shape, num_slots, device
        self.conv = [torch.empty((num_slots, *shape.conv), dtype=dtype, device=device)
                     for _ in range(shape.layers)]
        # fp32 whatever the weights: the state accumulates over the whole sequence.
        self.recurrent = [torch.empty((num_slots, *shape.recurrent), dtype=torch.float32, device=device)
                          for _ in range(shape.layers)]
        self._free = list(range(num_slots - 1, -1, -1))
        dtype_bytes = torch.finfo(dtype).bits // 8
        conv = shape.conv[0] * shape.conv[1] * dtype_bytes
        heads, dk, dv = shape.recurrent
        self.slot_bytes = shape.layers * (conv + heads * dk * dv * 4)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        for tensors in (self.conv, self.recurrent):
            for t in tensors:
                t[dst].copy_(t[src])

    def commit(self, ctx: LinearContext, kept: torch.Tensor | None = None) -> None:
        """Write the step's states. `kept` [B]: rows each decoding request kept (drafts
        verified); a request keeps the state after its last kept row, so the rounds after it
        are dropped (rounds are staged in order: a later kept round overwrites an earlier)."""
        for layer, slots, conv, rec, round_, members in ctx.staged:
            if members is not None:
                keep = kept.index_select(0, members) > round_
                slots, conv, rec = slots[keep], conv[keep], rec[keep]
            self.conv[layer].index_copy_(0, slots, conv.to(self.conv[layer].dtype))
            self.recurrent[layer].index_copy_(0, slots, rec)
        ctx.staged.clear()
