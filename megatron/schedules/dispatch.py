"""Choose the pipeline schedule: megatron-core's, Seq1F1B when splits are asked for, or
SlimPipe."""

import functools

from megatron.core.pipeline_parallel import schedules as mcore_schedules

from megatron.schedules.seq1f1b import Seq1F1BSettings, forward_backward_pipelining_seq1f1b


def get_forward_backward_func(seq1f1b_splits: int = 1, balance_method: str = "average",
                              alignment: int = 1, model_shape=None, observers=(),
                              pp_size=None, vp_size=None, schedule: str = "seq1f1b",
                              slimpipe_slices: int = None, attention_balance: bool = False,
                              exchange_cost: float = 0.0):
    """megatron-core's ``get_forward_backward_func``, plus Seq1F1B for ``seq1f1b_splits > 1``.

    The returned function takes megatron-core's keyword arguments and returns what
    megatron-core's schedules return, so any megatron-core training loop can use it.
    With one split it *is* megatron-core's function (1F1B, or no pipelining when pp=1),
    unless observers (timeline, memory probes) are attached: then our executor runs
    the s = 1 schedule, which is megatron's 1F1B unit for unit, so it can be observed.

    With virtual stages (``vp_size > 1``) our executor always runs, also for one split:
    it runs megatron-core's interleaved unit order (``megatron.schedules.interleaved``)
    and is tested exact against the unsplit single-process run. megatron-core 0.16.1's
    own interleaved function did not reproduce the single-process losses on our CPU/gloo
    setup (pp=2: batched p2p swaps a gradient and an activation between the same two
    ranks; unbatched, the first iteration still differed), so it is not used.

    ``schedule="slimpipe"`` runs SlimPipe (``megatron.schedules.slimpipe``) in the same
    executor: ``slimpipe_slices`` uniform slices (the ``average`` split plan), the
    interleaved order with a group of one microbatch, or Seq1F1B's order when
    ``vp_size`` is 1. ``attention_balance`` adds SlimPipe's attention redistribution
    (``megatron.schedules.attention_balance``; needs the chunked KV cache), with
    ``exchange_cost`` its communication cost per K/V chunk (``SliceCosts``).
    """
    if schedule == "slimpipe":
        if not slimpipe_slices or slimpipe_slices < 1:
            raise ValueError(f"SlimPipe needs slimpipe_slices >= 1, got {slimpipe_slices}")
        settings = Seq1F1BSettings(num_splits=slimpipe_slices, balance_method="average",
                                   alignment=alignment, model_shape=model_shape,
                                   observers=list(observers), schedule="slimpipe",
                                   attention_balance=attention_balance,
                                   exchange_cost=exchange_cost)
        return functools.partial(forward_backward_pipelining_seq1f1b, settings=settings)
    interleaved = vp_size is not None and vp_size > 1
    if seq1f1b_splits <= 1 and not observers and not interleaved:
        return mcore_schedules.get_forward_backward_func(pp_size=pp_size, vp_size=vp_size)
    settings = Seq1F1BSettings(num_splits=seq1f1b_splits, balance_method=balance_method,
                               alignment=alignment, model_shape=model_shape,
                               observers=list(observers))
    return functools.partial(forward_backward_pipelining_seq1f1b, settings=settings)
