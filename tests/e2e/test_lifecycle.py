"""Start-up and shutdown of a real `freetoken serve`: a busy port fails fast, SIGTERM / SIGINT
drain, and nothing (engine, helper process, ipc socket) outlives the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.servers import ROOT, Server, alive, children, free_port, wait_gone

pytestmark = pytest.mark.slow

LONG = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True}


def _ipc_leftovers(pid: int) -> list[str]:
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob(f"freetoken-{pid}-*"))


def _wait_running(server: Server, n: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while httpx.get(f"{server.url}/v1/stats", timeout=5).json()["frontend_requests"] < n:
        assert time.time() < deadline, "the requests never started"
        time.sleep(0.05)


class _Stream(threading.Thread):
    """A streamed completion read in the background; `first` is set at its first data line."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json={**self.body, "stream": True},
                          timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                if line.startswith("data: "):
                    self.first.set()
        self.first.set()


def test_busy_port_fails_fast_without_loading_the_model(tiny_qwen3_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        t0 = time.time()
        r = subprocess.run(
            [sys.executable, "-m", "freetoken", "serve", "--model", str(tiny_qwen3_path),
             "--port", str(port)],
            env=dict(os.environ, PYTHONPATH=str(ROOT / "python")), capture_output=True, text=True,
            timeout=30,
        )
        elapsed = time.time() - t0
    assert r.returncode != 0
    assert elapsed < 5, elapsed
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "in use" in lines[0], r.stderr
    assert "Loading model" not in r.stdout + r.stderr


# `freetoken serve` (launch_server, as the CLI calls it) with the engine's start replaced by an
# exit that says so: a refusal that comes later than the main process's check shows here.
SERVE_WITHOUT_ENGINE = ("import sys; from freetoken.serving.launch import serve as launch; "
                        "launch.spawn_engine = lambda *args: sys.exit('engine started'); "
                        "sys.exit(launch.launch_server(sys.argv[1:]))")


def test_an_unsupported_architecture_is_refused_before_the_engine_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"],
                                                      "model_type": "gemma2"}))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", SERVE_WITHOUT_ENGINE, "--model", str(tmp_path), "--port", "0"],
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "python")), capture_output=True,
                       text=True, timeout=60)
    elapsed = time.time() - t0
    output = (r.stdout + r.stderr).strip()
    assert r.returncode == 1, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    assert output.startswith("freetoken: architecture Gemma2ForCausalLM is not supported; freetoken "
                             "serves LlamaForCausalLM, "), output
    assert "Scripted" not in output
    assert elapsed < 15, elapsed  # the main process's imports only

@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the process group"])
def test_signal_lets_a_request_in_flight_finish(tiny_qwen3_path, how):
    # SIGINT goes to the whole group, as a terminal's Ctrl-C does: the engine must ignore it
    # and keep decoding until the server tells it to stop.
    server = Server("--model", str(tiny_qwen3_path), new_session=True)
    try:
        body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body,
                                    timeout=120)
            _wait_running(server, 1)
            if how == "SIGTERM":
                server.proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(server.proc.pid, signal.SIGINT)
            r = in_flight.result(timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 40
        assert server.proc.wait(timeout=30) == 0, server.output()
    finally:
        server.stop()


def test_sigterm_drains_then_ends_what_is_left_with_503(tiny_qwen3_path):
    timeout = 2
    server = Server("--model", str(tiny_qwen3_path), "--shutdown-timeout", str(timeout))
    pid = server.proc.pid
    try:
        stream = _Stream(server.url, LONG)
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(1) as pool:
            plain = pool.submit(client.post, f"{server.url}/v1/completions", json=LONG)
            stream.start()
            _wait_running(server, 2)
            assert stream.first.wait(60), "the stream sent nothing"
            helpers = children(pid)  # the engine, and multiprocessing's resource tracker
            assert helpers
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.time()
            time.sleep(0.3)
            with httpx.Client(timeout=30) as fresh:  # a new connection, during the drain
                r = fresh.post(f"{server.url}/v1/completions", json=LONG)
            assert time.time() - t0 < timeout
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown", r.text
            r = plain.result(timeout=timeout + 10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown", r.text
            stream.join(timeout=timeout + 10)
        assert stream.status == 200
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        error = json.loads(stream.lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutdown"
        assert server.proc.wait(timeout=timeout + 10) == 0, server.output()
        assert time.time() - t0 < timeout + 10
        assert wait_gone(helpers, 5) == []
        assert _ipc_leftovers(pid) == []
        log = server.output()  # stderr is a file here: plain log lines, no progress bars
        assert "Loading model: engine ready" in log and "\r" not in log
    finally:
        server.stop()


def test_sigkill_of_the_server_takes_the_engine_down(tiny_qwen3_path):
    server = Server("--model", str(tiny_qwen3_path))
    helpers: list[int] = []
    try:
        helpers = children(server.proc.pid)
        assert helpers
        server.proc.kill()
        server.proc.wait(timeout=10)
        assert wait_gone(helpers, 5) == []
    finally:
        server.stop()
        for pid in helpers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        # Nothing can remove the ipc folder of a SIGKILLed server (it holds two socket files).
        for name in _ipc_leftovers(server.proc.pid):
            shutil.rmtree(Path(tempfile.gettempdir()) / name, ignore_errors=True)
