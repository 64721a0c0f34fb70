"""The labs' stored outputs keep only the teaching: no absolute path of the machine that ran
them (its checkout, its environments, labkit's cache under its home folder). nbval ignores
the outputs of the cells that print such lines, so they would reach the published book as
stored; labkit prints them through :func:`labkit.lab.shown_path` instead."""

import json
import re
from pathlib import Path

import pytest

from labkit.lab import CHECKOUT, shown_path
from labkit.launch import format_command

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (ROOT / "labs").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)
# An absolute path into a virtual environment or into labkit's cache: a machine's, not the
# reader's. (Paths inside containers, such as /root/.cache/huggingface in a docker line, are
# what the reader runs: they stay.)
MACHINE_PATH = re.compile(r"(?<![\w.~])/[^\s'\"]*?/(\.venv[\w-]*|\.cache/labkit)(/|\b)")


def output_texts(notebook: Path):
    for index, cell in enumerate(json.loads(notebook.read_text(encoding="utf-8"))["cells"]):
        for output in cell.get("outputs", []):
            texts = [output.get("text", "")] + [v for k, v in output.get("data", {}).items()
                                                if k.startswith("text/")]
            for text in texts:
                yield index, "".join(text) if isinstance(text, list) else text


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_stored_outputs_hold_no_absolute_path_of_the_machine(notebook):
    found = [(index, match.group()) for index, text in output_texts(notebook)
             for match in MACHINE_PATH.finditer(text)]
    found += [(index, str(CHECKOUT)) for index, text in output_texts(notebook)
              if f"{CHECKOUT}/" in text]
    assert not found, f"cells print machine paths (use labkit.lab.shown_path): {found}"


def test_the_pattern_finds_what_it_must_and_spares_container_paths():
    assert MACHINE_PATH.search("in /home/ada/course/.venv-vllm/bin/python (no CUDA GPU)")
    assert MACHINE_PATH.search("model: /root/.cache/labkit/tiny-llama")
    assert not MACHINE_PATH.search("-v /var/cache/vllm:/root/.cache/huggingface")
    assert not MACHINE_PATH.search("in .venv-vllm/bin/python, model ~/.cache/labkit/tiny")


def test_paths_are_shown_from_the_checkout_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert shown_path(CHECKOUT / ".venv-vllm" / "bin" / "python") == ".venv-vllm/bin/python"
    assert shown_path(tmp_path / ".cache" / "labkit" / "tiny") == "~/.cache/labkit/tiny"
    assert shown_path(CHECKOUT) == "." and shown_path(tmp_path) == "~"
    assert shown_path("/opt/models/llama") == "/opt/models/llama"
    assert shown_path("relative/path") == "relative/path"
    command = format_command([str(CHECKOUT / ".venv-vllm/bin/python"), "-m", "vllm", "--model",
                              str(tmp_path / "my models" / "tiny"), "--tag", "a b"])
    # ~ stays outside the quotes, so that a shell still expands it.
    assert command == (".venv-vllm/bin/python -m vllm \\\n    --model ~/'my models/tiny' "
                       "\\\n    --tag 'a b'")
