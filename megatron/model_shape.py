"""The model shape and its FLOP count: one class and one formula for the whole project.

`ModelShape` is a decoder-only GPT as Megatron builds it. Training metrics (TFLOP/s),
the planner (presets, unit times, predicted TFLOP/s), the split solver (`uniform_comp`)
and SlimPipe's attention balancing all read their FLOPs from it. It is a leaf module:
it imports nothing from megatron.

FLOPs (2 per multiply-accumulate), forward pass, per layer:

    per token:  2 * h * (2 * hq * d + 2 * g * d + m * ffn)
                (Q and output projections, K and V projections with `g` query
                groups, MLP with m = 2, or 3 for SwiGLU)
    per causal (query, key) pair:  4 * hq * d   (QK^T and AV)

plus the LM head, 2 * h * vocab per token (the embedding lookup costs no FLOPs).
Backward is 2x forward, so an iteration is 3x its forward, as Megatron-LM counts
(recomputation is not counted).

Causal attention pairs, the one convention: a query attends to itself and to every
key before it, so a causal sequence of length S has S (S + 1) / 2 (query, key) pairs,
and a split of length l after a prefix of o tokens owns l * o + l (l + 1) / 2 of them.
The pairs of consecutive splits add up to the pairs of the whole sequence, so the
forward cost of a split is C(o + l) - C(o) with C(x) = a x + b x (x + 1) / 2
(a: linear FLOPs per token, b: attention FLOPs per pair).

Megatron-LM's throughput formula (`training.num_floating_point_operations`) counts
S / 2 keys per query (S^2 / 2 pairs; its older releases and Narayanan et al. (2021)
count S^2). The TFLOP/s this project prints therefore differ from Megatron-LM's by
the factor (S + 1) / S on the attention term: 0.02% of it at S = 4096.
`iteration_flops(..., causal=False)` gives the S^2 count, to compare with
publications that use it.
"""

from dataclasses import dataclass

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as Megatron builds it.

    The first eight fields decide the FLOPs; the others decide memory (planner). The
    defaults of the memory fields are the Seq1F1B paper's GPT models
    (`megatron.planner.presets`), not Megatron-LM's flag defaults.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    swiglu: bool
    vocab_size: int  # the output layer's width (training: the padded vocabulary)
    kv_channels: int | None = None  # None: hidden / heads, Megatron's default
    name: str = "custom"  # a preset's name
    add_bias_linear: bool = True
    hidden_dropout: bool = True  # dropout after attention / MLP (stores a 1-byte mask)
    normalization: str = "LayerNorm"  # or "RMSNorm"
    untie_embeddings: bool = True
    position_embedding_type: str = "rope"  # or "learned_absolute"
    # attention dropout > 0: no stored state with flash attention on GPU; on CPU it
    # sends SDPA to the math kernel, which saves the scores
    attention_dropout: bool = False
    vocab_divisible_by: int = 128  # --make-vocab-size-divisible-by (x TP)

    @classmethod
    def from_args(cls, args, *, vocab_size: int | None = None, name: str = "custom"):
        """The shape of a (validated) Megatron-LM command line.

        ``vocab_size``: the output layer's width; by default ``args.padded_vocab_size``,
        which the trainer sets once the tokenizer is built.
        """
        if vocab_size is None:
            vocab_size = getattr(args, "padded_vocab_size", None)
            if vocab_size is None:
                raise ValueError("ModelShape.from_args: args has no padded_vocab_size yet "
                                 "(the trainer sets it from the tokenizer); pass vocab_size")
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups,
            ffn_hidden_size=args.ffn_hidden_size,
            swiglu=bool(args.swiglu),
            vocab_size=vocab_size,
            kv_channels=args.kv_channels,
            name=name,
            add_bias_linear=not args.disable_bias_linear,
            hidden_dropout=args.hidden_dropout > 0,
            normalization=args.normalization,
            untie_embeddings=bool(args.untie_embeddings_and_output_weights),
            position_embedding_type=args.position_embedding_type,
            attention_dropout=args.attention_dropout > 0,
            vocab_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128),
        )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron pads the vocabulary to a multiple of ``vocab_divisible_by * tp``."""
        multiple = self.vocab_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    # ----------------------------------------------------------------- FLOPs
    @staticmethod
    def causal_pairs(length: int, offset: int = 0) -> float:
        """Causal (query, key) pairs of ``length`` queries after ``offset`` earlier tokens:
        ``l o + l (l + 1) / 2`` (each query sees the prefix, the earlier queries and itself)."""
        return length * offset + length * (length + 1) / 2

    def layer_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's linear layers (position-independent)."""
        h, d = self.hidden_size, self.head_dim
        q_out = 2 * h * self.num_attention_heads * d  # Q projection + output projection
        kv = 2 * h * self.num_query_groups * d  # K and V projections (GQA: g groups)
        mlp = (3 if self.swiglu else 2) * h * self.ffn_hidden_size
        return 2 * (q_out + kv + mlp)

    def layer_flops_per_pair(self) -> float:
        """Forward FLOPs of one layer per causal (query, key) pair: QK^T and AV."""
        return 2 * 2 * self.num_attention_heads * self.head_dim

    def lm_head_flops_per_token(self) -> float:
        return 2 * self.hidden_size * self.vocab_size

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token that do not depend on the position: all layers + LM head."""
        return self.num_layers * self.layer_flops_per_token() + self.lm_head_flops_per_token()

    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs per causal (query, key) pair over all layers."""
        return self.num_layers * self.layer_flops_per_pair()

    def forward_flops_parts(self, length: int, offset: int = 0, *, layers: int | None = None,
                            lm_head: bool = True) -> tuple[float, float]:
        """(linear, attention) forward FLOPs of ``length`` tokens after ``offset`` earlier
        ones (a split, a slice, a planner unit) through ``layers`` layers (default all),
        with or without the LM head."""
        n = self.num_layers if layers is None else layers
        linear = n * self.layer_flops_per_token() * length
        if lm_head:
            linear += self.lm_head_flops_per_token() * length
        return linear, n * self.layer_flops_per_pair() * self.causal_pairs(length, offset)

    def forward_flops(self, length: int, offset: int = 0) -> float:
        """Forward FLOPs of ``length`` tokens after ``offset`` earlier ones, whole model."""
        a, b = self.linear_flops_per_token(), self.attention_flops_per_pair()
        return a * length + b * self.causal_pairs(length, offset)

    def iteration_flops(self, seq_length: int, num_sequences: int = 1,
                        causal: bool = True) -> float:
        """Forward + backward (3x forward) FLOPs of ``num_sequences`` sequences.
        ``causal=False`` counts ``S^2`` pairs (Narayanan et al. 2021), not ``S (S + 1) / 2``."""
        pairs = self.causal_pairs(seq_length) if causal else seq_length**2
        per_sequence = (self.linear_flops_per_token() * seq_length
                        + self.attention_flops_per_pair() * pairs)
        return 3 * num_sequences * per_sequence
