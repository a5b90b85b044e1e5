"""Build the engine-side scheduler (engine, KV pool, sampler) over a loaded model."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from freetoken.config import EngineConfig, context_length
from freetoken.engine.engine import Engine
from freetoken.models.registry import LoadedModel
from freetoken.scheduler.scheduler import Scheduler, SchedulerConfig
from freetoken.structured.grammar import ll_tokenizer
from freetoken.structured.matcher import GrammarCompiler

if TYPE_CHECKING:  # torch.distributed: imported by tensor-parallel engines only
    from freetoken.distributed.group import Group


def build_scheduler(loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                    group: Group | None = None, **overrides) -> Scheduler:
    """`overrides` replace fields of `config` (tests: `build_scheduler(m, kv_slots=64)`); the
    device and dtype are the loaded model's. `group`: rank 0 of a tensor-parallel group."""
    config = replace(config, **overrides)
    return Scheduler(build_engine(loaded, config, group), SchedulerConfig(
        max_model_len=context_length(config.max_model_len, loaded.max_model_len),
        eos_token_ids=tuple(loaded.eos_token_ids),
        max_running_requests=config.max_running_requests,
        max_prefill_tokens=config.max_prefill_tokens,
        prefix_cache=config.prefix_cache,
        speculative=config.speculative,
    ), GrammarCompiler(partial(ll_tokenizer, loaded.tokenizer, loaded.vocab_size,
                               list(loaded.eos_token_ids))))


def build_engine(loaded: LoadedModel, config: EngineConfig, group: Group | None = None) -> Engine:
    """The engine over a loaded model; `group`: rank 0 of a tensor-parallel group, which sends
    its steps to the other ranks."""
    args = (loaded.model, config.kv_slots, loaded.device, loaded.dtype, tuple(loaded.eos_token_ids))
    mtp = config.speculative is not None and config.speculative.method == "mtp"
    if mtp:
        check_mtp(loaded, group)
    if group is None:
        return Engine(*args, num_state_slots=config.max_running_requests + config.state_snapshots,
                      mtp=mtp)
    from freetoken.engine.parallel import ParallelEngine

    return ParallelEngine(*args, group=group)


def check_mtp(loaded: LoadedModel, group) -> None:
    """Refuse `method: mtp` for a model without an MTP head, or one this engine cannot draft with."""
    head = getattr(loaded.model, "mtp", None)
    arch = (loaded.hf_config.get("architectures") or ["?"])[0]
    if head is None:
        raise ValueError(f"--speculative-config: method 'mtp' needs a checkpoint with MTP weights "
                         f"(mtp.*, as Qwen3.5 and Qwen3-Next ship them); {loaded.name} ({arch}) has "
                         "none: use method 'ngram'")
    if len(head.layers) != 1 or group is not None:
        raise ValueError(f"--speculative-config: method 'mtp' drafts with a one-layer MTP head "
                         f"on one rank; {loaded.name} has {len(head.layers)} MTP layers")
