"""The MLP's GeLU is the one Megatron-LM computes. Megatron-LM fuses bias and GeLU by
default (``--bias-gelu-fusion``) in a GeLU MLP with biased linear layers, and the fused
kernel (megatron-core's ``bias_gelu``) is GeLU's tanh approximation; without biases, or
with ``--no-bias-gelu-fusion``, it runs the exact (erf) GeLU. The trainer's MLP against
megatron-core's own fused MLP with the same weights, in a child process (the layers need
megatron-core's parallel state); the flag's parsing and the checkpoint's record of it
in-process."""

import pytest
import torch.nn.functional as F

from distributed import ONE_LAYER, run_layer_child
from megatron.trainer import model as trainer_model
from megatron.trainer.arguments import parse_args
from megatron.trainer.checkpointing import model_shape, with_legacy_gelu

BASE = ONE_LAYER

CHILD = r"""
import torch.nn.functional as F

def megatron_lm_fusion(config):  # what Megatron-LM builds: megatron-core's bias+GeLU kernel
    config.bias_activation_fusion, config.activation_func = True, F.gelu

def mlp_of(argv, fused=False):
    return model_of(argv, megatron_lm_fusion if fused else lambda config: None
                    ).decoder.layers[0].mlp

def run(mlp, x):
    x = x.clone().requires_grad_(True)
    out, bias = mlp(x)
    out = out + (bias if bias is not None else 0)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad, mlp.linear_fc1.weight.grad

base = json.loads(sys.argv[1])
fused = mlp_of(base, fused=True)
# inputs where tanh and erf GeLU differ visibly
x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0)) * 3
expected = run(fused, x)
for name, flags in (("default", []), ("no-fusion", ["--no-bias-gelu-fusion"])):
    ours = mlp_of(base + flags)
    ours.load_state_dict(fused.state_dict())
    got = run(ours, x)
    print(json.dumps({"flags": name, "activation": ours.activation_func.__name__,
                      "fused_path": bool(ours.config.bias_activation_fusion),
                      "errors": [(g - e).abs().max().item() for g, e in zip(got, expected)],
                      "scales": [e.abs().max().item() for e in expected]}))
"""


@pytest.mark.distributed  # a child process: the layers need megatron-core's parallel state
def test_mlp_computes_megatron_lm_fused_bias_gelu():
    results = {r["flags"]: r for r in run_layer_child(CHILD, BASE)}
    default, unfused = results["default"], results["no-fusion"]
    # our unfused tanh GeLU: megatron-core's fused kernel's values and gradients
    assert default["activation"] == "tanh_gelu" and not default["fused_path"]
    for error, scale in zip(default["errors"], default["scales"]):
        assert error <= 1e-6 * scale, default
    # --no-bias-gelu-fusion: the exact GeLU, which the fused kernel does not compute
    assert unfused["activation"] == "gelu"
    assert max(e / s for e, s in zip(unfused["errors"], unfused["scales"])) > 5e-5, unfused


def args_of(*flags):
    return parse_args(BASE + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


def test_which_gelu_as_megatron_lm():
    """Megatron-LM: bias_activation_fusion = --bias-gelu-fusion (default on), turned off
    without biased linear layers; SwiGLU and squared ReLU are other activations."""
    assert trainer_model.activation_func(args_of()) is trainer_model.tanh_gelu
    assert trainer_model.activation_func(args_of("--no-bias-gelu-fusion")) is F.gelu
    assert trainer_model.activation_func(args_of("--disable-bias-linear")) is F.gelu
    assert trainer_model.activation_func(args_of("--swiglu")) is F.silu
    assert trainer_model.activation_func(args_of("--swiglu", "--no-bias-gelu-fusion")) is F.silu


def test_checkpoints_record_which_gelu():
    assert model_shape(args_of())["bias_gelu_fusion"] is True
    assert model_shape(args_of("--no-bias-gelu-fusion"))["bias_gelu_fusion"] is False
    # where the flag changes nothing it is not recorded, so it never stops a resume
    assert "bias_gelu_fusion" not in model_shape(args_of("--swiglu"))
    assert "bias_gelu_fusion" not in model_shape(args_of("--disable-bias-linear"))
    # checkpoints saved before the flag was honoured trained the exact GeLU
    old = {k: v for k, v in model_shape(args_of()).items() if k != "bias_gelu_fusion"}
    assert with_legacy_gelu(old)["bias_gelu_fusion"] is False
    old_swiglu = {k: v for k, v in model_shape(args_of("--swiglu")).items()}
    assert "bias_gelu_fusion" not in with_legacy_gelu(old_swiglu)
    assert with_legacy_gelu({}) == {}
