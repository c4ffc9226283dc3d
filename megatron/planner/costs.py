"""Cost model: parameters, static memory, activation and K/V cache memory, unit times.

Everything is per GPU (one tensor-parallel rank of one pipeline stage) and in bytes,
FLOPs or seconds. The formulas are written out in docs/planner.md; the names below
follow it. Notation: ``b`` micro-batch size, ``l`` split length, ``o`` split offset
(tokens before the split), ``S`` sequence length, ``h`` hidden, ``a`` heads, ``g``
query groups, ``d`` head dim, ``F`` FFN size, ``V`` (padded) vocabulary, ``t`` tensor
parallel size, ``t_sp`` = ``t`` with sequence parallelism and 1 without.
"""

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from megatron.model_shape import ModelShape
from megatron.pipeline_layers import chunk_layer_counts
from megatron.planner.gpus import GPU
from megatron.schedules.simulate import MemoryEffect
from megatron.schedules.actions import FORWARD, Unit

BF16 = 2
FP32 = 4
# Megatron-LM with bf16/fp16: half-precision weights, fp32 main gradients
# (accumulate_allreduce_grads_in_fp32), fp32 master weights and the optimizer's fp32
# states (Adam m, v; SGD its momentum, none at momentum 0). In fp32 (no --bf16/--fp16)
# there is no master copy: weights, gradients and the states.
WEIGHT_BYTES = BF16
GRAD_BYTES = FP32


def static_bytes_per_param(act_bytes: int, optimizer_states: int = 2) -> Dict[str, int]:
    """Weight, gradient and optimizer bytes per parameter for the training dtype;
    ``optimizer_states``: fp32 tensors the optimizer keeps per parameter."""
    master = 0 if act_bytes >= FP32 else FP32
    return {"weights": min(act_bytes, FP32), "gradients": FP32,
            "optimizer": master + optimizer_states * FP32}

# buffer / chunked: --seq1f1b-kv-cache of this project's executor; concat: the original
# Seq1F1B code's (each split saves a concatenated copy of its prefix)
KV_LAYOUTS = ("buffer", "chunked", "concat")


