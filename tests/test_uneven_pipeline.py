"""Uneven pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers) are exact.

A 6-layer model (tied embeddings: the first and last stages share the embedding) trains
2 iterations from a one-process iteration-0 checkpoint:
* pp=4 as 1 + 2 + 2 + 1 layers (first and last stages lighter than the middle), Seq1F1B
  s = 2 and 3 against s = 1 on that layout and against one process;
* interleaved, pp=2 x 2 virtual stages as 2 + 4 layers (chunks of 1, 2, 1, 2 layers),
  s = 2 against s = 1 and one process;
* pp=4 with --account-for-embedding/loss-in-pipeline-split (megatron-core builds
  1 + 2 + 2 + 1 layers), and pp=2 x 2 virtual stages with both (chunks of 1, 2, 2, 1
  layers), s = 2 against s = 1 and one process;
loss, grad norm, validation loss and every parameter within 1e-5. The pp=4 s = 2 run
saves its checkpoint, which an even pp=2 x dp=2 run then loads: the same parameters and
validation loss (a checkpoint of unequal stages reshards into another layout). A pp=4
s = 3 run stopped after iteration 1 and resumed equals the uninterrupted one.
The argument checks (Megatron-LM's and megatron-core's rules) run in process.
"""

import pytest
import torch

from distributed import TINY_MODEL, TRACKER, Plan, assert_close_series, assert_params_close, \
    init_run
from split_checks import check_reports, check_split_units

from megatron.pipeline_layers import UnevenSplitError, chunk_layer_counts, stage_layer_counts

MODEL = TINY_MODEL + ["--num-layers", "6"]
ITERATIONS, MICROBATCHES = 2, 4
EVAL = ["--eval-interval", "1000", "--eval-iters", "1", "--split", "969,31,0"]
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", str(ITERATIONS)] + EVAL
PP4_UNEVEN = ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers",
              "1", "--decoder-last-pipeline-num-layers", "1"]
PP2V2_UNEVEN = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                "2", "--decoder-first-pipeline-num-layers", "2"]
# the embedding and the loss counted as layers: (6 + 2) / 4 = 2 slots per stage, so
# megatron-core builds 1 + 2 + 2 + 1 layers
PP4_ACCOUNTED = ["--pipeline-model-parallel-size", "4", "--account-for-embedding-in-pipeline-split",
                 "--account-for-loss-in-pipeline-split"]
# the same with 2 virtual stages per rank: (6 + 2) / (2 x 2) = 2 slots per chunk, so
# megatron-core builds chunks of 1, 2 (rank 0) and 2, 1 (rank 1) layers
PP2V2_ACCOUNTED = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                   "2", "--account-for-embedding-in-pipeline-split",
                   "--account-for-loss-in-pipeline-split"]
TIMELINE = []  # where the pp=4 s=2 run writes its timeline (set by `plan`)
# name -> (world, layout, splits, chunks)
CASES = {f"pp4_s{n}": (4, PP4_UNEVEN, n, 1) for n in (1, 2, 3)}
CASES.update({f"pp2v2_s{n}": (2, PP2V2_UNEVEN, n, 2) for n in (1, 2)})
CASES.update({f"pp4acc_s{n}": (4, PP4_ACCOUNTED, n, 1) for n in (1, 2)})
CASES.update({f"pp2v2acc_s{n}": (2, PP2V2_ACCOUNTED, n, 2) for n in (1, 2)})


def _splits(n):
    return ["--seq1f1b-splits", str(n)]


