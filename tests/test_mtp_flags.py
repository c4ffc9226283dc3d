"""Multi-token prediction's pieces without processes: the split's shifts against
megatron-core's unsplit ``roll_tensor``, Megatron-LM 0.19's flags, the refusals, the
checkpoint's model shape and the planner's stop; in one child process, the MTP routers'
statistics keys. The training runs (exact against one process) are
tests/test_mtp_exactness.py."""

import pytest
import torch
from megatron.core.transformer import multi_token_prediction

from distributed import ONE_LAYER, run_layer_child
from megatron_lm_parser import megatron_lm_args
from megatron.seqsplit.mtp import begin_split_rolls, end_split_rolls, split_aware_roll_tensor
from megatron.seqsplit.split_context import SplitContext, slice_batch
from megatron.trainer.arguments import ArgumentErrors, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "1",
        "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--position-embedding-type", "rope"]
MTP = ["--mtp-num-layers", "2"]
PP2_SPLITS = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2",
              "--untie-embeddings-and-output-weights"]


def args_of(*flags, world_size=1):
    return parse_args(BASE + list(flags), world_size=world_size, cuda_available=False,
                      check_files=False)


def _microbatch(length=13, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, (batch, length + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": (torch.rand(batch, length, generator=generator) > 0.2).float(),
            "position_ids": torch.arange(length).repeat(batch, 1)}


@pytest.mark.parametrize("lengths", [(13,), (5, 8), (4, 4, 5), (1, 3, 9), (6, 6, 1)])
def test_split_shifts_equal_the_unsplit_shift_cut_to_the_split(lengths, device="cpu"):
    """Every split's k-th shift of each tensor (and of the labels' copy, as megatron-core
    clones them) is the unsplit k-th shift's window, zeros past the sequence's end; the
    loss mask's sum is the whole microbatch's, as megatron-core's count of the row."""
    microbatch, depths = _microbatch(), 3
    whole = {name: [tensor] for name, tensor in microbatch.items()}
    sums = []
    for _ in range(depths):
        for name, shifted in whole.items():
            rolled, total = multi_token_prediction.roll_tensor(shifted[-1], shifts=-1, dims=-1)
            shifted.append(rolled)
            if name == "loss_mask":
                sums.append(total)
    offset = 0
    for index, length in enumerate(lengths):
        split = SplitContext(split_index=index, num_splits=len(lengths), offset=offset,
                             length=length, seq_length=13, microbatch=microbatch)
        # the split's tensors on the device, the kept microbatch on the host (as training)
        own = {name: tensor.to(device)
               for name, tensor in slice_batch(microbatch, offset, length, 13).items()}
        begin_split_rolls(split, **own)
        current = dict(own, labels=own["labels"].clone())  # megatron-core's copy
        for depth in range(depths):
            for name in current:
                rolled, total = split_aware_roll_tensor(current[name], packed_seq_params=split)
                expected = whole[name][depth + 1][:, offset:offset + length]
                assert rolled.device == own[name].device, (name, rolled.device)
                assert torch.equal(rolled.cpu(), expected), (lengths, index, name, depth)
                if name == "loss_mask":
                    assert torch.equal(total.cpu(), sums[depth]), (lengths, index, depth)
                current[name] = rolled
        end_split_rolls(split)
        offset += length


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_shifts_on_cuda():
    """The shifted windows come from the host's microbatch to the split's CUDA device
    (tools/gpu_checks.sh tests)."""
    test_split_shifts_equal_the_unsplit_shift_cut_to_the_split((4, 4, 5), device="cuda")


def test_an_unknown_tensor_stops_with_the_reason():
    microbatch = _microbatch()
    split = SplitContext(num_splits=2, offset=0, length=6, seq_length=13,
                         microbatch=microbatch)
    begin_split_rolls(split, **slice_batch(microbatch, 0, 6, 13))
    with pytest.raises(RuntimeError, match="not the split's tokens, position ids, labels"):
        split_aware_roll_tensor(torch.ones(2, 6, dtype=torch.long), packed_seq_params=split)


def test_unsplit_calls_stay_megatron_cores():
    tensor = torch.arange(6).view(1, 6)
    assert torch.equal(split_aware_roll_tensor(tensor)[0],
                       torch.tensor([[1, 2, 3, 4, 5, 0]]))


def test_flags_have_megatron_lms_names_defaults_and_config():
    from megatron.trainer.model import transformer_config_from_args

    args = args_of(*MTP, "--mtp-loss-scaling-factor", "0.3")
    config = transformer_config_from_args(args)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.3)
    plain = transformer_config_from_args(args_of())
    assert (plain.mtp_num_layers, plain.mtp_loss_scaling_factor) == (None, 0.1)
    megatron_lm = megatron_lm_args(MTP)
    if megatron_lm is not None:
        assert (megatron_lm.mtp_num_layers, megatron_lm.mtp_loss_scaling_factor) == (2, 0.1)
        assert args_of(*MTP).mtp_loss_scaling_factor == megatron_lm.mtp_loss_scaling_factor


