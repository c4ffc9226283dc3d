"""Model shapes: the Seq1F1B paper's GPT models and Llama-2 style models.

GPT presets (arXiv 2406.03488): GPT-2 BPE vocabulary (50257), RoPE, untied input
and output embeddings, FFN = 4h with GeLU, LayerNorm, linear biases and dropout 0.1
(Megatron-LM defaults). Llama-2 presets (arXiv 2307.09288): vocabulary 32000, RoPE,
untied embeddings, SwiGLU FFN, RMSNorm, no biases, no dropout; 70B uses grouped-query
attention with 8 K/V groups (7B and 13B have one K/V head per query head, as published).
"""

from dataclasses import asdict, dataclass, replace
from typing import Optional

from megatron.seqsplit.split_lengths import ModelShape


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as Megatron builds it."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    swiglu: bool
    vocab_size: int
    kv_channels: Optional[int] = None
    add_bias_linear: bool = True
    hidden_dropout: bool = True  # dropout after attention / MLP (stores a 1-byte mask)
    normalization: str = "LayerNorm"  # or "RMSNorm"
    untie_embeddings: bool = True
    position_embedding_type: str = "rope"  # or "learned_absolute"
    # attention dropout > 0: no stored state with flash attention on GPU; on CPU it
    # sends SDPA to the math kernel, which saves the scores
    attention_dropout: bool = False
    vocab_divisible_by: int = 128  # --make-vocab-size-divisible-by (x TP)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def shape(self) -> ModelShape:
        """The split planner's view of this model."""
        return ModelShape(
            self.num_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.num_query_groups,
            self.ffn_hidden_size,
            self.swiglu,
            self.vocab_size,
            self.kv_channels,
        )

    def with_overrides(self, **kwargs) -> "ModelSpec":
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})

    def to_dict(self):
        return asdict(self)


def _gpt(name, layers, hidden, heads):
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, False, 50257)


def _llama(name, layers, hidden, heads, groups, ffn):
    return ModelSpec(
        name, layers, hidden, heads, groups, ffn, True, 32000,
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


def get_preset(name: str) -> ModelSpec:
    for key, spec in PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"--model {name!r} is not a preset; choose one of {', '.join(PRESETS)}")
