"""The playground's static files over a stand-in state: served at / and /playground without the
API key (the page's own API calls still need it), off with --no-playground, nothing else read."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from freetoken.config import FrontendConfig, frontend_config
from freetoken.serving.app import create_app
from freetoken.serving.launch.args import parse_args

STATIC = ["main.js", "api.js", "chat.js", "completion.js", "scoring.js", "tokens.js", "ui.js",
          "code.js", "style.css"]


def _client(**config) -> TestClient:
    config = FrontendConfig(served_model_name="m", max_model_len=64, vocab_size=100, **config)
    state = SimpleNamespace(config=config, dead=False, draining=False, engine_stats={},
                            num_running=0)
    return TestClient(create_app(lambda: state), raise_server_exceptions=False)


def test_the_page_and_its_files_are_served_with_a_strict_policy():
    client = _client()
    for path in ("/", "/playground", "/playground/"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert 'data-key-required="false"' in r.text
        assert "default-src 'self'" in r.headers["content-security-policy"]
    for name in STATIC:
        r = client.get(f"/playground/{name}")
        assert r.status_code == 200, name
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        assert r.headers["content-type"].startswith(kind), name
    assert client.head("/").status_code == 200


def test_the_page_needs_no_key_but_the_api_does():
    client = _client(api_key="sekrit")
    r = client.get("/")
    assert r.status_code == 200 and 'data-key-required="true"' in r.text and "sekrit" not in r.text
    assert client.get("/playground/main.js").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_only_the_shipped_files_and_only_get():
    client = _client()
    for path in ("/playground/../app.py", "/playground/app.py", "/playground/nothing.js",
                 "/playground/%2e%2e/app.py", "/index.html"):
        assert client.get(path).status_code == 404, path
    assert client.post("/", json={}).status_code in (404, 405)


def test_no_playground_turns_it_off():
    assert parse_args([]).no_playground is False
    assert parse_args(["--no-playground"]).no_playground is True
    hf_config = {"vocab_size": 100, "max_position_embeddings": 64}
    for flags, served in (([], True), (["--no-playground"], False)):
        assert frontend_config(parse_args(flags), hf_config, "m", (None, None)).playground is served
    client = _client(playground=False)
    for path in ("/", "/playground", "/playground/main.js"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
