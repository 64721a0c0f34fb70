"""An ASGI app served in a thread of this process (chapter 5's fault experiments, the tests).

A lab that needs a small server of its own beside real backends (a backend whose exporter
lies, :func:`labkit.harness.faults.lying_metrics_app`) runs it here: uvicorn on a free
loopback port, lifespan included, in a daemon thread, stopped on exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from labkit.process import free_port, wait_until


@contextlib.contextmanager
def serve_in_thread(app, startup_timeout_s: float = 30.0, **options) -> Iterator[str]:
    """Serve ``app`` with uvicorn on ``127.0.0.1`` and a free port in a daemon thread; yield
    its base URL; on exit ask it to stop (2 s of grace for open connections) and join.
    ``options`` go to ``uvicorn.Config`` (``http=``: a protocol class)."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                            timeout_graceful_shutdown=2, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, startup_timeout_s, 0.02, what="the server started")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
