"""Context parallelism (--context-parallel-size) under sequence splits: each rank runs an
equal part of every split and attention gathers the split's K/V over the ranks
(megatron/seqsplit/context_parallel.py). Exact against one process: loss, grad norm,
validation loss per iteration and every parameter after the steps, on the packed-document
corpus with --eod-mask-loss (the parts of a split hold different numbers of loss tokens,
so a per-part mean would not be the microbatch's)."""

import pytest

from distributed import (
    GQA_ROPE_SWIGLU,
    TINY_MODEL,
    TRACKER,
    Plan,
    assert_close_series,
    assert_params_close,
    init_run,
)
from megatron import mcore_compat
from megatron.trainer.arguments import ArgumentErrors, parse_args
from split_checks import check_split_units
from packed_documents import CASES as DOCUMENT_CASES
from packed_documents import document_cases
from test_moe_exactness import MODELS as MOE_MODELS
from test_moe_exactness import MOE_LOSSES
from test_mtp_exactness import MODELS as MTP_MODELS

ITERATIONS, MICROBATCHES, SEQ = 2, 4, 48
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
         "--eval-interval", "1000", "--eval-iters", "1", "--split", "969,31,0",
         "--eod-mask-loss"]
# sliding windows of 10 keys in every other layer: shorter than a split and than a part
# (48 tokens in 3 splits, each in 2 parts), so windows start in the same part, the other
# rank's part or the previous split
WINDOWS = ["--window-size", "10,0", "--window-attn-skip-freq", "2"]
_TINY = [flag for flag in TINY_MODEL if flag != "--mock-data"]  # the corpus instead
# multi-latent attention: query-key head 8 + 4 rotary, value head 6 (its own rotary
# embedding takes the part's offset too)
MLA = ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--position-embedding-type", "rope",
       "--rope-type", "rope"]
