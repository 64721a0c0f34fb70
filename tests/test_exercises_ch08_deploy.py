"""Lab 08's checks (chapter 8): right answers pass, each named mistake is recognised, and the
recorded verdict on vLLM's flags agrees with vLLM's own parser where its CPU build is
installed."""

import pytest

from labkit.checks import ParameterError
from labkit.deploy import DeploymentSpec
from labkit.tutorial.ch08_deploy import TUTORIAL_SERVER_ARGS, TUTORIAL_SCRIPT_PROBLEMS
from labkit.exercises import ch08_deploy as ex
from labkit.lab import detect

VLLM_PYTHON = detect().vllm_cpu_python


def test_failure_threshold_right_and_wrong():
    # 250 s x 1.5 = 375 s; 375 / 10 = 37.5 -> 38 checks.
    assert ex.check_failure_threshold(38)
    assert not ex.check_failure_threshold(None)
    for wrong, says in [(37, "rounded down"), (25, "left out the margin"),
                        (380, "in seconds"), (3750, "multiplied")]:
        feedback = ex.check_failure_threshold(wrong)
        assert not feedback and says in feedback.message, feedback.message
    assert ex.check_failure_threshold(13, model_load_s=82)  # the chapter's worked example
    with pytest.raises(ParameterError) as err:
        ex.check_failure_threshold(1, margin=0.5)
    assert err.value.param == "margin"


def test_a_mistake_equal_to_the_answer_is_not_offered():
    # 100 s x 1.0 / 10 s: rounding down or up give the same 10, which is then simply right.
    feedback = ex.check_failure_threshold(10, model_load_s=100, margin=1.0)
    assert feedback and "Correct" in feedback.message


def test_rejected_flags_recorded_verdict():
    tutorial, exercise, ours = ex.rejected_flags(
        [TUTORIAL_SERVER_ARGS, ex.EXERCISE_LINE, ["vllm", "serve", "m", "--port", "8000"]])
    assert tutorial == {"--disable-log-requests", "--swap-space"}
    assert tutorial <= set(TUTORIAL_SCRIPT_PROBLEMS)
    assert exercise == {"--use-v2-block-manager", "--num-scheduler-steps"}
    assert ours == frozenset()
    with pytest.raises(ParameterError):
        ex.rejected_flags([["vllm", "serve"]])


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM CPU environment (make vllm-env)")
@pytest.mark.real_engine  # vLLM CPU
def test_the_recorded_verdict_is_vllms():
    removed = sorted(ex.REMOVED_IN_VLLM_0_32)
    lines = [TUTORIAL_SERVER_ARGS, ex.EXERCISE_LINE,
             ["vllm", "serve", "m", *(f for flag in removed for f in (flag, "1"))]]
    assert ex.rejected_flags(lines, VLLM_PYTHON) == ex.rejected_flags(lines)


def test_rejected_flags_check():
    right = {"--use-v2-block-manager", "--num-scheduler-steps"}
    assert ex.check_rejected_flags(right)
    assert ex.check_rejected_flags(sorted(right))  # any collection will do
    assert not ex.check_rejected_flags(None)
    assert "expected a set" in ex.check_rejected_flags("--swap-space").message
    assert "unsafe" in ex.check_rejected_flags(right | {"--trust-remote-code"}).message
    assert "--disable-log-stats" in ex.check_rejected_flags(
        right | {"--disable-log-stats"}).message
    assert "values" in ex.check_rejected_flags(right | {"8"}).message
    assert "1 of the rejected flags missing" in ex.check_rejected_flags(
        {"--use-v2-block-manager"}).message
    assert ex.check_rejected_flags({"--disable-log-requests", "--swap-space"},
                                   line=TUTORIAL_SERVER_ARGS)


@pytest.mark.parametrize("port", [8000, 8080, 9001])
def test_target_port_is_the_container_port(port):
    spec = DeploymentSpec(model="m", served_model_name="m", port=port)
    assert ex.service_target_port(spec) == port
    assert ex.check_target_port(port, port=port)


def test_target_port_mistakes():
    assert "default port" in ex.check_target_port(8000, port=8080).message
    assert "HTTP default" in ex.check_target_port(80, port=8080).message
    assert not ex.check_target_port(None)
    with pytest.raises(ParameterError) as err:
        ex.check_target_port(1, port=0)
    assert err.value.param == "port"
