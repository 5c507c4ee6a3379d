"""`GET /metrics`: the server's figures in Prometheus' text format (prometheus_client).

Each app has its own `CollectorRegistry`, so that several apps in one process (the
tests) keep their counts apart. Counters and histograms move as rank 0's `Monitor`
(server/status.py) observes requests, tokens and steps; the per-rank gauges (step
time, memory) and the queue are read from the monitor when Prometheus scrapes.
`RequestCounter` is the ASGI middleware that counts requests by route and status.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "llama_tp"
# Seconds: from a few ms (a cached prompt on a fast Mac) to minutes (a long prompt on a CPU).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    """The app's registry and the metrics that events move (the `Monitor`'s sink)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of the requests", registry=r
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens", "Tokens generated", registry=r
        )
        self.cache_hits = Counter(
            f"{PREFIX}_prompt_cache_hits", "Requests whose prompt was found in the prompt cache",
            registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            f"{PREFIX}_prompt_cached_tokens", "Prompt tokens taken from the prompt cache",
            registry=r,
        )  # fmt: skip
        self.embedding_inputs = Counter(
            f"{PREFIX}_embedding_inputs", "Inputs embedded (each one vector)", registry=r
        )
        self.embedding_tokens = Counter(
            f"{PREFIX}_embedding_tokens", "Tokens of the inputs embedded", registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From queueing a request to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Between a request's successive tokens",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            f"{PREFIX}_batch_size", "Sequences decoded together per step",
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip

    # -- the Monitor's sink --

    def first_token(self, seconds: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        if cached_tokens:
            self.cache_hits.inc()
            self.cached_tokens.inc(cached_tokens)

    def tokens(self, n: int, seconds_each: float | None) -> None:
        self.completion_tokens.inc(n)
        if seconds_each is not None:
            self.per_token.observe(seconds_each)

    def stepped(self, batch: int) -> None:
        self.batch.observe(batch)

    def embedded(self, inputs: int, tokens: int) -> None:
        self.embedding_inputs.inc(inputs)
        self.embedding_tokens.inc(tokens)

    def watch(self, monitor, scheduler) -> None:
        """Export `monitor`'s per-rank figures and `scheduler`'s queue at each scrape."""
        self.registry.register(_Live(monitor, scheduler))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Live(Collector):
    """Gauges read when scraped: queue, running sequences, tokens/s, each rank's figures."""

    def __init__(self, monitor, scheduler) -> None:
        self.monitor, self.scheduler = monitor, scheduler

    def describe(self):
        return []  # collected only at scrape time (no registration-time collect)

    def collect(self):
        m, s = self.monitor, self.scheduler
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting", s.queued())
        yield GaugeMetricFamily(f"{PREFIX}_running", "Sequences being decoded", sum(s.rows()))
        yield GaugeMetricFamily(
            f"{PREFIX}_tokens_per_second", "Tokens generated per second (last 5 s)",
            m.tokens_per_second(),
        )  # fmt: skip
        step = GaugeMetricFamily(
            f"{PREFIX}_rank_step_seconds", "Mean generation step of each rank", labels=["rank"]
        )
        memory = GaugeMetricFamily(
            f"{PREFIX}_rank_memory_bytes", "MLX memory of each rank (active, peak)",
            labels=["rank", "kind"],
        )  # fmt: skip
        for r in m.reports:
            if r.step_seconds is not None:
                step.add_metric([str(r.rank)], r.step_seconds)
            memory.add_metric([str(r.rank), "active"], r.active_memory)
            memory.add_metric([str(r.rank), "peak"], r.peak_memory)
        yield step
        yield memory


class RequestCounter:
    """ASGI middleware: counts each HTTP request by its route's path and its status."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def sent(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(path, str(status[0])).inc()
