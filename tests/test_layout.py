"""labkit's shape, checked: the floors of CONTRIBUTING.md hold (import-linter), a planted upward
import breaks them, no module outgrows one sitting, and every error names its parameter."""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABKIT = ROOT / "labkit"
#: CONTRIBUTING.md: "A module holds one idea, 400 lines of code at most".
MAX_LINES_OF_CODE = 400


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """import-linter's command on the package found from ``cwd``, with ``cwd``'s config."""
    command = Path(sys.executable).with_name("lint-imports")
    if not command.exists():
        pytest.skip("import-linter is not installed (make test installs it)")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(command), "--no-cache"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def readme_floors() -> list[set[str]]:
    """The floors of the README's layout, lowest first: the modules of each line under
    ``labkit/`` (a line that starts with two spaces and a name; wrapped text starts with more)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("```\nlabkit/", 1)[1].split("```", 1)[0]
    floors = []
    for line in block.splitlines()[1:]:
        if not line.startswith("  ") or line.startswith("   "):
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        floors.append({name.strip().rstrip("/") for name in names.split(",")})
    return floors


def contract_floors() -> list[set[str]]:
    """The floors of pyproject.toml's import-linter contract, lowest first."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        contract = tomllib.load(f)["tool"]["importlinter"]["contracts"][0]
    return [set(re.split(r"\s*[:|]\s*", layer.strip())) for layer in reversed(contract["layers"])]


def test_the_readme_and_contributing_show_the_contracts_floors():
    assert readme_floors() == contract_floors()
    assert len(contract_floors()) == 10
    contributing = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert "`|` separates modules of a floor that must not" in contributing.replace("\n", " ")


def test_the_project_cites_only_files_it_has():
    for path in [ROOT / "pyproject.toml", *ROOT.glob("labkit/**/*.py"), *ROOT.glob("tests/*.py")]:
        text = path.read_text(encoding="utf-8")
        for name in ("DESIGN.md", "DEVELOPERS.md"):
            assert name not in text or path.name == "test_layout.py", (path, name)


def test_the_floors_hold():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 1 kept, 0 broken" in run.stdout


def copy_of_labkit(tmp_path: Path) -> Path:
    shutil.copytree(LABKIT, tmp_path / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("planted", [
    "import labkit.gateway.server\n",                                  # at the top
    "def _routing():\n    from labkit.gateway import routing\n    return routing\n",  # lazy
])
def test_an_import_from_a_higher_floor_breaks_the_contract(tmp_path, planted):
    tree = copy_of_labkit(tmp_path)
    module = tree / "labkit" / "hardware" / "memory.py"
    module.write_text(module.read_text() + "\n" + planted)
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "labkit.hardware.memory -> labkit.gateway" in run.stdout, run.stdout


def test_a_module_without_a_floor_breaks_the_contract(tmp_path):
    tree = copy_of_labkit(tmp_path)
    (tree / "labkit" / "newcomer.py").write_text('"""Not yet given a floor."""\n')
    run = lint_imports(tree)
    assert run.returncode != 0
    assert "labkit.newcomer" in run.stdout + run.stderr


def lines_of_code(source: str) -> int:
    """Lines holding code: docstrings, comments and blank lines not counted."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
               tokenize.DEDENT, tokenize.ENDMARKER}
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def test_lines_of_code_counts_neither_docstrings_nor_comments():
    source = ('"""Module doc\n\nover lines."""\n\n# a comment\n'
              'def f(x):\n    """Doc."""\n    return (x +\n            1)  # why\n')
    assert lines_of_code(source) == 3  # def, and the two lines of the return


def test_no_module_is_over_400_lines_of_code():
    sizes = {str(p.relative_to(ROOT)): lines_of_code(p.read_text(encoding="utf-8"))
             for p in LABKIT.rglob("*.py")}
    over = {path: n for path, n in sizes.items() if n > MAX_LINES_OF_CODE}
    assert not over, f"modules over {MAX_LINES_OF_CODE} lines of code: {over}"


def plain_value_errors(source: str) -> list[int]:
    """Lines that ``raise ValueError(...)`` (or bare ``ValueError``) instead of labkit's
    ``ParameterError``, which names the parameter."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "ValueError":
                lines.append(node.lineno)
    return lines


def test_the_value_error_finder_finds_both_forms():
    assert plain_value_errors("raise ValueError('x')\nraise ValueError\n"
                              "raise ParameterError('p', 'x')\n") == [1, 2]


def test_every_error_names_its_parameter():
    found = {str(p.relative_to(ROOT)): lines
             for p in LABKIT.rglob("*.py") if p.name != "checks.py"
             if (lines := plain_value_errors(p.read_text(encoding="utf-8")))}
    assert not found, f"raise ValueError instead of ParameterError at {found}"
