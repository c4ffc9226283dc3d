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

Mixture of experts (``num_experts``): an MoE layer's MLP term counts the parameters a
token uses (the router ``h E``, ``top-k`` experts of ``moe_ffn`` and the shared expert),
so FLOPs follow the active parameters; ``--moe-layer-freq`` decides which layers are
MoE (the others keep the dense MLP). Multi-latent attention (``multi_latent_attention``):
the linear term is twice its projections' parameters (q down/up or q, kv down/up,
output) and a (query, key) pair costs ``2 hq (dqk + dpe) + 2 hq dv``.
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

__all__ = ["ModelShape", "pad_vocab_size"]


def vocab_divisible_by(args) -> int | None:
    """--make-vocab-size-divisible-by, or None with --no-pad-vocab-size."""
    if not getattr(args, "pad_vocab_size", True):
        return None
    return getattr(args, "make_vocab_size_divisible_by", 128)


def pad_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int | None = 128,
                   given: int | None = None) -> int:
    """The embedding's and output layer's width as Megatron-LM builds them, the one rule
    the trainer and the planner share: ``given`` (--padded-vocab-size) as it is, else the
    tokenizer's ``vocab_size`` padded to a multiple of ``divisible_by * tp_size``
    (--make-vocab-size-divisible-by: each TP rank's slice a multiple of it), or with
    ``divisible_by`` None (--no-pad-vocab-size) not padded. A ``given`` below
    ``vocab_size`` raises ValueError: Megatron-LM does not check it, and its embedding
    lookup then fails on the first token id past the table; so does an unpadded size that
    does not divide over the TP ranks (megatron-core's vocab-parallel embedding would
    stop on it at the model build)."""
    if given is not None:
        if given < vocab_size:
            raise ValueError(
                f"--padded-vocab-size ({given}) is smaller than the tokenizer's vocabulary "
                f"({vocab_size} tokens): token ids past it would index beyond the "
                f"embedding; give at least {vocab_size} or drop the flag")
        return given
    if divisible_by is None:
        if vocab_size % tp_size:
            raise ValueError(
                f"--no-pad-vocab-size: the tokenizer's vocabulary ({vocab_size} tokens) does "
                f"not divide over --tensor-model-parallel-size ({tp_size}), whose ranks each "
                f"hold an equal slice of it; drop --no-pad-vocab-size or give "
                f"--padded-vocab-size")
        return vocab_size
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def no_rope_pattern(every, layers) -> tuple:
    """--no-rope-freq as megatron-core expands it: N marks every N-th layer, a list is the
    pattern itself (1: no RoPE)."""
    if every is None:
        return ()
    if isinstance(every, int):
        return tuple(([0] * (every - 1) + [1]) * (layers // every))
    return tuple(every)


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
    swiglu: bool  # a gated MLP (SwiGLU, or gpt-oss's quick GeGLU below)
    vocab_size: int  # the output layer's width (training: the padded vocabulary)
    kv_channels: int | None = None  # None: hidden / heads, Megatron's default
    name: str = "custom"  # a preset's name
    add_bias_linear: bool = True
    hidden_dropout: bool = True  # dropout after attention / MLP (stores a 1-byte mask)
    normalization: str = "LayerNorm"  # or "RMSNorm"
    untie_embeddings: bool = True
    position_embedding_type: str = "rope"  # or "yarn", "learned_absolute", "none"
    # --quick-geglu (gated; swiglu is set too) and whether --activation-func-clamp-value
    # clamps its halves: what the activation keeps for backward
    quick_geglu: bool = False
    glu_clamp: bool = False
    # --no-rope-freq: 1 for each layer without RoPE (Llama-4's NoPE layers); () for none
    no_rope_layers: tuple = ()
    # --window-size LEFT,0: keys a query sees before itself in a sliding-window layer;
    # window_layers: 1 for each such layer (--window-attn-skip-freq), () for none
    window: int | None = None
    window_layers: tuple = ()
    # --attention-output-gate: QKV also projects a gate per head channel (Qwen3-Next)
    attention_output_gate: bool = False
    # --qk-l2-norm: Llama-4's weightless L2 norms in the query/key norms' place
    qk_l2_norm: bool = False
    # --softmax-type off-by-one / learnable: attention sinks (the CPU window mask is
    # then additive, in the activation dtype)
    attention_sinks: bool = False
    # attention dropout > 0: no stored state with flash attention on GPU; on CPU it
    # sends SDPA to the math kernel, which saves the scores
    attention_dropout: bool = False
    vocab_divisible_by: int | None = 128  # --make-vocab-size-divisible-by (x TP); None: not
    # padded (--no-pad-vocab-size)
    padded_vocab: int | None = None  # --padded-vocab-size: the width as given, no padding
    max_position_embeddings: int | None = None  # rows of learned position embeddings
    # mixture of experts (Megatron-LM's --num-experts ... flags); None: dense
    num_experts: int | None = None
    moe_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_shared_ffn_hidden_size: int = 0  # --moe-shared-expert-intermediate-size
    moe_shared_expert_gate: bool = False  # --moe-shared-expert-gate (with a shared expert)
    moe_probs_on_input: bool = False  # --moe-apply-probs-on-input
    moe_layer_freq: int | tuple = 1  # N, or one 0 (dense) / 1 (MoE) per layer
    # what the router saves for backward depends on these (activation memory only)
    moe_score_function: str = "softmax"  # --moe-router-score-function
    moe_aux_loss: bool = False  # an aux/seq/global load-balancing loss with coefficient > 0
    moe_z_loss: bool = False  # --moe-z-loss-coeff given
    # multi-latent attention (--multi-latent-attention and its sizes, Megatron-LM defaults)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # --qk-layernorm: per-head query/key norms (standard attention); MLA's latent norms
    # (megatron-core's local and TE specs build them only with it; without, the latents
    # go to the up-projections as they are)
    qk_layernorm: bool = False
    # --mtp-num-layers: DeepSeek-V3's multi-token prediction depths on the last stage, each
    # a copy of the last layer plus two norms, a 2h -> h projection, a final norm and a
    # pass through the output head
    mtp_num_layers: int = 0

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
        fields = dict(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups,
            ffn_hidden_size=args.ffn_hidden_size,
            # gated MLPs: SwiGLU and gpt-oss's quick GeGLU (fc1 twice as wide)
            swiglu=bool(args.swiglu or getattr(args, "quick_geglu", False)),
            quick_geglu=bool(getattr(args, "quick_geglu", False)),
            glu_clamp=getattr(args, "activation_func_clamp_value", None) is not None,
            no_rope_layers=no_rope_pattern(getattr(args, "no_rope_freq", None),
                                           args.num_layers),
            **_window_fields(args),
            attention_output_gate=bool(getattr(args, "attention_output_gate", False)),
            qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)),
            attention_sinks=getattr(args, "softmax_type", "vanilla") != "vanilla",
            qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
            vocab_size=vocab_size,
            kv_channels=args.kv_channels,
            name=name,
            add_bias_linear=not args.disable_bias_linear,
            hidden_dropout=args.hidden_dropout > 0,
            normalization=args.normalization,
            untie_embeddings=bool(args.untie_embeddings_and_output_weights),
            position_embedding_type=args.position_embedding_type,
            attention_dropout=args.attention_dropout > 0,
            vocab_divisible_by=vocab_divisible_by(args),
            padded_vocab=getattr(args, "padded_vocab_size", None),
            max_position_embeddings=getattr(args, "max_position_embeddings", None),
            mtp_num_layers=getattr(args, "mtp_num_layers", None) or 0,
        )
        return cls(**{**fields, **_moe_fields(args), **_mla_fields(args)})

    @property
    def rotary(self) -> bool:
        """RoPE rotates queries and keys (YaRN too: the same tensors, scaled)."""
        return self.position_embedding_type in ("rope", "yarn")

    def ropes_in_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (global index) rotates its queries and keys."""
        skipped = layer < len(self.no_rope_layers) and self.no_rope_layers[layer]
        return self.rotary and not skipped

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    # ------------------------------------------------------------ MoE and MLA
    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has experts, as --moe-layer-freq says."""
        if self.num_experts is None:
            return False
        if isinstance(self.moe_layer_freq, int):
            return layer % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer])

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def mlp_saved_widths(self) -> int:
        """FFN-wide tensors an MLP keeps per token, in units of the FFN width: fc1's output
        (2 when gated), what the activation saves and fc2's input. SwiGLU: fc1's 2F
        output, silu's and the product's F inputs (5); quick GeGLU: its fc1 output, the
        sigmoid, the quick GeLU, the offset linear half and fc2's input (6), and with the
        clamp the clamped activation input too (7); else fc1's output and fc2's input."""
        if self.quick_geglu:
            return 7 if self.glu_clamp else 6
        return 5 if self.swiglu else 2

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices per MLP: fc1 (doubled with SwiGLU) and fc2."""
        return 3 if self.swiglu else 2

    def attention_linear_params(self) -> int:
        """Weights of one layer's attention projections (no biases, no norms)."""
        h, a = self.hidden_size, self.num_attention_heads
        if not self.multi_latent_attention:
            d, g = self.head_dim, self.num_query_groups
            gate = a * d if self.attention_output_gate else 0  # QKV's extra gate rows
            return h * (a * d + 2 * g * d + gate) + a * d * h
        q_down = h * self.q_lora_rank if self.q_lora_rank else 0
        kv_down = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim)
        return q_down + kv_down + self.mla_up_projection_params() + a * self.v_head_dim * h

    def mla_up_projection_params(self) -> int:
        """Weights of MLA's up-projections (the query's, from its latent or, without one,
        from the hidden state; the keys' and values' from the kv latent): what
        --recompute-modules mla_up_proj runs again in the backward."""
        h, a = self.hidden_size, self.num_attention_heads
        qk = self.qk_head_dim + self.qk_pos_emb_head_dim
        q_up = (self.q_lora_rank or h) * a * qk
        return q_up + self.kv_lora_rank * a * (self.qk_head_dim + self.v_head_dim)

    def router_params(self) -> int:
        """The router's weights and the shared expert's gate (each a vector per output,
        replicated over TP)."""
        if not self.num_experts:
            return 0
        gate = self.hidden_size if self.moe_shared_gated() else 0
        return self.hidden_size * self.num_experts + gate

    def moe_shared_gated(self) -> bool:
        """Whether each MoE layer's shared expert output is gated (a shared expert and
        --moe-shared-expert-gate)."""
        return bool(self.moe_shared_expert_gate and self.moe_shared_ffn_hidden_size)

    def expert_params(self) -> int:
        """Weights of one routed expert."""
        return self.mlp_matrices * self.hidden_size * self.expert_ffn

    def shared_expert_params(self) -> int:
        """Weights of an MoE layer's shared expert (0 without one)."""
        return self.mlp_matrices * self.hidden_size * self.moe_shared_ffn_hidden_size

    def mlp_linear_params(self, layer: int, active: bool = False) -> int:
        """Weights of one layer's MLP: dense, or (MoE) router + experts + shared expert,
        with ``active`` only the ``top-k`` experts a token runs through."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return self.mlp_matrices * h * self.ffn_hidden_size
        experts = self.moe_topk if active else self.num_experts
        return (self.router_params() + experts * self.expert_params()
                + self.shared_expert_params())

    def parameter_count(self, active: bool = False) -> int:
        """Weights of the whole model (embeddings, norms; biases left out), all experts
        or (``active``) those one token uses."""
        h = self.hidden_size
        layers = sum(self._layer_params(i, active) for i in range(self.num_layers))
        embeddings = self.vocab_size * h * (2 if self.untie_embeddings else 1)
        embeddings += self.position_embedding_params()
        mtp = self.mtp_num_layers * (self._layer_params(self.num_layers - 1, active)
                                     + self.mtp_norm_params() + 2 * h * h)
        return layers + embeddings + self._norm_params() + mtp

    def _norm_params(self) -> int:
        return 2 * self.hidden_size if self.normalization == "LayerNorm" else self.hidden_size

    def _layer_params(self, layer: int, active: bool = False) -> int:
        """Weights of layer ``layer`` (no biases): projections, MLP or experts, its two
        norms and MLA's latent norms."""
        return (self.attention_linear_params() + self.mlp_linear_params(layer, active)
                + 2 * self._norm_params() + self.mla_norm_params())

    def mtp_norm_params(self) -> int:
        """Norm weights an MTP depth adds to its copy of the last layer: the embedding's,
        the hidden state's and the final norm (its projection of the two, 2h -> h without
        bias, is the other addition)."""
        return 3 * self._norm_params()

    def position_embedding_params(self) -> int:
        """Learned absolute position embeddings (RoPE has no weights)."""
        if self.position_embedding_type != "learned_absolute":
            return 0
        return (self.max_position_embeddings or 0) * self.hidden_size

    def mla_norm_params(self) -> int:
        """Weights of one layer's MLA latent norms (q latent when --q-lora-rank is given,
        kv latent), present with --qk-layernorm only; LayerNorm has a bias too."""
        if not (self.multi_latent_attention and self.qk_layernorm):
            return 0
        per = 2 if self.normalization == "LayerNorm" else 1
        return per * (self.kv_lora_rank + (self.q_lora_rank or 0))

    def kv_values_per_token(self) -> int:
        """Values the K/V cache keeps per token and layer: keys and values of every
        query group; MLA keeps decompressed keys (dqk + dpe) and values (dv) per head."""
        if self.multi_latent_attention:
            a = self.num_attention_heads
            return a * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim)
        return 2 * self.num_query_groups * self.head_dim

    def padded_vocab_size(self, tp: int = 1) -> int:
        """The embedding's and output layer's width at TP size ``tp``, as the trainer
        builds it (``pad_vocab_size``)."""
        return pad_vocab_size(self.vocab_size, tp, self.vocab_divisible_by, self.padded_vocab)

    # ----------------------------------------------------------------- FLOPs
    @staticmethod
    def causal_pairs(length: int, offset: int = 0) -> float:
        """Causal (query, key) pairs of ``length`` queries after ``offset`` earlier tokens:
        ``l o + l (l + 1) / 2`` (each query sees the prefix, the earlier queries and itself)."""
        return length * offset + length * (length + 1) / 2

    def layer_pairs(self, layer: int, length: int, offset: int = 0) -> float:
        """(query, key) pairs layer ``layer`` attends for ``length`` queries after
        ``offset`` earlier tokens: causal, or at most ``window`` keys before each query in
        a sliding-window layer (query p sees min(p, window) earlier keys and itself)."""
        if not (self.window_layers and self.window_layers[layer]):
            return self.causal_pairs(length, offset)
        w = self.window

        def earlier(n):  # sum of min(p, w) over positions p < n
            return n * (n - 1) / 2 if n <= w else w * (w - 1) / 2 + (n - w) * w

        return length + earlier(offset + length) - earlier(offset)

    def attention_flops(self, length: int, offset: int = 0, *, layers: int | None = None,
                        first_layer: int = 0) -> float:
        """Forward attention FLOPs (QK^T and AV) of ``length`` queries after ``offset``
        earlier tokens through ``layers`` layers (default all) from ``first_layer`` on."""
        n = self.num_layers if layers is None else layers
        if not self.window_layers:
            return n * self.layer_flops_per_pair() * self.causal_pairs(length, offset)
        return self.layer_flops_per_pair() * sum(
            self.layer_pairs(layer, length, offset)
            for layer in range(first_layer, first_layer + n))

    def layer_flops_per_token(self, layer: int | None = None) -> float:
        """Forward FLOPs per token of layer ``layer``'s linear layers (position-independent):
        twice the weights a token multiplies (attention projections, MLP or active
        experts). ``None``: the mean over the layers (all alike in a dense model)."""
        if layer is None:
            return sum(map(self.layer_flops_per_token, range(self.num_layers))) / self.num_layers
        return 2 * (self.attention_linear_params() + self.mlp_linear_params(layer, active=True))

    def layer_flops_per_pair(self) -> float:
        """Forward FLOPs of one layer per causal (query, key) pair: QK^T and AV."""
        a = self.num_attention_heads
        if self.multi_latent_attention:
            return 2 * a * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim)
        return 2 * 2 * a * self.head_dim

    def lm_head_flops_per_token(self) -> float:
        return 2 * self.hidden_size * self.vocab_size

    def mtp_flops_per_token(self) -> float:
        """Forward FLOPs per token of the MTP depths' linear layers: each its copy of the
        last layer, its 2h -> h projection and the output head (as Megatron-LM counts)."""
        per_depth = (self.layer_flops_per_token(self.num_layers - 1)
                     + 2 * 2 * self.hidden_size ** 2 + self.lm_head_flops_per_token())
        return self.mtp_num_layers * per_depth

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token that do not depend on the position: all layers + LM head
        (+ the MTP depths)."""
        return (sum(map(self.layer_flops_per_token, range(self.num_layers)))
                + self.lm_head_flops_per_token() + self.mtp_flops_per_token())

    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs per causal (query, key) pair over all layers (+ the MTP depths)."""
        return (self.num_layers + self.mtp_num_layers) * self.layer_flops_per_pair()

    def forward_flops_parts(self, length: int, offset: int = 0, *, layers: int | None = None,
                            lm_head: bool = True, first_layer: int = 0) -> tuple[float, float]:
        """(linear, attention) forward FLOPs of ``length`` tokens after ``offset`` earlier
        ones (a split, a slice, a planner unit) through ``layers`` layers (default all)
        from ``first_layer`` on, with or without the LM head."""
        n = self.num_layers if layers is None else layers
        linear = sum(map(self.layer_flops_per_token, range(first_layer, first_layer + n)))
        linear *= length
        attention = self.attention_flops(length, offset, layers=n, first_layer=first_layer)
        if lm_head:  # the last stage: the output head, and the MTP depths with it
            linear += (self.lm_head_flops_per_token() + self.mtp_flops_per_token()) * length
            attention += self.mtp_attention_flops(length, offset)
        return linear, attention

    def mtp_attention_flops(self, length: int, offset: int = 0) -> float:
        """Forward attention FLOPs of the MTP depths (causal over the whole sequence)."""
        return self.mtp_num_layers * self.layer_flops_per_pair() * self.causal_pairs(length,
                                                                                      offset)

    def forward_flops(self, length: int, offset: int = 0) -> float:
        """Forward FLOPs of ``length`` tokens after ``offset`` earlier ones, whole model."""
        return (self.linear_flops_per_token() * length + self.attention_flops(length, offset)
                + self.mtp_attention_flops(length, offset))

    def iteration_flops(self, seq_length: int, num_sequences: int = 1,
                        causal: bool = True) -> float:
        """Forward + backward (3x forward) FLOPs of ``num_sequences`` sequences.
        ``causal=False`` counts ``S^2`` pairs (Narayanan et al. 2021), not ``S (S + 1) / 2``."""
        attention = (self.attention_flops(seq_length) + self.mtp_attention_flops(seq_length)
                     if causal else self.attention_flops_per_pair() * seq_length**2)
        per_sequence = self.linear_flops_per_token() * seq_length + attention
        return 3 * num_sequences * per_sequence


