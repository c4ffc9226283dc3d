"""--apply-residual-connection-post-layernorm computes Megatron-LM's legacy layer: the
residuals are the norms' outputs. A layer built from the trainer's spec (split-aware local
layers) against the formula evaluated with its own submodules, in a child process (the
layer needs megatron-core's parallel state); the trained runs under Seq1F1B splits are in
tests/test_model_flags_exactness.py. The flag's parsing is checked in-process."""

import subprocess
import sys

import pytest

from distributed import ROOT, _single_process_env
from megatron.trainer.arguments import ArgumentErrors, parse_args

BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
        "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "local"]

CHILD = r"""
import json, sys, torch
from megatron import cpu_support
cpu_support.apply()
torch.distributed.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0,
                                     world_size=1)
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
from megatron.trainer.arguments import parse_args
from megatron.trainer.model import gpt_model_provider, transformer_config_from_args

def layer_of(argv):
    args = parse_args(argv, world_size=1, cuda_available=False)
    args.padded_vocab_size = 128
    model = gpt_model_provider(args, transformer_config_from_args(args))
    return model.decoder.layers[0]

base = json.loads(sys.argv[1])
for norm in ("LayerNorm", "RMSNorm"):
    flags = base + ["--normalization", norm, "--swiglu"] * (norm == "RMSNorm")
    post = layer_of(flags + ["--apply-residual-connection-post-layernorm"])
    plain = layer_of(flags)
    for name, p in post.named_parameters():  # non-trivial norm weights and biases
        if "norm" in name:
            torch.nn.init.uniform_(p.data, 0.5, 1.5)
    # the same weights: the legacy names hold megatron-core's two norms
    state = {k.replace("input_norm.", "input_layernorm.")
              .replace("post_attention_norm.", "pre_mlp_layernorm."): v
             for k, v in post.state_dict().items() if "_extra_state" not in k}
    plain.load_state_dict(state, strict=False)
    x = torch.randn(16, 2, 32)
    with torch.no_grad():
        got = post(hidden_states=x, attention_mask=None)[0]
        xn = post.input_norm(x)
        attn, bias = post.self_attention(xn, attention_mask=None)
        y = xn + attn + (bias if bias is not None else 0)
        yn = post.post_attention_norm(y)
        mlp, bias = post.mlp(yn)
        expected = yn + mlp + (bias if bias is not None else 0)
        standard = plain(hidden_states=x, attention_mask=None)[0]
    names = sorted(n for n, _ in post.named_parameters() if "norm" in n)
    print(json.dumps({"norm": norm, "type": type(post).__name__, "names": names,
                      "error": (got - expected).abs().max().item(),
                      "from_standard": (got - standard).abs().max().item(),
                      "scale": expected.abs().max().item()}))
"""


@pytest.mark.distributed  # a child process: the layer needs megatron-core's parallel state
def test_residuals_are_the_norms_outputs(tmp_path):
    import json

    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(BASE),
                           str(tmp_path / "store")], cwd=ROOT, env=_single_process_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["norm"] for r in results] == ["LayerNorm", "RMSNorm"]
    for result in results:
        assert result["type"] == "PostNormResidualLayer"
        assert {n.split(".")[0] for n in result["names"]} == {"input_norm",
                                                              "post_attention_norm"}
        assert result["error"] <= 1e-6 * result["scale"], result
        # megatron-core's layer with the same weights computes something else
        assert result["from_standard"] > 1e-2 * result["scale"], result


def test_the_flag_needs_the_local_layers():
    args = parse_args(BASE + ["--apply-residual-connection-post-layernorm"], world_size=1,
                      cuda_available=False, check_files=False)
    assert args.apply_residual_connection_post_layernorm
    from megatron.trainer.checkpointing import MODEL_SHAPE_FLAGS

    assert "apply_residual_connection_post_layernorm" in MODEL_SHAPE_FLAGS
    te = [a for a in BASE if a not in ("--transformer-impl", "local")]
    with pytest.raises(ArgumentErrors) as error:
        parse_args(te + ["--transformer-impl", "transformer_engine",
                         "--apply-residual-connection-post-layernorm"], world_size=1,
                   cuda_available=True, check_files=False)
    assert any("--apply-residual-connection-post-layernorm needs --transformer-impl local"
               in problem for problem in error.value.problems), error.value.problems
