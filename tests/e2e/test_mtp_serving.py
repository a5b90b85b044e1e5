"""`freetoken serve --speculative-config '{"method": "mtp", ...}'` on the tiny Qwen3.5 with a
random MTP head, against the same server without it: the same text and logprobs, greedy and
seeded, with a stop string and penalties; /metrics counts the MTP drafts. A model without the
head is refused at start-up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.support.servers import ROOT, free_port

pytestmark = pytest.mark.slow

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def servers(server, tiny_hybrid_path):
    folder = str(tiny_hybrid_path("qwen3_5_mtp"))
    return server("--model", folder), server("--model", folder, "--speculative-config", MTP)


def test_completions_equal_plain_decoding_and_metrics_count_mtp_drafts(servers):
    bodies = [{"prompt": "def add(a, b):\n    return", "max_tokens": 16, "temperature": 0,
               "logprobs": 2, "stop": ["\n\n"]},
              {"prompt": "1 2 3 4", "max_tokens": 16, "temperature": 0.8, "seed": 7, "n": 2,
               "logprobs": 1, "presence_penalty": 0.3, "ignore_eos": True}]
    for body in bodies:
        plain, drafted = (httpx.post(f"{s.url}/v1/completions", json=body, timeout=120).json()
                          for s in servers)
        for a, b in zip(plain["choices"], drafted["choices"]):
            assert (b["text"], b["logprobs"], b["finish_reason"]) == \
                (a["text"], a["logprobs"], a["finish_reason"])
    metrics = httpx.get(f"{servers[1].url}/metrics", timeout=30).text
    drafts = re.search(r'freetoken:spec_decode_num_drafts_total\{[^}]*method="mtp"[^}]*\} (\S+)', metrics)
    assert drafts and float(drafts.group(1)) > 0, metrics


def test_a_model_without_an_mtp_head_is_refused(tiny_hybrid_path):
    r = subprocess.run(
        [sys.executable, "-m", "freetoken", "serve", "--model", str(tiny_hybrid_path("qwen3_5_text")),
         "--port", str(free_port()), "--speculative-config", MTP],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "python")), capture_output=True, text=True,
        timeout=240)
    assert r.returncode != 0
    assert "method 'mtp' needs a checkpoint with MTP weights" in r.stdout + r.stderr
