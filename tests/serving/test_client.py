"""FrontendManager against a stand-in engine socket: what a client that leaves early leaves."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
import zmq
from transformers import AutoTokenizer

from freetoken.config import FrontendConfig
from freetoken.core import SamplingParams
from freetoken.message import AbortMsg, TokenizeMsg, UserMsg
from freetoken.serving.client import FrontendManager
from tests.model_fixtures import default_folder

pytestmark = pytest.mark.slow  # the default model


def test_a_request_cancelled_while_tokenizing_leaves_nothing_behind(tmp_path):
    engine = zmq.Context().socket(zmq.PULL)  # what the engine process would receive
    engine.bind(f"ipc://{tmp_path}/in")
    tokenizer = AutoTokenizer.from_pretrained(default_folder())
    frontend = FrontendManager(FrontendConfig("m", 8192, tokenizer.vocab_size), tokenizer,
                               f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    slow = frontend.tokenize_manager.tokenize
    frontend.tokenize_manager.tokenize = lambda msg: (time.sleep(0.5), slow(msg))[1]

    async def leave_while_tokenizing():
        task = asyncio.create_task(frontend.send_one(TokenizeMsg(1, "Hello", SamplingParams())))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert frontend.num_running == 0
        await asyncio.sleep(0.6)  # the tokenizer thread finishes; nothing may follow it
        await frontend.close(stop_engine=False)

    asyncio.run(leave_while_tokenizing())
    received = []
    while engine.poll(100):
        received.append(pickle.loads(engine.recv()))
    assert not any(isinstance(m, UserMsg) for m in received)
    assert all(isinstance(m, AbortMsg) and m.uid == 1 for m in received)
    engine.close(linger=0)
