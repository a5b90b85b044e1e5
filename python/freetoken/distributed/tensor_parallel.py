"""Tensor parallelism of the decoder of models/llama.py and its MoE families (qwen3_moe.py,
gpt_oss.py): the model, built on the meta device, cut down to one rank's layers
(`shard_model`), whose weights are then read from the checkpoint as the slices that rank keeps
(`RankPart`): no rank reads, nor holds, more than its share of the sliced layers.

Megatron's split, each rank keeping:
- q/k/v (fused `qkv_proj`, rows [q heads | k heads | v heads]) column-parallel by kv-head
  groups: a rank holds whole groups (a kv head and its query heads), as evenly as the number of
  groups allows, so every rank attends with plain GQA. With fewer kv heads than ranks, each kv
  head is replicated on the ranks that split its query heads.
- `o_proj` row-parallel on the same heads, its partial outputs summed over the ranks.
- gate/up (fused `gate_up_proj`, rows [gate | up]) column-parallel, both halves on the same
  rows of the intermediate size; `down_proj` row-parallel, summed.
- MoE layers: every expert split as gate/up and down are (sharded experts, not expert
  parallelism), the router whole on every rank, so all ranks route alike; the ranks' partial
  outputs are summed once, after the experts' weighted sum, expert down biases on rank 0 only.
  Experts stored in blocks along the intermediate size (gpt-oss's MXFP4: the family's
  `experts_block`; a GGUF's experts: their down projection's block) are split along whole
  blocks, as evenly as the block count allows.
  gpt-oss's attention sinks follow their query heads.
- the embedding vocabulary-parallel (an id outside a rank's rows looks up zeros, then the sum);
  the LM head vocabulary-parallel, its logit rows gathered on every rank, so that the sampler,
  masks, grammars and logprobs see full rows.

Uneven splits are allowed (SmolLM2-135M: 3 kv heads over 2 ranks is 1 group and 2 groups),
the busiest rank setting the pace. `group` is distributed.group.Group: `rank`, `world`,
`sum(x)` and `gather(x)` (concatenated along the last dimension).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.mxfp4 import BLOCK as MXFP4_BLOCK
from freetoken.kernels.quant import QuantizedWeight
from freetoken.layers.linear import Linear
from freetoken.layers.moe import Experts
from freetoken.layers.skeleton import on_meta
from freetoken.distributed.parts import block_part, even_part, head_split, scaled, vocab_part


class Summed:
    """A layer (mixed in before it) whose partial outputs are summed over the ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.sum(super().forward(x))


class Gathered:
    """An LM head (mixed in before it) of one vocabulary part (padded to the same count on every
    rank), the logits of all parts gathered and cut back to the vocabulary."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather(super().forward(x))[:, : self.vocab_size]

    def logits_at(self, x: torch.Tensor, columns: list[int]) -> None:
        return None  # a rank holds a slice of the vocabulary: every rank runs the whole gather


class VocabRows:
    """An embedding (mixed in before its lookup) of one vocabulary part: an id outside it looks
    up exact zeros, so that the sum gives every id the bits of its own row."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        x = super().forward(local.masked_fill(outside, 0))
        return self.group.sum(x.masked_fill_(outside[..., None], 0))


