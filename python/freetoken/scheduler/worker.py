"""The engine process: receive requests over ZMQ, step the scheduler, send results back."""

from __future__ import annotations

import os
import pickle
import traceback

import zmq

from freetoken.message import AbortMsg, ExitMsg, UserMsg
from freetoken.scheduler.scheduler import Scheduler


def serve_scheduler(scheduler: Scheduler, in_addr: str, out_addr: str) -> None:
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    parent = os.getppid()
    while os.getppid() == parent:  # a server killed without cleanup must not leave us behind
        # Block only briefly when idle; otherwise take whatever arrived and keep stepping.
        timeout = 0 if scheduler.has_work else 1000
        replies = []
        while inbox.poll(timeout):
            msg = pickle.loads(inbox.recv())
            timeout = 0
            if isinstance(msg, ExitMsg):
                return
            if isinstance(msg, UserMsg):
                replies += scheduler.add(msg)
            elif isinstance(msg, AbortMsg):
                replies += scheduler.abort(msg.uid)
        replies += scheduler.step()
        if replies:
            outbox.send(pickle.dumps((replies, scheduler.stats())))


def engine_main(args, in_addr: str, out_addr: str, ready) -> None:
    """Entry point of the spawned engine process; `ready` receives "ok" or an error line."""
    try:
        from freetoken.llm import build_scheduler
        from freetoken.models.loader import load_model

        loaded = load_model(args.model_folder, dtype=args.dtype, device=args.device)
        scheduler = build_scheduler(
            loaded, dtype=args.dtype, device=args.device, kv_slots=args.kv_slots,
            max_model_len=args.max_model_len, max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens, prefix_cache=not args.no_prefix_cache,
        )
    except Exception as exc:  # reported to the launcher as one line, not a traceback
        ready.put(f"error: {exc}")
        traceback.print_exc()
        return
    ready.put("ok")
    serve_scheduler(scheduler, in_addr, out_addr)
