"""The labs' graded cells and their reference answers, paired (the instructor's solutions).

A graded cell is a code cell of a lab with one line ``NAME = None  # ...`` that the student
replaces, followed by a call to a check of :mod:`labkit.exercises` (``ex.check_...``) as the
cell's last expression. ``solutions/answers.toml`` holds, lab by lab and in the order of the
lab's graded cells, the reference answer of each, a typical wrong answer (one of the check's
own ``mistakes``) and a piece of the hint that wrong answer must get.

``build.py`` writes the instructor copies with these answers and runs them;
``tests/test_solutions.py`` checks the pairing and runs the answers that need no state of the
notebook. Nothing here executes a notebook.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
ANSWERS = Path(__file__).resolve().parent / "answers.toml"

# The line a student edits: ``answer = None  # your expression`` (any variable name).
_BLANK = re.compile(r"^(?P<name>[A-Za-z_]\w*) = None\b[^\n]*$", re.MULTILINE)
# Tag of the cells build.py injects to verify an exercise; they are removed after the run.
VERIFY_TAG = "solutions-verify"


class SolutionError(ValueError):
    """The solutions and the labs disagree: a graded cell without an answer, an answer
    without a cell, an answer for another check, or an answer that does not bind the
    cell's variable. The message names the lab and the exercise."""


@dataclass(frozen=True)
class GradedCell:
    """One exercise of a lab, as the student sees it."""

    lab: str     # the notebook's path under labs/, without .ipynb: "01_gpu_memory", "gpu/x"
    index: int   # the cell's position in the notebook
    number: int  # 1, 2, ... in the lab's order (stretch exercises included)
    name: str    # the variable the student binds: "answer", "params", "my_quantize", ...
    check: str   # the check the cell calls, e.g. "check_kv_bytes_per_token"
    source: str  # the cell's source, with NAME = None

    @property
    def where(self) -> str:
        return f"{self.lab}, exercise {self.number} (cell {self.index}, {self.check})"

    def check_call(self) -> str:
        """The source of the cell's last expression: the call to the check."""
        tree = ast.parse(self.source)
        return ast.get_source_segment(self.source, tree.body[-1])


@dataclass(frozen=True)
class Solution:
    """The instructor's answer to one exercise, and a wrong one with the hint it gets."""

    check: str   # must match the graded cell's check, so a reordering cannot go unseen
    answer: str  # an expression for NAME, or statements that bind NAME
    wrong: str   # the same, for a typical wrong answer
    hint: str    # a piece of the feedback the wrong answer must get


def lab_name(notebook: Path) -> str:
    return notebook.relative_to(LABS).with_suffix("").as_posix()


def lab_notebooks() -> list[Path]:
    """Every lab notebook, ``labs/*.ipynb`` then ``labs/gpu/*.ipynb``."""
    return sorted(LABS.glob("*.ipynb")) + sorted(LABS.glob("gpu/*.ipynb"))


