"""An interactive memory calculator (ipywidgets) for lab 01 and
:doc:`chapter 1 </chapters/ch01_gpu_selection>`."""

from __future__ import annotations

import ipywidgets as widgets

from labkit.hardware.dtypes import WEIGHT_FORMATS
from labkit.hardware.gpus import list_gpus
from labkit.hardware.kv_budget import DoesNotFitError, plan_kv_cache
from labkit.hardware.models import preset_names
from labkit.widgets import calculator


def memory_calculator(model: str = "Llama-3-8B", gpu: str = "L40S") -> widgets.VBox:
    """Pick a model, GPU, precision and vLLM settings; read vLLM's KV-cache plan live.

    The returned box exposes its controls as ``.controls`` (a dict) and the report as
    ``.report`` (an ``HTML`` widget), so tests and exercises can drive it.
    """
    controls = {
        "model": widgets.Dropdown(options=preset_names(), value=model, description="model"),
        "gpu": widgets.Dropdown(options=[g.name for g in list_gpus()], value=gpu,
                                description="GPU"),
        "tensor_parallel_size": widgets.Dropdown(options=[1, 2, 4, 8], value=1,
                                                 description="TP size"),
        "weight_dtype": widgets.Dropdown(options=[n for n in WEIGHT_FORMATS if n != "fp32"],
                                         value="bf16", description="weights"),
        "kv_dtype": widgets.Dropdown(options=["bf16", "fp8"], value="bf16",
                                     description="KV cache"),
        "max_model_len": widgets.IntSlider(value=8192, min=512, max=131072, step=512,
                                           description="max_model_len"),
        "gpu_memory_utilization": widgets.FloatSlider(value=0.9, min=0.5, max=0.98,
                                                      step=0.01, description="GPU mem util"),
    }
    def render() -> str:
        values = {name: c.value for name, c in controls.items()}
        try:
            return str(plan_kv_cache(values.pop("model"), values.pop("gpu"), **values))
        except DoesNotFitError as err:
            return f"Does not fit: {err}"

    return calculator(controls, render)
