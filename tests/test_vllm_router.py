"""vllm-router, the vLLM project's production router, in front of real ``labkit serve``
processes (chapter 5): its flags checked by its own parser, then what it does with streams,
load, prefixes, a dead backend and SIGTERM, measured rather than assumed."""

import argparse
import importlib.metadata
import json
import os
import signal
import socket
import time

import httpx
import pytest
from conftest import paced
# Prometheus' own parser, not labkit.http.metrics: the pages are checked independently.
from prometheus_client.parser import text_string_to_metric_families

from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.gateway.config import GatewayConfig
from labkit.engine.tokenizer import Tokenizer
from labkit.harness.vllm_router import POLICIES, router_command, start_router
from labkit.launch import ServeConfig, labkit_command
from labkit.process import ServerProcess, free_port, wait_until

router_args = pytest.importorskip("vllm_router.router_args")

pytestmark = pytest.mark.real_engine  # the vllm-router binary

MODEL = "tiny"
# A prompt prefix long enough that a prompt sharing it matches well over cache_aware's
# threshold (0.3 of the prompt's tokens).
SHARED = "You are a helpful assistant. Answer briefly and precisely. The question is: "


def router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser)
    return parser


# -- the command line, against the router's own parser -------------------------------------

def test_the_gateway_defaults_that_follow_vllm_router_are_its_defaults():
    """labkit.gateway.config and chapter 5 take these from vllm-router: the installed wheel's
    own record says whether they still hold."""
    theirs, ours = router_args.RouterArgs(), GatewayConfig()
    assert ours.probe_timeout_s == theirs.health_check_timeout_secs
    assert ours.eject_after == theirs.health_failure_threshold
    assert ours.readmit_after == theirs.health_success_threshold
    assert ours.worker_startup_timeout_s == theirs.worker_startup_timeout_secs
    assert ours.read_timeout_s == theirs.request_timeout_secs
    assert theirs.policy == "cache_aware"  # the default chapter 5's table names


def test_router_parses_our_command():
    command = router_command(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], "cache_aware",
                             30123, health_check_interval_secs=1, disable_retries=True,
                             cors_allowed_origins=["http://a.example", "http://b.example"],
                             cache_threshold=0.5, prometheus_port=29123, api_key=None,
                             disable_circuit_breaker=False)
    # The module behind the ``vllm-router`` console script, run with this Python.
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="vllm-router")
    assert command[1:3] == ["-m", script.value.split(":")[0]]
    args = router_args.RouterArgs.from_cli_args(router_parser().parse_args(command[3:]))
    assert args.worker_urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert (args.policy, args.host, args.port) == ("cache_aware", "127.0.0.1", 30123)
    assert args.health_check_interval_secs == 1
    assert args.disable_retries is True
    assert args.cors_allowed_origins == ["http://a.example", "http://b.example"]
    assert args.cache_threshold == 0.5
    assert args.prometheus_port == 29123
    assert args.api_key is None and args.disable_circuit_breaker is False


def test_policies_are_the_routers_choices():
    (action,) = [a for a in router_parser()._actions if a.dest == "policy"]
    assert POLICIES == tuple(action.choices)


@pytest.mark.parametrize("call, param", [
    (lambda: router_command(["http://h:1"], "least_loaded", 8000), "policy"),
    (lambda: router_command(["http://h:1"], "round_robin", 0), "port"),
    (lambda: router_command([], "round_robin", 8000), "backends"),
    (lambda: router_command(["127.0.0.1:8001"], "round_robin", 8000), "backends"),
    (lambda: router_command(["http://h:1"], "round_robin", 8000, worker_urls=["http://x:2"]),
     "worker_urls"),
    (lambda: start_router(["http://h:1"], "round_robin", startup_timeout_s=0),
     "startup_timeout_s"),
    (lambda: start_router(["http://h:1"], "round_robin", port=8000, prometheus_port=8000),
     "prometheus_port"),
])
def test_bad_input_names_the_parameter(call, param):
    with pytest.raises(ParameterError) as caught:
        call()
    assert caught.value.param == param


# -- two real backends -----------------------------------------------------------------------