def code_cells(notebook: Path) -> list[tuple[int, str]]:
    """``(index, source)`` of every code cell of ``notebook``."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def graded_cells(notebook: Path) -> list[GradedCell]:
    """The graded cells of ``notebook``, in order."""
    found = []
    for index, source in code_cells(notebook):
        if "ex.check_" not in source:
            continue
        blanks = _BLANK.findall(source)
        tree = ast.parse(python_source(source))
        last = tree.body[-1] if tree.body else None
        call = last.value if isinstance(last, ast.Expr) else None
        if (len(blanks) != 1 or not isinstance(call, ast.Call)
                or not isinstance(call.func, ast.Attribute) or
                not call.func.attr.startswith("check_")):
            raise SolutionError(f"{lab_name(notebook)}, cell {index}: a graded cell needs one "
                                f"'NAME = None' line and ends with a call ex.check_...(...)")
        found.append(GradedCell(lab_name(notebook), index, len(found) + 1, blanks[0],
                                call.func.attr, source))
    return found


def load_solutions(path: Path = ANSWERS) -> dict[str, list[Solution]]:
    """``answers.toml``: for each lab, its solutions in the order of its graded cells."""
    with path.open("rb") as f:
        table = tomllib.load(f)
    solutions = {}
    for lab, entries in table.items():
        if not isinstance(entries, list):
            raise SolutionError(f"{path.name}: [{lab}] must be an array of tables, [[{lab}]]")
        try:
            solutions[lab] = [Solution(**entry) for entry in entries]
        except TypeError as err:
            raise SolutionError(f"{path.name}, [[{lab}]]: each entry has exactly check, "
                                f"answer, wrong and hint ({err})") from err
    return solutions


def pair(lab: str, cells: list[GradedCell],
         solutions: dict[str, list[Solution]]) -> list[tuple[GradedCell, Solution]]:
    """Each graded cell of ``lab`` with its solution; raises :class:`SolutionError` unless
    there is exactly one solution per graded cell, for the same check, in the same order."""
    given = solutions.get(lab, [])
    if len(given) != len(cells):
        raise SolutionError(f"{lab}: {len(cells)} graded cell(s) but {len(given)} reference "
                            f"answer(s) in {ANSWERS.name}; graded cells call "
                            f"{[c.check for c in cells]}")
    for cell, solution in zip(cells, given, strict=True):
        if solution.check != cell.check:
            raise SolutionError(f"{cell.where}: the reference answer is for "
                                f"{solution.check}; the answers are out of order")
    return list(zip(cells, given, strict=True))


def binding(name: str, code: str, where: str) -> str:
    """Source that binds ``name``: ``name = code`` for an expression, else ``code`` itself
    (statements that must assign ``name`` or define it with ``def``)."""
    code = textwrap.dedent(code).strip()
    try:
        ast.parse(code, mode="eval")
    except SyntaxError:
        pass
    else:
        return f"{name} = {code}"
    try:
        tree = ast.parse(code)
    except SyntaxError as err:
        raise SolutionError(f"{where}: the answer is not Python: {err}") from err
    if name not in bound_names(tree, top_level=True):
        raise SolutionError(f"{where}: the answer's statements never bind {name!r}")
    return code


def substitute(cell: GradedCell, code: str) -> str:
    """The cell's source with its ``NAME = None`` line replaced by ``code``."""
    replacement = binding(cell.name, code, cell.where)
    return _BLANK.sub(lambda _: replacement, cell.source, count=1)


def bound_names(tree: ast.AST, top_level: bool = False) -> set[str]:
    """Names ``tree`` binds: assignment targets, ``def``/``class`` names, imports, and (unless
    ``top_level``) function arguments and comprehension variables."""
    names: set[str] = set()
    nodes = ast.walk(tree) if not top_level else _top_level_nodes(tree)
    for node in nodes:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg) and not top_level:
            names.add(node.arg)
    return names


_OWN_SCOPE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp,
              ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _top_level_nodes(tree: ast.AST):
    """The nodes that bind in the module's scope: functions, classes, lambdas and
    comprehensions are yielded but not entered (their variables are their own)."""
    pending = list(getattr(tree, "body", []))
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, _OWN_SCOPE):
            pending.extend(ast.iter_child_nodes(node))


def free_names(source: str) -> set[str]:
    """Names ``source`` reads and never binds, builtins left out: what it needs from the
    notebook's namespace."""
    tree = ast.parse(source)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - bound_names(tree) - set(dir(builtins))


def python_source(source: str) -> str:
    """A cell's source as plain Python: IPython's magics (``%matplotlib``) become calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def imports_before(notebook: Path, index: int) -> str:
    """The import statements of the code cells before cell ``index``, as one source."""
    lines = []
    for i, source in code_cells(notebook):
        if i >= index:
            break
        tree = ast.parse(python_source(source))
        lines += [ast.unparse(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    return "\n".join(lines)


def verify_source(cell: GradedCell, solution: Solution) -> str:
    """The cell build.py runs right after ``cell`` in the instructor copy: it asserts that the
    check's feedback (the graded cell's output) was correct, then grades the wrong answer in
    a copy of the namespace (nothing the lab uses later is touched) and asserts that it fails
    with the hint."""
    wrong = binding(cell.name, solution.wrong, cell.where)
    return textwrap.dedent(f"""\
        # {VERIFY_TAG}: {cell.where}; build.py removes this cell after the run
        from labkit.grading import Feedback as _SolutionFeedback
        _solution_fb = Out.get(len(In) - 2)
        assert isinstance(_solution_fb, _SolutionFeedback), (
            f"the graded cell's output is not a check's Feedback: {{_solution_fb!r}}")
        assert _solution_fb.ok, f"the reference answer failed its check: {{_solution_fb}}"
        _solution_ns = dict(globals())
        exec(compile({wrong!r}, "<wrong answer>", "exec"), _solution_ns)
        _solution_fb = eval({cell.check_call()!r}, _solution_ns)
        assert not _solution_fb.ok, f"the wrong answer passed its check: {{_solution_fb}}"
        _solution_hint = {solution.hint!r}
        assert _solution_hint in _solution_fb.message, (
            f"the wrong answer did not get the hint {{_solution_hint!r}}: {{_solution_fb}}")
        del _solution_fb, _solution_ns, _solution_hint
        """)
