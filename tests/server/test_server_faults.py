"""The app in-process (Starlette's TestClient) over the tiny model: a fault during decoding ends
that request with a 500 JSON body (an error event when streamed) and the next request is
served bit-identically; fuzzed request bodies get 200 or a 400 naming the field, never 500."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iquestrt import LLM
from iquestrt.cli import main
from iquestrt.engine import EngineError
from iquestrt.engine_options import EngineOptions
from iquestrt.server.app import ServerConfig, create_app

BODY = {"prompt": [1, 2, 3], "max_tokens": 4, "seed": 7}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    ck = tmp_path_factory.mktemp("faults") / "tiny"
    assert main(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", str(ck)]) == 0
    llm = LLM(ck, EngineOptions(backend="runtime", ops="twins", max_model_len=64))
    with TestClient(create_app(llm, ServerConfig(model_name="tiny"))) as client:
        yield client, llm


def _fault_once(llm, monkeypatch):
    """The next engine run raises EngineError (as a readiness fault would), then runs again."""
    real = type(llm).run
    calls = []

    def faulty(self, req):
        calls.append(1)
        if len(calls) == 1:
            raise EngineError("round 2: readiness failure flag raised by target layer 1")
        return real(self, req)

    monkeypatch.setattr(type(llm), "run", faulty)


def test_a_fault_is_a_500_body_and_the_next_request_is_served(app, monkeypatch):
    client, llm = app
    clean = client.post("/v1/completions", json=BODY)
    assert clean.status_code == 200
    _fault_once(llm, monkeypatch)
    bad = client.post("/v1/completions", json=BODY)
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "target layer 1" in err["message"]
    again = client.post("/v1/completions", json=BODY)
    assert again.status_code == 200
    assert again.json()["token_ids"] == clean.json()["token_ids"]
    metrics = client.get("/metrics").text
    assert 'iquestrt:request_failure_total{model_name="tiny"} 1.0' in metrics


def test_a_fault_mid_stream_is_an_error_event_then_done(app, monkeypatch):
    client, llm = app
    from iquestrt import api

    real = api.TextStream._run

    def broken(self):
        self._error = EngineError("round 1: logits contain NaN (target layer 2)")
        self._q.put(api._END)

    monkeypatch.setattr(api.TextStream, "_run", broken)
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["type"] == "server_error" and "logits contain NaN" in err["message"]
    monkeypatch.setattr(api.TextStream, "_run", real)
    assert client.post("/v1/completions", json=BODY).status_code == 200


values = st.none() | st.booleans() | st.integers(-2**65, 2**65) | st.floats() \
    | st.text(max_size=6) | st.lists(st.integers(-3, 10**6), max_size=4)
FIELDS = ["prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
          "stop_token_ids", "stream", "model", "n", "ignore_eos", "bogus"]


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), values, max_size=5),
       chat=st.booleans())
def test_fuzzed_bodies_get_200_or_a_400_naming_the_problem(app, body, chat):
    client, _ = app
    if chat:
        body = {k: v for k, v in body.items() if k != "prompt"}
        body["messages"] = [{"role": "user", "content": "hi"}] if "bogus" not in body else 3
        url = "/v1/chat/completions"
    else:
        url = "/v1/completions"
    body.setdefault("max_tokens", 2)
    text = json.dumps(body, allow_nan=True)  # NaN / Infinity as a careless client sends them
    r = client.post(url, content=text, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
    assert client.get("/health").status_code == 200


def test_the_top_k_limit_is_a_400_that_says_it(app):
    client, _ = app
    r = client.post("/v1/completions", json={**BODY, "top_k": 0, "temperature": 1.0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "top_k" and "1 <= top_k <= 64" in err["message"], err
