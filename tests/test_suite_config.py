"""The test suite's own configuration (../conftest.py): no test can hang, every test says
what it needs.

A test planted in a scratch copy of the suite (this repository's pyproject.toml and
conftest.py, in pytester's temporary folder) sleeps forever: it must fail within its limit
with the stack of every thread printed, and the tests after it must still run.
"""
import importlib.util
import shutil
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["pytester"]


def _suite_config():
    """The root conftest.py as a module of its own (tests/conftest.py is ``conftest``)."""
    spec = importlib.util.spec_from_file_location("suite_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TIER_LIMITS_S = _suite_config().TIER_LIMITS_S


def _ini() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]


@pytest.fixture
def scratch_suite(pytester):
    """pytester's folder as a copy of this suite's configuration, with no tests of ours."""
    shutil.copy(ROOT / "pyproject.toml", pytester.path / "pyproject.toml")
    shutil.copy(ROOT / "conftest.py", pytester.path / "conftest.py")
    (pytester.path / "tests").mkdir()
    (pytester.path / "labs").mkdir()
    shutil.copy(ROOT / "labs" / "sanitize.cfg", pytester.path / "labs" / "sanitize.cfg")
    return pytester


PLANTED = '''
import threading
import time

import pytest


def helper_waits_forever():
    threading.Event().wait()


def test_sleeps_forever():
    threading.Thread(target=helper_waits_forever, name="planted-helper", daemon=True).start()
    time.sleep(10**6)


@pytest.mark.timeout(1)
def test_explicit_limit_wins():
    time.sleep(10**6)


def test_runs_after_the_hang():
    assert True
'''


def test_a_test_that_sleeps_forever_fails_with_every_stack_and_the_run_goes_on(scratch_suite):
    (scratch_suite.path / "tests" / "test_planted.py").write_text(PLANTED)
    # The default limit, shortened so this test stays short; the one under test is the ini's.
    result = scratch_suite.runpytest_subprocess(
        "-o", "timeout=2", "-p", "no:cacheprovider", "tests/test_planted.py", timeout=120)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=2)
    assert "Failed: Timeout (>2.0s) from pytest-timeout" in out
    assert "Failed: Timeout (>1.0s) from pytest-timeout" in out
    # the hanging line of the test, and the stack of the other thread, both printed
    assert "time.sleep(10**6)" in out
    assert "planted-helper" in out and "helper_waits_forever" in out
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_tier_markers_give_their_longer_limit(scratch_suite):
    (scratch_suite.path / "tests" / "test_tiers.py").write_text('''
import pytest

@pytest.mark.slow
def test_slow(request):
    assert request.node.get_closest_marker("timeout").args == ({slow},)

@pytest.mark.slow
@pytest.mark.book
def test_both(request):
    assert request.node.get_closest_marker("timeout").args == ({book},)

@pytest.mark.book
@pytest.mark.timeout(7)
def test_explicit(request):
    assert request.node.get_closest_marker("timeout").args == (7,)

def test_default(request):
    assert request.node.get_closest_marker("timeout") is None
'''.format(**TIER_LIMITS_S))
    result = scratch_suite.runpytest_subprocess("-p", "no:cacheprovider", "tests/test_tiers.py",
                                                timeout=120)
    result.assert_outcomes(passed=4)


def test_an_unregistered_marker_is_an_error(scratch_suite):
    (scratch_suite.path / "tests" / "test_typo.py").write_text(
        "import pytest\n\n@pytest.mark.real_engin\ndef test_x():\n    pass\n")
    result = scratch_suite.runpytest_subprocess("-p", "no:cacheprovider", "tests/test_typo.py",
                                                timeout=120)
    assert "'real_engin' not found in `markers` configuration option" in result.stdout.str() \
        + result.stderr.str()
    assert result.ret != 0


def test_limits_fit_ci_and_every_tier_is_registered():
    ini = _ini()
    registered = {line.split(":")[0] for line in ini["markers"]}
    assert set(TIER_LIMITS_S) <= registered
    assert "--strict-markers" in ini["addopts"]
    assert ini["timeout_method"] == "signal"  # "thread" would end the whole run at one hang
    # a short default; no tier's limit near CI's 90 minutes for the whole run
    assert 0 < ini["timeout"] <= 120
    assert all(ini["timeout"] < s <= 15 * 60 for s in TIER_LIMITS_S.values())
    # nbval interrupts a hung cell (and shows its traceback) before the lab tier's backstop
    cell = int(ini["addopts"].split("--nbval-cell-timeout=")[1].split()[0])
    assert cell < TIER_LIMITS_S["lab"]

