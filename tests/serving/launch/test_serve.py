"""The server's own process: what it imports before the engine answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# build_frontend's steps for the default model, then the modules it serves with.
FRONTEND = """
import json, sys
from freetoken.models.registry import check_supported, find_model, read_config
import freetoken.serving.app, freetoken.serving.client, freetoken.serving.launch.serve
from freetoken.tokenizer.load import load_tokenizer
folder, name = find_model(None)
check_supported(read_config(folder))
load_tokenizer(folder)
print(json.dumps(sorted(m for m in ("torch", "transformers.models") if m in sys.modules)))
"""


@pytest.mark.slow
def test_a_second_start_finds_and_tokenizes_without_torch():
    """torch and transformers' model registry (seconds of import, and memory) are the engine's
    and a first start's: from the second start on, the server's process finds the model, checks
    it and loads its tokenizer without them."""
    imported = []
    for _ in range(2):  # the first writes what the suite's cache lacks: config folder, tokenizer class
        done = subprocess.run([sys.executable, "-c", FRONTEND], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        imported.append(json.loads(done.stdout.splitlines()[-1]))
    assert imported[1] == []
