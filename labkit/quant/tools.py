"""The real tools on the course's tiny model, on CPU (:ref:`ch04-choosing`).

``llmcompressor_quantize`` runs one of llm-compressor's standard recipes (GPTQ W4A16, AWQ
W4A16, SmoothQuant + GPTQ W8A8, FP8 dynamic) with ``oneshot`` and saves the compressed-tensors
checkpoint that vLLM serves directly and the teaching engine dequantizes on load; it needs the
``ref`` extra. ``autoawq_quantize`` runs the tutorial's AutoAWQ, deprecated upstream
(:ref:`ch04-tutorial-wrong`), in its own environment (``make awq-env``), since it requires an old
transformers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from labkit.checks import ParameterError

SCHEMES = ("gptq-w4a16", "awq-w4a16", "w8a8-smoothquant-gptq", "fp8-dynamic")

#: Calibration text for the tiny model: what matters is that it is text, not its content.
CALIBRATION_TEXT = (
    "The key value cache stores one key and one value vector per layer for every token. "
    "A scheduler batches requests continuously under a token budget. Quantization stores "
    "weights in fewer bits; calibration data shows which weights matter."
)


def _recipe(scheme: str):
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    ignore = ["lm_head"]
    return {
        "gptq-w4a16": lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore),
        # AWQ only rescales channels; a quantization modifier after it does the rounding.
        "awq-w4a16": lambda: [AWQModifier(),
                              QuantizationModifier(targets="Linear", scheme="W4A16_ASYM",
                                                   ignore=ignore)],
        "w8a8-smoothquant-gptq": lambda: [SmoothQuantModifier(smoothing_strength=0.5),
                                          GPTQModifier(targets="Linear", scheme="W8A8",
                                                       ignore=ignore)],
        "fp8-dynamic": lambda: QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC",
                                                    ignore=ignore),
    }[scheme]()


@contextlib.contextmanager
def _cpu_awq_workaround():
    """llm-compressor's AWQ pins host memory, which fails without an accelerator."""
    from llmcompressor.pipelines import cache

    original = cache.IntermediatesCache.pin_memory
    cache.IntermediatesCache.pin_memory = lambda *args, **kwargs: None
    try:
        yield
    finally:
        cache.IntermediatesCache.pin_memory = original


def llmcompressor_quantize(model_dir: str | Path, out_dir: str | Path, scheme: str,
                           calibration_texts: Sequence[str] = (CALIBRATION_TEXT,) * 16,
                           max_seq_length: int = 64, verbose: bool = False) -> Path:
    """Quantize ``model_dir`` with an llm-compressor recipe; returns ``out_dir``."""
    if scheme not in SCHEMES:
        raise ParameterError("scheme", f"scheme must be one of {SCHEMES}, got {scheme!r}")
    with _quiet(verbose):
        return _oneshot(Path(model_dir), Path(out_dir), scheme, calibration_texts,
                        max_seq_length)


def _oneshot(model_dir: Path, out_dir: Path, scheme: str, calibration_texts: Sequence[str],
             max_seq_length: int) -> Path:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = None
    if scheme != "fp8-dynamic":  # FP8 dynamic needs no calibration data
        ids = [tokenizer(t)["input_ids"][:max_seq_length] for t in calibration_texts]
        dataset = Dataset.from_dict({"input_ids": ids})
    workaround = _cpu_awq_workaround() if scheme.startswith("awq") else contextlib.nullcontext()
    with workaround:
        oneshot(model=model, dataset=dataset, recipe=_recipe(scheme),
                max_seq_length=max_seq_length, num_calibration_samples=len(calibration_texts))
    model.save_pretrained(out_dir, save_compressed=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Hide llm-compressor's log lines and progress bars unless ``verbose``."""
    if verbose:
        yield
        return
    import io
    import logging
    import os
    import warnings

    import llmcompressor  # noqa: F401  (it configures its logger on import: do that first)
    from loguru import logger

    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    logger.disable("llmcompressor")
    logger.disable("compressed_tensors")
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        logger.enable("llmcompressor")
        logger.enable("compressed_tensors")
        if previous is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = previous


def autoawq_python() -> Path:
    """The interpreter of the AutoAWQ environment: ``$LABKIT_AUTOAWQ_PYTHON``, else the
    repository's ``.venv-awq`` (made by ``make awq-env``)."""
    default = Path(__file__).resolve().parents[2] / ".venv-awq" / "bin" / "python"
    return Path(os.environ.get("LABKIT_AUTOAWQ_PYTHON", default))


def autoawq_quantize(model_dir: str | Path, out_dir: str | Path,
                     calibration_text: str = CALIBRATION_TEXT) -> Path:
    """Quantize with AutoAWQ (W4, groups of 128, zero points, GEMM layout); returns ``out_dir``."""
    python = autoawq_python()
    if not python.exists():
        raise FileNotFoundError(f"no AutoAWQ environment at {python}: run `make awq-env`, or "
                                f"set LABKIT_AUTOAWQ_PYTHON")
    job = Path(__file__).with_name("autoawq_job.py")
    # -I: isolated, so the script's folder (labkit/quant, which has an awq.py) is not on the path.
    result = subprocess.run([str(python), "-I", str(job), str(model_dir), str(out_dir),
                             calibration_text], capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"AutoAWQ failed:\n{result.stderr[-3000:]}")
    return Path(out_dir)
