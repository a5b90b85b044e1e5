"""The FastAPI app over a stand-in state: error shapes, the API key, body limits, a dead or
draining engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from freetoken.config import FrontendConfig
from freetoken.serving.app import create_app

ERROR_KEYS = {"message", "type", "param", "code"}


def _client(dead=False, api_key=None, draining=False, max_request_bytes=1 << 20):
    config = FrontendConfig(served_model_name="m", max_model_len=64, vocab_size=100, api_key=api_key,
                            max_request_bytes=max_request_bytes)
    state = SimpleNamespace(config=config, dead=dead, draining=draining, engine_stats={},
                            num_running=0)
    return TestClient(create_app(lambda: state), raise_server_exceptions=False)


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def test_schema_errors_are_openai_400s_naming_the_field():
    err = _error(_client().post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}), 400)
    assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
    # A list index in pydantic's location is not a field name.
    err = _error(_client().post("/v1/completions", json={"prompt": [1, "a", 2]}), 400)
    assert err["param"] == "prompt"


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids",
     "allowed_token_ids must not be empty"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate",
     "Unknown field 'frobnicate': refused rather than ignored"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2,
                              "temperature": 0},
     "n", "n must be 1 when using greedy sampling, got 2."),
    ("/tokenize", {}, "prompt", "give exactly one of prompt or messages"),
])
def test_a_request_rule_refuses_with_its_own_message_and_param(path, body, param, message):
    """Raised inside the request's validator, the refusal reaches the client as itself, not as
    pydantic's wording."""
    err = _error(_client().post(path, json=body), 400)
    assert (err["param"], err["message"], err["type"]) == (param, message, "invalid_request_error")


def test_invalid_json_names_no_byte_offset():
    r = _client().post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2,,}',
                       headers={"content-type": "application/json"})
    err = _error(r, 400)
    assert err["param"] is None and "not valid JSON" in err["message"]


def test_missing_content_type_says_what_to_send():
    err = _error(_client().post("/v1/completions", content=b'{"prompt": "x"}'), 400)
    assert "application/json" in err["message"]


@pytest.mark.parametrize("method,path,status", [("get", "/v1/nothing", 404),
                                                 ("get", "/v1/completions", 405),
                                                 ("delete", "/v1/models", 405)])
def test_unknown_routes_and_methods_are_openai_errors(method, path, status):
    _error(getattr(_client(), method)(path), status)


def test_oversized_bodies_get_413_by_length_and_by_count():
    client = _client(max_request_bytes=1000)
    _error(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413)

    def chunks():  # no Content-Length: the limit counts what arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "max-request-bytes" in _error(r, 413)["message"]


def test_surrogate_model_name_is_a_404_not_a_500():
    r = _client().post("/v1/completions", content=b'{"model": "\\ud800", "prompt": "x"}',
                       headers={"content-type": "application/json"})
    assert "\\ud800" in r.text  # escaped, not a UTF-8 encoding failure
    assert _error(r, 404)["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/stats", "/tokenize", "/detokenize"])
def test_api_key_guards_every_route_but_health(path):
    client = _client(api_key="secret")
    call = client.get if path.startswith("/v1") else client.post
    assert _error(call(path), 401)["type"] == "authentication_error"
    assert _error(call(path, headers={"authorization": "Bearer wrong"}), 401)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("header", ["Bearer secret", "bearer secret", "BEARER  secret"])
def test_bearer_scheme_is_case_insensitive(header):
    ok = _client(api_key="secret").get("/v1/models", headers={"authorization": header})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"


def test_dead_engine_turns_health_and_requests_into_503():
    client = _client(dead=True)
    assert _error(client.get("/health"), 503)["code"] == "engine_dead"
    assert _error(client.post("/v1/completions", json={"prompt": "x"}), 503)["code"] == "engine_dead"


def test_draining_server_refuses_new_requests_with_503():
    client = _client(draining=True)
    assert _error(client.get("/health"), 503)["code"] == "shutdown"
    assert _error(client.post("/v1/completions", json={"prompt": "x"}), 503)["code"] == "shutdown"


def test_a_model_is_retrieved_by_its_id_and_an_unknown_id_is_an_openai_404():
    client = _client()
    card = client.get("/v1/models/m").json()
    assert card == client.get("/v1/models").json()["data"][0] and card["id"] == "m"
    err = _error(client.get("/v1/models/org/other"), 404)
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error"


def test_an_anthropic_client_may_send_its_key_as_x_api_key():
    client = _client(api_key="k")
    assert client.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200
    assert client.get("/v1/models", headers={"x-api-key": "nope"}).status_code == 401


def test_the_gate_answers_anthropic_routes_in_anthropics_shape():
    r = _client(api_key="k").post("/v1/messages", json={})
    assert r.status_code == 401 and r.json() == {
        "type": "error", "error": {"type": "authentication_error", "message": "Invalid API key"}}
    r = _client(dead=True).post("/v1/messages/count_tokens", json={})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
