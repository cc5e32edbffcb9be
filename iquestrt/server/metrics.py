"""Prometheus metrics of one server (its own registry). Names: vLLM's where vLLM has the
quantity (a vLLM dashboard reads them as they are), `iquestrt:` for the phase clocks vLLM does
not split out. Every series carries model_name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from iquestrt.api import RequestOutput

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, model_name: str, max_depth: int):
        self.registry = r = CollectorRegistry()
        self.model = model_name
        m = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               m + ["finished_reason"], registry=r)
        self.failed = Counter("iquestrt:request_failure", "Requests ended by a fault during "
                              "decoding (answered 500, or an error event when streamed).", m,
                              registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running (0 or 1).", m,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued.", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token "
                              "(queue wait + prefill).", m, buckets=SECONDS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Decode clock per output "
                              "token after the first.", m, buckets=SECONDS, registry=r)
        self.prefill = Histogram("iquestrt:request_prefill_seconds", "Prefill to the first "
                                 "token (includes Triton compilation on the first request).", m,
                                 buckets=SECONDS, registry=r)
        self.setup = Histogram("iquestrt:request_setup_seconds", "Decode set-up: device state, "
                               "round graphs when captured.", m, buckets=SECONDS, registry=r)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verification rounds with drafts.",
                              m, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.", m,
                                    registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Accepted draft "
                                "tokens.", m, registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted "
                                    "draft tokens by draft position.", m + ["position"],
                                    registry=r)
        for g in (self.running, self.waiting):
            g.labels(self.model).set(0)
        for j in range(max_depth):  # every position shows up from the start
            self.accepted_pos.labels(self.model, str(j))

    def finished(self, out: RequestOutput, ttft_s: float) -> None:
        m, t, s = self.model, out.timing, out.spec
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(len(out.token_ids))
        self.success.labels(m, out.finish_reason).inc()
        self.ttft.labels(m).observe(ttft_s)
        if t.time_per_output_token_s is not None:
            self.tpot.labels(m).observe(t.time_per_output_token_s)
        self.prefill.labels(m).observe(t.prefill_s)
        self.setup.labels(m).observe(t.setup_s)
        self.drafts.labels(m).inc(s.num_drafts)
        self.draft_tokens.labels(m).inc(s.num_draft_tokens)
        self.accepted.labels(m).inc(s.num_accepted_tokens)
        for j, a in enumerate(s.accepted_per_position):
            self.accepted_pos.labels(m, str(j)).inc(a)