class Fleet:
    """``labkit serve`` processes on fixed ports, so a killed one can come back at its URL."""

    def __init__(self, model_dir, size: int) -> None:
        self.configs = [ServeConfig(model=str(model_dir), port=free_port(),
                                    served_model_name=MODEL) for _ in range(size)]
        self.servers: list[ServerProcess | None] = [None] * size

    @property
    def urls(self) -> list[str]:
        return [cfg.base_url for cfg in self.configs]

    def start(self, *indexes: int) -> None:
        # One after the other, from this thread: ServerProcess asks Linux to SIGTERM the
        # server when the thread that started it ends (PR_SET_PDEATHSIG), so a server
        # started from a pool thread would die with that thread.
        for i in indexes:
            # Paced (20 ms a step at least): a 1000-token story streams for 20 s or more,
            # so a test finds it running while it looks at the fleet or kills its backend.
            self.servers[i] = ServerProcess(paced(labkit_command(self.configs[i]), 0.02),
                                            self.configs[i].base_url, startup_timeout_s=60)
            self.servers[i].start()

    def kill(self, i: int) -> None:
        """SIGKILL, as a crash or the OOM killer would: no graceful shutdown."""
        process = self.servers[i].process
        os.killpg(os.getpgid(process.pid), signal.SIGKILL)
        process.wait()

    def dead(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if s.process.poll() is not None]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def finished(self, *indexes: int) -> list[float]:
        """Requests each backend (all, or those of ``indexes``) has finished, from its own
        ``/metrics``."""
        return [_metric(self.urls[i] + "/metrics", "vllm:e2e_request_latency_seconds",
                        "_count") for i in indexes or range(len(self.urls))]

    def running(self) -> list[float]:
        return [_metric(url + "/metrics", "vllm:num_requests_running") for url in self.urls]


def _metric(url: str, family: str, suffix: str = "") -> float:
    text = httpx.get(url, timeout=5).text
    return sum(sample.value for fam in text_string_to_metric_families(text)
               if fam.name == family for sample in fam.samples
               if sample.name == family + suffix)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def _fleet(tiny):
    fleet = Fleet(tiny, 2)
    fleet.start(0, 1)
    yield fleet
    fleet.stop()


@pytest.fixture
def fleet(_fleet):
    """Both backends up: a test that killed one has it started again afterwards."""
    yield _fleet
    if dead := _fleet.dead():
        _fleet.start(*dead)


def _sse(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line]


def _complete(client: httpx.Client, prompt: str, max_tokens: int = 2) -> dict:
    return client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
    }).raise_for_status().json()


# -- /tokenize: the worker route vllm-router's cache_aware asks for --------------------------

def test_tokenize_gives_the_ids_the_engine_prefills(fleet, tiny):
    tokenizer = Tokenizer(tiny)
    messages = [{"role": "user", "content": "Is a radix tree a trie?"}]
    with httpx.Client(base_url=fleet.urls[0], timeout=30) as client:
        prompt = client.post("/tokenize", json={"model": MODEL, "prompt": SHARED}).json()
        assert prompt["tokens"] == tokenizer.encode(SHARED, add_special_tokens=True)
        assert prompt["count"] == len(prompt["tokens"]) == _complete(
            client, SHARED)["usage"]["prompt_tokens"]
        assert prompt["token_strs"] is None and prompt["max_model_len"] == 1024
        # vllm-router's own chat body: no add_special_tokens, an explicit
        # continue_final_message false. The template writes the BOS, so it is not added again.
        chat = client.post("/tokenize", json={"model": MODEL, "messages": messages,
                                              "continue_final_message": False}).json()
        assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages),
                                                  add_special_tokens=False)
        assert chat["count"] == client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 1,
        }).json()["usage"]["prompt_tokens"]
        bare = client.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False,
                                              "return_token_strs": True}).json()
        assert bare["tokens"] == tokenizer.encode("hello", add_special_tokens=False)
        assert "".join(bare["token_strs"]) == "hello"
        for body, status, param in [
            ({"model": "other", "prompt": "x"}, 404, "model"),
            ({"model": MODEL}, 400, "prompt"),
            ({"prompt": "x", "messages": messages}, 400, "prompt"),
            ({"messages": messages, "continue_final_message": True}, 400,
             "continue_final_message"),
        ]:
            refused = client.post("/tokenize", json=body)
            assert (refused.status_code, refused.json()["error"]["param"]) == (status, param)


# -- the router in front of them -------------------------------------------------------------

def test_streams_pass_through_unchanged(fleet):
    with httpx.Client(base_url=fleet.urls[0], timeout=60) as backend:
        direct = _complete(backend, "Once", max_tokens=12)["choices"][0]["text"]
    with start_router(fleet.urls, "round_robin") as router, \
            httpx.Client(timeout=60) as client:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 12, "temperature": 0,
                "stream": True}
        with client.stream("POST", router.base_url + "/v1/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = _sse(response)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) > 1  # chunk by chunk, as the backend sent them
        assert "".join(c["choices"][0]["text"] for c in chunks) == direct
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5, "stream": True}
        with client.stream("POST", router.base_url + "/v1/chat/completions",
                           json=chat) as response:
            events = _sse(response)
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_round_robin_alternates(fleet):
    with start_router(fleet.urls, "round_robin") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        before = fleet.finished()
        for i in range(10):
            _complete(client, f"request {i}")
        after = fleet.finished()
    assert [a - b for a, b in zip(after, before, strict=True)] == [5, 5]


