"""Session-scoped real servers and scripted models for the end-to-end tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures import build_models as bm
from tests.e2e.support import HARMONY_SCRIPTS, Server, chat_scripts


@pytest.fixture(scope="session")
def default_server():
    server = Server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def scripted_server(scripted_model_path):
    server = Server("--model", str(scripted_model_path))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def chat_model_path(make_scripted_model, qwen35_tokenizer) -> Path:
    """Scripted model of chat_scripts(); A = 9, alternatives </think> 8 and "\\n\\n" 6, and a
    base of -inf, so any top-k past those three ids shows the -inf clamp."""
    outputs = [{"trigger": k, "token_ids": v} for k, v in chat_scripts(qwen35_tokenizer).items()]
    return make_scripted_model(outputs, scripted_logit=9.0, base_logit=float("-inf"),
                               alternatives=bm.DEFAULT_ALTERNATIVES)


@pytest.fixture(scope="session")
def chat_server(chat_model_path):
    """chat_model_path with qwen3 reasoning (auto) and the qwen3_coder tool parser."""
    server = Server("--model", str(chat_model_path), "--tool-call-parser", "qwen3_coder")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_server(chat_model_path):
    """chat_model_path with no parser at all."""
    server = Server("--model", str(chat_model_path), "--reasoning-parser", "off",
                    "--tool-call-parser", "off")
    yield server
    server.stop()


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


@pytest.fixture(scope="session")
def harmony_server(harmony_scripted_path):
    """Harmony scripted model; auto picks the gpt_oss reasoning and tool parsers."""
    server = Server("--model", str(harmony_scripted_path))
    yield server
    server.stop()
