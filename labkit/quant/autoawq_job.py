"""Quantize a model with AutoAWQ (run by ``labkit.quant.tools.autoawq_quantize``).

AutoAWQ is deprecated and needs transformers < 4.52, which the course's main environment does
not have; this script runs in its own environment (``make awq-env``) and imports nothing from
labkit. Usage: ``python autoawq_job.py MODEL_DIR OUT_DIR CALIBRATION_TEXT``.
"""

import sys
import warnings

warnings.filterwarnings("ignore")

from awq import AutoAWQForCausalLM  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def main(model_dir: str, out_dir: str, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoAWQForCausalLM.from_pretrained(model_dir)
    config = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    # AutoAWQ silently drops calibration texts longer than max_calib_seq_len (and fails when
    # none is left): feed it one sentence per sample.
    sentences = [s.strip() + "." for s in text.split(".") if s.strip()]
    model.quantize(tokenizer, quant_config=config, calib_data=sentences * 16,
                   max_calib_seq_len=64)
    model.save_quantized(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])
