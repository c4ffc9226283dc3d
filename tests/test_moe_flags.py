"""Megatron-LM's MoE flags (issue #29 point 1) reach the config and the layer spec with
Megatron-LM's defaults and meanings, the unimplemented ones are refused with their
reason, and SplitRouter's deferred aux-loss gradient equals megatron-core's unsplit one.
In-process, no processes (but one sinkhorn routing run at pp=2 against one process); the
trained runs are in tests/test_moe_exactness.py."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    switch_load_balancing_loss_func,
)

from megatron.seqsplit.model import moe_layer_pattern, split_aware_local_spec
from megatron.seqsplit.moe import (
    RoutingStatistics,
    SplitMoELayer,
    SplitRouter,
    SplitTransformerLayer,
    _DeferredAuxLoss,
)
from megatron.trainer import model as trainer_model
from megatron.trainer.arguments import ArgumentErrors, parse_args
from megatron.trainer.moe_arguments import moe_freq_type

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--disable-bias-linear"]


def args_of(*flags, world_size=1):
    return parse_args(BASE + list(flags), world_size=world_size, cuda_available=False,
                      check_files=False)


@pytest.fixture(autouse=True)
def one_stage(monkeypatch):
    """One stage of every layer, without megatron-core's parallel state."""
    import megatron.seqsplit.model as seqsplit_model

    monkeypatch.setattr(seqsplit_model, "get_num_layers_to_build",
                        lambda config, vp_stage=None: config.num_layers)
    monkeypatch.setattr(seqsplit_model, "get_transformer_layer_offset",
                        lambda config, vp_stage=None: 0)


def test_megatron_lm_defaults_and_config_fields():
    args = args_of("--num-experts", "8", "--ffn-hidden-size", "64")
    assert (args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_layer_freq) == (2, 64, 1)
    assert args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff == 0.0
    assert args.moe_token_dispatcher_type == "allgather"
    assert args.expert_tensor_parallel_size == 1  # Megatron-LM's default: the TP size
    config = trainer_model.transformer_config_from_args(args)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 64)
    dense = trainer_model.transformer_config_from_args(args_of())
    assert dense.num_moe_experts is None


def test_deepseek_style_flags_reach_the_config():
    args = args_of("--num-experts", "8", "--moe-router-score-function", "sigmoid",
                   "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
                   "--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
                   "--moe-aux-loss-coeff", "1e-3", "1e-4", "--moe-z-loss-coeff", "1e-3",
                   "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "4",
                   "--moe-router-group-topk", "2", "--moe-shared-expert-intermediate-size",
                   "24", "--moe-layer-freq", "[0]*1+[1]*3",
                   "--moe-token-dispatcher-type", "alltoall")
    config = trainer_model.transformer_config_from_args(args)
    assert config.moe_router_load_balancing_type == ["seq_aux_loss", "global_aux_loss"]
    assert config.moe_aux_loss_coeff == [1e-3, 1e-4]
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias,
            config.moe_router_bias_update_rate, config.moe_z_loss_coeff,
            config.moe_router_topk_scaling_factor, config.moe_router_num_groups,
            config.moe_router_group_topk, config.moe_shared_expert_intermediate_size,
            config.moe_token_dispatcher_type) == (
        "sigmoid", True, 0.01, 1e-3, 2.5, 4, 2, 24, "alltoall")
    # first-k-dense: a dense MLP first, then split-aware MoE layers
    block = split_aware_local_spec(config, normalization="LayerNorm")
    mlps = [spec.submodules.mlp for spec in block.layer_specs]
    kinds = [getattr(mlp, "module", getattr(mlp, "func", None)).__name__ for mlp in mlps]
    # (a dense MLP is an MLP ModuleSpec on 0.16.1, a builder function on 0.19.2)
    assert kinds[0] != "SplitMoELayer" and kinds[1:] == ["SplitMoELayer"] * 3, kinds
    assert block.layer_specs[1].module is SplitTransformerLayer
    moe = mlps[1].submodules if hasattr(mlps[1], "submodules") else mlps[1].keywords["submodules"]
    assert moe.router is SplitRouter


