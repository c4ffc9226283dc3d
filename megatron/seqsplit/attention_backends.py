"""Causal attention kernels for sequence splits: queries are the LAST `lq` of `lk` keys.

Interface (one call per split and layer):
    backend(q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None) -> out
    q [b, hq, lq, d]; k, v [b, g, lk, d] with lk >= lq and hq % g == 0 (GQA/MQA);
    the causal mask is aligned to the bottom right: query i sees keys 0 .. lk - lq + i.
    document_ids [b, lk] (packed documents, non-decreasing per row): the document of
    every key; query i then sees only keys of its own document.
    out [b, hq, lq, d].

Backends: "sdpa" (always), "flash" (flash-attn >= 2.1, CUDA fp16/bf16; documents via
its variable-length API) and "flex" (FlexAttention, compiled on CUDA; on CPU an eager,
unfused reference). The backend is picked once, at model build time, with `get_backend`.
"""

import importlib
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron.seqsplit.documents import (
    PerSplitMemo,
    document_attention_bias,
    document_mask_mod,
    varlen_document_layout,
)

BACKEND_NAMES = ("sdpa", "flash", "flex")


class AttentionBackend:
    """Bottom-right causal attention over a key prefix; subclasses implement `__call__`."""

    name = "base"
    supports_dropout = True

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None):
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


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
    2048 keys, per split and layer); `_bottom_right_causal_cpu` passes a mask that
    costs lq + lk - 1 elements instead, where that saves memory
    (`_reversed_queries_save_memory`). Packed documents use an explicit additive
    mask over the keys from the first document a query is in, shared by the layers of
    a split (`_shared_document_bias`).
    """

    name = "sdpa"

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None):
        _check_shapes(q, k, v, document_ids)
        lq, lk = q.shape[2], k.shape[2]
        if document_ids is not None:
            bias = _shared_document_bias(document_ids, lq, q.dtype)
            first_key = lk - bias.shape[-1]  # keys before it are invisible to every query
            k, v = k[:, :, first_key:], v[:, :, first_key:]  # views: nothing copied
            causal = {"attn_mask": bias}
        elif lq == lk:
            causal = {"is_causal": True}
        elif q.device.type == "cpu" and _reversed_queries_save_memory(q, k):
            return _bottom_right_causal_cpu(q, k, v, softmax_scale, dropout_p)
        else:
            causal = {"attn_mask": causal_lower_right(lq, lk)}
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1], **causal,
        )


# The SDPA mask is kept for backward by every layer's kernel: one tensor for all of them.
# (`first_key` is not kept: it is `lk - bias.shape[-1]`.)
_shared_document_bias = PerSplitMemo(
    lambda ids, lq, dtype: document_attention_bias(ids, lq, dtype)[1], weak=True)
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

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None):
        _check_shapes(q, k, v, document_ids)
        if self._needs_cuda and (
                q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)):
            raise ValueError(f"flash backend needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
        if document_ids is not None:
            return self._documents(q, k, v, document_ids, softmax_scale, dropout_p)
        out = self._func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True,
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
    on a GPU yet. CPU: torch's public `flex_attention` refuses CPU inputs that require
    grad (it has no compiled CPU backward) and re-traces eagerly for every new shape, so
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
        self._compiled = None  # torch.compile(flex_attention), made on the first CUDA call

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None):
        _check_shapes(q, k, v, document_ids)
        if dropout_p > 0.0:
            raise ValueError("attention backend 'flex' has no dropout: set --attention-dropout 0")
        b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
        if document_ids is not None:
            mask_mod, batch = document_mask_mod(document_ids, lq), b
        else:
            offset = lk - lq

            def mask_mod(b_, h_, q_idx, kv_idx):
                return kv_idx <= q_idx + offset

            batch = None  # the same mask for every row
        enable_gqa = q.shape[1] != k.shape[1]
        if q.device.type == "cuda":
            return self._cuda(q, k, v, mask_mod, batch, softmax_scale, enable_gqa)
        block_mask = self._module.create_block_mask(mask_mod, batch, None, lq, lk, device=q.device)
        return self._eager(q, k, v, block_mask, softmax_scale)

    def _cuda(self, q, k, v, mask_mod, batch, softmax_scale, enable_gqa):
        # Not run yet (no GPU where this was written). The block mask is rebuilt for
        # every layer; it depends only on the split, so it could be made once per split.
        if self._compiled is None:
            self._compiled = torch.compile(self._module.flex_attention)
        block_mask = self._module.create_block_mask(
            mask_mod, batch, None, q.shape[2], k.shape[2], device=q.device, _compile=True)
        return self._compiled(q, k, v, block_mask=block_mask, scale=softmax_scale,
                              enable_gqa=enable_gqa)

    def _eager(self, q, k, v, block_mask, softmax_scale):
        # What the public function does once its checks pass, minus the CPU-backward
        # refusal and the dynamo trace; private torch API (checked on torch 2.13, guarded
        # by test_flex_cpu_path_equals_public_flex_attention).
        from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop

        options = self._module._apply_kernel_options(q, k, v, False, None)
        out, _, _ = flex_attention_hop(q, k, v, self._module._identity, block_mask.as_tuple(),
                                       softmax_scale, options)
        return out


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


def get_backend(name: str, device=None, dtype=None) -> AttentionBackend:
    """Backend by name: "sdpa", "flash", "flex", or "auto" (flash when usable, else sdpa).

    "auto" decides for `device`/`dtype` (the model's activations); when they are not
    given it assumes the current default device (CUDA if present) and default dtype.
    """
    if name == "auto":
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        name = available_backends(device, dtype or torch.get_default_dtype())[0]
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
