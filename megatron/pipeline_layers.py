"""How many transformer layers each pipeline stage holds.

Megatron-LM's uneven split: ``--decoder-first-pipeline-num-layers`` and
``--decoder-last-pipeline-num-layers`` fix the first and last stages' layer counts and the
remaining layers divide evenly among the middle stages (megatron-core's
``TransformerConfig`` checks and ``get_num_layers_to_build``);
``--account-for-embedding/loss-in-pipeline-split`` count the embedding / the loss as a
layer of an even split instead (of the virtual stages too); ``--pipeline-model-parallel-
layout`` gives every stage's layers (and the virtual stages); without them every stage
holds ``num_layers / pp``. The planner, the argument checks and the tests share this one
rule, so the model megatron-core builds and what they assume cannot drift apart.
"""


class UnevenSplitError(ValueError):
    """A layer split megatron-core would refuse; the message names the flags."""


def stage_layer_counts(num_layers, pp, first=None, last=None, vp=None,
                       account_for_embedding=False, account_for_loss=False):
    """Layers on each of the ``pp`` pipeline ranks (all of a rank's virtual stages together),
    checked as megatron-core checks them (each rank's count divides by ``vp``).

    ``account_for_embedding`` / ``account_for_loss`` (Megatron-LM's
    ``--account-for-embedding/loss-in-pipeline-split``): the embedding and the output
    layer with the loss count as one layer each in an even split, so the first / last
    model chunk builds one transformer layer fewer (megatron-core's
    ``get_num_layers_to_build``); with ``vp`` virtual stages the layers plus the counted
    parts divide by ``pp * vp`` instead (``chunk_layer_counts`` gives the chunks)."""
    if account_for_embedding or account_for_loss:
        return _accounted_counts(num_layers, pp, first, last, vp, account_for_embedding,
                                 account_for_loss)
    if first is None and last is None:
        if num_layers % pp:
            raise UnevenSplitError(
                f"--num-layers ({num_layers}) must be divisible by "
                f"--pipeline-model-parallel-size ({pp}), or set "
                f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        counts = [num_layers // pp] * pp
    else:
        if pp < 2:
            raise UnevenSplitError("--decoder-first/last-pipeline-num-layers need "
                                   "--pipeline-model-parallel-size >= 2")
        middle_layers, middle_stages = num_layers, pp
        for flag, value in (("--decoder-first-pipeline-num-layers", first),
                            ("--decoder-last-pipeline-num-layers", last)):
            if value is not None:
                if value <= 0:
                    raise UnevenSplitError(f"{flag} must be > 0, got {value}")
                middle_layers -= value
                middle_stages -= 1
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            raise UnevenSplitError(
                f"--num-layers ({num_layers}) leaves {middle_layers} layers for "
                f"{middle_stages} middle pipeline stages after --decoder-first/last-"
                f"pipeline-num-layers; give every stage at least one layer")
        if middle_stages and middle_layers % middle_stages:
            raise UnevenSplitError(
                f"the {middle_layers} layers left after --decoder-first/last-pipeline-num-"
                f"layers must divide among the {middle_stages} middle pipeline stages")
        middle = middle_layers // middle_stages if middle_stages else 0
        counts = [middle] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    if vp is not None and vp > 1:
        for rank, count in enumerate(counts):
            if count % vp:
                raise UnevenSplitError(
                    f"pipeline rank {rank} holds {count} layers, not divisible by the "
                    f"{vp} virtual pipeline stages per rank; change --num-layers, "
                    f"--decoder-first/last-pipeline-num-layers or the virtual stage count")
    return counts


def _accounted_counts(num_layers, pp, first, last, vp, embedding, loss):
    counted = [part for part, on in (("embedding", embedding), ("loss", loss)) if on]
    flags = " and ".join(f"--account-for-{part}-in-pipeline-split" for part in counted)
    if first is not None or last is not None:  # megatron-core asserts the same
        raise UnevenSplitError(f"{flags} cannot be combined with --decoder-first/last-"
                               f"pipeline-num-layers; give one way of unequal stages")
    vp = vp or 1
    slots = num_layers + int(embedding) + int(loss)
    if slots % (pp * vp):
        stages = (f"--pipeline-model-parallel-size ({pp}) x virtual stages ({vp})" if vp > 1
                  else f"--pipeline-model-parallel-size ({pp})")
        raise UnevenSplitError(
            f"with {flags} the {num_layers} layers plus the {' and '.join(counted)} "
            f"({slots}) must be divisible by {stages}")
    chunks = _accounted_chunks(slots // (pp * vp), pp, vp, embedding, loss)
    if 0 in chunks:
        rank = chunks.index(0) % pp
        where = (f"virtual stage {chunks.index(0) // pp} of pipeline rank {rank}" if vp > 1
                 else f"pipeline rank {rank}")
        raise UnevenSplitError(f"with {flags} {where} would hold no transformer layer; "
                               f"give every stage at least one layer")
    return [sum(chunks[rank::pp]) for rank in range(pp)]


def _accounted_chunks(per_chunk, pp, vp, embedding, loss):
    """Layers of each model chunk in pipeline order when every chunk holds ``per_chunk``
    slots and the embedding / the loss fill one slot of the first / last chunk
    (megatron-core's ``get_num_layers_to_build``)."""
    chunks = [per_chunk] * (pp * vp)
    chunks[0] -= int(embedding)
    chunks[-1] -= int(loss)
    return chunks


def chunk_layer_counts(counts, vp=None, account_for_embedding=False, account_for_loss=False):
    """Layers of each model chunk in pipeline order (chunk c of rank r is stage c*pp + r),
    from each rank's count (``stage_layer_counts``). A rank's chunks are equal except
    where the embedding or the loss is counted as a layer: there the first / last chunk
    holds one layer fewer."""
    vp = vp or 1
    pp = len(counts)
    if vp > 1 and (account_for_embedding or account_for_loss):
        # rank 0's chunks hold the same slots, its first one short of the embedding
        per_chunk = (counts[0] + int(account_for_embedding)) // vp
        return _accounted_chunks(per_chunk, pp, vp, account_for_embedding, account_for_loss)
    return [counts[rank] // vp for _ in range(vp) for rank in range(pp)]


def layout_chunk_layer_counts(layout: str, pp: int, num_layers: int,
                              mtp_num_layers: int = 0) -> list:
    """Transformer layers of each model chunk in pipeline order (chunk c of rank r at
    ``c * pp + r``) of Megatron-LM's ``--pipeline-model-parallel-layout`` (e.g.
    ``"Et*3|(tt|)*6,tL"``: ``E`` the embedding, ``t`` a transformer layer, ``m`` an MTP
    layer, ``L`` the output layer and loss, ``|`` between stages; the number of stages is
    ``pp`` times the virtual stages per rank). megatron-core parses and checks it (its
    ``PipelineParallelLayerLayout``, which builds the stages from it too); its assertions
    come back as ``UnevenSplitError`` naming the flag. MTP layers must sit with the loss
    on the last stage here (megatron-core's standalone MTP stage is not supported)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    flag = f"--pipeline-model-parallel-layout {layout!r}"
    try:
        parsed = PipelineParallelLayerLayout(layout, pp)
        standalone_mtp = parsed.validate_layer_layout(num_layers, mtp_num_layers or None)
    except (AssertionError, ValueError, KeyError, NotImplementedError) as error:
        raise UnevenSplitError(f"{flag}: {error or type(error).__name__}") from None
    vp = parsed.virtual_pipeline_model_parallel_size
    last = parsed.layout[pp - 1][vp - 1]
    if standalone_mtp or (mtp_num_layers and LayerType.mtp not in last):
        raise UnevenSplitError(f"{flag}: the MTP layers ('m') must be on the last stage, with "
                               f"the loss ('L'); a standalone MTP stage is not supported here")
    return [parsed.layout[rank][chunk].count(LayerType.decoder)
            for chunk in range(vp) for rank in range(pp)]