def test_router_precision_and_pre_softmax_reach_the_config():
    """DeepSeek's and Qwen3-MoE's router flags (Megatron-LM's examples give
    --moe-router-dtype fp32, and DeepSeek --moe-router-pre-softmax); trained against
    one process in tests/test_moe_exactness.py (X: fp64 router, D: pre-softmax)."""
    config = trainer_model.transformer_config_from_args(args_of(
        "--num-experts", "8", "--moe-router-dtype", "fp64", "--moe-router-pre-softmax",
        "--moe-router-score-function", "sigmoid"))
    assert (config.moe_router_dtype, config.moe_router_pre_softmax) == ("fp64", True)
    default = trainer_model.transformer_config_from_args(args_of("--num-experts", "8"))
    assert (default.moe_router_dtype, default.moe_router_pre_softmax) == (None, False)
    # top-1 with the softmax router: megatron-core's rule, met with pre-softmax
    config = trainer_model.transformer_config_from_args(args_of(
        "--num-experts", "4", "--moe-router-topk", "1", "--moe-router-pre-softmax"))
    assert config.moe_router_topk == 1 and config.moe_router_pre_softmax


def test_shared_expert_gate_and_probabilities_on_input_reach_the_config():
    """Qwen2-MoE's gated shared expert and Llama 4's probabilities on the experts' input
    reach megatron-core's config (trained against one process in
    tests/test_moe_exactness.py: X and N, whose gate weights are compared too)."""
    args = args_of("--num-experts", "4", "--moe-router-topk", "1",
                   "--moe-router-score-function", "sigmoid", "--moe-apply-probs-on-input",
                   "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate")
    config = trainer_model.transformer_config_from_args(args)
    assert config.moe_shared_expert_gate and config.moe_apply_probs_on_input
    default = trainer_model.transformer_config_from_args(args_of("--num-experts", "4"))
    assert not (default.moe_shared_expert_gate or default.moe_apply_probs_on_input)
    # without a shared expert the gate has nothing to act on: a note, as Megatron-LM ignores it
    args = args_of("--num-experts", "4", "--moe-shared-expert-gate")
    assert any("--moe-shared-expert-gate without" in note for note in args.flag_notes)


def test_flex_dispatcher_runs_as_alltoall_with_a_note():
    """DeepSeek-V3's and Qwen3-235B's recipes dispatch with flex (DeepEP / HybridEP CUDA
    kernels that only move the tokens): the all-to-all dispatcher runs, the note says so,
    and the backends' settings are accepted with their reason."""
    args = args_of("--num-experts", "4", "--moe-token-dispatcher-type", "flex",
                   "--moe-enable-deepep", "--moe-deepep-num-sms", "24",
                   "--moe-hybridep-num-sms-preprocessing", "64")
    assert args.moe_token_dispatcher_type == "alltoall"
    assert trainer_model.transformer_config_from_args(args).moe_token_dispatcher_type == \
        "alltoall"
    assert any("--moe-token-dispatcher-type flex (deepep) runs as alltoall" in note
               for note in args.flag_notes)
    assert {flag for flag, _ in args.no_op_flags} >= {"--moe-deepep-num-sms",
                                                      "--moe-hybridep-num-sms-preprocessing"}
    args = args_of("--num-experts", "4", "--moe-token-dispatcher-type", "flex",
                   "--moe-flex-dispatcher-backend", "hybridep")
    assert any("flex (hybridep)" in note for note in args.flag_notes)


