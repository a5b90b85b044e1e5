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


def test_requests_sent_together_get_the_ids_of_one_encode_each(tmp_path):
    """send_many tokenizes its text prompts in one call of the tokenizer: the ids must be those
    of `tokenizer.encode` on each text alone, an empty prompt still refused on its own."""
    engine = zmq.Context().socket(zmq.PULL)
    engine.bind(f"ipc://{tmp_path}/in")
    tokenizer = AutoTokenizer.from_pretrained(default_folder())
    frontend = FrontendManager(FrontendConfig("m", 8192, tokenizer.vocab_size), tokenizer,
                               f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    texts = ["The capital of France is", " leading space", "naïve café ☕", "a\n\nb"]
    msgs = [TokenizeMsg(i, t, SamplingParams()) for i, t in enumerate(texts)]
    msgs += [TokenizeMsg(10, texts[0], SamplingParams(), add_special_tokens=False),
             TokenizeMsg(11, [5, 6, 7], SamplingParams()), TokenizeMsg(12, "", SamplingParams())]
    expected = {i: tokenizer.encode(t) for i, t in enumerate(texts)}
    expected |= {10: tokenizer.encode(texts[0], add_special_tokens=False), 11: [5, 6, 7]}

    async def send():
        await frontend.send_many(msgs)
        replies = [r async for r in frontend.wait_for_ack(12)]
        await frontend.close(stop_engine=False)
        return replies

    [empty] = asyncio.run(send())
    assert empty.error_code == "invalid_prompt"
    sent = pickle.loads(engine.recv())  # one message: the requests as a list
    assert {m.uid: m.input_ids for m in sent} == expected
    engine.close(linger=0)
