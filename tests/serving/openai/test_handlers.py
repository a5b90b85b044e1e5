"""Handlers driven through upstream's fake-state style, no engine and no HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from freetoken.config import FrontendConfig
from freetoken.core import TokenLogprob
from freetoken.message import UserReply
from freetoken.serving.openai.completion import CompletionRequest, handle_completion


class State:
    """Only what upstream's fake state has: config, new_user, send_one, wait_for_ack."""

    config = FrontendConfig(served_model_name="m", max_model_len=8192, vocab_size=49152)

    def __init__(self, replies=None):
        self.sent = []
        self.replies = replies or [UserReply(uid=1, incremental_output=" Paris", finished=True,
                                             finish_reason="length")]

    def new_user(self):
        return 1

    async def send_one(self, msg):
        self.sent.append(msg)

    async def wait_for_ack(self, uid):
        for reply in self.replies:
            yield reply


def _run(state, **kw):
    req = CompletionRequest(model="m", max_tokens=1, temperature=0, **kw)
    return asyncio.run(handle_completion(req, None, state, {}))


def test_seed_reproduction_fields_reach_the_engine():
    """The seed-000 script: every scoring field now reaches the engine or answers 200."""
    s = State()
    out = _run(s, prompt="Is the sky blue? Answer Yes or No:", allowed_token_ids=[9454, 2753])
    assert out["choices"][0]["text"] == " Paris"
    params = s.sent[0].sampling_params
    assert "allowed_token_ids" in vars(params) and params.allowed_token_ids == [9454, 2753]

    s = State()
    _run(s, prompt="Q:", allowed_token_ids=[9454, 2753], return_tokens_as_token_ids=True)
    assert s.sent[0].sampling_params.return_tokens_as_token_ids is True

    s = State()
    out = _run(s, prompt="Q:", allowed_token_ids=[9454, 2753], logprobs=2)
    assert isinstance(out, dict) and s.sent[0].sampling_params.logprobs == 2
    assert out["choices"][0]["logprobs"] == {"tokens": [], "token_logprobs": [],
                                             "top_logprobs": [], "text_offset": []}

    s = State()
    out = _run(s, prompt=[[1, 2, 3]])
    assert isinstance(out, dict) and s.sent[0].text == [1, 2, 3]


def test_an_int8_server_marks_its_scores_in_the_system_fingerprint():
    s = State()
    s.config = replace(State.config, system_fingerprint="quantized-arithmetic:int8")
    out = _run(s, prompt="Q:", allowed_token_ids=[9454, 2753], logprobs=2)
    assert out["system_fingerprint"] == "quantized-arithmetic:int8"
    assert "system_fingerprint" not in _run(State(), prompt="Q:")  # the exact arithmetic: as before


def test_error_is_a_json_response_in_openai_shape():
    # Out of the vocabulary: refused against the limits, inside the handler (an empty list is
    # refused as the request is parsed, before any handler).
    r = _run(State(), prompt="x", allowed_token_ids=[49152])
    assert r.status_code == 400
    err = json.loads(r.body)["error"]
    assert err["param"] == "allowed_token_ids" and err["type"] == "invalid_request_error"


def test_logprob_entries_render_with_token_ids():
    entry = TokenLogprob(token_id=7, logprob=-0.5, rank=1, top_ids=[7, 9], top_logprobs=[-0.5, -float("inf")])
    s = State([UserReply(1, " a", True, "length", token_ids=[7], logprobs=[entry])])
    out = _run(s, prompt="x", logprobs=2, return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:7"]
    assert lp["top_logprobs"] == [{"token_id:7": -0.5, "token_id:9": -9999.0}]
    assert lp["text_offset"] == [0]


SEED_000 = Path(__file__).resolve().parents[4] / "shared" / "seeds" / "000_764d322c2bfab159.txt"
SEED_000_SCRIPT = Path(__file__).resolve().parents[2] / "fixtures" / "seed_000_script.py"


def test_seed_script_runs_verbatim():
    """The reproduction script of seed 000 (a verbatim copy in tests/fixtures), against this repo."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, str(SEED_000_SCRIPT)], cwd=root,
                         env={"PYTHONPATH": str(root / "python")}, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == 4 and all("-> 200 text=' Paris'" in line for line in out)
    assert all("'allowed_token_ids', 'return_tokens_as_token_ids'" in line for line in out)


@pytest.mark.skipif(not SEED_000.exists(), reason="the seed texts (../shared/seeds) are not beside "
                    "this checkout; the copy in tests/fixtures still runs")
def test_seed_script_copy_is_verbatim():
    seed = SEED_000.read_text()
    script = seed[seed.index("import asyncio, json"): seed.index("asyncio.run(main())")]
    assert SEED_000_SCRIPT.read_text() == script + "asyncio.run(main())\n"


def test_fakes_and_the_frontend_satisfy_the_engine_client_protocol(tmp_path):
    from freetoken.serving.client import EngineClient, FrontendManager

    assert isinstance(State(), EngineClient)
    assert not isinstance(SimpleNamespace(config=State.config), EngineClient)
    frontend = FrontendManager(FrontendConfig("m", 64, 100), None, f"ipc://{tmp_path}/in",
                               f"ipc://{tmp_path}/out")
    try:
        assert isinstance(frontend, EngineClient)
    finally:
        asyncio.run(frontend.close(stop_engine=False))


def _chat(state, stream: bool):
    """The response, and for a stream its SSE frames, read on the same event loop."""
    from freetoken.serving.openai.chat import ChatCompletionRequest, handle_chat_completion

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                max_tokens=8, stream=stream)

    async def run():
        r = await handle_chat_completion(req, None, state)
        if not stream:
            return r
        return [f for f in "".join([c async for c in r.body_iterator]).split("\n\n") if f]

    return asyncio.run(run())


DIES_MID_CHAT = [UserReply(1, "Hel", token_ids=[1], completion_tokens_delta=1),
                 UserReply(1, finished=True, finish_reason="error", error="The engine process "
                           "has stopped", error_code="engine_dead")]


def test_engine_death_mid_chat_is_a_503():
    r = _chat(State(DIES_MID_CHAT), stream=False)
    assert r.status_code == 503
    err = json.loads(r.body)["error"]
    assert (err["code"], err["type"]) == ("engine_dead", "server_error")


def test_engine_death_mid_chat_stream_ends_with_an_error_event():
    frames = _chat(State(DIES_MID_CHAT), stream=True)
    assert frames[-1] == "data: [DONE]"
    err = json.loads(frames[-2].removeprefix("data: "))["error"]
    assert (err["code"], err["type"]) == ("engine_dead", "server_error")
    assert any('"content": "Hel"' in f for f in frames[:-2])


def test_upstream_sampling_defaults_are_refused_not_ignored():
    req = CompletionRequest(model="m", prompt="x", max_tokens=1)
    r = asyncio.run(handle_completion(req, None, State(), {"temperature": 0.7}))
    assert r.status_code == 500 and "sampling defaults" in json.loads(r.body)["error"]["message"]