def test_moe_layer_recompute_as_megatron_lm():
    """--moe-layer-recompute: selective, "moe" added to the modules (core attention by
    default), as megatron-core's config turns it; the layers it builds recompute with
    their split (trained in tests/test_moe_exactness.py, measured in
    tests/test_planner_memory_probe.py)."""
    args = args_of("--num-experts", "8", "--moe-layer-recompute")
    config = trainer_model.transformer_config_from_args(args)
    assert (config.recompute_granularity, config.recompute_modules) == (
        "selective", ["core_attn", "moe"])
    assert not config.moe_layer_recompute  # translated here, not deprecated-warned there
    args = args_of("--num-experts", "8", "--recompute-granularity", "selective",
                   "--recompute-modules", "moe")
    assert trainer_model.transformer_config_from_args(args).recompute_modules == ["moe"]
    # unchanged without it: megatron-core's default modules
    args = args_of("--num-experts", "8", "--recompute-activations")
    assert trainer_model.transformer_config_from_args(args).recompute_modules == ["core_attn"]
    # the MoE layers of the spec are split-aware recomputing ones
    block = split_aware_local_spec(config, normalization="LayerNorm")
    mlp = block.layer_specs[0].submodules.mlp
    assert getattr(mlp, "module", getattr(mlp, "func", None)) is SplitMoELayer
    dense = args_of("--recompute-granularity", "selective", "--recompute-modules", "moe")
    assert ("note: --recompute-modules moe without --num-experts: there is no MoE layer "
            "to recompute") in dense.flag_notes


def test_moe_options_that_change_no_value_are_accepted_with_their_reason():
    """Megatron-LM's DeepSeek, Qwen3-MoE, Kimi and Llama-4 examples pass these; none
    changes a value here (overlap and fusions are performance)."""
    args = args_of("--num-experts", "8", "--moe-token-drop-policy", "probs",
                   "--moe-shared-expert-overlap", "--moe-permute-fusion", "--moe-router-fusion",
                   "--moe-token-dispatcher-type", "alltoall")
    assert [flag for flag, _ in args.no_op_flags] == [
        "--moe-shared-expert-overlap", "--moe-permute-fusion", "--moe-router-fusion"]
    assert args.moe_token_drop_policy == "probs"  # megatron-core's config field
    # megatron-core's config refuses the overlap with the allgather dispatcher
    with pytest.raises(ArgumentErrors, match="--moe-shared-expert-overlap only works with "
                                             "--moe-token-dispatcher-type alltoall"):
        args_of("--num-experts", "8", "--moe-shared-expert-overlap")


def test_moe_layer_freq_as_megatron_lm_reads_it():
    assert moe_freq_type("2") == 2
    assert moe_freq_type("([1]*3+[0]*1)*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    with pytest.raises(ValueError):
        moe_freq_type("[2]*4")
    with pytest.raises(ValueError):
        moe_freq_type("__import__('os')")


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "8", "--moe-router-dtype", "bf16"],
     "--moe-router-dtype: invalid choice: 'bf16'"),
    (["--num-experts", "8", "--moe-latent-size", "16"],
     "--moe-latent-size is refused: this mixture-of-experts option"),
    (["--num-experts", "8", "--moe-input-jitter-eps", "0"],
     "--moe-input-jitter-eps must be > 0, got 0.0"),
    (["--num-experts", "8", "--moe-layer-recompute", "--recompute-granularity", "full",
      "--recompute-method", "uniform"],
     "--moe-layer-recompute does not go with --recompute-granularity full (as in "
     "Megatron-LM)"),
    (["--num-experts", "8", "--recompute-granularity", "selective", "--recompute-modules",
      "moe", "moe_act"], "--recompute-modules moe_act is refused: megatron-core recomputes "
                         "the expert activation only inside its grouped-GEMM experts"),
    (["--num-experts", "8", "--moe-shared-expert-intermediate-size", "16",
      "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-overlap",
      "--recompute-granularity", "selective", "--recompute-modules", "shared_experts"],
     "--recompute-modules shared_experts does not go with --moe-shared-expert-overlap"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be between"),
    (["--num-experts", "4", "--moe-router-topk", "1"],
     "--moe-router-topk 1 with the softmax router needs --moe-router-pre-softmax (as in "
     "Megatron-LM)"),
    (["--num-experts", "4", "--moe-apply-probs-on-input"],
     "--moe-apply-probs-on-input needs --moe-router-topk 1 (got 2)"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*3"], "--moe-layer-freq gives 3 layers"),
    (["--num-experts", "4", "--moe-router-num-groups", "2"],
     "--moe-router-num-groups and --moe-router-group-topk go together"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size needs --num-experts"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "ring"], "ring"),
    (["--num-experts", "4", "--moe-enable-deepep"],
     "--moe-enable-deepep needs --moe-token-dispatcher-type flex"),
    (["--num-experts", "4", "--moe-flex-dispatcher-backend", "ncclep"],
     "--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"],
     "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 is refused: 1 (whole experts"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1", "--seq1f1b-splits", "2"],
     "--moe-expert-capacity-factor with --seq1f1b-splits 2: token dropping decides by the "
     "expert load of one forward call"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1", "--context-parallel-size",
      "2"], "--moe-expert-capacity-factor with --context-parallel-size 2"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
])
def test_mistakes_are_named(flags, message):
    with pytest.raises(ArgumentErrors) as error:
        args_of(*flags, world_size=4)
    assert message in str(error.value)