def plan(tmp, corpus):
    init, start = init_run("init", tmp / "init", MODEL + BATCH)
    saved = tmp / "pp4_s2_saved"
    by_world = {1: [{"name": "ref", "argv": MODEL + BATCH + start, "params": True}],
                2: [], 4: []}
    for name, (world, layout, n, _) in CASES.items():
        run = {"name": name, "argv": MODEL + BATCH + start + layout + _splits(n),
               "params": True}
        if name == "pp4_s2":
            run["argv"] = run["argv"] + ["--save", str(saved), "--save-interval", "1000",
                                         "--timeline-file", str(tmp / "timeline.json")]
            TIMELINE.append(tmp / "timeline.json")
        by_world[world].append(run)
    # resume on the uneven layout: stop after iteration 1 (saving), go on from there
    stopped = tmp / "pp4_s3_stopped"
    resumed = MODEL + BATCH + PP4_UNEVEN + _splits(3)
    by_world[4].append({"name": "pp4_s3_stopped", "argv": resumed + start + [
        "--exit-interval", "1", "--save", str(stopped), "--save-interval", "1000"]})
    by_world[4].append({"name": "pp4_s3_resumed", "after": [str(stopped / TRACKER)],
                        "params": True, "argv": resumed + ["--load", str(stopped)]})
    # the same launch, after the save: even pp=2 x dp=2 loads it and trains no further
    by_world[4].append({"name": "pp2dp2_loaded", "after": [str(saved / TRACKER)],
                        "params": True, "argv": MODEL + BATCH + [
                            "--load", str(saved), "--pipeline-model-parallel-size", "2"]})
    return Plan([init], by_world)


@pytest.fixture(scope="module")
def results(exactness_runs):
    return exactness_runs[__name__]


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n in CASES if not n.endswith("_s1")])
def test_uneven_split_run_equals_unsplit_runs(results, name):
    world, layout, n, chunks = CASES[name]
    run, unsplit = results[name], results[name.rsplit("_", 1)[0] + "_s1"]
    check_split_units(name, run["forward_units"], splits=n, method="average", seq_length=48,
                      calls=ITERATIONS + 1, microbatches=MICROBATCHES, chunks=chunks)
    check_reports(name, run["reports"], unsplit["reports"], calls=ITERATIONS + 1,
                  microbatches=MICROBATCHES)
    assert not results["ref"]["forward_units"]
    for other, what in ((results["ref"], "one process"), (unsplit, "same layout, s=1")):
        assert_close_series(run["losses"], other["losses"], 1e-5, f"{name} loss vs {what}")
        assert_close_series(run["grad_norms"], other["grad_norms"], 1e-5,
                            f"{name} grad norm vs {what}")
        assert_close_series([run["final_validation_loss"]], [other["final_validation_loss"]],
                            1e-5, f"{name} validation loss vs {what}")
        assert_params_close(run["params"], other["params"])


@pytest.mark.distributed
def test_uneven_timeline_names_each_stages_layers(results):
    import json

    timeline = json.loads(TIMELINE[0].read_text())
    assert timeline["meta"]["stage_layers"] == [1, 2, 2, 1]
    assert len(timeline["ranks"]) == 4 and all(timeline["ranks"])


@pytest.mark.distributed
def test_uneven_resume_equals_the_uninterrupted_run(results):
    whole, first, rest = results["pp4_s3"], results["pp4_s3_stopped"], results["pp4_s3_resumed"]
    assert len(first["losses"]) == len(rest["losses"]) == 1
    assert_close_series(first["losses"] + rest["losses"], whole["losses"], 1e-5, "resumed loss")
    assert_close_series(first["grad_norms"] + rest["grad_norms"], whole["grad_norms"], 1e-5,
                        "resumed grad norm")
    assert_close_series([rest["final_validation_loss"]], [whole["final_validation_loss"]],
                        1e-5, "resumed validation loss")
    assert_params_close(rest["params"], whole["params"])


@pytest.mark.distributed
def test_uneven_checkpoint_loads_into_an_even_layout(results):
    saved, loaded = results["pp4_s2"], results["pp2dp2_loaded"]
    assert loaded["losses"] == []  # resumed at the last iteration: nothing left to train
    assert_params_close(loaded["params"], saved["params"], rtol=1e-6, atol=1e-7)
    assert_close_series([loaded["final_validation_loss"]], [saved["final_validation_loss"]],
                        1e-5, "validation loss after loading")


