"""Real servers the end-to-end modules share (through one pool per worker) and scripted models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures import build_models as bm
from tests.e2e.support import HARMONY_SCRIPTS, ServerPool, chat_scripts


@pytest.fixture(scope="session")
def server_pool():
    pool = ServerPool(keep=1)
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _module_servers(server_pool):
    server_pool.enter_module()


@pytest.fixture(scope="module")
def default_server(server_pool):
    return server_pool.get()


@pytest.fixture(scope="module")
def scripted_server(server_pool, scripted_model_path):
    return server_pool.get("--model", str(scripted_model_path))


@pytest.fixture(scope="session")
def chat_model_path(make_scripted_model, qwen35_tokenizer) -> Path:
    """Scripted model of chat_scripts(); A = 9, alternatives </think> 8 and "\\n\\n" 6, and a
    base of -inf, so any top-k past those three ids shows the -inf clamp."""
    outputs = [{"trigger": k, "token_ids": v} for k, v in chat_scripts(qwen35_tokenizer).items()]
    return make_scripted_model(outputs, scripted_logit=9.0, base_logit=float("-inf"),
                               alternatives=bm.DEFAULT_ALTERNATIVES)


@pytest.fixture(scope="module")
def chat_server(server_pool, chat_model_path):
    """chat_model_path with qwen3 reasoning (auto) and the qwen3_coder tool parser."""
    return server_pool.get("--model", str(chat_model_path), "--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def plain_server(server_pool, chat_model_path):
    """chat_model_path with no parser at all."""
    return server_pool.get("--model", str(chat_model_path), "--reasoning-parser", "off",
                           "--tool-call-parser", "off")


@pytest.fixture(scope="session")
def harmony_scripted_path(tiny_harmony_path, tmp_path_factory) -> Path:
    """ScriptedForCausalLM of HARMONY_SCRIPTS on the tiny Harmony tokenizer (its markers are
    single ids); eos <|return|> and <|call|>; alternatives <|end|> 8 and <|channel|> 6."""
    added = json.loads((tiny_harmony_path / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    folder = tmp_path_factory.mktemp("harmony-scripted")
    bm.build_scripted(folder, HARMONY_SCRIPTS, vocab_size=1024, eos_token_id=ids["<|return|>"],
                      alternatives=[(ids["<|end|>"], 8.0), (ids["<|channel|>"], 6.0)])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # swap the Qwen tokenizer out
        (folder / name).unlink()
        shutil.copyfile(tiny_harmony_path / name, folder / name)
    eos = [ids["<|return|>"], ids["<|call|>"]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


@pytest.fixture(scope="module")
def harmony_server(server_pool, harmony_scripted_path):
    """Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    return server_pool.get("--model", str(harmony_scripted_path))


@pytest.fixture(scope="module")
def hermes_server(server_pool, tiny_qwen3_path):
    """The tiny Qwen3 (real weights, no script) with qwen3 reasoning and hermes tool calls."""
    return server_pool.get("--model", str(tiny_qwen3_path), "--tool-call-parser", "hermes",
                           "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def coder_server(server_pool, tiny_qwen3_path):
    """The tiny Qwen3 with qwen3_coder tool calls and no reasoning parser."""
    return server_pool.get("--model", str(tiny_qwen3_path), "--tool-call-parser", "qwen3_coder",
                           "--reasoning-parser", "off")
