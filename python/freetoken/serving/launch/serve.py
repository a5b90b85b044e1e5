"""`freetoken serve`: claim the port, resolve the model, start the engine process, serve HTTP,
and shut all of it down cleanly.

Lifecycle:
- The listening socket is bound first, so a busy port fails in a moment, before any loading.
- SIGTERM / SIGINT drain: new requests get 503 (code "shutdown"), requests in flight may finish
  for up to --shutdown-timeout seconds, the rest are ended with a 503, then uvicorn stops, the
  engine is told to exit (and killed if it does not), and the process exits 0. A second signal
  skips the wait; a third stops uvicorn without waiting for responses to flush.
- An engine that dies (OOM kill, segfault) ends the requests in flight with a 503 (code
  "engine_dead"); the server exits 1 a moment later so a supervisor restarts it.
- The engine's ZMQ ipc sockets live in a private `freetoken-<pid>-*` folder (mode 0700) in the
  temp dir, removed at exit; the engine dies with its parent (PR_SET_PDEATHSIG on Linux).

torch, transformers, fastapi and the model code are imported inside the functions that need
them: a busy port or a bad flag is reported before any of them loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace

from freetoken.config import engine_config, frontend_config
from freetoken.paths import ModelNotFound
from freetoken.serving.launch.args import ServerArgs, parse_args, resolve_parsers
from freetoken.serving.launch.engine_procs import (exit_reason, raise_interrupted, spawn_engine, stop_engine,
                                                   wait_engine)
from freetoken.serving.launch.node import serve_node

log = logging.getLogger("freetoken")

FLUSH_GRACE_S = 1.0  # after requests were ended with an error: time for those replies to leave
GRACEFUL_HTTP_SHUTDOWN_S = 3.0  # uvicorn's wait for open connections once requests are answered


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now: a second server on the same port fails here, before loading.
    Connections that arrive while the model loads wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if sys.platform != "win32":  # on Windows it would let two servers share the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


class _Steps:
    """The "Loading model" progress: a tqdm bar on a terminal, log lines otherwise."""

    def __init__(self, total: int):
        from freetoken.models.registry import progress_bars_wanted

        self.bar = None
        if progress_bars_wanted():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="Loading model", unit="step", file=sys.stderr)

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update()
        else:
            log.info("Loading model: %s", what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_frontend(args: ServerArgs, ipc_dir: str, procs: list):
    """Load the model's tokenizer and config, start the engine processes (into `procs`), and
    return the frontend."""
    from freetoken.models.registry import check_supported, find_model, quiet_progress_bars, read_config

    quiet_progress_bars()
    from freetoken.serving.pooling.config import pooling_config

    folder, name = find_model(args.model, args.hub, args.dtype, args.device)  # (downloads' own bars)
    hf_config = read_config(folder)
    check_supported(hf_config)  # a model the engine would refuse: before it is started
    steps = _Steps(3)
    try:
        steps.step(f"found {folder}")
        try:
            pooling = pooling_config(args.runner, args.convert, args.hf_overrides,
                                     args.chat_template, hf_config, folder)
        except ValueError as exc:  # flags that do not fit this model: refused before it loads
            raise RuntimeError(str(exc)) from None
        # The engine loads (its imports, the weights) while this process imports the server's
        # modules and loads the tokenizer: on a second core, each start ~2 s shorter.
        loading = spawn_engine(engine_config(args, str(folder), pooling), ipc_dir, procs)
        import freetoken.serving.app  # noqa: F401  (launch_server's create_app, imported meanwhile)
        from freetoken.serving.client import FrontendManager
        from freetoken.tokenizer.load import load_tokenizer

        tokenizer = load_tokenizer(folder)
        steps.step("tokenizer loaded")
        in_addr, out_addr = wait_engine(loading)
        steps.step("engine ready")
    finally:
        steps.close()
    config = frontend_config(args, hf_config, name, resolve_parsers(args, tokenizer), pooling)

    def alive() -> bool:  # every rank on this node: one that dies takes the group down
        return all(proc.is_alive() for proc in procs)

    return FrontendManager(config, tokenizer, in_addr, out_addr, engine_alive=alive)


def _make_server(app, args: ServerArgs):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, minus its signal handling: `_serve` below owns SIGTERM / SIGINT, drains
        first, and never re-raises the signal (which would skip the engine's cleanup)."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=GRACEFUL_HTTP_SHUTDOWN_S)
    return Server(config)


async def _wait(until, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _serve(server, sock: socket.socket, frontend, procs: list, args: ServerArgs) -> int:
    """Run uvicorn until a signal or the engine's death, then drain; returns the exit code."""
    signals: list[int] = []

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        if len(signals) >= 3:
            server.force_exit = True  # uvicorn stops without waiting for connections

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not signals and not frontend.dead and not serving.done():
            await asyncio.sleep(0.1)
        code = 0
        if serving.done():  # uvicorn stopped by itself (a startup failure)
            log.error("The HTTP server stopped unexpectedly")
            code = 1
        elif frontend.dead:
            log.error("The engine process died (%s); ending %d request(s) with 503 and exiting "
                      "with status 1 so that a supervisor restarts the server",
                      exit_reason(next((p for p in procs if not p.is_alive()), procs[0])),
                      frontend.num_running)
            from freetoken.serving.errors import ENGINE_DEAD

            frontend.draining = True
            frontend.fail_all(ENGINE_DEAD, "engine_dead")
            await _wait(lambda: not frontend.num_running, FLUSH_GRACE_S)
            await asyncio.sleep(0.2)
            code = 1
        else:
            await _drain(frontend, signals, args.shutdown_timeout)
            if frontend.dead:
                code = 1
        server.should_exit = True
        await serving
        await frontend.close(stop_engine=True)
        return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


