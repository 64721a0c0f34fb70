"""Chapter 6.2 for real: `labkit serve` processes sharing one simulated device.

The second server is refused at startup with vLLM 0.32's message when the first holds the
memory it asks for, and serves when it fits; a SIGKILLed server's memory comes back; sleep
hands weights and KV cache back to the device and wake takes them again (or cannot, while
another server holds them); requests sent while asleep wait for the wake, as vLLM's paused
scheduler keeps them. No server outlives its test.
"""

import math
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import paced

from labkit.checks import ParameterError
from labkit.engine import LLM, EngineArgs, LLMEngine, SamplingParams, write_tiny_model
from labkit.engine.device import (DeviceMemoryError, DeviceOutOfMemory, SimulatedDevice,
                                  format_gib)
from labkit.process import ServerProcess, free_port
from labkit.units import GiB, MiB

DEVICE_GIB = 0.125                 # the teaching engine's default device: 128 MiB
TOTAL = int(DEVICE_GIB * GiB)
# vLLM 0.32, vllm/v1/worker/utils.py, request_memory(): the startup refusal, word for word.
VLLM_REFUSAL = re.compile(
    r"Free memory on device (?P<device>\S+) \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on "
    r"startup is less than desired GPU memory utilization \((?P<util>[\d.]+), "
    r"(?P<requested>[\d.]+) GiB\)\. Decrease GPU memory utilization or reduce GPU memory used "
    r"by other processes\.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def device_dir(tmp_path, monkeypatch):
    directory = tmp_path / "devices"
    monkeypatch.setenv("LABKIT_DEVICE_DIR", str(directory))
    return directory


# -- the ledger ------------------------------------------------------------------------------

def test_ledger_counts_every_holder_and_frees_by_tag(device_dir):
    a = SimulatedDevice("gpu0", TOTAL, label="a")
    b = SimulatedDevice("gpu0", TOTAL, label="b")
    a.allocate("weights", 10 * MiB)
    a.allocate("kv_cache", 50 * MiB)
    b.allocate("weights", 30 * MiB)
    assert a.snapshot().free_bytes == b.snapshot().free_bytes == TOTAL - 90 * MiB
    assert {h.label: h.total_bytes for h in a.holders()} == {"a": 60 * MiB, "b": 30 * MiB}
    with pytest.raises(DeviceOutOfMemory, match="of which 0.04 GiB is free"):
        b.allocate("kv_cache", 40 * MiB)          # 38 MiB free: nothing taken
    assert b.allocated() == 30 * MiB
    assert a.free("kv_cache") == 50 * MiB and a.allocated() == 10 * MiB
    a.release()
    b.release()
    assert a.snapshot().free_bytes == TOTAL and a.holders() == []


def test_a_device_keeps_its_size_while_in_use(device_dir):
    a = SimulatedDevice("gpu0", TOTAL)
    a.allocate("weights", MiB)
    with pytest.raises(ParameterError, match="device gpu0 has 0.12 GiB") as err:
        SimulatedDevice("gpu0", 2 * TOTAL)
    assert err.value.param == "device_memory_gib"
    a.release()
    assert SimulatedDevice("gpu0", 2 * TOTAL).snapshot().total_bytes == 2 * TOTAL
    with pytest.raises(ParameterError, match="device_id"):
        SimulatedDevice("../etc", TOTAL)


def test_startup_check_is_vllms(device_dir):
    holder = SimulatedDevice("gpu0", TOTAL)
    holder.allocate("kv_cache", 64 * MiB)
    engine = SimulatedDevice("gpu0", TOTAL)
    # Asking for exactly what is free passes: vLLM refuses only free < requested.
    assert engine.request_memory(0.5) == 64 * MiB
    with pytest.raises(DeviceMemoryError) as err:
        engine.request_memory(0.6)
    match = VLLM_REFUSAL.fullmatch(str(err.value))
    assert match, str(err.value)
    # ceil(134217728 * 0.6) = 80530637 bytes = 0.075 GiB; 64 MiB free = 0.0625 GiB.
    assert match["device"] == "gpu0" and match["util"] == "0.6"
    assert match["free"] == format_gib(64 * MiB) == "0.06"
    assert match["requested"] == format_gib(math.ceil(TOTAL * 0.6)) == "0.08"
    assert err.value.param == "gpu_memory_utilization" and isinstance(err.value, ValueError)
    holder.release()


HOLD_AND_WAIT = """
import sys, time
from labkit.engine.device import SimulatedDevice
SimulatedDevice("gpu0", int(sys.argv[1])).allocate("weights", int(sys.argv[2]))
print("held", flush=True)
time.sleep(60)
"""


def test_a_killed_process_frees_its_memory_even_unreaped(device_dir):
    child = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, str(TOTAL), str(100 * MiB)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        observer = SimulatedDevice("gpu0", TOTAL)
        assert observer.snapshot().free_bytes == TOTAL - 100 * MiB
        child.send_signal(signal.SIGKILL)
        # Not reaped yet: a zombie, which holds no GPU memory either.
        deadline = time.monotonic() + 10
        while observer.snapshot().free_bytes != TOTAL and time.monotonic() < deadline:
            time.sleep(0.05)
        assert observer.snapshot().free_bytes == TOTAL
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


# -- the engine on a shared device, in this process -------------------------------------------

def engine_args(tiny, util, **kw):
    return EngineArgs(tiny, device_id="gpu0", device_memory_gib=DEVICE_GIB,
                      gpu_memory_utilization=util, max_model_len=256, **kw)


def test_engine_holds_weights_activations_and_kv_within_its_budget(tiny, device_dir):
    engine = LLMEngine(engine_args(tiny, 0.5))
    [me] = engine.device.holders()
    # Weights, the profiled activations and the whole KV cache: what fills 50 % of the device,
    # less what does not make a whole block.
    block_bytes = sum(store.k.nbytes + store.v.nbytes for store in engine.model.kv) \
        // engine.num_gpu_blocks
    assert me.allocations == {"weights": engine.model.weight_bytes,
                              "activations": me.allocations["activations"],
                              "kv_cache": engine.num_gpu_blocks * block_bytes}
    assert 0 <= TOTAL * 0.5 - me.total_bytes < block_bytes
    with pytest.raises(DeviceMemoryError, match=r"\(0\.6, 0\.08 GiB\)"):
        LLMEngine(engine_args(tiny, 0.6))
    second = LLMEngine(engine_args(tiny, 0.45))       # 0.5 + 0.45 <= 1: both fit
    assert len(engine.device.holders()) == 2
    second.close()
    engine.close()
    assert engine.device.snapshot().free_bytes == TOTAL


def test_sleep_aborts_queues_and_wakes(tiny, device_dir):
    llm = LLM(tiny, device_id="gpu0", device_memory_gib=DEVICE_GIB, gpu_memory_utilization=0.5,
              max_model_len=256, enable_sleep_mode=True)
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=8, temperature=0)
    before = llm.generate("Paged attention", greedy)[0].outputs[0].text

    running = engine.add_request("The quick brown fox", SamplingParams(max_tokens=50))
    engine.step()
    [aborted] = engine.sleep(level=1)
    assert aborted.request_id == running and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    assert engine.kv_cache.block_pool.num_free_blocks == engine.num_gpu_blocks
    assert engine.device.allocated("weights") == engine.device.allocated("kv_cache") == 0
    assert engine.device.allocated("activations") > 0      # what stays in use while asleep
    assert engine.is_sleeping() and engine.step() == []
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate("x", greedy)
    queued = engine.add_request("Hello", greedy)           # accepted, waits for the wake
    assert not engine.has_unfinished_requests()
    assert engine.wake_up(tags=["scheduling"]) is False     # level 1: memory first
    assert engine.wake_up(tags=["weights"]) is False
    assert engine.device.allocated("weights") == engine.model.weight_bytes
    assert engine.wake_up(tags=["kv_cache"]) is True and not engine.is_sleeping()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [queued]
    assert llm.generate("Paged attention", greedy)[0].outputs[0].text == before
    # A prompt of several full blocks hits the prefix cache the second time...
    long = "The quick brown fox jumps over the lazy dog. " * 6
    llm.generate(long, greedy)
    hits = engine.kv_cache.prefix_cache_hits
    llm.generate(long, greedy)
    assert engine.kv_cache.prefix_cache_hits > hits
    # ... but not after a sleep, which discards the KV cache.
    llm.sleep(level=2)
    assert engine.model is None                             # level 2: the weights are gone
    hits = engine.kv_cache.prefix_cache_hits
    assert llm.wake_up() is True                            # reloaded from the directory
    assert llm.generate("Paged attention", greedy)[0].outputs[0].text == before
    llm.generate(long, greedy)
    assert engine.kv_cache.prefix_cache_hits == hits
    engine.close()


