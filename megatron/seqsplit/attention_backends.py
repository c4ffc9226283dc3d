"""Causal attention kernels for sequence splits: queries are the LAST `lq` of `lk` keys.

Interface (one call per split and layer):
    backend(q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None, window=None,
            sink=None) -> out
    q [b, hq, lq, d]; k, v [b, g, lk, d] with lk >= lq and hq % g == 0 (GQA/MQA);
    the causal mask is aligned to the bottom right: query i sees keys 0 .. lk - lq + i.
    document_ids [b, lk] (packed documents, non-decreasing per row): the document of
    every key; query i then sees only keys of its own document.
    window (sliding-window attention, megatron-core's ``window_size[0]``): query i sees
    only the keys lk - lq + i - window .. lk - lq + i (window + 1 keys).
    sink [hq] (attention sinks, megatron-core's ``softmax_offset``): a logit per head
    joined to every query's softmax, with no value ("sdpa" on CPU, no dropout; on CUDA
    the chunked KV cache's kernel has them, `kv_chunks`).
    out [b, hq, lq, d].

Backends: "sdpa" (always), "flash" (flash-attn >= 2.1, CUDA fp16/bf16; documents via
its variable-length API) and "flex" (FlexAttention, compiled on CUDA; on CPU an eager,
unfused reference). The backend is picked once, at model build time, with `get_backend`;
"auto" is a backend that routes each call by its device, dtype, head dim, grouped K/V
and documents (`auto_backend_name`), which the model build does not know all of.

On CUDA no route keeps an lq x lk tensor per layer: SDPA's math kernel (an fp32
probability tensor per layer, saved for backward) is the fallback of PyTorch's
dispatcher that every route here avoids (`sdpa_expands_kv_heads`).
"""

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.seqsplit.cpu_split_attention import (
    masked_attention_cpu,
    prefix_visibility,
    split_causal_attention_cpu,
    split_document_attention_cpu,
)
from megatron.seqsplit.documents import (
    PerSplitMemo,
    document_attention_bias,
    document_mask_mod,
    first_visible_key,
    varlen_document_layout,
)

from megatron.seqsplit.names import BACKEND_NAMES  # noqa: E402,F401 - re-exported
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256  # flash-attn 2's and PyTorch's CUDA flash kernels


@dataclass(frozen=True)
class AttentionCall:
    """What the choice of kernel depends on, for one call (a split and a layer)."""

    device_type: str  # "cuda" or "cpu"
    dtype: torch.dtype
    head_dim: int
    grouped: bool  # fewer K/V heads than query heads (GQA/MQA)
    documents: bool  # packed documents: a per-document mask
    dropout: bool = False
    window: bool = False  # sliding-window attention: a banded mask

    @classmethod
    def of(cls, q, k, document_ids=None, dropout_p=0.0, window=None):
        return cls(q.device.type, q.dtype, q.shape[-1], q.shape[1] != k.shape[1],
                   document_ids is not None, dropout_p > 0.0, window is not None)


FLASH_WINDOW_VERSION = (2, 3)  # flash-attn's window_size argument


def flash_attn_runs(call: AttentionCall, flash_version) -> bool:
    """Whether flash-attn (installed ``flash_version``, None: absent) runs ``call``."""
    needed = FLASH_WINDOW_VERSION if call.window else (2, 1)
    return (call.device_type == "cuda" and call.dtype in HALF_DTYPES
            and call.head_dim <= FLASH_MAX_HEAD_DIM
            and flash_version is not None and flash_version >= needed)


def auto_backend_name(call: AttentionCall, flash_version, flex_available: bool) -> str:
    """The backend "auto" runs ``call`` on.

    CPU: sdpa (its fused CPU kernel reads grouped K/V under any mask). CUDA: flash-attn
    whenever it runs (packed documents through its varlen API); else, for packed
    documents, compiled FlexAttention (a block mask per split; no dropout); else sdpa,
    which keeps off its math kernel by expanding grouped K/V heads where needed
    (`sdpa_expands_kv_heads`, with a warning)."""
    if call.device_type != "cuda":
        return "sdpa"
    if flash_attn_runs(call, flash_version):
        return "flash"
    if (call.documents or call.window) and flex_available and not call.dropout:
        return "flex"
    return "sdpa"


