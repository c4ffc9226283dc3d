"""--moe-use-upcycling (Megatron-LM's): a dense model's checkpoint becomes an MoE model
through megatron-core's upcycling, is saved as iteration 1 and trains on, here at pp=2 with
Seq1F1B splits. With granularity 1 every expert is the dense MLP and the router's weights
(softmax over the top-k) sum to 1, so the upcycled model computes what the dense one did:
its validation loss before any MoE step equals the dense run's. A finer granularity
(experts of half the FFN, twice as many chosen) trains on; the refusals name the flag."""

import pytest

from distributed import TINY_MODEL, TRACKER, one_error_line, pretrain, run_configs
from megatron.trainer.arguments import ArgumentErrors, parse_args

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

BASE = TINY_MODEL + ["--global-batch-size", "2", "--eval-iters", "1", "--eval-interval", "1000"]
FFN = 128  # TINY_MODEL's default: 4 x hidden 32
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
SPLIT = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]


def test_upcycled_model_starts_as_the_dense_one_and_trains_on(tmp_path):
    dense, moe, fine = (tmp_path / name for name in ("dense", "moe", "fine"))
    runs = run_configs(tmp_path, 1, [{"name": "dense", "argv": BASE + [
        "--train-iters", "2", "--save", str(dense), "--save-interval", "2"]}])
    upcycle = BASE + ["--load", str(dense), "--moe-use-upcycling", "--save-interval", "10"]
    runs.update(run_configs(tmp_path, 2, [
        {"name": "moe", "argv": upcycle + MOE + SPLIT + [
            "--moe-ffn-hidden-size", str(FFN), "--train-iters", "1", "--save", str(moe)]},
        # experts of half the dense FFN, 8 of them, 4 chosen per token
        {"name": "fine", "argv": upcycle + SPLIT + [
            "--num-experts", "8", "--moe-router-topk", "4", "--moe-upcycling-granularity", "2",
            "--moe-ffn-hidden-size", str(FFN // 2), "--train-iters", "3", "--save",
            str(fine)]}]))
    expected = runs["dense"]["final_validation_loss"]
    got = runs["moe"]["final_validation_loss"]
    assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
    assert runs["moe"]["losses"] == []  # iteration 1 is the upcycled checkpoint itself
    assert (moe / TRACKER).read_text().strip() == "1"
    # the finer experts train on from iteration 1: iterations 2 and 3
    assert len(runs["fine"]["losses"]) == 2
    assert all(loss == loss and loss < 10 for loss in runs["fine"]["losses"])
    assert (fine / TRACKER).read_text().strip() == "3"

    # a second start with the flag would convert again over the run's own checkpoints
    again = pretrain(upcycle + MOE + ["--moe-ffn-hidden-size", str(FFN), "--train-iters", "2",
                                      "--save", str(moe)])
    assert again.returncode != 0
    assert one_error_line(again.stderr) == (
        f"error: --moe-use-upcycling: --save {moe} already holds a checkpoint; upcycling is "
        f"for the first run only: drop --moe-use-upcycling to resume it (--load {moe})")


@pytest.mark.parametrize("flags, problem", [
    ([], "--moe-use-upcycling needs --load DIR, the dense model's checkpoint"),
    (["--load", "x"], "--moe-use-upcycling needs --save DIR (as in Megatron-LM)"),
    (["--load", "x", "--save", "y", "--save-interval", "1", "--moe-upcycling-granularity",
      "3"], "--moe-upcycling-granularity 3 must be >= 1 and divide --num-experts (4)"),
    (["--load", "x", "--save", "y", "--save-interval", "1", "--moe-layer-freq", "[0,1,1,1]"],
     "--moe-use-upcycling converts every layer's MLP into experts"),
])
def test_what_upcycling_cannot_convert_stops_before_work(flags, problem):
    with pytest.raises(ArgumentErrors) as error:
        parse_args(BASE + MOE + ["--train-iters", "1", "--moe-use-upcycling"] + flags)
    assert any(line.startswith(problem) for line in error.value.problems), error.value.problems
