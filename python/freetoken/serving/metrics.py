"""Prometheus metrics for `GET /metrics`: vLLM's names, with a `freetoken:` prefix.

Three sources, none of which adds a channel to the engine or work to a step:
- latencies and token counts are observed in the frontend as the engine's messages arrive
  (`RequestTimer`, one per engine request: time to first token, inter-token, end to end);
- HTTP requests by endpoint and status are counted by an ASGI wrapper (`HttpMetrics`);
- what lives in the engine process (running and waiting requests, KV usage, the prefix cache,
  preemptions) is read at scrape time from the stats snapshot that every engine message
  already carries (`_Snapshot`, with the token counts), so a scrape costs the engine nothing.
Only the HTTP process serves them; with tensor parallelism that is the frontend on node 0, and
the stats it holds are rank 0's scheduler's, which schedules for the whole group.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PATH = "/metrics"

# No `_created` series beside each counter and histogram: they double the exposition and say
# nothing a restart (engine_start_time_seconds) does not.
disable_created_metrics()

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RequestTimer:
    """When one engine request arrived at the frontend, and when its last tokens did."""

    __slots__ = ("arrival", "last")

    def __init__(self) -> None:
        self.arrival = time.perf_counter()
        self.last: float | None = None


class Metrics:
    """The registry of one server. `get_stats` returns the engine's latest stats snapshot."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict]):
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_start_time_seconds, memory, CPU
        labels, model = ["model_name"], [model_name]
        self.http_requests = Counter("freetoken:http_requests", "HTTP requests by endpoint and "
                                     "status code.", ["endpoint", "status"], registry=registry)
        self._success = Counter("freetoken:request_success", "Engine requests that finished, by "
                                "finish reason (errors are not counted).",
                                [*labels, "finished_reason"], registry=registry)
        # Plain ints, exported at scrape time: they move on every engine message, where a
        # prometheus_client Counter would take a lock each time (the event loop is one thread).
        self.prompt_tokens = self.generation_tokens = 0
        self._ttft = Histogram("freetoken:time_to_first_token_seconds", "Time from the request's "
                               "arrival to its first token.", labels, buckets=TTFT_BUCKETS,
                               registry=registry).labels(*model)
        self._itl = Histogram("freetoken:inter_token_latency_seconds", "Time between a "
                              "request's successive tokens.", labels, buckets=ITL_BUCKETS,
                              registry=registry).labels(*model)
        self._e2e = Histogram("freetoken:e2e_request_latency_seconds", "Time from the request's "
                              "arrival to its last token.", labels, buckets=E2E_BUCKETS,
                              registry=registry).labels(*model)
        # Restarts: an engine that dies takes the server down and a supervisor restarts it
        # (docs/server.md), so the counter that would survive a restart cannot live here;
        # changes() of this start time counts them.
        Gauge("freetoken:engine_start_time_seconds", "Unix time at which the engine serving "
              "now became ready.", labels, registry=registry).labels(*model).set(time.time())
        registry.register(_Snapshot(self, get_stats))

    def on_tokens(self, timer: RequestTimer, prompt_tokens: int, new_tokens: int) -> None:
        """An engine message with `new_tokens` tokens (and, on the first, the prompt's size)."""
        now = time.perf_counter()
        if timer.last is None:
            self._ttft.observe(now - timer.arrival)
        else:
            self._itl.observe(now - timer.last)
        timer.last = now
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += new_tokens

    def on_finish(self, timer: RequestTimer, finish_reason: str | None) -> None:
        if finish_reason == "error":
            return
        self._success.labels(self.model_name, finish_reason or "unknown").inc()
        self._e2e.observe(time.perf_counter() - timer.arrival)

    def exposition(self) -> tuple[bytes, str]:
        """The text format of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Snapshot(Collector):
    """Series read when Prometheus scrapes: the frontend's token counts, and the engine's gauges
    and counters from the snapshot of its last message (empty before the first: zeros). The
    engine counts since it started, which is a Prometheus counter's rule."""

    def __init__(self, metrics: Metrics, get_stats: Callable[[], dict]):
        self.metrics, self.model, self.get_stats = metrics, [metrics.model_name], get_stats

    def collect(self):
        stats = self.get_stats()
        total = stats.get("kv_total", 0)
        gauges = [("num_requests_running", "Requests in the engine's running batch.",
                   stats.get("running", 0)),
                  ("num_requests_waiting", "Requests waiting for the engine.",
                   stats.get("waiting", 0)),
                  ("kv_cache_usage_perc", "Fraction of the KV pool that requests hold (slots "
                   "only the prefix cache holds are evictable and count as free).",
                   stats.get("kv_used", 0) / total if total else 0.0),
                  ("batch_invariant", "1 where every linear layer runs on a kernel whose rows "
                   "were found alike at every row count on this CPU (a row's result does not "
                   "depend on its batch), else 0.", stats.get("batch_invariant", 0))]
        counters = [("num_preemptions", "Requests preempted for KV space (recomputed later).",
                     stats.get("preemptions", 0)),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     stats.get("prefix_cache_queries", 0)),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     stats.get("prefix_cache_hits", 0)),
                    ("prompt_tokens", "Prompt tokens of the engine requests (cached ones "
                     "included).", self.metrics.prompt_tokens),
                    ("generation_tokens", "Generated tokens.", self.metrics.generation_tokens)]
        if "spec_decode_method" in stats:
            method = [*self.model, stats["spec_decode_method"]]
            for name, doc in (("num_drafts", "Drafts verified (speculative decoding)."),
                              ("num_draft_tokens", "Draft tokens proposed."),
                              ("num_accepted_tokens", "Draft tokens accepted."),
                              ("num_emitted_tokens", "Tokens emitted by the steps that verified a "
                               "draft (accepted ones and the token sampled after them).")):
                family = CounterMetricFamily(f"freetoken:spec_decode_{name}", doc,
                                             labels=["model_name", "method"])
                family.add_metric(method, stats.get(f"spec_decode_{name}", 0))
                yield family
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"freetoken:{name}", doc, labels=["model_name"])
            family.add_metric(self.model, value)
            yield family
        if stats.get("kernel_plan"):
            family = GaugeMetricFamily("freetoken:kernel_info", "1 for each op's kernel in the "
                                       "load-time kernel plan (kernels/plan.py).",
                                       labels=["model_name", "op", "kernel"])
            for op, kernel in stats["kernel_plan"].items():
                family.add_metric([*self.model, op, kernel], 1)
            yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(f"freetoken:{name}", doc, labels=["model_name"])
            family.add_metric(self.model, value)
            yield family


class HttpMetrics:
    """ASGI wrapper counting each HTTP request by endpoint and status code, refusals included.
    Paths that are not routes count as "other": a scan of random paths must not make series."""

    def __init__(self, app, get_metrics: Callable[[], Metrics | None], endpoints: set[str]):
        self.app, self.get_metrics, self.endpoints = app, get_metrics, endpoints

    async def __call__(self, scope, receive, send):
        metrics = self.get_metrics() if scope["type"] == "http" else None
        if metrics is None:
            return await self.app(scope, receive, send)
        status = 500  # what the client gets if the app raises before it answers

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            path = scope["path"]
            metrics.http_requests.labels(path if path in self.endpoints else "other",
                                         str(status)).inc()
