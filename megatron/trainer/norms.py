"""--log-params-norm and --log-num-zeros-in-grad, with Megatron-LM's meaning.

Both are whole-model statistics: every parameter (or gradient) element counted once,
whatever the layout. A rank holds its pipeline stage's and its tensor-parallel shard's
share; TP-duplicated parameters (LayerNorm weights, row-parallel biases) and the last
stage's copy of a tied embedding are left out before the sum over the model-parallel
group, as megatron-core's own filters decide (``param_is_not_shared``,
``param_is_not_tensor_parallel_duplicate``), the same filters Megatron-LM's
``calc_params_l2_norm`` and megatron-core's ``count_zeros_fp32`` use.
"""

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared


def params_l2_norm(model, bf16=False) -> float:
    """The L2 norm of all parameters of the model (a list of model chunks), the same on
    every rank. As Megatron-LM: with --bf16 the optimizer's fp32 main copy, else the
    parameter; with the distributed optimizer each data-parallel rank holds a shard of
    those main copies (None where another rank holds it), summed over the data-parallel
    group first."""
    whole, sharded, dp_sharded = [], [], False
    for chunk in model:
        for param in chunk.parameters():
            if not (param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)):
                continue
            if not (bf16 and hasattr(param, "main_param")):
                whole.append(param)
            elif getattr(param, "main_param_sharded", False):
                dp_sharded = True  # the same on every data-parallel rank: the same reduces
                if param.main_param is not None:
                    sharded.append(param.main_param)
            else:
                whole.append(param.main_param)
    device = next(model[0].parameters()).device
    whole_sq, sharded_sq = (_sum_of_squares(tensors, device) for tensors in (whole, sharded))
    if dp_sharded:
        # the distributed optimizer shards over the data- and context-parallel ranks
        torch.distributed.all_reduce(
            sharded_sq, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    total = whole_sq + sharded_sq
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.item() ** 0.5


def _sum_of_squares(tensors, device):
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for tensor in tensors:
        total += tensor.detach().double().square().sum().to(device)
    return total


def num_zeros_across_model_parallel(num_zeros, device):
    """megatron-core's optimizer counts the zeros over its own group; ranks without
    trainable parameters return None. As Megatron-LM's
    ``reduce_max_stat_across_model_parallel_group``: the max over the model-parallel group,
    so every rank prints the same count."""
    value = torch.tensor([-1.0 if num_zeros is None else float(num_zeros)], dtype=torch.float64,
                         device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX,
                                 group=parallel_state.get_model_parallel_group())
    return None if value.item() < 0 else int(value.item())
