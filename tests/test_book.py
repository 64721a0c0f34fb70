"""The book builds strictly, executes its pages, and shows every chapter and lab."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.book  # the strict build of the whole book

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def _toc_files() -> list[str]:
    text = (BOOK / "_toc.yml").read_text()
    return re.findall(r"file:\s*(\S+)", text)


def test_toc_lists_the_chapters_in_order_and_every_lab():
    files = _toc_files()
    chapters = [f.split("_")[0] for f in files if f.startswith("chapters/")]
    # ch01..ch09, in order, none missing; a chapter may have sections (ch06).
    assert list(dict.fromkeys(chapters)) == [f"chapters/ch{n:02d}" for n in range(1, 10)]
    labs = sorted(str(p.relative_to(ROOT).with_suffix("")) for p in (ROOT / "labs").rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts)
    assert labs and set(labs) <= set(files)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    result = subprocess.run([str(jb), "build", "-W", "-n", "--keep-going", "--path-output",
                             str(out), str(BOOK)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out / "_build" / "html"


def test_book_builds_strictly_with_every_page(built):
    for file in _toc_files():
        assert (built / f"{file}.html").is_file(), file


def test_chapter_1_numbers_are_computed_at_build_time(built):
    page = (built / "chapters" / "ch01_gpu_selection.html").read_text()
    assert "{glue" not in page                      # every glued number was resolved
    assert page.count("<table") >= 1                 # the GPU table, generated from data
    assert "MI300X" in page and "327,680" in page    # Llama-3-70B KV bytes per token
    assert page.count("<img") >= 2                   # plots executed at build time


def test_chapter_6_cost_is_computed_and_cited(built):
    page = (built / "chapters" / "ch06_cost.html").read_text()
    assert "{glue" not in page and "Not written yet." not in page
    assert "must divide num_attention_heads (64)" in page
    assert "[0.3241, 0.3241, 0.3241]" in page        # the tutorial ignores utilization
    assert "No available memory for the cache blocks: Llama-3-70B needs 34.1 GiB per GPU" in page
    assert "A100 80GB has no fp8 tensor cores" in page
    assert "simulated: Llama-3-8B bf16 on 1 x L40S, roofline" in page
    assert ("RunPod Secure Cloud, L40S 48GB (on_demand): $1.09 per GPU-hour as of 2026-09-25"
            in page)
    assert "8,820" in page and "12,775" in page      # x utilization and 720 h, against 730 h
    assert "ch06_gpu_sharing.html" in page
    assert page.count("<table") >= 2 and page.count("<img") >= 1
    refs = (built / "references.html").read_text()
    assert "Zhong" in refs and "Little" in refs


def test_chapter_6_sharing_is_computed_and_cited(built):
    page = (built / "chapters" / "ch06_gpu_sharing.html").read_text()
    assert "{glue" not in page
    assert "| 1 | coder | 17.05 | 0.38 | 6.56 | 24.00 | 0.3 |" in page
    assert "vllm serve chat --gpu-memory-utilization 0.18" in page
    assert "A100 40GB, coder, 0.4275: No available memory for the cache blocks" in page
    assert "4g.40gb + 2g.20gb + 2g.20gb need 8 compute slices; a H100 SXM has 7" in page
    assert "fit in slices but not in place" in page
    assert "PCIe Gen5 x16  coder to sleep 0.286 s" in page
    assert page.count("<img") >= 1 and page.count("<table") >= 1
    refs = (built / "references.html").read_text()
    assert "LoRA: low-rank adaptation" in refs and "multi-instance GPU user guide" in refs


def test_chapter_7_is_computed_and_cited(built):
    page = (built / "chapters" / "ch07_cloud_vs_self_hosted.html").read_text()
    assert "{glue" not in page and "Not written yet." not in page
    # 10.2 kW x 0.8333 (typical draw) x 1.54 x 730 h x $0.0813 = $776.84
    assert "power_usd         $   776.84" in page
    assert "depreciation_usd  $ 4,090.91" in page      # $270,000 / 66 months (5.5 years)
    assert "capacity block: AWS, p5.48xlarge" in page  # the committed offer, priced too
    assert "simulated: Llama-3-70B fp8 on 4 x H100 SXM" in page
    assert "margin m = a Q - c" in page and "self-hosted is cheaper (1 server(s))" in page
    assert "never: a fully used server replaces" in page
    assert "1. 8 GPUs billed every hour: $20,440/month, not $14,112" in page
    assert "unguarded: -391 months" in page
    assert page.count("<img") >= 2 and page.count("<table") >= 1
    refs = (built / "references.html").read_text()
    assert "Barroso" in refs and "Uptime" in refs


def test_chapter_8_is_computed_and_cited(built):
    page = (built / "chapters" / "ch08_production.html").read_text()
    assert "{glue" not in page and "Not written yet." not in page
    assert "failureThreshold: 13" in page and "budget 130 s" in page     # 82 s x 1.5 / 10 s
    assert "the tutorial's script rejects: --disable-log-requests, --swap-space" in page
    assert "labkit.deploy's command rejects: nothing" in page
    assert "p50 TTFT = 0.1900 s" in page and "p99 TTFT = 1.5769 s" in page  # derived by hand
    assert "t=  270 s  inactive" in page and "t=  540 s  firing" in page   # for: 60s
    assert "transitions: [(60.0, 'down'), (100.0, 'up')]" in page
    assert "{'gpu_utilization': [], 'gpu_memory_used_bytes': []}" in page
    assert "set -euo pipefail" in page and "--shutdown-timeout 30" in page
    assert page.count("<img") >= 2
    refs = (built / "references.html").read_text()
    assert "Ewaschuk" in refs and "Prometheus Authors" in refs


def test_chapter_5_is_computed_and_cited(built):
    page = (built / "chapters" / "ch05_gateway_autoscaling.html").read_text()
    assert "{glue" not in page and "Not written yet." not in page
    assert "picked: http://a" in page               # the endpoint picker's worked example
    assert "t= 15 s  2 replicas, waiting [9, 13]  -&gt;  5" in page   # HPA, derived in the text
    assert "on a simulation clock:   []" in page     # the tutorial's autoscaler never scales
    assert "kind: HorizontalPodAutoscaler" in page and page.count("<img") >= 1
    assert "Mitzenmacher" in (built / "references.html").read_text()


def test_chapter_2_tables_and_measurement(built):
    page = (built / "chapters" / "ch02_engines.html").read_text()
    assert "Not written yet." not in page and "{glue" not in page
    assert page.count("<table") >= 2                 # flag mapping and engine comparison
    assert "--mem-fraction-static" in page and "TensorRT-LLM" in page
    assert "Successful requests:" in page            # a benchmark measured at build time


def test_chapter_3_is_computed_and_cited(built):
    page = (built / "chapters" / "ch03_paged_attention_batching_parallelism.html").read_text()
    assert "{glue" not in page and "Not written yet." not in page
    assert page.count("<img") >= 4            # usage/latency, sweep, trace, TP scaling
    assert "Azure code trace" in page and "Patel" in page  # the replayed trace, cited
    assert "static: 200 steps, continuous: 100 steps" in page   # the tutorial's toy
    assert "references.html#id" in page or "references.html" in page  # citations link out
    assert "Kwon" in (built / "references.html").read_text()         # bibliography rendered


def test_chapter_4_comparison_table_is_computed(built):
    page = (built / "chapters" / "ch04_quantization.html").read_text()
    assert "Not written yet." not in page and "{glue" not in page
    assert "AWQ W4A16" in page and "tok/s" in page and page.count("<table") >= 2


@pytest.mark.parametrize("chapter, figures", [("ch01_gpu_selection", 3), ("ch02_engines", 1),
                                              ("ch03_paged_attention_batching_parallelism", 8),
                                              ("ch05_gateway_autoscaling", 3)])
def test_figures_are_numbered_captioned_and_referenced(built, chapter, figures):
    page = (built / "chapters" / f"{chapter}.html").read_text()
    assert page.count('<span class="caption-number">') == figures
    assert "{numref" not in page


def test_figure_references_resolve_across_chapters(built):
    ch03 = (built / "chapters" / "ch03_paged_attention_batching_parallelism.html").read_text()
    for name in ("fig-block-table", "fig-ring-all-reduce", "fig-batching-timeline"):
        assert f'id="{name}"' in ch03
    assert "ch01_gpu_selection.html#fig-roofline" in ch03
    ch05 = (built / "chapters" / "ch05_gateway_autoscaling.html").read_text()
    assert 'id="fig-endpoint-picker"' in ch05 and 'id="fig-hpa-loop"' in ch05


def test_glossary_gives_the_tutorials_terms_and_chapters_link_to_it(built):
    glossary = (built / "glossary.html").read_text()
    for term in ("显存", "张量并行", "连续批处理", "量化"):
        assert term in glossary
    ch03 = (built / "chapters" / "ch03_paged_attention_batching_parallelism.html").read_text()
    assert "glossary.html#term-" in ch03


def test_errata_links_every_finding_to_a_section(built):
    errata = (built / "tutorial_errata.html").read_text()
    for chapter in ("ch01_gpu_selection", "ch05_gateway_autoscaling", "ch06_gpu_sharing",
                    "ch07_cloud_vs_self_hosted", "ch08_production"):
        assert f"chapters/{chapter}.html#" in errata


def test_landing_page_and_instructor_guide(built):
    intro = (built / "intro.html").read_text()
    assert "labkit doctor" in intro and "instructor_guide.html" in intro
    guide = (built / "instructor_guide.html").read_text()
    from labkit.doctor import LABS

    assert all(lab in guide for lab in LABS)          # rendered from the doctor's table
    assert "vllm-env" in guide and "--allow-root" in guide
