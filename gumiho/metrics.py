"""The server's running totals, served at `GET /metrics` in Prometheus' text format.

Named after vLLM's metrics where they mean the same (prefix `gumiho:` for `vllm:`), so a
dashboard built for a vLLM server with speculative decoding reads these with the prefix
changed: the requests running and waiting, prompt and generated tokens, finished requests by
reason, end-to-end latency and time to the first token, the prefix cache's queries and
hits, and the speculative loop's cycles and accepted draft tokens, in
all and by draft position. From them: mean tokens per cycle (tau, the prefill's cycle left
out) = 1 + accepted / cycles; the acceptance at position k = accepted_per_pos{k} / cycles.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from gumiho.engine import GenerationResult

# finish reasons as vLLM counts them: a stream whose client left is an abort
REASON = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length",
          "closed": "abort"}


def added(a: list[int], b: list[int]) -> list[int]:
    """Two per-depth counts added, the shorter padded with zeros."""
    return [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)),
                                  strict=True)]


class Metrics:
    """Totals over the requests answered so far; `record` and `refused` from any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cycles = 0  # verify cycles (the prefill, which drafts nothing, left out)
        self.accepted_at: list[int] = []  # cycles that accepted a draft at position k
        self.finished: Counter[str] = Counter()  # requests by finish reason
        self.refused_by: Counter[int] = Counter()  # requests refused, by HTTP status
        self.prefix_hits = 0  # prompt tokens reused from the cache (reuse_prefix)
        self.latency_s = 0.0
        self.first_token_s = 0.0
        self.requests = 0

    def record(self, prompt_tokens: int, results: list[GenerationResult], arrived: float,
               began: float) -> None:
        """One request's answers (n of them), done now; it `arrived` and its first answer
        `began` (left the queue) at those `time.perf_counter()` readings: its first token
        came after the wait and the first answer's prefill cycle."""
        now = time.perf_counter()
        with self.lock:
            self.requests += 1
            self.latency_s += now - arrived
            self.first_token_s += began - arrived + (results[0].cycle_s or [0.0])[0]
            for result in results:
                self.prompt_tokens += prompt_tokens
                self.prefix_hits += result.reused_tokens
                self.generation_tokens += result.new_tokens
                self.finished[REASON.get(result.stopped_by, "stop")] += 1
                self.cycles += max(result.cycles - 1, 0)  # the prefill's left out
                self.accepted_at = added(self.accepted_at, result.accepted_by_depth())

    def refused(self, status: int) -> None:
        with self.lock:
            self.refused_by[int(status)] += 1

    def text(self, running: int, waiting: int) -> str:
        """Every metric in Prometheus' text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, about: str, values: list[tuple[str, float]]):
            lines.extend([f"# HELP gumiho:{name} {about}", f"# TYPE gumiho:{name} {kind}"])
            lines.extend(f"gumiho:{name}{labels} {number(value)}" for labels, value in values)

        with self.lock:
            metric("num_requests_running", "gauge", "Requests generating now.",
                   [("", running)])
            metric("num_requests_waiting", "gauge", "Requests waiting for the generator.",
                   [("", waiting)])
            metric("prompt_tokens_total", "counter", "Prompt tokens processed (once per "
                   "answer).", [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [("", self.generation_tokens)])
            metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the "
                   "cache (every answer's).", [("", self.prompt_tokens)])
            metric("prefix_cache_hits_total", "counter", "Prompt tokens whose entries were "
                   "reused (--reuse-prefix).", [("", self.prefix_hits)])
            metric("request_success_total", "counter", "Answers finished, by reason.",
                   [(f'{{finished_reason="{r}"}}', self.finished[r])
                    for r in ("stop", "length", "abort")])
            metric("request_refused_total", "counter", "Requests refused, by HTTP status.",
                   [(f'{{status="{s}"}}', n) for s, n in sorted(self.refused_by.items())])
            lines.extend(["# HELP gumiho:e2e_request_latency_seconds Time from a request's "
                          "arrival to its last token.",
                          "# TYPE gumiho:e2e_request_latency_seconds summary",
                          f"gumiho:e2e_request_latency_seconds_sum {number(self.latency_s)}",
                          f"gumiho:e2e_request_latency_seconds_count {self.requests}",
                          "# HELP gumiho:time_to_first_token_seconds Time from a request's "
                          "arrival to its first token (its wait and its prefill).",
                          "# TYPE gumiho:time_to_first_token_seconds summary",
                          f"gumiho:time_to_first_token_seconds_sum {number(self.first_token_s)}",
                          f"gumiho:time_to_first_token_seconds_count {self.requests}"])
            metric("spec_decode_num_drafts_total", "counter", "Verify cycles (each verifies "
                   "one draft tree; the prefill not counted).", [("", self.cycles)])
            # each accepted draft counts once, at its position
            metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens "
                   "accepted.", [("", sum(self.accepted_at))])
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Cycles that "
                   "accepted a draft token at this position (0: the first).",
                   [(f'{{position="{k}"}}', n) for k, n in enumerate(self.accepted_at)])
        return "\n".join(lines) + "\n"


def number(value: float) -> str:
    """A sample's value written exactly (`:g` keeps six digits: a counter past a million
    would stop moving in small steps)."""
    return str(value) if isinstance(value, int) else repr(float(value))
