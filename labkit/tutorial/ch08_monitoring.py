"""The tutorial's monitor (its chapter 8, ``InferenceMonitor``), as written, to hold our metrics
against (:ref:`ch08-tutorial-wrong`).

Its ``check_health`` reads ``/metrics`` by taking the last field of the first line whose text
*contains* a word, 0.0 when none does. The bugs: the words it looks for name no metric vLLM
exports, so the GPU reads as idle instead of the monitor as broken, and a substring is not a
name (``time_to_first_token`` finds the first histogram bucket).
:func:`labkit.monitor.conformance.lint_substring_lookups` shows which vLLM names each word finds;
the fix is a parser and exact names (:mod:`labkit.http.metrics`), and GPU figures from NVIDIA's
DCGM exporter.
"""

#: The words the tutorial's ``InferenceMonitor._parse_metric`` looks for in ``/metrics``
#: (seed tutorial, chapter 8, ``InferenceMonitor.check_health``): it takes the first line
#: containing the word. GPU utilisation and memory come from NVIDIA's DCGM exporter
#: (``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``), never from vLLM.
TUTORIAL_MONITOR_LOOKUPS = ("gpu_utilization", "gpu_memory_used_bytes")
