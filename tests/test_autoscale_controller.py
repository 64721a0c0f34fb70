"""The process autoscaler (chapter 5): real ``labkit serve`` replicas behind a real gateway,
scaled by the HPA on their scraped ``vllm:num_requests_waiting``.

The gateway runs in this process (uvicorn in a thread); the autoscaler reaches it only over
HTTP, as it would reach ``labkit gateway`` in another process.
"""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from conftest import serve_asgi

from labkit.autoscale.controller import (
    ProcessAutoscaler,
    _deletion_rank,
    crash_backoff_s,
    exit_status,
)
from labkit.autoscale.hpa import HPAScalingPolicy, HPAScalingRules, HorizontalPodAutoscaler
from labkit.autoscale.observation import WAITING
from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.gateway import Gateway, GatewayConfig
from labkit.harness.fleet import start_gateway
from labkit.harness.steps import StepLoad
from labkit.launch import ServeConfig
from labkit.process import wait_until

MODEL = "tiny"
#: Scale down only after 3 s of lower recommendations (Kubernetes: 300 s), all at once.
QUICK_SCALE_DOWN = HPAScalingRules(3, (HPAScalingPolicy("Percent", 100, 15),))
NO_WINDOW_SCALE_DOWN = HPAScalingRules(0, (HPAScalingPolicy("Percent", 100, 15),))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@contextlib.contextmanager
def serve_gateway():
    """An empty ``least_requests`` gateway on a free loopback port: yields its URL and the
    :class:`Gateway` (to read its books)."""
    gateway = Gateway([], GatewayConfig("least_requests"))
    with serve_asgi(gateway.app) as base:
        yield base, gateway