@pytest.mark.parametrize("layout", [["--context-parallel-size", "2"],
                                    ["--tensor-model-parallel-size", "2",
                                     "--sequence-parallel"]])
def test_per_token_router_losses_need_a_router_that_counts_tp_and_cp(layout):
    """--calculate-per-token-loss with router losses (now also under --seq1f1b-splits)
    runs where megatron-core's router multiplies them by TP x CP (0.19; trained in
    tests/test_moe_exactness.py and tests/test_context_parallel.py) and stops on
    megatron-core 0.16.1, whose router does not."""
    from megatron import mcore_compat

    flags = ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
             "--calculate-per-token-loss", "--seq1f1b-splits", "2", *layout]
    if mcore_compat.per_token_router_loss_counts_tp_cp():
        assert args_of(*flags, world_size=2).calculate_per_token_loss
    else:
        with pytest.raises(ArgumentErrors, match="this megatron-core's router scales those "
                                                 "losses by its local tokens alone"):
            args_of(*flags, world_size=2)
    # one TP and CP rank: right on every version
    assert args_of(*flags[:-len(layout)]).calculate_per_token_loss


def test_a_dense_model_gets_no_note_for_the_moe_defaults():
    """Every MoE flag at its default: no 'the MoE flags have no effect' note (the README's
    demo printed one for the token-dropping flags' defaults)."""
    assert not [note for note in args_of().flag_notes if "MoE flags" in note]
    noted = args_of("--moe-token-drop-policy", "position").flag_notes
    assert [note for note in noted if "--moe-token-drop-policy without --num-experts" in note]


def test_token_dropping_flags_reach_the_config():
    from megatron.trainer.model import transformer_config_from_args

    config = transformer_config_from_args(args_of(
        "--num-experts", "4", "--moe-expert-capacity-factor", "1.5",
        "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy", "position"))
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity,
            config.moe_token_drop_policy) == (1.5, True, "position")
    dropless = args_of("--num-experts", "4", "--moe-expert-capacity-factor", "-1",
                       "--seq1f1b-splits", "2")  # megatron-core's "no dropping"
    assert dropless.moe_expert_capacity_factor is None
    assert transformer_config_from_args(args_of("--num-experts", "4")).moe_token_drop_policy \
        == "probs"


def test_biased_grouped_experts_are_refused_with_the_fix():
    """megatron-core's grouped experts have no bias (on CUDA; on CPU the flag runs the
    sequential experts, which have theirs)."""
    flags = [f for f in BASE if f != "--disable-bias-linear"] + ["--num-experts", "4",
                                                                 "--moe-grouped-gemm"]
    with pytest.raises(ArgumentErrors, match="--moe-grouped-gemm has no expert biases"):
        parse_args(flags, world_size=1, cuda_available=True, check_files=False)
    assert parse_args(flags, world_size=1, cuda_available=False, check_files=False).num_experts


def test_biased_experts_need_expert_tensor_parallel_size_one():
    """megatron-core asserts expert biases only with expert TP 1 (by default ETP = TP)."""
    flags = [f for f in BASE if f != "--disable-bias-linear"] + [
        "--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    with pytest.raises(ArgumentErrors, match="biased linear layers needs "
                                             "--expert-tensor-parallel-size 1"):
        parse_args(flags, world_size=2, cuda_available=False, check_files=False)
    whole = parse_args(flags + ["--expert-tensor-parallel-size", "1",
                                "--expert-model-parallel-size", "2"],
                       world_size=2, cuda_available=False, check_files=False)
    assert (whole.expert_tensor_parallel_size, whole.expert_model_parallel_size) == (1, 2)
    assert trainer_model.transformer_config_from_args(whole).expert_tensor_parallel_size == 1


