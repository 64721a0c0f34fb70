"""labkit's docstrings link the book's sections by label, so the links cannot drift.

A module says which section teaches it with a Sphinx role that the API reference
(``book/api/``, autodoc, nitpicky strict build) resolves: :ref:`ch03-paged-attention` for a
MyST section label ``(ch03-paged-attention)=``, :numref:`fig-roofline` for a figure's
``:name:``, :doc:`/chapters/ch01_gpu_selection` for a whole page. A renamed or removed label
fails the book's build; these tests catch it in a second, without building, and also catch
the roles in modules that the API reference does not render.

They also forbid the old way, a typed section number ("chapter 3.1", "ch. 2.2", "section 6.2",
a bare "(3.2)"): it goes stale silently when a chapter gains or loses a section. A chapter
named in words ("chapter 5's autoscaler") stays allowed.
"""

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
LABKIT = ROOT / "labkit"

ROLE = re.compile(r":(ref|numref|doc):`([^`]+)`")
SECTION_LABEL = re.compile(r"^\((?P<label>[^()\s]+)\)=\s*$", re.MULTILINE)
FIGURE_NAME = re.compile(r"^\s*:?name:\s*(?P<name>fig-\S+)\s*$", re.MULTILINE)
# A typed section number: "chapter 3.1", "chapters 7.2-7.3", "section 6.2", "ch. 2" or
# "ch. 2.2", "§ 3", or a bare "(3.2)" / "(6.2.1)". A value in parentheses should say what it
# is ("a margin of 1.5"), so the bare form is taken to be a section.
TYPED_SECTION = re.compile(
    r"\b(?:chapters?|sections?)\s+\d+\.\d+|\bch\.\s*\d|§\s*\d|\([1-8]\.[1-9](?:\.[1-9])?\)",
    re.IGNORECASE)
# Docstrings this change does not own; each still types a number and is fixed in its own file.
TYPED_SECTION_EXEMPT = {
    "labkit/exercises/ch06_cost.py": "names the tutorial's chapter 6.1",
    "labkit/exercises/ch06_sharing.py": "names the lab of chapter 6.2",
}


def book_markdown() -> list[Path]:
    """Every Markdown page of the book, without build outputs or the labs' symlink."""
    pages = []
    for folder, dirs, files in os.walk(BOOK):  # os.walk does not follow the labs symlink
        dirs[:] = [d for d in dirs if not d.startswith(("_build", "."))]
        pages += [Path(folder) / f for f in files if f.endswith(".md")]
    return pages


def book_targets() -> tuple[set[str], set[str]]:
    """The section labels and figure names the book's pages define."""
    labels, figures = set(), set()
    for page in book_markdown():
        text = page.read_text(encoding="utf-8")
        labels |= {m["label"] for m in SECTION_LABEL.finditer(text)}
        figures |= {m["name"] for m in FIGURE_NAME.finditer(text)}
    return labels, figures


def docstrings(package: Path = LABKIT):
    """``(path relative to the repository, object name, docstring)`` for every module, class
    and function docstring under ``package``."""
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield (path.relative_to(ROOT).as_posix(),
                           getattr(node, "name", "<module>"), doc)


def role_target(text: str) -> str:
    """The target of a role's text: ``label`` or, with an explicit title, ``title <label>``."""
    explicit = re.fullmatch(r"(?s).*<([^<>]+)>\s*", text)
    return (explicit[1] if explicit else text).strip()


def unresolved_roles(docs, labels: set[str], figures: set[str]) -> list[str]:
    """Every role in ``docs`` whose target the book does not define."""
    missing = []
    for path, name, doc in docs:
        for kind, text in ROLE.findall(doc):
            target = role_target(text)
            if kind == "ref":
                ok = target in labels
            elif kind == "numref":
                ok = target in figures
            else:  # a docstring renders on an API page, so a page is named from the book's root
                ok = target.startswith("/") and any(
                    (BOOK / (target[1:] + suffix)).is_file() for suffix in (".md", ".ipynb"))
            if not ok:
                missing.append(f"{path} {name}: :{kind}:`{text}`")
    return missing


def typed_sections(docs) -> list[str]:
    """Every typed section number in ``docs``, outside the exempt files."""
    found = []
    for path, name, doc in docs:
        if path in TYPED_SECTION_EXEMPT:
            continue
        found += [f"{path} {name}: {m[0]!r}" for m in TYPED_SECTION.finditer(doc)]
    return found


def test_book_defines_the_labels_docstrings_use():
    labels, figures = book_targets()
    # The parser found the book's labels (a broken regex would make every check below vacuous).
    assert {"ch01-what-fits", "ch03-paged-attention", "ch08-alerts"} <= labels
    assert {"fig-roofline", "fig-block-table"} <= figures


def test_every_role_in_labkit_docstrings_resolves():
    docs = list(docstrings())
    roles = [role for _, _, doc in docs for role in ROLE.findall(doc)]
    assert len(roles) > 100, "labkit's docstrings should link the book's sections"
    labels, figures = book_targets()
    assert unresolved_roles(docs, labels, figures) == []


def test_no_docstring_types_a_section_number():
    assert typed_sections(docstrings()) == []


def test_the_checks_catch_what_they_are_for():
    """A made-up label, figure or page is reported, and so is each way of typing a number."""
    labels, figures = {"ch01-what-fits"}, {"fig-roofline"}
    docs = [("labkit/x.py", "<module>",
             "Sizes (:ref:`ch01-what-fits`, :ref:`ch01-made-up`), :numref:`fig-made-up`, "
             ":doc:`chapter 1 </chapters/ch99_made_up>` and :doc:`ch01_gpu_selection`.")]
    assert unresolved_roles(docs, labels, figures) == [
        "labkit/x.py <module>: :ref:`ch01-made-up`",
        "labkit/x.py <module>: :numref:`fig-made-up`",
        "labkit/x.py <module>: :doc:`chapter 1 </chapters/ch99_made_up>`",
        "labkit/x.py <module>: :doc:`ch01_gpu_selection`",  # relative: wrong from api/
    ]
    typed = ("(chapter 3.1)", "chapters 7.2-7.3", "Section 6.2", "(ch. 2.2)", "(4.4)", "(6.2.1)")
    for text in typed:
        assert typed_sections([("labkit/x.py", "f", f"Does it {text}.")]), text
    allowed = ("chapter 5's autoscaler", "(chapter 3)", "lab 07", "ratio (0.9, 1.1)",
               "at 1.5x", "vLLM 0.32.0")
    for text in allowed:
        assert typed_sections([("labkit/x.py", "f", f"Does it {text}.")]) == [], text
