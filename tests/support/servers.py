"""Process control for end-to-end tests: a real `freetoken serve` subprocess, the pool the e2e
files share servers through, and /proc readers for the processes a server leaves behind."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    # A killed test run must not leave servers behind (Linux: PR_SET_PDEATHSIG = 1).
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    # Should the suite ever run out of memory, the kernel kills a server (its tests fail) rather
    # than a pytest-xdist worker, after which the run hangs instead of failing. Inherited by the
    # engine processes.
    Path("/proc/self/oom_score_adj").write_text("500")


class Server:
    def __init__(self, *args: str, new_session: bool = False, env: dict[str, str] | None = None):
        # new_session: its own process group, so a test can send the group a terminal's Ctrl-C;
        # env: variables set for it beyond the test's own.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), **(env or {}))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freetoken", "serve", *args, "--port", str(self.port)],
            # A file, not a pipe: nobody reads a pipe while the server runs, and a full one
            # would block the server.
            env=env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
            start_new_session=new_session,
        )
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode(errors='replace')}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def output(self) -> str:
        """What the server has written to stdout and stderr so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


class ServerPool:
    """The servers the e2e modules of one test worker share (tests/e2e/conftest.py's
    `server(*args)`), started on first use and keyed by their arguments.

    Every server the suite shares kept up at once (two workers, each with its own) outgrows
    CI's 24 GB, so once a module is done its servers are idle and only the `keep` most recently
    used idle ones stay up; the rest stop when the next module starts. Test files run one at a
    time per worker (`--dist loadfile`), so a module never loses a server it is using.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self._servers: dict[tuple[str, ...], Server] = {}  # least recently used first
        self._in_use: set[tuple[str, ...]] = set()

    def enter_module(self) -> None:
        self._in_use = set()
        self._stop_idle(self.keep)

    def get(self, *args: str) -> Server:
        server = self._servers.pop(args, None)
        if server is None or server.proc.poll() is not None:  # a dead one is replaced
            self._stop_idle(self.keep)
            server = Server(*args)
        self._servers[args] = server
        self._in_use.add(args)
        return server

    def close(self) -> None:
        self._in_use = set()
        self._stop_idle(0)

    def _stop_idle(self, keep: int) -> None:
        idle = [args for args in self._servers if args not in self._in_use]
        for args in idle[: max(0, len(idle) - keep)]:
            self._servers.pop(args).stop()


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid`."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) and not fields.get("State", "").startswith("Z"):
            out.append(int(status.parent.name))
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits until none of `pids` runs, or `timeout`; returns those still running."""
    deadline = time.time() + timeout
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
