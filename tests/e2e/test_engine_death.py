"""A dying engine process is reported, never a hang: the requests in flight get 503 at once,
then the server exits non-zero so that a supervisor restarts it."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.servers import Server, children

pytestmark = pytest.mark.slow


def test_killed_engine_fails_requests_with_503_and_the_server_exits_non_zero(tiny_qwen3_path):
    server = Server("--model", str(tiny_qwen3_path))
    try:
        body = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True}
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(client.post, f"{server.url}/v1/completions", json=body)
            deadline = time.time() + 60
            while client.get(f"{server.url}/v1/stats").json()["frontend_requests"] < 1:
                assert time.time() < deadline
                time.sleep(0.05)
            time.sleep(0.5)  # let it decode a little
            for child in children(server.proc.pid):  # the engine (and the resource tracker)
                os.kill(child, signal.SIGKILL)
            t0 = time.time()
            r = in_flight.result(timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            assert time.time() - t0 < 5
        code = server.proc.wait(timeout=10)
        assert code == 1, server.output()
        assert "engine process died (killed by SIGKILL" in server.output()
    finally:
        server.stop()
