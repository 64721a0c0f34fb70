"""The test suite's configuration, for tests/ and labs/ alike (a conftest.py applies to the
folders below it; tests/conftest.py holds the helpers that tests import).

- **No test can hang.** pyproject.toml's ``timeout`` (pytest-timeout) holds every test; a tier
  marker (registered there) gives its tests a longer limit, and an explicit
  ``@pytest.mark.timeout(s)`` wins over both. A lab cell is first stopped by nbval's own
  ``--nbval-cell-timeout`` (addopts), which interrupts the kernel and so shows the cell's own
  traceback; the limit here is the backstop behind it. A fixture's setup counts against the
  first test that uses it (the book build, the shared vLLM server).
- **One real vLLM server** (vLLM's CPU build) for the whole run: starting one takes about a
  minute, so the engine labs and the side-by-side tests share it, announced to the labs'
  kernels through the environment (``labkit.harness.lab_engines.start_lab_server`` attaches to
  it). Its users run first and together; it starts at the first of them and stops after the
  last, since an idle vLLM CPU server busy-polls about half a core.
- **Two cores, two workers** (``make test``: ``-n auto --dist loadfile``): a file runs whole, in
  order, in one worker (a notebook's cells share one kernel, a module its fixtures), and the
  files that use the shared vLLM server count as one file. Longest first, so that the workers
  finish together.
"""
import functools
import os
import re
import time
from pathlib import Path

import pytest

TIER_LIMITS_S = {
    "slow": 300,         # reference models, long simulations, servers started in the test
    "lab": 360,          # per cell; nbval interrupts the kernel at 300 s
    "real_engine": 600,  # a real vLLM CPU server starts in about a minute on 2 idle cores
    "book": 900,         # the strict build of every chapter, executed, about 2 minutes idle
}

SHARED_VLLM_GROUP = "the shared vLLM server"


def time_limit(item) -> float | None:
    """The time limit of ``item`` (s) its tier markers give it, or None for the default."""
    limits = [s for tier, s in TIER_LIMITS_S.items() if item.get_closest_marker(tier)]
    return max(limits, default=None)


@functools.cache
def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


#: What a notebook calls to start its vLLM server (its plain one, with no options, is the
#: run's shared server), as its source spells it (JSON-escaped quotes).
LAB_VLLM_STARTS = ('start_lab_server(\\"vllm\\"', "speculation_sweep(")


def uses_shared_vllm(path: str) -> bool:
    """Whether the test module or notebook at ``path`` uses the run's vLLM server: a lab that
    starts its server on vLLM, a module whose tests take the ``shared_vllm`` fixture."""
    if path.endswith(".ipynb"):
        return any(start in _source(path) for start in LAB_VLLM_STARTS)
    return path.endswith(".py") and re.search(r"\bshared_vllm\b", _source(path)) is not None


def _wants_vllm(item) -> bool:
    return uses_shared_vllm(str(item.path))


def _run_order(item) -> int:
    """Longest first: the users of the shared vLLM server, the book, the labs, the rest."""
    if _wants_vllm(item):
        return 0
    return 1 if item.get_closest_marker("book") else 2 if item.get_closest_marker("lab") else 3


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark every notebook cell ``lab`` and every user of the shared vLLM server
    ``real_engine``, give each item its tier's limit, and order them."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.lab)
        if _wants_vllm(item):
            item.add_marker(pytest.mark.real_engine)
        limit = time_limit(item)
        if limit is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))
    items.sort(key=_run_order)  # stable: each notebook's cells keep their order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which make test-fast/test use
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with every user of the shared vLLM server in one group, and the
    groups handed out in collection order (``_run_order``), not by size."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedServerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return SHARED_VLLM_GROUP if uses_shared_vllm(str(config.rootpath / path)) else path

    config.option.loadscopereorder = False
    return SharedServerScheduling(config, log)


# -- one real vLLM server (vLLM's CPU build) for the whole run ----------------------------

_shared = {}


def _start_shared_vllm():
    """Start the run's vLLM server where this machine runs vLLM on CPU; a start that failed
    fails every item that wanted it, without trying again."""
    from labkit import lab

    path = lab.detect()
    if path.runs("vllm") != "cpu":
        _shared["absent"] = True
        return
    from labkit.harness.lab_engines import (LAB_SERVER_DEFAULTS, SHARED_VLLM_LOG, SHARED_VLLM_URL,
                                            lab_model, start_server)
    from labkit.launch import ServeConfig
    from labkit.process import free_port

    cfg = ServeConfig(model=lab_model("vllm", path), port=free_port(), **LAB_SERVER_DEFAULTS)
    started = time.monotonic()
    try:
        server = start_server("vllm", cfg, path)
    except Exception as error:
        _shared["error"] = f"the shared vLLM server did not start: {error}"
        raise
    _shared.update(server=server, cfg=cfg, startup_s=time.monotonic() - started)
    os.environ[SHARED_VLLM_URL], os.environ[SHARED_VLLM_LOG] = cfg.base_url, server.log_path


@pytest.hookimpl(tryfirst=True)  # before the notebook's kernel starts: it reads the environment
def pytest_runtest_setup(item):
    if not _wants_vllm(item) or "absent" in _shared or "server" in _shared:
        return
    if "error" in _shared:
        pytest.fail(_shared["error"], pytrace=False)
    _start_shared_vllm()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # after the item's own teardown: a notebook's last cell closes its kernel
    if "server" in _shared and (nextitem is None or not _wants_vllm(nextitem)):
        _shared.pop("server").stop()


def pytest_sessionfinish(session):
    if "server" in _shared:
        _shared.pop("server").stop()


@pytest.fixture(scope="session")
def shared_vllm():
    """The run's real vLLM server on CPU (``ServerProcess``, ``ServeConfig``); skips where
    vLLM's CPU build is not installed."""
    if "absent" in _shared:
        pytest.skip("vLLM's CPU build is not installed here (make vllm-env)")
    return _shared["server"], _shared["cfg"]


def pytest_terminal_summary(terminalreporter):
    """Say which path each engine lab took: the labs' first cells print it, but nbval keeps
    cell output to itself."""
    from labkit import lab

    path = lab.detect()
    root = Path(terminalreporter.config.rootpath)
    labs = sorted({r.nodeid.split("::")[0] for r in terminalreporter.stats.get("passed", [])
                   + terminalreporter.stats.get("failed", []) if ".ipynb::" in r.nodeid})
    lines = []
    for notebook in labs:
        engines = sorted(set(re.findall(r'banner\(\\"(\w+)\\"\)', _source(str(root / notebook)))))
        lines += [f"{notebook}: {path.banner(engine)}" for engine in engines]
    if "startup_s" in _shared:
        lines.append(f"shared vLLM server on CPU: healthy after {_shared['startup_s']:.0f} s")
    if lines:
        terminalreporter.write_sep("-", "engine paths")
        for line in lines:
            terminalreporter.write_line(line)
