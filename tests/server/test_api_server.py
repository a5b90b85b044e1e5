"""The FastAPI app over a stand-in state: error shapes, the API key, a dead engine."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from freetoken.server.api_server import FrontendConfig, create_app


def _client(dead=False, api_key=None):
    config = FrontendConfig(served_model_name="m", max_model_len=64, vocab_size=100, api_key=api_key)
    state = SimpleNamespace(config=config, dead=dead, engine_stats={}, num_running=0)
    return TestClient(create_app(lambda: state))


def test_schema_errors_are_openai_400s_naming_the_field():
    r = _client().post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
    r = _client().post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_api_key_guards_v1_routes():
    client = _client(api_key="secret")
    assert client.get("/v1/models").status_code == 401
    ok = client.get("/v1/models", headers={"authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"
    assert client.get("/health").status_code == 200


def test_dead_engine_turns_health_and_requests_into_503():
    client = _client(dead=True)
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
