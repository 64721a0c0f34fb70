"""Chapter 6.2 exercise checks: right answers pass, the usual mistakes are named, and the
expected values are the ones derived by hand from published shapes and tables."""

import pytest

from labkit.checks import ParameterError
from labkit.exercises import ch06_sharing as ex


def test_kv_bytes_per_token():
    # Code Llama 34B: 2 (K, V) * 48 layers * 8 KV heads * 128 * 2 bytes = 196,608.
    assert ex.check_kv_bytes_per_token(196_608)
    assert "KV heads" in repr(ex.check_kv_bytes_per_token(196_608 * 8))   # 64 heads, not 8
    assert "both" in repr(ex.check_kv_bytes_per_token(98_304))
    assert "4 bits" in repr(ex.check_kv_bytes_per_token(49_152))
    assert "Not answered" in repr(ex.check_kv_bytes_per_token(None))
    # Llama 3 8B: 2 * 32 * 8 * 128 * 2 = 131,072.
    assert ex.check_kv_bytes_per_token(131_072, "Llama-3-8B")


def test_second_utilization():
    # 80 GiB, the first at 0.5 (40 GiB) and two 0.7 GiB contexts: 38.6 / 80 = 0.4825 -> 0.48.
    assert ex.largest_second_utilization(80, 0.5, 0.7) == 0.48
    assert ex.check_second_utilization(0.48)
    assert "CUDA contexts" in repr(ex.check_second_utilization(0.5))
    assert "PR #18974" in repr(ex.check_second_utilization(0.98))
    assert not ex.check_second_utilization(0.47)
    # 40 GiB, the first at 0.4275 (17.1 GiB): (40 - 17.1 - 1.4) / 40 = 0.5375 -> 0.53.
    assert ex.check_second_utilization(0.53, total_gib=40, first_utilization=0.4275)


def test_mig_choice():
    # 34 GiB needs 3g.40gb (0.9 * 40 = 36); 15 GiB needs a 20 GB profile (18).
    assert ex.check_mig_choice(["3g.40gb", "1g.20gb", "1g.20gb"])
    assert ex.check_mig_choice(["3g.40gb", "2g.20gb", "1g.20gb"])        # 6 compute slices
    assert "less than the 15 GiB" in repr(ex.check_mig_choice(["3g.40gb", "1g.10gb",
                                                               "1g.20gb"]))
    assert "less than the 34 GiB" in repr(ex.check_mig_choice(["2g.20gb", "1g.20gb",
                                                               "1g.20gb"]))
    assert "compute slices" in repr(ex.check_mig_choice(["4g.40gb", "2g.20gb", "2g.20gb"]))
    assert "not a MIG profile" in repr(ex.check_mig_choice(["3g.20gb", "1g.20gb", "1g.20gb"]))
    assert "list" in repr(ex.check_mig_choice("3g.40gb"))
    assert "Not answered" in repr(ex.check_mig_choice(None))
    with pytest.raises(ParameterError):
        ex.check_mig_choice(["3g.40gb"], needs_gib=[-1.0])


def test_wake_seconds():
    # Llama 3 8B in BF16: 16,060,522,496 bytes over PCIe Gen5 at 64 GB/s one way.
    assert ex.check_wake_seconds(16.060522496 / 64)
    assert "both directions" in repr(ex.check_wake_seconds(16.060522496 / 128))
    assert "GiB" in repr(ex.check_wake_seconds(16.060522496 / 64 * 1e9 / 2**30))
    assert ex.check_wake_seconds(16.060522496 / 32, link="PCIe Gen4 x16")


def test_lora_buffer():
    # 8 slots of rank 32 on seven projections: 8 * 32 * 1,310,720 / 16 * 32 layers * 2 bytes
    # = 8 * 2 * 83,886,080 bytes = 1.25 GiB.
    assert ex.check_lora_buffer_gib(1.25)
    assert "max_lora_rank" in repr(ex.check_lora_buffer_gib(0.625))
    assert "one adapter" in repr(ex.check_lora_buffer_gib(0.15625))
    assert not ex.check_lora_buffer_gib(2.5)