def sdpa_expands_kv_heads(call: AttentionCall) -> bool:
    """Whether SDPA gets K/V expanded to the query heads, to keep CUDA off its math kernel.

    Among PyTorch's CUDA kernels only flash reads grouped K/V, and it runs for fp16/bf16
    with head dim <= 256 and no explicit mask (packed documents have one). Otherwise the
    memory-efficient kernel would run (fp32, any head dim, masks, bottom-right causal)
    but refuses grouped K/V, and the dispatcher falls to the math kernel: fp32 copies,
    expanded heads anyway and an fp32 [b, hq, lq, lk] probability tensor saved per
    layer. Expanded K/V cost hq/g times the K/V of the visible keys per layer instead.
    On CPU the fused kernel reads grouped K/V under any mask: never needed."""
    if call.device_type != "cuda" or not call.grouped:
        return False
    return (call.documents or call.window or call.dtype not in HALF_DTYPES
            or call.head_dim > FLASH_MAX_HEAD_DIM)


_EXPANSION_WARNED = set()


def _expanded_kv_heads(call: AttentionCall, k, v, query_heads: int):
    """K/V with one head per query head (a copy), and a one-line warning once per kind."""
    if call not in _EXPANSION_WARNED:
        _EXPANSION_WARNED.add(call)
        why = ("packed documents (an explicit mask)" if call.documents else
               "a sliding window (an explicit mask)" if call.window else
               f"{str(call.dtype).replace('torch.', '')}, head dim {call.head_dim}")
        warnings.warn(
            f"attention: SDPA on CUDA has no fused kernel for grouped K/V with {why}; K/V "
            f"heads are expanded {query_heads // k.shape[1]}x per layer (flash-attn >= 2.1 "
            "with bf16/fp16 and head dim <= 256 avoids this)", stacklevel=3)
    r = query_heads // k.shape[1]
    return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)


class AttentionBackend:
    """Bottom-right causal attention over a key prefix; subclasses implement `__call__`."""

    name = "base"
    supports_dropout = True

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None,
                 window=None, sink=None):
        raise NotImplementedError

    def runs_split_kernel_cpu(self, call: "AttentionCall") -> bool:
        """Whether a split with a prefix and no packed documents runs
        `cpu_split_attention`'s two mask-free kernels (the buffer KV cache then fuses its
        own bookkeeping with them: `kv_cache._CachedSplitAttention`)."""
        return False

    def __repr__(self):
        return f"{type(self).__name__}()"


def variant_kwargs(window=None, sink=None) -> dict:
    """The ``window`` and ``sink`` keywords of a backend call, only those set: any
    attention callable serves plain causal attention without them."""
    return {name: value for name, value in (("window", window), ("sink", sink))
            if value is not None}


def _refuse_sink(sink, where):
    if sink is not None:
        raise ValueError(f"attention sinks (--softmax-type) are not supported {where} yet: "
                         "they run in the CPU kernels ('sdpa') and in the chunked KV cache's "
                         "kernel (--seq1f1b-kv-cache chunked)")


def _check_window(window, document_ids):
    if window is None:
        return
    if window < 0:
        raise ValueError(f"sliding window: need window >= 0 keys before the query, got {window}")
    if document_ids is not None:
        raise ValueError("sliding-window attention with packed documents is not supported")


def window_key_start(lq: int, lk: int, window) -> int:
    """The first key any of the last ``lq`` of ``lk`` queries sees in a window of
    ``window`` keys before each query (0 without a window)."""
    return 0 if window is None else max(0, lk - lq - window)


@functools.lru_cache(maxsize=16)
def window_mask(lq: int, lk: int, window: int, device) -> torch.Tensor:
    """[lq, lk] bool, True where query i (position lk - lq + i) sees key j: j in
    [i + lk - lq - window, i + lk - lq]. One tensor for every layer of a split shape (the
    kernels keep it for backward)."""
    rel = (torch.arange(lk, device=device)[None, :]
           - torch.arange(lq, device=device)[:, None] - (lk - lq))  # key - query position
    return (rel <= 0) & (rel >= -window)


@functools.lru_cache(maxsize=16)
def window_bias(lq: int, lk: int, window: int, device, dtype) -> torch.Tensor:
    """`window_mask` as an additive mask of ``dtype`` (0 or -inf), which the fused CPU
    kernel takes when called directly (attention sinks)."""
    visible = window_mask(lq, lk, window, device)
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
        ~visible, float("-inf"))


