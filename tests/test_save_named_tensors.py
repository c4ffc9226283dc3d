"""--save-wgrads-interval and --save-params-interval (as Megatron-LM): the files a user
compares to check the schedules' exactness. Seq1F1B's gradients and parameters, written
per pipeline stage, equal 1F1B's tensor by tensor; under the distributed optimizer every
gradient is written whole (reduced over the data-parallel ranks, as without it).
--save-activations-interval and --save-dgrads-interval: the last microbatch's linear
layers' and routers' inputs, outputs and their gradients; Seq1F1B's, its splits joined,
equal 1F1B's, also with full recomputation and with MoE routers."""

import pytest
import torch

from distributed import TINY_MODEL, run_configs
from megatron.trainer.arguments import ArgumentErrors, parse_args

FLAGS = TINY_MODEL + ["--global-batch-size", "4", "--micro-batch-size", "1",
                      "--train-iters", "2", "--save-interval", "100",
                      "--save-wgrads-interval", "1", "--save-params-interval", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _tensors(root, label, iteration, name):
    return torch.load(root / label / f"iter_{iteration:07d}" / f"{name}.pth")


def _assert_same(actual, expected, label):
    """Gradients within 1e-5 of each tensor's largest element (the sums run in another
    order); parameters after Adam's steps as tests/distributed.assert_params_close
    compares them (near-zero gradients' steps differ in their last bits)."""
    assert actual.keys() == expected.keys() == {"model_chunk0"}
    actual, expected = actual["model_chunk0"], expected["model_chunk0"]
    assert actual.keys() == expected.keys() and actual
    for name, tensor in expected.items():
        if label == "wgrads":
            close = (actual[name] - tensor).abs().max() <= 1e-5 * tensor.abs().max()
        else:
            close = torch.allclose(actual[name], tensor, rtol=1e-5, atol=1e-6)
        assert close, f"{label} {name}"


@pytest.mark.distributed
def test_seq1f1b_writes_the_gradients_and_parameters_of_1f1b(tmp_path):
    runs = {"f1b": PP2, "s4": PP2 + ["--seq1f1b-splits", "4"], "dp2": [],
            "dp2_distopt": ["--use-distributed-optimizer"]}
    run_configs(tmp_path, 2, [{"name": name, "argv": FLAGS + flags + [
        "--save", str(tmp_path / name)]} for name, flags in runs.items()])
    f1b, s4 = tmp_path / "f1b", tmp_path / "s4"
    # one file per pipeline stage (Megatron-LM's names); params every 2nd iteration only
    assert sorted(p.name for p in (f1b / "wgrads" / "iter_0000001").iterdir()) == [
        "mp_rank_00_000.pth", "mp_rank_00_001.pth"]
    assert not (f1b / "params" / "iter_0000001").exists()
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):
        for label, iteration in (("wgrads", 1), ("wgrads", 2), ("params", 2)):
            expected = _tensors(f1b, label, iteration, stage)
            _assert_same(_tensors(s4, label, iteration, stage), expected, label)
        grads = _tensors(f1b, "wgrads", 1, stage)["model_chunk0"]
        assert all(grad.abs().sum() > 0 for grad in grads.values())
    # the distributed optimizer reduce-scatters: rank 0 would hold half the gradients
    # reduced; the written ones are whole, as the plain optimizer's
    for iteration in (1, 2):
        _assert_same(_tensors(tmp_path / "dp2_distopt", "wgrads", iteration, "mp_rank_00"),
                     _tensors(tmp_path / "dp2", "wgrads", iteration, "mp_rank_00"), "wgrads")


ACTIVATIONS = TINY_MODEL + ["--global-batch-size", "4", "--micro-batch-size", "1",
                            "--train-iters", "1", "--save-interval", "100",
                            "--save-activations-interval", "1", "--save-dgrads-interval", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]


@pytest.mark.distributed
def test_seq1f1b_writes_the_activations_and_dgrads_of_1f1b(tmp_path):
    runs = {"f1b": PP2, "s4": PP2 + ["--seq1f1b-splits", "4"],
            "s3_recompute": PP2 + ["--seq1f1b-splits", "3"] + RECOMPUTE,
            "moe_f1b": PP2 + MOE, "moe_s4": PP2 + MOE + ["--seq1f1b-splits", "4"]}
    run_configs(tmp_path, 2, [{"name": name, "argv": ACTIVATIONS + flags + [
        "--save", str(tmp_path / name)]} for name, flags in runs.items()])
    for reference, split in (("f1b", "s4"), ("f1b", "s3_recompute"), ("moe_f1b", "moe_s4")):
        for label in ("activations", "dgrads"):
            for stage in ("mp_rank_00_000", "mp_rank_00_001"):
                expected = _tensors(tmp_path / reference, label, 1, stage)["model_chunk0"]
                actual = _tensors(tmp_path / split, label, 1, stage)["model_chunk0"]
                assert actual.keys() == expected.keys() and expected, (split, label, stage)
                for key, tensor in expected.items():
                    assert actual[key].shape == tensor.shape, (split, label, key)
                    if tensor.is_floating_point():
                        scale = tensor.abs().max().clamp(min=1e-30)
                        assert (actual[key] - tensor).abs().max() <= 1e-5 * scale, (
                            split, label, key)
                    else:  # a router's routing map
                        assert torch.equal(actual[key], tensor), (split, label, key)
    f1b = _tensors(tmp_path / "f1b", "activations", 1, "mp_rank_00_000")["model_chunk0"]
    # the last microbatch's whole sequence (48 tokens, [s, b, h]) of each linear layer
    assert f1b["decoder.layers.0.self_attention.linear_qkv/input0"].shape[0] == 48
    routers = _tensors(tmp_path / "moe_s4", "dgrads", 1, "mp_rank_00_001")["model_chunk0"]
    # (a stage's modules are named locally: its layers are decoder.layers.0 and 1)
    assert "decoder.layers.1.mlp.router/input0" in routers


@pytest.mark.parametrize("flags, message", [
    (["--save-wgrads-interval", "1"],
     "--save-wgrads-interval writes its files under --save DIR/wgrads: give --save"),
    (["--save-params-interval", "0", "--save", "x", "--save-interval", "1"],
     "--save-params-interval must be >= 1, got 0"),
    (["--save-params-interval", "1", "--save", "x", "--save-interval", "1",
      "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce"],
     "--save-params-interval with --overlap-param-gather: the parameters after the step"),
])
def test_flag_errors(flags, message):
    with pytest.raises(ArgumentErrors) as errors:
        parse_args(TINY_MODEL + ["--train-iters", "2", "--global-batch-size", "2"] + flags,
                   world_size=2, cuda_available=False, check_files=False)
    assert message in str(errors.value)