def test_stage_layer_counts_follow_megatron_core():
    assert stage_layer_counts(36, 8, 3, 3) == [3] + [5] * 6 + [3]
    assert stage_layer_counts(6, 4, 1, 1) == [1, 2, 2, 1]
    assert stage_layer_counts(6, 2, first=2) == [2, 4]
    assert stage_layer_counts(7, 3, last=1) == [3, 3, 1]
    assert stage_layer_counts(8, 4) == [2] * 4
    assert chunk_layer_counts([2, 4], 2) == [1, 2, 1, 2]
    for args, words in (((36, 8), "divisible by --pipeline-model-parallel-size"),
                        ((36, 8, 4, 4), "must divide among the 6 middle"),
                        ((6, 4, 0, 1), "--decoder-first-pipeline-num-layers must be > 0"),
                        ((4, 4, 2, 2), "leaves 0 layers for 2 middle"),
                        ((4, 2, 2, 3), "leaves -1 layers"),
                        ((6, 1, 2), "need --pipeline-model-parallel-size >= 2")):
        with pytest.raises(UnevenSplitError, match=words):
            stage_layer_counts(*args)
    with pytest.raises(UnevenSplitError, match="rank 0 holds 3 layers, not divisible by the 2"):
        stage_layer_counts(11, 3, 3, vp=2)


def test_accounted_embedding_and_loss_follow_megatron_core():
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    for num_layers, pp, vp, embedding, loss in (
            (6, 4, None, True, True), (7, 2, None, False, True), (7, 2, None, True, False),
            (30, 8, None, True, True), (10, 2, None, True, True), (6, 2, 2, True, True),
            (7, 2, 2, True, False), (7, 2, 2, False, True), (14, 4, 2, True, True),
            (22, 2, 4, True, True)):
        config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   virtual_pipeline_model_parallel_size=vp,
                                   account_for_embedding_in_pipeline_split=embedding,
                                   account_for_loss_in_pipeline_split=loss)
        # megatron-core's chunks in pipeline order: chunk c of rank r is stage c * pp + r
        built = [get_num_layers_to_build(config, vp_stage=None if vp is None else chunk,
                                         pp_rank=rank)
                 for chunk in range(vp or 1) for rank in range(pp)]
        counts = stage_layer_counts(num_layers, pp, vp=vp, account_for_embedding=embedding,
                                    account_for_loss=loss)
        assert chunk_layer_counts(counts, vp, embedding, loss) == built, (num_layers, pp, vp)
        assert counts == [sum(built[rank::pp]) for rank in range(pp)], (num_layers, pp, vp)
    assert stage_layer_counts(7, 2, account_for_loss=True) == [4, 3]
    assert chunk_layer_counts([3, 3], 2, True, True) == [1, 2, 2, 1]
    for args, kwargs, words in (
            ((6, 2), {"account_for_loss": True}, r"the 6 layers plus the loss \(7\) must be "
                                                  r"divisible by --pipeline-model-parallel-size"),
            ((2, 4), {"account_for_embedding": True, "account_for_loss": True},
             "pipeline rank 0 would hold no transformer layer"),
            ((6, 4, 1), {"account_for_loss": True}, "cannot be combined with --decoder-first"),
            ((6, 2, None, None, 2), {"account_for_embedding": True},
             r"\(7\) must be divisible by --pipeline-model-parallel-size \(2\) x virtual "
             r"stages \(2\)"),
            ((7, 2, None, None, 4), {"account_for_loss": True},
             "virtual stage 3 of pipeline rank 1 would hold no transformer layer")):
        with pytest.raises(UnevenSplitError, match=words):
            stage_layer_counts(*args, **kwargs)


