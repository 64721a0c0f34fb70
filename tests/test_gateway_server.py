"""labkit.gateway's proxy in front of real teaching-engine servers (chapter 5): streaming
passthrough, the models union, health, API key, size limit, errors passed on unchanged,
retries before the first byte, 503 and 429, the admin API, a backend killed under load
(error events, ejection, re-admission), and no in-flight count left behind."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time

import httpx
import pytest
from conftest import serve_asgi, serve_tiny_model
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.engine.metrics import EngineMetrics
from labkit.gateway import (
    BackendPool,
    Endpoint,
    Gateway,
    GatewayConfig,
    NoEndpointError,
    Router,
    RoutingRequest,
    SaturatedError,
    make_router,
    parse_backend_metrics,
    routing_request,
)
from labkit.launch import ServeConfig, command_for
from labkit.process import ServerProcess, free_port

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def backends(tiny):
    """Two teaching-engine servers in this process: ``[(url, engine), (url, engine)]``."""
    with serve_tiny_model(tiny, MODEL, max_model_len=512) as a, \
            serve_tiny_model(tiny, MODEL, max_model_len=512) as b:
        yield [a, b]


@contextlib.contextmanager
def running(gateway: Gateway):
    """Serve ``gateway``; on exit, every backend's in-flight count must be back to 0."""
    with serve_asgi(gateway.app) as base:
        seen = list(gateway.pool.endpoints)
        yield base
        seen += [e for e in gateway.pool.endpoints if e not in seen]
        assert wait_for(lambda: all(e.in_flight == 0 for e in seen)), \
            {e.url: e.in_flight for e in seen}


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def gateway_metric(base: str, name: str, **labels) -> float:
    """One sample of the gateway's own ``/metrics`` (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def sse_events(lines) -> list:
    """The ``data:`` payloads of a server-sent-event stream: dicts, and "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def completion(prompt="Hello world", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}


def fake_backend(status: int = 500) -> FastAPI:
    """A backend that is healthy but answers every generation request with ``status``."""
    app = FastAPI()
    app.get("/health")(lambda: PlainTextResponse(""))
    app.get("/metrics")(lambda: PlainTextResponse(""))
    failure = {"error": {"message": "boom", "type": "InternalServerError", "param": None,
                         "code": status}}
    app.post("/v1/completions")(lambda: JSONResponse(failure, status_code=status))
    return app


