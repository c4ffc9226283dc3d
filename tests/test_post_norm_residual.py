"""--apply-residual-connection-post-layernorm computes Megatron-LM's legacy layer: the
residuals are the norms' outputs. A layer built from the trainer's spec (split-aware local
layers) against the formula evaluated with its own submodules, in a child process (the
layer needs megatron-core's parallel state); the trained runs under Seq1F1B splits are in
tests/test_model_flags_exactness.py. The flag's parsing is checked in-process."""

import pytest

from distributed import ONE_LAYER, run_layer_child
from megatron.trainer.arguments import ArgumentErrors, parse_args

BASE = ONE_LAYER

CHILD = r"""
def layer_of(argv):
    return model_of(argv).decoder.layers[0]

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
def test_residuals_are_the_norms_outputs():
    results = run_layer_child(CHILD, BASE)
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