def test_flags_are_checked_up_front():
    from megatron.trainer.arguments import ArgumentError, parse_args

    def parse(*flags, world=4):
        return parse_args(MODEL + BATCH + list(flags), world_size=world, cuda_available=False)

    assert parse(*PP4_UNEVEN).stage_layer_counts == [1, 2, 2, 1]
    assert parse(*PP4_ACCOUNTED).stage_layer_counts == [1, 2, 2, 1]
    assert parse(*PP2V2_ACCOUNTED, world=2).stage_layer_counts == [3, 3]
    # Megatron-LM's --num-layers-per-virtual-pipeline-stage counts the slots: (6 + 2) / 2 / 2
    per_stage = parse("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-"
                      "pipeline-stage", "2", "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split", world=2)
    assert per_stage.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ArgumentError, match=r"\(7\) must be divisible by "
                                            r"--pipeline-model-parallel-size \(2\) x virtual"):
        parse("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
              "2", "--account-for-loss-in-pipeline-split", world=2)
    with pytest.raises(ArgumentError, match="--slimpipe-attention-balance pairs the layers"):
        parse(*PP4_ACCOUNTED, "--slimpipe-slices", "4", "--seq1f1b-kv-cache", "chunked",
              "--slimpipe-attention-balance")
    args = parse(*PP2V2_UNEVEN, world=2)
    assert (args.stage_layer_counts, args.virtual_pipeline_model_parallel_size) == ([2, 4], 2)
    with pytest.raises(ArgumentError, match="--decoder-first-pipeline-num-layers"):
        parse("--pipeline-model-parallel-size", "4")  # 6 layers do not divide by 4
    with pytest.raises(ArgumentError, match="--num-virtual-stages-per-pipeline-rank, not "
                                            "--num-layers-per-virtual-pipeline-stage"):
        parse(*PP2V2_UNEVEN[:2], *PP2V2_UNEVEN[4:], "--num-layers-per-virtual-pipeline-stage",
              "1", world=2)
    with pytest.raises(ArgumentError, match="--slimpipe-attention-balance pairs the layers"):
        parse(*PP4_UNEVEN, "--slimpipe-slices", "4", "--seq1f1b-kv-cache", "chunked",
              "--slimpipe-attention-balance")
    with pytest.raises(ArgumentError, match="rank 0 holds 5 layers, not divisible by the 2"):
        parse("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
              "2", "--decoder-last-pipeline-num-layers", "1", world=2)


def test_pipeline_layout_is_megatron_lms():
    """--pipeline-model-parallel-layout: each chunk's transformer layers and the virtual
    stages as Megatron-LM derives them from its string (megatron-core parses and checks
    it); its errors name the flag; the other ways of shaping stages are refused beside it;
    MTP only with the loss on the last stage. (Trained: tests/test_moe_exactness.py.)"""
    from megatron.trainer.arguments import ArgumentError, parse_args

    def parse(*flags, world=2):
        return parse_args(MODEL + BATCH + ["--pipeline-model-parallel-size", "2"] + list(flags),
                          world_size=world, cuda_available=False)

    embedding_stage = parse("--pipeline-model-parallel-layout", "E|t*6L")
    assert embedding_stage.chunk_layer_counts == [0, 6]
    assert embedding_stage.stage_layer_counts == [0, 6]
    assert embedding_stage.virtual_pipeline_model_parallel_size is None
    interleaved = parse("--pipeline-model-parallel-layout", "Et|(tt|)*2,tL")
    assert interleaved.chunk_layer_counts == [1, 2, 2, 1]
    assert interleaved.stage_layer_counts == [3, 3]
    assert interleaved.virtual_pipeline_model_parallel_size == 2
    for flags, message in (
            (["E|t*5L"], "Number of decoder layers 5must match num_layers 6"),
            (["Et*6|L|tL"], "must be divisible by pipeline_model_parallel_size"),
            (["t*3|Et*3L"], "The first layer must be embedding"),
            (["Et*3|t*3Lx"], "Invalid layer character: x"),
            (["Et*3|t*3L", "--decoder-first-pipeline-num-layers", "3"],
             "drop --decoder-first-pipeline-num-layers (as Megatron-LM)"),
            (["Et|tt|tt|tL", "--virtual-pipeline-model-parallel-size", "2"],
             "drop --virtual-pipeline-model-parallel-size"),
            (["Et*3|t*3L", "--account-for-loss-in-pipeline-split"],
             "drop --account-for-loss-in-pipeline-split"),
            (["Et*3|t*3L", "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights",
              "--position-embedding-type", "rope"], "Number of mtp layers in layout must match"),
            (["Et*3|mt*3L", "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights",
              "--position-embedding-type", "rope"], "decoder layers must be placed before MTP"),
            (["Et*3|t*3|m|L", "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights",
              "--position-embedding-type", "rope", "--global-batch-size", "4"],
             "the MTP layers ('m') must be on the last stage")):
        with pytest.raises(ArgumentError) as error:
            parse("--pipeline-model-parallel-layout", *flags)
        assert "--pipeline-model-parallel-layout" in str(error.value), str(error.value)
        assert message in str(error.value), str(error.value)
    with_mtp = parse("--pipeline-model-parallel-layout", "Et*3|t*3mL", "--mtp-num-layers", "1",
                     "--untie-embeddings-and-output-weights", "--position-embedding-type",
                     "rope")
    assert with_mtp.chunk_layer_counts == [3, 3]
