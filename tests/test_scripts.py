"""The benchmark scripts stay runnable: they are not imported by the package, so nothing else
would notice when a change breaks them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("name", ["bench_engine.py", "bench_server.py", "bench_scoring.py",
                                  "bench_load.py", "bench_gguf_load.py"])
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