async def _drain(frontend, signals: list[int], timeout: float) -> None:
    from freetoken.serving.errors import SHUTTING_DOWN

    frontend.draining = True
    name = signal.Signals(signals[0]).name
    if frontend.num_running:
        log.info("%s: no new requests; waiting up to %gs for %d in flight (signal again to stop "
                 "now)", name, timeout, frontend.num_running)
    else:
        log.info("%s: shutting down", name)
    await _wait(lambda: not frontend.num_running or len(signals) > 1 or frontend.dead, timeout)
    if frontend.num_running:
        n = frontend.fail_all(SHUTTING_DOWN, "shutdown")
        log.warning("Ended %d request(s) still running at shutdown with a 503", n)
        await _wait(lambda: not frontend.num_running, FLUSH_GRACE_S)
        await asyncio.sleep(0.2)


def _run(server, coro):
    """Run `coro` on the event loop uvicorn itself would pick (uvloop when installed)."""
    get_factory = getattr(server.config, "get_loop_factory", None)
    if hasattr(asyncio, "Runner") and get_factory is not None:
        with asyncio.Runner(loop_factory=get_factory()) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def launch_server(argv: list[str] | None = None, prog: str = "freetoken serve") -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv, prog)
    if args.node_rank > 0:
        return serve_node(args)
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(f"freetoken: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    previous_int = signal.getsignal(signal.SIGINT)
    previous_term = signal.signal(signal.SIGTERM, raise_interrupted)
    ipc_dir = tempfile.mkdtemp(prefix=f"freetoken-{os.getpid()}-")  # mode 0700
    procs: list = []
    told_to_exit = False
    try:
        try:
            frontend = build_frontend(replace(args, port=port), ipc_dir, procs)
        except (ModelNotFound, RuntimeError) as exc:
            print(f"freetoken: {exc}", file=sys.stderr)
            return 1
        from freetoken.serving.app import create_app  # (build_frontend imported it)

        app = create_app(lambda: frontend)
        cfg = frontend.config
        log.info("FreeToken ready at http://%s:%d/v1 serving %s (reasoning parser: %s, tool "
                 "parser: %s)", host, port, cfg.served_model_name, cfg.reasoning_parser,
                 cfg.tool_call_parser)
        server = _make_server(app, args)
        gc.collect()  # what start-up built lives as long as the server: collections skip it
        gc.freeze()
        code = _run(server, _serve(server, sock, frontend, procs, args))
        told_to_exit = True  # _serve ends by sending the engine an ExitMsg
        log.info("FreeToken stopped")
        return code
    except KeyboardInterrupt as exc:
        log.info("Interrupted (%s) before the server was ready; exiting",
                 exc.args[0] if exc.args else "SIGINT")
        return 0
    finally:
        # Bounded, and not to be cut short by another Ctrl-C: the engine and the ipc folder
        # must not outlive us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for proc in procs:
                stop_engine(proc, told_to_exit)
            sock.close()
            shutil.rmtree(ipc_dir, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)