def test_whole_experts_under_tensor_parallelism_need_expert_parallelism():
    """--expert-tensor-parallel-size 1 under TP 2 (DeepSeek-V3's and Qwen3's recipes): at
    EP 1 megatron-core leaves each TP rank's copy of an expert to its own tokens (measured:
    the copies drift apart), so EP > 1 is required; EP then spans the TP x DP ranks."""
    tp2 = ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--expert-tensor-parallel-size", "1"]
    with pytest.raises(ArgumentErrors, match="needs --expert-model-parallel-size > 1"):
        args_of(*tp2, world_size=2)
    with pytest.raises(ArgumentErrors, match="does not divide the 2 ranks"):
        args_of(*tp2, "--expert-model-parallel-size", "4", world_size=2)
    assert args_of(*tp2, "--expert-model-parallel-size", "2", world_size=2)


def test_grouped_gemm_on_cpu_runs_sequential_experts_with_a_note():
    args = args_of("--num-experts", "4", "--moe-grouped-gemm")
    assert not args.moe_grouped_gemm
    assert any("--moe-grouped-gemm" in note for note in args.flag_notes)


def test_deferred_aux_loss_gradient_equals_the_unsplit_one():
    """aux_loss: the splits' deferred gradients (weights from the whole microbatch's
    counts) add up to megatron-core's gradient of the unsplit loss."""
    torch.manual_seed(0)
    tokens, experts, topk, coeff = 12, 4, 2, 0.5
    logits = torch.randn(tokens, experts, requires_grad=True)
    scores = torch.softmax(logits, dim=-1)
    routing = torch.zeros_like(scores).scatter(1, scores.topk(topk).indices, 1)
    counts = routing.sum(0)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    unsplit = switch_load_balancing_loss_func(scores, counts, tokens, topk, experts, coeff)
    (expected,) = torch.autograd.grad(unsplit, logits, retain_graph=True)

    def weights(_):
        return counts * (experts * coeff / (topk * tokens * tokens))

    outputs = []
    for part in scores.split([5, 4, 3]):  # three splits
        anchor = torch.zeros(1, requires_grad=True)
        outputs.append(_DeferredAuxLoss.apply(anchor, part.sum(0), weights))
    (got,) = torch.autograd.grad(sum(o.sum() for o in outputs), logits)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def test_routing_statistics_keep_one_record_per_split():
    """A recomputed forward overwrites its split's counts instead of adding them."""
    from megatron.seqsplit.moe import _Record

    stats = RoutingStatistics()
    for split in (0, 1, 1):  # split 1 recorded twice (recomputation)
        stats.record(3, 0, split, _Record(tokens=4, tokens_reduced=4,
                                          counts={"tp": torch.ones(2)}))
    assert stats.tokens(3, 0) == 8 and stats.counts(3, 0, "tp").tolist() == [2.0, 2.0]
    assert stats.microbatches(3) == [0] and stats.tokens(2, 0) == 0


def test_logged_moe_losses_are_megatron_lms_names_and_layer_count():
    """The aux losses logged each iteration: Megatron-LM's names for the load-balancing
    types and z-loss (none for a dense model), averaged over the MoE layers that
    --moe-layer-freq makes, printed after the lm loss."""
    from megatron.trainer.metrics import format_iteration_line
    from megatron.trainer.moe_metrics import tracked_names

    args = args_of("--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss",
                   "global_aux_loss", "--moe-aux-loss-coeff", "1", "0.5",
                   "--moe-z-loss-coeff", "0.1")
    assert tracked_names(args) == ["seq_load_balancing_loss", "global_load_balancing_loss",
                                   "z_loss"]
    assert tracked_names(args_of("--num-experts", "4")) == ["load_balancing_loss"]
    assert tracked_names(args_of()) == []
    # the layers averaged over: the model's own --moe-layer-freq rule
    def moe_layers(freq):
        return sum(moe_layer_pattern(SimpleNamespace(num_layers=4, moe_layer_freq=freq)))

    assert moe_layers(moe_freq_type("[0]*1+[1]*3")) == 3
    assert moe_layers(2) == 2 and moe_layers(1) == 4
    line = format_iteration_line(3, 10, 12, 5.0, 1e-4, 4, 2.5, 0.75, 100.0, None, [0.1],
                                 moe_losses={"load_balancing_loss": 1.00264, "z_loss": 4.3})
    assert "| lm loss: 2.5 | load_balancing_loss: 1.00264 | z_loss: 4.3 | grad norm:" in line


