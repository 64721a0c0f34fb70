"""Write a tiny Llama checkpoint that every tool can load: random weights, a real tokenizer.

The directory has what a Hugging Face model has: ``config.json``, ``model.safetensors`` and a
byte-level BPE ``tokenizer.json`` trained here, offline, on a few paragraphs of text, plus a
``tokenizer_config.json`` with a chat template. As Llama 3's does, the tokenizer's
post-processor puts ``<|begin_of_text|>`` (BOS) before every text encoded with special
tokens, and the chat template writes it itself. ``transformers``, vLLM and labkit's teaching
engine all load it; nothing is downloaded. Widths are multiples of 128 so the quantization
tools of chapter 4 (group size 128) accept it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>",
                  "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}<|end_of_text|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Training text for the tokenizer: the course's own sentences, so merges look like English.
_CORPUS = """\
Large language model inference is limited by memory bandwidth when decoding and by compute
when prefilling a long prompt. The key value cache stores one key and one value vector per
layer for every token, and paged attention splits it into blocks of sixteen tokens. A
scheduler batches requests continuously: finished sequences leave, waiting ones join, and a
token budget bounds every step. Tensor parallelism splits each layer over several GPUs and
adds two all-reduce operations per layer. Quantization stores weights in eight or four bits
and keeps the activations in sixteen. Serving engines such as vLLM, SGLang and TensorRT-LLM
expose an OpenAI compatible HTTP API with streaming, health checks and metrics. The quick
brown fox jumps over the lazy dog. Hello world! What is the capital of France? Paris is the
capital of France. One, two, three, four, five, six, seven, eight, nine, ten.
"""


def write_tiny_model(path: str | Path, *, hidden_size: int = 128, intermediate_size: int = 256,
                     num_layers: int = 2, num_attention_heads: int = 4,
                     num_key_value_heads: int = 2, vocab_size: int = 512,
                     max_position_embeddings: int = 1024, seed: int = 0) -> Path:
    """Create a tiny random Llama model directory at ``path`` and return the path."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    bos = SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(path / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()

    head_dim = hidden_size // num_attention_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": tokenizer.token_to_id(bos),
        "eos_token_id": tokenizer.token_to_id("<|end_of_text|>"),
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_position_embeddings,
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))

    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    kv = num_key_value_heads * head_dim
    tensors = {"model.embed_tokens.weight": weight(vocab, hidden_size),
               "model.norm.weight": np.ones(hidden_size, np.float32),
               "lm_head.weight": weight(vocab, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden_size, np.float32),
            p + "self_attn.q_proj.weight": weight(num_attention_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": weight(kv, hidden_size),
            p + "self_attn.v_proj.weight": weight(kv, hidden_size),
            p + "self_attn.o_proj.weight": weight(hidden_size, num_attention_heads * head_dim),
            p + "mlp.gate_proj.weight": weight(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": weight(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": weight(hidden_size, intermediate_size),
        })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
