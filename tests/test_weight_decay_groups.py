"""Which parameters get weight decay, as Megatron-LM decides it (megatron-core's
optimizer groups): none for 1-D weights and biases (norms included), and with
--apply-wd-to-qk-layernorm (Qwen3-Next; the deprecated --no-weight-decay-cond-type
apply_wd_to_qk_layernorm) also for the query/key norms' parameters. The trainer's optimizer
over its model in a child process (megatron-core's parallel state)."""

import pytest

from distributed import ONE_LAYER, run_layer_child
from megatron.trainer.arguments import parse_args

CHILD = r"""
from megatron.trainer.training import build_model, build_optimizer

base = json.loads(sys.argv[1])
for name, flags in (("default", []), ("qk", ["--apply-wd-to-qk-layernorm"]),
                    ("deprecated", ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"])):
    args = parse_args(base + ["--qk-layernorm", "--weight-decay", "0.1"] + flags,
                      world_size=1, cuda_available=False)
    args.padded_vocab_size = 128
    model = build_model(args, transformer_config_from_args(args), gpt_model_provider)
    optimizer, _ = build_optimizer(args, model)
    names = {id(p): n for n, p in model[0].named_parameters()}
    decayed = sorted(names[id(p)] for group in optimizer.param_groups
                     if group["wd_mult"] > 0 for p in group["params"])
    print(json.dumps({"name": name, "decayed": decayed}))
"""


@pytest.mark.distributed  # a child process: the model needs megatron-core's parallel state
def test_qk_norms_get_weight_decay_only_with_the_flag():
    results = {r["name"]: set(r["decayed"]) for r in run_layer_child(CHILD, ONE_LAYER)}
    qk_norms = {n for n in results["qk"] if "q_layernorm" in n or "k_layernorm" in n}
    # megatron-core's rule: the q/k norms' parameters (LayerNorm here: weight and bias)
    assert {n.rsplit(".", 2)[-2:][0] + "." + n.rsplit(".", 1)[1] for n in qk_norms} == {
        "q_layernorm.weight", "q_layernorm.bias", "k_layernorm.weight", "k_layernorm.bias"}
    assert results["qk"] == results["default"] | qk_norms
    assert not any("layernorm" in n or n.endswith(".bias") for n in results["default"])
    assert any(n.endswith("linear_qkv.weight") for n in results["default"])
    assert results["deprecated"] == results["qk"]


def test_the_flag_without_qk_norms_is_noted():
    args = parse_args(ONE_LAYER + ["--apply-wd-to-qk-layernorm"], world_size=1,
                      cuda_available=False, check_files=False)
    assert ("note: --apply-wd-to-qk-layernorm without --qk-layernorm: there are no query/key "
            "norms, it has no effect") in args.flag_notes
