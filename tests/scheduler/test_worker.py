"""The engine loop's last line of defence: a fault in one message or one step is logged and
answered with an error reply, and the loop keeps serving."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from types import SimpleNamespace

import zmq
from freetoken.core import SamplingParams
from freetoken.message import DetokenizeMsg, ExitMsg, UserMsg
from freetoken.scheduler import worker
from freetoken.scheduler.worker import serve_scheduler


class FaultyScheduler:
    """Refuses uid 1 in add(); its first step() with work raises; later steps finish all."""

    def __init__(self):
        self.running: list = []
        self.waiting: list = []
        self.step_failed = False

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def stats(self) -> dict:
        return {"running": len(self.running)}

    def add(self, msg: UserMsg) -> list[DetokenizeMsg]:
        if msg.uid == 1:
            raise ValueError("cannot admit this one")
        self.running.append(SimpleNamespace(uid=msg.uid))
        return []

    def abort(self, uid: int) -> list[DetokenizeMsg]:
        self.running = [r for r in self.running if r.uid != uid]
        return []

    def step(self) -> list[DetokenizeMsg]:
        if self.running and not self.step_failed:
            self.step_failed = True
            raise RuntimeError("kernel fault")
        done, self.running = self.running, []
        return [DetokenizeMsg(r.uid, token_ids=[7], finished=True, finish_reason="length")
                for r in done]


@contextlib.contextmanager
def serving(scheduler, tmp_path):
    """serve_scheduler on a thread: (the socket to it, the socket of its replies); on leaving,
    ExitMsg ends the loop, which must stop."""
    in_addr, out_addr = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    ctx = zmq.Context()
    replies_sock = ctx.socket(zmq.PULL)
    replies_sock.bind(out_addr)
    engine = threading.Thread(target=serve_scheduler, args=(scheduler, in_addr, out_addr), daemon=True)
    engine.start()
    to_engine = ctx.socket(zmq.PUSH)
    to_engine.connect(in_addr)
    try:
        yield to_engine, replies_sock
        to_engine.send(pickle.dumps(ExitMsg()))
        engine.join(timeout=10)
        assert not engine.is_alive()
    finally:
        to_engine.close(linger=0)
        replies_sock.close(linger=0)
        ctx.term()


def test_faults_become_error_replies_and_the_loop_keeps_serving(tmp_path):
    with serving(FaultyScheduler(), tmp_path) as (to_engine, replies_sock):
        def replies(n: int) -> dict[int, DetokenizeMsg]:
            out = {}
            while len(out) < n:
                assert replies_sock.poll(10_000), f"no reply; have {out}"
                out.update((m.uid, m) for m in pickle.loads(replies_sock.recv())[0])
            return out

        to_engine.send(b"not a pickle")
        to_engine.send(pickle.dumps(UserMsg(1, [1, 2], SamplingParams())))
        got = replies(1)
        assert got[1].error_code == "engine_error" and got[1].finished
        assert "cannot admit this one" in got[1].error

        to_engine.send(pickle.dumps(UserMsg(2, [1, 2], SamplingParams())))
        got = replies(1)
        assert got[2].error_code == "engine_error" and "kernel fault" in got[2].error

        to_engine.send(pickle.dumps(UserMsg(3, [1, 2], SamplingParams())))
        got = replies(1)
        assert got[3].error is None and got[3].finish_reason == "length"


class PromptScheduler:
    """Finishes each waiting request in one step (with a second finished reply, for a uid of its
    own: as if it were two requests); records each step's uids."""

    def __init__(self):
        self.running: list = []
        self.waiting: list[int] = []
        self.steps: list[list[int]] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def stats(self) -> dict:
        return {}

    def add(self, msg: UserMsg) -> list[DetokenizeMsg]:
        self.waiting.append(msg.uid)
        return []

    def step(self) -> list[DetokenizeMsg]:
        if not self.waiting:
            return []
        self.steps.append(self.waiting)
        done, self.waiting = self.waiting, []
        return [DetokenizeMsg(u, finished=True, finish_reason="length") for uid in done for u in (uid, -uid)]


def test_after_a_step_that_finished_requests_the_engine_gathers_their_clients_next_ones(
        tmp_path, monkeypatch):
    """A step finished two; the next request is held back until a second one comes (within the
    wait), and the two run as one step."""
    monkeypatch.setattr(worker, "GATHER_SHARE", 1e6)
    monkeypatch.setattr(worker, "GATHER_MAX_S", 10.0)
    scheduler = PromptScheduler()
    with serving(scheduler, tmp_path) as (to_engine, replies_sock):
        def reply() -> list[DetokenizeMsg]:
            while True:
                assert replies_sock.poll(10_000), "no reply"
                if msgs := pickle.loads(replies_sock.recv())[0]:
                    return msgs

        to_engine.send(pickle.dumps(UserMsg(1, [1], SamplingParams())))
        assert {m.uid for m in reply()} == {1, -1}
        to_engine.send(pickle.dumps(UserMsg(2, [1], SamplingParams())))
        time.sleep(0.2)
        to_engine.send(pickle.dumps(UserMsg(3, [1], SamplingParams())))
        assert {m.uid for m in reply()} == {2, -2, 3, -3}
        assert scheduler.steps == [[1], [2, 3]]
