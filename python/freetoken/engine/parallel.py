"""Tensor-parallel ranks: loading a rank's slices, rank 0's engine that sends each step's plan,
and the step loop of the ranks other than 0 (the group itself: distributed/group.py).

Rank 0 runs the scheduler. Each step it sends the other ranks the step's plan (engine.StepPlan:
ids, positions, KV slots, attention groups' members, logit rows), then every rank builds the
same tensors and runs the forward on its slices; the logit rows are gathered on every rank and
only rank 0 samples. When idle, rank 0 sends a heartbeat at least every HEARTBEAT_S, so that a
rank waiting for its next step can tell a quiet group from a lost one.
"""

from __future__ import annotations

import time

import torch

from freetoken.distributed.group import Group, GroupLost, init_group, rank_device
from freetoken.engine.engine import Engine
from freetoken.models.registry import load_model, resolve_device

HEARTBEAT_S = 1.0
STOP = "stop"


def share_cores(config) -> None:
    """A CPU rank takes its share of this machine's cores (`config` an EngineConfig): the ranks
    of a node each running torch's default of all cores would contend for them."""
    if resolve_device(config.device).type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // config.parallel.per_node))


def load_rank(config, rank: int):
    """This rank's slices of the model (`config` an EngineConfig): (LoadedModel, Group)."""
    device = rank_device(resolve_device(config.device), rank, config.parallel)
    group = init_group(config.parallel, rank, device)
    loaded = load_model(config.model_folder, dtype=config.dtype, device=str(device), group=group,
                        weights=config.weights)
    return loaded, group


class ParallelEngine(Engine):
    """Rank 0's engine: sends each step's plan to the other ranks before running it."""

    def __init__(self, *args, group: Group, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def run_model(self, batch):
        plan = self.plan(batch)
        self.group.send(plan)
        try:
            ctx = self.context(plan)
            return self.model(batch, ctx), ctx
        except Exception as exc:
            # The other ranks may be waiting in a collective of this forward: the group is out
            # of step, and a re-run of the step (the scheduler's fault isolation) would pair
            # its collectives with theirs.
            raise GroupLost(f"rank 0 failed within a forward: {type(exc).__name__}: {exc}") from exc

    def idle(self) -> None:
        if time.monotonic() - self.group.last_sent >= HEARTBEAT_S:
            self.group.send(None)

    def close(self) -> None:
        self.group.send(STOP)


def follow(engine: Engine, group: Group) -> None:
    """Ranks other than 0: run the forward of every plan rank 0 sends, until STOP."""
    with torch.inference_mode():
        while (message := group.receive()) != STOP:
            if message is not None:
                engine.model(None, engine.context(message))