def _check_shapes(q, k, v, document_ids=None):
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"expected q [b, hq, lq, d], k/v [b, g, lk, d]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] or q.shape[2] > k.shape[2]:
        raise ValueError(f"need hq % g == 0 and lq <= lk; got q {q.shape}, k {k.shape}")
    if document_ids is not None and tuple(document_ids.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"document_ids must be [b, lk] = [{k.shape[0]}, {k.shape[2]}], "
                         f"got {tuple(document_ids.shape)}")


class SDPABackend(AttentionBackend):
    """torch.nn.functional.scaled_dot_product_attention.

    `enable_gqa=True` lets the kernel read grouped K/V without expanding heads (the
    CPU flash kernel and the CUDA flash kernel do; the math fallback expands inside).
    For lq != lk on CUDA the mask is `causal_lower_right`, which torch maps onto the
    flash or memory-efficient kernels. On CPU torch would materialise it as an lq x lk
    float mask that its fused kernel saves for backward (4 MiB for 512 queries over
    2048 keys, per split and layer). Without dropout a CPU split runs as two mask-free
    kernels merged by log-sum-exp (`cpu_split_attention`); with dropout
    `_bottom_right_causal_cpu` passes a mask that costs lq + lk - 1 elements instead,
    where that saves memory (`_reversed_queries_save_memory`). Packed documents use an
    explicit additive mask over the keys from the first document a query is in, shared
    by the layers of a split (`_shared_document_bias`); on CPU without dropout a split
    keeps only its own block's mask (`split_document_attention_cpu`).
    """

    name = "sdpa"

    @staticmethod
    def _cpu_kernels(call: AttentionCall) -> bool:
        """A split (lq < lk) runs `cpu_split_attention`'s mask-free kernels."""
        return (call.device_type == "cpu" and not call.dropout and not call.window
                and not sdpa_expands_kv_heads(call))

    def runs_split_kernel_cpu(self, call: AttentionCall) -> bool:
        return self._cpu_kernels(call) and not call.documents

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None,
                 window=None, sink=None):
        _check_shapes(q, k, v, document_ids)
        _check_window(window, document_ids)
        lq, lk = q.shape[2], k.shape[2]
        call = AttentionCall.of(q, k, document_ids, dropout_p, window)
        cpu_kernels = self._cpu_kernels(call)
        if q.device.type != "cpu" or call.dropout:
            _refuse_sink(sink, "on CUDA or with attention dropout")
        if window is not None:
            # keys before the earliest query's window are invisible to all: views, no copy
            first_key = window_key_start(lq, lk, window)
            k, v = k[:, :, first_key:], v[:, :, first_key:]
            mask = (window_mask(lq, lk - first_key, window, q.device) if sink is None
                    else window_bias(lq, lk - first_key, window, q.device, q.dtype))
            causal = {"attn_mask": mask}
        elif document_ids is not None and lq < lk and cpu_kernels:
            return split_document_attention_cpu(
                q, k, v, softmax_scale, _shared_own_block_bias(document_ids, lq, q.dtype),
                _shared_prefix_rows(document_ids, lq), sink)
        elif document_ids is not None:
            bias = _shared_document_bias(document_ids, lq, q.dtype)
            first_key = lk - bias.shape[-1]  # keys before it are invisible to every query
            k, v = k[:, :, first_key:], v[:, :, first_key:]  # views: nothing copied
            causal = {"attn_mask": bias}
        elif lq == lk:
            causal = {"is_causal": True}
        elif cpu_kernels:
            return split_causal_attention_cpu(q, k, v, softmax_scale, sink)
        elif q.device.type == "cpu" and _reversed_queries_save_memory(q, k):
            return _bottom_right_causal_cpu(q, k, v, softmax_scale, dropout_p)
        else:
            # imported here: torch.nn.attention.bias imports torch._dynamo (~0.8 s of
            # every process's start-up), and only this path needs it
            from torch.nn.attention.bias import causal_lower_right
            causal = {"attn_mask": causal_lower_right(lq, lk)}
        if sink is not None:  # the fused CPU kernel and its LSE, with the sink joined
            return masked_attention_cpu(q, k, v, softmax_scale, sink, **causal)
        if sdpa_expands_kv_heads(call):
            k, v = _expanded_kv_heads(call, k, v, q.shape[1])
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1], **causal,
        )