def test_wake_needs_the_memory_back(tiny, device_dir):
    sleeper = LLMEngine(engine_args(tiny, 0.5, enable_sleep_mode=True))
    sleeper.sleep(level=1)
    other = LLMEngine(engine_args(tiny, 0.6))               # fits while the first one sleeps
    with pytest.raises(DeviceOutOfMemory, match="out of memory on device gpu0"):
        sleeper.wake_up()
    assert sleeper.is_sleeping()
    other.close()
    assert sleeper.wake_up() is True
    sleeper.close()


def test_sleep_needs_sleep_mode_and_a_level(tiny, device_dir):
    engine = LLMEngine(engine_args(tiny, 0.5))
    with pytest.raises(ParameterError, match="--enable-sleep-mode") as err:
        engine.sleep()
    assert err.value.param == "enable_sleep_mode"
    engine.close()
    engine = LLMEngine(engine_args(tiny, 0.5, enable_sleep_mode=True))
    for level in (3, -1, True):
        with pytest.raises(ParameterError, match="level must be 0, 1 or 2"):
            engine.sleep(level)
    with pytest.raises(ParameterError, match="mode"):
        engine.sleep(1, mode="keep")
    with pytest.raises(ParameterError, match="tags"):
        engine.wake_up(["everything"])
    engine.sleep(level=0)                                   # pause only: memory stays
    assert engine.is_sleeping() and engine.device.allocated("weights") > 0
    assert engine.wake_up(["scheduling"]) is True
    engine.close()