class RowParallelLinear(Summed, Linear):
    """A slice of a linear layer's input features; the partial outputs are summed over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group):
        with on_meta():
            super().__init__(in_features, out_features, bias=bias)
        self.group = group


class VocabParallelHead(Gathered, Linear):
    def __init__(self, weight: nn.Parameter, vocab_size: int, group):
        with on_meta():
            super().__init__(weight.shape[1], weight.shape[0], bias=False)
        self.weight = weight  # a tied embedding's Parameter stays shared
        self.vocab_size, self.group = vocab_size, group


class Embedding(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(VocabRows, Embedding):
    def __init__(self, weight: nn.Parameter, rows: range, group):
        super().__init__(weight)
        self.rows, self.group = rows, group


def _meta_linear(in_features: int, out_features: int, bias: bool) -> Linear:
    with on_meta():
        return Linear(in_features, out_features, bias=bias)


def shard_model(model: nn.Module, group) -> RankPart:
    """Cut `model` (a models/llama.py decoder or a family built on it, on the meta device) down
    to `group.rank`'s layers, in place; returns what that rank reads of each checkpoint tensor."""
    cfg, rank, world = model.cfg, group.rank, group.world
    q, kv = head_split(cfg.num_heads, cfg.num_kv_heads, rank, world)
    d = cfg.head_dim
    # Per-rank head counts, which attention reads; vocab_size stays whole (the sampler works on
    # gathered rows), and feed-forward sizes are read off each layer (experts' differ).
    model.cfg = replace(cfg, num_heads=len(q), num_kv_heads=len(kv))
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.cfg = model.cfg
        attn.qkv_proj = _meta_linear(cfg.hidden_size, (len(q) + 2 * len(kv)) * d,
                                     attn.qkv_proj.bias is not None)
        # The bias is added once, by rank 0, before the sum.
        attn.o_proj = RowParallelLinear(len(q) * d, cfg.hidden_size,
                                        attn.o_proj.bias is not None and rank == 0, group)
        if hasattr(attn, "sinks"):  # gpt-oss: one per query head
            attn.sinks = nn.Parameter(torch.empty(len(q), device="meta"))
        if isinstance(mlp, Experts):
            for expert in mlp.experts:
                _shard_feed_forward(expert, group, summed=False, block=model.experts_block)
            mlp.sum_over_ranks = group.sum  # once, after the experts' weighted sum
        else:
            _shard_feed_forward(mlp, group, summed=True)
    vocab_rows, vocab_part = _shard_vocabulary(model, group)
    return RankPart(rank, world, q, kv, d, vocab_rows, vocab_part, cfg.num_heads, cfg.num_kv_heads,
                    experts_in_out=model.experts_in_out, experts_block=model.experts_block)


def _shard_feed_forward(layer: nn.Module, group, summed: bool, block: int = 1) -> None:
    """`group.rank`'s part of the intermediate size (whole blocks of `block`): the same rows of
    the gate and up halves of `gate_up_proj` ([gate | up]), those columns of `down_proj`,
    summed over the ranks if `summed`; the down bias on rank 0 only."""
    hidden, size = layer.down_proj.out_features, layer.down_proj.in_features
    part = len(block_part(size, group.rank, group.world, block))
    layer.gate_up_proj = _meta_linear(hidden, 2 * part, layer.gate_up_proj.bias is not None)
    bias = layer.down_proj.bias is not None and group.rank == 0
    layer.down_proj = (RowParallelLinear(part, hidden, bias, group) if summed
                       else _meta_linear(part, hidden, bias))


def _shard_vocabulary(model: nn.Module, group) -> tuple[range, int]:
    vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
    rows, per_rank = vocab_part(vocab, group.rank, group.world)
    embedding = nn.Parameter(torch.empty(per_rank, hidden, device="meta"))
    head = embedding if model.cfg.tie_word_embeddings else nn.Parameter(torch.empty(per_rank, hidden, device="meta"))
    model.model.embed_tokens = VocabParallelEmbedding(embedding, rows, group)
    model.lm_head = VocabParallelHead(head, vocab, group)
    return rows, per_rank


