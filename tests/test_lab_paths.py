"""The engine labs on the teaching engine: both CPU paths stay green.

nbval runs the labs on whichever path this machine takes (real vLLM on CPU where ``make
vllm-env`` installed it, which is CI's path). This test runs the same cells again with
``LABKIT_ENGINE_PATH=teaching``, labkit's teaching engine standing in for vLLM, as on a machine
without vLLM's CPU build, and fails if any cell raises. Outputs are not compared: they are the
other path's.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.lab  # whole labs, on the teaching engine

LABS = Path(__file__).resolve().parent.parent / "labs"
ENGINE_LABS = ["02_offline_inference.ipynb", "02_openai_server.ipynb",
               "02_benchmark_serving.ipynb", "gpu/vllm_deploy_benchmark.ipynb",
               "03_tensor_parallel.ipynb", "09_speculative_decoding.ipynb"]


@pytest.mark.parametrize("name", ENGINE_LABS)
def test_lab_runs_on_the_teaching_engine(name, monkeypatch):
    monkeypatch.setenv("LABKIT_ENGINE_PATH", "teaching")
    notebook = LABS / name
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    banner = "".join(output.get("text", "") for output in nb.cells[1].outputs)
    assert banner.startswith("Teaching engine"), banner