@dataclass(frozen=True)
class Parallel:
    """How the model is laid out over GPUs."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    num_chunks: int = 1  # virtual pipeline stages per rank
    micro_batch_size: int = 1
    global_batch_size: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    optimizer_states: int = 2  # fp32 tensors per parameter (trainer.optimizers.optimizer_states)
    # layers of each pipeline rank (--decoder-first/last-pipeline-num-layers); None: even
    stage_layers: Optional[Tuple[int, ...]] = None
    # layers of each model chunk in pipeline order (chunk c of rank r at c * pp + r), where
    # a rank's chunks differ (--account-for-embedding/loss-in-pipeline-split with virtual
    # stages: the first / last chunk a layer short); None: a rank's layers / num_chunks
    chunk_layers: Optional[Tuple[int, ...]] = None
    ep: int = 1  # --expert-model-parallel-size: experts divided over ranks of TP x CP x DP
    moe_dispatcher: str = "allgather"  # --moe-token-dispatcher-type
    etp: Optional[int] = None  # --expert-tensor-parallel-size; None: the TP size
    # --context-parallel-size: ranks that divide every split (each an equal contiguous
    # part; the split's K/V all-gathered into every rank's K/V cache)
    cp: int = 1

    @property
    def expert_tp(self) -> int:
        """Ranks each expert is split over (--expert-tensor-parallel-size, default TP)."""
        return self.etp or self.tp

    @property
    def expert_token_share(self) -> float:
        """The share of a unit's tokens whose expert copies one rank computes: with
        experts split over TP (ETP = TP) the dispatcher gathers the TP ranks'
        sequence-parallel shards; whole experts (ETP 1) see their rank's shard."""
        return self.expert_tp / self.tp

    def chunk_counts(self, num_layers: int) -> List[int]:
        """Layers of each model chunk in pipeline order (chunk c of rank r at c * pp + r)."""
        if self.chunk_layers is not None:
            return list(self.chunk_layers)
        stages = self.stage_layers or [num_layers // self.pp] * self.pp
        return chunk_layer_counts(stages, self.num_chunks)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks that average gradients (and shard the distributed optimizer): the data-
        and context-parallel ranks, as megatron-core's DDP."""
        return self.dp * self.cp

    @property
    def tp_sp(self) -> int:
        """Divisor of the activations outside attention and MLP (1 without SP)."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1


@dataclass(frozen=True)
class Recompute:
    """Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers
    and, for selective recomputation, --recompute-modules."""

    granularity: Optional[str] = None  # None, "selective", "full"
    method: str = "uniform"  # "uniform" or "block" (full only)
    num_layers: int = 1
    # selective: the modules recomputed (megatron-core's default: core attention alone);
    # "moe" (--moe-layer-recompute): each MoE layer keeps only its input (the norm's
    # output, counted with the norm); "layernorm", "mlp", "shared_experts",
    # "mla_up_proj": megatron-core's checkpoints of those modules
    modules: Tuple[str, ...] = ("core_attn",)

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation recomputes ``module``."""
        return self.granularity == "selective" and module in self.modules

    @property
    def moe_layers(self) -> bool:
        return self.recomputes("moe")

    @property
    def attention_kernel(self) -> bool:
        """Whether core attention's kernel runs again in the backward (selective with
        core_attn, or full), so that the first forward's kernel keeps nothing."""
        return self.granularity == "full" or self.recomputes("core_attn")


class CostModel:
    """Per-GPU memory and time of every unit of one configuration."""

    def __init__(
        self,
        model: ModelShape,
        par: Parallel,
        gpu: GPU,
        seq_length: int,
        split_lengths: List[int],
        recompute: Recompute = Recompute(),
        kv_layout: str = "buffer",
        act_bytes: int = BF16,
        packed_documents: bool = False,
    ):
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"--kv-cache-layout must be one of {', '.join(KV_LAYOUTS)}")
        self.model, self.par, self.gpu = model, par, gpu
        self.seq_length = seq_length
        self.split_lengths = list(split_lengths)
        self.offsets = [sum(self.split_lengths[:j]) for j in range(len(self.split_lengths))]
        self.num_splits = len(self.split_lengths)
        # the split-aware K/V cache holds the prefix: splits, or context parallelism
        # (one split too: the gathered sequence lives in the cache)
        self.cached = self.num_splits > 1 or par.cp > 1
        self.recompute = recompute
        self.kv_layout = kv_layout
        self.act_bytes = act_bytes  # 2 with --bf16/--fp16, 4 in fp32
        self.packed_documents = packed_documents  # --reset-attention-mask
        self.chunk_counts = par.chunk_counts(model.num_layers)
        self.vocab = model.padded_vocab_size(par.tp)
        self.shape = replace(model, vocab_size=self.vocab)  # as training builds it

    # ------------------------------------------------------------------ parameters
    def layer_params(self, layer: int = 0) -> Dict[str, float]:
        """Parameters of layer ``layer`` on one TP rank, by part: ``linear`` (TP-split),
        ``other`` (biases, norms, the router: replicated) and ``experts`` (this rank's
        ``E / EP`` routed experts, TP-split as --expert-tensor-parallel-size = TP)."""
        m, t = self.model, self.par.tp
        h, a, g, d, f = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim, m.ffn_hidden_size
        moe = m.is_moe_layer(layer)
        linear = m.attention_linear_params()
        if moe:
            linear += m.shared_expert_params()
        else:
            linear += m.mlp_linear_params(layer)
        bias = 0
        if m.add_bias_linear:  # MoE needs --disable-bias-linear: dense layers only
            # column-parallel biases are split over TP, row-parallel ones are replicated
            bias = ((a * d + 2 * g * d) + f * (2 if m.swiglu else 1)) / t + 2 * h
        norms = 2 * (2 * h if m.normalization == "LayerNorm" else h)
        norms += m.mla_norm_params()
        experts = 0.0
        if moe:
            norms += m.router_params()
            experts = m.num_experts // self.par.ep * m.expert_params() / self.par.expert_tp
        return {"linear": linear / t, "other": bias + norms, "experts": experts}

    def layer_indices(self, rank: int, chunk: int) -> range:
        """Global indices of the layers of virtual stage ``chunk`` on pipeline ``rank``
        (Megatron's interleaved assignment, megatron-core's offsets with uneven stages:
        after the layers of every model chunk before it in pipeline order)."""
        first = sum(self.chunk_counts[:chunk * self.par.pp + rank])
        return range(first, first + self.chunk_layers(rank, chunk))

    def rank_param_parts(self, rank: int) -> Dict[str, float]:
        """Parameters held by one GPU of pipeline rank ``rank``: ``dense`` (sharded over
        DP by the distributed optimizer) and ``experts`` (over DP / EP)."""
        dense = experts = 0.0
        for chunk in range(self.par.num_chunks):
            for layer in self.layer_indices(rank, chunk):
                p = self.layer_params(layer)
                dense += p["linear"] + p["other"]
                experts += p["experts"]
        h = self.model.hidden_size
        if rank == 0:
            dense += self.vocab * h / self.par.tp  # input embedding
            dense += self.model.position_embedding_params()  # replicated over TP
        if rank == self.par.pp - 1:
            # the output layer: its own weight when untied, and a tied one's copy on a
            # last stage that is not the first (one weight when PP = 1)
            if self.model.untie_embeddings or self.par.pp > 1:
                dense += self.vocab * h / self.par.tp
            dense += 2 * h if self.model.normalization == "LayerNorm" else h
            depths = self.model.mtp_num_layers
            if depths:  # MTP: copies of the last layer, and the embedding (tied) again
                last = self.layer_params(self.model.num_layers - 1)
                dense += depths * (last["linear"] + last["other"] + self.model.mtp_norm_params()
                                   + 2 * h * h / self.par.tp)
                experts += depths * last["experts"]
                if self.par.pp > 1:
                    dense += self.vocab * h / self.par.tp
        return {"dense": dense, "experts": experts}

    def chunk_layers(self, rank: int, chunk: int = 0) -> int:
        """Layers in model chunk ``chunk`` of pipeline rank ``rank`` (stages may be uneven,
        and a rank's chunks too with --account-for-*-in-pipeline-split)."""
        return self.chunk_counts[chunk * self.par.pp + rank]

    def is_first(self, rank: int, chunk: int) -> bool:
        return rank == 0 and chunk == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return rank == self.par.pp - 1 and chunk == self.par.num_chunks - 1

    def rank_params(self, rank: int) -> float:
        """Parameters held by one GPU of pipeline rank ``rank``."""
        return sum(self.rank_param_parts(rank).values())

    def static_memory(self, rank: int) -> Dict[str, float]:
        """Bytes of weights, gradients and optimizer states on one GPU of ``rank``: the
        distributed optimizer shards dense parameters over DP and expert parameters over
        the expert-data-parallel group (DP x CP x TP / (EP x ETP)), as megatron-core
        does."""
        parts = self.rank_param_parts(rank)
        params = parts["dense"] + parts["experts"]
        dense_shards = self.par.dp_cp if self.par.distributed_optimizer else 1
        expert_dp = self.par.dp_cp * self.par.tp // (self.par.ep * self.par.expert_tp)
        expert_shards = expert_dp if self.par.distributed_optimizer else 1
        per = static_bytes_per_param(self.act_bytes, self.par.optimizer_states)
        return {
            "weights": per["weights"] * params,
            "gradients": per["gradients"] * params,
            "optimizer": per["optimizer"] * (parts["dense"] / dense_shards
                                             + parts["experts"] / expert_shards),
        }

    # ----------------------------------------------------------------- activations
    # What autograd saves, tensor by tensor, as megatron-core's local layers save it
    # (found by logging the saved tensors; docs/planner.md lists every term). ``e`` is
    # the activation dtype's size; statistics (norm mean/rstd, LSE, the loss softmax)
    # are fp32 in every dtype. A unit covers ``T = b l`` tokens of split ``j``.

    @property
    def on_cpu(self) -> bool:
        return self.gpu.kind == "cpu"

    def mask_bytes(self) -> int:
        """Dropout masks are bool on CUDA and in the activation dtype on CPU."""
        return self.act_bytes if self.on_cpu else 1

    def norm_bytes(self, tokens: float) -> float:
        """One norm: its input, statistics and output (the next linear's saved input);
        megatron's RMSNorm also keeps ``x * rstd``."""
        h, e = self.model.hidden_size, self.act_bytes
        if self.model.normalization == "LayerNorm":
            per = 2 * h * e + 2 * FP32  # input, output; mean and rstd
        else:
            per = 3 * h * e + FP32  # input, x * rstd, output; rstd
        return tokens * per / self.par.tp_sp

    def layer_norm_bytes(self, tokens: float) -> float:
        """One of a layer's two norms (before attention, before the MLP): ``norm_bytes``,
        or with ``--recompute-modules layernorm`` only its input (megatron-core's
        ``CheckpointWithoutOutput`` runs the norm without saving anything and frees its
        output, which the next linear layer had saved, until the backward reruns it)."""
        if self.recompute.recomputes("layernorm"):
            return tokens * self.model.hidden_size * self.act_bytes / self.par.tp_sp
        return self.norm_bytes(tokens)

    def part_length(self, split: int) -> int:
        """Positions of split ``split`` one rank runs: its context-parallel part."""
        return self.split_lengths[split] // self.par.cp

    def unit_tokens(self, split: int) -> int:
        """Tokens of a unit of split ``split`` on one rank (micro-batch included)."""
        return self.par.micro_batch_size * self.part_length(split)

    def query_offset(self, split: int) -> int:
        """Where the queries of the slowest rank's part start: the last context-parallel
        rank's, whose queries see the most keys (the split's offset without CP)."""
        return self.offsets[split] + (self.par.cp - 1) * self.part_length(split)

    def _rope_bytes(self, length: float) -> float:
        """RoPE's cos and sin for q and for k: four ``[l, 1, 1, d]`` tensors, not
        divided by TP nor multiplied by the micro-batch size."""
        if not self.model.rotary:
            return 0.0
        return 4 * length * self.model.head_dim * self.act_bytes

    def _math_kernel(self) -> bool:
        """Attention dropout sends SDPA to its math kernel on CPU (scores materialised);
        the chunked cache has no dropout."""
        return (self.on_cpu and self.model.attention_dropout
                and not (self.num_splits > 1 and self.kv_layout == "chunked"))

    def attention_bytes(self, split: int, layer: int = 0) -> float:
        """Core attention of layer ``layer`` for split ``split``, with the output
        projection's saved input (the QKV projection's input is the norm output, in
        ``norm_bytes``); a layer without RoPE (--no-rope-freq) keeps QKV's views."""
        m, t, e = self.model, self.par.tp, self.act_bytes
        if m.multi_latent_attention:
            return self.mla_attention_bytes(split)
        b, l = self.par.micro_batch_size, self.part_length(split)
        tokens = b * l
        q = m.num_attention_heads * m.head_dim / t * e
        kv = m.num_query_groups * m.head_dim / t * e
        qkv = q + 2 * kv
        lse = FP32 * m.num_attention_heads / t
        rope = m.ropes_in_layer(layer)
        split_kernel = self.cached and self.kv_layout in ("buffer", "chunked")
        # q, k, v handed to the kernel: views of the fused QKV output keep it whole;
        # RoPE's (and the qk norms') q, k are new tensors
        new_qk = rope or m.qk_layernorm or m.qk_l2_norm
        unsplit_inputs = (q + kv + qkv) if new_qk else qkv
        cos_sin = self._rope_bytes(l) if rope else 0.0
        # the qk norms' and the output gate's own tensors, outside the kernel
        around, pinned = self._qk_norm_and_gate_bytes(q, qkv)
        if split_kernel and self.kv_layout == "chunked":
            # q copy, LSE, output once; the chunked kernel is not checkpointed by
            # selective recomputation (it keeps no scores to drop)
            return tokens * (q + lse + q + around + pinned) + cos_sin
        if self.recompute.recomputes("core_attn"):
            if split_kernel:
                # the checkpoint wraps the kernel after the cache write
                # (megatron/seqsplit/recompute.py): it keeps the query (RoPE's, or a copy
                # of the view of QKV: kv_cache.query_alone) and aliases of the K/V buffer;
                # the output once
                return tokens * (q + q + around + pinned) + cos_sin
            # the checkpoint keeps q, k, v
            return tokens * (unsplit_inputs + q + around) + cos_sin
        if self._math_kernel():
            keys = l + (self.query_offset(split) if self.cached else 0)
            heads = b * m.num_attention_heads / t
            out = heads * m.head_dim * e * (l + keys)  # scaled q and k
            out += 3 * heads * l * keys * e  # scores, dropout mask, probabilities
            if m.num_query_groups < m.num_attention_heads:
                out += heads * m.head_dim * keys * e  # v expanded to every head
                out += tokens * pinned
            elif not split_kernel:  # split kernels read v from the K/V buffer
                out += tokens * qkv  # v: a view of the fused QKV output
            else:
                out += tokens * pinned
            return out + tokens * (q + around) + cos_sin
        if not split_kernel:
            return tokens * (unsplit_inputs + lse + q + around) + cos_sin
        # K/V live in the buffer; q is RoPE's or a copy of the view of QKV
        # (kv_cache.query_alone), and one output, which the output projection's saved
        # input shares (CPU and GPU kernels alike)
        return tokens * (q + lse + q + around + pinned) + cos_sin

    def _qk_norm_and_gate_bytes(self, q: float, qkv: float) -> tuple[float, float]:
        """Per token, outside the attention kernel: (what the qk norms and the output gate
        keep themselves, the fused QKV output when only a norm's saved input keeps it).

        A norm's input is a view of the QKV output, so keeping it keeps all of QKV;
        LayerNorm adds mean and rstd per head row, RMSNorm rstd and ``x * rstd``, the L2
        norm its rsqrt (and with half inputs, its fp32 copy of q and k instead of the
        view). The gate keeps its sigmoid, and the output projection then keeps the gated
        product besides the kernel's output (probe: +2 q-sized tensors per token)."""
        m, t, e = self.model, self.par.tp, self.act_bytes
        rows = (m.num_attention_heads + m.num_query_groups) / t  # q and k head rows
        around = 2 * q if m.attention_output_gate else 0.0
        if m.multi_latent_attention or not (m.qk_l2_norm or m.qk_layernorm):
            return around, 0.0
        if m.qk_l2_norm:
            around += rows * FP32
            if e < FP32:  # x.float() is a copy, not the view
                return around + rows * m.head_dim * FP32, 0.0
            return around, qkv
        if m.normalization == "LayerNorm":
            around += 2 * rows * FP32
        else:
            around += rows * FP32 + rows * m.head_dim * e
        return around, qkv

    def _latent_bytes(self, rank: int, stored: int) -> float:
        """Per token: one MLA latent of width ``rank`` on its way to its up-projection.
        Without --qk-layernorm the up-projection keeps the down-projection's output
        (``stored`` wide: the kv latent is a view of the output that also holds the
        rotary key); with it the norm keeps that output as its input, its fp32
        statistics and (RMSNorm) ``x * rstd``, and the up-projection keeps its output.
        With sequence parallelism megatron-core scatters the latent back to the
        sequence shard before its norm, so the norm's own terms are the shard's
        (measured: planned 2.8% / 4.7% over the probe with LayerNorm / RMSNorm latent
        norms at TP = 2 with SP when counted whole)."""
        e = self.act_bytes
        if not self.model.qk_layernorm:
            return stored * e
        if self.model.normalization == "LayerNorm":
            norm = rank * e + 2 * FP32
        else:
            norm = 2 * rank * e + FP32
        return stored * e + norm / self.par.tp_sp

    def mla_attention_bytes(self, split: int) -> float:
        """Multi-latent attention of one layer for split ``split`` as megatron-core's
        local MLA spec and the split-aware core attention save it (measured term by
        term with the probe, docs/planner.md): the latents, RoPE's cos and sin of the
        decoupled rotary part (``dpe`` wide, shared by the heads), and core attention
        over queries and keys of head size ``dq = dqk + dpe`` and values of ``dv``.
        The fused kernels need one head size, so V is padded to ``dq`` for the call:
        the padded copy of the whole prefix is saved, and so is the padded output
        (cut back to ``dv`` for the output projection, whose input is saved too)."""
        m, t, e = self.model, self.par.tp, self.act_bytes
        b, l = self.par.micro_batch_size, self.part_length(split)
        tokens = b * l
        heads = m.num_attention_heads / t
        dq = m.qk_head_dim + m.qk_pos_emb_head_dim
        q = heads * dq * e  # also a key, a padded value or a padded output
        out = heads * m.v_head_dim * e  # the output projection's input
        lse = FP32 * heads
        latents = self._latent_bytes(m.kv_lora_rank, m.kv_lora_rank + m.qk_pos_emb_head_dim)
        if m.q_lora_rank:
            latents += self._latent_bytes(m.q_lora_rank, m.q_lora_rank)
        # 4 [l, 1, 1, dpe] tensors, as _rope_bytes; MLA ropes whatever the position type
        up_recomputed = self.recompute.recomputes("mla_up_proj")
        # RoPE's cos and sin, kept by the rotation unless the up-projection is recomputed
        # (it then runs without saving anything, and its checkpoint keeps the fp32
        # [l, 1, 1, dpe] frequencies it was given)
        rope = (l * m.qk_pos_emb_head_dim * FP32 if up_recomputed
                else 4 * l * m.qk_pos_emb_head_dim * e)
        fixed = tokens * latents + rope
        # the query (and unsplit a fresh key) the up-projection made: megatron-core's
        # up-projection checkpoint frees them after core attention until the backward
        # reruns it (what core attention made of them, a padded V, copies, stays)
        own = 0 if up_recomputed else tokens * q
        split_kernel = self.cached and self.kv_layout in ("buffer", "chunked")
        if split_kernel and self.kv_layout == "chunked":
            # the query, the output (at dv: the chunks merge unpadded) and the LSE
            return fixed + own + tokens * (out + lse)
        # the split kernel's K lives in the buffer (counted as K/V cache) and its padded
        # V spans the prefix up to the part's end; unsplit, a fresh K and a padded V of
        # the split alone
        keys = b * (l + self.query_offset(split)) if split_kernel else tokens
        inputs = own + keys * q + (0 if split_kernel else own)
        if self.recompute.recomputes("core_attn"):  # the checkpoint keeps q, k, v
            return fixed + inputs + tokens * out
        if self._math_kernel():
            # scaled q and k, the padded V, then scores, dropout mask and probabilities
            per_key = b * heads * l * e
            return (fixed + tokens * q + 2 * keys * q + 3 * per_key * keys / b
                    + tokens * out)
        return fixed + inputs + tokens * (q + lse + out)

    def mlp_bytes(self, tokens: float) -> float:
        """fc1 output and activation output (SwiGLU: fc1's 2F output, silu and the
        product's two F inputs, the F fc2 input)."""
        f, e = self.model.ffn_hidden_size / self.par.tp, self.act_bytes
        return tokens * f * e * self.model.mlp_saved_widths

    def router_bytes(self, tokens: float) -> float:
        """What the router and the token dispatcher keep for ``tokens`` tokens (megatron-core
        0.16.1 and 0.19.2, measured with the probe): the top-k int64 indices and fp32
        probabilities; sigmoid scores over every expert (and, for k > 1, the per-token sum
        that normalises the top-k); with a load-balancing loss its own fp32 scores over
        every expert, int64 top-k and per-expert fp32 load (sigmoid: a per-token sum
        again); with z-loss the fp32 logits and a per-token logsumexp; the dispatcher's
        bool routing map and fp32 probability matrix over (expert, token) and int64
        permutation map of the ``k T`` copies (allgather and alltoall alike)."""
        m = self.model
        k, E = m.moe_topk, m.num_experts
        # sqrtsoftplus (megatron-core 0.19) also scores every expert and normalises the
        # top-k: counted as sigmoid, plus the softplus output its sqrt keeps
        per_expert = {"sigmoid": 1, "sqrtsoftplus": 2}.get(m.moe_score_function, 0)
        sigmoid = per_expert > 0
        out = tokens * k * (8 + FP32)
        if sigmoid:
            out += per_expert * tokens * E * FP32 + (tokens * FP32 if k > 1 else 0)
        if m.moe_aux_loss:
            out += tokens * (E * FP32 + 8 * k + (FP32 if sigmoid else 0)) + E * FP32
        if m.moe_z_loss:
            out += tokens * (E + 1) * FP32 + FP32
        return out + tokens * E * (1 + FP32) + tokens * k * 8

    def moe_bytes(self, tokens: float) -> float:
        """An MoE layer's MLP for ``tokens`` tokens: the router's and dispatcher's
        bookkeeping (``router_bytes``); per dispatched copy (``k T`` of them) the expert's
        input and its fp32 probability, which the expert applies inside its MLP
        (megatron-core's ``per_token_scale``): the MLP keeps its activation output before
        the scaling besides the usual terms, and the expert output is not kept; and the
        shared expert's MLP. ``tokens`` are the unit's tokens (all of them with SP too:
        the dispatcher gathers the sequence-parallel shards); each expert's FFN is split
        over TP. With --moe-apply-probs-on-input the experts' scaled inputs are kept too
        (fc1's input) and the activation output is not; a gated shared expert keeps its
        output and gate for the product."""
        m, t, e = self.model, self.par.expert_tp, self.act_bytes
        h, k = m.hidden_size, m.moe_topk
        per_act = m.mlp_saved_widths
        routed = k * tokens * self.par.expert_token_share  # expert copies on this rank
        dispatched = routed * (h * e + FP32)
        experts = routed * m.expert_ffn / t * e * (per_act + 1)
        if m.moe_probs_on_input:
            # the scaled copy of the input (fc1's) and the ones that replace the
            # probabilities are kept; a product with those ones (no gradient) keeps
            # only them, not the activation output
            dispatched += routed * (h * e + FP32)
            experts -= routed * m.expert_ffn / t * e
        # a recomputed shared expert (its gate too) keeps its input: the norm's output
        shared = 0.0
        if not self.recompute.recomputes("shared_experts"):
            shared = self.shared_expert_bytes(tokens)
            if m.moe_shared_gated():  # its output and the sigmoid gate, this rank's shard
                shared += tokens / self.par.tp_sp * (h + 1) * e
        return self.router_bytes(tokens) + dispatched + experts + shared

    def shared_expert_bytes(self, tokens: float) -> float:
        """The shared expert's MLP (a dense MLP of the shared FFN size, split over TP)."""
        m = self.model
        width = m.moe_shared_ffn_hidden_size / self.par.tp
        return tokens * width * self.act_bytes * m.mlp_saved_widths

    def dropout_bytes(self, tokens: float) -> float:
        """The two hidden-dropout masks of a layer."""
        if not self.model.hidden_dropout:
            return 0.0
        return 2 * tokens * self.model.hidden_size * self.mask_bytes() / self.par.tp_sp

    def layer_bytes(self, split: int, layer: int = 0) -> float:
        """Activation bytes layer ``layer`` keeps for split ``split``, no full recomputation."""
        tokens = self.unit_tokens(split)
        if self.model.is_moe_layer(layer):
            mlp = 0.0 if self._moe_recomputed() else self.moe_bytes(tokens)
        else:  # a recomputed MLP keeps its input: the norm's output
            mlp = 0.0 if self.recompute.recomputes("mlp") else self.mlp_bytes(tokens)
        return (2 * self.layer_norm_bytes(tokens) + self.attention_bytes(split, layer)
                + mlp + self.dropout_bytes(tokens))

    def chunk_layer_bytes(self, split: int, rank: int = 0, chunk: int = 0) -> List[float]:
        """``layer_bytes`` of each layer of virtual stage ``chunk`` on ``rank``."""
        return [self.layer_bytes(split, layer) for layer in self.layer_indices(rank, chunk)]

    def full_layer_bytes(self, tokens: float, layer: int = 0) -> float:
        """Activation bytes of one layer for ``tokens`` tokens of an unsplit sequence."""
        split = CostModel(self.model, self.par, self.gpu, self.seq_length,
                          [tokens / self.par.micro_batch_size], Recompute(), self.kv_layout,
                          self.act_bytes)
        return split.layer_bytes(0, layer)

    def layer_input_bytes(self, tokens: float) -> float:
        return tokens * self.act_bytes * self.model.hidden_size / self.par.tp_sp

    def _checkpoint_bytes(self, split: int, groups: int) -> float:
        """Full recomputation: each checkpointed group keeps its input."""
        tokens = self.unit_tokens(split)
        return groups * self.layer_input_bytes(tokens)

    def rope_frequency_bytes(self, split: int) -> float:
        """With full recomputation the checkpoints also keep RoPE's fp32 ``[l, 1, 1, d]``
        frequencies, one tensor per split position that megatron-core's rotary module
        caches and hands to every microbatch: held from the first microbatch's forward
        to the last one's backward."""
        if self.recompute.granularity != "full" or not self.model.rotary:
            return 0.0
        if self.model.multi_latent_attention:  # MLA ropes inside the recomputed layer
            return 0.0
        return self.part_length(split) * self.model.head_dim * FP32

    def stored_layer_bytes(self, split: int, rank: int = 0, chunk: int = 0) -> float:
        """Activation bytes kept for backward by the layers of one chunk (recompute applied)."""
        n, rc = self.chunk_layers(rank, chunk), self.recompute
        per_layer = self.chunk_layer_bytes(split, rank, chunk)
        if rc.granularity == "full" and n:  # (a layout's stage may hold no layer)
            k = min(rc.num_layers, n)
            if rc.method == "uniform":
                return self._checkpoint_bytes(split, math.ceil(n / k))
            return self._checkpoint_bytes(split, k) + sum(per_layer[k:])
        return sum(per_layer)

    def _moe_recomputed(self) -> bool:
        return self.recompute.recomputes("moe")

    def recomputed_flops_per_token(self, layer: int) -> float:
        """Linear-layer FLOPs per token that selective recomputation runs again in the
        backward of layer ``layer``: a recomputed MoE layer (router, active experts,
        shared expert), dense MLP, shared expert, MLA up-projections."""
        m, rc = self.model, self.recompute
        params = 0
        if m.is_moe_layer(layer):
            if rc.moe_layers:
                params += m.mlp_linear_params(layer, active=True)
            elif rc.recomputes("shared_experts"):
                params += m.shared_expert_params()
        elif rc.recomputes("mlp"):
            params += m.mlp_linear_params(layer)
        if m.multi_latent_attention and rc.recomputes("mla_up_proj"):
            params += m.mla_up_projection_params()
        return 2 * params

    def recompute_transient_bytes(self, split: int, rank: int = 0, chunk: int = 0) -> float:
        """Activations rebuilt during a backward with full recomputation; with selective
        recomputation the largest module rebuilt at a time (an MoE layer, a dense MLP, a
        shared expert; the up-projection's query and key and the norms' outputs are
        smaller)."""
        rc, n = self.recompute, self.chunk_layers(rank, chunk)
        if rc.granularity == "selective":
            tokens = self.unit_tokens(split)
            layers = self.layer_indices(rank, chunk)
            moe = any(map(self.model.is_moe_layer, layers))
            dense = not all(map(self.model.is_moe_layer, layers))
            rebuilt = [self.moe_bytes(tokens) if moe and rc.moe_layers else 0.0,
                       self.mlp_bytes(tokens) if dense and rc.recomputes("mlp") else 0.0,
                       self.shared_expert_bytes(tokens)
                       if moe and rc.recomputes("shared_experts") else 0.0]
            return max(rebuilt)
        if rc.granularity != "full" or not n:
            return 0.0
        k = min(rc.num_layers, n)
        largest = max(self.chunk_layer_bytes(split, rank, chunk))
        return (k if rc.method == "uniform" else 1) * largest

    def edge_bytes(self, rank: int, chunk: int, tokens: float) -> float:
        """The embedding's (first stage) and the loss's (last stage) saved tensors."""
        h, extra = self.model.hidden_size, 0.0
        if self.is_first(rank, chunk):
            ids = 2 if self.model.position_embedding_type == "learned_absolute" else 1
            extra += tokens * 8 * ids  # int64 token (and position) ids
            if self.par.tp > 1:
                extra += tokens  # the vocab-parallel embedding's bool mask
            if self.model.hidden_dropout:
                extra += tokens * h * self.mask_bytes() / self.par.tp_sp
        if self.is_last(rank, chunk):
            extra += self.loss_bytes(tokens)
        return extra

    def document_mask_bytes(self, split: int) -> float:
        """Packed documents on CPU: SDPA takes an explicit additive mask in the activation
        dtype, built once per split and kept by every layer's kernel of the stage
        (megatron/seqsplit/attention_backends.py). A split without dropout keeps its own
        block's ``l x l`` mask (its prefix runs unmasked); otherwise the mask spans the
        keys from the first document a query is in, at most the prefix and the split
        (unsplit: all of them, exactly). A recomputed kernel (selective or full) keeps
        none. Not counted on GPU, where flash-attn's varlen path and FlexAttention keep no
        dense mask (SDPA's fallback, with dropout and without flash-attn, would)."""
        if not (self.packed_documents and self.on_cpu) or self.recompute.attention_kernel:
            return 0.0
        if self.num_splits > 1 and self.kv_layout == "chunked":
            return 0.0  # the chunked kernel saves the document ids, not a mask
        if self.offsets[split] > 0 and not self.model.attention_dropout:  # own block only
            l = self.split_lengths[split]
            return self.par.micro_batch_size * l * l * self.act_bytes
        return self.sdpa_document_bias_bytes(split)

    def window_mask_bytes(self, split: int, rank: int, chunk: int) -> float:
        """Sliding windows on CPU: SDPA's banded mask over the keys from the earliest
        query's window, ``l x min(offset + l, l + W)`` (bool; with attention sinks in the
        activation dtype), kept by the kernels of the chunk's windowed layers. The kernels
        share one mask per split shape, across layers and microbatches, so one per unit in
        flight is an upper bound (probe: +1.6% of a stage at the window_sinks_s2 shape).
        None with the chunked cache's kernel (it masks block by block) or a recomputed
        kernel; on GPU flash-attn and FlexAttention keep none."""
        m = self.model
        if not (m.window_layers and self.on_cpu) or self.recompute.attention_kernel:
            return 0.0
        if self.num_splits > 1 and self.kv_layout == "chunked":
            return 0.0
        if not any(m.window_layers[i] for i in self.layer_indices(rank, chunk)):
            return 0.0
        l, offset = self.part_length(split), self.query_offset(split)
        element = self.act_bytes if m.attention_sinks else 1
        return l * min(offset + l, l + m.window) * element

    def sdpa_document_bias_bytes(self, split: int) -> float:
        """SDPA's additive document mask of one split at its largest (one document over
        the prefix and the split): ``b x l x (offset + l)`` in the activation dtype."""
        b, l, offset = self.par.micro_batch_size, self.split_lengths[split], self.offsets[split]
        return b * l * (l + offset) * self.act_bytes

    def activation_bytes(self, rank: int, unit: Unit) -> float:
        """Bytes a forward unit stores for its backward."""
        tokens = self.unit_tokens(unit.split)
        mask = self.document_mask_bytes(unit.split) if self.chunk_layers(rank, unit.chunk) else 0.0
        mask += self.window_mask_bytes(unit.split, rank, unit.chunk)
        mtp = self.mtp_bytes(unit.split) if self.is_last(rank, unit.chunk) else 0.0
        return (self.stored_layer_bytes(unit.split, rank, unit.chunk)
                + self.edge_bytes(rank, unit.chunk, tokens) + mask + mtp)

    def loss_bytes(self, tokens: float) -> float:
        """The final norm's (its output is the head's input) and ``head_bytes``."""
        return self.norm_bytes(tokens) + self.head_bytes(tokens)

    def head_bytes(self, tokens: float) -> float:
        """The output head's and the loss's saved tensors: the fp32 softmax of the logits,
        the target mask, the masked targets and the loss mask."""
        return tokens * FP32 * self.vocab / self.par.tp + tokens * (1 + 8 + FP32)

    def mtp_bytes(self, split: int) -> float:
        """What the MTP depths (last stage) keep for split ``split``: per depth the shifted
        token ids of the embedding, the embedding's and the hidden state's norms (their
        outputs joined: the projection's saved input), the copy of the last layer, the
        final norm, the output head and the loss, and the loss mask product's fp32
        operands. Under full recomputation megatron-core checkpoints the projection, the
        layer and the final norm: their two inputs and the head's input stay."""
        depths = self.model.mtp_num_layers
        if not depths:
            return 0.0
        tokens = self.unit_tokens(split)
        ids = tokens * 8 + (tokens if self.par.tp > 1 else 0.0)
        if self.model.hidden_dropout:  # the embedding's dropout mask
            ids += tokens * self.model.hidden_size * self.mask_bytes() / self.par.tp_sp
        if self.recompute.granularity == "full":  # two checkpoint inputs, the head's input
            body = 3 * self.layer_input_bytes(tokens) + self.head_bytes(tokens)
        else:
            body = (2 * self.norm_bytes(tokens)
                    + self.layer_bytes(split, self.model.num_layers - 1)
                    + self.loss_bytes(tokens))
        return depths * (ids + body + tokens * 2 * FP32)

    # -------------------------------------------------------------------- KV cache
    def kv_bytes_per_token(self) -> float:
        """K and V of one token, one layer, one GPU, in the activation dtype (micro-batch
        included)."""
        m = self.model
        return self.act_bytes * self.par.micro_batch_size * m.kv_values_per_token() / self.par.tp

    def memory_effect(self, rank: int, unit: Unit) -> MemoryEffect:
        """What ``unit`` allocates and frees on ``rank`` (for the simulator)."""
        s, j = self.num_splits, unit.split
        act = self.activation_bytes(rank, unit)
        n = self.chunk_layers(rank, unit.chunk)
        if self.is_last(rank, unit.chunk):  # the MTP depths' layers cache K/V too
            n += self.model.mtp_num_layers
        kv_tok = self.kv_bytes_per_token() * n
        at_start: Dict[str, float] = {}
        at_end: Dict[str, float] = {}
        transient: Dict[str, float] = {}
        freqs = self.rope_frequency_bytes(j)
        if unit.kind == FORWARD:
            at_start["activations"] = act + (freqs if unit.microbatch == 0 else 0.0)
            if self.cached:
                if self.kv_layout in ("buffer", "chunked"):  # this split's own K/V
                    at_start["kv_cache"] = kv_tok * self.split_lengths[j]
                    # growing a layer's buffer copies its prefix: old and new storage
                    # live together, one layer at a time; with context parallelism
                    # beside the split's gathered K/V (its copy goes into the buffer)
                    held = self.offsets[j] if self.kv_layout == "buffer" else 0
                    held += self.split_lengths[j] if self.par.cp > 1 else 0
                    if held:
                        transient["kv_cache"] = self.kv_bytes_per_token() * held
                elif self.recompute.granularity == "full":
                    at_start["kv_cache"] = kv_tok * self.split_lengths[j]
                else:  # concat: this split saves its own copy of the prefix K/V
                    at_start["kv_cache"] = kv_tok * self.offsets[j]
        else:
            last = unit.microbatch == self.par.num_microbatches - 1
            at_end["activations"] = -act - (freqs if last else 0.0)
            rebuilt = self.recompute_transient_bytes(j, rank, unit.chunk)
            if rebuilt:
                transient["activations"] = rebuilt
            if self.cached:
                if self.kv_layout == "buffer":
                    # fp32 prefix-gradient accumulator over the last split's prefix, from
                    # the last split's backward to the first split's backward
                    acc = kv_tok * self.offsets[s - 1] * max(FP32, self.act_bytes) / self.act_bytes
                    if j == s - 1:
                        at_start["kv_cache"] = acc
                    if j == 0:
                        at_end["kv_cache"] = -acc - kv_tok * self.seq_length
                elif self.kv_layout == "chunked":
                    # after split j's backward the gradients of chunks < j wait for their
                    # own splits (in the K/V dtype); split 0's frees every chunk
                    waiting_after = kv_tok * self.offsets[j]
                    waiting_before = kv_tok * self.offsets[j + 1] if j < s - 1 else 0.0
                    delta = waiting_after - waiting_before
                    if j == 0:
                        delta -= kv_tok * self.seq_length
                    at_end["kv_cache"] = delta
                else:
                    acc = kv_tok * self.offsets[s - 1]
                    own = (
                        self.split_lengths[j]
                        if self.recompute.granularity == "full"
                        else self.offsets[j]
                    )
                    delta = -kv_tok * own
                    if j == s - 1:
                        at_start["kv_cache"] = acc
                    if j == 0:
                        delta -= acc
                    at_end["kv_cache"] = delta
        return MemoryEffect(at_start, at_end, transient)

    # ----------------------------------------------------------------------- FLOPs
    def unit_flops(self, rank: int, unit: Unit) -> Dict[str, float]:
        """Forward FLOPs of a unit on one GPU: GEMMs and causal attention
        (``ModelShape.forward_flops_parts`` of its layers, over the micro-batch and TP)."""
        gemm, attn = self.shape.forward_flops_parts(
            self.part_length(unit.split), self.query_offset(unit.split),
            layers=self.chunk_layers(rank, unit.chunk), lm_head=self.is_last(rank, unit.chunk),
            first_layer=self.layer_indices(rank, unit.chunk).start)
        share = self.par.micro_batch_size / self.par.tp
        return {"gemm": gemm * share, "attention": attn * share}

    # ------------------------------------------------------------------------ time
    def _tp_comm_time(self, tokens: float) -> float:
        """Tensor-parallel traffic of one layer's forward (the backward moves the same).

        Without SP: two all-reduces of the ``[l, b, h]`` activation; with SP: two
        all-gathers and two reduce-scatters. Both move ``4 (t - 1) / t`` activations.
        """
        t = self.par.tp
        if t == 1:
            return 0.0
        bw = self.gpu.nvlink_bw if t <= self.gpu.gpus_per_node else self.gpu.network_bw
        size = tokens * BF16 * self.model.hidden_size
        count = 4 if self.par.sequence_parallel else 2
        return 4 * (t - 1) / t * size / bw + count * self.gpu.collective_latency_s

    def _cp_comm_time(self, split: int) -> float:
        """Context-parallel traffic of one layer's forward: the split's K and V
        all-gathered over the CP ranks, each receiving ``(C - 1) / C`` of them (the
        backward reduce-scatters their gradients: as much)."""
        cp = self.par.cp
        if cp == 1:
            return 0.0
        m = self.model
        size = (self.par.micro_batch_size * self.split_lengths[split] * BF16
                * 2 * m.num_query_groups * m.head_dim / self.par.tp)
        inside = self.par.tp * cp <= self.gpu.gpus_per_node  # order tp-cp-...
        bw = self.gpu.nvlink_bw if inside else self.gpu.network_bw
        return (cp - 1) / cp * size / bw + 2 * self.gpu.collective_latency_s

    def moe_comm_bytes(self, tokens: float) -> float:
        """Bytes one GPU sends and receives for one MoE layer's forward (dispatch and
        combine; the backward moves as much). alltoall: each of the ``k`` copies of a
        token goes to the rank of its expert, ``(EP - 1) / EP`` of them to another rank,
        and comes back. allgather: the tokens of the EP x TP group are gathered and the
        combined output reduce-scattered, ``(n - 1)`` times this rank's tokens each way.
        On one rank (EP = TP = 1) nothing moves."""
        m, ep, t = self.model, self.par.ep, self.par.expert_tp
        size = tokens * BF16 * m.hidden_size
        if self.par.moe_dispatcher == "alltoall":
            return 2 * m.moe_topk * size * self.par.expert_token_share * (ep - 1) / ep
        group = ep * t
        return 2 * size * (group - 1) / (self.par.tp if self.par.sequence_parallel else 1)

    def moe_comm_time(self, tokens: float) -> float:
        """``moe_comm_bytes`` over NVLink when the EP x TP group fits in a node, else
        over the network."""
        nbytes = self.moe_comm_bytes(tokens)
        if not nbytes:
            return 0.0
        inside = self.par.ep * self.par.expert_tp <= self.gpu.gpus_per_node
        bw = self.gpu.nvlink_bw if inside else self.gpu.network_bw
        return nbytes / bw + 2 * self.gpu.collective_latency_s

    def forward_time_parts(self, rank: int, unit: Unit) -> Dict[str, float]:
        g = self.gpu
        fl = self.unit_flops(rank, unit)
        tokens = self.unit_tokens(unit.split)
        n = self.chunk_layers(rank, unit.chunk)
        elementwise = 2 * sum(self.chunk_layer_bytes(unit.split, rank, unit.chunk))
        return {
            "gemm": fl["gemm"] / (g.peak_bf16_flops * g.gemm_efficiency),
            "attention": fl["attention"] / (g.peak_bf16_flops * g.attention_efficiency),
            "elementwise": elementwise / (g.hbm_bw * g.hbm_efficiency),
            "tp_comm": n * self._tp_comm_time(tokens),
            "cp_comm": n * self._cp_comm_time(unit.split),
            "moe_comm": sum(self.model.is_moe_layer(layer)
                            for layer in self.layer_indices(rank, unit.chunk))
                        * self.moe_comm_time(tokens),
            "overhead": n * g.layer_overhead_s,
        }

    def unit_time(self, rank: int, unit: Unit) -> float:
        f = self.forward_time_parts(rank, unit)
        if unit.kind == FORWARD:
            return sum(f.values())
        backward = (
            2 * f["gemm"] + 2.5 * f["attention"] + 2 * f["elementwise"]
            + f["tp_comm"] + f["cp_comm"] + f["moe_comm"] + 2 * f["overhead"]
        )
        rc = self.recompute
        if rc.granularity == "selective":
            if rc.recomputes("core_attn"):
                backward += f["attention"]
            flops = (self.unit_tokens(unit.split) / self.par.tp
                     * sum(map(self.recomputed_flops_per_token,
                               self.layer_indices(rank, unit.chunk))))
            backward += flops / (self.gpu.peak_bf16_flops * self.gpu.gemm_efficiency)
        elif rc.granularity == "full" and (n := self.chunk_layers(rank, unit.chunk)):
            k = min(rc.num_layers, n)
            share = 1.0 if rc.method == "uniform" else k / n
            fwd_layers = sum(f.values())
            if self.is_last(rank, unit.chunk):  # the LM head is not recomputed
                lm = self.unit_tokens(unit.split) / self.par.tp
                lm *= self.shape.lm_head_flops_per_token()
                fwd_layers -= lm / (self.gpu.peak_bf16_flops * self.gpu.gemm_efficiency)
            backward += share * fwd_layers
        return backward

    def pipeline_link_bw(self, src: int, dst: int) -> float:
        """Bandwidth between the GPUs of two pipeline ranks (same TP and DP index)."""
        stride = self.par.tp * self.par.cp * self.par.dp  # megatron order tp-cp-dp-pp
        per_node = self.gpu.gpus_per_node
        same_node = (src * stride) // per_node == (dst * stride) // per_node
        return self.gpu.nvlink_bw if same_node else self.gpu.network_bw

    def p2p_time(self, src: int, dst: int, unit: Unit) -> float:
        """Activation (or its gradient) of one unit between two pipeline ranks."""
        tokens = self.unit_tokens(unit.split)
        size = tokens * BF16 * self.model.hidden_size / self.par.tp_sp
        return size / self.pipeline_link_bw(src, dst) + self.gpu.p2p_latency_s

    # ------------------------------------------- SlimPipe attention redistribution
    def moved_attention_share(self, unit: Unit, num_chunks: int) -> float:
        """Share of ``unit``'s causal (query, key) pairs in its first ``num_chunks``
        prefix chunks: ``k l^2 / (l o + l (l + 1) / 2)`` for uniform slices of length l."""
        l, o = self.split_lengths[unit.split], self.offsets[unit.split]
        return num_chunks * l * l / ModelShape.causal_pairs(l, o)

    def moved_attention_time(self, rank: int, unit: Unit, num_chunks: int) -> float:
        """Attention time of ``unit`` that moves to the helper with ``num_chunks``
        prefix chunks: that share of its forward attention, 2.5x for a backward
        (the attention factor of ``unit_time``). Recomputation of the attention
        (selective or full) is assumed to stay on the asker, so it does not move."""
        attention = self.forward_time_parts(rank, unit)["attention"]
        if unit.kind != FORWARD:
            attention *= 2.5
        return attention * self.moved_attention_share(unit, num_chunks)

    def balance_exchange_cost(self) -> float:
        """``SliceCosts.exchange`` for this layout: sending one slice's K/V (one layer)
        over the slowest link between pipeline ranks, relative to that slice's forward
        attention against one full key slice (one layer)."""
        m, t = self.model, self.par.tp
        tokens = self.par.micro_batch_size * self.split_lengths[0]
        kv_bytes = tokens * BF16 * 2 * m.num_query_groups * m.head_dim / t
        bw = min(self.pipeline_link_bw(a, b) for a in range(self.par.pp)
                 for b in range(self.par.pp) if a != b)
        # split 0's forward attention is its causal block: l (l + 1) / 2 of a chunk's
        # l^2 (query, key) pairs, per layer
        l = self.split_lengths[0]
        first = self.forward_time_parts(0, Unit(FORWARD, 0, 0))["attention"]
        chunk = first * l * l / ModelShape.causal_pairs(l) / self.chunk_layers(0)
        return (kv_bytes / bw + self.gpu.p2p_latency_s) / chunk

    def exchange_time(self, asker_rank: int, helper_rank: int, unit: Unit,
                      num_chunks: int) -> float:
        """Communication of one pair (``unit`` is the asker's) over all layers of a chunk.

        Per layer, one message each way between the two ranks' GPUs of the same TP
        index (heads are TP-sharded): forward sends the query slice and ``k`` K/V
        chunks and gets the partial output (bf16) and its log-sum-exp (fp32) back;
        backward also sends the output gradient, the log-sum-exp and the row sums
        ``rowsum(dO * O)`` (fp32) and gets the query gradient and the ``k`` K/V
        chunk gradients back. No overlap with computation is assumed (the partners
        wait for each layer's reply), so this is added to the pair's time.
        """
        m, t = self.model, self.par.tp
        tokens = self.par.micro_batch_size * self.split_lengths[unit.split]
        q = tokens * BF16 * m.num_attention_heads * m.head_dim / t  # Q, O, dO, dQ alike
        rows = tokens * FP32 * m.num_attention_heads / t  # LSE or rowsum(dO * O)
        kv = num_chunks * tokens * BF16 * 2 * m.num_query_groups * m.head_dim / t
        if unit.kind == FORWARD:
            there, back = q + kv, q + rows
        else:
            there, back = 2 * q + kv + 2 * rows, q + kv
        bw = self.pipeline_link_bw(asker_rank, helper_rank)
        per_layer = (there + back) / bw + 2 * self.gpu.p2p_latency_s
        return self.chunk_layers(asker_rank, unit.chunk) * per_layer

    def grad_sync_time(self, rank: int) -> float:
        """Data-parallel gradient reduction (and parameter all-gather), not overlapped:
        over the data- and context-parallel ranks."""
        dp = self.par.dp_cp
        if dp == 1:
            return 0.0
        params = self.rank_params(rank)
        inside = self.par.tp * dp <= self.gpu.gpus_per_node
        bw = self.gpu.nvlink_bw if inside else self.gpu.network_bw
        if self.par.distributed_optimizer:
            size = (GRAD_BYTES + WEIGHT_BYTES) * params  # reduce-scatter + all-gather
        else:
            size = 2 * GRAD_BYTES * params  # all-reduce
        return (dp - 1) / dp * size / bw + 2 * self.gpu.collective_latency_s

    def optimizer_time(self, rank: int) -> float:
        """The optimizer step: memory bound over the parameters this GPU owns."""
        params = self.rank_params(rank)
        owned = params / (self.par.dp_cp if self.par.distributed_optimizer else 1)
        # Adam (2 states): read/write master, m, v, read the gradient = 30 bytes; then
        # zero the gradients
        per_owned = 14 + 8 * self.par.optimizer_states
        touched = per_owned * owned + GRAD_BYTES * params
        return touched / (self.gpu.hbm_bw * self.gpu.hbm_efficiency)