def test_per_token_loss_runs_under_splits():
    """Trained against one process in tests/test_mtp_exactness.py ("Tp", "Vp")."""
    assert args_of(*MTP, *PP2_SPLITS, "--calculate-per-token-loss",
                   world_size=2).calculate_per_token_loss


@pytest.mark.parametrize("flags, reason", [
    (["--position-embedding-type", "yarn"], "not supported with --position-embedding-type"),
    (["--pipeline-model-parallel-size", "2"], "needs --untie-embeddings-and-output-weights"),
    (["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights",
      "--position-embedding-type", "learned_absolute"], "learned absolute position"),
    (PP2_SPLITS + ["--window-size", "4,0"], "not supported with --window-size"),
])
def test_what_cannot_run_stops_before_work(flags, reason):
    world = 2 if "--pipeline-model-parallel-size" in flags else 1
    with pytest.raises(ArgumentErrors) as error:
        args_of(*MTP, *flags, world_size=world)
    assert reason in str(error.value)


@pytest.mark.parametrize("moe_layers", ["[1,0]", "[0,1]"])
def test_mtp_under_splits_runs_after_a_dense_or_an_moe_last_layer(moe_layers):
    flags = [*MTP, *PP2_SPLITS, "--num-experts", "4", "--moe-router-topk", "2",
             "--disable-bias-linear", "--moe-layer-freq", moe_layers]
    assert args_of(*flags, world_size=2).mtp_num_layers == 2


def test_repeated_layer_is_refused_under_splits_only():
    """One MTP layer at every depth would share its K/V cache between the depths."""
    flags = [*MTP, "--mtp-use-repeated-layer"]
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags, *PP2_SPLITS, world_size=2)
    text = str(error.value)
    assert "--mtp-use-repeated-layer is not supported under sequence splits" in text or (
        "needs megatron-core >= 0.17" in text)


def test_full_recomputation_under_splits_needs_megatron_core_0_19():
    from megatron.trainer.mtp_arguments import (
        recompute_runs_under_splits,
        recompute_takes_its_arguments,
    )

    flags = [*MTP, *PP2_SPLITS, "--recompute-granularity", "full", "--recompute-method",
             "uniform", "--recompute-num-layers", "1"]
    if not recompute_takes_its_arguments():
        with pytest.raises(ArgumentErrors, match="0.18's MTP layer passes padding_mask"):
            args_of(*flags, world_size=2)
    elif recompute_runs_under_splits():
        assert args_of(*flags, world_size=2).mtp_num_layers == 2
    else:
        with pytest.raises(ArgumentErrors, match="needs megatron-core >= 0.19"):
            args_of(*flags, world_size=2)


