"""``labkit doctor``: every lab is in its table, and its verdicts follow the machine."""

import ast
import json
import re
from pathlib import Path

import pytest

import labkit.doctor as doctor
from labkit.lab import LabPath

LABS_DIR = Path(__file__).resolve().parent.parent / "labs"
NOTEBOOKS = sorted(str(p.relative_to(LABS_DIR).with_suffix(""))
                   for p in LABS_DIR.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def test_every_lab_is_in_the_table():
    assert sorted(doctor.LABS) == NOTEBOOKS


@pytest.mark.parametrize("lab", NOTEBOOKS)
def test_the_engine_in_the_table_is_the_one_the_lab_banners(lab):
    text = (LABS_DIR / f"{lab}.ipynb").read_text()
    engines = set(re.findall(r"banner\(\\?[\"']([a-z]+)\\?[\"']\)", text))
    needs = doctor.LABS[lab]
    assert engines == ({needs.engine} if needs.engine else set())


@pytest.mark.parametrize("lab", NOTEBOOKS)
def test_the_stacks_in_the_table_are_the_ones_the_lab_installs(lab):
    text = (LABS_DIR / f"{lab}.ipynb").read_text()
    ensured = set(re.findall(r"stacks\.ensure\(\\?[\"']([a-z]+)\\?[\"']\)", text))
    assert ensured == set(doctor.LABS[lab].stacks)


HEAVY = {"torch", "transformers", "llmcompressor", "awq"}  # the reference stacks' modules
#: The only labkit modules that import them: the quantization tools of lab 04, which installs
#: them first (``stacks.ensure``), the job that runs inside .venv-awq, and the benchmark,
#: which reads a Hugging Face model name's tokenizer with transformers on the GPU path only
#: (vLLM brings transformers there; a model directory needs only ``tokenizers``).
HEAVY_IMPORTERS = {"labkit/quant/tools.py", "labkit/quant/autoawq_job.py", "labkit/bench.py"}


def _imported(source: str) -> set[str]:
    tree = ast.parse(source)
    return ({alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
            | {node.module.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module and not node.level})


@pytest.mark.parametrize("lab", NOTEBOOKS)
def test_a_lab_that_installs_no_stack_imports_none(lab):
    """`make lab` installs no reference stack: a lab whose row names none must not need one,
    neither in its own cells nor through labkit (checked below)."""
    if doctor.LABS[lab].stacks:
        pytest.skip("installs its stacks first")
    notebook = json.loads((LABS_DIR / f"{lab}.ipynb").read_text())
    cells = ["\n".join(line for line in "".join(c["source"]).splitlines()
                       if not line.lstrip().startswith(("%", "!")))  # IPython magics
             for c in notebook["cells"] if c["cell_type"] == "code"]
    assert not set().union(*map(_imported, cells)) & HEAVY


def test_only_the_quantization_tools_import_the_reference_stacks():
    root = LABS_DIR.parent
    importers = {p.relative_to(root).as_posix() for p in (root / "labkit").rglob("*.py")
                 if _imported(p.read_text(encoding="utf-8")) & HEAVY}
    assert importers == HEAVY_IMPORTERS


def test_paths_follow_the_machine(monkeypatch):
    teaching = LabPath(gpus=(), engines=())
    cpu = LabPath(gpus=(), engines=(), vllm_cpu_python="/x/.venv-vllm/bin/python")
    gpu = LabPath(gpus=("NVIDIA H100 80GB HBM3",), engines=("vllm",))
    vllm_lab = doctor.LABS["02_openai_server"]
    assert doctor.lab_runs(vllm_lab, teaching, set()).startswith("Teaching engine")
    assert doctor.lab_runs(vllm_lab, cpu, set()).startswith("vLLM on CPU")
    assert doctor.lab_runs(vllm_lab, gpu, set()).startswith("GPU path: vllm")
    assert doctor.lab_runs(doctor.LABS["01_gpu_memory"], gpu, set()).startswith("CPU path")
    monitoring = doctor.LABS["08_monitoring"]
    assert "Without prometheus" in doctor.lab_runs(monitoring, cpu, set())
    assert "Without" not in doctor.lab_runs(monitoring, cpu, {"prometheus"})
    # A stack not installed yet is no obstacle: the lab installs it, and the line says so.
    quant = doctor.LABS["04_quantization_tools"]
    monkeypatch.setattr(doctor, "_stack_present", lambda name: name == "awq")
    line = doctor.lab_runs(quant, cpu, set())
    assert line.startswith("vLLM on CPU") and line.endswith(
        f"Installs on first use: ref (~{doctor.stacks.STACKS['ref'].size_mb} MB).")
    monkeypatch.setattr(doctor, "_stack_present", lambda name: True)
    assert "first use" not in doctor.lab_runs(quant, cpu, set())
    # A lab whose extra is missing cannot run, and the line says how to install it.
    monkeypatch.setattr(doctor, "_module_present", lambda name: name != "vllm_router")
    line = doctor.lab_runs(doctor.LABS["05_gateway"], cpu, set())
    assert line == "cannot run: extras gateway missing (make lab)"


def test_report_names_each_labs_path_and_fails_only_on_required_checks(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor, "_stack_present", lambda name: False)   # a fresh `make lab`
    report = doctor.run_checks(LabPath(gpus=(), engines=()), root=tmp_path)
    text = report.text()
    for lab in doctor.LABS:
        assert re.search(rf"^  {re.escape(lab)} +\S", text, re.M)
    assert report.ok and text.endswith("ready")             # no GPU, no stacks: not failures
    assert "[warn] GPU: no CUDA GPU" in text
    for name, stack in doctor.stacks.STACKS.items():
        assert (f"[info] stack {name}: not installed: installs on first use "
                f"(~{stack.size_mb} MB)\n       ahead: python -m labkit.stacks {name}") in text
    monkeypatch.setattr(doctor, "_stack_present", lambda name: True)
    assert "[ok  ] stack ref: installed" in doctor.run_checks(
        LabPath(gpus=(), engines=()), root=tmp_path).text()
    monkeypatch.setattr(doctor, "MIN_DISK_GB", 1e12)
    report = doctor.run_checks(LabPath(gpus=(), engines=()), root=tmp_path)
    assert not report.ok and "[FAIL] disk" in report.text()
    assert report.text().endswith("not ready: fix the FAIL lines above")


def test_labkit_doctor_command_prints_every_lab(capsys):
    from labkit.cli import main

    status = main(["doctor"])
    out = capsys.readouterr().out
    assert status in (0, 1) and "What each lab runs here:" in out
    assert all(lab in out for lab in doctor.LABS)
