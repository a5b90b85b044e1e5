"""`freetoken serve ORG/NAME[:TAG]`: models by Hub name, through the real huggingface_hub client,
from a Hub cache laid out by hand (offline) and from a Hub on 127.0.0.1 (HF_ENDPOINT), each
answering as the same files served by path."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.fixtures import build_models as bm
from tests.support.fake_hub import FakeHub, write_cache
from tests.support.servers import ROOT, Server

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def files(tiny_qwen3_path):
    """Each repo's files: a safetensors model, and a GGUF repo holding a Q8_0 file (a tiny qwen2)
    and a Q4_K_M one split into three parts in a folder (a tiny qwen3), as unsloth's are."""
    qwen2, split = bm.cached_gguf("tiny-quantized-qwen2"), bm.cached_split_gguf()
    gguf = {"Tiny-Q8_0.gguf": qwen2 / "model.gguf"}
    gguf |= {f"Q4_K_M/Tiny-Q4_K_M-0000{i}-of-00003.gguf": split / f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)}
    return {"acme/tiny": {p.name: p for p in tiny_qwen3_path.iterdir()}, "acme/tiny-GGUF": gguf}


def complete(server: Server, model: str) -> dict:
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"]


@pytest.fixture(scope="module")
def by_path(files):
    """The completions of each model served by its path."""
    paths = {"acme/tiny": files["acme/tiny"]["config.json"].parent,
             "acme/tiny-GGUF:q8_0": files["acme/tiny-GGUF"]["Tiny-Q8_0.gguf"],
             "acme/tiny-GGUF": files["acme/tiny-GGUF"]["Q4_K_M/Tiny-Q4_K_M-00001-of-00003.gguf"]}
    done = {}
    for name, path in paths.items():
        server = Server("--model", str(path))
        try:
            done[name] = complete(server, server.client().models.list().data[0].id)
        finally:
            server.stop()
    return done


def serve_by_name(name: str, env: dict[str, str]) -> tuple[list, str]:
    server = Server(name, env=env)
    try:
        assert [m.id for m in server.client().models.list().data] == [name]  # the name as typed
        return complete(server, name), server.output()
    finally:
        server.stop()


def test_names_in_an_offline_cache_serve_what_their_files_serve(files, by_path, tmp_path):
    cache = tmp_path / "hub"
    for repo, repo_files in files.items():
        write_cache(cache, repo, repo_files)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    # No tag: the repo's Q4_K_M, all three parts; a tag in any case.
    for name in ("acme/tiny", "acme/tiny-GGUF:q8_0", "acme/tiny-GGUF"):
        assert serve_by_name(name, env)[0] == by_path[name], name
    assert by_path["acme/tiny-GGUF"] != by_path["acme/tiny-GGUF:q8_0"]  # two models: the tag chose


def freetoken_serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken", "serve", *args, "--port", "0"], timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "python"), **env},
                          capture_output=True, text=True)


def test_a_first_start_downloads_what_it_needs_and_a_second_needs_no_hub(files, by_path, tmp_path):
    hub = FakeHub()
    extras = {"README.md": b"# tiny", "mmproj-F16.gguf": b"not a model", "Tiny-Q8_0.imatrix": b"\0" * 64}
    hub.add("acme/tiny-GGUF", {**files["acme/tiny-GGUF"], **extras})
    hub.add("acme/private", {"config.json": b"{}"})
    hub.private.add("acme/private")
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home")}
    try:
        first, _ = serve_by_name("acme/tiny-GGUF:Q8_0", env)
        assert first == by_path["acme/tiny-GGUF:q8_0"]
        assert hub.downloaded("acme/tiny-GGUF") == ["Tiny-Q8_0.gguf"]
        for args, message in (
                (["acme/private"], "freetoken: acme/private: the Hub answered HTTP 401: a private or gated repo, "
                 "or none of that name; pass a token that may read it (HF_TOKEN or --hf-token)"),
                (["acme/nothing"], "freetoken: Model not found: acme/nothing is neither a local path nor a "
                 "model on the Hub"),
                (["acme/tiny-GGUF:Q2_K"], "freetoken: acme/tiny-GGUF has no GGUF of tag Q2_K: name one as "
                 "acme/tiny-GGUF:TAG, TAG one of Q4_K_M, Q8_0")):
            done = freetoken_serve(*args, env=env)
            assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == message, done.stderr
            assert "Traceback" not in done.stderr
    finally:
        hub.close()
    second, output = serve_by_name("acme/tiny-GGUF:Q8_0", env)
    assert second == first and "cannot be reached" in output
