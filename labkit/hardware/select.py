"""GPU recommendations derived from the memory and roofline math (:ref:`ch01-let-numbers-choose`).

The seed tutorial's ``select_gpu`` returns strings someone typed in. Here every option is
computed: for each GPU and weight precision, the smallest tensor-parallel size at which vLLM
could hold ``concurrency`` sequences of ``max_model_len`` tokens, with the headroom left and
the decode-speed bound of that setup, so the reason for each choice can be read off its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.checks import positive_int
from labkit.hardware.gpus import GPU, get_gpu, list_gpus
from labkit.hardware.kv_budget import DoesNotFitError, KVCachePlan, plan_kv_cache
from labkit.hardware.memory import check_tensor_parallel
from labkit.hardware.models import ModelSpec, get_model
from labkit.hardware.roofline import decode_step

#: Weight precisions from least to most lossy; the order breaks ties between options.
PRECISIONS = ("bf16", "fp8", "int8", "int4-awq")
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Recommendation:
    """One way to serve the model, with the numbers that justify it."""

    gpu: str
    num_gpus: int
    weight_dtype: str
    concurrency: int
    plan: KVCachePlan
    decode_tok_s: float
    over_pcie: bool

    @property
    def headroom(self) -> float:
        """Concurrency this setup holds divided by the concurrency asked for."""
        return self.plan.max_concurrency / self.concurrency

    @property
    def why(self) -> str:
        p = self.plan
        link = " over PCIe (slow all-reduce)" if self.over_pcie else ""
        return (
            f"{self.num_gpus} x {self.gpu}{link}, {self.weight_dtype} weights: "
            f"{p.weights_gib:.1f} GiB weights + {p.activations_gib + p.overhead_gib:.1f} GiB "
            f"activations/overhead per GPU leave {p.kv_cache_gib:.1f} GiB for "
            f"{p.kv_cache_tokens:,} KV tokens = {p.max_concurrency:.1f} sequences of "
            f"{p.max_model_len:,} ({self.headroom:.1f}x what was asked); decode bound "
            f"{self.decode_tok_s:,.0f} tok/s at that batch"
        )


def select_gpu(model: ModelSpec | str, max_model_len: int = 8192, concurrency: int = 1,
               gpus: list[GPU | str] | None = None,
               precisions: tuple[str, ...] = PRECISIONS,
               max_gpus: int = 8, gpu_memory_utilization: float = 0.9,
               kv_dtype: str = "bf16") -> list[Recommendation]:
    """Ways to serve ``model``, best first (:ref:`ch01-let-numbers-choose`).

    For each GPU and precision, keeps the smallest TP size in (1, 2, 4, 8) up to ``max_gpus``
    that holds ``concurrency`` full-length sequences. Sorted by GPU count, then precision
    (less lossy first), then the decode throughput bound at ``concurrency`` sequences.
    FP8 is offered only on GPUs with FP8 tensor cores. Raises ``ValueError`` when nothing fits.
    """
    model = get_model(model)
    positive_int("concurrency", concurrency)
    positive_int("max_gpus", max_gpus)
    candidates = [get_gpu(g) for g in gpus] if gpus is not None else list_gpus()
    options: list[Recommendation] = []
    for gpu in candidates:
        for precision in precisions:
            if precision == "fp8" and not gpu.has_fp8:
                continue
            option = _smallest_fit(model, gpu, precision, max_model_len, concurrency, max_gpus,
                                   gpu_memory_utilization, kv_dtype)
            if option is not None:
                options.append(option)
    if not options:
        raise DoesNotFitError(
            "model",
            f"model: {model.name} does not fit {concurrency} sequence(s) of {max_model_len} "
            f"tokens on up to {max_gpus} of any GPU in {[g.name for g in candidates]} at "
            f"precisions {list(precisions)}; lower max_model_len or concurrency, or allow more GPUs"
        )
    rank = {p: i for i, p in enumerate(precisions)}
    return sorted(options, key=lambda r: (r.num_gpus, rank[r.weight_dtype], -r.decode_tok_s))


def _smallest_fit(model: ModelSpec, gpu: GPU, precision: str, max_model_len: int,
                  concurrency: int, max_gpus: int, gpu_memory_utilization: float,
                  kv_dtype: str) -> Recommendation | None:
    for tp in (t for t in TP_SIZES if t <= max_gpus):
        try:
            check_tensor_parallel(model, tp)
        except ValueError:
            continue
        try:
            plan = plan_kv_cache(model, gpu, tp, gpu_memory_utilization,
                                 max_model_len=max_model_len, weight_dtype=precision,
                                 kv_dtype=kv_dtype)
        except DoesNotFitError:
            continue
        if plan.max_concurrency < concurrency:
            continue
        step = decode_step(model, gpu, concurrency, max_model_len, precision, kv_dtype, tp)
        return Recommendation(gpu=gpu.name, num_gpus=tp, weight_dtype=precision,
                              concurrency=concurrency, plan=plan,
                              decode_tok_s=step.tokens_per_s,
                              over_pcie=tp > 1 and not gpu.has_nvlink)
    return None