async def stream_once(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One streamed completion through the gateway: its status, its ``data:`` payloads
    (dicts and "[DONE]") and when it ended (``time.monotonic``), or the error that broke it."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines()]
    except httpx.HTTPError as err:
        return {"status": None, "events": [], "error": f"{type(err).__name__}: {err}"}
    # Read from the wire, not by labkit.http.sse (the gateway writes with it): what a client
    # reads.
    events = [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
              for line in lines if line.startswith("data: ")]
    return {"status": response.status_code, "events": events, "ended": time.monotonic()}


def complete(result: dict) -> bool:
    """Status 200, a stream that ends with [DONE], and no error event in it."""
    events = result["events"]
    return (result["status"] == 200 and bool(events) and events[-1] == "[DONE]"
            and not any(isinstance(e, dict) and "error" in e for e in events))


def client(base: str, connections: int) -> httpx.AsyncClient:
    """A client whose idle connections expire (1 s) before the gateway's uvicorn closes them
    (5 s): reusing one at the instant the server closes it would fail the request."""
    return httpx.AsyncClient(base_url=base, timeout=60, trust_env=False,
                             limits=httpx.Limits(max_connections=connections + 4,
                                                 keepalive_expiry=1.0))


def gone(pid: int) -> bool:
    """True once no process of ``pid``'s group is left (each replica leads its own group)."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def pids(scaler: ProcessAutoscaler) -> set[int]:
    return {e.pid for e in scaler.events if e.pid is not None}


def events_of(scaler: ProcessAutoscaler, replica: str) -> list[str]:
    return [e.kind for e in scaler.events if e.replica == replica]


# -- no processes ---------------------------------------------------------------------------

def hpa(target: float = 4.0, **options) -> HorizontalPodAutoscaler:
    """The HPA on requests waiting per replica, syncing every second."""
    return HorizontalPodAutoscaler(WAITING, target, sync_period_s=1.0, **options)


@pytest.mark.parametrize("param, overrides", [
    ("gateway_url", {"gateway_url": "127.0.0.1:30000"}),
    ("policy", {"policy": object()}),
    ("policy.sync_period_s", {"policy": SimpleNamespace(decide=lambda o, now: 1)}),
    ("serve", {"serve": "/models/tiny"}),
    ("serve", {"serve": ServeConfig(model="m", tensor_parallel_size=2)}),
    ("initial_replicas", {"initial_replicas": 0}),
    ("max_replicas", {"initial_replicas": 3, "max_replicas": 2}),
    ("drain_timeout_s", {"drain_timeout_s": -1.0}),
    ("startup_timeout_s", {"startup_timeout_s": 0}),
    ("probe_timeout_s", {"probe_timeout_s": float("nan")}),
])
def test_bad_arguments_name_the_parameter(param, overrides):
    args = {"gateway_url": "http://127.0.0.1:30000", "policy": hpa(),
            "serve": ServeConfig(model="m")}
    args.update(overrides)
    positional = [args.pop(k) for k in ("gateway_url", "policy", "serve")]
    with pytest.raises(ParameterError) as err:
        ProcessAutoscaler(*positional, **args)
    assert err.value.param == param


def test_crash_loop_backoff_doubles_from_10_s_up_to_5_minutes():
    assert [crash_backoff_s(n) for n in range(7)] == [0, 10, 20, 40, 80, 160, 300]
    assert crash_backoff_s(100) == 300
    with pytest.raises(ParameterError):
        crash_backoff_s(-1)


def test_scale_down_removes_starting_replicas_then_the_last_ready_then_the_newest():
    def replica(name, created, ready_order):
        return SimpleNamespace(name=name, created=created, ready_order=ready_order)

    fleet = [replica("a", 0, 0), replica("b", 1, 2), replica("c", 2, 1),
             replica("d", 3, None), replica("e", 4, None)]
    assert [r.name for r in sorted(fleet, key=_deletion_rank)] == ["e", "d", "b", "c", "a"]


def test_exit_status_in_words():
    assert exit_status(0) == "exit status 0"
    assert exit_status(-signal.SIGTERM) == "ended by SIGTERM"


# -- real processes -------------------------------------------------------------------------

@pytest.mark.slow
def test_step_load_scales_one_to_three_and_back_with_no_failed_request(tiny):
    """40 users streaming for a few seconds, then none: the HPA (target 4 requests waiting
    per replica, 1 s syncs, 3 s scale-down window) takes the fleet 1 -> 3 -> 1."""
    policy = hpa(min_replicas=1, max_replicas=3, scale_down=QUICK_SCALE_DOWN)
    # max_num_seqs=4: with 40 requests in flight, 36 wait on the only replica.
    serve = ServeConfig(model=tiny, served_model_name=MODEL, max_model_len=512, max_num_seqs=4)
    with serve_gateway() as (base, gateway):
        with ProcessAutoscaler(base, policy, serve, max_replicas=3,
                               drain_timeout_s=10) as scaler:
            began, seen = time.monotonic(), {}

            def load_on() -> bool:  # until 3 s after the scale-up got ready (a state, not a
                now = time.monotonic()  # time; the cap only ends a run that never scales)
                if "scaled" not in seen and scaler.ready_count >= 2 and not any(
                        r.phase == "starting" for r in scaler.replicas()):
                    seen["scaled"] = now
                return now - began < 180 and now - seen.get("scaled", now) < 3

            async def step_load() -> list[dict]:
                results = []
                async with client(base, 40) as http:
                    async def user(u: int) -> None:
                        while load_on():
                            results.append(await stream_once(http, f"user {u}: hello", 32))
                    await asyncio.gather(*(user(u) for u in range(40)))
                return results

            results = asyncio.run(step_load())
            assert "scaled" in seen, [(h.desired, h.ready) for h in scaler.history]
            with contextlib.suppress(TimeoutError):  # the assertion below says what it saw
                wait_until(lambda: [r.phase for r in scaler.replicas()
                                    if r.phase != "stopped"] == ["ready"], 40, 0.05)
            back_to_one = [r.phase for r in scaler.replicas() if r.phase != "stopped"] == ["ready"]
            survivors = [r.name for r in scaler.replicas() if r.phase == "ready"]
            listed = httpx.get(base + "/list_workers", trust_env=False).json()["urls"]
            served = {url: value for (url, status), value in requests_by_backend(gateway)
                      if status == "200"}
            failed_at_gateway = [(url, status) for (url, status), _ in
                                 requests_by_backend(gateway) if status != "200"]
        started = pids(scaler)

    assert results and all(complete(r) for r in results), \
        [r for r in results if not complete(r)][:3]
    assert not failed_at_gateway
    history = [(h.desired, h.ready) for h in scaler.history]
    assert max(h.ready for h in scaler.history) >= 2, history
    assert max(h.waiting for h in scaler.history) > 4  # over the target: why it scaled
    assert back_to_one and survivors == ["replica-0"], history  # the newest went first
    # Syncs ran while the new replicas loaded, and started no second copy of them: never more
    # than max_replicas alive at once. (The fleet may scale up again after a scale-down while
    # the load lasts, so more than three replicas can have lived in all.)
    assert any(h.starting for h in scaler.history), history
    assert all(h.ready + h.starting <= 3 for h in scaler.history), \
        [(h.desired, h.ready, h.starting) for h in scaler.history]
    assert listed == [scaler.replicas()[0].url]
    # The replicas added by the scale-up took their share of the load.
    assert sum(v for url, v in served.items() if url != scaler.replicas()[0].url) > 0
    for replica in {e.replica for e in scaler.events if e.kind == "scale-down"}:
        kinds = events_of(scaler, replica)
        if "ready" not in kinds:  # still starting: killed at once, never saw a request
            assert kinds == ["starting", "scale-down", "stopped"]
            continue
        assert kinds.index("scale-down") < kinds.index("removed") < kinds.index("stopped")
        removed = next(e for e in scaler.events if e.replica == replica and e.kind == "removed")
        assert removed.detail.startswith("Successfully removed worker")
        assert "still open" not in removed.detail  # drained before it was stopped
    assert not any(e.kind in ("died", "failed") for e in scaler.events)
    assert len(started) >= 3 and all(gone(pid) for pid in started)


def requests_by_backend(gateway: Gateway) -> list[tuple[tuple[str, str], float]]:
    """The gateway's ``labkit_gateway_requests`` counter: ((backend, status), count)."""
    return [((s.labels["backend"], s.labels["status"]), s.value)
            for metric in gateway.metrics.requests.collect() for s in metric.samples
            if s.name.endswith("_total")]


@pytest.mark.slow
def test_scale_down_drains_the_open_streams_before_stopping_the_youngest(tiny):
    """Two replicas, each with streams queued (one sequence at a time, about a second
    each); the HPA asks for one. The replica that got ready last goes (the ReplicaSet's
    ranking): the gateway drains it, every stream ends whole, and only then is its process
    stopped."""
    # Target 100 waiting per replica: the few waiting here ask for a single replica.
    policy = hpa(100.0, min_replicas=1, max_replicas=2, scale_down=NO_WINDOW_SCALE_DOWN)
    serve = ServeConfig(model=tiny, served_model_name=MODEL, max_model_len=1024,
                        max_num_seqs=1)
    with serve_gateway() as (base, gateway):
        with ProcessAutoscaler(base, policy, serve, initial_replicas=2, max_replicas=2,
                               drain_timeout_s=30).start(run_loop=False) as scaler:
            youngest = [e.replica for e in scaler.events if e.kind == "ready"][-1]
            leaving = next(r for r in scaler.replicas() if r.name == youngest)
            survivor = next(r for r in scaler.replicas() if r.name != youngest)
            endpoint = next(e for e in gateway.pool.endpoints if e.url == leaving.url)

            async def streams_with_a_scale_down() -> tuple[list[dict], int]:
                async with client(base, 8) as http:
                    running = [asyncio.create_task(stream_once(http, f"s{i}", 900))
                               for i in range(8)]
                    async def three_open() -> None:
                        while endpoint.in_flight < 3:
                            await asyncio.sleep(0.01)

                    await asyncio.wait_for(three_open(), 60)
                    open_at_scale_down = endpoint.in_flight
                    assert await asyncio.to_thread(scaler.step, 0.0) == 1
                    return await asyncio.gather(*running), open_at_scale_down

            results, open_at_scale_down = asyncio.run(streams_with_a_scale_down())
            wait_until(lambda: next(r.phase for r in scaler.replicas()
                                    if r.name == youngest) == "stopped", 60, 0.05)
            listed = httpx.get(base + "/list_workers", trust_env=False).json()["urls"]
            on_leaving = {s: v for (url, s), v in requests_by_backend(gateway)
                         if url == leaving.url}

    assert all(complete(r) and len(r["events"]) == 900 + 1 for r in results)  # + [DONE]
    assert open_at_scale_down >= 3
    assert set(on_leaving) == {"200"} and on_leaving["200"] >= open_at_scale_down
    assert listed == [survivor.url]
    kinds = events_of(scaler, leaving.name)
    assert kinds[-3:] == ["scale-down", "removed", "stopped"]
    scaled_down = next(e.time_s for e in scaler.events
                       if e.replica == leaving.name and e.kind == "scale-down")
    assert scaled_down < max(r["ended"] for r in results)  # streams were open meanwhile
    removed = next(e for e in scaler.events if e.replica == leaving.name and e.kind == "removed")
    assert "still open" not in removed.detail
    assert gone(leaving.pid) and gone(survivor.pid)


def test_a_replica_that_dies_is_taken_out_and_replaced(tiny):
    """The HPA would only see one ready pod fewer; like a ReplicaSet, the autoscaler takes
    the dead replica out of the gateway and starts another to match the desired count."""
    policy = hpa(min_replicas=2, max_replicas=2)
    serve = ServeConfig(model=tiny, served_model_name=MODEL, max_model_len=512)
    with serve_gateway() as (base, _):
        with ProcessAutoscaler(base, policy, serve, initial_replicas=2,
                               max_replicas=2).start(run_loop=False) as scaler:
            assert scaler.step(0.0) == 2 and scaler.history[-1].ready == 2
            victim = scaler.replicas()[1]
            os.killpg(victim.pid, signal.SIGKILL)
            clock = iter(range(1, 10**6))  # one second a sync, on the policy's clock
            wait_until(lambda: scaler.step(float(next(clock))) == 2
                       and any(e.kind == "died" for e in scaler.events), 10, 0.05)
            died = [e for e in scaler.events if e.kind == "died"]
            assert [(e.replica, e.detail) for e in died] == [(victim.name, "ended by SIGKILL")]
            assert scaler.history[-1].ready == 1  # what the policy saw: one pod fewer
            wait_until(lambda: scaler.ready_count == 2, 30, 0.05)
            listed = httpx.get(base + "/list_workers", trust_env=False).json()["urls"]
            phases = {r.name: r.phase for r in scaler.replicas()}
    assert phases == {"replica-0": "ready", "replica-1": "stopped", "replica-2": "ready"}
    assert set(listed) == {r.url for r in scaler.replicas() if r.name != victim.name}
    assert all(gone(pid) for pid in pids(scaler))


@pytest.mark.slow
def test_a_replica_that_hangs_fails_its_liveness_probes_and_is_replaced(tiny):
    """A stopped process (SIGSTOP: alive, answering nothing) fails its /health probes; the
    third failure in a row kills it, as the kubelet kills a container failing its liveness
    probe, and the next sync replaces it."""
    policy = hpa(min_replicas=2, max_replicas=2)
    serve = ServeConfig(model=tiny, served_model_name=MODEL, max_model_len=512)
    with serve_gateway() as (base, _):
        with ProcessAutoscaler(base, policy, serve, initial_replicas=2, max_replicas=2,
                               probe_timeout_s=1.0).start(run_loop=False) as scaler:
            hung = scaler.replicas()[0]
            os.kill(hung.pid, signal.SIGSTOP)
            syncs = 0
            while syncs < 10 and not any(e.kind == "unhealthy" for e in scaler.events):
                scaler.step(float(syncs))
                syncs += 1
            clock = iter(range(syncs, 10**6))  # then it is noticed dead, and replaced
            wait_until(lambda: scaler.step(float(next(clock))) == 2
                       and any(e.kind == "died" for e in scaler.events), 10, 0.05)
            wait_until(lambda: scaler.ready_count == 2 and scaler.replicas()[0].phase
                       == "stopped", 30, 0.05)
            kinds = events_of(scaler, hung.name)
    assert syncs == 3  # the third failed probe in a row killed it
    assert kinds == ["starting", "ready", "unhealthy", "died", "removed", "stopped"]
    assert [e.detail for e in scaler.events if e.kind == "died"] == ["ended by SIGKILL"]
    assert all(gone(pid) for pid in pids(scaler))


@pytest.mark.slow
def test_replicas_that_cannot_start_back_off_and_leave_nothing_running(tiny, tmp_path):
    """A model directory that disappears: the next replica fails to start, and the one after
    waits out the crash-loop backoff (10 s) instead of starting at the next sync. A fleet
    that cannot start at all makes start() raise, saying why."""
    model = tmp_path / "model"
    model.mkdir()
    for f in os.listdir(tiny):
        os.link(os.path.join(tiny, f), model / f)
    serve = ServeConfig(model=str(model), served_model_name=MODEL, max_model_len=512)
    clock = [0.0]  # the backoff's clock stands still: it cannot run out on a slow machine
    with serve_gateway() as (base, _):
        with ProcessAutoscaler(base, hpa(min_replicas=2, max_replicas=2), serve,
                               max_replicas=2, clock=lambda: clock[0]
                               ).start(run_loop=False) as scaler:
            for f in os.listdir(model):
                os.unlink(model / f)
            assert scaler.step(0.0) == 2  # below minReplicas: the HPA asks for 2
            wait_until(lambda: any(e.kind == "failed" for e in scaler.events), 30, 0.05)
            assert scaler.step(1.0) == 2 and scaler.step(2.0) == 2
            names = [r.name for r in scaler.replicas()]
        with pytest.raises(RuntimeError, match="did not start"):
            ProcessAutoscaler(base, hpa(), serve).start()
    assert names == ["replica-0", "replica-1"]  # no third start within the backoff
    assert all(gone(pid) for pid in pids(scaler))


# -- the lab's harness (labkit.harness.steps) -------------------------------------------------

def test_the_empty_gateway_of_an_autoscaled_fleet_starts_and_lists_no_worker():
    with start_gateway([], "least_requests") as gateway:
        assert httpx.get(gateway.base_url + "/list_workers",
                         trust_env=False).json()["urls"] == []
        assert httpx.get(gateway.base_url + "/health", trust_env=False).status_code == 503
    assert gone(gateway.process.pid)


@pytest.mark.parametrize("param, overrides", [
    ("base_users", {"base_users": -1}), ("step_users", {"base_users": 8, "step_users": 4}),
    ("max_hold_s", {"hold_s": 20, "max_hold_s": 10}), ("sample_s", {"sample_s": 0}),
])
def test_step_load_parameters_name_the_field(param, overrides):
    with pytest.raises(ParameterError) as err:
        StepLoad(**overrides)
    assert err.value.param == param


# -- the autoscaler's own process stopped or killed ---------------------------------------

FLEET_SCRIPT = """
import sys, time
from labkit.autoscale.hpa import HorizontalPodAutoscaler
from labkit.autoscale.observation import WAITING
from labkit.harness.steps import AutoscaledFleet
from labkit.launch import ServeConfig
from labkit.process import exit_on_sigterm, wait_until

serve = ServeConfig(model=sys.argv[1], served_model_name="tiny", max_model_len=512)
policy = HorizontalPodAutoscaler(WAITING, 100.0, min_replicas=2, max_replicas=2,
                                 sync_period_s=0.2)
with exit_on_sigterm(), AutoscaledFleet(policy, serve, max_replicas=2) as fleet:
    wait_until(lambda: fleet.scaler.ready_count == 2, 120, what="two replicas ready")
    pids = [r.pid for r in fleet.scaler.replicas()] + [fleet.gateway.process.pid]
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_replicas_stop_with_the_autoscalers_process_however_it_ends(tiny, sig):
    """A script that runs a fleet (a gateway, an autoscaler, two replicas): stopped with
    SIGTERM or SIGINT it drains and stops its replicas and exits; killed with SIGKILL, its
    replicas and gateway get the parent-death signal. Either way no process is left, by PID."""
    script = subprocess.Popen([sys.executable, "-c", FLEET_SCRIPT, tiny], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = script.stdout.readline()
        assert line, script.stderr.read()[-3000:]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and not any(gone(pid) for pid in pids)
        script.send_signal(sig)
        script.wait(timeout=120)
        if sig != signal.SIGKILL:  # a clean exit: it unwound its with-blocks
            assert script.returncode in (128 + signal.SIGTERM, -signal.SIGINT), \
                script.stderr.read()[-3000:]
        wait_until(lambda: all(gone(pid) for pid in pids), 60, 0.05,
                   what="every replica gone")
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