def slow_backend(stall_s: float) -> FastAPI:
    """A healthy backend that stalls ``stall_s`` seconds: before answering a completion, or,
    for a streamed one, after its first event."""
    app = FastAPI()
    app.get("/health")(lambda: PlainTextResponse(""))
    app.get("/metrics")(lambda: PlainTextResponse(""))

    @app.post("/v1/completions")
    async def completions(request: Request):
        if not (await request.json()).get("stream"):
            await asyncio.sleep(stall_s)
            return JSONResponse({"choices": []})

        async def events():
            yield 'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "one"}]}\n\n'
            await asyncio.sleep(stall_s)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def dead_url() -> str:
    """A loopback URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


# -- pure parts --------------------------------------------------------------------------

def test_parse_backend_metrics_reads_labkit_serve_pages():
    metrics = EngineMetrics(MODEL)
    metrics.waiting.set(3)
    metrics.running.set(2)
    metrics.kv_usage.set(0.25)
    metrics.prefix_queries.inc(40)
    metrics.prefix_hits.inc(16)
    assert parse_backend_metrics(generate_latest(metrics.registry).decode()) == {
        "num_requests_waiting": 3.0, "num_requests_running": 2.0, "kv_cache_usage": 0.25,
        "prefix_cache_queries": 40.0, "prefix_cache_hits": 16.0}


def test_parse_backend_metrics_sums_counts_and_averages_usage_over_engines():
    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "w", ["engine"], registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "u", ["engine"], registry=registry)
    for engine, (w, u) in {"0": (1, 0.2), "1": (4, 0.6)}.items():
        waiting.labels(engine).set(w)
        usage.labels(engine).set(u)
    parsed = parse_backend_metrics(generate_latest(registry).decode())
    assert parsed["num_requests_waiting"] == 5.0
    assert parsed["kv_cache_usage"] == pytest.approx(0.4)
    assert "num_requests_running" not in parsed


def test_pool_ejects_after_n_failures_and_readmits_after_m_good_probes():
    events = []
    pool = BackendPool(["http://127.0.0.1:1/"], GatewayConfig(eject_after=3, readmit_after=2),
                       on_eject=lambda e: events.append("eject"),
                       on_readmit=lambda e: events.append("readmit"))
    (endpoint,) = pool.endpoints
    assert endpoint.url == "http://127.0.0.1:1"
    pool.record_failure(endpoint)
    pool.record_failure(endpoint)
    pool.record_success(endpoint)          # a success in between resets the count
    for _ in range(2):
        pool.record_failure(endpoint)
    assert endpoint.healthy and events == []
    pool.record_failure(endpoint)
    assert not endpoint.healthy and events == ["eject"]
    pool.record_success(endpoint)          # a request that was open on it: not a probe
    pool.record_success(endpoint, probe=True)
    pool.record_failure(endpoint)          # a failed probe starts the count again
    pool.record_success(endpoint, probe=True)
    assert not endpoint.healthy
    pool.record_success(endpoint, probe=True)
    assert endpoint.healthy and events == ["eject", "readmit"]


def test_ttft_ewma_weights_the_newest_sample_by_a_quarter():
    endpoint = Endpoint("http://127.0.0.1:1")
    BackendPool.record_ttft(endpoint, 1.0)
    assert endpoint.ttft_ewma_s == 1.0     # the first sample is the average
    BackendPool.record_ttft(endpoint, 0.0)
    assert endpoint.ttft_ewma_s == pytest.approx(0.75)


def test_bad_settings_name_the_parameter():
    with pytest.raises(ParameterError) as err:
        GatewayConfig("round_robin", eject_after=0)
    assert err.value.param == "eject_after"
    with pytest.raises(ParameterError) as err:
        Gateway(["ftp://example"], GatewayConfig("round_robin"))
    assert err.value.param == "url"
    with pytest.raises(ParameterError) as err:
        GatewayConfig("fastest")
    assert err.value.param == "strategy"
    for field, bad in (("session_header", ""), ("max_request_bytes", 0), ("read_timeout_s", 0),
                       ("probe_interval_s", -1), ("readmit_after", 1.5),
                       ("drain_timeout_s", float("inf"))):
        with pytest.raises(ParameterError) as err:
            GatewayConfig(**{field: bad})
        assert err.value.param == field and str(err.value).startswith(field)
    with pytest.raises(ParameterError) as err:
        Gateway(["http://127.0.0.1:1"], "round_robin")  # a strategy goes in the config
    assert err.value.param == "config"


def test_config_defaults_are_vllm_router_s_and_the_endpoint_picker_s_ratio():
    """vllm-router 0.1.17's ``router_args.py``: health_failure_threshold 3,
    health_success_threshold 2, health_check_timeout_secs 5, worker_startup_timeout_secs 600;
    its client's connect timeout 10 s and request timeout 1800 s. The endpoint picker calls
    metrics stale after 200 ms at a 50 ms scrape: 4 intervals."""
    config = GatewayConfig()
    assert (config.eject_after, config.readmit_after, config.probe_timeout_s) == (3, 2, 5.0)
    assert (config.worker_startup_timeout_s, config.connect_timeout_s,
            config.read_timeout_s) == (600.0, 10.0, 1800.0)
    assert GatewayConfig(scrape_interval_s=0.05).metrics_staleness_s == pytest.approx(0.2)
    gateway = Gateway(["http://127.0.0.1:1"], GatewayConfig(scrape_interval_s=0.5, seed=1))
    assert gateway.pool.config is gateway.config
    detector = gateway.router.filters[1]  # routable, then the saturation detector
    assert detector.metrics_staleness_s == pytest.approx(2.0)


def test_routing_request_sees_the_prompt_text():
    assert routing_request(b'{"model": "m", "prompt": "abc"}', "s1") == \
        RoutingRequest("m", "abc", "s1")
    chat = routing_request(json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).encode())
    assert chat.prompt == "be brief\nhi" and chat.model is None
    assert routing_request(b'{"prompt": [[1, 2], [3]]}').prompt == "1 2\n3"
    assert routing_request(b'{"prompt": [1, 2, 3]}').prompt == "1 2 3"
    assert routing_request(b"not json").prompt == ""


# -- the proxy ---------------------------------------------------------------------------

def test_stream_passes_through_event_by_event(backends):
    (a, engine), _ = backends
    body = completion(max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", a + "/v1/completions", json=body, timeout=60) as direct:
        expected = [e["choices"] if e != "[DONE]" else e for e in sse_events(direct.iter_lines())]
    with running(Gateway([a], GatewayConfig("round_robin"))) as gw:
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # The first event reached us while the backend was still generating.
            assert engine.engine.has_unfinished_requests()
            events = sse_events([first, *lines])
    assert [e["choices"] if e != "[DONE]" else e for e in events] == expected
    assert len(events) > 100


def test_models_union_and_health(tiny, backends):
    (a, _), _ = backends
    with serve_tiny_model(tiny, "tiny-chat", max_model_len=128) as (c, _):
        with running(Gateway([a, c, dead_url()], GatewayConfig("round_robin"))) as gw:
            ids = [m["id"] for m in httpx.get(gw + "/v1/models").json()["data"]]
            assert sorted(ids) == ["tiny", "tiny-chat"]
            assert httpx.get(gw + "/health").status_code == 200
    with running(Gateway([dead_url(), dead_url()], GatewayConfig("round_robin"))) as gw:
        assert httpx.get(gw + "/health").status_code == 503
        assert httpx.get(gw + "/v1/models").status_code == 503
        refused = httpx.post(gw + "/v1/completions", json=completion())
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert gateway_metric(gw, "labkit_gateway_requests_total", backend="none",
                              status="503") == 1


def test_api_key_guards_v1_and_admin_but_not_probes(backends):
    (a, _), _ = backends
    with running(Gateway([a], GatewayConfig("round_robin", api_key="s3cret"))) as gw:
        refused = httpx.post(gw + "/v1/completions", json=completion())
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "AuthenticationError"
        assert refused.headers["www-authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.get(gw + "/v1/models", headers=wrong).status_code == 401
        assert httpx.get(gw + "/list_workers").status_code == 401
        assert httpx.post(gw + "/remove_worker", params={"url": a}).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.post(gw + "/v1/completions", json=completion(), headers=good).status_code \
            == 200
        assert httpx.get(gw + "/list_workers", headers=good).json() == {"urls": [a]}
        assert httpx.get(gw + "/health").status_code == 200
        assert httpx.get(gw + "/metrics").status_code == 200


def test_request_size_limit(backends):
    (a, _), _ = backends
    with running(Gateway([a], GatewayConfig("round_robin", max_request_bytes=1000))) as gw:
        big = completion(prompt="x" * 2000)
        declared = httpx.post(gw + "/v1/completions", json=big)
        assert declared.status_code == 413
        assert declared.json()["error"]["type"] == "RequestTooLargeError"

        def chunks():  # no Content-Length: the limit counts what arrives
            yield json.dumps(big).encode()

        assert httpx.post(gw + "/v1/completions", content=chunks()).status_code == 413
        assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "x", "max_tokens": -5}',
    b'{"model": "tiny", "prompt": "x", "temperature": -1e308}',
    b'{"model": "tiny", "prompt": "x", "n": "many"}',
    b'{"model": "no-such-model", "prompt": "x"}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 100000000000000000000}',
    b'{"model": "tiny", "prompt": "x", "stream": true, "top_p": 7}',
    b'{"model": "tiny", "prompt": ',
])
def test_backend_errors_pass_through_unchanged(backends, body):
    (a, _), (b, _) = backends
    headers = {"content-type": "application/json"}
    direct = httpx.post(a + "/v1/completions", content=body, headers=headers)
    assert 400 <= direct.status_code < 500
    with running(Gateway([a, b], GatewayConfig("round_robin"))) as gw:
        for _ in range(2):  # both backends
            proxied = httpx.post(gw + "/v1/completions", content=body, headers=headers)
            assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content)
        assert gateway_metric(gw, "labkit_gateway_retries_total") == 0
        assert httpx.get(gw + "/health").status_code == 200


def test_multibyte_prompts_and_outputs_arrive_intact(backends):
    (a, _), _ = backends
    prompt = "Grüße, 世界! 🙂 Ünïcödé ½ — ok"
    messages = [{"role": "user", "content": prompt}]
    with running(Gateway([a], GatewayConfig("round_robin"))) as gw:
        for path, body in (("/v1/completions", completion(prompt, max_tokens=24)),
                           ("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                     "max_tokens": 24, "temperature": 0})):
            direct = httpx.post(a + path, json=body).json()["choices"][0]
            proxied = httpx.post(gw + path, json=body).json()["choices"][0]
            assert proxied == direct
            with httpx.stream("POST", gw + path, json={**body, "stream": True}) as stream:
                events = sse_events(stream.iter_lines())
            key = "text" if path == "/v1/completions" else "message"
            pieces = [c.get("text", c.get("delta", {}).get("content") or "")
                      for e in events[:-1] for c in e["choices"]]
            text = direct[key] if key == "text" else direct[key]["content"]
            assert "".join(pieces) == text and events[-1] == "[DONE]"


class InOrder(Router):
    """The first routable endpoint, always: makes the retry path deterministic."""

    name = "in_order"

    def pick(self, request, endpoints, now):
        for endpoint in endpoints:
            if endpoint.routable:
                return endpoint
        raise NoEndpointError("none routable")


def test_retry_on_another_backend_before_the_first_byte(backends):
    (a, _), _ = backends
    # A backend answering 500, tried first every time: each request goes on to the good one.
    with serve_asgi(fake_backend(500)) as broken:
        with running(Gateway([broken, a], GatewayConfig(InOrder(), eject_after=100))) as gw:
            for _ in range(4):
                assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
            assert gateway_metric(gw, "labkit_gateway_retries_total", backend=broken) == 4
            assert gateway_metric(gw, "labkit_gateway_requests_total", backend=a,
                                  status="200") == 4
        # Alone, its own 500 goes back to the client unchanged.
        with running(Gateway([broken], GatewayConfig(InOrder(), eject_after=100))) as gw:
            answer = httpx.post(gw + "/v1/completions", json=completion())
            assert answer.status_code == 500 and answer.json()["error"]["message"] == "boom"
    # A backend that was healthy at start, then died between two probes: connection refused.
    stack = contextlib.ExitStack()
    gone = stack.enter_context(serve_asgi(fake_backend(500)))
    gateway = Gateway([gone, a], GatewayConfig(InOrder(), probe_interval_s=60))
    with running(gateway) as gw:
        stack.close()
        for _ in range(2):
            assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
        assert gateway_metric(gw, "labkit_gateway_retries_total", backend=gone) == 2
        dead = gateway.pool.get(gone)
        assert dead.consecutive_failures == 2 and dead.healthy  # 2 of eject_after=3
        assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
        assert not dead.healthy  # the third failure ejects it
        assert gateway_metric(gw, "labkit_gateway_ejections_total", backend=gone) == 1


def test_read_timeouts_retry_before_the_first_byte_and_cut_after_it(backends):
    (a, _), _ = backends
    with serve_asgi(slow_backend(stall_s=1.5)) as slow:
        gateway = Gateway([slow, a], GatewayConfig(InOrder(), read_timeout_s=0.3,
                                                 eject_after=100))
        with running(gateway) as gw:
            # Nothing came back within the read timeout: the request goes on to ``a``.
            started = time.monotonic()
            answer = httpx.post(gw + "/v1/completions", json=completion())
            assert answer.status_code == 200 and answer.json()["model"] == MODEL
            assert time.monotonic() - started < 1.5
            assert gateway_metric(gw, "labkit_gateway_retries_total", backend=slow) == 1
            # The first event went out, then the backend stalled: the stream is cut with an
            # error event, never sent again elsewhere.
            with httpx.stream("POST", gw + "/v1/completions",
                              json=completion(stream=True)) as stream:
                events = sse_events(stream.iter_lines())
            assert events[0]["choices"][0]["text"] == "one" and len(events) == 3
            assert events[1]["error"]["type"] == "BadGatewayError"
            assert "ReadTimeout" in events[1]["error"]["message"] and events[2] == "[DONE]"
            assert gateway_metric(gw, "labkit_gateway_streams_cut_total", backend=slow) == 1


def test_429_with_retry_after_when_every_backend_is_saturated(backends):
    (a, _), _ = backends

    class AlwaysSaturated(Router):
        name = "saturated"

        def pick(self, request, endpoints, now):
            raise SaturatedError("all busy", retry_after_s=2.5)

    with running(Gateway([a], GatewayConfig(AlwaysSaturated()))) as gw:
        shed = httpx.post(gw + "/v1/completions", json=completion())
        assert shed.status_code == 429 and shed.headers["retry-after"] == "3"
        assert shed.json()["error"]["type"] == "RateLimitError"
    # The endpoint picker's saturation detector: metrics older than its staleness bound count
    # as saturated. Scraped once at start and not again for a minute, they soon are.
    picker = make_router("endpoint_picker", metrics_staleness_s=0.2)
    stale = Gateway([a], GatewayConfig(picker, scrape_interval_s=60))
    with running(stale) as gw:
        assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
        time.sleep(0.3)
        shed = httpx.post(gw + "/v1/completions", json=completion())
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"


def held_stream_backend() -> tuple[FastAPI, dict]:
    """A healthy backend whose stream sends one event and then holds, until its client goes
    away: the state "mid-stream" lasts as long as the test needs, on any machine's speed.
    ``state["closed"]`` is set once the backend sees its stream end."""
    app = FastAPI()
    app.get("/health")(lambda: PlainTextResponse(""))
    app.get("/metrics")(lambda: PlainTextResponse(""))
    state = {"closed": False}

    @app.post("/v1/completions")
    async def completions():
        async def events():
            try:
                yield 'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "one"}]}\n\n'
                await asyncio.Event().wait()  # held: nothing ever sets it
            finally:
                state["closed"] = True

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, state


def test_client_leaving_mid_stream_frees_the_backend():
    app, state = held_stream_backend()
    with serve_asgi(app) as backend:
        gateway = Gateway([backend], GatewayConfig("round_robin"))
        with running(gateway) as gw:
            body = completion(max_tokens=500, stream=True)
            with httpx.stream("POST", gw + "/v1/completions", json=body) as response:
                # Keep the line iterator: a discarded one is closed at once, and closing it
                # closes the connection, so the client would leave before the assert.
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                assert gateway.pool.endpoints[0].in_flight == 1  # the backend holds it
            # The gateway notices its client left, closes the upstream stream, and counts a
            # 499; generous bounds, since a loaded machine may take seconds to get there.
            assert wait_for(lambda: state["closed"], 30)
            assert wait_for(lambda: gateway.pool.endpoints[0].in_flight == 0, 30)
            assert wait_for(lambda: gateway_metric(gw, "labkit_gateway_requests_total",
                                                   backend=backend, status="499") == 1, 30), \
                httpx.get(gw + "/metrics").text[-2000:]


def test_admin_add_drain_and_remove(tiny, backends):
    (a, _), (b, _) = backends
    gateway = Gateway([a], GatewayConfig("round_robin", probe_interval_s=0.05,
                                         worker_startup_timeout_s=0.3))
    with running(gateway) as gw:
        added = httpx.post(gw + "/add_worker", params={"url": b + "/"})
        assert (added.status_code, added.text) == (200, f"Successfully added worker: {b}")
        assert httpx.get(gw + "/list_workers").json() == {"urls": [a, b]}
        again = httpx.post(gw + "/add_worker", params={"url": b})
        assert again.status_code == 400 and "already exists" in again.json()["error"]["message"]
        never = httpx.post(gw + "/add_worker", params={"url": dead_url()})
        assert never.status_code == 400 and "not healthy after 0.3 s" in never.text
        assert httpx.post(gw + "/add_worker", params={"url": "ftp://x"}).status_code == 400
        assert httpx.post(gw + "/remove_worker", params={"url": dead_url()}).status_code == 404

        async def drain_while_streaming() -> tuple[list, httpx.Response, list[str]]:
            async with httpx.AsyncClient(base_url=gw, timeout=60) as client:
                removed = await client.post("/remove_worker", params={"url": a})
                assert removed.status_code == 200  # a had nothing open: gone at once
                body = completion(max_tokens=300, ignore_eos=True, stream=True)
                async with client.stream("POST", "/v1/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    first = await anext(line async for line in lines if line.startswith("data"))
                    on_b = gateway.pool.get(b)
                    assert on_b.in_flight == 1
                    await client.post("/add_worker", params={"url": a})
                    draining = asyncio.create_task(client.post("/remove_worker",
                                                               params={"url": b}))
                    await asyncio.sleep(0.2)
                    assert on_b.draining and not draining.done()
                    # New requests go to a while b finishes its stream.
                    served = [(await client.post("/v1/completions", json=completion()))
                              .status_code for _ in range(2)]
                    rest = [first] + [line async for line in lines]
                return sse_events(rest), await draining, served

        events, removed, served = asyncio.run(drain_while_streaming())
        assert served == [200, 200]
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert removed.status_code == 200 and removed.text == f"Successfully removed worker: {b}"
        assert httpx.get(gw + "/list_workers").json() == {"urls": [a]}
        assert gateway_metric(gw, "labkit_gateway_requests_total", backend=a,
                              status="200") == 2


@pytest.mark.slow
def test_load_with_a_backend_killed_mid_stream_and_restarted(tiny, backends):
    """The load test in small: 60 streamed requests over three backends; the third, a
    ``labkit serve`` process, is killed (SIGKILL) while it streams and restarted later."""
    (a, _), (b, _) = backends
    # One sequence at a time: whenever it is killed, one stream is mid-way (cut) and the
    # requests queued behind it have sent nothing yet (retried elsewhere).
    cfg = ServeConfig(model=tiny, served_model_name=MODEL, port=free_port(), max_model_len=512,
                      max_num_seqs=1)
    command = command_for("labkit", cfg)
    victim = ServerProcess(command, cfg.base_url).start()
    gateway = Gateway([a, b, cfg.base_url], GatewayConfig("least_requests", probe_interval_s=0.1,
                                                         eject_after=3, readmit_after=2))
    results: list[tuple[int, list]] = []
    try:
        with running(gateway) as gw:
            c = gateway.pool.get(cfg.base_url)

            async def one(client: httpx.AsyncClient, i: int) -> None:
                # The first half long enough to be cut, the second quick.
                max_tokens = 300 if i < 30 else 40
                body = completion(f"request {i}", max_tokens=max_tokens, ignore_eos=True,
                                  stream=True)
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines()]
                results.append((response.status_code, sse_events(lines)))

            async def load() -> None:
                async with httpx.AsyncClient(base_url=gw, timeout=60) as client:
                    first = [asyncio.create_task(one(client, i)) for i in range(30)]
                    # Kill it once its streams have started: a first event from it has
                    # reached the gateway (its TTFT is known) and it still has some open.
                    while c.ttft_ewma_s is None or c.in_flight == 0:
                        await asyncio.sleep(0.005)
                    os.killpg(os.getpgid(victim.process.pid), signal.SIGKILL)
                    await asyncio.gather(*first)
                    second = [asyncio.create_task(one(client, i)) for i in range(30, 60)]
                    await asyncio.gather(*second)

            asyncio.run(load())
            victim.process.wait()
            assert wait_for(lambda: not c.healthy)
            victim = ServerProcess(command, cfg.base_url).start()
            assert wait_for(lambda: c.healthy)
            assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
            ejections = gateway_metric(gw, "labkit_gateway_ejections_total", backend=c.url)
            readmissions = gateway_metric(gw, "labkit_gateway_readmissions_total", backend=c.url)
            cut_metric = gateway_metric(gw, "labkit_gateway_streams_cut_total", backend=c.url)
    finally:
        victim.stop()
    assert len(results) == 60
    assert all(status == 200 for status, _ in results)  # nothing lost before streaming
    cut = [events for _, events in results if any("error" in e for e in events[:-1])]
    complete = [events for _, events in results if events not in cut]
    assert 1 <= len(cut) == cut_metric
    for events in cut:  # a clear error, then [DONE]; no token twice, no second backend
        assert "error" in events[-2] and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 502 and c.url in events[-2]["error"]["message"]
        assert len({e["id"] for e in events[:-2]}) == 1
    for events in complete:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert ejections == 1 and readmissions == 1


def listening_address(port: int) -> str:
    """The IPv4 address a local TCP socket listens on at ``port``, from /proc/net/tcp."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise LookupError(port)


def test_cli_serves_a_gateway_on_localhost(backends):
    (a, _), _ = backends
    port = free_port()
    command = [sys.executable, "-m", "labkit.cli", "gateway", "--backend", a,
               "--strategy", "round_robin", "--port", str(port)]
    with ServerProcess(command, f"http://127.0.0.1:{port}", startup_timeout_s=30):
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert listening_address(port) == "127.0.0.1"
