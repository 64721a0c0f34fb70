"""``labkit.stacks``: heavy stacks install on first use, from pyproject's pins, and fail clearly.

No network: the installs run against a stand-in interpreter (a shell script in ``tmp_path``)
that answers ``-m venv`` and ``-m pip install`` the way python and pip do.
"""

import shlex
import stat
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from labkit import stacks
from labkit.checks import ParameterError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent

# pip's output for a big install: hundreds of lines, of which a student needs a handful.
PIP_OUTPUT = "\n".join(
    ["Collecting torch==2.13.0",
     "  Downloading torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl (190.3 MB)",
     "  Downloading six-1.17.0-py2.py3-none-any.whl (11 kB)"]
    + [f"Requirement already satisfied: package{i} in ./site-packages" for i in range(300)]
    + ["Installing collected packages: six, torch, autoawq",
       "Successfully installed autoawq-0.2.9 six-1.17.0 torch-2.13.0+cpu"])


def fake_python(tmp_path: Path, pip_status: int) -> Path:
    """A stand-in for python: ``-m venv DIR`` makes ``DIR/bin/python`` (a copy of itself);
    ``-m pip ...`` prints :data:`PIP_OUTPUT` and exits ``pip_status``."""
    (tmp_path / "pip_output.txt").write_text(PIP_OUTPUT + "\n")
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit 0; fi\n'
        f'cat {tmp_path / "pip_output.txt"}\n'
        f'[ {pip_status} = 0 ] || echo "ERROR: Could not install packages due to an OSError: '
        f'No space left on device" >&2\n'
        f"exit {pip_status}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


# uv's output for the same install (it writes to stderr; labkit reads both streams).
UV_OUTPUT = "\n".join(
    ["Using Python 3.11.7 environment at: .venv-awq", "Resolved 31 packages in 1.20s",
     "Downloading torch (190.3MiB)", "Downloading six (11.1KiB)", " Downloaded torch",
     "Prepared 31 packages in 6.02s", "Installed 31 packages in 212ms"]
    + [f" + package{i}==1.0" for i in range(31)])


def fake_uv(python: Path, status: int = 0) -> Path:
    """A stand-in for uv beside ``python`` (where ``make`` puts it): ``uv venv ... DIR`` makes
    ``DIR/bin/python``; ``uv pip install ...`` prints :data:`UV_OUTPUT` and exits ``status``;
    every call is logged to ``uv_calls.txt``."""
    log, output = python.parent / "uv_calls.txt", python.parent / "uv_output.txt"
    output.write_text(UV_OUTPUT + "\n")
    uv = python.parent / "uv"
    uv.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'if [ "$1" = venv ]; then for last; do :; done; mkdir -p "$last/bin"; exit 0; fi\n'
        f"cat {output} >&2\n"
        f"exit {status}\n")
    uv.chmod(uv.stat().st_mode | stat.S_IXUSR)
    return uv


def test_ref_installs_exactly_the_ref_extra_of_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["ref"]

    def pins(specs):
        return {Requirement(s).name: Requirement(s).specifier for s in specs}

    assert pins(stacks.requirements("ref")) == pins(extra)
    assert stacks.commands("ref", python="PY") == [["PY", *stacks.PIP_INSTALL, *extra]]
    # Each module the presence check looks for is a distribution of the extra.
    assert set(stacks.REF_MODULES) == set(pins(extra))


def test_awq_commands_make_its_own_venv_where_the_quantizer_looks(tmp_path, monkeypatch):
    venv = tmp_path / "awq"
    assert stacks.commands("awq", python="PY", venv=venv) == [
        ["PY", "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), *stacks.PIP_INSTALL,
         "torch==2.13.0", "transformers<4.52", "autoawq==0.2.9"]]
    monkeypatch.delenv(stacks.AWQ_PYTHON_ENV, raising=False)
    from labkit.quant.tools import autoawq_python

    assert autoawq_python() == stacks.awq_venv() / "bin" / "python"