# -- real servers ----------------------------------------------------------------------------

def serve(tiny, util, *, sleep_mode=False, name="tiny", step_s=0.0):
    port = free_port()
    command = [sys.executable, "-m", "labkit.cli", "serve", tiny, "--port", str(port),
               "--served-model-name", name, "--max-model-len", "256", "--device-id", "gpu0",
               "--device-memory-gib", str(DEVICE_GIB), "--gpu-memory-utilization", str(util)]
    if sleep_mode:
        command.append("--enable-sleep-mode")
    if step_s:
        command = paced(command, step_s)
    return ServerProcess(command, f"http://127.0.0.1:{port}", startup_timeout_s=90,
                         env={"VLLM_SERVER_DEV_MODE": "1"})


def complete(server, prompt="Hello", max_tokens=4, name="tiny", timeout=30):
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_gone(*servers):
    for server in servers:
        assert server.process is not None and server.process.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(server.process.pid, 0)              # nothing left of its group


def refusal(server: ServerProcess) -> re.Match:
    with pytest.raises(RuntimeError, match="server exited with code 2") as err:
        server.start()
    match = VLLM_REFUSAL.search(str(err.value))
    assert match, str(err.value)
    return match


@pytest.mark.slow
def test_second_server_refused_when_the_device_is_taken_and_served_when_it_fits(
        tiny, device_dir):
    ledger = SimulatedDevice("gpu0", TOTAL)
    first, too_big, fits = serve(tiny, 0.5), serve(tiny, 0.6), serve(tiny, 0.45, name="b")
    try:
        with first:
            used = TOTAL - ledger.snapshot().free_bytes
            assert 0 < TOTAL * 0.5 - used < 2 * MiB          # the budget, less a partial block
            match = refusal(too_big)
            assert match["util"] == "0.6" and match["free"] == format_gib(TOTAL - used)
            with fits:                                       # 0.5 + 0.45 of the device
                assert complete(first)["finish_reason"] == "length"
                assert complete(fits, name="b")["finish_reason"] == "length"
                assert len(ledger.holders()) == 2
            assert len(ledger.holders()) == 1                # SIGTERM gave "b"'s memory back
    finally:
        for server in (first, too_big, fits):
            server.stop()
    assert ledger.snapshot().free_bytes == TOTAL
    assert_gone(first, too_big, fits)


