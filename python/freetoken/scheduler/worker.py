"""The engine process: receive requests over ZMQ, step the scheduler, send results back."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

import zmq

from freetoken.config import EngineConfig
from freetoken.message import AbortMsg, DetokenizeMsg, ExitMsg, UserMsg

if TYPE_CHECKING:  # torch: not imported before engine_main has tied us to the server
    from freetoken.scheduler.scheduler import Scheduler

log = logging.getLogger("freetoken.engine")

# A step that finished requests is often answered by their clients' next ones within a few ms (a
# benchmark's or a batch job's clients, each sending its next request on a reply). Stepping at
# once runs the few that came in meanwhile as a step of their own, which reads every weight for a
# handful of rows, the rest as the next one, and the two halves keep alternating. So while no
# request is mid-generation (no decode to delay), the engine waits for as many arrivals as the
# last step finished, at most a share of that step's time (GATHER_SHARE, up to GATHER_MAX_S):
# scoring workload A in docs/performance.md (measured: benchmarks/results/2026-12-02-xeon-amx.md,
# "bfloat16 scoring A"). A lone client's next request ends the wait at once.
GATHER_SHARE = 0.1
GATHER_MAX_S = 0.02


def _engine_error(uid: int, what: str, exc: BaseException) -> DetokenizeMsg:
    return DetokenizeMsg(uid, finished=True, finish_reason="error", error_code="engine_error",
                         error=f"Internal engine error while {what}: {type(exc).__name__}: {exc}")


def _held_uids(scheduler: Scheduler) -> list[int]:
    reqs = [*getattr(scheduler, "running", ()), *getattr(scheduler, "waiting", ())]
    return list(dict.fromkeys(r.uid for r in reqs))


def serve_scheduler(scheduler: Scheduler, in_addr: str, out_addr: str,
                    parent: int | None = None) -> None:
    # The model, tokenizer and imported modules live as long as the engine: frozen, the full
    # collections (every ~30 steps under scoring load) stop walking them (~130 ms a walk).
    gc.collect()
    gc.freeze()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    parent = os.getppid() if parent is None else parent
    # The frontend's /v1/stats and /metrics have the engine's stats before its first reply.
    outbox.send(pickle.dumps(([], scheduler.stats())))
    try:
        finished, step_s, arrived = 0, 0.0, 0
        # A server killed without cleanup must not leave us behind (PR_SET_PDEATHSIG does this
        # at once on Linux; this check is the portable fallback, within a second).
        while os.getppid() == parent:
            # Block only briefly when idle; otherwise take whatever arrived and keep stepping.
            timeout = 0 if scheduler.has_work else 1000
            replies = []
            while inbox.poll(timeout):
                timeout = 0
                if (got := _receive(inbox, scheduler)) is None:
                    return
                replies += got[0]
                arrived += got[1]
            deadline = time.perf_counter() + min(GATHER_MAX_S, GATHER_SHARE * step_s)
            while (arrived < finished and not scheduler.running
                   and (left := deadline - time.perf_counter()) > 0
                   and inbox.poll(max(1, round(left * 1000)))):
                if (got := _receive(inbox, scheduler)) is None:
                    return
                replies += got[0]
                arrived += got[1]
            start = time.perf_counter()
            try:
                done = scheduler.step()
            except Exception as exc:
                # Last line of defence (the scheduler handles per-request faults itself): end
                # every request it holds with an error and keep serving.
                log.exception("engine: scheduler step failed")
                done = []
                for uid in _held_uids(scheduler):
                    replies.append(_engine_error(uid, "running the batch", exc))
                    _abort_quietly(scheduler, uid)
            step_s, arrived = time.perf_counter() - start, 0
            finished = sum(r.finished for r in done)
            replies += done
            if replies:
                outbox.send(pickle.dumps((replies, scheduler.stats())))
    finally:
        inbox.close(linger=0)
        outbox.close(linger=100)
        ctx.term()


def _receive(inbox: zmq.Socket, scheduler: Scheduler) -> tuple[list[DetokenizeMsg], int] | None:
    """Hand the scheduler the next message of `inbox`: its replies and the number of messages
    it held (a list of requests sent together, FrontendManager.send_many, counts each), or
    None for ExitMsg."""
    raw = inbox.recv()
    try:
        msg = pickle.loads(raw)
    except Exception:  # a bad message must not take the engine down
        log.exception("engine: dropped a message that failed to unpickle")
        return [], 1
    if isinstance(msg, ExitMsg):
        return None
    if isinstance(msg, list):
        return [reply for one in msg for reply in _guarded(scheduler, one)], len(msg)
    return _guarded(scheduler, msg), 1


def _guarded(scheduler: Scheduler, msg) -> list[DetokenizeMsg]:
    try:
        if isinstance(msg, UserMsg):
            return scheduler.add(msg)
        if isinstance(msg, AbortMsg):
            return scheduler.abort(msg.uid)
        log.error("engine: ignored a message of unknown type %s", type(msg).__name__)
    except Exception as exc:
        log.exception("engine: %s of request %s failed", type(msg).__name__, getattr(msg, "uid", "?"))
        if isinstance(msg, UserMsg):
            _abort_quietly(scheduler, msg.uid)  # whatever part of it the scheduler kept
            return [_engine_error(msg.uid, "admitting the request", exc)]
    return []


def _abort_quietly(scheduler: Scheduler, uid: int) -> None:
    try:
        scheduler.abort(uid)
    except Exception:
        log.exception("engine: aborting request %s failed", uid)


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process as soon as its parent exits, whatever it is
    blocked on (a forward, a load). Elsewhere the parent-pid check in the loop does it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _detach(parent: int | None) -> bool:
    """Tie this engine process to the server; False if the server is gone already."""
    die_with_parent()
    if parent is not None and os.getppid() != parent:
        return False  # the server went away before the line above took effect
    # Ctrl-C reaches the whole process group and systemd's SIGTERM the whole cgroup: the server
    # decides when the engine stops (ExitMsg, or kill), so in-flight requests can drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The one line that names the CPU and the kernel each op runs on (kernels/plan.py).
    logging.getLogger("freetoken.kernels.plan").setLevel(logging.INFO)
    return True


def engine_main(config: EngineConfig, in_addr: str, out_addr: str, ready,
                parent: int | None = None) -> None:
    """Entry point of the spawned engine process (tensor-parallel rank 0); `ready` (the sending
    end of a one-way pipe) gets "ok" or an error line. `parent` is the server's pid."""
    if not _detach(parent):
        return
    group = None
    try:
        # torch and the model code load only now that _detach has tied this process to the server.
        from freetoken.models.registry import load_model, quiet_progress_bars
        from freetoken.scheduler.factory import build_scheduler

        quiet_progress_bars()
        if config.parallel.tp_size > 1:
            from freetoken.engine.parallel import load_rank, share_cores

            share_cores(config)
            loaded, group = load_rank(config, 0)
        else:
            loaded = load_model(config.model_folder, dtype=config.dtype, device=config.device,
                                kv_slots=config.kv_slots, weights=config.weights)
        scheduler = build_scheduler(loaded, config, group)
        if group is not None:
            group.setup_barrier()
    except BaseException as exc:  # GroupLost too; reported to the launcher as one line
        ready.send(f"error: {exc}")
        traceback.print_exc()
        return
    ready.send("ok")
    ready.close()
    if group is None:
        serve_scheduler(scheduler, in_addr, out_addr, parent)
        return
    from freetoken.distributed.group import GroupLost

    try:
        serve_scheduler(scheduler, in_addr, out_addr, parent)
        scheduler.engine.close()  # the other ranks stop too
    except GroupLost as exc:
        log.error("engine: %s", exc)
        sys.exit(1)


def rank_main(config: EngineConfig, rank: int, ready, parent: int | None = None) -> None:
    """Entry point of a tensor-parallel rank other than 0: load its slices, then run the steps
    rank 0 sends until it stops. Exits 1 when the group is lost."""
    if not _detach(parent):
        return
    try:
        # As in engine_main: torch loads once _detach has tied this process to the server.
        from freetoken.distributed.group import GroupLost
        from freetoken.engine.parallel import follow, load_rank, share_cores
        from freetoken.models.registry import quiet_progress_bars
        from freetoken.scheduler.factory import build_engine

        quiet_progress_bars()
        share_cores(config)
        loaded, group = load_rank(config, rank)
        engine = build_engine(loaded, config)
        group.setup_barrier()
    except BaseException as exc:  # GroupLost too
        ready.send(f"error: rank {rank}: {exc}")
        traceback.print_exc()
        sys.exit(1)
    ready.send("ok")
    ready.close()
    try:
        follow(engine, group)
    except GroupLost as exc:
        log.error("engine rank %d: %s", rank, exc)
        sys.exit(1)
