"""What the engine hands the model with each step's batch: the tensors every layer reads, and the
groups in which requests attend (built by engine/engine.py, read by layers/attention.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PromptGroup:
    """Prompt chunks whose queries and keys are padded to the same lengths, attended in one call.

    Each member's queries are padded (repeating its last query) and its keys padded (masked,
    pointing at the pool's zeroed scratch slot) to lengths fixed by its own lengths alone
    (engine.PROMPT_QUERY_BLOCK, engine.PROMPT_KV_BLOCK): the batched call then gives each member
    the bits it gets alone, which a call padded to the batch's longest member does not.
    """

    shape: tuple[int, int, int]  # (B members, Q queries, L keys) each
    query_rows: torch.Tensor  # [B * Q] indices into the step's tokens, member after member
    kv_slots: torch.Tensor  # [B * L]
    mask: torch.Tensor | None  # [B, 1, Q, L] bool: the key is visible to the query; None: causal
    kept: torch.Tensor  # [N] positions in the flattened [B * Q] output of the real queries
    out_rows: torch.Tensor  # [N] their indices into the step's tokens
    window_mask: torch.Tensor | None = None  # [B, 1, Q, L] bool, for sliding-window layers
    # [N] (first, lo, hi) per real query, as DecodeGroup's: the pool kernel computes each prompt
    # row as it computes a decoding row, so a row's bits do not depend on which of the two it was
    # (a preempted request's recomputed rows, chunking, a prefix-cache hit).
    key_ranges: torch.Tensor | None = None
    window_key_ranges: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Decoding requests (one new token each) whose keys are padded to the same length.

    As PromptGroup; on torch's SDPA, with each kv head's queries folded into rows, padded to
    layers/attention.py's MIN_QUERY_ROWS.
    """

    rows: torch.Tensor  # [B] indices into the step's tokens
    kv_slots: torch.Tensor  # [B * L]: member after member, each padded to L
    valid: torch.Tensor  # [B, 1, 1, L] bool, False on padding
    window_valid: torch.Tensor | None = None  # as valid, for sliding-window layers
    # [B, 3] int64 on the CPU, for the pool attention kernel: each member's (first index of its
    # keys in kv_slots, first visible key, end of its keys); the window's, for sliding layers.
    key_ranges: torch.Tensor | None = None
    window_key_ranges: torch.Tensor | None = None


@dataclass
class ForwardContext:
    """Tensors the engine builds once per step for every layer.

    Greedy results must not depend on what else is in the batch (nor on whether a prefix came
    from the cache), so requests attend in groups built for that (PromptGroup, DecodeGroup).
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] pool slot that receives each token's K/V
    prompt_groups: list[PromptGroup]
    decode_groups: list[DecodeGroup]
    logit_rows: torch.Tensor  # [R] rows of T whose hidden state produces logits
    kv_cache: list[torch.Tensor]  # per layer [num_slots + 1, 2 * kv_heads, head_dim], K then V
    linear: Any = None  # hybrid models: engine.state_pool.LinearContext
    # Embeddings (engine/pooling.py): rows of T whose final-norm hidden states the forward also
    # leaves in `hidden`, for models with `supports_pooling`.
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    # Sorted vocabulary ids, where every logit row's mask allows these alone (allowed_token_ids):
    # the LM head may compute just them, returning [R, len(logit_columns)] logits; the sampler
    # takes the rest as -inf, as the masks make them (Engine.plan).
    logit_columns: list[int] | None = None
    mtp: Any = None  # with MTP drafting: engine.mtp.MtpPass
    # kernels/decoder_layer.py's arguments for this step, made by the first layer that
    # asks (False: the step's layers run in Python).
    layer_step: Any = None

    def merged_keys(self, tokens: int) -> StepKeys | None:
        """Every group's keys as one slot list and a range per row of the step's `tokens`, for a
        kernel that attends all the rows in one call; None where a group has no key ranges."""
        groups = [(g.out_rows, g) for g in self.prompt_groups] + [(g.rows, g) for g in self.decode_groups]
        if not groups or any(g.key_ranges is None for _, g in groups):
            return None
        windowed = all(g.window_key_ranges is not None for _, g in groups)
        ranges = torch.zeros(tokens, 3, dtype=torch.int64)  # a row in no group: no keys
        window = ranges.clone() if windowed else ranges
        offset = 0
        for rows, group in groups:
            shift = torch.tensor([offset, 0, 0])
            ranges[rows] = group.key_ranges + shift
            if windowed:
                window[rows] = group.window_key_ranges + shift
            offset += group.kv_slots.numel()
        slots = torch.cat([g.kv_slots for _, g in groups]).to(torch.int64)
        return StepKeys(slots, ranges, window)


@dataclass
class StepKeys:
    """A step's keys in one list (ForwardContext.merged_keys), as kernels/pool_attention.py
    reads them: row r's keys are slots[first + j] for j in [lo, hi) of ranges[r] = (first, lo, hi)."""

    slots: torch.Tensor  # int64, every group's kv_slots one after the other
    ranges: torch.Tensor  # [T, 3] int64
    window_ranges: torch.Tensor  # [T, 3] int64, for sliding-window layers (`ranges` without a window)