# The split's first visible key costs a host sync: an int kept per split, also when the
# mask below is not (no autograd keeps it between layers).
_shared_first_key = PerSplitMemo(first_visible_key)
# The SDPA mask is kept for backward by every layer's kernel: one tensor for all of them.
_shared_document_bias = PerSplitMemo(
    lambda ids, lq, dtype: document_attention_bias(ids, lq, dtype,
                                                   _shared_first_key(ids, lq))[1], weak=True)
# CPU splits with documents (cpu_split_attention): the own block's mask, shared by the
# layers like the mask above, and which rows see which prefix keys (one host sync).
_shared_own_block_bias = PerSplitMemo(
    lambda ids, lq, dtype: document_attention_bias(ids[:, -lq:], lq, dtype, 0)[1], weak=True)
_shared_prefix_rows = PerSplitMemo(prefix_visibility)
# The varlen layout costs two host syncs; a few small integer tensors, kept until the
# next split's.
_shared_varlen_layout = PerSplitMemo(lambda ids, lq: varlen_document_layout(ids, lq))


def _reversed_queries_save_memory(q, k):
    """Whether `_bottom_right_causal_cpu` keeps fewer bytes than a materialised mask.

    It saves no lq x lk mask but one more output-sized tensor [b, lq, hq, d] when b == 1:
    the kernel's output (row-major [b, lq, hq, d]) is then already the [lq, b, hq, d]
    layout the caller hands to the output projection, which saves that very tensor,
    while the restored order is a copy. With b > 1 the caller copies either way.
    """
    b, hq, _, d = q.shape
    return b > 1 or k.shape[2] > hq * d


def _bottom_right_causal_cpu(q, k, v, softmax_scale, dropout_p):
    """SDPA with a bottom-right causal mask whose saved copy is a vector, not a matrix.

    Query i may see key j when j <= lk - lq + i: the mask depends on j - i, which no
    view with non-negative strides can express. With the queries in reverse order
    (i' = lq - 1 - i) it depends on i' + j (visible when i' + j <= lk - 1), and that is
    a view with strides (1, 1) of one vector of lq + lk - 1 entries, which is what the
    fused CPU kernel then keeps for backward. Attention treats every query row on its
    own, so reversing the rows of q and of the output gives the same result; the
    reversed query is saved instead of the query (same size), but the kernel then saves
    the reversed output and the caller the restored one (`_reversed_queries_save_memory`).
    """
    lq, lk = q.shape[2], k.shape[2]
    diagonals = torch.zeros(lq + lk - 1, dtype=q.dtype, device=q.device)
    diagonals[lk:] = float("-inf")
    mask = diagonals.as_strided((lq, lk), (1, 1))
    out = F.scaled_dot_product_attention(
        q.flip(2), k, v, attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.flip(2)


@functools.lru_cache(maxsize=None)
def _flash_attn_version():
    """Installed flash-attn version as a tuple, or None when it does not import."""
    try:
        version = importlib.import_module("flash_attn").__version__
    except Exception:  # not installed, or a broken build (missing CUDA symbols)
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


class FlashAttnBackend(AttentionBackend):
    """flash-attn's public API, CUDA fp16/bf16 only.

    flash-attn >= 2.1 aligns the causal mask to the bottom right when lq != lk and
    reads grouped K/V natively. It wants [b, l, h, d]; transposing our [b, h, l, d]
    keeps the last dimension contiguous, so no copy is made.

    Packed documents go through `flash_attn_varlen_func`: every (row, document) pair
    with queries in this split is one variable-length sequence whose queries are the
    last of its keys (`varlen_document_layout`), so `causal=True` (bottom-right per
    sequence) is the per-document causal mask. Keys of documents that ended before the
    split are left out. With micro-batch size 1 the keys are a view of the cache; with
    more rows each row's key range is packed into one copy per split and layer (and
    that copy is what the kernel saves for backward).

    `kernels=(flash_attn_func, flash_attn_varlen_func)` replaces flash-attn's kernels
    (tests run the varlen path on CPU in float64 with an emulated kernel); by default
    they are imported and need CUDA fp16/bf16 tensors.
    """

    name = "flash"

    def __init__(self, kernels=None):
        self._needs_cuda = kernels is None
        if kernels is None:
            from flash_attn import flash_attn_func, flash_attn_varlen_func  # ImportError if missing

            kernels = (flash_attn_func, flash_attn_varlen_func)
        self._func, self._varlen_func = kernels

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None,
                 window=None, sink=None):
        _check_shapes(q, k, v, document_ids)
        _check_window(window, document_ids)
        _refuse_sink(sink, "by flash-attn 2")
        if self._needs_cuda and (
                q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)):
            raise ValueError(f"flash backend needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
        if document_ids is not None:
            return self._documents(q, k, v, document_ids, softmax_scale, dropout_p)
        # flash-attn >= 2.3 aligns its window to the bottom right, as its causal mask
        windowed = {} if window is None else {"window_size": (window, 0)}
        if window is not None and self._needs_cuda and (
                (_flash_attn_version() or (0,)) < FLASH_WINDOW_VERSION):
            raise ValueError("flash backend: sliding-window attention needs flash-attn >= 2.3; "
                             "use 'auto' or 'sdpa'")
        out = self._func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True, **windowed,
        )
        return out.transpose(1, 2)

    def _documents(self, q, k, v, document_ids, softmax_scale, dropout_p):
        b, hq, lq, d = q.shape
        layout = _shared_varlen_layout(document_ids, lq)
        q_packed = q.transpose(1, 2).reshape(b * lq, hq, d)  # [b, lq, hq, d], rows in order

        def pack(x):  # [b, g, lk, d] -> [sum of kept keys, g, d]
            rows = x.transpose(1, 2)
            parts = [rows[r, start:] for r, start in enumerate(layout.key_starts)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)  # one row: a view

        out = self._varlen_func(
            q_packed, pack(k), pack(v), layout.cu_seqlens_q, layout.cu_seqlens_k,
            layout.max_seqlen_q, layout.max_seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True,
        )
        return out.reshape(b, lq, hq, d).transpose(1, 2)


