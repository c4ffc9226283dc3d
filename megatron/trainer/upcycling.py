"""Megatron-LM's --moe-use-upcycling: a dense model's checkpoint turned into an MoE
model (sparse upcycling, arXiv 2410.07524) by megatron-core's ``upcycling_utils``, saved
as iteration 1 of the MoE run, which then trains on.

The dense model is built beside the MoE one with the same flags but no experts and an FFN
of --moe-ffn-hidden-size x --moe-upcycling-granularity, loaded from --load (weights only),
and each chunk's state converted: the dense MLP copied (or cut into granularity slices)
into every expert, scaled so that the MoE layer starts out computing what the dense MLP
did; the router keeps its fresh weights (repeated per slice). Shared experts, which
megatron-core's conversion does not fill, keep their fresh weights too (as in
Megatron-LM).
"""

import contextlib
import copy

import torch
import torch.nn.functional as F

from megatron.trainer import checkpointing
from megatron.trainer.agreed_stop import AgreedStop
from megatron.trainer.model import tanh_gelu


def upcycle(args, model, optimizer, scheduler, build_model, model_provider, config_of):
    """Fill ``model`` (the MoE run's chunks) from the dense checkpoint in --load and save
    it into --save as iteration 1 (``refuse_a_second_conversion`` has run, before --save
    was claimed). Returns (iteration, consumed samples): (1, 0), where Megatron-LM's
    training goes on. Collective."""
    from megatron.core.transformer.moe import upcycling_utils

    dense_args = dense_model_args(args)
    dense_model = build_model(dense_args, config_of(dense_args), model_provider)
    checkpointing.load_checkpoint(dense_args, dense_model, None, scheduler)
    unwrap = checkpointing.unwrap_model
    try:
        with _activation_named_for_upcycling(model):
            for moe_chunk, dense_chunk in zip(model, dense_model, strict=True):
                # one chunk at a time: megatron-core's own loop over several chunks
                # (virtual stages) hands them over in the wrong order
                state = upcycling_utils.upcycle_state_dict([unwrap(moe_chunk)],
                                                           [unwrap(dense_chunk)])["model"]
                unwrap(moe_chunk).load_state_dict(state, strict=True)
    except (AssertionError, TypeError, ValueError, RuntimeError, KeyError) as error:
        raise AgreedStop(f"--moe-use-upcycling: megatron-core's upcycling cannot convert "
                         f"this model: {error}") from None
    del dense_model
    optimizer.reload_model_params()  # the optimizer's main copies follow the new weights
    if torch.distributed.get_rank() == 0:
        print(f"  upcycled the dense checkpoint in --load {args.load} into "
              f"{args.num_experts} experts per MoE layer (granularity "
              f"{args.moe_upcycling_granularity}); saving it as iteration 1 in --save "
              f"{args.save}", flush=True)
    saving = copy.copy(args)
    saving.no_save_optim = True  # as Megatron-LM: the optimizer has not stepped yet
    checkpointing.save_checkpoint(saving, 1, 0, model, optimizer, scheduler)
    return 1, 0


def refuse_a_second_conversion(args):
    """As Megatron-LM: only the first run converts; the later ones resume from --save
    (before the --save directory is claimed, whose own check would say less)."""
    if checkpointing.has_checkpoint(args.save):
        raise AgreedStop(f"--moe-use-upcycling: --save {args.save} already holds a "
                         f"checkpoint; upcycling is for the first run only: drop "
                         f"--moe-use-upcycling to resume it (--load {args.save})")


def dense_model_args(args):
    """The flags of the dense model a checkpoint for upcycling holds: no experts, and the
    FFN that the experts (times the granularity) slice."""
    dense = copy.copy(args)
    dense.num_experts = None
    dense.expert_model_parallel_size = 1
    dense.ffn_hidden_size = args.moe_ffn_hidden_size * args.moe_upcycling_granularity
    dense.finetune = True  # the weights only (--no-load-optim/-rng: set by the flag checks)
    return dense


@contextlib.contextmanager
def _activation_named_for_upcycling(model):
    """megatron-core picks the experts' weight scale by the activation's name (gelu,
    silu, squared_relu); the tanh GeLU that Megatron-LM's bias+GeLU fusion computes (our
    ``tanh_gelu``) is its GeLU, named so only while converting."""
    config = checkpointing.unwrap_model(model[0]).config
    original = config.activation_func
    if original is tanh_gelu:
        config.activation_func = F.gelu
    try:
        yield
    finally:
        config.activation_func = original
