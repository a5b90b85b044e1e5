"""The tensor-parallel process group on torch.distributed: joining it (torchrun's conventions),
the collectives the sharded model calls (distributed/tensor_parallel.py) and the step plans rank
0 sends (engine/parallel.py), each failure raised as GroupLost.

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

    def send(self, message: object) -> None:
        """Rank 0: a step's plan (engine.StepPlan), None (a heartbeat) or a stop, to every other
        rank."""
        with self._timed():
            dist.broadcast_object_list([message], src=0, group=self.steps, device=torch.device("cpu"))
        self.last_sent = time.monotonic()

    def receive(self) -> object:
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