@pytest.mark.slow
def test_sigkill_frees_the_device(tiny, device_dir):
    ledger = SimulatedDevice("gpu0", TOTAL)
    victim, waiting = serve(tiny, 0.5), serve(tiny, 0.6)
    try:
        victim.start()
        refusal(waiting)
        os.killpg(victim.process.pid, signal.SIGKILL)       # no atexit, no cleanup
        victim.process.wait(timeout=10)
        assert ledger.snapshot().free_bytes == TOTAL
        with waiting:                                        # the same command, now it fits
            assert complete(waiting)["finish_reason"] == "length"
    finally:
        victim.stop()
        waiting.stop()
    assert_gone(victim, waiting)


def timed(call):
    start = time.perf_counter()
    response = call()
    return response, time.perf_counter() - start


@pytest.mark.slow
def test_switching_models_with_sleep_mode(tiny, device_dir):
    ledger = SimulatedDevice("gpu0", TOTAL)
    a, b = serve(tiny, 0.5, sleep_mode=True, name="a", step_s=0.05), serve(tiny, 0.6, name="b")
    latencies = {}
    try:
        with a, httpx.Client(base_url=a.base_url, timeout=30) as http:
            greedy = complete(a, "Paged attention", 8, name="a")["text"]
            assert http.get("/is_sleeping").json() == {"is_sleeping": False}
            # A long request in flight when the server falls asleep is aborted, as vLLM does
            # (240 steps of 50 ms at least: still running when the sleep comes).
            body = {"model": "a", "prompt": "x", "max_tokens": 240, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", a.base_url + "/v1/completions", json=body,
                              timeout=30) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                response, latencies["sleep level 1"] = timed(
                    lambda: http.post("/sleep", params={"level": 1}))
                assert response.json() == {"status": "sleeping", "level": 1}
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and '"finish_reason": "abort"' in rest[-2]
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            [holder] = ledger.holders()
            assert list(holder.allocations) == ["activations"]
            with b:                                          # fits while "a" sleeps
                assert complete(b, name="b")["finish_reason"] == "length"
                response = http.post("/wake_up")
                assert response.status_code == 503, response.text   # "b" holds the memory
                assert "out of memory on device gpu0" in response.json()["error"]["message"]
            response, latencies["wake from level 1"] = timed(lambda: http.post("/wake_up"))
            assert response.json() == {"status": "awake", "tags": None}
            assert complete(a, "Paged attention", 8, name="a")["text"] == greedy

            # Level 2, and a request sent while asleep: it waits in the queue for the wake.
            response, latencies["sleep level 2"] = timed(
                lambda: http.post("/sleep", params={"level": 2}))
            assert response.status_code == 200
            with httpx.Client(base_url=a.base_url, timeout=0.5) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    impatient.post("/v1/completions", json={"model": "a", "prompt": "Hi",
                                                            "max_tokens": 2})
            response, latencies["wake from level 2"] = timed(
                lambda: http.post("/wake_up", params=[("tags", "weights")]))
            assert response.json() == {"status": "sleeping", "tags": ["weights"]}
            response = http.post("/wake_up", params=[("tags", "kv_cache")])
            assert response.json() == {"status": "awake", "tags": ["kv_cache"]}
            assert complete(a, "Paged attention", 8, name="a")["text"] == greedy
            assert http.post("/sleep", params={"level": 3}).status_code == 400
    finally:
        a.stop()
        b.stop()
    assert_gone(a, b)
    assert all(s > 0 for s in latencies.values())
    print({k: f"{v * 1000:.1f} ms" for k, v in latencies.items()})


@pytest.mark.slow
def test_sleep_routes_need_dev_mode_and_sleep_mode(tiny, device_dir):
    plain = serve(tiny, 0.5)
    try:
        with plain:
            response = httpx.post(plain.base_url + "/sleep", params={"level": 1})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "enable_sleep_mode" and "--enable-sleep-mode" in \
                error["message"]
    finally:
        plain.stop()
    hidden = serve(tiny, 0.5, sleep_mode=True)
    hidden.env = {}                                          # no VLLM_SERVER_DEV_MODE
    try:
        with hidden:
            assert httpx.post(hidden.base_url + "/sleep").status_code == 404
    finally:
        hidden.stop()
    assert_gone(plain, hidden)
