"""One forward step: build the batch's tensors, run the model, sample."""

from __future__ import annotations

import torch

from freetoken.core import Batch, SamplingParams
from freetoken.engine.kv_pool import KVPool
from freetoken.engine.sample import Sampler, SampleOutput
from freetoken.models.llama import ForwardContext, SeqAttention


ROW_MULTIPLE = 4


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

    def build_context(self, batch: Batch) -> ForwardContext:
        ids, positions, out_slots, logit_rows, seqs = [], [], [], [], []
        logit_set = {id(r) for r in batch.logit_reqs}
        dev = self.device
        for req, new in zip(batch.reqs, batch.new_ids):
            total, q = req.num_computed, len(new)  # slots for `new` were appended before the step
            mask = None
            if 1 < q < total:  # a prompt chunk after cached context: causal with an offset
                mask = torch.arange(total)[None, :] <= torch.arange(total - q, total)[:, None]
                mask = mask.to(dev)
            seqs.append(SeqAttention(len(ids), q, torch.tensor(req.slots, device=dev), mask))
            ids += new
            positions += range(total - q, total)
            out_slots += req.slots[total - q :]
            if id(req) in logit_set:
                logit_rows.append(len(ids) - 1)
        # CPU GEMM kernels give a row different low bits when M < 4 or M % 4 != 0 (< 12); rows
        # padded to a multiple of 4 come out bit-identical whatever else is in the batch.
        pad = -len(ids) % ROW_MULTIPLE
        ids += [0] * pad
        positions += [0] * pad
        out_slots += [self.kv.scratch_slot] * pad
        logit_rows += [0] * (-len(logit_rows) % ROW_MULTIPLE)
        return ForwardContext(
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            out_slots=torch.tensor(out_slots, device=dev),
            seqs=seqs,
            logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            k_cache=self.kv.k,
            v_cache=self.kv.v,
        )
