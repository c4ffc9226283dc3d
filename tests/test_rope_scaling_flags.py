"""RoPE's per-layer and long-context flags of standard attention
(megatron/trainer/rope_arguments.py): --no-rope-freq, --rotary-seq-len-interpolation-factor
and --position-embedding-type yarn with its flags reach the config and the model as
Megatron-LM sets them, YaRN at a split's offset is the
unsplit embedding's slice, and the combinations Megatron-LM would silently ignore stop.
In-process; the trained runs (split against unsplit, and YaRN against plain RoPE) are in
tests/test_model_flags_exactness.py."""

import types

import pytest
import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_get_concentration_factor_from_config,
)

from megatron.trainer import model as trainer_model
from megatron.trainer.arguments import ArgumentErrors, parse_args
from megatron_lm_parser import megatron_lm_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1"]
YARN = ["--position-embedding-type", "yarn"]
MLA = ["--multi-latent-attention", "--position-embedding-type", "rope", "--kv-lora-rank", "8",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"]


def args_of(*flags):
    return parse_args(BASE + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


def megatron_lm_yarn_attributes(flags):
    """What Megatron-LM 0.19's own code sets on the config for these flags, or None where
    this megatron-core ships no megatron/training (0.16.1) or no such code (0.18)."""
    parsed = megatron_lm_args(flags)  # imports megatron/training where it exists
    if parsed is None:
        return None
    try:
        from megatron.training.argument_utils import _apply_yarn_config_from_args
    except ImportError:
        return None

    config = types.SimpleNamespace()
    _apply_yarn_config_from_args(config, parsed)
    return vars(config)


@pytest.mark.parametrize("flags, expected", [
    (YARN, {"yarn_rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": 4096,
            "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 1.0,
            "yarn_mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": True}),
    (YARN + ["--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "32768",
             "--yarn-beta-fast", "16", "--yarn-beta-slow", "2", "--mscale", "0.7",
             "--mscale-all-dim", "0.5", "--no-yarn-correction-range-round-to-int"],
     {"yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 32768,
      "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0, "yarn_mscale": 0.7,
      "yarn_mscale_all_dim": 0.5, "yarn_correction_range_round_to_int": False}),
])
def test_yarn_sets_the_config_as_megatron_lm(flags, expected):
    config = trainer_model.transformer_config_from_args(args_of(*flags))
    ours = {name: getattr(config, name) for name in expected}
    assert ours == expected
    theirs = megatron_lm_yarn_attributes(flags)
    if theirs is not None:  # CI's megatron-core 0.19.2 pass
        assert ours == theirs
    # the attention multiplies RoPE's cos and sin by YaRN's concentration factor
    scale = 4.0 if "4" in flags else 1.0
    factor = _yarn_get_concentration_factor_from_config(config)
    if scale == 1.0:
        assert factor == 1.0
    else:
        assert factor == pytest.approx((0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1)
                                       / (0.1 * 0.5 * torch.log(torch.tensor(4.0)).item() + 1))


def test_standard_rope_sets_no_yarn_attributes():
    config = trainer_model.transformer_config_from_args(args_of(
        "--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "4"))
    assert not [name for name in vars(config) if name.startswith("yarn_")]
    assert _yarn_get_concentration_factor_from_config(config) == 1.0


@pytest.mark.parametrize("flags, position, factor", [
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "4"],
     "rope", 4),
    (YARN + ["--rotary-scaling-factor", "8"], "yarn", None),
])
def test_the_model_gets_the_position_embedding(monkeypatch, flags, position, factor):
    seen = {}
    monkeypatch.setattr(trainer_model, "SeqSplitGPTModel", lambda **kw: seen.update(kw))
    monkeypatch.setattr(trainer_model, "layer_spec", lambda *a, **k: None)
    args = args_of(*flags)
    args.padded_vocab_size = 128
    trainer_model.gpt_model_provider(args, trainer_model.transformer_config_from_args(args))
    assert seen["position_embedding_type"] == position
    assert seen["seq_len_interpolation_factor"] == factor


def test_yarn_at_a_split_offset_is_the_unsplit_slice(monkeypatch):
    """What SeqSplitGPTModel hands a split (the embedding from its offset) equals the
    whole sequence's embedding at those positions, bitwise, with the same factor."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    yarn = YarnRotaryEmbedding(16, rotary_base=10000, scaling_factor=4.0,
                               original_max_position_embeddings=8, use_cpu_initialization=True)
    whole, whole_factor = yarn.get_emb(24)
    assert whole_factor != 1.0  # scaling factor 4: the attention scales cos and sin
    offset = 0
    for length in (5, 11, 8):
        part, factor = yarn(length, offset=offset)  # the module call SeqSplitGPTModel makes
        assert factor == whole_factor
        assert torch.equal(part, whole[offset:offset + length])
        offset += length


@pytest.mark.parametrize("flags, message", [
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0"],
     "--rotary-seq-len-interpolation-factor must be >= 1 (positions are divided by it), got 0"),
    (["--rotary-seq-len-interpolation-factor", "2"],
     "--rotary-seq-len-interpolation-factor scales RoPE: it needs --position-embedding-type "
     "rope, not learned_absolute"),
    (YARN + ["--rotary-seq-len-interpolation-factor", "2"],
     "--rotary-seq-len-interpolation-factor has no effect under --position-embedding-type "
     "yarn"),
    (MLA + ["--rotary-seq-len-interpolation-factor", "2"],
     "--rotary-seq-len-interpolation-factor does not reach --multi-latent-attention's"),
    (MLA[:1] + MLA[3:] + YARN, "--position-embedding-type yarn is YaRN for standard "
                               "attention; --multi-latent-attention takes YaRN through "
                               "--rope-type yarn"),
    (YARN + ["--rotary-interleaved"],
     "--rotary-interleaved is not supported with --position-embedding-type yarn"),
    (YARN + ["--rotary-scaling-factor", "0"], "--rotary-scaling-factor must be > 0, got 0.0"),
    (YARN + ["--yarn-original-max-position-embeddings", "0"],
     "--yarn-original-max-position-embeddings must be >= 1, got 0"),
    (YARN + ["--use-rope-scaling"], "--use-rope-scaling scales RoPE: it needs "
                                    "--position-embedding-type rope"),
    (MLA + ["--yarn-original-max-position-embeddings", "64"],
     "--yarn-original-max-position-embeddings: standard attention's YaRN flags"),
])
def test_combinations_megatron_lm_would_ignore_stop(flags, message):
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags)
    assert [p for p in error.value.problems if message in p], error.value.problems


def test_yarn_flags_without_yarn_are_noted_and_the_shared_ones_are_not_mla_only():
    args = args_of("--position-embedding-type", "rope", "--yarn-beta-fast", "16")
    assert ("note: --yarn-beta-fast without --position-embedding-type yarn: these flags have "
            "no effect") in args.flag_notes
    # --rotary-scaling-factor and --mscale are YaRN's under yarn, not MLA's unused flags
    args = args_of(*YARN, "--rotary-scaling-factor", "4", "--mscale", "0.9")
    assert not [note for note in args.flag_notes if "multi-latent" in note], args.flag_notes
    args = args_of("--position-embedding-type", "rope", "--rotary-scaling-factor", "4")
    assert [note for note in args.flag_notes if "--rotary-scaling-factor" in note]


@pytest.mark.parametrize("value, pattern", [("2", [0, 1, 0, 1]), ("[1]+[0]*3", [1, 0, 0, 0])])
def test_layers_without_rope_reach_the_config(value, pattern):
    """Llama-4's NoPE layers: megatron-core's attention drops the rotary embedding in the
    layers marked 1 (its layer numbers are global, so pipeline stages agree)."""
    args = args_of("--num-layers", "4", "--position-embedding-type", "rope",
                   "--no-rope-freq", value)
    assert trainer_model.transformer_config_from_args(args).no_rope_freq == pattern
    assert trainer_model.transformer_config_from_args(args_of(
        "--position-embedding-type", "rope")).no_rope_freq is None


@pytest.mark.parametrize("flags, message", [
    (["--no-rope-freq", "2"], "--no-rope-freq skips RoPE in some layers: it needs "
                              "--position-embedding-type rope or yarn, not learned_absolute"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "3"],
     "--no-rope-freq 3 must divide --num-layers (2)"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "[0]*3"],
     "--no-rope-freq gives 3 layers, --num-layers is 2"),
    (MLA + ["--no-rope-freq", "2"], "--no-rope-freq does not reach --multi-latent-attention"),
])
def test_layers_without_rope_mistakes_are_named(flags, message):
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags)
    assert [p for p in error.value.problems if message in p], error.value.problems