def window_layer_pattern(skip, layers) -> tuple:
    """--window-attn-skip-freq as megatron-core applies it (``is_layer_window_attention``):
    1 for each sliding-window layer; N keeps every N-th layer full, a pattern is itself,
    None windows every layer."""
    if skip is None:
        return (1,) * layers
    if isinstance(skip, int):
        return tuple(int((layer + 1) % skip != 0) for layer in range(layers))
    return tuple(skip)


def _window_fields(args) -> dict:
    """--window-size LEFT,0 and its layers; LEFT -1 is no window."""
    size = getattr(args, "window_size", None)
    if not size or size[0] < 0:
        return {}
    return {"window": size[0], "window_layers": window_layer_pattern(
        getattr(args, "window_attn_skip_freq", None), args.num_layers)}


def _moe_fields(args) -> dict:
    if getattr(args, "num_experts", None) is None:
        return {}
    freq = args.moe_layer_freq
    types = getattr(args, "moe_router_load_balancing_type", "aux_loss")
    coeffs = getattr(args, "moe_aux_loss_coeff", 0.0)
    types = types if isinstance(types, list) else [types]
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(types)
    aux = any(t in ("aux_loss", "seq_aux_loss", "global_aux_loss") and c > 0
              for t, c in zip(types, coeffs))
    return dict(num_experts=args.num_experts, moe_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_shared_ffn_hidden_size=args.moe_shared_expert_intermediate_size or 0,
                moe_shared_expert_gate=getattr(args, "moe_shared_expert_gate", False),
                moe_probs_on_input=getattr(args, "moe_apply_probs_on_input", False),
                moe_layer_freq=freq if isinstance(freq, int) else tuple(freq),
                moe_score_function=getattr(args, "moe_router_score_function", "softmax"),
                moe_aux_loss=aux,
                moe_z_loss=getattr(args, "moe_z_loss_coeff", None) is not None)


def _mla_fields(args) -> dict:
    if not getattr(args, "multi_latent_attention", False):
        return {}
    # MLA has a K and V per head (no query groups); the activation terms that read
    # head_dim see the query-key head size
    return dict(multi_latent_attention=True, num_query_groups=args.num_attention_heads,
                kv_channels=args.qk_head_dim + args.qk_pos_emb_head_dim, q_lora_rank=args.q_lora_rank,
                kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                qk_layernorm=bool(getattr(args, "qk_layernorm", False)))
