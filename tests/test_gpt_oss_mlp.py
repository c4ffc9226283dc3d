"""gpt-oss's MLP as Megatron-LM builds it: --quick-geglu (a gated MLP with quick GeLU,
x * sigmoid(1.702 x)), --glu-linear-offset (added to the gate's linear half) and
--activation-func-clamp-value (the activation's input clamped from above, the linear
half to +-value). The trainer's MLP against the formula from its own weights, in a
child process (the layers need megatron-core's parallel state); the flags' checks and
records in-process. Exact under splits with MoE in tests/test_moe_exactness.py (G)."""

import pytest

from distributed import ONE_LAYER, run_layer_child
from megatron.trainer import model as trainer_model
from megatron.trainer.arguments import ArgumentErrors, parse_args
from megatron.trainer.checkpointing import model_shape

GPT_OSS = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value",
           "7.0", "--disable-bias-linear"]

CHILD = r"""
def reference(mlp, x, offset, clamp):
    # gpt-oss's gated activation on megatron-core's layout: fc1's output in two halves,
    # the activated one first
    h = x @ mlp.linear_fc1.weight.t()
    gate, linear = torch.chunk(h, 2, dim=-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
    return (gate * torch.sigmoid(1.702 * gate) * (linear + offset)) @ mlp.linear_fc2.weight.t()

base = json.loads(sys.argv[1])
# inputs large enough that the clamp at 7 cuts some of fc1's outputs
x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0)) * 40
for name, flags, offset, clamp in (
        ("gpt-oss", ["--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0"],
         1.0, 7.0),
        ("plain", [], 0.0, None)):
    mlp = model_of(base + ["--quick-geglu", "--disable-bias-linear"] + flags
                   ).decoder.layers[0].mlp
    out, bias = mlp(x)
    expected = reference(mlp, x, offset, clamp)
    h = x @ mlp.linear_fc1.weight.t()
    print(json.dumps({"name": name, "error": (out - expected).abs().max().item(),
                      "scale": expected.abs().max().item(), "bias": bias is not None,
                      "fc1_rows": mlp.linear_fc1.weight.shape[0],
                      "clamped": (h.abs() > 7).float().mean().item(),
                      "unclamped_error": (out - reference(mlp, x, offset, None)
                                          ).abs().max().item()}))
"""


@pytest.mark.distributed  # a child process: the layers need megatron-core's parallel state
def test_mlp_computes_gpt_oss_activation():
    results = {r["name"]: r for r in run_layer_child(CHILD, ONE_LAYER)}
    for name, r in results.items():
        assert r["fc1_rows"] == 2 * 128, r  # gated: fc1 twice the FFN width (4h = 128)
        assert not r["bias"]
        assert r["error"] <= 1e-6 * r["scale"], (name, r)
    oss = results["gpt-oss"]
    # the clamp is in effect on these inputs: without it the values differ
    assert oss["clamped"] > 0.05 and oss["unclamped_error"] > 1e-3 * oss["scale"], oss


def args_of(*flags):
    return parse_args(ONE_LAYER + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


def test_flags_reach_the_config():
    config = trainer_model.transformer_config_from_args(args_of(*GPT_OSS))
    assert config.gated_linear_unit and config.activation_func.__name__ == "quick_gelu"
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    plain = trainer_model.transformer_config_from_args(args_of("--disable-bias-linear"))
    assert (plain.glu_linear_offset, plain.activation_func_clamp_value) == (0.0, None)


@pytest.mark.parametrize("flags, message", [
    (["--quick-geglu", "--swiglu"], "--quick-geglu is another MLP activation than --swiglu"),
    (["--glu-linear-offset", "1.0"], "--glu-linear-offset shapes --quick-geglu's gated MLP"),
    (["--swiglu", "--activation-func-clamp-value", "7"],
     "--activation-func-clamp-value shapes --quick-geglu's gated MLP"),
    (["--quick-geglu", "--activation-func-clamp-value", "0"],
     "--activation-func-clamp-value must be > 0, got 0.0"),
])
def test_mistakes_are_named(flags, message):
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags)
    assert [p for p in error.value.problems if message in p], error.value.problems


def test_checkpoints_record_the_activation():
    shape = model_shape(args_of(*GPT_OSS))
    assert (shape["quick_geglu"], shape["glu_linear_offset"],
            shape["activation_func_clamp_value"]) == (True, 1.0, 7.0)
    assert "bias_gelu_fusion" not in shape  # not a GeLU MLP
