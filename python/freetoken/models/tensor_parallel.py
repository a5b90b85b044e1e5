"""Tensor parallelism of the decoder of models/llama.py and its MoE families (qwen3_moe.py,
gpt_oss.py): a loaded model cut down to one rank's slices, before its linear layers are packed.

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
  gpt-oss's attention sinks follow their query heads.
- the embedding vocabulary-parallel (an id outside a rank's rows looks up zeros, then the sum);
  the LM head vocabulary-parallel, its logit rows gathered on every rank, so that the sampler,
  masks, grammars and logprobs see full rows.

Uneven splits are allowed (SmolLM2-135M: 3 kv heads over 2 ranks is 1 group and 2 groups),
the busiest rank setting the pace. `group` is engine.parallel.Group: `rank`, `world`,
`sum(x)` and `gather(x)` (concatenated along the last dimension).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.models.linear import Linear
from freetoken.models.llama import LlamaForCausalLM
from freetoken.models.moe import Experts


def even_part(n: int, rank: int, world: int) -> range:
    """`rank`'s part of n items cut into `world` contiguous parts that differ by one at most."""
    return range(rank * n // world, (rank + 1) * n // world)


def head_split(heads: int, kv_heads: int, rank: int, world: int) -> tuple[range, range]:
    """(query heads, kv heads) that `rank` holds."""
    per_group = heads // kv_heads
    if world <= kv_heads:
        kv = even_part(kv_heads, rank, world)
        return range(kv.start * per_group, kv.stop * per_group), kv
    group = rank * kv_heads // world
    sharing = [r for r in range(world) if r * kv_heads // world == group]
    if per_group < len(sharing):
        raise ValueError(f"{world} ranks cannot split {heads} attention heads "
                         f"({kv_heads} kv heads): every rank needs one query head at least")
    q = even_part(per_group, sharing.index(rank), len(sharing))
    first = group * per_group
    return range(first + q.start, first + q.stop), range(group, group + 1)


class RowParallelLinear(Linear):
    """A slice of a linear layer's input features; the partial outputs are summed over ranks."""

    def __init__(self, part: Linear, group):
        super().__init__(part.in_features, part.out_features, bias=part.bias is not None, device="meta")
        _set(self, part.weight, part.bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.sum(super().forward(x))


class VocabParallelHead(Linear):
    """The LM head's rows of one vocabulary part (padded to the same count on every rank), with
    the logits of all parts gathered and cut back to the vocabulary."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = weight  # a tied embedding's Parameter stays shared
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.gather(super().forward(x))[:, : self.vocab_size]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, rows: range, group):
        super().__init__()
        self.weight, self.rows, self.group = weight, rows, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        # Exact zeros: the sum gives every id the bits of its own row.
        return self.group.sum(x.masked_fill_(outside[:, None], 0))


def _set(layer: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)


def _rows(layer: nn.Linear, rows: torch.Tensor) -> Linear:
    return _linear(layer.weight[rows], None if layer.bias is None else layer.bias[rows])


def _cols(layer: nn.Linear, cols: torch.Tensor, rank: int) -> Linear:
    # The bias is added once, by rank 0, before the sum.
    return _linear(layer.weight[:, cols], layer.bias if rank == 0 else None)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    _set(layer, weight, bias)
    return layer


def _span(start: int, part: range, size: int) -> torch.Tensor:
    """Indices of the rows of items `part` of a block of items `size` rows each at `start`."""
    return torch.arange(start + part.start * size, start + part.stop * size)


def shard_model(model: nn.Module, group) -> None:
    """Keep `group.rank`'s slices of `model` (loaded whole, not yet packed), in place."""
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"{type(model).__name__} does not support tensor parallelism")
    cfg, rank, world = model.cfg, group.rank, group.world
    q, kv = head_split(cfg.num_heads, cfg.num_kv_heads, rank, world)
    d, heads, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qkv_rows = torch.cat([_span(0, q, d), _span(heads * d, kv, d), _span((heads + kvh) * d, kv, d)])
    # Per-rank head counts, which attention reads; vocab_size stays whole (the sampler works on
    # gathered rows), and feed-forward sizes are read off each layer (experts' differ).
    model.cfg = replace(cfg, num_heads=len(q), num_kv_heads=len(kv))
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.cfg = model.cfg
        attn.qkv_proj = _rows(attn.qkv_proj, qkv_rows)
        attn.o_proj = RowParallelLinear(_cols(attn.o_proj, _span(0, q, d), rank), group)
        if hasattr(attn, "sinks"):  # gpt-oss: one per query head
            attn.sinks = nn.Parameter(attn.sinks[q.start : q.stop].clone(), requires_grad=False)
        if isinstance(mlp, Experts):
            for expert in mlp.experts:
                _shard_feed_forward(expert, group, summed=False)
            mlp.sum_over_ranks = group.sum  # once, after the experts' weighted sum
        else:
            _shard_feed_forward(mlp, group, summed=True)
    _shard_vocabulary(model, group)


def _shard_feed_forward(block: nn.Module, group, summed: bool) -> None:
    """`group.rank`'s part of the intermediate size: the same rows of the gate and up halves of
    `gate_up_proj` ([gate | up]), those columns of `down_proj`, summed over the ranks if
    `summed`."""
    size = block.down_proj.in_features
    inter = _span(0, even_part(size, group.rank, group.world), 1)
    block.gate_up_proj = _rows(block.gate_up_proj, torch.cat([inter, inter + size]))
    down = _cols(block.down_proj, inter, group.rank)
    block.down_proj = RowParallelLinear(down, group) if summed else down


def _shard_vocabulary(model: LlamaForCausalLM, group) -> None:
    vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
    per_rank = -(-vocab // group.world)
    rows = range(min(vocab, group.rank * per_rank), min(vocab, (group.rank + 1) * per_rank))

    def part(weight: torch.Tensor) -> nn.Parameter:
        # Zero rows pad the last part, so that every rank gathers the same logit columns.
        padded = weight.new_zeros(per_rank, hidden)
        padded[: len(rows)] = weight[rows.start : rows.stop]
        return nn.Parameter(padded, requires_grad=False)

    embedding = part(model.model.embed_tokens.weight)
    head = embedding if model.cfg.tie_word_embeddings else part(model.lm_head.weight)
    model.model.embed_tokens = VocabParallelEmbedding(embedding, rows, group)
    model.lm_head = VocabParallelHead(head, vocab, group)
