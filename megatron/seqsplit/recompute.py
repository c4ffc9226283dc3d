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

The other modules of ``--recompute-modules`` are megatron-core's own checkpoints, which
read no split state and so rerun exactly the split they saved;
``prepare_output_discarding_checkpoints`` makes the output-freeing one
(``CheckpointWithoutOutput``: layernorm, mla_up_proj) run where Transformer Engine is
missing and builds what megatron-core 0.19 compiles for it before training starts.
"""

import functools

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as mcore_random
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


# --recompute-modules that megatron-core runs through CheckpointWithoutOutput
OUTPUT_DISCARDING_MODULES = ("layernorm", "mla_up_proj")


def prepare_output_discarding_checkpoints(config) -> None:
    """Before a model with ``OUTPUT_DISCARDING_MODULES`` recomputed is built: make
    megatron-core's ``CheckpointWithoutOutput`` run without Transformer Engine, and build
    the C++ extension megatron-core >= 0.19 compiles at its first recomputation
    (``_get_share_storage``, with ninja and a C++ compiler: 24 s on this CPU, cached in
    ``~/.cache/torch_extensions``) now, so that a machine without a compiler stops before
    training instead of at its first backward."""
    modules = config.recompute_modules or ()
    if config.recompute_granularity != "selective" or not (
            set(modules) & set(OUTPUT_DISCARDING_MODULES)):
        return
    checkpoint_without_output_runs_without_te()
    build = getattr(mcore_random, "_get_share_storage", None)
    if build is None:  # megatron-core 0.16: the recomputation copies into the storage
        return
    try:
        build()
    except Exception as error:  # what torch's extension builder raises varies
        chosen = " ".join(m for m in OUTPUT_DISCARDING_MODULES if m in modules)
        raise RuntimeError(
            f"--recompute-modules {chosen}: megatron-core builds a C++ extension "
            f"(share_storage, torch.utils.cpp_extension.load_inline) for this recomputation, "
            f"and the build failed: {error}. Install ninja and a C++ compiler, or drop "
            f"{chosen} from --recompute-modules") from error


def checkpoint_without_output_runs_without_te() -> None:
    """Make megatron-core's ``CheckpointWithoutOutput`` (``--recompute-modules layernorm``;
    MLA's ``mla_up_proj`` when fp8 is None) run where Transformer Engine is not installed.

    Its ``__init__`` sets ``self.fp8 = fp8 is not None``, so its default ``fp8=False``
    takes the FP8 path, which asks Transformer Engine's ``FP8GlobalStateManager``
    (0.16.1 and 0.19.2): without TE every such checkpoint stops with a NameError. Without
    TE there is no FP8, so the flag is cleared after megatron-core's ``__init__``; with TE
    nothing changes."""
    cls = mcore_random.CheckpointWithoutOutput
    if getattr(mcore_random, "HAVE_TE", True) or getattr(cls, "_fp8_off_without_te", False):
        return
    original_init = cls.__init__

    @functools.wraps(original_init)  # megatron-core's signature (mcore_compat reads it)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.fp8 = False

    cls.__init__ = __init__
    cls._fp8_off_without_te = True
