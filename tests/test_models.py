"""ModelSpec: shapes and parameter counts against published numbers and transformers."""

import json

import pytest

from labkit.hardware import ModelSpec, preset_names, preset_record

PRESETS = preset_names()
LLAMA_8B = preset_record("Llama-3-8B")["config"]


def test_course_presets_are_all_there():
    assert set(PRESETS) >= {"Llama-3-8B", "Llama-3-70B", "Llama-3.1-405B", "Qwen2.5-7B",
                            "Qwen2.5-72B", "Mixtral-8x7B"}


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_within_1pct_of_published(name):
    record = preset_record(name)
    published = record["published_params_b"] * 1e9
    assert ModelSpec.preset(name).num_params == pytest.approx(published, rel=0.01)
    assert record["params_source"].startswith("https://") and record["as_of"]


def test_mixtral_active_params_match_mistral():
    record = preset_record("Mixtral-8x7B")
    spec = ModelSpec.preset("Mixtral-8x7B")
    published = record["published_active_params_b"] * 1e9
    assert spec.num_active_params == pytest.approx(published, rel=0.01)


def test_llama_3_8b_by_hand():
    # embed 128256*4096 twice (untied); per layer q,o 4096^2, k,v 4096*1024,
    # MLP 3*4096*14336, two norms of 4096; one final norm.
    embed = 128256 * 4096
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert ModelSpec.preset("Llama-3-8B").num_params == 2 * embed + 32 * layer + 4096


@pytest.mark.parametrize("name", PRESETS)
def test_param_count_equals_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(preset_record(name)["config"])
    hf_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert ModelSpec.preset(name).num_params == sum(p.numel() for p in model.parameters())


def test_llama_attention_bias_counts_all_four_projections():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=100,
                  attention_bias=True, tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(config)
    hf = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_from_config_file_and_directory(tmp_path):
    config = preset_record("Qwen2.5-7B")["config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_file = ModelSpec.from_hf_config(tmp_path / "config.json")
    from_dir = ModelSpec.from_hf_config(str(tmp_path))
    assert from_file == from_dir
    assert from_file.num_kv_heads == 4 and from_file.head_dim == 128 and from_file.qkv_bias


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    spec = ModelSpec.from_hf_config({"hidden_size": 512, "num_hidden_layers": 2,
                                     "num_attention_heads": 8, "intermediate_size": 1024,
                                     "vocab_size": 1000})
    assert spec.head_dim == 64 and spec.num_kv_heads == 8


@pytest.mark.parametrize("bad, match", [
    ({"hidden_size": 512}, "missing required keys"),
    ({**LLAMA_8B, "kv_lora_rank": 512}, "multi-head latent"),
    ({**LLAMA_8B, "num_key_value_heads": 5}, "multiple of num_kv_heads"),
    ({**LLAMA_8B, "num_hidden_layers": -1}, "num_layers must be a positive"),
])
def test_bad_configs_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(bad)


def test_missing_file_and_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelSpec.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelSpec.preset("Llama-9-1T")