def test_megatron_core_0_18s_mtp_recomputation_is_refused_with_or_without_splits(
        monkeypatch):
    """megatron-core 0.18's MTP layer calls its checkpointed forward with padding_mask,
    which that method does not take: a TypeError in the first forward, so such a run stops
    while parsing (checked here on whichever megatron-core is installed by making it 0.18's
    case; the real one is met on 0.18.2)."""
    from megatron.trainer import mtp_arguments

    monkeypatch.setattr(mtp_arguments, "recompute_takes_its_arguments", lambda: False)
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    for layout in ([], PP2_SPLITS):
        with pytest.raises(ArgumentErrors, match="use megatron-core 0.19, or "
                                                 "--recompute-granularity selective"):
            args_of(*MTP, *layout, *full, world_size=2 if layout else 1)
    assert args_of(*MTP, "--recompute-granularity", "selective").mtp_num_layers == 2


def test_the_depth_count_is_part_of_the_checkpoints_model_shape():
    from megatron.trainer.checkpointing import model_shape

    assert model_shape(args_of(*MTP))["mtp_num_layers"] == 2
    assert model_shape(args_of())["mtp_num_layers"] is None


def test_the_model_shape_counts_the_mtp_depths_as_megatron_lm():
    """Each depth: a copy of the last layer, the 2h -> h projection and the output head
    (Megatron-LM's FLOPs formula counts them so), and causal attention over the sequence;
    its parameters: the layer's, three norms and the projection. The planner's memory
    terms are checked against the probe (tests/test_planner_memory_probe.py)."""
    from dataclasses import replace

    from megatron.model_shape import ModelShape

    with_mtp = ModelShape.from_args(args_of(*MTP), vocab_size=128)
    plain = replace(with_mtp, mtp_num_layers=0)
    h = 32
    per_depth = plain.layer_flops_per_token(1) + 4 * h * h + 2 * h * 128
    assert with_mtp.linear_flops_per_token() == plain.linear_flops_per_token() + 2 * per_depth
    assert with_mtp.forward_flops(16) - plain.forward_flops(16) == pytest.approx(
        2 * (per_depth * 16 + plain.layer_flops_per_pair() * 16 * 17 / 2))
    layer = plain.attention_linear_params() + plain.mlp_linear_params(1) + 2 * 2 * h
    assert with_mtp.parameter_count() - plain.parameter_count() == 2 * (
        layer + 3 * 2 * h + 2 * h * h)


MTP_ROUTERS_CHILD = r"""
from megatron.seqsplit.moe import SplitRouter

base = json.loads(sys.argv[1])
model = model_of(base + ["--num-layers", "3", "--mtp-num-layers", "2", "--num-experts", "4",
                         "--moe-ffn-hidden-size", "16", "--disable-bias-linear",
                         "--untie-embeddings-and-output-weights",
                         "--position-embedding-type", "rope"])
for part in ("decoder", "mtp"):
    for module in getattr(model, part).modules():
        if isinstance(module, SplitRouter):
            print(json.dumps({"part": part, "key": str(module._layer_key()),
                              "logged_as": module._tracker_layer()[0]}))
"""


@pytest.mark.distributed  # a child process: the layers need megatron-core's parallel state
def test_mtp_routers_keep_their_own_statistics_and_log_after_the_decoder():
    """Each MTP layer's router keys its split statistics apart from every decoder layer's
    and logs its losses after the decoder's layers (megatron-core 0.17 told only MoELayer
    itself, not our subclass, that it sits in an MTP layer: its MTP routers shared the
    statistics of the decoder layer of the same number)."""
    routers = run_layer_child(MTP_ROUTERS_CHILD, ONE_LAYER)
    decoder = [r for r in routers if r["part"] == "decoder"]
    mtp = [r for r in routers if r["part"] == "mtp"]
    assert len(decoder) == 3 and len(mtp) == 2
    assert len({r["key"] for r in routers}) == 5
    assert sorted(r["logged_as"] for r in mtp) == [4, 5]
    assert sorted(r["logged_as"] for r in decoder) == [1, 2, 3]
