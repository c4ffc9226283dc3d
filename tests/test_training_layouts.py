"""Foundation: every parallel layout trains the same model to the same losses.

A single-process pp=1 run is the reference; pp=2, pp=4, tp=2, tp=2 x pp=2, dp=2 and
pp=2 x dp=2 in both of Megatron-LM's rank orders start from the same iteration-0 checkpoint (resharded by megatron-core's
dist_checkpointing) and must print the same per-iteration losses and grad norms
(relative 1e-5, fp32) and end with the same parameters.
"""

import pytest

from distributed import (
    TINY_MODEL,
    Plan,
    assert_close_series,
    assert_params_close,
    init_run,
)

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

FLAGS = TINY_MODEL + ["--global-batch-size", "8", "--micro-batch-size", "2",
                      "--train-iters", "3", "--clip-grad", "1.0", "--weight-decay", "0.01"]


DROPOUT = ["--hidden-dropout", "0.1"]


def plan(tmp, corpus):
    """The runs (tests/conftest.py's `exactness_runs` trains them with the other
    exactness suites')."""
    init, load = init_run("init", tmp / "init_ckpt", FLAGS)
    start = FLAGS + load

    def run(name, extra):
        return {"name": name, "argv": start + extra, "params": True}

    return Plan([init], {
        1: [run("pp1", [])],
        2: [run("pp2", ["--pipeline-model-parallel-size", "2"]),
            run("tp2", ["--tensor-model-parallel-size", "2"]),
            run("dp2", []),
            run("dp2_distopt", ["--use-distributed-optimizer"]),
            # --data-parallel-random-init: rank 1 draws other dropout masks (rank 0's seed
            # is --seed's; the weights are rank 0's, broadcast, as always here)
            run("dp2_dropout", DROPOUT),
            run("dp2_dropout_random_init", DROPOUT + ["--data-parallel-random-init"])],
        4: [run("pp4", ["--pipeline-model-parallel-size", "4"]),
            run("tp2pp2", ["--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2"]),
            run("pp2dp2", ["--pipeline-model-parallel-size", "2"]),
            # Megatron-LM's other rank order: consecutive ranks form a pipeline
            run("pp2dp2_tp_pp_dp_mapping", ["--pipeline-model-parallel-size", "2",
                                            "--use-tp-pp-dp-mapping"])],
    })


@pytest.fixture(scope="module")
def layouts(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.parametrize("layout", ["pp2", "tp2", "dp2", "dp2_distopt", "pp4", "tp2pp2",
                                    "pp2dp2", "pp2dp2_tp_pp_dp_mapping"])
def test_layout_matches_single_process(layouts, layout):
    reference, run = layouts["pp1"], layouts[layout]
    assert len(reference["losses"]) == 3
    assert_close_series(run["losses"], reference["losses"], 1e-5, f"{layout} loss")
    assert_close_series(run["grad_norms"], reference["grad_norms"], 1e-5, f"{layout} grad norm")
    assert_params_close(run["params"], reference["params"])


def test_training_moves_the_loss(layouts):
    losses = layouts["pp1"]["losses"]
    assert len(set(losses)) == 3  # a frozen model would make every comparison vacuous


def test_rank_orders_as_megatron_lm(layouts):
    """Global ranks 0..3 at pp=2 x dp=2: by default data parallelism inside each stage
    (stages 0, 0, 1, 1); with --use-tp-pp-dp-mapping each pipeline on consecutive ranks
    (0, 1, 0, 1), as Megatron-LM orders them. Both train like one process (above)."""
    assert layouts["pp2dp2"]["pipeline_ranks"] == [0, 0, 1, 1]
    assert layouts["pp2dp2_tp_pp_dp_mapping"]["pipeline_ranks"] == [0, 1, 0, 1]


def test_data_parallel_random_init_seeds_each_rank(layouts):
    """--data-parallel-random-init: data-parallel rank 1 draws other dropout masks than
    without the flag."""
    plain, seeded = layouts["dp2_dropout"]["losses"], layouts["dp2_dropout_random_init"]["losses"]
    assert plain[0] != seeded[0] and len(plain) == len(seeded) == 3
    assert plain != layouts["dp2"]["losses"]  # dropout is on
