"""Model directories as current ``transformers`` saves them, loaded as ``transformers`` loads
them: RoPE settings in ``rope_parameters``, the chat template in ``chat_template.jinja``, and
the BOS token that the tokenizer's post-processor adds."""

import json

import numpy as np
import pytest

from labkit.checks import ParameterError
from labkit.engine import write_tiny_model
from labkit.engine.model import LlamaModel, SequenceBatch
from labkit.engine.tokenizer import Tokenizer
from labkit.engine.weights import load_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

# Laid out on many lines the way Llama 3.1's template is, and using what it uses:
# whitespace control, strftime_now, raise_exception, loop controls and tojson.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
<|system|>Today is {{ strftime_now("%Y-%m-%d") }}.
{{ system }}<|end_of_text|>
{% for message in messages %}
    {% if message['content'] == '' %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception("unknown role " + message['role']) }}
    {% endif %}
    {% if message['role'] == 'tool' %}
<|user|>{{ message['content'] | tojson }}<|end_of_text|>
    {% else %}
<|{{ message['role'] }}|>{{ message['content'] | trim }}<|end_of_text|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{%- endif %}
"""

MESSAGES = [{"role": "system", "content": "  Answer briefly. "},
            {"role": "user", "content": "What limits decode speed?"},
            {"role": "assistant", "content": "Memory bandwidth."},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": 'read "<b>café</b>"'},
            {"role": "user", "content": "And prefill?"}]

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)

# Config files as transformers 5 writes them (rope_parameters) and as older versions did (a
# top-level rope_theta and rope_scaling). Llama 3.1's scaling with a short original context,
# so that the tiny head's frequencies fall in all three of its bands.
ROPE_CASES = {
    "llama-theta-500k": ("llama", {"rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 500000.0}}),
    "llama3-scaling": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "old-format-linear": ("llama", {"rope_theta": 500000.0,
                                    "rope_scaling": {"type": "linear", "factor": 4.0}}),
    "qwen2-theta-1m": ("qwen2", {"rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 1000000.0},
                                 "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's directory: its tokenizer.json adds BOS, as Llama 3's does."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def save_tokenizer(tiny, path, chat_template=CHAT_TEMPLATE):
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"),
                                                     bos_token=BOS, eos_token=EOS)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path


def save_model(path, model_type, settings):
    """A random model saved by transformers with these config ``settings``; old-format RoPE
    keys, which transformers 5 would rewrite, replace its rope_parameters in config.json."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    old_format = "rope_scaling" in settings
    config = config_class[model_type](**SMALL, vocab_size=512,
                                      **({} if old_format else settings))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if old_format:
        saved = json.loads((path / "config.json").read_text())
        del saved["rope_parameters"]
        (path / "config.json").write_text(json.dumps(saved | settings))
    return path


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """Llama 3-like: theta 500,000 in rope_parameters, the template in chat_template.jinja."""
    path = tmp_path_factory.mktemp("llama3-like")
    save_model(path, "llama", ROPE_CASES["llama-theta-500k"][1])
    save_tokenizer(tiny, path)
    return path


