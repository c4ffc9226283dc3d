"""--attention-output-gate (Qwen3-Next) and --qk-l2-norm (Llama-4): Megatron-LM 0.19's
flags reach megatron-core's config and spec; their exactness under splits is the
"qwen3-gate" and "qwen3-l2norm" recipes of tests/test_model_flags_exactness.py."""

import pytest
from megatron.core.transformer.torch_norm import L2Norm

from megatron_lm_parser import megatron_lm_args
from megatron.trainer.arguments import ArgumentErrors, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "8", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"]


def args_of(*flags):
    return parse_args(BASE + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


@pytest.mark.parametrize("flag, field", [("--attention-output-gate", "attention_output_gate"),
                                         ("--qk-l2-norm", "qk_l2_norm")])
def test_flag_reaches_the_config_as_in_megatron_lm(flag, field):
    from megatron.trainer.model import transformer_config_from_args

    assert getattr(transformer_config_from_args(args_of(flag)), field) is True
    assert getattr(transformer_config_from_args(args_of()), field) is False
    megatron_lm = megatron_lm_args([flag])
    if megatron_lm is not None:
        assert getattr(megatron_lm, field) is True


def test_l2_norm_takes_the_qk_norms_place_in_the_spec():
    from megatron.seqsplit.model import _split_aware_layer_spec

    args = args_of("--qk-l2-norm", "--qk-layernorm")
    assert any("--qk-layernorm has no effect with --qk-l2-norm" in n for n in args.flag_notes)
    for l2 in (True, False):
        spec = _split_aware_layer_spec("RMSNorm", "auto", "buffer", True, qk_l2_norm=l2)
        attention = spec.submodules.self_attention.submodules
        assert (attention.q_layernorm is L2Norm) == l2 and (attention.k_layernorm is L2Norm) == l2


@pytest.mark.parametrize("flag", ["--attention-output-gate", "--qk-l2-norm"])
def test_mla_stops_with_the_reason(flag):
    with pytest.raises(ArgumentErrors) as error:
        args_of(flag, *MLA)
    assert f"{flag} is not supported with --multi-latent-attention" in str(error.value)


def test_the_gate_counts_in_the_model_shape_and_the_checkpoint():
    from megatron.model_shape import ModelShape
    from megatron.trainer.checkpointing import model_shape

    plain = ModelShape.from_args(args_of(), vocab_size=128)
    gated = ModelShape.from_args(args_of("--attention-output-gate"), vocab_size=128)
    assert gated.attention_linear_params() - plain.attention_linear_params() == 32 * 32
    shape = model_shape(args_of("--attention-output-gate", "--qk-l2-norm"))
    assert shape["attention_output_gate"] is True and shape["qk_l2_norm"] is True
