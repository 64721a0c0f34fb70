"""The lab's calculator widget and chapter 1's plots."""

from labkit.hardware import decode_step, estimate_vram, prefill_step
from labkit.hardware.plots import plot_decode_throughput, plot_memory_breakdown, plot_roofline
from labkit.hardware.widgets import memory_calculator


def test_calculator_reports_and_reacts():
    calc = memory_calculator("Llama-3-8B", "L40S")
    assert "1 x L40S" in calc.report.value and "max concurrency" in calc.report.value
    calc.controls["model"].value = "Llama-3-70B"
    assert "Does not fit" in calc.report.value
    calc.controls["tensor_parallel_size"].value = 4
    assert "4 x L40S" in calc.report.value
    calc.controls["model"].value = "Qwen2.5-7B"
    calc.controls["tensor_parallel_size"].value = 8      # 28 heads do not split 8 ways
    assert "Invalid setting" in calc.report.value and "tensor_parallel_size" in calc.report.value


def test_memory_breakdown_stacks_four_parts():
    estimates = [estimate_vram("Llama-3-8B"), estimate_vram("Llama-3-8B", "int4-awq")]
    ax = plot_memory_breakdown(estimates, gpu="L4")
    assert len(ax.patches) == 4 * len(estimates)
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert top == max(e.total_gib for e in estimates)


def test_roofline_places_steps():
    steps = {"decode": decode_step("Llama-3-8B", "H100 SXM", 1, 1024),
             "prefill": prefill_step("Llama-3-8B", "H100 SXM", 2048)}
    ax = plot_roofline("H100 SXM", steps)
    assert len(ax.collections) == 2
    assert max(ax.lines[0].get_ydata()) == 989.0


def test_decode_throughput_lines_per_gpu():
    ax = plot_decode_throughput("Llama-3-8B", ["H100 SXM", "L4"], 1024, batch_sizes=[1, 2, 4])
    assert len(ax.lines) == 2 and list(ax.lines[0].get_xdata()) == [1, 2, 4]


def test_decode_curves_stop_where_the_kv_cache_is_full():
    # Llama-3-8B on an L4 holds about 43k KV tokens: batch 32 of 1024 fits, 64 does not.
    ax = plot_decode_throughput("Llama-3-8B", ["L4", "H100 SXM"], 1024)
    l4, h100 = ax.lines
    assert max(l4.get_xdata()) == 32 and max(h100.get_xdata()) == 256
    ax = plot_decode_throughput("Llama-3-70B", ["L4"], 1024)
    assert not ax.lines and "does not fit: L4" in ax.get_title()
