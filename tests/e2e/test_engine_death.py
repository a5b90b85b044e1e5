"""A dying engine process is reported, never a hang."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.support import Server

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            out.append(int(status.parent.name))
    return out


def test_killed_engine_turns_health_unhealthy_and_requests_503(tiny_qwen3_path):
    server = Server("--model", str(tiny_qwen3_path))
    try:
        body = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True}
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(client.post, f"{server.url}/v1/completions", json=body)
            time.sleep(2)  # let it start decoding
            for child in _children(server.proc.pid):
                os.kill(child, signal.SIGKILL)
            t0 = time.time()
            while client.get(f"{server.url}/health").status_code == 200:
                assert time.time() - t0 < 20
                time.sleep(0.2)
            r = client.post(f"{server.url}/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            r = in_flight.result(timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        server.stop()