# Megatron-LM's own model settings (examples/post_training/modelopt/conf/: Qwen3-30B-A3B
# and DeepSeek-R1, their MODEL_ARGS as given there; --tokenizer-type swapped for the
# NullTokenizer, whose files are not read)
QWEN3_30B_A3B = """--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope
    --no-rope-fusion --normalization RMSNorm --swiglu --num-layers 48 --hidden-size 2048
    --ffn-hidden-size 6144 --num-attention-heads 32 --group-query-attention
    --num-query-groups 4 --kv-channels 128 --qk-layernorm --num-experts 128
    --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-dtype fp32
    --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --seq-length 4096
    --max-position-embeddings 40960 --make-vocab-size-divisible-by 1187 --use-mcore-models
    --rotary-percent 1.0 --rotary-base 1000000 --no-bias-swiglu-fusion --sequence-parallel"""
DEEPSEEK_R1 = """--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
    --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope
    --no-rope-fusion --normalization RMSNorm --swiglu --num-layers 61 --hidden-size 7168
    --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
    --multi-latent-attention --kv-lora-rank 512 --v-head-dim 128 --q-lora-rank 1536
    --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 --num-experts 256
    --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 --moe-router-dtype fp32
    --moe-router-score-function sigmoid --moe-router-bias-update-rate 1e-3
    --moe-router-enable-expert-bias --moe-router-topk 8 --moe-router-num-groups 8
    --moe-router-group-topk 4 --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5
    --moe-shared-expert-overlap --moe-shared-expert-intermediate-size 2048
    --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type seq_aux_loss
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --seq-length 4096
    --max-position-embeddings 163840 --make-vocab-size-divisible-by 1280 --use-mcore-models
    --rotary-base 10000 --rotary-percent 1.0 --rotary-scaling-factor 40 --mscale 1.0
    --mscale-all-dim 1.0 --recompute-activations --moe-layer-recompute --sequence-parallel"""


# DeepSeek-V3 as NVIDIA's Megatron-MoE model zoo trains it with Megatron-LM
# (model_configs/benchmarking/DeepSeek-V3.yaml's MODEL_ARGS with its H100 run's additions:
# whole experts, --expert-tensor-parallel-size 1, a pipeline layout with the MTP depth on
# the last stage, --enable-experimental; the launcher's default DeepEP dispatcher), 61
# layers cut to 16 to fit 8 ranks; its
# --transformer-impl transformer_engine becomes local (Transformer Engine layers do not
# run under sequence splits here) and its data the NullTokenizer's mock data
DEEPSEEK_V3_MODEL_ZOO = """--distributed-timeout-minutes 60 --pipeline-model-parallel-size 4
    --expert-model-parallel-size 2 --context-parallel-size 1 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models
    --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1
    --exit-duration-in-mins 220 --no-save-optim --no-check-for-nan-in-loss-and-grad
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl native --manual-gc
    --manual-gc-interval 10 --transformer-impl local --seq-length 4096 --split 99,1,0
    --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6
    --num-layers 16 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --kv-channels 128 --max-position-embeddings 4096 --position-embedding-type rope
    --rotary-base 10000 --make-vocab-size-divisible-by 3232 --normalization RMSNorm
    --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
    --multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0
    --weight-decay 0.1 --qk-layernorm --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
    --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 256
    --moe-layer-freq ([0]*3+[1]*13) --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk 8 --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4
    --moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
    --moe-router-fusion --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0
    --mscale-all-dim 1.0 --eval-iters 32 --eval-interval 200 --no-load-optim --no-load-rng
    --auto-detect-ckpt-format --dist-ckpt-strictness log_all --init-method-std 0.02
    --log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad
    --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
    --bf16 --enable-experimental --recompute-granularity selective
    --recompute-modules mla_up_proj mlp --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --pipeline-model-parallel-layout Ett|(tt|)*6ttmL --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend deepep"""


