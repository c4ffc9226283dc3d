"""Selective recomputation of core attention that does not duplicate the KV cache.

megatron-core's selective recomputation (``--recompute-granularity selective``,
``recompute_modules`` containing ``"core_attn"``) wraps the whole core attention in a
reentrant checkpoint (``SelfAttention._checkpointed_attention_forward``), which saves
its inputs: the split's query, key and value. Under Seq1F1B split attention writes the
split's key and value into the microbatch's KV-cache buffer, which stays alive until
split 0's backward anyway, and without recomputation the kernel saves aliases of that
buffer, not copies. The checkpoint therefore kept a second copy of the split's K/V, and
since ``value`` is a view of the fused QKV projection's output it pinned that whole
output: ``(g + hq + 2 g) d`` elements per token, more than the attention kernel itself
saves besides its query (``out`` and the softmax statistics; on CPU also the bottom-right
causal mask of a split with ``lq != lk``, see ``attention_backends``). Measured: 4 MiB per
split of 1024 tokens at hidden 256 above no recomputation
(docs/results/seq1f1b_memory_cpu.md).

Here the checkpoint moves inside split attention, after the cache write: it wraps the
attention kernel only, so it saves the query (never a view of the fused QKV output:
``kv_cache.query_alone``) plus aliases of the cache buffers (no new memory), and its
recomputation reruns the kernel without touching the KV cache (the
cache is written once per split, by the first forward).
"""

from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention

from megatron.seqsplit.attention_backends import variant_kwargs


class RecomputedAttentionKernel:
    """An attention backend whose call is checkpointed (megatron-core's reentrant
    ``tensor_parallel.checkpoint``: the same RNG-state handling as the selective path
    it replaces, so attention dropout draws the same mask when recomputed)."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):  # name, supports_dropout, ... of the wrapped backend
        return getattr(self.backend, name)

    def runs_split_kernel_cpu(self, call) -> bool:
        # the KV cache's fused CPU node would run the kernel outside this checkpoint
        return False

    def __call__(self, q, k, v, *, softmax_scale, dropout_p=0.0, document_ids=None,
                 window=None, sink=None):
        def kernel(q_, k_, v_, document_ids_, sink_):
            return self.backend(q_, k_, v_, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                document_ids=document_ids_, **variant_kwargs(window, sink_))

        if not any(t.requires_grad for t in (q, k, v)):  # evaluation: nothing to save
            return kernel(q, k, v, document_ids, sink)
        # the sinks are an input, so their gradient leaves the checkpoint
        return tensor_parallel.checkpoint(kernel, False, q, k, v, document_ids, sink)

    def __repr__(self):
        return f"RecomputedAttentionKernel({self.backend!r})"


def checkpoint_kernel_not_core_attention(attention) -> None:
    """On a built megatron-core attention (standard or MLA): with selective recomputation
    of ``core_attn`` and a split-aware core attention (anything with a ``backend``
    attribute: the kernel it calls), checkpoint the kernel instead of the whole core
    attention."""
    attention.checkpoint_attention_kernel = (
        attention.checkpoint_core_attention and hasattr(attention.core_attention, "backend"))
    if attention.checkpoint_attention_kernel:
        attention.checkpoint_core_attention = False
        attention.core_attention.backend = RecomputedAttentionKernel(
            attention.core_attention.backend)


class SplitSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` with ``checkpoint_kernel_not_core_attention``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        checkpoint_kernel_not_core_attention(self)
