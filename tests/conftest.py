"""Helpers the tests share: servers run in this process on a free loopback port. The suite's
configuration (time limits, tiers, order, the shared vLLM server) is ../conftest.py."""
import contextlib
import threading

import matplotlib

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
