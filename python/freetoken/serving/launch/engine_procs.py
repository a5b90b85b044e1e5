"""The engine processes of one machine: spawned (one per tensor-parallel rank), waited for while
they load, told to stop, and why one ended. Both `freetoken serve` (serving/launch/serve.py) and a
node other than 0 (serving/launch/node.py) run them."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing import connection

from freetoken.config import EngineConfig
from freetoken.scheduler.worker import engine_main, rank_main

log = logging.getLogger("freetoken")

ENGINE_EXIT_TIMEOUT_S = 5.0


class Interrupted(KeyboardInterrupt):
    """SIGTERM before the HTTP server runs (or on a node that runs none): unwind like Ctrl-C so
    the cleanup runs."""


def raise_interrupted(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def start_engine(config: EngineConfig, ipc_dir: str, procs: list) -> tuple[str, str]:
    """Spawn this node's engine processes and wait until they have loaded (spawn_engine, then
    wait_engine); returns (in_addr, out_addr) of rank 0's sockets."""
    return wait_engine(spawn_engine(config, ipc_dir, procs))


@dataclass
class Loading:
    """Engine processes spawned and loading: each one's ready pipe, and rank 0's addresses."""

    pending: dict
    in_addr: str
    out_addr: str


def spawn_engine(config: EngineConfig, ipc_dir: str, procs: list) -> Loading:
    """Spawn this node's engine processes, one per tensor-parallel rank (appended to `procs` at
    once, so that an interrupted start is still cleaned up), without waiting for them: the caller
    may do its own loading meanwhile."""
    in_addr, out_addr = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    ctx = mp.get_context("spawn")

    pending = {}
    for rank in config.parallel.local_ranks:
        # A one-way pipe, not a Queue: no semaphore for the resource tracker to watch, and an
        # engine that dies while loading shows as EOF instead of a wait forever.
        ready_recv, ready_send = ctx.Pipe(duplex=False)
        if rank == 0:
            target, args = engine_main, (config, in_addr, out_addr, ready_send, os.getpid())
        else:
            target, args = rank_main, (config, rank, ready_send, os.getpid())
        proc = ctx.Process(target=target, args=args, daemon=True,
                           name="freetoken-engine" + (f"-{rank}" if rank else ""))
        proc.start()
        procs.append(proc)
        ready_send.close()
        pending[ready_recv] = proc
    return Loading(pending, in_addr, out_addr)


def wait_engine(loading: Loading) -> tuple[str, str]:
    """(in_addr, out_addr) once every rank of `loading` has loaded its model; RuntimeError with
    the first failure's reason otherwise."""
    pending = loading.pending
    # Any order: a rank that fails to load is reported at once, not after the others' waits.
    while pending:
        for ready_recv in connection.wait(list(pending)):
            proc = pending.pop(ready_recv)
            try:
                status = ready_recv.recv()
            except EOFError:
                proc.join(timeout=5)
                status = (f"error: the engine process exited while loading the model "
                          f"({exit_reason(proc)})")
            finally:
                ready_recv.close()
            if status != "ok":
                raise RuntimeError(status.removeprefix("error: "))
    return loading.in_addr, loading.out_addr


def exit_reason(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


def stop_engine(proc, told_to_exit: bool) -> None:
    """Wait for an engine told to exit; kill one that was not or does not (it ignores
    SIGTERM and SIGINT, which reach it along with its server from a terminal or systemd)."""
    if told_to_exit:
        proc.join(timeout=ENGINE_EXIT_TIMEOUT_S)
        if proc.is_alive():
            log.warning("The engine process did not exit within %gs; killing it",
                        ENGINE_EXIT_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=5)
