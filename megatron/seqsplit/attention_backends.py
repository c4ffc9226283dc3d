"""Causal attention kernels for sequence splits: queries are the LAST `lq` of `lk` keys.

Interface (one call per split and layer):
    backend(q, k, v, *, softmax_scale, dropout_p=0.0) -> out
    q [b, hq, lq, d]; k, v [b, g, lk, d] with lk >= lq and hq % g == 0 (GQA/MQA);
    the causal mask is aligned to the bottom right: query i sees keys 0 .. lk - lq + i.
    out [b, hq, lq, d].

The backend is picked once, at model build time, with `get_backend`.
"""

import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

BACKEND_NAMES = ("sdpa", "flash")


class AttentionBackend:
    """Bottom-right causal attention over a key prefix; subclasses implement `__call__`."""

    name = "base"

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0):
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


def _check_shapes(q, k, v):
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"expected q [b, hq, lq, d], k/v [b, g, lk, d]; got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] or q.shape[2] > k.shape[2]:
        raise ValueError(f"need hq % g == 0 and lq <= lk; got q {q.shape}, k {k.shape}")


class SDPABackend(AttentionBackend):
    """torch.nn.functional.scaled_dot_product_attention.

    `enable_gqa=True` lets the kernel read grouped K/V without expanding heads (the
    CPU flash kernel and the CUDA flash kernel do; the math fallback expands inside).
    For lq != lk the mask is `causal_lower_right`; torch maps it onto the CUDA flash or
    memory-efficient kernels where they apply, otherwise materialises an lq x lk mask.
    """

    name = "sdpa"

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0):
        _check_shapes(q, k, v)
        lq, lk = q.shape[2], k.shape[2]
        causal = {"is_causal": True} if lq == lk else {"attn_mask": causal_lower_right(lq, lk)}
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1], **causal,
        )


def _flash_attn_version():
    """Installed flash-attn version as a tuple, or None when it does not import."""
    try:
        version = importlib.import_module("flash_attn").__version__
    except Exception:  # not installed, or a broken build (missing CUDA symbols)
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


class FlashAttnBackend(AttentionBackend):
    """flash_attn.flash_attn_func (public API), CUDA fp16/bf16 only.

    flash-attn >= 2.1 aligns the causal mask to the bottom right when lq != lk and
    reads grouped K/V natively. It wants [b, l, h, d]; transposing our [b, h, l, d]
    keeps the last dimension contiguous, so no copy is made.
    """

    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_func  # raises ImportError when missing

        self._func = flash_attn_func

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0):
        _check_shapes(q, k, v)
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash backend needs CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
        out = self._func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True,
        )
        return out.transpose(1, 2)


def _flash_usable(device, dtype):
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    version = _flash_attn_version()
    return version is not None and version >= (2, 1)


def available_backends(device, dtype) -> list[str]:
    """Names of the backends that can run on `device` with `dtype`, preferred first."""
    return (["flash"] if _flash_usable(device, dtype) else []) + ["sdpa"]


def get_backend(name: str, device=None, dtype=None) -> AttentionBackend:
    """Backend by name: "sdpa", "flash", or "auto" (flash when usable, else sdpa).

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
    raise ValueError(f"unknown attention backend {name!r}; use one of auto, {', '.join(BACKEND_NAMES)}")
