"""The instructor's solutions (``solutions/answers.toml``): every graded cell of every lab has
a reference answer, and each answer that needs nothing from the notebook's state passes its
check while the typical wrong answer next to it gets its hint. No notebook runs here:
``make solutions`` runs the labs with every answer, those that read the notebook's state
(a benchmark result, a metrics scrape, a scenario) included.
"""

import ast
import contextlib
import importlib.util
import inspect
import io
import pkgutil
import re
import sys
from pathlib import Path

import pytest

import labkit.exercises
from labkit.exercises import ch01, ch03
from labkit.hardware import plan_kv_cache

ROOT = Path(__file__).resolve().parent.parent


def _load_graded():
    spec = importlib.util.spec_from_file_location("solutions_graded",
                                                  ROOT / "solutions" / "graded.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


graded = _load_graded()
SOLUTIONS = graded.load_solutions()
CELLS = {graded.lab_name(nb): (nb, graded.graded_cells(nb)) for nb in graded.lab_notebooks()}


def _solution(cell):
    notebook, cells = CELLS[cell.lab]
    return dict((c.index, s) for c, s in graded.pair(cell.lab, cells, SOLUTIONS))[cell.index]


def _standalone(cell) -> bool:
    """Whether the cell, answered, reads nothing but the imports of the cells before it."""
    notebook, _ = CELLS[cell.lab]
    imported = graded.bound_names(ast.parse(graded.imports_before(notebook, cell.index)))
    solution = _solution(cell)
    return all(graded.free_names(graded.substitute(cell, code)) <= imported
               for code in (solution.answer, solution.wrong))


def _run(cell, code):
    """The check's feedback on ``code``, the cell run in a namespace of the lab's imports."""
    notebook, _ = CELLS[cell.lab]
    namespace: dict = {}
    exec(graded.imports_before(notebook, cell.index), namespace)
    tree = ast.parse(graded.substitute(cell, code))
    last = tree.body.pop()
    with contextlib.redirect_stdout(io.StringIO()):  # the cells' own prints
        exec(compile(tree, f"<{cell.where}>", "exec"), namespace)
        return eval(compile(ast.Expression(last.value), f"<{cell.where}>", "eval"), namespace)


ALL = [cell for _, cells in CELLS.values() for cell in cells]
STANDALONE = [cell for cell in ALL if cell.lab in SOLUTIONS and _standalone(cell)]


def test_every_graded_cell_has_a_reference_answer():
    for lab, (_, cells) in CELLS.items():
        for cell, solution in graded.pair(lab, cells, SOLUTIONS):
            for code in (solution.answer, solution.wrong):
                graded.substitute(cell, code)  # parses and binds the cell's variable
    assert set(SOLUTIONS) <= set(CELLS), "answers.toml names a lab that does not exist"
    assert sum(len(cells) for _, cells in CELLS.values()) >= 50


def test_a_missing_or_misplaced_answer_names_the_lab_and_exercise():
    _, cells = CELLS["03_paged_kv_cache"]
    given = SOLUTIONS["03_paged_kv_cache"]
    with pytest.raises(graded.SolutionError, match=r"03_paged_kv_cache: 4 graded cell\(s\) "
                                                   r"but 3 reference answer\(s\)"):
        graded.pair("03_paged_kv_cache", cells, {"03_paged_kv_cache": given[:3]})
    swapped = [given[1], given[0], *given[2:]]
    with pytest.raises(graded.SolutionError, match="exercise 1 .*out of order"):
        graded.pair("03_paged_kv_cache", cells, {"03_paged_kv_cache": swapped})
    with pytest.raises(graded.SolutionError, match="never bind 'answer'"):
        graded.substitute(cells[0], "blocks = 4\nprint(blocks)")


@pytest.mark.parametrize("cell", STANDALONE, ids=lambda c: f"{c.lab}-{c.number}")
def test_reference_answer_passes_and_wrong_answer_gets_its_hint(cell):
    solution = _solution(cell)
    right = _run(cell, solution.answer)
    assert right.ok, f"{cell.where}: {right.message}"
    wrong = _run(cell, solution.wrong)
    assert not wrong.ok and solution.hint in wrong.message, f"{cell.where}: {wrong.message}"


def test_most_answers_run_without_the_notebook():
    # The rest read what the lab computed (a benchmark, a scrape, a scenario): make solutions.
    assert len(STANDALONE) >= 0.75 * len(ALL)


def test_every_check_is_graded_and_tested():
    """Every check of labkit.exercises is called by a lab's graded cell (so make solutions
    runs it with its reference answer and a wrong one), and is graded without a notebook
    either here or in a test file that imports its module."""
    checks = [(module.__name__.rsplit(".", 1)[1], name)
              for module in _exercise_modules()
              for name, function in inspect.getmembers(module, inspect.isfunction)
              if name.startswith("check_") and function.__module__ == module.__name__]
    assert {name for _, name in checks} <= {cell.check for cell in ALL}
    here = {(cell.check, _module_of(cell)) for cell in STANDALONE}
    test_files = [p.read_text() for p in (ROOT / "tests").glob("test_*.py")
                  if p.name != "test_solutions.py"]
    untested = [(module, name) for module, name in checks if (name, module) not in here
                and not any(module in text and name in text for text in test_files)]
    assert not untested


def _module_of(cell) -> str:
    """The exercises module a graded cell's ``ex`` is, from the lab's imports."""
    notebook, _ = CELLS[cell.lab]
    found = re.search(r"from labkit\.exercises import (\w+) as ex",
                      graded.imports_before(notebook, cell.index))
    return found.group(1)


def _exercise_modules():
    return [importlib.import_module(f"labkit.exercises.{m.name}")
            for m in pkgutil.iter_modules(labkit.exercises.__path__)]


def test_answers_leave_the_labs_names_alone():
    """A helper variable an answer binds is used by no other cell of its lab, so the
    instructor copy computes the same as the student's notebook after the exercise."""
    clashes = []
    for lab, (notebook, cells) in CELLS.items():
        others = {name for index, source in graded.code_cells(notebook)
                  if index not in {c.index for c in cells}
                  for name in _names(source)}
        for cell, solution in graded.pair(lab, cells, SOLUTIONS):
            tree = ast.parse(graded.binding(cell.name, solution.answer, cell.where))
            modules = {name for node in ast.walk(tree) if isinstance(node, ast.Import)
                       for name in graded.bound_names(node)}
            helpers = graded.bound_names(tree, top_level=True) - {cell.name} - modules
            clashes += [f"{cell.where}: {name}" for name in sorted(helpers & others)]
    assert not clashes


def _names(source: str) -> set[str]:
    tree = ast.parse(graded.python_source(source))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def test_radix_extra_tokens_by_hand():
    # A radix tree also serves the partial last block of a shared prefix: 37 = 2 x 16 + 5.
    assert ch03.check_radix_extra_tokens(5)
    assert "blocks' tokens" in ch03.check_radix_extra_tokens(32).message
    assert ch03.check_radix_extra_tokens(0, shared_prefix_len=48)  # whole blocks: nothing more
    assert ch03.check_radix_extra_tokens(0, shared_prefix_len=37, block_size=1)
    assert not ch03.check_radix_extra_tokens(None)


def test_largest_max_model_len_is_whole_blocks():
    plan = plan_kv_cache("Llama-3-70B", "L40S", 2, max_model_len=16, weight_dtype="int4-awq")
    # One sequence takes every block; eight share them out in whole blocks.
    assert ch01.check_largest_max_model_len(plan.kv_cache_tokens, concurrency=1)
    assert ch01.check_largest_max_model_len(16 * (plan.num_gpu_blocks // 8))
    four_bit = 16 * (plan.num_gpu_blocks * 4 // 8)
    assert "weights' precision" in ch01.check_largest_max_model_len(four_bit).message
    assert not ch01.check_largest_max_model_len(16 * (plan.num_gpu_blocks // 8) + 16)
