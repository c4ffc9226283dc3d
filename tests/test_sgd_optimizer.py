"""--optimizer sgd (megatron-core's SGD with --sgd-momentum) trains the unsplit model's
steps under every schedule, and its momentum survives a checkpoint.

From a shared iteration-0 checkpoint, 4 iterations of SGD (momentum 0.9, weight decay,
clipping) in one process are the reference; Seq1F1B at pp 2 with 2 splits and dp 2
must print the same losses and grad norms and end with the same parameters. A run
saved at iteration 2 by Seq1F1B (pp 2) and resumed in another layout (dp 2) must go on
with the reference's losses: iteration 4's loss depends on the momentum saved at 2.
"""

import pytest

from distributed import (
    GQA_ROPE_SWIGLU,
    TINY_MODEL,
    TRACKER,
    Plan,
    assert_close_series,
    assert_params_close,
    init_run,
)

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

MODEL = TINY_MODEL + GQA_ROPE_SWIGLU
# a learning rate at which SGD moves the loss in a few steps (Adam's 1e-3 would not)
SGD = ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.5", "--weight-decay", "0.01",
       "--clip-grad", "1.0", "--global-batch-size", "8", "--micro-batch-size", "2",
       "--train-iters", "4"]
PP2_S2 = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]


def plan(tmp, corpus):
    init, load = init_run("init", tmp / "init_ckpt", MODEL)
    start = MODEL + SGD + load
    saved = tmp / "saved_at_2"

    def run(name, extra, **more):
        return {"name": name, "argv": start + extra, "params": True, **more}

    return Plan([init], {
        1: [run("pp1", [])],
        2: [run("pp2_s2", PP2_S2),
            run("dp2", []),
            run("first_half", PP2_S2 + ["--save", str(saved), "--save-interval", "2",
                                        "--exit-interval", "2"],
                writes=str(saved / TRACKER)),
            # with its optimizer state and RNG (the runs above load the init's weights only)
            {"name": "second_half", "argv": MODEL + SGD + ["--load", str(saved)],
             "params": True, "after": [str(saved / TRACKER)]}],
    })


@pytest.fixture(scope="module")
def runs(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.parametrize("layout", ["pp2_s2", "dp2"])
def test_sgd_matches_one_process(runs, layout):
    reference, run = runs["pp1"], runs[layout]
    assert len(reference["losses"]) == 4
    assert_close_series(run["losses"], reference["losses"], 1e-5, f"{layout} loss")
    assert_close_series(run["grad_norms"], reference["grad_norms"], 1e-5,
                        f"{layout} grad norm")
    assert_params_close(run["params"], reference["params"])


def test_sgd_trains(runs):
    losses = runs["pp1"]["losses"]
    # not a frozen model (mock data is random tokens: the loss falls slowly)
    assert len(set(losses)) == 4 and losses[-1] < losses[0] - 0.01, losses


def test_momentum_survives_a_checkpoint(runs):
    reference = runs["pp1"]
    assert_close_series(runs["first_half"]["losses"], reference["losses"][:2], 1e-5,
                        "before the save")
    assert_close_series(runs["second_half"]["losses"], reference["losses"][2:], 1e-5,
                        "after the resume")
    assert_params_close(runs["second_half"]["params"], reference["params"])
