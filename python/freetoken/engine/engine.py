"""One forward step: build the batch's tensors, run the model, sample."""

from __future__ import annotations

import torch

from freetoken.core import Batch, SamplingParams
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.sample import Sampler, SampleOutput
from freetoken.models.llama import MIN_QUERY_ROWS, DecodeGroup, ForwardContext, SeqAttention

# oneDNN computes a single row with a GEMV that rounds differently from the same row among
# others (models/linear.py): a step never has fewer rows than this.
MIN_ROWS = 2
# A decoding request's keys are padded to a multiple of this (see DecodeGroup).
DECODE_KV_BLOCK = 64


class Engine:
    def __init__(self, model: torch.nn.Module, num_kv_slots: int, device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.device = device
        cfg = getattr(model, "cfg", model)
        self.kv = KVPool(num_kv_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.sampler = Sampler(model.vocab_size, device)

    def new_generator(self, params: SamplingParams) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        return gen

    @torch.inference_mode()
    def forward_batch(self, batch: Batch, generators: list[torch.Generator]) -> SampleOutput:
        """Run `batch`; the caller has already given every new token a KV slot."""
        ctx = self.build_context(batch)
        logits = self.model(batch, ctx)[: len(batch.logit_reqs)]
        args = self.sampler.prepare([r.params for r in batch.logit_reqs], generators)
        return self.sampler.sample(logits, args)

    def _seq_attention(self, start: int, q: int, slots: list[int]) -> SeqAttention:
        """Attention of a chunk of prompt tokens."""
        total, dev = len(slots), self.device
        rows = list(range(start, start + q))
        rows += [rows[-1]] * (MIN_QUERY_ROWS - q)  # see SeqAttention: short blocks padded to 4
        mask = None  # a single query sees every key; a whole fresh prompt of >= 4 is plain causal
        if q > 1 and (q < total or len(rows) > q):
            # Query j sits at position total - q + j and sees keys up to it.
            positions = torch.arange(total - q, total)
            positions = torch.cat([positions, positions[-1:].expand(len(rows) - q)])
            mask = (torch.arange(total)[None, :] <= positions[:, None]).to(dev)
        return SeqAttention(start, q, torch.tensor(rows, device=dev),
                            torch.tensor(slots, device=dev), mask, causal=q > 1 and mask is None)

    def _decode_groups(self, decoding: list[tuple[int, list[int]]]) -> list[DecodeGroup]:
        by_length: dict[int, list[tuple[int, list[int]]]] = {}
        for row, slots in decoding:
            by_length.setdefault(-(-len(slots) // DECODE_KV_BLOCK) * DECODE_KV_BLOCK, []).append((row, slots))
        groups = []
        for length, members in by_length.items():
            table = [s for _, slots in members for s in slots + [self.kv.scratch_slot] * (length - len(slots))]
            lengths = torch.tensor([len(slots) for _, slots in members])
            valid = torch.arange(length)[None, :] < lengths[:, None]
            groups.append(DecodeGroup(
                rows=torch.tensor([row for row, _ in members], device=self.device),
                kv_slots=torch.tensor(table, device=self.device),
                valid=valid[:, None, None, :].to(self.device)))
        return groups

    def build_context(self, batch: Batch) -> ForwardContext:
        ids, positions, out_slots, logit_rows, seqs, decoding = [], [], [], [], [], []
        logit_set = {id(r) for r in batch.logit_reqs}
        dev = self.device
        for req, new in zip(batch.reqs, batch.new_ids):
            total, q = req.num_computed, len(new)  # slots for `new` were appended before the step
            # Prompt tokens always take the per-request path, so that a prompt whose last token
            # is all that is left after a prefix-cache hit gets the bits of a full prefill.
            if req.output_ids:
                decoding.append((len(ids), req.slots))
            else:
                seqs.append(self._seq_attention(len(ids), q, req.slots))
            ids += new
            positions += range(total - q, total)
            out_slots += req.slots[total - q :]
            if id(req) in logit_set:
                logit_rows.append(len(ids) - 1)
        pad = max(0, MIN_ROWS - len(ids))
        ids += [0] * pad
        positions += [0] * pad
        out_slots += [self.kv.scratch_slot] * pad
        logit_rows += [0] * max(0, MIN_ROWS - len(logit_rows))
        return ForwardContext(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            out_slots=torch.tensor(out_slots, device=dev),
            seqs=seqs,
            decode_groups=self._decode_groups(decoding),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            kv_cache=self.kv.kv,
        )
