"""--save-wgrads-interval and --save-params-interval (as Megatron-LM): the files a user
compares to check the schedules' exactness. Seq1F1B's gradients and parameters, written
per pipeline stage, equal 1F1B's tensor by tensor; under the distributed optimizer every
gradient is written whole (reduced over the data-parallel ranks, as without it)."""

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