@pytest.mark.parametrize("settings", [QWEN3_30B_A3B, DEEPSEEK_R1, DEEPSEEK_V3_MODEL_ZOO],
                         ids=["qwen3-30b-a3b", "deepseek-r1", "deepseek-v3-model-zoo"])
def test_megatron_lms_own_moe_settings_are_accepted(settings):
    """On GPUs (8 ranks, TP 2 for sequence parallelism), with a training length and data,
    Megatron-LM's own Qwen3-MoE and DeepSeek settings, and the Megatron-MoE model zoo's
    DeepSeek-V3 (with Transformer Engine swapped for local layers), parse unchanged,
    every flag with its meaning or its reason."""
    argv = settings.split() + [
        "--tensor-model-parallel-size", "2", "--train-iters", "10", "--global-batch-size",
        "8", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000"]
    args = parse_args(argv, world_size=8, cuda_available=True, check_files=False)
    assert args.moe_router_dtype == "fp32" and args.num_experts in (128, 256)
    if settings is DEEPSEEK_R1:
        assert args.moe_router_pre_softmax and args.recompute_modules == ["core_attn", "moe"]
        assert "--moe-shared-expert-overlap" in {flag for flag, _ in args.no_op_flags}
        assert args.moe_token_drop_policy == "probs"
    if settings is DEEPSEEK_V3_MODEL_ZOO:  # 4 stages x 2 virtual, EP over the TP ranks
        assert (args.expert_tensor_parallel_size, args.expert_model_parallel_size) == (1, 2)
        assert args.virtual_pipeline_model_parallel_size == 2 and args.mtp_num_layers == 1
        assert "--enable-experimental" in {flag for flag, _ in args.no_op_flags}
        assert args.moe_token_dispatcher_type == "alltoall"  # flex (DeepEP), with a note


SINKHORN = ["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"]


def test_sinkhorn_routing_runs_on_whole_microbatches_only():
    """S-BASE routing balances the tokens of one router call against each other: whole
    microbatches (megatron-core's own routing) run, splits and context parallelism stop
    before work; megatron-core's rule (no aux-loss coefficient) is checked up front; 0.19's
    quantile balancing is refused with its reason rather than argparse's "invalid
    choice"."""
    args = args_of(*SINKHORN)
    assert args.moe_router_load_balancing_type == "sinkhorn"
    assert trainer_model.transformer_config_from_args(
        args).moe_router_load_balancing_type == "sinkhorn"
    split = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]
    for flags, problem in (
            (split, "--moe-router-load-balancing-type sinkhorn balances the tokens of each "
                    "router call against each other"),
            (["--context-parallel-size", "2"], "--moe-router-load-balancing-type sinkhorn "
                                               "with context parallelism"),
            (["--moe-aux-loss-coeff", "0.01"], "--moe-router-load-balancing-type sinkhorn "
                                               "takes no --moe-aux-loss-coeff")):
        with pytest.raises(ArgumentErrors) as error:
            args_of(*SINKHORN, *flags, world_size=2)
        assert any(line.startswith(problem) for line in error.value.problems), (
            flags, error.value.problems)
    with pytest.raises(ArgumentErrors, match="quantile_balancing is not implemented here"):
        args_of("--num-experts", "4", "--moe-router-load-balancing-type", "quantile_balancing")


