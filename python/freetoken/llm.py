"""Offline API: the same scheduler, engine and sampler as the server, in this process."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from freetoken.config import EngineConfig
from freetoken.core import SamplingParams, TokenLogprob
from freetoken.message import UserMsg
from freetoken.models.registry import find_model, load_model
from freetoken.scheduler.factory import build_scheduler
from freetoken.tokenizer.reply import ReplyBuilder


@dataclass
class GenerationOutput:
    prompt_ids: list[int]
    token_ids: list[int]  # every sampled id, the ending EOS / stop id included
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob | None]
    error: str | None = None


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto", **kw):
        """`model`: a folder, a GGUF file or a Hub name (hub.py); `kw`: the other fields
        of `EngineConfig` (kv_slots, max_model_len, ...)."""
        folder, _ = find_model(model, dtype=dtype, device=device)
        config = EngineConfig(model_folder=str(folder), dtype=dtype, device=device, **kw)
        if config.parallel.tp_size > 1:
            raise ValueError("LLM runs in this process: tensor parallelism is `freetoken serve "
                             "--tensor-parallel-size N`")
        self.loaded = load_model(config.model_folder, dtype=config.dtype, device=config.device,
                                 kv_slots=config.kv_slots, weights=config.weights)
        self.tokenizer = self.loaded.tokenizer
        self.scheduler = build_scheduler(self.loaded, config)
        self._uids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt at once (batched by the scheduler), in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        outputs: dict[int, GenerationOutput] = {}
        builders: dict[int, ReplyBuilder] = {}
        for prompt, p in zip(prompts, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            uid = next(self._uids)
            outputs[uid] = GenerationOutput(ids, [], "", None, [])
            builders[uid] = ReplyBuilder(self.tokenizer, p.stop_strs)
            for msg in self.scheduler.add(UserMsg(uid, ids, replace(p))):
                outputs[uid].finish_reason, outputs[uid].error = msg.finish_reason, msg.error
        pending = {uid for uid, o in outputs.items() if o.finish_reason is None}
        while pending:
            for msg in self.scheduler.step():
                if msg.uid not in pending:
                    continue  # the abort ack of a request a stop string already ended
                out, reply = outputs[msg.uid], builders[msg.uid].build(msg)
                out.token_ids += msg.token_ids
                out.logprobs += msg.logprobs
                out.text += reply.incremental_output
                if reply.finished:
                    out.finish_reason, out.error = reply.finish_reason, msg.error
                    pending.discard(msg.uid)
                    if not msg.finished:
                        self.scheduler.abort(msg.uid)
        return list(outputs.values())
