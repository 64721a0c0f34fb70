"""labkit.gateway's proxy in front of real teaching-engine servers (chapter 5): streaming
passthrough, the models union, health, API key, size limit, errors passed on unchanged,
retries before the first byte, 503 and 429, the admin API, a backend killed under load
(error events, ejection, re-admission), and no in-flight count left behind."""

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from conftest import serve_asgi, serve_tiny_model
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
# Prometheus' own parser, not labkit.http.metrics: the pages are checked independently.
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
from labkit.gateway.config import check_exposure
from labkit.launch import ServeConfig, command_for
from labkit.process import ServerProcess, free_port, wait_until, wait_until_async

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
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: all(e.in_flight == 0 for e in seen), 10, 0.02)
        assert all(e.in_flight == 0 for e in seen), {e.url: e.in_flight for e in seen}


def gateway_metric(base: str, name: str, **labels) -> float:
    """One sample of the gateway's own ``/metrics`` (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def sse_events(lines) -> list:
    """The ``data:`` payloads of a server-sent-event stream: dicts, and "[DONE]". Read from
    the wire here, not by labkit.http.sse, which is under test too: what a client reads."""
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


def quick_backend() -> FastAPI:
    """A healthy backend that answers at once: a stream of one event, or a JSON body."""
    app = FastAPI()
    app.get("/health")(lambda: PlainTextResponse(""))
    app.get("/metrics")(lambda: PlainTextResponse(""))

    @app.post("/v1/completions")
    async def completions(request: Request):
        if not (await request.json()).get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": "quick"}]})

        async def events():
            yield 'data: {"id": "cmpl-q", "choices": [{"index": 0, "text": "quick"}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def held_backend(*, first_event: bool = True) -> tuple[FastAPI, dict]:
    """A backend whose completions hold until the test says otherwise, on any machine's
    speed: a stream sends its headers and then holds, after one event (``first_event``) or
    before any, until ``state["release"]`` is set (then it sends a second event and
    ``[DONE]``) or its client goes away; a non-streamed request is held before its answer
    starts. ``state``: ``"arrived"`` counts requests, ``"closed"`` the streams that ended,
    and ``"healthy"`` (set it False) turns ``/health`` into 503, as a wedged server's probe
    fails."""
    app = FastAPI()
    state = {"arrived": 0, "closed": 0, "healthy": True, "release": threading.Event()}
    app.get("/health")(lambda: PlainTextResponse("", 200 if state["healthy"] else 503))
    app.get("/metrics")(lambda: PlainTextResponse(""))

    @app.post("/v1/completions")
    async def completions(request: Request):
        state["arrived"] += 1
        if not (await request.json()).get("stream"):
            await asyncio.Event().wait()  # held: nothing ever sets it

        async def events():
            try:
                if first_event:
                    yield 'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "one"}]}\n\n'
                while not state["release"].is_set():  # a threading.Event: the test sets it
                    await asyncio.sleep(0.01)
                yield 'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "two"}]}\n\n'
                yield "data: [DONE]\n\n"
            finally:
                state["closed"] += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, state


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
                       ("first_byte_timeout_s", 0), ("stream_idle_timeout_s", float("nan")),
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


@pytest.mark.parametrize("host, api_key, open_routes, refused", [
    ("127.0.0.1", None, False, False), ("127.8.9.10", None, False, False),
    ("::1", None, False, False), ("localhost", None, False, False),
    ("0.0.0.0", None, False, True), ("::", None, False, True), ("10.1.2.3", None, False, True),
    ("gateway.internal", None, False, True),
    ("0.0.0.0", "sk-1", False, False), ("0.0.0.0", None, True, False),
])
def test_admin_routes_beyond_loopback_need_a_key_or_an_explicit_flag(host, api_key,
                                                                     open_routes, refused):
    if refused:
        with pytest.raises(ParameterError) as err:
            check_exposure(host, api_key, open_routes)
        assert err.value.param == "host" and "--api-key" in str(err.value)
    else:
        check_exposure(host, api_key, open_routes)


def test_cli_refuses_to_open_the_admin_routes_to_the_network_unasked():
    command = [sys.executable, "-m", "labkit.cli", "gateway", "--host", "0.0.0.0",
               "--port", str(free_port())]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "labkit gateway: binding '0.0.0.0'" in refused.stderr
    assert "--open-admin-routes" in refused.stderr


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
    # Only a JSON true asks for a stream (as vLLM's request model reads it).
    assert routing_request(b'{"prompt": "a", "stream": true}').stream
    assert not routing_request(b'{"prompt": "a", "stream": "yes"}').stream


# -- the proxy ---------------------------------------------------------------------------

def test_stream_passes_through_event_by_event(backends):
    (a, _), _ = backends
    body = completion(max_tokens=400, ignore_eos=True, stream=True)
    with httpx.stream("POST", a + "/v1/completions", json=body, timeout=60) as direct:
        expected = [e["choices"] if e != "[DONE]" else e for e in sse_events(direct.iter_lines())]
    with running(Gateway([a], GatewayConfig("round_robin"))) as gw:
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response.iter_lines())
    assert [e["choices"] if e != "[DONE]" else e for e in events] == expected
    assert len(events) > 100
    # Event by event, not collected first: the first event reaches the client while the
    # backend holds the rest back, until the test lets it go.
    app, state = held_backend()
    with serve_asgi(app) as held, running(Gateway([held], GatewayConfig("round_robin"))) as gw:
        with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] == "one"
            state["release"].set()
            events = sse_events([first, *lines])
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["one", "two"]
    assert events[-1] == "[DONE]"


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


@contextlib.contextmanager
def garbage_backend():
    """A TCP server that answers anything with bytes that are not HTTP, then hangs up."""
    import socketserver
    import threading

    class Garbage(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            self.request.sendall(b"\x00\xffnot http at all\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Garbage)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def broken_sse_backend() -> FastAPI:
    """A healthy backend whose stream is a 200 that breaks the SSE rules: half an event, no
    blank line, no ``[DONE]``, then the end of the body."""
    app = FastAPI()
    app.get("/health")(lambda: PlainTextResponse(""))
    app.get("/metrics")(lambda: PlainTextResponse(""))

    @app.post("/v1/completions")
    async def completions():
        async def events():
            yield 'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "one"}]}\n\n'
            yield 'data: {"id": "cmpl-1", "choi'

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_hostile_backends_get_a_clear_error_and_leave_nothing_open():
    # A backend that speaks no HTTP: a failure before the first byte, 503 once it was the
    # only one, retried on another when there is one.
    with garbage_backend() as garbage, serve_asgi(quick_backend()) as quick:
        config = GatewayConfig(InOrder(), eject_after=100, probe_interval_s=600)
        for urls in ([garbage, quick], [garbage]):
            gateway = Gateway(urls, config)
            with running(gateway) as gw:
                # Its first probe failed; route to it anyway, as if it had just broken.
                gateway.pool.endpoints[0].healthy = True
                answer = httpx.post(gw + "/v1/completions", json=completion())
                assert gateway_metric(gw, "labkit_gateway_retries_total",
                                      backend=garbage) == (len(urls) > 1)
                if len(urls) > 1:
                    assert answer.status_code == 200
                else:
                    assert answer.status_code == 503
                    error = answer.json()["error"]
                    assert error["type"] == "ServiceUnavailableError"
                    assert "every backend tried failed" in error["message"]
                    assert garbage in error["message"]
    # A 200 whose stream breaks the SSE rules: the whole first event, then the error event.
    with serve_asgi(broken_sse_backend()) as broken:
        with running(Gateway([broken], GatewayConfig(InOrder(), eject_after=100))) as gw:
            with httpx.stream("POST", gw + "/v1/completions",
                              json=completion(stream=True)) as stream:
                events = sse_events(stream.iter_lines())
            assert events[0]["choices"][0]["text"] == "one" and len(events) == 3
            assert "ended before data: [DONE]" in events[1]["error"]["message"]
            assert events[2] == "[DONE]"
            assert httpx.get(gw + "/health").status_code == 200


def test_hostile_clients_get_a_clear_error_and_leave_nothing_open(backends):
    (a, _), _ = backends
    with running(Gateway([a], GatewayConfig("round_robin"))) as gw:
        # Not JSON at all, with a wrong content type: the backend's own 4xx, unchanged.
        for body, content_type in ((b"\xff\xfe not json", "application/json"),
                                   (b"prompt=hello", "application/x-www-form-urlencoded"),
                                   ("Grüße 🙂".encode(), "text/plain; charset=utf-8")):
            answer = httpx.post(gw + "/v1/completions", content=body,
                                headers={"content-type": content_type})
            assert 400 <= answer.status_code < 500, (content_type, answer.text)
            assert "error" in answer.json()
        # Many idle connections held open: the gateway keeps serving, and they cost it
        # nothing once they go.
        host, port = gw.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
        try:
            assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
            assert httpx.get(gw + "/health").status_code == 200
        finally:
            for connection in idle:
                connection.close()
        assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200


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


def test_a_first_byte_timeout_retries_elsewhere_and_ejects_the_silent_backend():
    held, state = held_backend(first_event=False)
    with serve_asgi(held) as silent, serve_asgi(quick_backend()) as quick:
        config = GatewayConfig(InOrder(), first_byte_timeout_s=2, eject_after=2,
                               probe_interval_s=60)
        gateway = Gateway([silent, quick], config)
        with running(gateway) as gw:
            assert gateway_metric(gw, "labkit_gateway_timeouts_total", backend=silent,
                                  kind="first_byte") == 0  # exported from the start
            for _ in range(2):  # headers, then no event: retried on the quick one
                with httpx.stream("POST", gw + "/v1/completions",
                                  json=completion(stream=True)) as stream:
                    events = sse_events(stream.iter_lines())
                assert events[0]["choices"][0]["text"] == "quick" and events[-1] == "[DONE]"
            assert gateway_metric(gw, "labkit_gateway_timeouts_total", backend=silent,
                                  kind="first_byte") == 2
            assert gateway_metric(gw, "labkit_gateway_retries_total", backend=silent) == 2
            endpoint = gateway.pool.get(silent)
            assert not endpoint.healthy  # the second timeout in a row ejected it
            assert endpoint.ttft_ewma_s >= 2  # and its latency average counts the wait
            wait_until(lambda: state["closed"] == 2, 30, 0.02)  # the backend saw both leave
    # Alone, every attempt timed out: 504 with an OpenAI error body that says so.
    held, _ = held_backend(first_event=False)
    with serve_asgi(held) as silent:
        config = GatewayConfig(InOrder(), first_byte_timeout_s=1, eject_after=100)
        with running(Gateway([silent], config)) as gw:
            answer = httpx.post(gw + "/v1/completions", json=completion(stream=True))
            assert answer.status_code == 504
            assert "no first byte within 1 s" in answer.json()["error"]["message"]


def test_a_stream_idle_timeout_cuts_the_stream_with_an_error_event():
    held, state = held_backend(first_event=True)
    with serve_asgi(held) as stalled:
        gateway = Gateway([stalled], GatewayConfig(InOrder(), stream_idle_timeout_s=1,
                                                   eject_after=100))
        with running(gateway) as gw:
            with httpx.stream("POST", gw + "/v1/completions",
                              json=completion(stream=True)) as stream:
                events = sse_events(stream.iter_lines())
            # The first event went out, then nothing: cut, never sent again elsewhere.
            assert events[0]["choices"][0]["text"] == "one" and len(events) == 3
            assert events[1]["error"]["type"] == "BadGatewayError"
            assert "sent nothing for 1 s" in events[1]["error"]["message"]
            assert events[2] == "[DONE]"
            assert gateway_metric(gw, "labkit_gateway_timeouts_total", backend=stalled,
                                  kind="stream_idle") == 1
            assert gateway_metric(gw, "labkit_gateway_streams_cut_total", backend=stalled) == 1
            assert gateway.pool.get(stalled).consecutive_failures == 1
            wait_until(lambda: state["closed"] == 1, 30, 0.02)  # the upstream was closed


def test_requests_waiting_on_a_backend_that_gets_ejected_are_retried_at_once():
    """A non-streamed answer has no first-byte bound (it comes whole when complete), but a
    request waiting on a backend that is ejected meanwhile (its probes fail) goes elsewhere
    at once. The read timeout still bounds each read."""
    held, state = held_backend()
    with serve_asgi(held) as wedged, serve_asgi(quick_backend()) as quick:
        gateway = Gateway([wedged, quick], GatewayConfig(InOrder(), probe_interval_s=0.05))
        with running(gateway) as gw:
            with httpx.Client(timeout=60) as client:
                async_answer = _in_thread(lambda: client.post(gw + "/v1/completions",
                                                              json=completion()))
                wait_until(lambda: state["arrived"] == 1, 30, 0.02)  # held on the wedged one
                assert gateway.pool.get(wedged).in_flight == 1
                state["healthy"] = False  # three failed probes eject it
                answer = async_answer()
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "quick"
            assert gateway_metric(gw, "labkit_gateway_retries_total", backend=wedged) == 1
            assert gateway_metric(gw, "labkit_gateway_timeouts_total", backend=wedged,
                                  kind="first_byte") == 0
    held, _ = held_backend()
    with serve_asgi(held) as wedged, serve_asgi(quick_backend()) as quick:
        config = GatewayConfig(InOrder(), read_timeout_s=1, eject_after=100)
        with running(Gateway([wedged, quick], config)) as gw:
            answer = httpx.post(gw + "/v1/completions", json=completion(), timeout=60)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "quick"
            assert gateway_metric(gw, "labkit_gateway_retries_total", backend=wedged) == 1


def _in_thread(call):
    """Start ``call()`` in a thread; return a function that waits for and returns its
    result."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return lambda: future.result(timeout=60)


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
    # as saturated. Scraped once at start and not again for a minute; the scrape is aged by
    # hand, not waited for: a loaded machine may take longer than any short bound to route
    # the first request.
    picker = make_router("endpoint_picker", metrics_staleness_s=30)
    stale = Gateway([a], GatewayConfig(picker, scrape_interval_s=60))
    with running(stale) as gw:
        assert httpx.post(gw + "/v1/completions", json=completion()).status_code == 200
        stale.pool.endpoints[0].metrics_time -= 60
        shed = httpx.post(gw + "/v1/completions", json=completion())
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"


