import contextlib
import os
import re
import threading
import time

import matplotlib
import pytest

matplotlib.use("Agg")


@contextlib.contextmanager
def serve_asgi(app):
    """Serve any ASGI app (lifespan included) with uvicorn on a free loopback port, in a
    thread; yields the base URL and stops the server on exit."""
    import uvicorn

    from labkit.process import free_port, wait_until

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, 0.02, what="the test server started")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_in_thread(engine, **app_options):
    """Serve ``engine`` (an AsyncLLMEngine) over HTTP on a free loopback port; yields the
    base URL and stops the server and the engine on exit."""
    from labkit.engine.server import build_app

    try:
        with serve_asgi(build_app(engine, **app_options)) as base:
            yield base
    finally:
        engine.shutdown()


@contextlib.contextmanager
def serve_tiny_model(model_dir, served_model_name="tiny", **engine_args):
    """The teaching engine on ``model_dir`` behind a server in this process: yields the base
    URL and the ``AsyncLLMEngine`` (to look at its KV cache)."""
    from labkit.engine import EngineArgs
    from labkit.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineArgs(str(model_dir), **engine_args),
                            served_model_name=served_model_name)
    with serve_in_thread(engine) as base:
        yield base, engine


# -- one real vLLM server (vLLM's CPU build) for the whole run ----------------------------
# Starting vLLM takes about a minute, so the engine labs and the side-by-side tests share one,
# started only when something collected needs it, and announced to the labs' kernels through
# the environment (labkit.harness.lab_engines.start_lab_server attaches to it).

_shared = {}


def _wants_vllm(item) -> bool:
    if "shared_vllm" in getattr(item, "fixturenames", ()):
        return True
    path = str(item.fspath)
    return path.endswith(".ipynb") and 'start_lab_server(\\"vllm\\"' in _source(path)


def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def pytest_collection_finish(session):
    from labkit import lab

    path = lab.detect()
    if path.runs("vllm") != "cpu" or not any(_wants_vllm(item) for item in session.items):
        return
    from labkit.harness.lab_engines import (LAB_SERVER_DEFAULTS, SHARED_VLLM_LOG, SHARED_VLLM_URL,
                                            lab_model, start_server)
    from labkit.launch import ServeConfig
    from labkit.process import free_port

    cfg = ServeConfig(model=lab_model("vllm", path), port=free_port(), **LAB_SERVER_DEFAULTS)
    started = time.monotonic()
    server = start_server("vllm", cfg, path)
    _shared.update(server=server, cfg=cfg, startup_s=time.monotonic() - started)
    os.environ[SHARED_VLLM_URL], os.environ[SHARED_VLLM_LOG] = cfg.base_url, server.log_path


def pytest_sessionfinish(session):
    if "server" in _shared:
        _shared.pop("server").stop()


def pytest_terminal_summary(terminalreporter):
    """Say which path each engine lab took: the labs' first cells print it, but nbval keeps
    cell output to itself."""
    from labkit import lab

    path = lab.detect()
    labs = sorted({str(r.fspath) for r in terminalreporter.stats.get("passed", [])
                   + terminalreporter.stats.get("failed", []) if str(r.fspath).endswith(".ipynb")})
    lines = []
    for notebook in labs:
        engines = sorted(set(re.findall(r'banner\(\\"(\w+)\\"\)', _source(notebook))))
        lines += [f"{os.path.relpath(notebook)}: {path.banner(engine)}" for engine in engines]
    if "startup_s" in _shared:
        lines.append(f"shared vLLM server on CPU: healthy after {_shared['startup_s']:.0f} s")
    if lines:
        terminalreporter.write_sep("-", "engine paths")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def shared_vllm():
    """The run's real vLLM server on CPU (``ServerProcess``, ``ServeConfig``); skips where
    vLLM's CPU build is not installed."""
    if "cfg" not in _shared:
        pytest.skip("vLLM's CPU build is not installed here (make vllm-env)")
    return _shared["server"], _shared["cfg"]
