"""Benchmark of `iquestrt serve` streaming (GPU): does a streamed request's time per output
token, as the client sees it, stay close to the engine's decode clock?

Starts a real server (uvicorn in a child process, iquestrt/server/spawn.py) on the checkpoint,
warms it up (Triton compilation and round-graph capture happen in the first requests), then
alternates --pairs times: one streamed completion, one non-streamed completion, same prompt,
seed and budget (ignore_eos: every request emits exactly --max-tokens tokens). Per request:

  client TPOT    streamed: (arrival of the finish chunk − arrival of the first chunk) / (n − 1),
                 timed on the client with perf_counter per server-sent event
  engine TPOT    the engine's decode clock / (n − 1): the streamed request's own (the increase
                 of /metrics vllm:time_per_output_token_seconds_sum, one observation), and the
                 non-streamed request's (its response's metrics.time_per_output_token_s; the
                 device loop reads the log once)

The verdict compares the median client TPOT of the streamed requests with the median decode
clock of the non-streamed ones (--within, default 10 %). The streamed text must equal the
non-streamed text (same seed: same tokens).

    python3 -m benchmarks.bench_serve --out DIR [--checkpoint CK] [--pairs 5]
        [--max-tokens 512] [--draft-depth 3] [--ops auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iquestrt import assets
from iquestrt.report.provenance import revision
from iquestrt.server.spawn import spawn

TPOT_SUM = "vllm:time_per_output_token_seconds"
START_S = 600  # loading and importing; compilation happens in the warm-up requests
REQUEST_S = 300


def _tpot_sum(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == TPOT_SUM:
            return sum(s.value for s in fam.samples if s.name == TPOT_SUM + "_sum")
    raise RuntimeError(f"/metrics: no {TPOT_SUM} histogram")


def streamed(client: httpx.Client, body: dict) -> dict:
    """One streamed completion → text, finish reason, client TPOT and chunk arrival times."""
    arrivals, text, finish = [], [], None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"streamed request: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            arrivals.append(time.perf_counter())
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
    n = body["max_tokens"]
    return {"text": "".join(text), "finish_reason": finish, "chunks": len(arrivals),
            "client_tpot_s": (arrivals[-1] - arrivals[0]) / (n - 1),
            "first_to_last_s": arrivals[-1] - arrivals[0]}


def plain(client: httpx.Client, body: dict) -> dict:
    r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"request: HTTP {r.status_code}: {r.text[:300]}")
    out = r.json()
    m = out["metrics"]
    return {"text": out["choices"][0]["text"], "finish_reason": out["choices"][0]["finish_reason"],
            "engine_tpot_s": m["time_per_output_token_s"], "decode_s": m["decode_s"],
            "rounds": m["rounds"], "prefill_s": m["prefill_s"], "setup_s": m["setup_s"],
            "mean_acceptance_length": m["speculative_decoding"]["mean_acceptance_length"]}


def run(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    args = ["--checkpoint", str(a.checkpoint), "--ops", a.ops, "--draft-depth", a.draft_depth,
            "--max-model-len", str(a.max_model_len), "--model-name", "bench"]
    served = spawn(args, out / "server.log", START_S, env=dict(os.environ))
    body = {"prompt": a.prompt, "max_tokens": a.max_tokens, "seed": a.seed, "ignore_eos": True}
    rows = []
    try:
        with httpx.Client(base_url=served.base, timeout=REQUEST_S) as client:
            for _ in range(a.warmup):
                plain(client, body)
                streamed(client, body)
            for i in range(a.pairs):
                before = _tpot_sum(client)
                s = streamed(client, body)
                s["engine_tpot_s"] = _tpot_sum(client) - before
                p = plain(client, body)
                if s["text"] != p["text"]:
                    raise RuntimeError(f"pair {i}: streamed text differs from the non-streamed "
                                       "text for the same seed")
                for r in (s, p):
                    if r["finish_reason"] != "length":
                        raise RuntimeError(f"pair {i}: finish {r['finish_reason']!r}, expected "
                                           f"'length' ({a.max_tokens} tokens)")
                rows.append({"pair": i, "streamed": {k: v for k, v in s.items() if k != "text"},
                             "plain": {k: v for k, v in p.items() if k != "text"}})
                print(f"pair {i}: client {s['client_tpot_s'] * 1e3:.3f} ms/token (stream; "
                      f"engine {s['engine_tpot_s'] * 1e3:.3f}), engine "
                      f"{p['engine_tpot_s'] * 1e3:.3f} ms/token (no stream)", flush=True)
    finally:
        served.stop()
    client_med = statistics.median(r["streamed"]["client_tpot_s"] for r in rows)
    plain_med = statistics.median(r["plain"]["engine_tpot_s"] for r in rows)
    stream_engine_med = statistics.median(r["streamed"]["engine_tpot_s"] for r in rows)
    ratio = client_med / plain_med
    result = {
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.bench_serve",
                             *sys.argv[1:]]),
        "revision": os.environ.get("IQUESTRT_REVISION") or revision()["commit"],
        "settings": {k: str(v) for k, v in vars(a).items()},
        "pairs": rows,
        "median_client_tpot_s": client_med, "median_stream_engine_tpot_s": stream_engine_med,
        "median_plain_engine_tpot_s": plain_med,
        "client_over_engine": ratio, "within": a.within,
        "verdict": "pass" if abs(ratio - 1) <= a.within else "fail",
    }
    (out / "bench_serve.json").write_text(json.dumps(result, indent=1))
    (out / "bench_serve.md").write_text(table(result))
    print(table(result))
    return result


def table(r: dict) -> str:
    lines = ["| pair | client TPOT, streamed (ms) | engine TPOT, streamed (ms) | engine TPOT, "
             "not streamed (ms) | chunks | rounds |", "| --- | --- | --- | --- | --- | --- |"]
    for row in r["pairs"]:
        s, p = row["streamed"], row["plain"]
        lines.append(f"| {row['pair']} | {s['client_tpot_s'] * 1e3:.4f} | "
                     f"{s['engine_tpot_s'] * 1e3:.4f} | {p['engine_tpot_s'] * 1e3:.4f} | "
                     f"{s['chunks']} | {p['rounds']} |")
    lines += ["", f"median client TPOT (streamed) / median engine decode clock (not streamed): "
              f"{r['client_over_engine']:.3f} → {r['verdict']} (within ±{r['within']:.0%})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--ops", default="auto", choices=("auto", "kernels", "twins"))
    p.add_argument("--draft-depth", default="3")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--within", type=float, default=0.10)
    a = p.parse_args(argv)
    if a.max_tokens < 2 or a.pairs < 1:
        p.error("--max-tokens must be >= 2 and --pairs >= 1")
    a.checkpoint = a.checkpoint or assets.default_model()
    return 0 if run(a)["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
