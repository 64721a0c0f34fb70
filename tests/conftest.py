import contextlib
import threading
import time

import matplotlib

matplotlib.use("Agg")


@contextlib.contextmanager
def serve_in_thread(engine, **app_options):
    """Serve ``engine`` (an AsyncLLMEngine) over HTTP on a free loopback port; yields the
    base URL and stops the server and the engine on exit."""
    import uvicorn

    from labkit.engine.server import build_app
    from labkit.launch import free_port

    port = free_port()
    config = uvicorn.Config(build_app(engine, **app_options), host="127.0.0.1", port=port,
                            log_level="error", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not server.started:
        time.sleep(0.02)
    assert server.started, "the test server did not start"
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)
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