# mixture of experts (tests/test_moe_exactness.py's): X, Mixtral- / Qwen2-MoE-style with
# aux_loss and z-loss; D, DeepSeek-V3-style with MLA and its YaRN, seq_aux_loss and
# global_aux_loss, expert bias and group-limited routing (the auxiliary losses weigh each
# token by counts over the whole microbatch: over the splits and the CP ranks' parts)
MODELS = {"T": _TINY, "G": _TINY + GQA_ROPE_SWIGLU, "M": _TINY + MLA,
          "W": _TINY + GQA_ROPE_SWIGLU + WINDOWS,
          # Qwen3's long-context YaRN (standard attention): each part's table at its offset
          "Y": [flag if flag != "rope" else "yarn" for flag in _TINY + GQA_ROPE_SWIGLU] + [
              "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "12"],
          # packed documents: attention within each document, whose tokens may lie in
          # the other rank's part, earlier splits or both
          "Gd": _TINY + GQA_ROPE_SWIGLU + ["--reset-attention-mask", "--reset-position-ids"],
          "X": [flag for flag in MOE_MODELS["X"] if flag != "--mock-data"],
          # gpt-oss-style: learnable attention sinks, 20-key windows in every other layer,
          # YaRN, biased experts (tests/test_moe_exactness.py's G)
          "O": [flag for flag in MOE_MODELS["G"] if flag != "--mock-data"],
          "D": [flag for flag in MOE_MODELS["D"] if flag != "--mock-data"],
          # DeepSeek-V3's layers with 2 MTP depths (an MoE layer each): a part's shifted
          # tokens, labels and loss mask reach into the next part (tests/test_mtp_exactness.py)
          "V": [flag for flag in MTP_MODELS["V"] if flag != "--mock-data"],
          # DeepSeek-V3's dense attention (MLA) with one MTP depth
          "U": [flag for flag in MTP_MODELS["U"] if flag != "--mock-data"]}
# the MTP depths' logged losses of the models with MTP
MTP_DEPTHS = {"V": ["mtp_1 loss", "mtp_2 loss"], "U": ["mtp_1 loss"]}
LOGGED_MOE_LOSSES = {"X": MOE_LOSSES["X"], "D": MOE_LOSSES["D"], "O": MOE_LOSSES["G"],
                     "V": ["seq_load_balancing_loss"]}
CP2 = ["--context-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
CHUNKED = ["--seq1f1b-kv-cache", "chunked"]
# name -> (model, world size, splits, balance method, extra flags)
CASES = {
    # context parallelism alone: no pipeline, no splits (our executor's one-split program)
    "T_cp2_s1": ("T", 2, 1, "average", []),
    "G_cp2_s3_uniform": ("G", 2, 3, "uniform_comp", ["--calculate-per-token-loss"]),
    "W_cp2_s3_selective": ("W", 2, 3, "average", ["--recompute-granularity", "selective"]),
    "M_cp2_s2": ("M", 2, 2, "average", []),
    "G_pp2_cp2_s2": ("G", 4, 2, "average", PP2 + ["--recompute-granularity", "full",
                                                 "--recompute-method", "uniform"]),
    "T_pp2_vp2_cp2_s2": ("T", 4, 2, "average", PP2 + ["--num-virtual-stages-per-pipeline-rank",
                                                     "2"]),
    # sequence parallelism divides each rank's part over TP; the distributed optimizer
    # shards over the data- and context-parallel ranks
    "T_tp2_sp_cp2_s2": ("T", 4, 2, "average", ["--tensor-model-parallel-size", "2",
                                              "--sequence-parallel",
                                              "--use-distributed-optimizer"]),
    "G_dp2_cp2_s2": ("G", 4, 2, "average", ["--use-distributed-optimizer"]),
    # MoE: megatron-core's router on one split per part (s = 1), and the split router;
    # experts over 2 expert-parallel ranks that are the CP ranks (all-to-all)
    "Y_cp2_s3": ("Y", 2, 3, "average", []),
    "Gd_cp2_s3": ("Gd", 2, 3, "average", []),
    # the chunked KV cache: each chunk the whole split, a part's queries seeing its own
    # split's chunk up to their end (kv_chunks.py); with windows, documents and sinks
    "W_cp2_s3_chunked": ("W", 2, 3, "average", CHUNKED),
    "Gd_cp2_s2_chunked": ("Gd", 2, 2, "average", CHUNKED),
    "O_cp2_ep2_s2_chunked": ("O", 2, 2, "average", CHUNKED + EP2),
    "O_cp2_s1": ("O", 2, 1, "average", []),  # CPU: the sinks in the buffer cache's kernel
    # SlimPipe's 4 uniform slices (the `average` plan) under CP, its own unit order; MoE
    "X_pp2_cp2_slimpipe_n4": ("X", 4, 4, "average", PP2 + ["--pipeline-schedule", "slimpipe",
                                                         "--slimpipe-slices", "4"]),
    "Gd_pp2_cp2_s2_uniform": ("Gd", 4, 2, "uniform_comp", PP2),
    "X_cp2_ep2_s1": ("X", 2, 1, "average", EP2),
    "X_cp2_ep2_s3": ("X", 2, 3, "average", EP2),
    # DeepSeek-V3's selective recomputation (MLA's kernel, the MoE layers with the split)
    "D_cp2_s2_selective": ("D", 2, 2, "average", ["--recompute-activations",
                                                 "--moe-layer-recompute"]),
    "D_pp2_cp2_s2": ("D", 4, 2, "average", PP2),
    # experts over all 4 ranks of DP 2 x CP 2; global_aux_loss counts over both
    "D_dp2_cp2_ep4_s2": ("D", 4, 2, "average", ["--expert-model-parallel-size", "4",
                                               "--use-distributed-optimizer"]),
    # multi-token prediction: one split per part (its shifts cross into the other rank's
    # part), 3 splits, and the MTP layers on the last of 2 stages
    "V_cp2_s1": ("V", 2, 1, "average", []),
    "V_cp2_s3": ("V", 2, 3, "average", EP2),
    "V_pp2_cp2_s2": ("V", 4, 2, "average", PP2),
}
# cases whose reference trains with the same flag (per-token loss: the sum over the whole
# batch's loss tokens, which megatron-core counts over the data- and context-parallel
# ranks), or on the same data-parallel ranks: global_aux_loss weighs a microbatch by the
# running mean of the counts over the DP ranks' microbatches so far, which one process
# does not compute (a DP 2 run differs from one process in Megatron-LM too); its
# reference: (world size, flags)
OWN_REFERENCE = {"G_cp2_s3_uniform": (1, ["--calculate-per-token-loss"]),
                 "D_dp2_cp2_ep4_s2": (2, [])}
PER_TOKEN = ["--calculate-per-token-loss"]
# per-token loss with MTP: each depth's loss weighs by the whole microbatch's loss tokens
CASES["U_cp2_s2_per_token"] = ("U", 2, 2, "average", PER_TOKEN)
OWN_REFERENCE["U_cp2_s2_per_token"] = (1, PER_TOKEN)
if mcore_compat.per_token_router_loss_counts_tp_cp():
    # Megatron-LM's MoE recipes' per-token loss: the router losses weigh by the whole
    # microbatch's tokens times TP x CP (megatron-core >= 0.19; 0.16.1 stops on it,
    # tests/test_moe_flags.py); with MTP's MoE depths too (V)
    for _model in ("X", "V"):
        _name = f"{_model}_cp2_s2_per_token"
        CASES[_name] = (_model, 2, 2, "average", PER_TOKEN)
        OWN_REFERENCE[_name] = (1, PER_TOKEN)
# microbatches per data-parallel rank, and model chunks per pipeline rank
DATA_PARALLEL = {"G_dp2_cp2_s2": 2, "D_dp2_cp2_ep4_s2": 2}
# iteration 1's checkpoint of a CP run (distributed optimizer over DP x CP = 4 ranks)
# resumed without CP (DP = 2, the optimizer state resharded): iteration 2 as uninterrupted
RESUMED, SAVED = "G_dp2_cp2_resumed_at_dp2", "G_dp2_cp2_s2"
CHUNKS = {"T_pp2_vp2_cp2_s2": 2}


def plan(tmp, corpus):
    data = ["--data-path", corpus]
    inits, starts = [], {}
    for model, flags in MODELS.items():
        run, starts[model] = init_run(f"init_{model}", tmp / f"init_{model}",
                                      flags + BATCH + data)
        inits.append(run)
    runs = {1: [{"name": f"ref_{model}", "argv": MODELS[model] + BATCH + data + starts[model],
                 "params": True} for model in MODELS]}
    for name, (world, flags) in OWN_REFERENCE.items():
        model = CASES[name][0]
        runs.setdefault(world, []).append({"name": f"ref_{name}", "params": True,
                        "argv": MODELS[model] + BATCH + data + starts[model] + flags})
    for name, (model, world, splits, method, extra) in CASES.items():
        save = ["--save", str(tmp / name), "--save-interval", "1"] if name == SAVED else []
        schedule = ([] if "slimpipe" in extra else  # SlimPipe: its slices
                    ["--seq1f1b-splits", str(splits), "--seq1f1b-balance-method", method])
        runs.setdefault(world, []).append({
            "name": name, "params": True,
            "argv": MODELS[model] + BATCH + data + starts[model] + CP2 + extra + save
            + schedule})
    runs[2].append({"name": RESUMED, "params": True, "after": [str(tmp / SAVED / TRACKER)],
                    "argv": MODELS["G"] + BATCH + data + [
                        "--use-distributed-optimizer", "--load", str(tmp / SAVED),
                        "--ckpt-step", "1"]})
    return Plan(inits, runs)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_context_parallel_run_equals_one_process(results, name):
    model, _, splits, method, _ = CASES[name]
    run = results[name]
    ref = results[f"ref_{name}" if name in OWN_REFERENCE else f"ref_{model}"]
    assert len(run["losses"]) == ITERATIONS
    assert_close_series(run["losses"], ref["losses"], 1e-5, f"{name} loss")
    assert_close_series(run["grad_norms"], ref["grad_norms"], 1e-5, f"{name} grad norm")
    assert_close_series([run["final_validation_loss"]], [ref["final_validation_loss"]], 1e-5,
                        f"{name} validation loss")
    assert_params_close(run["params"], ref["params"])
    for loss in LOGGED_MOE_LOSSES.get(model, []):  # as Megatron-LM logs them, each iteration
        assert_close_series([step[loss] for step in run["moe_losses"]],
                            [step[loss] for step in ref["moe_losses"]], 1e-5, f"{name} {loss}")
    for depth in MTP_DEPTHS.get(model, []):
        assert [step[depth] > 0 for step in ref["mtp_losses"]] == [True] * ITERATIONS
        assert_close_series([step[depth] for step in run["mtp_losses"]],
                            [step[depth] for step in ref["mtp_losses"]], 1e-5, f"{name} {depth}")
    # the last rank (context-parallel rank 1) ran the second half of every split
    halves = [dict(unit, offset=unit["offset"] - unit["length"], length=2 * unit["length"])
              for unit in run["forward_units"]]
    check_split_units(name, halves, splits=splits, method=method, seq_length=SEQ,
                      calls=ITERATIONS + 1,
                      microbatches=MICROBATCHES // DATA_PARALLEL.get(name, 1),
                      chunks=CHUNKS.get(name, 1))
    if "--reset-attention-mask" in MODELS[model]:
        assert document_cases(halves) == set(DOCUMENT_CASES), name


@pytest.mark.distributed
def test_context_parallel_checkpoint_resumes_without_it(results):
    """A checkpoint of DP 2 x CP 2 (its distributed optimizer sharded over 4 ranks) loads
    into DP 2 without CP: iteration 2 trains as the uninterrupted runs did."""
    run = results[RESUMED]
    for other in ("ref_G", SAVED):
        expected = results[other]
        assert_close_series(run["losses"], expected["losses"][1:], 1e-5, f"loss vs {other}")
        assert_close_series(run["grad_norms"], expected["grad_norms"][1:], 1e-5,
                            f"grad norm vs {other}")
        assert_params_close(run["params"], expected["params"])


GOOD = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "2", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "4"]


def _parse(*flags, world_size=4):
    return parse_args(GOOD + list(flags), world_size=world_size, cuda_available=False)


def test_context_parallel_layout_and_alignment():
    args = _parse("--context-parallel-size", "2", "--seq1f1b-splits", "2")
    assert args.data_parallel_size == 2 and args.seq1f1b_alignment == 2
    args = _parse("--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", "--seq1f1b-split-alignment", "8")
    assert args.data_parallel_size == 1 and args.seq1f1b_alignment == 8
    args = _parse("--context-parallel-size", "2", "--cp-comm-type", "a2a")
    assert [flag for flag, _ in args.no_op_flags] == ["--cp-comm-type"]
    args = _parse("--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p",
                  "--hierarchical-context-parallel-sizes", "1", "2")
    assert [flag for flag, _ in args.no_op_flags] == ["--cp-comm-type",
                                                      "--hierarchical-context-parallel-sizes"]


@pytest.mark.parametrize("flags, message", [
    (["--context-parallel-size", "3"], "not divisible by .* x --context-parallel-size \\(3\\)"),
    (["--context-parallel-size", "2", "--seq-length", "62", "--tensor-model-parallel-size",
      "2", "--sequence-parallel"], "--seq-length \\(62\\) must be a multiple of the split "
                                   "alignment \\(4\\)"),
    (["--context-parallel-size", "2", "--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine is not supported with --context-parallel-size 2"),
    # on CUDA the sinks' kernel is the chunked cache's, as with splits
    (["--context-parallel-size", "2", "--softmax-type", "learnable", "--attention-dropout",
      "0", "--cuda"], "--softmax-type learnable on CUDA needs --seq1f1b-kv-cache chunked"),
    (["--context-parallel-size", "2", "--pipeline-schedule", "slimpipe",
      "--slimpipe-slices", "4", "--pipeline-model-parallel-size", "2",
      "--slimpipe-attention-balance", "--seq1f1b-kv-cache", "chunked"],
     "--slimpipe-attention-balance is not supported with --context-parallel-size 2"),
    # the expert-parallel ranks come from a stage's DP x CP x TP ranks (2 here)
    (["--context-parallel-size", "2", "--num-experts", "8", "--expert-model-parallel-size",
      "4", "--moe-token-dispatcher-type", "alltoall", "--world-size-2"],
     "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 does not divide the 2 "
     "ranks of a pipeline stage \\(data-parallel x context-parallel x tensor-parallel"),
    (["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "2"],
     "--hierarchical-context-parallel-sizes 2 2: their product \\(4\\) must be "
     "--context-parallel-size \\(2\\)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a\\+p2p needs --hierarchical-context-parallel-sizes"),
])
def test_context_parallel_refusals_name_the_flag(flags, message):
    world, cuda = (2 if "--world-size-2" in flags else 4), "--cuda" in flags
    flags = [flag for flag in flags if flag not in ("--world-size-2", "--cuda")]
    with pytest.raises(ArgumentErrors, match=message):
        parse_args(GOOD + flags, world_size=world, cuda_available=cuda)


def test_experts_spread_over_the_context_parallel_ranks():
    """Megatron-LM forms expert-parallel groups from a stage's DP x CP x TP ranks, so EP 2
    at CP 2 needs no data parallelism; MLA's default YaRN is accepted under CP."""
    args = _parse("--context-parallel-size", "2", "--num-experts", "8",
                  "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                  "alltoall", "--multi-latent-attention", "--position-embedding-type", "rope",
                  world_size=2)
    assert (args.data_parallel_size, args.expert_model_parallel_size) == (1, 2)
    assert args.rope_type == "yarn"


def test_each_rank_runs_its_contiguous_part_of_a_split():
    from megatron.seqsplit.context_parallel import ContextParallel
    from megatron.seqsplit.split_context import SplitContext

    second = ContextParallel(group=None, size=2, rank=1)
    assert second.part(10, 8) == (14, 4)
    split = SplitContext(num_splits=3, offset=14, length=4, seq_length=30,
                         context_parallel=second)
    assert (split.cache_offset, split.cache_length) == (10, 8)  # the whole split
    assert (SplitContext(offset=14, length=4).cache_offset, SplitContext(
        offset=14, length=4).cache_length) == (14, 4)  # without CP: the split itself
    with pytest.raises(ValueError, match="multiples of 2"):
        second.part(0, 7)


def test_every_combination_refused_with_context_parallelism_is_named_at_once():
    with pytest.raises(ArgumentErrors) as error:
        _parse("--context-parallel-size", "2", "--pipeline-schedule", "slimpipe",
               "--slimpipe-slices", "4", "--pipeline-model-parallel-size", "2",
               "--slimpipe-attention-balance", "--seq1f1b-kv-cache", "chunked",
               "--transformer-impl", "transformer_engine")
    named = [p.split(" is not supported")[0] for p in error.value.problems
             if " is not supported with --context-parallel-size" in p]
    assert named == ["--slimpipe-attention-balance", "--transformer-impl transformer_engine"], \
        error.value.problems
