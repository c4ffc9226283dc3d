"""Megatron-LM's multi-latent attention flags (issue #29 point 3) reach the config and
the layer spec with Megatron-LM's defaults and meanings; the MLA options not built here
are refused with their reason. In-process, no processes; the trained runs (split vs
unsplit, buffer and chunked caches) are in tests/test_moe_exactness.py (models D, M)."""

import pytest
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron.seqsplit.core_attention import SplitCausalAttention
from megatron.seqsplit.mla import SplitMLASelfAttention
from megatron.seqsplit.model import SequenceParallelTorchNorm, split_aware_local_spec
from megatron.trainer import model as trainer_model
from megatron.trainer.arguments import ArgumentErrors, build_parser, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1",
        "--position-embedding-type", "rope"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]


def args_of(*flags):
    return parse_args(BASE + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


@pytest.fixture(autouse=True)
def one_stage(monkeypatch):
    """One stage of every layer, without megatron-core's parallel state."""
    import megatron.seqsplit.model as seqsplit_model

    monkeypatch.setattr(seqsplit_model, "get_num_layers_to_build",
                        lambda config, vp_stage=None: config.num_layers)


def test_megatron_lm_defaults():
    args = args_of("--multi-latent-attention")
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim,
            args.v_head_dim) == (None, 32, 128, 64, 128)
    # Megatron-LM: MLA's rotary embedding is YaRN unless --rope-type says otherwise
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale,
            args.mscale_all_dim) == ("yarn", 1.0, 1.0, 0.0)
    dense = trainer_model.transformer_config_from_args(args_of())
    assert not isinstance(dense, MLATransformerConfig) and not dense.multi_latent_attention


def test_flags_reach_the_config_and_the_spec():
    args = args_of(*MLA, "--rotary-scaling-factor", "4", "--mscale", "0.9",
                   "--mscale-all-dim", "1", "--qk-layernorm", "--normalization", "RMSNorm")
    config = trainer_model.transformer_config_from_args(args)
    assert isinstance(config, MLATransformerConfig)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
            config.qk_pos_emb_head_dim, config.v_head_dim, config.rope_type,
            config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (
        16, 12, 8, 4, 6, "yarn", 4.0, 0.9, 1.0)
    layer = split_aware_local_spec(config, normalization="RMSNorm",
                                   qk_layernorm=True).layer_specs[0]
    attention = layer.submodules.self_attention
    assert attention.module is SplitMLASelfAttention
    assert attention.submodules.core_attention.module is SplitCausalAttention
    # the latent norms (--qk-layernorm) support sequence parallelism like the others
    assert attention.submodules.q_layernorm is SequenceParallelTorchNorm
    assert attention.submodules.kv_layernorm is SequenceParallelTorchNorm


def test_split_attention_scales_by_the_query_key_head_size():
    """MLA hands core attention k_channels (query-key head 8 + 4) and v_channels."""
    config = trainer_model.transformer_config_from_args(args_of(*MLA))
    from megatron.core.transformer.enums import AttnMaskType

    core = SplitCausalAttention(config, 1, AttnMaskType.causal, "self", k_channels=12,
                                v_channels=6)
    assert core.softmax_scale == pytest.approx(12 ** -0.5)


@pytest.mark.parametrize("flags, message", [
    (MLA + ["--group-query-attention"],
     "--group-query-attention and --multi-latent-attention exclude each other"),
    (["--rope-type", "yarn"], "--rope-type yarn is MLA's YaRN (for --multi-latent-attention); "
     "standard attention takes YaRN with --position-embedding-type yarn"),
    (MLA + ["--position-embedding-type", "learned_absolute"],
     "--multi-latent-attention rotates its decoupled part with RoPE/YaRN"),
    (MLA + ["--rotary-interleaved"], "--rotary-interleaved is not supported with"),
    (MLA + ["--q-lora-rank", "0"], "--q-lora-rank must be >= 1"),
    (["--multi-latent-attention", "--qk-layernorm"],
     "--qk-layernorm with --multi-latent-attention needs --q-lora-rank"),
    (MLA + ["--cache-mla-latents"], "--cache-mla-latents is refused: an inference-time MLA"),
    (MLA + ["--mla-down-proj-fusion"],
     "--mla-down-proj-fusion is refused: the fused MLA down-projection"),
    (MLA + ["--qk-clip"], "--qk-clip is refused: QK-clip"),
    (MLA + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "slimpipe",
            "--slimpipe-slices", "2", "--slimpipe-attention-balance"],
     "--slimpipe-attention-balance does not exchange MLA's keys and values"),
    (MLA + ["--yarn-beta-fast", "16"], "--yarn-beta-fast: standard attention's YaRN flags"),
])
def test_mistakes_are_named(flags, message):
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags)
    assert message in str(error.value)


@pytest.mark.parametrize("sequence_parallel", [[], ["--sequence-parallel"]])
def test_tensor_parallelism_is_accepted(sequence_parallel):
    """MLA at TP=2, with and without SP (refused before mla.py summed the shared rotary
    key's gradient over TP; trained against TP=1 in tests/test_moe_exactness.py)."""
    args = parse_args(BASE + MLA + ["--qk-layernorm", "--tensor-model-parallel-size", "2"]
                      + sequence_parallel, world_size=2, cuda_available=False,
                      check_files=False)
    assert args.tensor_model_parallel_size == 2 and args.multi_latent_attention
    assert args.sequence_parallel == bool(sequence_parallel)


@pytest.mark.parametrize("flags, named", [
    (MLA, "--multi-latent-attention"),
    (["--num-experts", "4", "--disable-bias-linear"], "--num-experts")])
def test_transformer_engine_is_not_taken_for_mla_or_moe(monkeypatch, flags, named):
    """With Transformer Engine importable, MLA and MoE still get the local layers (the TE
    layer spec built by megatron/trainer/model.py is dense standard attention): by
    default with a note naming the flag, and an explicit --transformer-impl
    transformer_engine is one error line."""
    import megatron.trainer.arguments as arguments

    monkeypatch.setattr(arguments, "_te_importable", lambda: True)
    args = args_of(*flags)
    assert args.transformer_impl == "local"
    assert f"does not run with {named} here" in args.transformer_impl_note
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags, "--transformer-impl", "transformer_engine")
    assert f"{named} need --transformer-impl local here" in str(error.value)


def test_mla_flags_without_mla_are_noted():
    args = args_of("--kv-lora-rank", "16")
    assert any("--kv-lora-rank without --multi-latent-attention" in n for n in args.flag_notes)


def test_help_lists_the_mla_flags_with_their_meanings():
    text = " ".join(build_parser().format_help().split())
    assert "multi-latent attention: Megatron-LM's MLA flags" in text
    for flag in ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank",
                 "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type",
                 "--rotary-scaling-factor", "--mscale", "--mscale-all-dim"):
        assert flag in text, flag
    assert "rank of the query's low-rank latent (none: no query compression)" in text