@dataclass(frozen=True)
class RankPart:
    """What one rank reads of each checkpoint tensor (transformers' names, before the family's
    conversion: q/k/v, gate/up are separate, or fused as Phi-3 stores them; experts per expert or
    stacked)."""

    rank: int
    world: int
    q: range  # query heads
    kv: range  # kv heads
    head_dim: int
    vocab_rows: range
    vocab_part: int  # rows per rank, the last part padded with zeros
    heads: int  # the model's, of which q and kv are this rank's
    kv_heads: int
    # Stacked experts ([E, ...]) come [E, out, in] with gate then up (Qwen), or [E, in, out] with
    # gate and up interleaved (gpt-oss, whose MXFP4 blocks are [E, out, in / 32, 16]); a GGUF's
    # as three tensors [E, out, in] (`experts.{gate,up,down}_proj.weight`).
    experts_in_out: bool = False
    experts_block: int = 1  # stacked experts' intermediate size is split in whole blocks of this

    def __call__(self, name: str, stored) -> torch.Tensor | None:
        """The piece of tensor `name` this rank keeps, read from `stored` (a
        models/checkpoint.py StoredTensor); None for a bias another rank adds."""
        shape = stored.shape
        leaf = name.rpartition(".")[2]
        module = name.rpartition(".")[0].rpartition(".")[2]
        d = self.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return _padded(stored.read(0, [self.vocab_rows]), self.vocab_part)
        if ".self_attn." in name:
            if module == "q_proj":
                return stored.read(0, [scaled(self.q, d)])
            if module in ("k_proj", "v_proj"):
                return stored.read(0, [scaled(self.kv, d)])
            if module == "qkv_proj":  # [q heads | k heads | v heads]
                k, v = self.heads, self.heads + self.kv_heads
                return stored.read(0, [scaled(self.q, d), scaled(range(k + self.kv.start, k + self.kv.stop), d),
                                       scaled(range(v + self.kv.start, v + self.kv.stop), d)])
            if module == "o_proj":
                return stored.read(1, [scaled(self.q, d)]) if leaf == "weight" else self._rank0(stored)
            if leaf == "sinks":
                return stored.read(0, [self.q])
            return stored.read()
        if ".shared_expert" in name or ".mlp." not in name:
            return stored.read()  # norms, routers, shared experts (Qwen's, GLM's): whole on every rank
        # A GGUF's experts, [E, out, in] (biases [E, out]): their part of each expert's rows or K.
        stacked = name.rpartition(".")[0].rpartition(".")[0].endswith(".experts")
        if module in ("gate_proj", "up_proj"):
            return stored.read(1 if stacked else 0, [(self._expert_part if stacked else self._part)(shape[int(stacked)])])
        if module == "gate_up_proj" and not stacked:  # [gate | up]
            half = shape[0] // 2
            part = self._part(half)
            return stored.read(0, [part, range(half + part.start, half + part.stop)])
        if module == "down_proj":
            if leaf != "weight":
                return self._rank0(stored)
            return stored.read(2, [self._expert_part(shape[2])]) if stacked else stored.read(1, [self._part(shape[1])])
        return self._stacked(leaf, shape, stored)

    def _stacked(self, leaf: str, shape: tuple[int, ...], stored) -> torch.Tensor | None:
        """A stacked expert tensor `experts.<leaf>`."""
        if leaf == "down_proj_bias":
            return self._rank0(stored)
        if leaf.startswith("gate_up_proj"):
            if self.experts_in_out:  # interleaved: a part's gate and up columns are adjacent
                dim = 2 if leaf == "gate_up_proj" else 1
                part = self._expert_part(shape[dim] // 2)
                return stored.read(dim, [range(2 * part.start, 2 * part.stop)])
            half = shape[1] // 2
            part = self._expert_part(half)
            return stored.read(1, [part, range(half + part.start, half + part.stop)])
        if leaf in ("down_proj_blocks", "down_proj_scales"):
            part = self._expert_part(shape[2] * MXFP4_BLOCK)
            if part.start % MXFP4_BLOCK or part.stop % MXFP4_BLOCK:
                raise ValueError(f"{self.world} ranks split an MXFP4 intermediate size of "
                                 f"{shape[2] * MXFP4_BLOCK} within a block of {MXFP4_BLOCK}")
            return stored.read(2, [range(part.start // MXFP4_BLOCK, part.stop // MXFP4_BLOCK)])
        if leaf == "down_proj":
            dim = 1 if self.experts_in_out else 2
            return stored.read(dim, [self._expert_part(shape[dim])])
        return stored.read()

    def _part(self, size: int) -> range:
        return even_part(size, self.rank, self.world)

    def _expert_part(self, size: int) -> range:
        return block_part(size, self.rank, self.world, self.experts_block)

    def _rank0(self, stored) -> torch.Tensor | None:
        return stored.read() if self.rank == 0 else None


def _padded(rows: torch.Tensor | QuantizedWeight, count: int) -> torch.Tensor | QuantizedWeight:
    """`rows` with zero rows added up to `count` (zero bytes are zeros in every block format)."""
    missing = count - rows.shape[0]
    if not isinstance(rows, QuantizedWeight):
        return F.pad(rows, (0, 0, 0, missing))
    if not missing:
        return rows
    data = torch.cat([rows.data, rows.data.new_zeros(missing, rows.data.shape[1])])
    return QuantizedWeight(rows.qtype, data, (count, *rows.shape[1:]))
