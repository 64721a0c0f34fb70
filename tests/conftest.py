"""Helpers the tests share: servers run in this process on a free loopback port. The suite's
configuration (time limits, tiers, order, the shared vLLM server) is ../conftest.py."""
import contextlib

import matplotlib

matplotlib.use("Agg")


def serve_asgi(app, **options):
    """Serve any ASGI app (lifespan included) on a free loopback port, in a thread; yields the
    base URL and stops the server on exit (:func:`labkit.harness.asgi.serve_in_thread`;
    ``options`` go to ``uvicorn.Config``)."""
    from labkit.harness.asgi import serve_in_thread as serve_app

    return serve_app(app, **options)


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


# The program ``paced`` runs: ``labkit`` with every forward pass of the teaching model made to
# take at least argv[1] seconds.
_PACED_LABKIT = """
import sys, time
from labkit import cli
from labkit.engine.model import LlamaModel

step_s, forward = float(sys.argv[1]), LlamaModel.forward

def paced(self, *args, **kwargs):
    time.sleep(step_s)
    return forward(self, *args, **kwargs)

LlamaModel.forward = paced
sys.exit(cli.main(sys.argv[2:]))
"""


def paced(command: list[str], step_s: float) -> list[str]:
    """A ``python -m labkit.cli ...`` command whose model takes at least ``step_s`` seconds a
    forward pass: a stream of n tokens then lasts n * step_s or more on any machine, so a
    test that acts while it streams (kills its backend, puts its server to sleep) finds it
    still running however fast the machine is."""
    if command[1:3] != ["-m", "labkit.cli"]:
        raise ValueError(f"not a labkit command: {command[:3]}")
    return [command[0], "-c", _PACED_LABKIT, str(step_s), *command[3:]]