@pytest.mark.distributed  # starts processes
def test_sinkhorn_routing_trains_as_one_process_at_pp2(tmp_path):
    from distributed import TINY_MODEL, assert_close_series, init_run, run_configs

    argv = TINY_MODEL + SINKHORN + ["--global-batch-size", "4", "--train-iters", "2",
                                    "--moe-router-topk", "2"]
    init, start = init_run("init", tmp_path / "init", argv)  # one set of initial weights
    argv = argv + start
    runs = run_configs(tmp_path, 1, [init, {"name": "one", "argv": argv}])
    runs.update(run_configs(tmp_path, 2, [
        {"name": "pp2", "argv": argv + ["--pipeline-model-parallel-size", "2"]}]))
    assert len(runs["one"]["losses"]) == 2
    assert_close_series(runs["pp2"]["losses"], runs["one"]["losses"], 1e-6, "pp2")


def test_sqrtsoftplus_scores_and_refused_choices_name_their_reason():
    """0.19's sqrtsoftplus router scores where megatron-core has them (per token: exact
    under splits like sigmoid), a line naming the version elsewhere; Megatron-LM's mrope
    and relative positions and its inference-only layer implementation are refused with
    their reason instead of argparse's 'invalid choice'."""
    from megatron import mcore_compat

    if "sqrtsoftplus" in mcore_compat.moe_router_score_functions():
        args = args_of("--num-experts", "4", "--moe-router-score-function", "sqrtsoftplus")
        assert trainer_model.transformer_config_from_args(
            args).moe_router_score_function == "sqrtsoftplus"
    else:
        with pytest.raises(ArgumentErrors, match="sqrtsoftplus needs megatron-core >= 0.19"):
            args_of("--num-experts", "4", "--moe-router-score-function", "sqrtsoftplus")
    for flags, problem in (
            (["--position-embedding-type", "mrope"], "--position-embedding-type mrope is "
                                                     "refused: multimodal RoPE"),
            (["--position-embedding-type", "relative"], "--position-embedding-type relative "
                                                        "is refused: T5's"),
            (["--transformer-impl", "inference_optimized"], "--transformer-impl "
                                                            "inference_optimized is refused")):
        with pytest.raises(ArgumentErrors) as error:
            args_of(*flags)
        assert any(line.startswith(problem) for line in error.value.problems), (
            flags, error.value.problems)


@pytest.mark.distributed  # starts processes
def test_sqrtsoftplus_routing_under_splits_equals_one_process(tmp_path):
    """sqrtsoftplus scores with the sequence aux loss and expert bias (DeepSeek-style
    routing), Seq1F1B s = 2 at pp = 2 against one process (megatron-core >= 0.19)."""
    from megatron import mcore_compat

    if "sqrtsoftplus" not in mcore_compat.moe_router_score_functions():
        pytest.skip("sqrtsoftplus needs megatron-core >= 0.19")
    from distributed import TINY_MODEL, assert_close_series, init_run, run_configs

    argv = TINY_MODEL + ["--num-experts", "4", "--moe-router-score-function", "sqrtsoftplus",
                         "--moe-router-load-balancing-type", "seq_aux_loss",
                         "--moe-aux-loss-coeff", "0.1", "--moe-router-enable-expert-bias",
                         "--global-batch-size", "4", "--train-iters", "2"]
    init, start = init_run("init", tmp_path / "init", argv)
    argv = argv + start
    runs = run_configs(tmp_path, 1, [init, {"name": "one", "argv": argv}])
    runs.update(run_configs(tmp_path, 2, [{"name": "split", "argv": argv + [
        "--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]}]))
    assert len(runs["one"]["losses"]) == 2
    for key in ("losses", "grad_norms"):
        assert_close_series(runs["split"][key], runs["one"][key], 1e-5, key)


def test_force_biased_router_reaches_the_config_where_megatron_core_has_it():
    """--moe-router-force-biased (megatron-core 0.19's benchmark routing) in the config
    there, a line naming the version elsewhere."""
    from megatron import mcore_compat

    flags = ("--num-experts", "4", "--moe-router-force-biased", "-0.5")
    if mcore_compat.config_has("moe_router_force_biased"):
        config = trainer_model.transformer_config_from_args(args_of(*flags))
        assert config.moe_router_force_biased == -0.5
    else:
        with pytest.raises(ArgumentErrors, match="--moe-router-force-biased needs "
                                                 "megatron-core >= 0.19"):
            args_of(*flags)
