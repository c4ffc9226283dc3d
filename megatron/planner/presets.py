"""Model shapes: the Seq1F1B paper's GPT models and Llama-2 style models.

GPT presets (arXiv 2406.03488): GPT-2 BPE vocabulary (50257), RoPE, untied input
and output embeddings, FFN = 4h with GeLU, LayerNorm, linear biases and dropout 0.1
(Megatron-LM defaults). Llama-2 presets (arXiv 2307.09288): vocabulary 32000, RoPE,
untied embeddings, SwiGLU FFN, RMSNorm, no biases, no dropout; 70B uses grouped-query
attention with 8 K/V groups (7B and 13B have one K/V head per query head, as published).
"""

from megatron.model_shape import ModelShape


def _gpt(name, layers, hidden, heads):
    return ModelShape(layers, hidden, heads, heads, 4 * hidden, False, 50257, name=name)


def _llama(name, layers, hidden, heads, groups, ffn):
    return ModelShape(
        layers, hidden, heads, groups, ffn, True, 32000, name=name,
        add_bias_linear=False, hidden_dropout=False, normalization="RMSNorm",
    )


PRESETS = {
    "1.3B": _gpt("1.3B", 24, 2048, 16),
    "2.7B": _gpt("2.7B", 32, 2560, 32),
    "7B": _gpt("7B", 32, 4096, 32),
    "13B": _gpt("13B", 40, 5120, 40),
    "30B": _gpt("30B", 64, 6144, 64),
    "llama2-7B": _llama("llama2-7B", 32, 4096, 32, 32, 11008),
    "llama2-13B": _llama("llama2-13B", 40, 5120, 40, 40, 13824),
    "llama2-70B": _llama("llama2-70B", 80, 8192, 64, 8, 28672),
}


def get_preset(name: str) -> ModelShape:
    for key, spec in PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"--model {name!r} is not a preset; choose one of {', '.join(PRESETS)}")