def test_client_leaving_mid_stream_frees_the_backend():
    app, state = held_backend()
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
            wait_until(lambda: state["closed"] == 1, 30, 0.02)
            wait_until(lambda: gateway.pool.endpoints[0].in_flight == 0, 30, 0.02)
            wait_until(lambda: gateway_metric(gw, "labkit_gateway_requests_total",
                                              backend=backend, status="499") == 1, 30, 0.02,
                       what=f"one request of {backend} counted as 499 (client gone)")


def test_admin_add_drain_and_remove(backends):
    (a, _), _ = backends
    app, state = held_backend()  # b holds its stream open until the test releases it
    with serve_asgi(app) as b:
        gateway = Gateway([a], GatewayConfig("round_robin", probe_interval_s=0.05,
                                             worker_startup_timeout_s=0.3))
        with running(gateway) as gw:
            added = httpx.post(gw + "/add_worker", params={"url": b + "/"})
            assert (added.status_code, added.text) == (200, f"Successfully added worker: {b}")
            assert httpx.get(gw + "/list_workers").json() == {"urls": [a, b]}
            again = httpx.post(gw + "/add_worker", params={"url": b})
            assert again.status_code == 400
            assert "already exists" in again.json()["error"]["message"]
            never = httpx.post(gw + "/add_worker", params={"url": dead_url()})
            assert never.status_code == 400 and "not healthy after 0.3 s" in never.text
            assert httpx.post(gw + "/add_worker", params={"url": "ftp://x"}).status_code == 400
            assert httpx.post(gw + "/remove_worker",
                              params={"url": dead_url()}).status_code == 404

            async def drain_while_streaming() -> tuple[list, httpx.Response, list[int], bool]:
                async with httpx.AsyncClient(base_url=gw, timeout=60) as client:
                    removed = await client.post("/remove_worker", params={"url": a})
                    assert removed.status_code == 200  # a had nothing open: gone at once
                    body = completion(stream=True)
                    async with client.stream("POST", "/v1/completions", json=body) as stream:
                        lines = stream.aiter_lines()
                        first = await anext(line async for line in lines
                                            if line.startswith("data"))
                        on_b = gateway.pool.get(b)
                        assert on_b.in_flight == 1  # b holds it
                        await client.post("/add_worker", params={"url": a})
                        draining = asyncio.create_task(client.post("/remove_worker",
                                                                   params={"url": b}))
                        await wait_until_async(lambda: on_b.draining, 30, 0.01)
                        # New requests go to a while b finishes its stream, which b holds:
                        # the drain cannot be over.
                        served = [(await client.post("/v1/completions", json=completion()))
                                  .status_code for _ in range(2)]
                        still_draining = not draining.done()
                        state["release"].set()
                        rest = [first] + [line async for line in lines]
                    return sse_events(rest), await draining, served, still_draining

            events, removed, served, still_draining = asyncio.run(drain_while_streaming())
            assert served == [200, 200] and still_draining
            assert [e["choices"][0]["text"] for e in events[:-1]] == ["one", "two"]
            assert events[-1] == "[DONE]"
            assert removed.status_code == 200
            assert removed.text == f"Successfully removed worker: {b}"
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
                    await wait_until_async(lambda: c.ttft_ewma_s is not None
                                           and c.in_flight > 0, 60, 0.005)
                    os.killpg(os.getpgid(victim.process.pid), signal.SIGKILL)
                    await asyncio.gather(*first)
                    second = [asyncio.create_task(one(client, i)) for i in range(30, 60)]
                    await asyncio.gather(*second)

            asyncio.run(load())
            victim.process.wait()
            wait_until(lambda: not c.healthy, 10, 0.02)
            victim = ServerProcess(command, cfg.base_url).start()
            wait_until(lambda: c.healthy, 10, 0.02)
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