def _flex_attention_module():
    """torch.nn.attention.flex_attention, or None when this torch has none (< 2.5)."""
    try:
        return importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None


class FlexAttentionBackend(AttentionBackend):
    """torch.nn.attention.flex_attention with a block mask from a `mask_mod`.

    mask_mod: bottom-right causal, and same document when `document_ids` is given
    (`document_mask_mod`). Block masks skip fully masked key blocks, so a split's cost
    follows its documents, not its prefix.

    CUDA: `flex_attention` and `create_block_mask` under `torch.compile` (one compile per
    new split shape until dynamo marks the lengths dynamic); this path has not been run
    on a GPU yet. The block mask depends on the split alone, so the layers of a split
    share one (`_shared_block_mask`). CPU: torch's public `flex_attention` refuses CPU
    inputs that require grad (it has no compiled CPU backward) and re-traces eagerly
    for every new shape, so
    on CPU we call the higher-order op it dispatches to, whose eager autograd
    implementation is the unfused math one (it materialises the lq x lk scores). That is
    a float64 reference for tests, not a fast path. No dropout.
    """

    name = "flex"
    supports_dropout = False

    def __init__(self):
        module = _flex_attention_module()
        if module is None:
            raise ValueError("attention backend 'flex' needs torch >= 2.5 (FlexAttention)")
        self._module = module

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None,
                 window=None, sink=None):
        _check_shapes(q, k, v, document_ids)
        _check_window(window, document_ids)
        _refuse_sink(sink, "by the 'flex' backend")
        if dropout_p > 0.0:
            raise ValueError("attention backend 'flex' has no dropout: set --attention-dropout 0")
        block_mask = _shared_block_mask(self._module, document_ids, q.shape[2], k.shape[2],
                                        q.device, window)
        if q.device.type == "cuda":
            # Not run yet (no GPU where this was written)
            return _compiled_flex_attention(self._module)(
                q, k, v, block_mask=block_mask, scale=softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1])
        return self._eager(q, k, v, block_mask, softmax_scale)

    def _eager(self, q, k, v, block_mask, softmax_scale):
        # What the public function does once its checks pass, minus the CPU-backward
        # refusal and the dynamo trace; private torch API (checked on torch 2.13, guarded
        # by test_flex_cpu_path_equals_public_flex_attention).
        from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop

        options = self._module._apply_kernel_options(q, k, v, False, None)
        out, _, _ = flex_attention_hop(q, k, v, self._module._identity, block_mask.as_tuple(),
                                       softmax_scale, options)
        return out


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention(module):
    """torch.compile(flex_attention), made once for every layer (CUDA)."""
    return torch.compile(module.flex_attention)