def test_the_makefile_builds_awq_through_stacks_without_repeating_its_pins():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(AWQ_VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    assert "-m labkit.stacks awq" in recipe
    assert "autoawq==" not in makefile and "transformers<4.52" not in makefile
    lab = next(line for line in makefile.splitlines() if line.startswith("lab:"))
    assert "ref" not in lab and "AWQ" not in lab      # make lab stays light


def test_ensure_is_a_no_op_when_the_stack_is_present(tmp_path, capsys):
    failing = fake_python(tmp_path, pip_status=1)    # would raise if anything ran
    venv = tmp_path / "awq"
    venv.mkdir()
    (venv / ".installed").touch()
    assert stacks.ensure("awq", python=failing, venv=venv) is False
    if not stacks.present("ref"):
        pytest.skip("the ref stack is not installed here (make test installs it)")
    assert stacks.ensure("ref", python=failing) is False
    assert capsys.readouterr().out == ""


def test_awq_installs_once_with_a_few_progress_lines(tmp_path, capsys):
    python, venv = fake_python(tmp_path, pip_status=0), tmp_path / "awq"
    assert stacks.ensure("awq", python=python, venv=venv) is True
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("labkit: installing the awq stack") and "MB" in out[0]
    assert out[1:] == ["  downloading torch 2.13.0+cpu (190.3 MB)", "  installing 3 packages",
                       "  installed 3 packages"]
    assert (venv / ".installed").is_file()
    assert stacks.ensure("awq", python=python, venv=venv) is False
    assert capsys.readouterr().out == ""


def test_ref_install_says_whether_the_kernel_can_import_it(tmp_path, capsys):
    stacks.install("ref", python=fake_python(tmp_path, pip_status=0))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("labkit: installing the ref stack")
    assert len(out) == 5 and out[-1].startswith("  ready:")


@pytest.mark.parametrize("name", ["ref", "awq"])
def test_a_failing_pip_raises_an_error_naming_the_command(tmp_path, name):
    python = fake_python(tmp_path, pip_status=1)
    with pytest.raises(stacks.StackInstallError) as error:
        stacks.install(name, python=python, venv=tmp_path / "awq")
    message = str(error.value)
    pip = stacks.commands(name, python, tmp_path / "awq")[-1]
    assert "exit status 1" in message and "No space left on device" in message
    assert shlex.join(pip) in message and f"-m labkit.stacks {name}" in message
    assert not (tmp_path / "awq" / ".installed").exists()    # the next ensure tries again


def test_a_missing_interpreter_is_a_clear_error_too(tmp_path):
    with pytest.raises(stacks.StackInstallError, match="could not start"):
        stacks.install("ref", python=tmp_path / "no-python")


def test_an_instructors_awq_python_is_used_never_overwritten(tmp_path, monkeypatch):
    python = fake_python(tmp_path, pip_status=1)
    monkeypatch.setenv(stacks.AWQ_PYTHON_ENV, str(python))
    assert stacks.present("awq") and stacks.ensure("awq") is False
    monkeypatch.setenv(stacks.AWQ_PYTHON_ENV, str(tmp_path / "gone" / "python"))
    with pytest.raises(stacks.StackInstallError, match="does not exist"):
        stacks.ensure("awq")


def test_unknown_stacks_name_the_allowed_ones(capsys):
    for call in (stacks.ensure, stacks.present, stacks.requirements):
        with pytest.raises(ParameterError, match="name must be one of 'ref', 'awq', got 'cuda'"):
            call("cuda")
    assert stacks.main(["cuda"]) == 1
    assert "'ref', 'awq'" in capsys.readouterr().err


def test_command_line_installs_ahead_or_says_it_is_there(tmp_path, capsys):
    venv = tmp_path / "awq"
    venv.mkdir()
    (venv / ".installed").touch()
    assert stacks.main(["awq", "--venv", str(venv)]) == 0
    assert "already installed" in capsys.readouterr().out


def test_uv_beside_the_interpreter_installs_both_stacks_as_pip_would(tmp_path, monkeypatch):
    python = fake_python(tmp_path, pip_status=1)    # pip would fail: uv must do the work
    uv, venv = fake_uv(python), tmp_path / "awq"
    monkeypatch.delenv("UV_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels /srv/more")
    options = ["--prerelease", "disallow", "--compile-bytecode", "--find-links", "/opt/wheels",
               "--find-links", "/srv/more"]
    assert stacks.commands("awq", python, venv) == [
        [str(uv), "venv", "--allow-existing", "--python", str(python), str(venv)],
        [str(uv), "pip", "install", *options, "--python", str(venv / "bin" / "python"),
         *stacks.AWQ_REQUIREMENTS]]
    assert stacks.commands("ref", python)[0][:10] == [str(uv), "pip", "install", *options[:5],
                                                      "--find-links", "/srv/more"]
    monkeypatch.setenv("UV_FIND_LINKS", "/opt/wheels")    # uv's own setting: left to uv
    assert stacks.uv_options() == ["--prerelease", "disallow", "--compile-bytecode"]


def test_a_uv_install_shows_the_same_few_progress_lines(tmp_path, capsys):
    python, venv = fake_python(tmp_path, pip_status=1), tmp_path / "awq"
    fake_uv(python)
    assert stacks.ensure("awq", python=python, venv=venv) is True
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["  downloading torch (190.3 MiB)", "  installed 31 packages"]
    assert (venv / ".installed").is_file()
    assert len((tmp_path / "uv_calls.txt").read_text().splitlines()) == 2


def test_a_failing_uv_names_its_command(tmp_path):
    python = fake_python(tmp_path, pip_status=0)
    fake_uv(python, status=2)
    with pytest.raises(stacks.StackInstallError, match="exit status 2") as error:
        stacks.install("ref", python=python)
    assert shlex.join(stacks.commands("ref", python)[0]) in str(error.value)


@pytest.mark.parametrize("line, shown", [
    ("Downloading torch (190.3MiB)", "  downloading torch (190.3 MiB)"),
    ("Downloading triton (1.0GiB)", "  downloading triton (1.0 GiB)"),
    ("Downloading six (11.1KiB)", None),
    ("Downloading numpy (19.0MiB)", None),                 # 19.9 MB: under the 20 MB bar
    ("Installed 1 package in 3ms", "  installed 1 package"),
    (" + torch==2.13.0+cpu", None),
    ("Resolved 31 packages in 1.20s", None),
])
def test_uv_lines_are_condensed_like_pips(line, shown):
    assert stacks.condense(line) == shown
