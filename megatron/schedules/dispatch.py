"""Choose the pipeline schedule: megatron-core's, Seq1F1B when splits are asked for, or
SlimPipe (by the names of ``megatron.schedules.registry``)."""

import functools
import inspect

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as mcore_schedules

from megatron.schedules import registry
from megatron.schedules.executor import ScheduleSettings, forward_backward_pipelining_seq1f1b
from megatron.seqsplit.context_parallel import ContextParallel

# megatron-core 0.19 added a third parameter (schedule_pg_collection); 0.16 has two
_MCORE_TAKES_PG_COLLECTION = "schedule_pg_collection" in inspect.signature(
    mcore_schedules.get_forward_backward_func).parameters


def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None, *,
                              seq1f1b_splits: int = 1, balance_method: str = "average",
                              alignment: int = 1, model_shape=None, observers=(),
                              schedule: str = None, slimpipe_slices: int = None,
                              attention_balance: bool = False, exchange_cost: float = 0.0):
    """megatron-core's ``get_forward_backward_func``, plus Seq1F1B and SlimPipe.

    Called as megatron-core's (``get_forward_backward_func()``,
    ``get_forward_backward_func(pp_size, vp_size)``), it returns what megatron-core's
    returns for the same sizes (both None: read from ``parallel_state``), except with
    virtual stages, see below. The keyword-only arguments ask for sequence splits.

    The returned function takes megatron-core's keyword arguments and returns what
    megatron-core's schedules return (one loss report per microbatch on the last
    stage), so any megatron-core training loop can use it::

        forward_backward_func = get_forward_backward_func(seq1f1b_splits=4)
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step, data_iterator=data_iterator, model=model,
            num_microbatches=8, seq_length=4096, micro_batch_size=1)

    The contract with splits (``seq1f1b_splits > 1`` or SlimPipe):

    * ``data_iterator`` yields each microbatch as a dict of per-token tensors
      ``[b, seq_length]``. ``forward_step`` receives a wrapper of it whose ``split``
      is this unit's ``SplitContext`` and whose ``next()`` returns the split's slice
      of the microbatch (labels were shifted before slicing).
    * The model is ``megatron.seqsplit.model.SeqSplitGPTModel`` with
      ``split_aware_local_spec(config)``, and ``forward_step`` passes the split to it
      as ``packed_seq_params``: the split-aware attention attends over the K/V of the
      earlier splits, the model puts RoPE at the split's offset. A forward that
      returns without both (a stock ``GPTModel``, or the split left out) raises
      ``SplitNotConsumedError`` at the first unit, before any backward: it would
      otherwise attend within each split only and train on wrong gradients.
    * The loss function returns megatron's triple ``(loss_sum, num_tokens,
      reported)``: a split's loss sum is divided by its whole microbatch's token
      count (``reported`` values are added over the splits of a microbatch).

    For example (``pretrain_gpt.py`` is the full version, with pipeline stages and
    packed documents)::

        def loss_func(loss_mask, output_tensor):
            losses = output_tensor.float().view(-1)  # per-token losses of the split
            loss_mask = loss_mask.view(-1).float()
            loss_sum = torch.sum(losses * loss_mask)
            num_tokens = loss_mask.sum().to(torch.int)
            reported = torch.stack([loss_sum.detach(), loss_mask.sum().detach()])
            return loss_sum, num_tokens, {"lm loss": reported}

        def forward_step(data_iterator, model):
            batch = next(data_iterator)  # this split's tokens, labels, ... [b, length]
            output_tensor = model(batch["tokens"], batch["position_ids"], None,
                                  labels=batch["labels"],
                                  packed_seq_params=data_iterator.split)
            return output_tensor, functools.partial(loss_func, batch["loss_mask"])

        model = SeqSplitGPTModel(config, split_aware_local_spec(config), vocab_size=...,
                                 max_sequence_length=4096, position_embedding_type="rope")

    The same ``forward_step`` runs unsplit: ``data_iterator.split`` is then absent
    (use ``getattr(data_iterator, "split", None)``) and the model is plain causal.

    With one split it *is* megatron-core's function (1F1B, or no pipelining when pp=1),
    unless observers (timeline, memory probes) are attached or context parallelism is
    initialised: then our executor runs the s = 1 schedule, which is megatron's 1F1B
    unit for unit, so it can be observed (and each context-parallel rank given its part
    of the sequence, ``megatron.seqsplit.context_parallel``).

    With virtual stages (``vp_size > 1``) our executor always runs, also for one split:
    it runs megatron-core's interleaved unit order (``megatron.schedules.interleaved``)
    and is tested exact against the unsplit single-process run. megatron-core 0.16.1's
    own interleaved function did not reproduce the single-process losses on our CPU/gloo
    setup (pp=2: batched p2p swaps a gradient and an activation between the same two
    ranks; unbatched, the first iteration still differed), so it is not used.

    ``schedule`` is a name of ``megatron.schedules.registry`` (``1f1b``, ``seq1f1b``,
    ``slimpipe``; None: chosen from the split and slice counts as ``--pipeline-schedule``
    is). An unknown name, or a combination the command line refuses (splits under
    ``1f1b``, Seq1F1B splits or ``uniform_comp`` under ``slimpipe``, ...), raises
    ``registry.ScheduleChoiceError`` naming the valid choices. With splits the returned
    function is ``megatron.schedules.executor.forward_backward_pipelining_seq1f1b`` with
    its ``settings`` bound (its ``.func``).

    ``schedule="slimpipe"`` runs SlimPipe (``megatron.schedules.slimpipe``) in the same
    executor: ``slimpipe_slices`` uniform slices (the ``average`` split plan), the
    interleaved order with a group of one microbatch, or Seq1F1B's order when
    ``vp_size`` is 1. ``attention_balance`` adds SlimPipe's attention redistribution
    (``megatron.schedules.attention_balance``; needs the chunked KV cache), with
    ``exchange_cost`` its communication cost per K/V chunk (``SliceCosts``).

    Data-parallel gradient reduction follows ``config.no_sync_func`` /
    ``grad_sync_func`` as megatron-core's schedules do (``--overlap-grad-reduce``):
    see ``megatron.schedules.grad_sync``.
    """
    if schedule_pg_collection is not None and not _MCORE_TAKES_PG_COLLECTION:
        raise TypeError("schedule_pg_collection needs megatron-core >= 0.17")
    schedule = registry.resolve(
        schedule, seq1f1b_splits=seq1f1b_splits,
        slices_flag=None if slimpipe_slices is None else "--slimpipe-slices",
        balance_method=balance_method, attention_balance=attention_balance)
    slimpipe = schedule == "slimpipe"
    if slimpipe and (slimpipe_slices is None or slimpipe_slices < 1):
        raise registry.ScheduleChoiceError(
            f"--pipeline-schedule slimpipe needs slimpipe_slices >= 1, got {slimpipe_slices}")
    # context parallelism runs in the split-aware attention (our executor cuts each
    # unit's part of the sequence), also for one split
    context_parallel = ContextParallel.from_parallel_state() is not None
    if not slimpipe and seq1f1b_splits <= 1 and not observers and not context_parallel:
        if pp_size is None and vp_size is None:  # megatron-core's fallback
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if vp_size is None or vp_size <= 1:  # virtual stages: our executor, see above
            extra = ({"schedule_pg_collection": schedule_pg_collection}
                     if schedule_pg_collection is not None else {})
            return mcore_schedules.get_forward_backward_func(pp_size, vp_size, **extra)
    _refuse_pg_collection(schedule_pg_collection)
    settings = ScheduleSettings(schedule=schedule,
                                num_splits=slimpipe_slices if slimpipe else seq1f1b_splits,
                                balance_method=balance_method, alignment=alignment,
                                model_shape=model_shape, observers=list(observers),
                                attention_balance=attention_balance,
                                exchange_cost=exchange_cost)
    return with_settings(settings)


def with_settings(settings: ScheduleSettings):
    """``forward_backward_pipelining_seq1f1b`` with ``settings`` bound: it keeps the
    function's name and docstring, and ``.func`` is the function itself."""
    return functools.update_wrapper(
        functools.partial(forward_backward_pipelining_seq1f1b, settings=settings),
        forward_backward_pipelining_seq1f1b)


def _refuse_pg_collection(schedule_pg_collection):
    if schedule_pg_collection is not None:
        raise ValueError("schedule_pg_collection (multi-module pipelines) is megatron-core's "
                         "only; our executor runs one module's pipeline: leave it None")
