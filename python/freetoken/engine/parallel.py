"""Tensor-parallel ranks on torch.distributed: the process group, the collectives the sharded
model calls (models/layers/tensor_parallel.py), and the step loop of the ranks other than 0.

Rank 0 runs the scheduler. Each step it sends the other ranks the step's plan (engine.StepPlan:
ids, positions, KV slots, attention groups' members, logit rows), then every rank builds the
same tensors and runs the forward on its slices; the logit rows are gathered on every rank and
only rank 0 samples. When idle, rank 0 sends a heartbeat at least every HEARTBEAT_S, so that a
rank waiting for its next step can tell a quiet group from a lost one.

Failures: a collective that fails (a rank died: gloo sees its sockets close at once) or waits
past `--distributed-timeout` (a rank hung) raises GroupLost in every rank still alive. It is
not an Exception, so the scheduler's per-request fault handling lets it through: the process
exits, which takes the rest of the group down the same way, and the server answers 503.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from freetoken.config import ParallelConfig
from freetoken.engine.engine import Engine, StepPlan
from freetoken.models.registry import load_model, resolve_device

HEARTBEAT_S = 1.0
STOP = "stop"


class GroupLost(BaseException):
    """A collective failed: a rank of the group died or hung."""


def _backend(config: ParallelConfig, device: torch.device) -> str:
    choice = config.backend if config.backend != "auto" else (
        "nccl" if device.type == "cuda" else "gloo")
    # NCCL carries the forward's tensors; gloo the step plans, which are Python objects.
    return "cpu:gloo,cuda:nccl" if choice == "nccl" else "gloo"


@dataclass
class Group:
    rank: int
    world: int
    steps: dist.ProcessGroup  # the forward's collectives and the step plans, timeout_s each
    last_sent: float = 0.0
    # Collectives run and seconds spent in them, waits for the other ranks included
    # (scripts/bench_engine.py --tensor-parallel-size).
    collectives: int = 0
    collective_s: float = 0.0

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            with self._timed():
                dist.all_reduce(x, group=self.steps)
            return x
        # Gathered, then added in rank order on every rank: an all-reduce's order depends on the
        # tensor's size (its ring chunks) past 2 ranks, which would make a row's bits depend on
        # the number of rows in the step.
        parts = self._all_gather(x)
        out = parts[0]
        for part in parts[1:]:
            out += part
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, concatenated along the last dimension in rank order."""
        return torch.cat(self._all_gather(x), dim=-1)

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        with self._timed():
            dist.all_gather(parts, x.contiguous(), group=self.steps)
        return parts

    def send(self, message: StepPlan | str | None) -> None:
        """Rank 0: a step's plan, None (a heartbeat) or STOP, to every other rank."""
        with self._timed():
            dist.broadcast_object_list([message], src=0, group=self.steps, device=torch.device("cpu"))
        self.last_sent = time.monotonic()

    def receive(self) -> StepPlan | str | None:
        box = [None]
        with _lost():
            dist.broadcast_object_list(box, src=0, group=self.steps, device=torch.device("cpu"))
        return box[0]

    @contextmanager
    def _timed(self):
        start = time.perf_counter()
        with _lost():
            yield
        self.collectives += 1
        self.collective_s += time.perf_counter() - start

    def setup_barrier(self) -> None:
        """Every rank is ready (with the setup timeout: the slowest load is waited for)."""
        with _lost():
            dist.all_reduce(torch.zeros(1))


@contextmanager
def _lost():
    """A failed collective becomes GroupLost."""
    try:
        yield
    except RuntimeError as exc:
        raise GroupLost(f"tensor-parallel group lost: {exc}") from exc


def init_group(config: ParallelConfig, rank: int, device: torch.device) -> Group:
    """Join the group with torchrun's conventions: rank 0 hosts the store at master_addr:port."""
    setup = timedelta(seconds=config.setup_timeout_s)
    backend = _backend(config, device)
    store = dist.TCPStore(config.master_addr, config.master_port, config.tp_size,
                          is_master=rank == 0, timeout=setup)
    with _lost():
        dist.init_process_group(backend, store=store, rank=rank, world_size=config.tp_size,
                                timeout=setup)
        steps = dist.new_group(backend=backend, timeout=timedelta(seconds=config.timeout_s))
    return Group(rank, config.tp_size, steps)


def rank_device(device: torch.device, rank: int, config: ParallelConfig) -> torch.device:
    """A CUDA rank takes the GPU of its local index."""
    if device.type != "cuda":
        return device
    index = rank - config.local_ranks.start
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


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