def test_cache_aware_follows_the_prefix_until_loads_differ(fleet):
    """cache_aware sends a prompt to the worker whose tree holds most of it, even a busy
    one; a prompt that matches little goes to the least loaded worker instead."""
    with start_router(fleet.urls, "cache_aware") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        before = fleet.finished()
        _complete(client, SHARED + "what is a KV cache?")
        after = fleet.finished()
        (home,) = [i for i in range(2) if after[i] > before[i]]
        # Keep ``home`` busy with a long stream that shares the prefix.
        body = {"model": MODEL, "prompt": SHARED + "tell a long story.", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as story:
            # Hold on to the line iterator: a discarded one closes the response, the router
            # sees the client leave and the backend aborts the story.
            lines = story.iter_lines()
            next(line for line in lines if line)
            assert fleet.running()[home] == 1
            before = fleet.finished()
            _complete(client, SHARED + "what is paged attention?")
            _complete(client, "Zebras graze.")
            after = fleet.finished()
    # Leaving the story aborts it on its backend: the fleet is idle again for the next test.
    wait_until(lambda: fleet.running() == [0, 0], timeout_s=30, what="the story aborted")
    other = 1 - home
    assert after[home] - before[home] == 1   # the shared prefix, to the busy worker
    assert after[other] - before[other] == 1  # the unrelated prompt, to the idle one


def test_a_killed_backend_is_retried_around_ejected_and_readmitted(fleet):
    with start_router(fleet.urls, "round_robin", health_check_interval_secs=1) as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        fleet.kill(1)
        # Right after the crash the router still counts it healthy (three failed probes
        # are needed): requests sent there fail to connect and are retried on the other.
        (before,) = fleet.finished(0)
        statuses = [client.post("/v1/completions", json={
            "model": MODEL, "prompt": f"after the crash {i}", "max_tokens": 2,
        }).status_code for i in range(6)]
        with client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "streamed", "max_tokens": 4,
                "stream": True}) as response:
            assert _sse(response)[-1] == "[DONE]"
        assert statuses == [200] * 6
        assert fleet.finished(0) == [before + 7]
        assert _metric(router.metrics_url, "vllm_router_retries", "_total") >= 1
        # Then the health checker ejects it: /health turns 503 and names it, /readiness
        # stays 200 while one worker is left.
        health = _wait_for(lambda: httpx.get(router.base_url + "/health"), 503, within_s=20)
        assert f'"{fleet.urls[1]}"' in health.text and f'"{fleet.urls[0]}"' not in health.text
        readiness = httpx.get(router.base_url + "/readiness")
        assert readiness.status_code == 200 and readiness.json()["healthy_workers"] == 1
        # Back at the same URL, it is re-admitted after two good probes.
        fleet.start(1)
        _wait_for(lambda: httpx.get(router.base_url + "/health"), 200, within_s=20)
        before = fleet.finished()
        for i in range(4):
            _complete(client, f"after the restart {i}")
        assert fleet.finished()[1] - before[1] == 2


def _wait_for(probe, status: int, within_s: float) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while (response := probe()).status_code != status:
        assert time.monotonic() < deadline, f"still {response.status_code}: {response.text}"
        time.sleep(0.2)
    return response


def test_a_stream_whose_backend_dies_is_cut_without_an_error_event(fleet):
    """Measured: vllm-router 0.1.17 closes the client's connection mid-body, with neither an
    error event nor ``[DONE]``; the client sees a truncated chunked response."""
    with start_router(fleet.urls, "round_robin") as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as client:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        received = []
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received.append(next(line for line in lines if line))
            (busy,) = [i for i, n in enumerate(fleet.running()) if n == 1]
            fleet.kill(busy)
            with pytest.raises(httpx.RemoteProtocolError):
                received += [line for line in lines if line]
    assert "data: [DONE]" not in received
    assert not any('"error"' in line for line in received)


def test_stop_ends_the_router_and_frees_its_port(fleet):
    router = start_router(fleet.urls, "power_of_two")
    port = int(router.base_url.rsplit(":", 1)[1])
    group = os.getpgid(router.process.pid)
    router.stop(grace_s=10)
    assert router.process.returncode == 0  # it shut down on SIGTERM, no SIGKILL needed
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)  # nothing of its process group is left
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
