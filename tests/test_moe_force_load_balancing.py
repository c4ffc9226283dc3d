"""--moe-router-force-load-balancing (Megatron-LM's benchmark switch: random router logits
from megatron-core's expert-parallel RNG stream) under Seq1F1B: it changes the routing, and
recomputing the MoE layers replays the same random logits, so the gradients are those of
the run that keeps the activations. (Split and unsplit runs draw different random logits,
as with dropout: their exactness is tested without the switch, tests/test_moe_exactness.py.)"""

import pytest

from distributed import GQA_ROPE_SWIGLU, TINY_MODEL, assert_close_series, run_configs

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

MOE = TINY_MODEL + GQA_ROPE_SWIGLU + [
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
    "--disable-bias-linear", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--pipeline-model-parallel-size", "2",
    "--seq1f1b-splits", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
    "--train-iters", "2", "--init-method-std", "0.2"]
RANDOM = MOE + ["--moe-router-force-load-balancing"]
RECOMPUTE_MOE = ["--recompute-granularity", "selective", "--recompute-modules", "moe"]


def test_random_routing_is_replayed_by_recomputation(tmp_path):
    results = run_configs(tmp_path, 2, [
        {"name": "random", "argv": RANDOM},
        {"name": "random_recomputed", "argv": RANDOM + RECOMPUTE_MOE},
        {"name": "learned", "argv": MOE},
    ])
    random, recomputed = results["random"], results["random_recomputed"]
    assert len(random["losses"]) == 2
    # the same draws in the forward and in the recomputation: the same step
    assert_close_series(recomputed["losses"], random["losses"], 1e-6, "loss")
    assert_close_series(recomputed["grad_norms"], random["grad_norms"], 1e-6, "grad norm")
    # the router's own choice is not what routes the tokens
    learned = results["learned"]
    assert abs(random["losses"][0] - learned["losses"][0]) > 1e-4 * learned["losses"][0]
    assert abs(random["grad_norms"][0] - learned["grad_norms"][0]) > 1e-3
