"""Path detection for labs."""

import labkit.lab as lab
from labkit.lab import LabPath


def test_three_paths_and_their_banners():
    teaching = LabPath(gpus=(), engines=("vllm",))
    cpu = LabPath(gpus=(), engines=(), vllm_cpu_python="/x/.venv-vllm/bin/python")
    gpu = LabPath(gpus=("NVIDIA H100 80GB HBM3",), engines=("vllm",),
                  vllm_cpu_python="/x/.venv-vllm/bin/python")
    assert teaching.banner().startswith("CPU path")
    assert teaching.runs("vllm") == "teaching" and not teaching.uses("vllm")
    assert "no CUDA GPU" in teaching.banner("vllm") and "make vllm-env" in teaching.banner("vllm")
    assert cpu.runs("vllm") == "cpu" and cpu.banner("vllm").startswith("vLLM on CPU")
    assert cpu.runs("sglang") == "teaching"       # only vLLM has a CPU build
    assert gpu.runs("vllm") == "gpu" and gpu.uses("vllm")  # a GPU wins over the CPU build
    assert gpu.banner("vllm") == "GPU path: vllm on NVIDIA H100 80GB HBM3."
    assert "sglang is not installed" in gpu.banner("sglang")
    assert "tensorrt_llm is not installed" in gpu.banner("trtllm")  # the package, by name


def test_vllm_cpu_environment_is_found_by_its_stamp(monkeypatch, tmp_path):
    monkeypatch.delenv("LABKIT_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(lab.sys, "prefix", str(tmp_path / ".venv"))
    venv = tmp_path / ".venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert lab.detect().vllm_cpu_python is None          # half-built: no stamp yet
    (venv / ".installed").write_text("")
    assert lab.detect().vllm_cpu_python == str(venv / "bin" / "python")
    monkeypatch.setenv("LABKIT_ENGINE_PATH", "teaching")
    assert lab.detect().runs("vllm") == "teaching"
    assert "LABKIT_ENGINE_PATH=teaching" in lab.detect().banner("vllm")
    monkeypatch.setenv("LABKIT_VLLM_PYTHON", str(tmp_path / "missing"))
    monkeypatch.delenv("LABKIT_ENGINE_PATH")
    assert lab.detect().vllm_cpu_python is None


def test_detect_names_engines_not_packages(monkeypatch):
    monkeypatch.setattr(lab.importlib.util, "find_spec",
                        lambda name: object() if name == "tensorrt_llm" else None)
    assert lab.detect().engines == ("trtllm",)


def test_detect_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(lab.shutil, "which", lambda name: None)
    assert lab.detect().gpus == ()


def test_detect_reads_nvidia_smi(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200'\necho 'NVIDIA H200'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(lab.shutil, "which", lambda name: str(fake))
    assert lab.detect().gpus == ("NVIDIA H200", "NVIDIA H200")
