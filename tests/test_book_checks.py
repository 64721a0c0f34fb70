"""The book's strict build fails loudly on the mistakes that would otherwise ship quietly.

`make book` runs ``jupyter-book build -W -n --keep-going book``: every warning is an error and
every cross-reference is checked (nitpicky). These tests build tiny books with the real
``book/_config.yml`` and prove that a chapter naming a labkit function that does not exist, a
figure no cell glued, a {numref} to a figure that is not there, and a cell that raised each
fail the build with a warning that says which; a positive control shows the same build passes
when nothing is wrong, so the failures are the mistakes' and not the harness's.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.book  # a small book built per test

BOOK = Path(__file__).resolve().parents[1] / "book"
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")

HEADER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

"""

# A page that references labkit's API reference correctly, glues a figure, shows it and
# numbers it: the positive control, and the base every failing page changes one thing in.
GOOD_PAGE = HEADER + """# A chapter

{py:func}`labkit.launch.trtllm_kv_fraction` sizes TensorRT-LLM's KV cache; {numref}`fig-line`
draws a line.

```{code-cell} ipython3
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from myst_nb import glue

fig, ax = plt.subplots()
ax.plot([0, 1], [0, 1])
glue("fig-line", fig, display=False)
```

```{glue:figure} fig-line
:name: fig-line

A line.
```

PagedAttention {footcite:p}`kwon2023` pages the KV cache.

## References

```{footbibliography}
```
"""


def build(tmp_path: Path, page: str) -> subprocess.CompletedProcess:
    """Build a book of one chapter, ``page``, and an API page for the one function it names.

    The real ``book/api/launch.rst`` links to half of labkit; documenting just the function
    keeps each build to seconds while using the same autodoc and config as the book."""
    root = tmp_path / "book"
    (root / "api").mkdir(parents=True)
    shutil.copy(BOOK / "_config.yml", root)
    for bib in BOOK.glob("*.bib"):  # the config names them
        shutil.copy(bib, root)
    # The config's local extensions.
    shutil.copytree(BOOK / "api" / "_ext", root / "api" / "_ext")
    shutil.copytree(BOOK / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "api" / "launch.rst").write_text(
        "labkit.launch\n=============\n\n.. autofunction:: labkit.launch.trtllm_kv_fraction\n"
    )
    # The labels the function's docstring links (tests/test_book_links.py keeps them real).
    (root / "intro.md").write_text("# Intro\n\n(ch02-sglang)=\n## SGLang\n")
    (root / "chapter.md").write_text(page)
    (root / "_toc.yml").write_text(
        "format: jb-book\nroot: intro\nchapters:\n  - file: chapter\n  - file: api/launch\n"
    )
    result = subprocess.run(
        [str(JUPYTER_BOOK), "build", "-W", "-n", "--keep-going", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    # Sphinx colours its warnings; the assertions read plain text.
    result.stdout = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    return result


def test_a_correct_page_builds(tmp_path):
    result = build(tmp_path, GOOD_PAGE)
    assert result.returncode == 0, result.stdout[-3000:]
    assert ": WARNING: " not in result.stdout  # Sphinx's; the kernel logs its own "WARNING |"
    html = (tmp_path / "book" / "_build" / "html" / "chapter.html").read_text()
    # The footnote citation links to its entry in the page's own bibliography.
    assert 'href="#footcite-kwon2023"' in html and 'id="footcite-kwon2023"' in html


def test_an_unknown_citation_key_fails_the_build(tmp_path):
    result = build(tmp_path, GOOD_PAGE.replace("`kwon2023`", "`kwon2099`"))
    assert result.returncode != 0
    assert 'could not find bibtex key "kwon2099"' in result.stdout


def test_the_book_writes_no_markdown_footnotes():
    """The config silences MyST's footnote check, which {footcite} trips (see _config.yml):
    that hides nothing only while no page writes a Markdown footnote of its own."""
    pages = [p for p in BOOK.rglob("*.md") if "_build" not in p.parts]
    assert pages
    footnotes = [f"{p.relative_to(BOOK)}: {m[0]}" for p in pages
                 for m in re.finditer(r"\[\^[\w-]+\]", p.read_text(encoding="utf-8"))]
    assert footnotes == []


def test_a_renamed_labkit_function_fails_the_build(tmp_path):
    page = GOOD_PAGE.replace("trtllm_kv_fraction", "trtllm_kv_share")
    result = build(tmp_path, page)
    assert result.returncode != 0
    assert "py:func reference target not found: labkit.launch.trtllm_kv_share" in result.stdout


def test_a_figure_no_cell_glued_fails_the_build(tmp_path):
    # Without the {numref}, so that the missing glue key is the only thing wrong.
    page = (GOOD_PAGE.replace("{glue:figure} fig-line", "{glue:figure} fig-curve")
            .replace("; {numref}`fig-line`\ndraws a line.", "."))
    result = build(tmp_path, page)
    assert result.returncode != 0
    assert "No key 'fig-curve' found in glue data" in result.stdout


def test_a_numref_to_a_missing_figure_fails_the_build(tmp_path):
    page = GOOD_PAGE.replace("{numref}`fig-line`", "{numref}`fig-curve`")
    result = build(tmp_path, page)
    assert result.returncode != 0
    assert "undefined label: 'fig-curve'" in result.stdout


def test_a_cell_that_raised_fails_the_build(tmp_path):
    page = GOOD_PAGE.replace('ax.plot([0, 1], [0, 1])', 'ax.plot([0, 1], [0, 1])\n1 / 0')
    result = build(tmp_path, page)
    assert result.returncode != 0
    assert "Executing notebook failed" in result.stdout
