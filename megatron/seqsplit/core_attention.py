"""Core attention for the local layer spec: causal attention that understands splits.

It replaces megatron-core's ``DotProductAttention`` in the layer spec. Unsplit
(``packed_seq_params`` is not a ``SplitContext``) it is plain causal attention; for a
split it attends over the microbatch's cached K/V prefix plus its own K/V, through
``megatron.seqsplit.kv_cache``. Both paths run the same kernel, so a split run and an
unsplit run differ only by floating-point summation order.
"""

import math
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    get_cuda_rng_tracker,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from megatron.seqsplit.attention_backends import get_backend
from megatron.seqsplit.kv_cache import KV_CACHE_LAYOUTS, split_causal_attention
from megatron.seqsplit.split_context import SplitContext


class SplitCausalAttention(MegatronModule):
    """Drop-in ``core_attention`` submodule (same constructor as ``DotProductAttention``;
    also MLA's, which adds ``k_channels``/``v_channels``: keys and values of different
    head sizes, kept at their own sizes in the KV caches)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend_name: str = "auto",
        kv_cache: str = "buffer",
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        mtp_layer: bool = False,
    ):
        super().__init__(config=config)
        if attention_type != "self" or attn_mask_type != AttnMaskType.causal:
            raise ValueError("SplitCausalAttention implements causal self-attention only")
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism is not supported by the local split attention")
        self.layer_number = layer_number
        # the K/V caches are keyed by layer: an MTP layer's own (megatron-core >= 0.17
        # numbers MTP layers from 1, as decoder layers that may sit on the same stage)
        self.cache_key = ("mtp", layer_number) if mtp_layer else layer_number
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # MLA passes its query-key head size (k_channels) and its value head size
        # (v_channels), which differ; the scale follows the query-key size
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        # chosen once, at build time ("auto" routes each call by its own tensors, so it
        # follows the run's device, not whether a GPU exists)
        self.backend = get_backend(backend_name)
        if kv_cache not in KV_CACHE_LAYOUTS:
            raise ValueError(f"unknown KV-cache layout {kv_cache!r}; use one of {KV_CACHE_LAYOUTS}")
        if kv_cache == "chunked" and self.dropout_p > 0.0:
            raise ValueError("the chunked KV cache has no attention dropout; set "
                             f"--attention-dropout 0 (got {self.dropout_p})")
        self.kv_cache = kv_cache
        self.tp_group = (pg_collection.tp if pg_collection is not None else
                         parallel_state.get_tensor_model_parallel_group(check_initialized=False))
        self._make_softmax_offset(config)
        self.window = layer_window(config, layer_number)
        if self.dropout_p > 0.0 and not self.backend.supports_dropout:
            raise ValueError(
                f"attention backend {self.backend.name!r} has no attention dropout; "
                f"set --attention-dropout 0 (got {self.dropout_p}) or pick another backend")

    def _make_softmax_offset(self, config):
        """Attention sinks as megatron-core's DotProductAttention makes them
        (``softmax_type``): off-by-one, a zero logit per head (not saved); learnable, a
        parameter per head of this TP rank, initialised with ``init_method``."""
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type == "vanilla":
            self.softmax_offset = None
            return
        if self.softmax_type not in ("off-by-one", "learnable"):
            raise ValueError(f"softmax_type {self.softmax_type!r}: use vanilla, off-by-one or "
                             "learnable")
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        heads = config.num_attention_heads // tp_size
        device = ("cpu" if config.use_cpu_initialization or not torch.cuda.is_available()
                  else torch.cuda.current_device())
        offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
        if self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", offset, persistent=False)
            return
        self.softmax_offset = torch.nn.Parameter(offset)
        # one entry per head of this rank: split by head across TP like QKV's rows (so the
        # grad norm counts every rank's, where megatron-core's counts TP rank 0's only)
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        if config.perform_initialization:
            config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The learnable sinks split by head across TP ranks (megatron-core's layout)."""
        state_dict = (self.state_dict(prefix="", keep_vars=True)
                      if self.softmax_type == "learnable" else {})
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SplitCausalAttention")
        split = packed_seq_params if isinstance(packed_seq_params, SplitContext) else None
        if split is not None:
            split.mark_consumed("attention")  # the executor checks it (split_context.CONSUMERS)
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(
            split=split,
            store=split.kv_store if split is not None else None,
            layer_key=self.cache_key,
            backend=self.backend,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout_p,
            kv_cache=self.kv_cache,
            window=self.window,
            sink=self.softmax_offset,
        )
        if dropout_p > 0.0:
            # heads are split across TP ranks: use the model-parallel RNG stream, as
            # megatron-core's DotProductAttention does
            with get_cuda_rng_tracker().fork():
                context = split_causal_attention(query, key, value, **kwargs)
        else:
            context = split_causal_attention(query, key, value, **kwargs)
        seq, batch, heads, head_dim = context.shape
        return context.reshape(seq, batch, heads * head_dim)


def layer_window(config, layer_number):
    """Keys a query sees before itself in this layer under sliding-window attention
    (``config.window_size[0]``), or None for full causal attention: megatron-core's rule
    (``window_attn_skip_freq`` makes some layers full). ``window_size[1]``, the keys after
    the query, must be 0: attention here is causal."""
    window_size = getattr(config, "window_size", None)
    if not window_size or not is_layer_window_attention(
            window_size, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    left, right = window_size
    if right != 0 or left < -1:
        raise ValueError(f"window_size {tuple(window_size)}: need (left, 0) for causal "
                         "attention, left >= 0 keys before each query (-1: unlimited)")
    return None if left == -1 else left
