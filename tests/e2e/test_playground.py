"""The playground in a real browser (Debian's chromium, driven headless by playwright) against
`freetoken serve` on the scripted Qwen model (DEFAULT_SCRIPT; qwen3 reasoning, hermes tool
calls) behind an API key. What the page shows is checked against the API's answer to the very
request the page sent, asked again without streaming. Each mode is screenshotted; with
FREETOKEN_UPDATE_SCREENSHOTS=1 the shots replace docs/playground/*.png (else they go to a
temporary folder, so that a test run leaves the checkout as it was).
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.support.servers import ROOT

pytestmark = pytest.mark.slow

# Debian's chromium, as the README's test command installs it.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "playground-test-key"
SHOTS = (ROOT / "docs" / "playground" if os.environ.get("FREETOKEN_UPDATE_SCREENSHOTS")
         else Path(tempfile.gettempdir()) / "freetoken-playground-shots")
# Off: what a closed network refuses (the browser's background connections), and /dev/shm,
# which containers make too small for the renderer.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium: apt-get install chromium (the README's test command does, "
                    "as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extras")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def playground(server, scripted_model_path):
    return server("--model", str(scripted_model_path), "--served-model-name", "scripted-qwen3",
                  "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--api-key", KEY)


class Page:
    """A fresh browser context (its own session storage) on the playground, recording console
    errors and the API requests the page sends."""

    def __init__(self, browser, server, width: int = 1280):
        self.server = server
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.sent: list[tuple[str, dict]] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", self._record)

    def _record(self, request):
        if request.method == "POST":
            path = request.url.removeprefix(self.server.url)
            self.sent.append((path, json.loads(request.post_data)))

    def open(self, mode: str = "chat", key: str | None = KEY):
        self.page.goto(f"{self.server.url}/#{mode}")
        if key is not None:
            self.page.fill("#api-key", key)
            self.page.press("#api-key", "Tab")  # the key is taken on change
        return self.page

    def run(self, mode: str):
        """Submits the mode's form from the keyboard and waits for the run to end."""
        self.page.press(f"#panel-{mode} form textarea >> nth=0", "Control+Enter")
        self.page.wait_for_selector(f"#panel-{mode} .output[data-done]", timeout=60_000)

    def tokens(self, selector: str) -> list[dict]:
        return self.page.eval_on_selector_all(selector, "spans => spans.map(s => ({"
                                              "label: s.dataset.label, text: s.entry.text, "
                                              "logprob: Number(s.dataset.logprob)}))")

    def close(self):
        self.context.close()


@pytest.fixture
def page(browser, playground):
    page = Page(browser, playground)
    yield page
    page.close()