def test_current_transformers_saves_what_this_file_is_about(saved):
    config = json.loads((saved / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 500000.0
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())


def our_logits(path, config, token_ids):
    model = LlamaModel(config, load_checkpoint(path), num_blocks=4, block_size=16)
    return model.forward([SequenceBatch(token_ids, 0, [0, 1, 2, 3])])[0]


@pytest.mark.parametrize("case", ROPE_CASES)
def test_logits_equal_transformers_for_every_way_to_write_rope(case, tmp_path):
    path = save_model(tmp_path, *ROPE_CASES[case])
    config = json.loads((path / "config.json").read_text())
    token_ids = np.random.default_rng(0).integers(0, 512, size=60).tolist()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0].numpy()

    np.testing.assert_allclose(our_logits(path, config, token_ids), expected, atol=1e-4)
    # Ignoring the RoPE settings (theta 10,000, no scaling) would fail the check above.
    ignored = {k: v for k, v in config.items()
               if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    assert np.abs(our_logits(path, ignored, token_ids) - expected).max() > 1e-3


def test_unsupported_rope_type_names_the_config_key(saved):
    config = json.loads((saved / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}
    with pytest.raises(ParameterError, match="rope_parameters: rope_type 'yarn'") as err:
        LlamaModel(config, load_checkpoint(saved), num_blocks=1, block_size=16)
    assert err.value.param == "rope_parameters"


def test_chat_template_from_chat_template_jinja_renders_as_transformers(saved):
    ours, theirs = Tokenizer(saved), transformers.AutoTokenizer.from_pretrained(saved)
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == \
            theirs.apply_chat_template(MESSAGES, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    prompt = ours.apply_chat_template(MESSAGES)
    assert prompt.startswith(BOS + "<|system|>Today is") and "\u00e9" in prompt


def test_template_errors_are_bad_messages(saved):
    with pytest.raises(ParameterError, match="messages: .*unknown role robot") as err:
        Tokenizer(saved).apply_chat_template([{"role": "robot", "content": "beep"}])
    assert err.value.param == "messages"


def test_completions_add_bos_and_chat_prompts_do_not_add_another(saved):
    ours, theirs = Tokenizer(saved), transformers.AutoTokenizer.from_pretrained(saved)
    bos_id = theirs.convert_tokens_to_ids(BOS)
    text = "Paged attention splits the cache into blocks."
    assert ours.encode(text) == theirs(text).input_ids
    assert ours.encode(text)[0] == bos_id
    assert ours.encode(text, add_special_tokens=False) == ours.encode(text)[1:]

    chat = ours.encode(ours.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert chat == theirs.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                              return_dict=False)
    assert chat[0] == bos_id and chat[1] != bos_id


# Where a template can be, and which one a chat uses: (files to write, expected result).
# tokenizer_config.json's "chat_template" is written when the layout has a "config" entry.
LAYOUTS = {
    "config string": ({"config": "C{{ messages[0]['content'] }}"}, "Chi"),
    "config list of named templates": (
        {"config": [{"name": "rag", "template": "R"}, {"name": "default", "template": "D"}]},
        "D"),
    "jinja file wins over config": (
        {"config": "C", "chat_template.jinja": "J{{ bos_token }}"}, "J" + BOS),
    "jinja file and additional templates": (
        {"config": "C", "chat_template.jinja": "J",
         "additional_chat_templates/tool_use.jinja": "T"}, "J"),
    "additional templates replace config, no default": (
        {"config": "C", "additional_chat_templates/tool_use.jinja": "T"}, "none named"),
    "processor's chat_template.json is not the tokenizer's": (
        {"chat_template.json": json.dumps({"chat_template": "P"})}, "no chat template"),
    "chat_template.json beside a config template": (
        {"config": "C", "chat_template.json": json.dumps({"chat_template": "P"})}, "C"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_template_precedence_is_transformers(layout, tiny, tmp_path):
    files, expected = LAYOUTS[layout]
    save_tokenizer(tiny, tmp_path, chat_template=None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if "config" in files:
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps(config | {"chat_template": files["config"]}))
    for name, text in files.items():
        if name != "config":
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text(text)
    messages = [{"role": "user", "content": "hi"}]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    if expected in ("none named", "no chat template"):
        with pytest.raises(ValueError):
            theirs.apply_chat_template(messages, tokenize=False)
        with pytest.raises(ParameterError, match=expected):
            Tokenizer(tmp_path).apply_chat_template(messages)
    else:
        assert theirs.apply_chat_template(messages, tokenize=False) == expected
        assert Tokenizer(tmp_path).apply_chat_template(messages, False) == expected


def test_the_tiny_model_adds_bos_like_llama_3(tiny):
    ours, theirs = Tokenizer(tiny), transformers.AutoTokenizer.from_pretrained(tiny)
    assert ours.encode("Hello world") == theirs("Hello world").input_ids
    assert ours.encode("Hello world")[0] == json.loads((tiny / "config.json").read_text())[
        "bos_token_id"]


def test_chat_completion_on_a_model_saved_by_current_transformers(saved):
    """The end-to-end case of the issue: chat on a transformers-5 directory (template in
    chat_template.jinja, theta in rope_parameters) answers, and greedy equals transformers."""
    from labkit.engine import LLM, SamplingParams

    llm = LLM(str(saved), max_model_len=256)
    reply = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    theirs = transformers.AutoTokenizer.from_pretrained(saved)
    prompt = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert reply.prompt_token_ids == prompt
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():  # greedy decoding, written out
        for _ in range(6):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert reply.outputs[0].token_ids == ids[len(prompt):]
