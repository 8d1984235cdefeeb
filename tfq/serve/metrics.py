"""The server's Prometheus metrics, in a registry of its own (several servers can share a process: the tests)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no `_created` timestamp series beside every counter: they only add noise here

OUTCOMES = ("finished", "failed", "aborted", "invalid", "unauthorized", "busy")
# Seconds: a first token on two cores takes from tens of milliseconds (a tiny model) to minutes (a long queue).
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TBT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    def __init__(self, lanes: int, pool_pages: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tfq_requests", "HTTP requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("tfq_prompt_tokens", "Prompt tokens of requests run", registry=r)
        self.generation_tokens = Counter("tfq_generation_tokens", "Tokens drawn", registry=r)
        self.waiting = Gauge("tfq_queue_streams", "Streams waiting for a lane", registry=r)
        self.streams = Gauge("tfq_streams", "Streams submitted and not finished (running or waiting)", registry=r)
        self.busy = Gauge("tfq_lanes_busy", "Lanes holding a stream", registry=r)
        Gauge("tfq_lanes", "Lanes of the plan", registry=r).set(lanes)
        self.free_pages = Gauge("tfq_pages_free", "Pages of the pool no stream holds", registry=r)
        self.free_pages.set(pool_pages)
        Gauge("tfq_pages", "Pages of the pool", registry=r).set(pool_pages)
        self.preemptions = Counter("tfq_preemptions", "Streams sent back to the queue for lack of pages", registry=r)
        self._preempted = 0
        self.cached_pages = Gauge("tfq_pages_cached", "Pages no stream holds that the prefix cache keeps", registry=r)
        self.reused = Counter("tfq_prefix_cache_reused_rows", "Rows streams took from the prefix cache", registry=r)
        self._reused = 0
        self.disk = Gauge("tfq_prefix_store_pages", "Pages of the prefix store on disk, since start: read back into "
                          "the cache, written, ignored (not this cache's, or damaged)", ["event"], registry=r)
        for event in ("read", "written", "ignored"):
            self.disk.labels(event)
        self.ttft = Histogram("tfq_time_to_first_token_seconds", "From a request's arrival to each choice's first "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("tfq_time_between_tokens_seconds", "Between a choice's tokens",
                             buckets=TBT_BUCKETS, registry=r)

    def outcome(self, name: str) -> None:
        self.requests.labels(name).inc()

    def token(self, seconds: float, first: bool) -> None:
        (self.ttft if first else self.tbt).observe(seconds)
        self.generation_tokens.inc()

    def engine(self, stats, streams: int) -> None:
        """stats: tfq.engine.scheduler.Stats; streams: submitted and not finished."""
        self.cached_pages.set(stats.cached_pages)
        if stats.reused_rows > self._reused:
            self.reused.inc(stats.reused_rows - self._reused)
            self._reused = stats.reused_rows
        for event, n in zip(("read", "written", "ignored"), stats.disk):
            self.disk.labels(event).set(n)
        self.waiting.set(stats.waiting)
        self.busy.set(stats.running)
        self.free_pages.set(stats.free_pages)
        self.streams.set(streams)
        if stats.preemptions > self._preempted:
            self.preemptions.inc(stats.preemptions - self._preempted)
            self._preempted = stats.preemptions

    def text(self) -> bytes:
        return generate_latest(self.registry)