def api(server, path: str, body: dict) -> dict:
    """The same request as the page's, answered whole."""
    r = httpx.post(f"{server.url}{path}", json={**body, "stream": False, "stream_options": None},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(entries: list[dict]) -> list[float]:
    return [e["logprob"] for e in entries]


def shot(page, name: str):
    page.evaluate("(e => e.matches('textarea, input') && e.blur())(document.activeElement)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_page_loads_clean_and_server_errors_show_the_servers_message(page, playground):
    p = page.open(key=None)
    p.wait_for_selector("text=Enter the API key to start.")
    assert page.errors == [] and page.sent == []
    # The page is public, the API is not: the key field is marked as needed.
    assert p.get_attribute("#api-key", "required") is not None
    p.fill("#api-key", "wrong")
    p.press("#api-key", "Tab")
    p.wait_for_selector("#error:not([hidden])")
    assert "Invalid API key" in p.inner_text("#error") and "401" in p.inner_text("#error")
    p.fill("#chat-user", "hi")
    page.run("chat")
    assert "Invalid API key" in p.inner_text("#error")
    p.fill("#api-key", KEY)
    p.press("#api-key", "Tab")
    p.wait_for_selector("#model-name:has-text('Model: ')")
    assert p.is_hidden("#error")
    # A 400 shows the server's own message and the field it names.
    p.fill("#top-logprobs", "21")
    page.run("chat")
    error = p.inner_text("#error")
    assert "Requested sample logprobs of 21, which is greater than max allowed: 20" in error
    assert "HTTP 400" in error and "top_logprobs" in error


def test_chat_streams_reasoning_and_content_with_the_apis_logprobs(page, playground):
    p = page.open("chat")
    p.fill("#chat-user", "hi")
    p.fill("#top-logprobs", "3")
    page.run("chat")
    assert page.errors == []
    (path, body), = page.sent
    assert path == "/v1/chat/completions" and body["stream"] and body["temperature"] == 0
    choice = api(playground, path, body)["choices"][0]
    reasoning = page.tokens("#panel-chat .label-reasoning .tok")
    content = page.tokens("#panel-chat .label-content .tok")
    message = choice["message"]
    assert {t["label"] for t in reasoning} == {"reasoning"}
    assert {t["label"] for t in content} == {"content"}
    assert "".join(t["text"] for t in reasoning) == message["reasoning_content"] == "Let me think."
    assert "".join(t["text"] for t in content) == message["content"] == "Use a <b> tag."
    assert [t["logprob"] for t in reasoning] == logprobs(choice["reasoning_logprobs"]["content"])
    assert [t["logprob"] for t in content] == logprobs(choice["logprobs"]["content"])
    # Focusing a token shows its logprob, rank and alternatives; arrows move along the tokens.
    p.focus("#panel-chat .label-content .tok >> nth=0")
    p.keyboard.press("ArrowRight")
    first = choice["logprobs"]["content"][1]
    tip = p.inner_text("#tooltip")
    assert f"logprob {first['logprob']:.4f}" in tip and "rank 1" in tip
    for alt in first["top_logprobs"]:
        assert f"{100 * math.exp(alt['logprob']):.2f} %" in tip
    assert "finish_reason: stop" in p.inner_text("#panel-chat .meta")
    shot(p, "chat")


def test_tool_call_renders_with_its_arguments(page, playground):
    p = page.open("chat")
    p.fill("#chat-user", "What is the weather in Paris?")
    p.click("#panel-chat details.tools summary")
    p.click("#chat-tools-example")
    page.run("chat")
    assert page.errors == []
    assert p.inner_text("#panel-chat .call-name") == "Tool call: get_weather"
    assert json.loads(p.inner_text("#panel-chat .call-args")) == {"city": "Paris"}
    assert p.inner_text("#panel-chat .reasoning summary").startswith("Reasoning")
    assert "finish_reason: tool_calls" in p.inner_text("#panel-chat .meta")
    shot(p, "tool-call")


def test_completion_tokens_show_the_apis_logprobs(page, playground):
    p = page.open("completion")
    p.fill("#completion-prompt", "hi")
    page.run("completion")
    assert page.errors == []
    (path, body), = page.sent
    lp = api(playground, path, body)["choices"][0]["logprobs"]
    shown = page.tokens("#panel-completion .tok")
    assert [t["logprob"] for t in shown] == lp["token_logprobs"]
    assert [t["text"] for t in shown] == lp["tokens"]
    p.hover("#panel-completion .tok >> nth=2")
    shot(p, "completion")


def test_conversation_is_sent_whole_and_an_edited_turn_replaces_the_later_ones(page, playground):
    p = page.open("chat")
    p.fill("#chat-user", "hi")
    page.run("chat")
    p.fill("#chat-user", "What is the weather in Paris?")
    page.run("chat")
    assert page.errors == [] and p.input_value("#chat-user") == ""
    (path, first), (_, second) = page.sent
    reply = api(playground, path, first)["choices"][0]["message"]
    assert second["messages"] == [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": reply["content"]},
                                  {"role": "user", "content": "What is the weather in Paris?"}]
    weather = api(playground, path, second)["choices"][0]["message"]["content"]
    assert weather != reply["content"]  # the scripted model's weather answer
    turns = "#chat-turns > .turn"

    def contents() -> list[str]:
        return p.eval_on_selector_all(turns, "ts => ts.map(t => [t.dataset.role, [...t."
                                      "querySelectorAll('.turn-text, .label-content .tok')]"
                                      ".map(e => e.entry ? e.entry.text : e.textContent)"
                                      ".join('')])")

    assert contents() == [["user", "hi"], ["assistant", reply["content"]],
                          ["user", "What is the weather in Paris?"], ["assistant", weather]]
    shot(p, "conversation")
    # Edit the first turn and resend: it is answered again, the turns after it gone.
    p.click(f"{turns} >> nth=0 >> button:has-text('Edit')")
    p.fill("#chat-turns .turn-edit", "hello")
    p.press("#chat-turns .turn-edit", "Control+Enter")
    p.wait_for_selector("#panel-chat .output[data-done]", timeout=60_000)
    assert page.errors == []
    assert page.sent[-1][1]["messages"] == [{"role": "user", "content": "hello"}]
    assert contents() == [["user", "hello"], ["assistant", reply["content"]]]


def generative_scoring(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/generative_scoring", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_scoring_bars_and_table_are_the_whole_labels_renormalised(page, playground):
    p = page.open("scoring")
    p.fill("#scoring-prompts", "hi")
    # A label of one token, two of several sharing its first token, and another one-token label.
    labels = [" Yes", " Yes</think>", " Yes, please", "Let"]
    p.fill("#scoring-labels", "\n".join(labels))
    page.run("scoring")
    assert page.errors == []
    (path, body), = page.sent
    assert path == "/generative_scoring" and body["items"] == ["hi"] and body["labels"] == labels
    expected = generative_scoring(playground, body)["data"][0]["labels"]
    assert [len(e["token_ids"]) for e in expected] == [1, 2, 3, 1]
    probs = [e["prob"] for e in expected]
    assert math.fsum(probs) == pytest.approx(1)
    bars = p.eval_on_selector_all("#panel-scoring .bar", "bars => bars.map(b => [b.dataset.label, "
                                  "Number(b.dataset.prob), Number(b.getAttribute('width'))])")
    assert [label for label, _, _ in bars] == labels
    assert [prob for _, prob, _ in bars] == probs
    assert [w for _, _, w in bars] == pytest.approx([300 * v for v in probs], abs=0.01)
    cells = p.eval_on_selector_all("#panel-scoring td.score", "cells => cells.map(c => "
                                   "[Number(c.dataset.prob), Number(c.dataset.logprob)])")
    assert cells == [[e["prob"], e["logprob"]] for e in expected]
    # A label's tooltip lists its tokens.
    p.focus("#panel-scoring thead th >> nth=3")
    tip = p.inner_text("#tooltip")
    assert "3 tokens" in tip
    for token, token_id in zip(expected[2]["tokens"], expected[2]["token_ids"]):
        assert f"{json.dumps(token)} id {token_id}" in tip
    shot(p, "scoring")
    # "Copy as Python" is code that runs and gets the same answer.
    p.click("#panel-scoring .requests summary")
    code = p.inner_text("#panel-scoring .request .code-python")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FREETOKEN_API_KEY": KEY})
    assert run.returncode == 0, run.stderr
    assert ast.literal_eval(run.stdout)["data"][0]["labels"] == expected
    if shutil.which("curl"):
        code = p.inner_text("#panel-scoring .request .code-curl")
        run = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "FREETOKEN_API_KEY": KEY})
        assert json.loads(run.stdout)["data"][0]["labels"] == expected, run.stderr

    p.fill("#scoring-prompts", "hi\n---\nWhat is the weather in Paris?")
    page.run("scoring")
    path, body = page.sent[-1]
    data = generative_scoring(playground, body)["data"]
    cells = p.eval_on_selector_all("#panel-scoring td.score",
                                   "cells => cells.map(c => Number(c.dataset.prob))")
    assert cells == [e["prob"] for d in data for e in d["labels"]]
    chosen = p.eval_on_selector_all("#panel-scoring tbody tr td:last-child",
                                    "cells => cells.map(c => c.textContent)")
    assert chosen == [json.dumps(max(d["labels"], key=lambda e: e["prob"])["label"])
                      for d in data]
    shot(p, "scoring-prompts")


def test_phone_width(browser, playground):
    page = Page(browser, playground, width=390)
    try:
        p = page.open("chat")
        p.fill("#chat-user", "hi")
        page.run("chat")
        assert page.errors == []
        # Nothing wider than the screen: no sideways scrolling.
        assert p.evaluate("document.documentElement.scrollWidth") <= 390
        shot(p, "phone")
    finally:
        page.close()
