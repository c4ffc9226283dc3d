"""A split's causal attention on CPU without a mask: two mask-free kernels merged by LSE.

A split's ``lq`` queries are the last ``lq`` of its ``lk`` keys (bottom-right causal).
Given as one masked call, torch's CPU SDPA either builds the ``lq x lk`` mask and runs its
math path (1.2x the forward of the flash kernel) or needs a strided mask vector
(``attention_backends._bottom_right_causal_cpu``). But the keys fall in two parts that
need no mask at all:

* the split's own block, the last ``lq`` keys: plain causal attention (``is_causal``:
  top-left and bottom-right alignment coincide for a square block);
* the prefix, the ``lk - lq`` keys before it: every query sees all of them.

Each part runs torch's fused CPU flash kernel, which returns its log-sum-exp (LSE); the
parts merge exactly:

    lse = logaddexp(lse_own, lse_prefix),
    out = exp(lse_own - lse) out_own + exp(lse_prefix - lse) out_prefix

Backward is the flash recurrence of each part with the merged output and LSE
(``P = exp(S - lse)``, ``dS = P (dO V^T - rowsum(dO * O))``): the fused backward kernel
computes each part's gradients exactly when given those. Saved for backward: q, k, v
(views of what the caller keeps anyway), the merged output and its LSE; no mask.
No dropout: the kernel draws its own mask per call (callers route dropout elsewhere).
"""

import torch

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def split_causal_attention_cpu(q, k, v, softmax_scale):
    """q [b, hq, lq, d], k/v [b, g, lk, d] (hq % g == 0, lq < lk) on CPU -> [b, hq, lq, d].

    The queries are the last ``lq`` positions of the keys; no dropout."""
    if not q.shape[2] < k.shape[2]:
        raise ValueError(f"a split has a prefix: need lq < lk, got {q.shape[2]} and {k.shape[2]}")
    return _SplitCausal.apply(q, k, v, softmax_scale)


def _merge(out_own, lse_own, out_prefix, lse_prefix):
    lse = torch.logaddexp(lse_own, lse_prefix)  # float32 (float64 for float64 inputs)
    weight_own = torch.exp(lse_own - lse).unsqueeze(-1)
    weight_prefix = torch.exp(lse_prefix - lse).unsqueeze(-1)
    # in the statistics' dtype, rounded once to the inputs' (as the fused kernel does)
    out = out_own.to(lse.dtype) * weight_own + out_prefix.to(lse.dtype) * weight_prefix
    return out.to(out_own.dtype), lse


class _SplitCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale):
        prefix = k.shape[2] - q.shape[2]
        own = _flash_forward(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=softmax_scale)
        before = _flash_forward(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False,
                                scale=softmax_scale)
        out, lse = _merge(*own, *before)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.shape[2] - q.shape[2]
        grad_out = grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out
        dq_own, dk_own, dv_own = _flash_backward(
            grad_out, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, 0.0, True,
            scale=ctx.softmax_scale)
        dq_prefix, dk_prefix, dv_prefix = _flash_backward(
            grad_out, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, 0.0, False,
            scale=ctx.softmax_scale)
        return (dq_own + dq_prefix, torch.cat([dk_prefix, dk_own], dim=2),
                torch.cat([dv_prefix, dv_own], dim=2), None)
