"""`iquestrt serve` through real HTTP: the openai client and httpx against uvicorn on
127.0.0.1 (tests/server/conftest.py: the mini model, twins engine, max queue 2). The tests of
this module share one server and run in order."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

PROMPT = "def add(a, b):\n    "
WAIT_S = 120  # a bound on any one wait here


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)


def _metric(base: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(base + "/metrics", timeout=WAIT_S).text.splitlines():
        if line.startswith(name + "{"):
            got = line[len(name) + 1: line.index("}")]
            parts = ",".join(sorted(p for p in got.split(",") if not p.startswith("model_name")))
            if parts == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_completion_and_its_stream_agree(server):
    base, _, _ = server
    c = _client(base)
    out = c.completions.create(model="mini", prompt=PROMPT, max_tokens=12, seed=7,
                               temperature=1.0, top_p=0.95, extra_body={"top_k": 20})
    ch = out.choices[0]
    assert ch.finish_reason == "length" and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens > 0 and ch.text
    stream = c.completions.create(model="mini", prompt=PROMPT, max_tokens=12, seed=7,
                                  temperature=1.0, top_p=0.95, extra_body={"top_k": 20},
                                  stream=True)
    chunks = list(stream)
    assert "".join(x.choices[0].text for x in chunks) == ch.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) > 2  # text arrives as it is decoded, not once at the end


@pytest.mark.slow
def test_chat_completion_streams_the_same_reply(server):
    base, _, _ = server
    c = _client(base)
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Add two numbers."}]
    out = c.chat.completions.create(model="mini", messages=msgs, max_tokens=8, seed=1)
    reply = out.choices[0].message
    assert reply.role == "assistant" and out.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model="mini", messages=msgs, max_tokens=8, seed=1,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in chunks) == reply.content


def test_sse_framing_ends_with_done(server):
    base, _, _ = server
    with httpx.stream("POST", base + "/v1/completions", timeout=WAIT_S,
                      json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": PROMPT, "max_tokens": 4, "temprature": 1.0}, 400, "temprature"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "seed": -1}, 400, "seed"),
    ({"prompt": PROMPT, "seed": 2**64}, 400, "seed"),
    ({"prompt": PROMPT, "n": 2}, 400, "n"),
    ({"prompt": [1] * 300, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [1, 10**9], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 400, "model"),
    ({"max_tokens": 4}, 400, "prompt"),
])
def test_bad_requests_get_400_naming_the_field(server, body, status, param):
    base, _, _ = server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    r = httpx.post(base + "/v1/completions", timeout=WAIT_S, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def test_bad_chat_requests_get_400(server):
    base, _, _ = server
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role")):
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_models_health_and_metrics(server):
    """Self-contained: its own requests move the counters (the module's other tests may be
    deselected, e.g. by the fast tier's -m "not slow")."""
    base, _, _ = server
    before = _metric(base, "vllm:request_success_total", finished_reason="length")
    for i in range(3):
        r = httpx.post(base + "/v1/completions", timeout=WAIT_S,
                       json={"prompt": PROMPT, "max_tokens": 2, "seed": i, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(base + "/health", timeout=WAIT_S).json() == {"status": "ok"}
    models = httpx.get(base + "/v1/models", timeout=WAIT_S).json()["data"]
    assert [m["id"] for m in models] == ["mini"] and models[0]["max_model_len"] == 256
    text = httpx.get(base + "/metrics", timeout=WAIT_S).text
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "iquestrt:request_prefill_seconds_bucket"):
        assert name in text, name
    assert _metric(base, "vllm:request_success_total", finished_reason="length") == before + 3


def test_a_disconnected_stream_is_cancelled_and_the_next_request_runs(server):
    base, _, _ = server
    before = _metric(base, "vllm:request_success_total", finished_reason="cancelled")
    tokens = _metric(base, "vllm:generation_tokens_total")
    with httpx.stream("POST", base + "/v1/completions", timeout=WAIT_S,
                      json={"prompt": PROMPT, "max_tokens": 200, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    t = time.monotonic()
    out = _client(base).completions.create(model="mini", prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert _metric(base, "vllm:request_success_total", finished_reason="cancelled") == before + 1
    cancelled_tokens = _metric(base, "vllm:generation_tokens_total") - tokens - 2
    assert 1 <= cancelled_tokens < 200
    assert time.monotonic() - t < WAIT_S


@pytest.mark.slow
def test_a_full_queue_answers_429_and_the_queue_drains(server):
    base, _, _ = server
    hold = httpx.stream("POST", base + "/v1/completions", timeout=WAIT_S,
                        json={"prompt": PROMPT, "max_tokens": 200, "stream": True})
    r = hold.__enter__()
    lines = r.iter_lines()
    next(line for line in lines if line.startswith("data: {"))  # running now
    with ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(httpx.post, base + "/v1/completions", timeout=WAIT_S,
                              json={"prompt": PROMPT, "max_tokens": 2, "seed": i})
                  for i in range(2)]
        deadline = time.monotonic() + WAIT_S
        while _metric(base, "vllm:num_requests_waiting") < 2:
            assert time.monotonic() < deadline, "the two requests never queued"
            time.sleep(0.05)
        full = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                          timeout=WAIT_S)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
        hold.__exit__(None, None, None)  # the client goes: the running request is cancelled
        assert [q.result().status_code for q in queued] == [200, 200]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_load_no_request_lost_duplicated_or_mixed(server):
    """8 clients send 40 requests (8 distinct ones, 5 times each, shuffled): every answer
    equals the answer its request got alone; the server's memory stays flat."""
    base, proc, _ = server
    distinct = [{"prompt": f"x{i} = ", "max_tokens": 2, "seed": 100 + i} for i in range(8)]

    def send(body):
        r = httpx.post(base + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code in (200, 429), r.text
        return r

    alone = [send(b).json()["token_ids"] for b in distinct]
    rss0 = _rss_kb(proc.pid)
    order = [i for _ in range(5) for i in range(8)]
    order = order[3:] + order[:3]
    results: dict[int, list] = {}
    lock = threading.Lock()

    def client(k: int):
        for j in range(k, len(order), 8):
            while True:  # a 429 is retried: the load is bounded by the queue, not refused
                r = send(distinct[order[j]])
                if r.status_code == 200:
                    break
                time.sleep(float(r.headers["retry-after"]) / 10)
            with lock:
                assert j not in results
                results[j] = r.json()["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    assert sorted(results) == list(range(len(order)))
    assert all(results[j] == alone[order[j]] for j in results)
    grown = _rss_kb(proc.pid) - rss0
    assert grown < 64 * 1024, f"server RSS grew by {grown} kB over {len(order)} requests"
