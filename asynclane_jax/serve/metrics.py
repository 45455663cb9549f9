"""`/metrics`: the server's Prometheus metrics (text format, through prometheus-client).

  asynclane_requests_total{endpoint,status}        HTTP requests answered, refusals too
  asynclane_request_latency_seconds{endpoint}      a served completion (status 200), from
                                                   its arrival to its last byte
  asynclane_time_to_first_token_seconds{endpoint}  from a completion's arrival to its first
                                                   token final
  asynclane_generated_tokens_total                 completion tokens sent to clients (its
                                                   rate is tokens/s)
  asynclane_prompt_tokens_total                    prompt tokens of the requests submitted
  asynclane_queue_depth                            requests waiting for a row
  asynclane_slots_busy, asynclane_pool_slots       rows decoding a request (all pools);
                                                   rows per pool
  asynclane_pools, asynclane_pool_bytes            pools kept, and the bytes of the state
                                                   they hold on the device (K/V caches,
                                                   canvas, per-row counters; from shapes)
  asynclane_kv_budget_bytes                        the bound on asynclane_pool_bytes
                                                   (--kv-budget)
  asynclane_pool_evictions_total                   pools dropped and idle states released
  asynclane_compiles_total,                        programs compiled (a pool at a slot
  asynclane_compile_seconds_total                  count), and the seconds spent on them
  process_*                                        the server process (memory, CPU, files)

Every app has a registry of its own (several apps in one process do not share
counters). The engine's gauges are read when /metrics is scraped (`Engine.gauges`,
which takes no lock: a scrape never waits for the engine's loop); the request metrics
are counted on the event loop by `RequestMetrics`, the app's outermost middleware, so
that requests the guard refuses (401, 403, 413, 415) are counted too. Endpoint labels
are the app's routes ("other" for any other path), so a client cannot add series.
"""

from __future__ import annotations

import time

from asynclane_jax.serve import require

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
_PATHS = COMPLETION_PATHS + ("/v1/models", "/health", "/metrics")
# Seconds: a tiny model's request on a CPU takes tens of milliseconds, an 8B model's
# long completion behind a full queue minutes.
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
# Where RequestMetrics puts a request's arrival (time.perf_counter()) in its ASGI scope.
START_KEY = "asynclane.start"


def endpoint(path: str) -> str:
    """A path's endpoint label: the app's route ("other" for any other path)."""
    if path in _PATHS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{name}"
    return "other"


class _EngineCollector:
    """The engine's gauges and compile counters, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # names are fixed; nothing to check them against at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = self.engine.gauges()

        def gauge(name, doc, key):
            return GaugeMetricFamily(name, doc, value=g.get(key, 0))

        yield gauge("asynclane_queue_depth", "Requests waiting for a row.", "waiting")
        yield gauge("asynclane_slots_busy", "Rows decoding a request, over all pools.",
                    "slots_busy")
        yield gauge("asynclane_pool_slots", "Rows of each pool (requests it decodes at once).",
                    "slots")
        yield gauge("asynclane_pools", "Pools kept (one per sampler setting, generation "
                    "bucket and prompt bucket).", "pools")
        yield gauge("asynclane_pool_bytes", "Bytes of the decode state the pools hold on "
                    "the device (K/V caches, canvas, per-row counters; from their shapes).",
                    "pool_bytes")
        yield gauge("asynclane_kv_budget_bytes", "The bound on asynclane_pool_bytes "
                    "(--kv-budget).", "kv_budget")
        yield CounterMetricFamily("asynclane_pool_evictions", "Pools dropped and idle pools' "
                                  "state released.", value=g.get("evicted", 0))
        yield CounterMetricFamily("asynclane_compiles", "Programs compiled (a pool at a slot "
                                  "count).", value=g.get("compiles", 0))
        yield CounterMetricFamily("asynclane_compile_seconds", "Seconds spent compiling "
                                  "programs.", value=g.get("compile_seconds", 0.0))


class Metrics:
    """One app's metrics, in a registry of their own (`registry`); `exposition()` is
    /metrics' body and content type."""

    def __init__(self, engine, *, process: bool = True):
        prom = require("prometheus_client")
        self.registry = prom.CollectorRegistry()
        reg = self.registry
        self.requests = prom.Counter(
            "asynclane_requests", "HTTP requests answered, by endpoint and status (refusals "
            "included; 499: the client went away).", ["endpoint", "status"], registry=reg)
        self.latency = prom.Histogram(
            "asynclane_request_latency_seconds", "Served completions (status 200): seconds "
            "from the request's arrival to its last byte.", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=reg)
        self.ttft = prom.Histogram(
            "asynclane_time_to_first_token_seconds", "Seconds from a completion's arrival to "
            "its first token final.", ["endpoint"], buckets=TTFT_BUCKETS, registry=reg)
        self.generated_tokens = prom.Counter(
            "asynclane_generated_tokens", "Completion tokens sent to clients (its rate is "
            "the server's tokens/s).", registry=reg)
        self.prompt_tokens = prom.Counter(
            "asynclane_prompt_tokens", "Prompt tokens of the requests the engine took.",
            registry=reg)
        reg.register(_EngineCollector(engine))
        if process:
            prom.ProcessCollector(registry=reg)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMetrics:
    """ASGI middleware (the app's outermost): counts every HTTP request by endpoint and
    status, and a served completion's latency. Both are recorded as its last body message
    is sent (before the client can read it); a request whose app ends without one (a
    stream the client left, an error) is counted without a latency."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = scope[START_KEY] = time.perf_counter()
        name = endpoint(scope.get("path", ""))
        status: list[int] = []
        recorded = False

        def record(code: int, whole: bool = False) -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            self.metrics.requests.labels(name, str(code)).inc()
            if whole and code == 200 and name in COMPLETION_PATHS:
                self.metrics.latency.labels(name).observe(time.perf_counter() - start)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                record(status[0] if status else 500, whole=True)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            record(status[0] if status else 500)  # the error page is sent outside
            raise
        record(status[0] if status else 500)
