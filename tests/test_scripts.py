"""The benchmark scripts stay runnable: they are not imported by the package, so nothing else
would notice when a change breaks them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("name", ["bench_engine.py", "bench_server.py", "bench_scoring.py",
                                  "bench_load.py", "bench_gguf_load.py", "bench_linear.py"])
def test_script_parses_its_arguments(name):
    done = subprocess.run([sys.executable, str(SCRIPTS / name), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


def test_roofline_measures_torch_and_our_kernels(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _bench_common

    peaks = _bench_common.gemm_roofline("float32", seconds=0.05)
    assert set(peaks) <= {"torch.mm", "onednn", "grouped"} and "torch.mm" in peaks
    assert all(rate > 0 for rate in peaks.values())


@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_load_generator_reads_every_answer(monkeypatch, client):
    """Both load generators post each payload once and hand back its JSON answer, over
    keep-alive connections; a non-200 answer stops the run with its status."""
    import http.server
    import json
    import threading

    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _bench_common

    class Echo(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn answers

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"echo": payload, "path": self.path}).encode()
            self.send_response(418 if payload.get("fail") else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    monkeypatch.setattr(_bench_common, "http_client", client)
    try:
        payloads = [{"prompt": f"item {i} \u00e9", "max_tokens": 1} for i in range(37)]
        result = _bench_common.run_load(url, payloads, concurrency=5)
        assert result.responses == [{"echo": p, "path": "/v1/completions"} for p in payloads]
        assert result.n == 37 and all(t > 0 for t in result.latencies)
        assert result.client_cpu_ms > 0
        with pytest.raises(RuntimeError, match="HTTP 418"):
            _bench_common.run_load(url, [{"fail": True}], concurrency=1)
    finally:
        server.shutdown()