def _causal_mask_mod(offset, window=None):
    def mask_mod(b, h, q_idx, kv_idx):  # bottom-right: query i is position offset + i
        return kv_idx <= q_idx + offset

    def window_mask_mod(b, h, q_idx, kv_idx):  # and at most `window` keys before it
        return (kv_idx <= q_idx + offset) & (kv_idx >= q_idx + offset - window)

    return mask_mod if window is None else window_mask_mod


def _make_block_mask(module, document_ids, lq, lk, device, window=None):
    """FlexAttention's block mask for one split (per row with documents)."""
    if document_ids is not None:
        mask_mod, batch = document_mask_mod(document_ids, lq), document_ids.shape[0]
    else:  # the same for every row
        mask_mod, batch = _causal_mask_mod(lk - lq, window), None
    compiled = {"_compile": True} if torch.device(device).type == "cuda" else {}
    return module.create_block_mask(mask_mod, batch, None, lq, lk, device=device, **compiled)


# Block masks, one per split for all its layers: with documents keyed on the split's id
# tensor (which every layer of a unit passes), without them on the lengths alone.
_document_block_mask = PerSplitMemo(
    lambda ids, module, lq, lk, device: _make_block_mask(module, ids, lq, lk, device))


@functools.lru_cache(maxsize=8)
def _causal_block_mask(module, lq, lk, device, window=None):
    return _make_block_mask(module, None, lq, lk, device, window)


def _shared_block_mask(module, document_ids, lq, lk, device, window=None):
    if document_ids is not None:
        return _document_block_mask(document_ids, module, lq, lk, device)
    return _causal_block_mask(module, lq, lk, device, window)


def _flash_usable(device, dtype):
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    version = _flash_attn_version()
    return version is not None and version >= (2, 1)


def available_backends(device, dtype) -> list[str]:
    """Names of the backends that can run on `device` with `dtype`, preferred first.

    "flex" comes last: on CPU it is an unfused reference, and "auto" never picks it.
    """
    flex = ["flex"] if _flex_attention_module() is not None else []
    return (["flash"] if _flash_usable(device, dtype) else []) + ["sdpa"] + flex


class AutoBackend(AttentionBackend):
    """Routes every call to the backend `auto_backend_name` picks for it.

    The route depends on the call's device, dtype, head dim, grouped K/V and whether it
    has packed documents, which the model build does not all know; it is a pure
    function of those, and the backends are made once per name and shared."""

    name = "auto"

    def __init__(self):
        self._backends = {}

    def backend_for(self, call: AttentionCall) -> AttentionBackend:
        name = auto_backend_name(call, _flash_attn_version(),
                                 _flex_attention_module() is not None)
        if name not in self._backends:
            self._backends[name] = _named_backend(name)
        return self._backends[name]

    def runs_split_kernel_cpu(self, call: AttentionCall) -> bool:
        return self.backend_for(call).runs_split_kernel_cpu(call)

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None,
                 window=None, sink=None):
        backend = self.backend_for(AttentionCall.of(q, k, document_ids, dropout_p, window))
        return backend(q, k, v, softmax_scale=softmax_scale, dropout_p=dropout_p,
                       document_ids=document_ids, window=window, sink=sink)


def get_backend(name: str, device=None, dtype=None) -> AttentionBackend:
    """Backend by name: "sdpa", "flash", "flex", or "auto" (`AutoBackend`: routed per
    call by `auto_backend_name`; on CPU that is always sdpa).

    ``device``/``dtype`` are accepted for callers that know them; "auto" decides from
    each call's tensors instead, so it never follows "CUDA if present"."""
    if name == "auto":
        return AutoBackend()
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; use one of auto, {', '.join(BACKEND_NAMES)}")
    return _named_backend(name)


def _named_backend(name: str) -> AttentionBackend:
    if name == "sdpa":
        return SDPABackend()
    if name == "flash":
        version = _flash_attn_version()
        if version is None or version < (2, 1):
            raise ValueError(
                "attention backend 'flash' needs flash-attn >= 2.1 (bottom-right causal "
                f"masks); found {version}. Use 'sdpa' or 'auto'."
            )
        return FlashAttnBackend()
    if name == "flex":
        return FlexAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; use one of auto, {', '.join(BACKEND_NAMES)}")
