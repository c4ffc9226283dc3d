"""The router's random inputs of Megatron-LM under Seq1F1B: --moe-router-force-load-balancing
(its benchmark switch: random router logits from megatron-core's expert-parallel RNG
stream) and --moe-input-jitter-eps (Switch Transformer's multiplicative noise on the
router's input, from the default generator). Each changes the routing, and recomputing the
MoE layers replays the same draws, so the gradients are those of the run that keeps the
activations. (Split and unsplit runs draw different noise, as with dropout: their
exactness is tested without it, tests/test_moe_exactness.py.)"""

import pytest

from distributed import GQA_ROPE_SWIGLU, TINY_MODEL, assert_close_series, run_configs

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

MOE = TINY_MODEL + GQA_ROPE_SWIGLU + [
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
    "--disable-bias-linear", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--pipeline-model-parallel-size", "2",
    "--seq1f1b-splits", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
    "--train-iters", "2", "--init-method-std", "0.2"]
NOISE = {"random": ["--moe-router-force-load-balancing"],
         "jitter": ["--moe-input-jitter-eps", "0.5"]}
RECOMPUTE_MOE = ["--recompute-granularity", "selective", "--recompute-modules", "moe"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs = [{"name": "learned", "argv": MOE}]
    for name, flags in NOISE.items():
        runs += [{"name": name, "argv": MOE + flags},
                 {"name": f"{name}_recomputed", "argv": MOE + flags + RECOMPUTE_MOE}]
    return run_configs(tmp_path_factory.mktemp("router_noise"), 2, runs)


@pytest.mark.parametrize("name", NOISE)
def test_the_noise_is_replayed_by_recomputation(runs, name):
    kept, recomputed = runs[name], runs[f"{name}_recomputed"]
    assert len(kept["losses"]) == 2
    # the same draws in the forward and in the recomputation: the same step
    assert_close_series(recomputed["losses"], kept["losses"], 1e-6, "loss")
    assert_close_series(recomputed["grad_norms"], kept["grad_norms"], 1e-6, "grad norm")
    # and the noise changed what the router chose
    learned = runs["learned"]
    assert abs(kept["losses"][0] - learned["losses"][0]) > 1e-4 * learned["losses"][0]
    assert abs(kept["grad_norms"][0] - learned["grad_norms"][0]) > 1e-3
