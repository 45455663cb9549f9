"""`/metrics` (asynclane_jax.serve.metrics): the Prometheus exposition parsed back with
prometheus_client's parser, and its numbers checked against what was sent.

  * Requests by endpoint and status (200s, a 400, 401s, 404s; an unknown path is
    "other"), tokens and prompt tokens equal to the usage the answers reported, the
    latency and time-to-first-token histograms one observation per served completion,
    the engine's gauges (pools, the bytes they hold, the budget, compiles, slots) as the
    engine reports them;
    /metrics itself needs the key.
  * Queue depth and busy slots are read at the scrape, whatever the engine is doing.
  * Each app counts in a registry of its own (two in one process, nothing in the global
    registry), and over uvicorn a request is counted before its client has the answer.

The engine is the fake one (no model, no compile, one character a token); the real
engine's pools and tokens are checked in test_serve_http.py, on the server it compiles.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from serve_fakes import (  # noqa: E402
    PROMPT,
    REPLY,
    CharTokenizer,
    FakeEngine,
    ServerThread,
    body,
    chat_body,
    local_client,
    metric,
    metric_samples,
    sse_events,
    wait_for,
)

from asynclane_jax.serve.app import create_app  # noqa: E402
from asynclane_jax.serve.guard import Security  # noqa: E402

KEY = "sk-metrics-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def scrape(client, **kw) -> dict:
    r = client.get("/metrics", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return metric_samples(r.text)


def requests(m, endpoint, status) -> float:
    return metric(m, "asynclane_requests_total", endpoint=endpoint, status=str(status))


def test_requests_tokens_latency_and_pools_are_counted():
    tok = CharTokenizer()
    eng = FakeEngine(tok, tick=0.001)
    usages = []
    with local_client(create_app(eng, security=Security(api_key=KEY)), headers=AUTH) as c:
        for path, req in ((COMPLETIONS, body(max_tokens=5)), (COMPLETIONS, body()),
                          (CHAT, chat_body(max_tokens=7))):
            r = c.post(path, json=req)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        r = c.post(CHAT, json=chat_body(max_tokens=9, stream=True))
        assert r.status_code == 200
        usages.append(sse_events(r.text)[-2]["usage"])
        assert c.post(COMPLETIONS, json=body(max_tokens=0)).status_code == 400
        assert c.post(COMPLETIONS, json=body(max_tokens=3),
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models/other").status_code == 404
        assert c.get("/v1/no/such/path").status_code == 404
        assert c.get("/health", headers={"Authorization": ""}).status_code == 200
        assert wait_for(lambda: eng.stats()["slots_busy"] == eng.stats()["waiting"] == 0)
        m = scrape(c)
        again = scrape(c)

    # What the answers said: 5 tokens, the whole reply (one token a character), 7, 9.
    assert [u["completion_tokens"] for u in usages] == [5, len(REPLY), 7, 9]
    assert {(COMPLETIONS, 200): 2, (CHAT, 200): 2, (COMPLETIONS, 400): 1,
            (COMPLETIONS, 401): 1, ("/metrics", 401): 1, ("/v1/models/{name}", 404): 1,
            ("other", 404): 1, ("/health", 200): 1} == {
        k: requests(m, *k) for k in [(COMPLETIONS, 200), (CHAT, 200), (COMPLETIONS, 400),
                                     (COMPLETIONS, 401), ("/metrics", 401),
                                     ("/v1/models/{name}", 404), ("other", 404),
                                     ("/health", 200)]}
    assert sum(v for (name, _), v in m.items() if name == "asynclane_requests_total") == 10
    assert requests(m, "/metrics", 200) == 0 and requests(again, "/metrics", 200) == 1
    assert metric(m, "asynclane_generated_tokens_total") == sum(
        u["completion_tokens"] for u in usages) == 21 + len(REPLY)
    assert metric(m, "asynclane_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    # One latency and one time to first token per served completion; the first token
    # comes before the last byte; every observation is in the +Inf bucket.
    for ep in (COMPLETIONS, CHAT):
        lat = {s: metric(m, "asynclane_request_latency_seconds_" + s, endpoint=ep)
               for s in ("count", "sum")}
        ttft = {s: metric(m, "asynclane_time_to_first_token_seconds_" + s, endpoint=ep)
                for s in ("count", "sum")}
        assert lat["count"] == ttft["count"] == 2
        assert 0 < ttft["sum"] < lat["sum"] < 60
        assert metric(m, "asynclane_request_latency_seconds_bucket", endpoint=ep,
                      le="+Inf") == 2
    # The engine's gauges, as it reports them.
    g = eng.gauges()
    assert (metric(m, "asynclane_pools"), metric(m, "asynclane_pool_bytes")) == (
        g["pools"], g["pool_bytes"]) == (2, 2 * FakeEngine.POOL_BYTES)
    assert metric(m, "asynclane_kv_budget_bytes") == FakeEngine.KV_BUDGET
    assert metric(m, "asynclane_pool_evictions_total") == 1
    assert metric(m, "asynclane_compiles_total") == 2
    assert metric(m, "asynclane_compile_seconds_total") == 2 * FakeEngine.COMPILE_S
    assert metric(m, "asynclane_pool_slots") == eng.slots == 2
    assert metric(m, "asynclane_slots_busy") == metric(m, "asynclane_queue_depth") == 0
    assert metric(m, "process_resident_memory_bytes") > 0


def test_queue_depth_and_busy_slots_are_read_at_the_scrape():
    tok = CharTokenizer()
    eng = FakeEngine(tok, tick=0.05, slots=2, queue_size=4)
    with local_client(create_app(eng)) as c:
        handles = [eng.submit(tok.encode(PROMPT), max_tokens=40, on_update=lambda u: None)
                   for _ in range(4)]
        assert wait_for(lambda: eng.stats()["slots_busy"] == 2)
        m = scrape(c)
        assert (metric(m, "asynclane_slots_busy"), metric(m, "asynclane_queue_depth")) == (2, 2)
        for h in handles:
            h.cancel()
        assert wait_for(lambda: not eng.gauges()["slots_busy"] + eng.gauges()["waiting"])
        m = scrape(c)
        assert (metric(m, "asynclane_slots_busy"), metric(m, "asynclane_queue_depth")) == (0, 0)


def test_each_app_has_its_own_registry_and_counts_before_the_client_reads():
    from prometheus_client import REGISTRY

    tok = CharTokenizer()
    served, idle = FakeEngine(tok, tick=0.001), FakeEngine(tok, tick=0.001)
    srv = ServerThread(create_app(served))
    try:
        with local_client(create_app(idle)) as other, httpx.Client(base_url=srv.url,
                                                                  timeout=30) as c:
            for n in (3, 4):
                r = c.post(CHAT, json=chat_body(max_tokens=n, stream=True))
                assert sse_events(r.text)[-1] == "[DONE]"
                # Read at once: the stream was counted before its last byte was sent.
                m = metric_samples(c.get("/metrics").text)
                assert requests(m, CHAT, 200) == n - 2
                assert metric(m, "asynclane_request_latency_seconds_count",
                              endpoint=CHAT) == n - 2
            assert metric(m, "asynclane_generated_tokens_total") == 7
            m = scrape(other)
            assert requests(m, CHAT, 200) == 0
            assert metric(m, "asynclane_generated_tokens_total") == 0
    finally:
        srv.stop()
    assert not [f.name for f in REGISTRY.collect() if f.name.startswith("asynclane")]
