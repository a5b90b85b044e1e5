"""The `server(*args)` factory the end-to-end files get their shared servers from, and the scripted
chat models several of them serve.

A file states its servers' arguments in module-scoped fixtures of its own, e.g.

    @pytest.fixture(scope="module")
    def chat_server(server, chat_model_path):
        return server("--model", str(chat_model_path), "--tool-call-parser", "qwen3_coder")

`server()` with no arguments serves the default model. Servers come from one pool per test
worker (tests/support/servers.py, ServerPool): a file that asks for the same arguments, in the
same order, as an earlier file on its worker gets that server if it is still up. A file whose
server must be fresh, or is stopped or signalled by its tests, starts its own `Server`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from tests.fixtures import build_models as bm
from tests.support.chat import HARMONY_SCRIPTS, chat_scripts
from tests.support.servers import Server, ServerPool


@pytest.fixture(scope="session")
def server_pool():
    pool = ServerPool(keep=1)
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _module_servers(server_pool):
    server_pool.enter_module()


@pytest.fixture(scope="session")
def server(server_pool) -> Callable[..., Server]:
    """`server(*args)` -> a healthy `freetoken serve *args` from this worker's pool, kept up
    until the module ends (and perhaps past it, for the next file asking the same)."""
    return server_pool.get


@pytest.fixture(scope="session")
def chat_model_path(make_scripted_model, qwen35_tokenizer) -> Path:
    """Scripted model of chat_scripts(); A = 9, alternatives </think> 8 and "\\n\\n" 6, and a
    base of -inf, so any top-k past those three ids shows the -inf clamp."""
    outputs = [{"trigger": k, "token_ids": v} for k, v in chat_scripts(qwen35_tokenizer).items()]
    return make_scripted_model(outputs, scripted_logit=9.0, base_logit=float("-inf"),
                               alternatives=bm.DEFAULT_ALTERNATIVES)


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
