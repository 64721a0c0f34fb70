"""Path detection for labs."""

import labkit.lab as lab
from labkit.lab import LabPath


def test_banner_names_the_path():
    cpu = LabPath(gpus=(), engines=("vllm",))
    gpu = LabPath(gpus=("NVIDIA H100 80GB HBM3",), engines=("vllm",))
    assert cpu.banner().startswith("CPU path")
    assert not cpu.uses("vllm") and "no CUDA GPU" in cpu.banner("vllm")
    assert gpu.uses("vllm") and gpu.banner("vllm") == "GPU path: vllm on NVIDIA H100 80GB HBM3."
    assert "sglang is not installed" in gpu.banner("sglang")
    assert "tensorrt_llm is not installed" in gpu.banner("trtllm")  # the package, by name


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
