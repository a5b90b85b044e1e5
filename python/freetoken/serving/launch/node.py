"""`freetoken serve --nnodes N --node-rank K` on a machine other than node 0: start this
machine's tensor-parallel ranks, which join the group at --master-addr:--master-port, and wait
until the group ends. No HTTP here: node 0 serves it.

Exit status: 0 when node 0 stopped the group (its server shut down), 1 when the group was lost
(a rank died or hung) or a rank failed to load. SIGTERM / SIGINT stop the ranks, which takes the
group down: node 0's server answers 503 and exits 1 for its supervisor.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from freetoken.config import engine_config
from freetoken.paths import ModelNotFound
from freetoken.serving.launch.args import ServerArgs
from freetoken.serving.launch.engine_procs import exit_reason, raise_interrupted, start_engine, stop_engine

log = logging.getLogger("freetoken")


def serve_node(args: ServerArgs) -> int:
    # torch and the model code: only once the signal handler is in place (as launch.py's).
    from freetoken.models.registry import find_model

    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    procs: list = []
    try:
        try:
            folder, _ = find_model(args.model, args.hub, args.dtype, args.device)
            config = engine_config(args, str(folder))
            # No ipc folder: rank 0, whose sockets the addresses name, runs on node 0.
            start_engine(config, "", procs)
        except (ModelNotFound, RuntimeError) as exc:
            print(f"freetoken: {exc}", file=sys.stderr)
            return 1
        ranks = config.parallel.local_ranks
        log.info("Node %d: ranks %d-%d of %d joined the group at %s:%d; waiting for it to end",
                 args.node_rank, ranks.start, ranks.stop - 1, config.parallel.tp_size,
                 args.master_addr, args.master_port)
        while all(proc.is_alive() for proc in procs):
            time.sleep(0.2)
        for proc in procs:  # the others follow within the group's timeout
            proc.join(timeout=config.parallel.timeout_s + 5)
        failed = [proc for proc in procs if proc.exitcode != 0]
        if failed:
            log.error("Node %d: the tensor-parallel group was lost (%s)", args.node_rank,
                      exit_reason(failed[0]))
            return 1
        log.info("Node %d: the group ended", args.node_rank)
        return 0
    except KeyboardInterrupt as exc:
        log.info("Node %d: interrupted (%s); stopping its ranks", args.node_rank,
                 exc.args[0] if exc.args else "SIGINT")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for proc in procs:
            stop_engine(proc, told_to_exit=False)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
