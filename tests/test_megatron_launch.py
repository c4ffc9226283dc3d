"""Megatron-LM users' launch scripts run unchanged (tests/launch_scripts/: the original
Seq1F1B run.sh and Megatron-LM examples (GPT-3, Llama-3, Mixtral, DeepSeek-V3, the
classic model-parallel one) and CI configs, their flags kept except shapes, data
paths and precision), each training 2 iterations with Seq1F1B on 2 CPU processes; and
the no-op and refused Megatron-LM flags, checked flag by flag."""

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import distributed
from distributed import ROOT, _free_port
from megatron.trainer.arguments import ArgumentErrors, build_parser, parse_args
from megatron.trainer.megatron_lm_flags import DEFAULT_VALUES_ACCEPTED, NO_OP_FLAGS, REFUSED_FLAGS

SCRIPTS = os.path.join(ROOT, "tests", "launch_scripts")
ITERATION = re.compile(r"iteration +(\d+)/ +(\d+) \|.*lm loss: ([0-9.eE+-]+|nan)")


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    """The built-in corpus as a GPT-2-style BPE vocabulary and a .bin/.idx pair, laid
    out as the original Seq1F1B run.sh expects ($DATA_PATH/data/...)."""
    root = tmp_path_factory.mktemp("launch_data")
    data = root / "data"
    data.mkdir()

    def tool(*argv):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    files = root / "stdlib_files.jsonl"
    tool("tools/build_code_corpus.py", "--output", str(files), "--max-bytes", "300000")
    corpus = root / "stdlib.jsonl"  # 2 kB documents: every split of '98,2,0' gets some
    with files.open() as source, corpus.open("w") as chunks:
        for line in source:
            content = json.loads(line)["content"]
            for start in range(0, len(content), 2000):
                chunks.write(json.dumps({"content": content[start:start + 2000]}) + "\n")
    tool("tools/train_tokenizer.py", "--input", str(corpus), "--json-key", "content",
         "--vocab-size", "512", "--output-dir", str(data))
    tool("tools/preprocess_data.py", "--input", str(corpus), "--json-keys", "content",
         "--output-prefix", str(data / "codeparrot"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(data / "vocab.json"), "--merge-file", str(data / "merges.txt"),
         "--append-eod", "--workers", "1")
    return root


def run_script(name, *argv, env=None, cwd=None, timeout=300):
    """Run a launch script to its end: (CompletedProcess, stdout + stderr). One that runs
    past ``timeout`` (each takes seconds; one hung once in a CI pass, 2026-12-08) fails the
    test with its output and every Python process's stack (faulthandler, on SIGABRT), and
    nothing it started is left running."""
    import psutil

    environment = dict(os.environ, TORCHRUN=f"{sys.executable} -m torch.distributed.run",
                       MASTER_PORT=str(_free_port()), PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1",
                       **(env or {}))
    proc = subprocess.Popen(["bash", os.path.join(SCRIPTS, name), *argv], cwd=cwd or ROOT,
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            if "python" in child.name().lower():  # by pid: this run's own processes
                child.send_signal(signal.SIGABRT)
        time.sleep(5)  # the stacks reach stderr before the group is killed
        out, err = distributed.kill_tree(proc)
        pytest.fail(f"{name} ran past {timeout} s; its output, with each Python process's "
                    f"stack at that moment:\n{(out + err)[-12000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), out + err


def assert_trained(proc, output, iterations=2, printed=None):
    """Exit 0, no error, the iteration lines of ``printed`` (default: every one)."""
    assert proc.returncode == 0, output[-4000:]
    assert "error:" not in output, output[-4000:]
    lines = ITERATION.findall(output)
    expected = printed or list(range(1, iterations + 1))
    assert [int(i) for i, _, _ in lines] == expected, output[-4000:]
    assert all(math.isfinite(float(loss)) for _, _, loss in lines)


@pytest.mark.distributed
def test_original_seq1f1b_run_sh(gpt2_data):
    env = dict(GPUS_PER_NODE="2", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", TP_SIZE="1",
               PP_SIZE="2", PP_SP="2", PP_SP_STR="uniform_comp", NUM_LAYERS="4", HIDDEN="64",
               NUM_ATTN_HEADS="4", SEQ_LENGTH="128", MICRO_BATCH="1", GLOBAL_BATCH="4",
               TRAIN_ITER="2", VPP_SIZE="1", PROFILE="false", RECOMPUTE="1",
               DATA_PATH=str(gpt2_data))
    proc, output = run_script("seq1f1b_run.sh", env=env)
    assert_trained(proc, output)
    assert "seq1f1b-splits=2" in output
    # --timing-log-level 2: real per-unit timers, printed each log interval
    assert re.search(r"forward-compute \.+: \(\d", output), output[-3000:]
    assert "note: --no-async-tensor-model-parallel-allreduce has no effect here" in output
    assert "note: --save-interval without --save: no checkpoints are written" in output


@pytest.mark.distributed
def test_megatron_gpt3_example(gpt2_data, tmp_path):
    data = gpt2_data / "data"
    ckpt = tmp_path / "ckpt"
    proc, output = run_script(
        "megatron_gpt3_175b.sh", str(ckpt), str(tmp_path / "tb"), str(data / "vocab.json"),
        str(data / "merges.txt"), str(data / "codeparrot_content_document"))
    assert_trained(proc, output)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert os.listdir(tmp_path / "tb")


@pytest.mark.distributed
def test_megatron_llama3_example(tmp_path):
    # the script runs ./pretrain_gpt.py and writes its data cache under $PWD: run it in
    # a scratch directory holding a link to ours
    (tmp_path / "pretrain_gpt.py").symlink_to(os.path.join(ROOT, "pretrain_gpt.py"))
    ckpt = tmp_path / "ckpt"
    proc, output = run_script("megatron_llama3_8b.sh", str(ckpt), str(tmp_path / "tb"),
                              cwd=tmp_path)
    assert_trained(proc, output)
    assert "throughput per GPU (TFLOP/s/GPU)" in output
    assert "note: --attention-backend fused runs PyTorch SDPA" in output
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.distributed
def test_megatron_classic_mp_example(gpt2_data, tmp_path):
    data = gpt2_data / "data"
    ckpt = tmp_path / "ckpt"
    env = dict(CHECKPOINT_PATH=str(ckpt), VOCAB_FILE=str(data / "vocab.json"),
               MERGE_FILE=str(data / "merges.txt"),
               DATA_PATH=str(data / "codeparrot_content_document"))
    proc, output = run_script("megatron_gpt_distributed_with_mp.sh", env=env)
    assert_trained(proc, output)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def ci_env(gpt2_data, tmp_path, **extra):
    """The environment Megatron-LM's CI gives its model_config.yaml runs (paths), on the
    test corpus; wandb offline."""
    data = gpt2_data / "data"
    ckpt = str(tmp_path / "ckpt")
    return dict(DATA_PATH=str(data / "codeparrot_content_document"),
                VOCAB_FILE=str(data / "vocab.json"), MERGE_FILE=str(data / "merges.txt"),
                DATA_CACHE_PATH=str(tmp_path / "cache"), TENSORBOARD_PATH=str(tmp_path / "tb"),
                CHECKPOINT_SAVE_PATH=ckpt, CHECKPOINT_LOAD_PATH=ckpt,
                WANDB_MODE="offline", WANDB_SILENT="true", **extra)


# reruns_resume_check_grads loads (--finetune) from a path under $CHECKPOINT_LOAD_PATH;
# with no checkpoint there and --save the same directory it starts from random weights
RERUNS_LOAD = "ckpt/model/mcore_gpt/gpt3_4b_pyt/25.03.05_bf16_rerun-enabled_v2"


def _ci_launches(gpt2_data, root):
    """name -> (script, argv, env) of the CI configs and the fork's functional test."""
    launches = {}
    for name in ("tp1_pp4_vp1", "rope_interleaved"):
        script = {"tp1_pp4_vp1": "megatron_ci_tp1_pp4_vp1_distopt_overlap.sh",
                  "rope_interleaved": "megatron_ci_rope_embeddings_interleaved.sh"}[name]
        launches[name] = (script, [], ci_env(gpt2_data, root / name))
    launches["15b_release"] = ("megatron_ci_gpt3_15b_release.sh", [], ci_env(
        gpt2_data, root / "15b_release", WANDB_EXPERIMENT="release-test",
        WANDB_SAVE_PATH=str(root / "15b_release" / "wandb")))
    env = ci_env(gpt2_data, root / "reruns", REPEAT="1")
    env["CHECKPOINT_SAVE_PATH"] = str(root / "reruns" / RERUNS_LOAD)
    launches["reruns"] = ("megatron_ci_reruns_resume_check_grads.sh", [], env)
    data = gpt2_data / "data"
    # DATA_PATH CHECKPOINT_PATH TENSORBOARD_DIR USE_TE TP PP NNODES MAX_STEPS USE_CORE VP
    # MBS GBS ADDITIONAL_PARAMS, as its sbatch script passes them
    fork = root / "fork_functional"
    launches["fork_functional"] = (
        "seq1f1b_pretrain_gpt3_distributed_test.sh",
        [str(data / "codeparrot_content_document"), str(fork / "ckpt"), str(fork / "tb"), "0",
         "1", "2", "1", "2", "0", "", "1", "4",
         "--pipe-sp-splits 2 --pipe-sp-strategy uniform_comp"],
        dict(VOCAB_FILE=str(data / "vocab.json"), MERGE_FILE=str(data / "merges.txt")))
    return launches


@pytest.fixture(scope="module")
def ci_runs(gpt2_data, tmp_path_factory):
    """The five scripts, two at a time (a 2-rank pipeline leaves a core idle while its
    ranks wait for each other): name -> (process, output, its directory)."""
    import threading

    root = tmp_path_factory.mktemp("ci_configs")
    launches = _ci_launches(gpt2_data, root)
    for name in launches:
        (root / name).mkdir(exist_ok=True)
    order = ["15b_release", "reruns", "tp1_pp4_vp1", "rope_interleaved", "fork_functional"]
    results = {}

    def lane(names):
        for name in names:
            script, argv, env = launches[name]
            results[name] = run_script(script, *argv, env=env) + (root / name,)

    threads = [threading.Thread(target=lane, args=(order[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def assert_ci_logging(output, directory, iterations=(1, 2), memory=True):
    """What the CI configs log: 'num zeros' and 'params norm' on the printed iterations,
    the TensorBoard scalars; on CPU the memory scalars (``memory``: asked for) noted as not
    reported."""
    from test_monitoring import scalars

    lines = [line for line in output.splitlines()
             if line.startswith(" iteration ") and "lm loss" in line]  # not the evaluations
    assert len(lines) == len(iterations), output[-3000:]
    assert all(re.search(r"num zeros: \d+ \| params norm: [\d.]+", line) for line in lines)
    tags = scalars(directory / "tb")
    assert [step for step, _ in tags["params-norm"]] == [1, 2], sorted(tags)
    assert [step for step, _ in tags["num-zeros"]] == [1, 2]
    note = "note: --log-memory-to-tensorboard reports the CUDA allocator's memory"
    assert (note in output) == memory
    assert "seq1f1b-splits=2" in output


def _saved_at(path):
    return (path / "latest_checkpointed_iteration.txt").read_text().strip()


@pytest.mark.distributed
def test_megatron_ci_gpt3_15b_release(ci_runs):
    pytest.importorskip("wandb", reason="the config logs to wandb (pip install wandb)")
    proc, output, directory = ci_runs["15b_release"]
    assert_trained(proc, output, printed=[2])  # --log-interval 100: the last one
    # --step-batch-size-schedule: batch 2, then 6 from 256 tokens (2 samples) on
    assert re.search(r"iteration +2/ +2 \| consumed samples: +8 \|.*global batch size: +6 \|",
                     output), output[-3000:]
    assert_ci_logging(output, directory, iterations=[2])
    assert glob.glob(str(directory / "wandb" / "wandb" / "offline-run-*"))
    assert _saved_at(directory / "ckpt") == "2"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp1_pp4_vp1", "rope_interleaved"])
def test_megatron_ci_small_gpt3(ci_runs, name):
    proc, output, directory = ci_runs[name]
    assert_trained(proc, output)
    assert_ci_logging(output, directory)
    assert _saved_at(directory / "ckpt") == "2"


@pytest.mark.distributed
def test_megatron_ci_reruns_resume_check_grads(ci_runs):
    proc, output, directory = ci_runs["reruns"]
    assert_trained(proc, output)
    assert_ci_logging(output, directory)
    assert "note: --recompute-num-layers has no effect here" in output
    # --rerun-mode validate_results: megatron-core's machine validated iteration 2 (the
    # first is never validated) and let it through
    assert "RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS" in output
    assert "Result validation enabled" in output
    assert _saved_at(directory / RERUNS_LOAD) == "2"


@pytest.mark.distributed
def test_original_seq1f1b_functional_test(ci_runs):
    proc, output, directory = ci_runs["fork_functional"]
    assert_trained(proc, output)
    assert_ci_logging(output, directory, memory=False)
    assert "note: --data-impl has no effect here" in output
    assert re.search(r"forward-compute \.+: \(\d", output), output[-3000:]  # level 2


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "1", "--mock-data", "--vocab-size", "128"]


def parse(*extra):
    return parse_args(BASE + list(extra), world_size=1, cuda_available=False)


# no-op flags whose values Megatron-LM checks (so do we): a valid one at this layout
CHECKED_VALUES = {"--hierarchical-context-parallel-sizes": "1"}


@pytest.mark.parametrize("flag", sorted(NO_OP_FLAGS))
def test_no_op_flag_is_accepted_with_its_reason(flag):
    takes_value, reason = NO_OP_FLAGS[flag]
    args = parse(flag, *([CHECKED_VALUES.get(flag, "v2")] if takes_value else []))
    assert (flag, reason) in args.no_op_flags
    help_text = " ".join(build_parser().format_help().split())
    assert " ".join(reason.split()) in help_text


@pytest.mark.parametrize("flag", sorted(REFUSED_FLAGS))
def test_refused_flag_gives_reason_and_alternative(flag):
    # (--moe-router-topk is implemented; --moe-latent-size is refused)
    given = flag + "latent-size" if flag.endswith("-") else flag
    with pytest.raises(ArgumentErrors) as error:
        parse(given, "2", "--lr", "1e-3")  # the value is taken with the flag; --lr still parses
    accepted = DEFAULT_VALUES_ACCEPTED.get(flag)  # its default value would be accepted
    suffix = f" (accepted: {flag} {'/'.join(accepted[0])})" if accepted else ""
    assert error.value.problems == [f"{given} is refused: {REFUSED_FLAGS[flag]}{suffix}"]


@pytest.mark.distributed
def test_every_problem_is_reported_at_once():
    """Unknown flags, bad choices, refused features and failed checks together, one line
    each, from the real entry point; exit 2 before any work."""
    argv = BASE + ["--fp32-residual-connection", "--lr-decay-style", "bogus",
                   "--lr-warmup-fractoin", "0.1", "--main-grads-dtype", "bf16",
                   "--save", "/tmp/never", "--micro-batch-size", "two", "--min-lr", "1"]
    proc = distributed.pretrain(argv, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    expected = ["--fp32-residual-connection is refused", "argument --lr-decay-style: invalid choice",
                "unknown flag --lr-warmup-fractoin", "did you mean --lr-warmup-fraction?",
                "argument --micro-batch-size: invalid int value: 'two'",
                "--main-grads-dtype is refused", "--save needs --save-interval",
                "--min-lr (1.0) must not exceed --lr"]
    for text in expected:
        assert sum(text in line for line in errors) == 1, (text, errors)
    assert len(errors) == 7, errors
    assert "iteration" not in proc.stdout


def test_train_samples_and_rampup_count_iterations_as_megatron_lm():
    # start 2, +2 up to 8 over 16 samples: batches 2 2 2 4 4 6 8 ... (megatron-core's
    # calculator); 40 samples take 8 iterations, as Megatron-LM's update_train_iters counts
    args = parse_args([a for a in BASE if a not in ("--train-iters", "1")] +
                      ["--train-samples", "40", "--global-batch-size", "8",
                       "--rampup-batch-size", "2", "2", "16", "--lr-warmup-fraction", "0.25"],
                      world_size=1, cuda_available=False)
    assert args.train_iters == 8
    assert (args.lr_decay_steps, args.lr_warmup_steps) == (40, 10)
    assert args.rampup_global_batch_sizes == [2, 4, 6, 8]


def test_step_batch_size_schedule_as_megatron_lm():
    """--step-batch-size-schedule: thresholds in tokens (K suffix, // --seq-length 64),
    the last batch is the global batch, and --train-samples 40 takes 9 iterations
    (Megatron-LM's update_train_iters: 2 2 2 4 4 6 8 8 8); where megatron-core has the
    calculator (0.19+), its batch at every consumed count is ours."""
    from megatron.trainer.batch_schedule import batch_at

    base = [a for a in BASE if a not in ("--train-iters", "1")] + ["--train-samples", "40"]
    text = "0:2 0.384K:4 704:6 1024:8"
    args = parse_args(base + ["--step-batch-size-schedule", text], world_size=1,
                      cuda_available=False)
    assert args.step_batch_schedule == [(0, 2), (6, 4), (11, 6), (16, 8)]
    assert (args.global_batch_size, args.train_iters) == (8, 9)
    assert args.rampup_global_batch_sizes == [2, 4, 6, 8]
    from megatron.core import num_microbatches_calculator as calculators
    if hasattr(calculators, "StepBatchsizeNumMicroBatchesCalculator"):
        theirs = calculators.StepBatchsizeNumMicroBatchesCalculator(
            micro_batch_size=1, data_parallel_size=1, decrease_batch_size_if_needed=False,
            rank=1, schedule=text, seq_length=64)
        for consumed in range(40):
            theirs.update(consumed, False)
            assert theirs.get_current_global_batch_size() == \
                batch_at(args.step_batch_schedule, consumed), consumed
    for extra, says in ((["--global-batch-size", "8"], "exclude each other"),
                        (["--micro-batch-size", "4"], r"the global batches \[2, 6\] are not"),
                        ([], "the first threshold must be 0")):
        schedule = "64:2 128:4" if not extra else text
        with pytest.raises(ArgumentErrors, match=f"--step-batch-size-schedule.*{says}"):
            parse_args(base + ["--step-batch-size-schedule", schedule] + extra,
                       world_size=1, cuda_available=False)


def test_rerun_mode_flags():
    """--rerun-mode and its flags (tests/test_rerun_engine.py runs them): Megatron-LM's
    values; error injection without the engine, and megatron-core 0.16.1's broken
    report_stats, refused with the reason."""
    from megatron import mcore_compat

    args = parse("--rerun-mode", "validate_results", "--error-injection-rate", "10",
                 "--error-injection-type", "persistent_error", "--check-for-spiky-loss",
                 "--check-for-large-grads", "--result-rejected-tracker-filename", "t.txt")
    assert (args.rerun_mode, args.error_injection_rate, args.error_injection_type) == \
        ("validate_results", 10, "persistent_error")
    assert args.check_for_spiky_loss and args.check_for_large_grads
    assert parse().rerun_mode == "disabled" and parse().error_injection_type == "transient_error"
    with pytest.raises(ArgumentErrors, match="--error-injection-rate injects into the rerun "
                                             "engine's validation: add --rerun-mode "
                                             "validate_results"):
        parse("--error-injection-rate", "3")
    with pytest.raises(ArgumentErrors, match="--error-injection-rate must be >= 0"):
        parse("--rerun-mode", "validate_results", "--error-injection-rate", "-1")
    if mcore_compat.rerun_report_stats_works():
        assert parse("--rerun-mode", "report_stats").rerun_mode == "report_stats"
    else:
        with pytest.raises(ArgumentErrors, match="--rerun-mode report_stats: the installed "
                                                 "megatron-core's report reads a "
                                                 "Caller.filename"):
            parse("--rerun-mode", "report_stats")


def test_iteration_based_schedule_counts_samples():
    args = parse("--global-batch-size", "4", "--lr-warmup-iters", "1", "--lr-decay-iters", "1",
                 "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "1")
    assert (args.lr_warmup_steps, args.lr_decay_steps, args.lr_wsd_decay_steps) == (4, 4, 4)
    with pytest.raises(ArgumentErrors, match="--lr-decay-samples counts samples"):
        parse("--lr-decay-samples", "8")
    with pytest.raises(ArgumentErrors, match="needs --lr-wsd-decay-iters"):
        parse("--lr-decay-style", "WSD")


def test_megatron_lm_defaults():
    args = parse("--group-query-attention")
    assert args.num_query_groups == 1  # Megatron-LM's default group count
    assert args.transformer_impl == "local"  # Transformer Engine is not installed here
    assert "Transformer Engine" in args.transformer_impl_note
    args = parse("--use-rotary-position-embeddings")
    assert args.position_embedding_type == "rope"
    assert parse("--no-position-embedding").position_embedding_type == "none"
    args = parse("--save-interval", "5")  # as Megatron-LM: no --save, no checkpoints
    assert args.save is None


@pytest.mark.distributed
def test_checkpoint_flags_finetune_and_checkpoint_args(tmp_path):
    """--no-save-optim/--no-save-rng leave those out (and a plain resume says so);
    --finetune loads the weights only and starts at iteration 0; --use-checkpoint-args
    takes the model shape from the checkpoint."""
    from distributed import TINY_MODEL, one_error_line, pretrain

    base = TINY_MODEL + ["--global-batch-size", "2", "--log-interval", "1"]
    lean = tmp_path / "lean"
    saved = pretrain(base + ["--train-iters", "2", "--save", str(lean), "--save-interval", "2",
                             "--no-save-optim", "--no-save-rng", "--apply-layernorm-1p"])
    assert saved.returncode == 0, saved.stderr[-3000:]
    resumed = pretrain(base + ["--train-iters", "3", "--load", str(lean), "--apply-layernorm-1p"])
    assert resumed.returncode == 1
    assert "holds no optimizer state (saved with --no-save-optim): pass --no-load-optim or " \
           "--finetune" in one_error_line(resumed.stderr)

    # the shape flags left out, --use-checkpoint-args supplies them (a wrong shape would
    # not load: the weights must match)
    tuned = pretrain(_without(base, "--num-layers", "--hidden-size")
                     + ["--train-iters", "2", "--load", str(lean), "--finetune",
                        "--use-checkpoint-args"])
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "(--finetune): training starts at iteration 0" in tuned.stdout
    # the same samples and seed as the saved run's first iteration, but trained weights
    first = [float(m[2]) for m in ITERATION.findall(saved.stdout)][0]
    assert [float(m[2]) for m in ITERATION.findall(tuned.stdout)][0] < first - 1e-3
    assert re.search(r"iteration +2/ +2 \|", tuned.stdout), tuned.stdout[-2000:]
    files = sorted(os.listdir(lean / "iter_0000002"))
    assert not any("optimizer" in name for name in files), files

    # --use-mp-args-from-checkpoint-args: also the checkpoint's parallel sizes (one
    # process, no virtual stages) replace the command line's; without
    # --use-checkpoint-args it is noted as without effect, as in Megatron-LM
    from megatron.trainer.arguments import parse_args

    two_stages = base + ["--train-iters", "3", "--load", str(lean), "--apply-layernorm-1p",
                         "--pipeline-model-parallel-size", "2",
                         "--virtual-pipeline-model-parallel-size", "2"]
    args = parse_args(two_stages + ["--use-checkpoint-args",
                                    "--use-mp-args-from-checkpoint-args"], world_size=2)
    assert (args.pipeline_model_parallel_size, args.tensor_model_parallel_size,
            args.virtual_pipeline_model_parallel_size, args.data_parallel_size) == (
        1, 1, None, 2)
    args = parse_args(two_stages + ["--use-mp-args-from-checkpoint-args"], world_size=2)
    assert (args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size) == (
        2, 2)
    assert ("note: --use-mp-args-from-checkpoint-args has no effect without "
            "--use-checkpoint-args (as in Megatron-LM)") in args.flag_notes


@pytest.mark.distributed
def test_pretrained_checkpoint_starts_a_run_that_then_resumes_from_its_own(tmp_path):
    """Megatron-LM's continued training (e.g. extending a model's context):
    --pretrained-checkpoint BASE --load RUN --save RUN. The first start finds no checkpoint
    in RUN and takes BASE's weights as --finetune does (the losses of --load BASE
    --finetune); after it saved and stopped, the same command resumes from RUN at its
    iteration (the uninterrupted run's next loss), not from BASE again. A BASE without a
    checkpoint stops before any work, naming the flag."""
    from distributed import TINY_MODEL, one_error_line, pretrain

    base = TINY_MODEL + ["--global-batch-size", "2", "--log-interval", "1",
                         "--train-iters", "3"]
    pretrained, run = tmp_path / "pretrained", tmp_path / "run"
    saved = pretrain(base + ["--save", str(pretrained), "--save-interval", "3"])
    assert saved.returncode == 0, saved.stderr[-3000:]
    continued = base + ["--pretrained-checkpoint", str(pretrained), "--load", str(run),
                        "--save", str(run), "--save-interval", "1"]
    started = pretrain(continued + ["--exit-interval", "2"])
    assert started.returncode == 0, started.stderr[-3000:]
    assert (f"--load {run} holds no checkpoint: starting from the weights of "
            f"--pretrained-checkpoint {pretrained}") in started.stdout
    assert f"loaded the weights of {pretrained / 'iter_0000003'} (--finetune)" in started.stdout
    uninterrupted = pretrain(base + ["--load", str(pretrained), "--finetune"])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    expected = [m[2] for m in ITERATION.findall(uninterrupted.stdout)]
    assert [m[2] for m in ITERATION.findall(started.stdout)] == expected[:2]
    resumed = pretrain(continued)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {run / 'iter_0000002'} at iteration 2" in resumed.stdout
    assert [(m[0], m[2]) for m in ITERATION.findall(resumed.stdout)] == [("3", expected[2])]

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = pretrain(base + ["--pretrained-checkpoint", str(empty), "--load", str(run / "x")])
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == (
        f"error: --pretrained-checkpoint {empty}: no checkpoint there "
        f"(latest_checkpointed_iteration.txt missing), and --load {run / 'x'} holds none "
        f"either: give the directory a run saved into (its --save)")


@pytest.mark.distributed
def test_start_eval_at_iter_skips_the_earlier_evaluations(tmp_path):
    """--start-eval-at-iter 3 with --eval-interval 1: the periodic evaluations run after
    iterations 3 and 4 only; a run resumed from iteration 3 evaluates iteration 4 on the
    samples the uninterrupted run did (the same validation loss; counting the skipped
    evaluations as run would move it)."""
    from distributed import TINY_MODEL, pretrain

    base = TINY_MODEL + ["--global-batch-size", "2", "--log-interval", "1", "--train-iters",
                         "4", "--eval-interval", "1", "--eval-iters", "1"]
    validation = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) ")
    ckpt = tmp_path / "ckpt"
    whole = pretrain(base + ["--start-eval-at-iter", "3", "--save", str(ckpt),
                             "--save-interval", "3"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    evaluated = validation.findall(whole.stdout)
    assert [iteration for iteration, _ in evaluated] == ["3", "4"], whole.stdout[-3000:]
    resumed = pretrain(base + ["--start-eval-at-iter", "3", "--load", str(ckpt),
                               "--ckpt-step", "3"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert validation.findall(resumed.stdout) == evaluated[1:]


@pytest.mark.distributed
def test_evaluation_batch_flags_read_the_same_samples(tmp_path):
    """--eval-global-batch-size / --eval-micro-batch-size: an evaluation of 2 steps of 2
    samples, or of 1 step of 4 in microbatches of 2, reads the 4 samples 1 step of 4
    microbatches of 1 reads, so every validation loss is the same (each sample holds as
    many loss tokens); at pp = 2 with Seq1F1B splits the executor's messages take the
    evaluation's micro-batch size. A batch that does not divide stops before work."""
    from distributed import TINY_MODEL, assert_close_series, run_configs

    base = TINY_MODEL + ["--global-batch-size", "4", "--train-iters", "2", "--eval-interval",
                         "1", "--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]
    results = run_configs(tmp_path, 2, [
        {"name": "default", "argv": base + ["--eval-iters", "1"]},
        {"name": "two_steps", "argv": base + ["--eval-iters", "2",
                                              "--eval-global-batch-size", "2"]},
        {"name": "mbs2", "argv": base + ["--eval-iters", "1", "--eval-micro-batch-size", "2"]},
    ])
    expected = results["default"]
    assert len(expected["validation_losses"]) == 2
    for name in ("two_steps", "mbs2"):
        assert_close_series(results[name]["losses"], expected["losses"], 1e-6, name)
        assert_close_series(results[name]["validation_losses"] + [
            results[name]["final_validation_loss"]], expected["validation_losses"] + [
            expected["final_validation_loss"]], 1e-6, f"{name} validation")
    with pytest.raises(ArgumentErrors, match=r"--eval-global-batch-size \(3\) must be "
                                             r"divisible by --eval-micro-batch-size \(2\)"):
        parse("--eval-global-batch-size", "3", "--eval-micro-batch-size", "2")


def _without(argv, *flags):
    """argv without the given flags and their values."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        else:
            out.append(token)
    return out


@pytest.mark.distributed
def test_rampup_decoupled_lr_and_workers_in_training(tmp_path):
    """--rampup-batch-size grows the batch as megatron-core's calculator says (consumed
    samples 2 4 6 10 14 20 28 36), --decoupled-lr 0 freezes exactly the embedding and
    output layer, and --num-workers does not change the losses."""
    import torch

    from distributed import TINY_MODEL, run_configs

    base = _without(TINY_MODEL, "--lr-warmup-iters") + ["--untie-embeddings-and-output-weights"]
    ramp = ["--train-samples", "40", "--global-batch-size", "8",
            "--rampup-batch-size", "2", "2", "16"]
    # the same batches as a step schedule (thresholds in tokens of --seq-length 48)
    steps = ["--train-samples", "40", "--step-batch-size-schedule", "0:2 288:4 528:6 768:8"]
    results = run_configs(tmp_path, 1, [
        {"name": "initial", "argv": base + ["--train-iters", "0"], "params": True},
        {"name": "ramp", "argv": base + ramp, "params": True},
        {"name": "steps", "argv": base + steps},
        {"name": "ramp_workers", "argv": base + ramp + ["--num-workers", "2"]},
        {"name": "decoupled", "argv": base + ramp + ["--decoupled-lr", "0"], "params": True},
    ])
    assert results["ramp"]["losses"] == results["ramp_workers"]["losses"]
    assert len(results["ramp"]["losses"]) == 8
    # Megatron-LM counts a last iteration past --train-samples for a step schedule
    assert len(results["steps"]["losses"]) == 9
    assert results["steps"]["losses"][:8] == results["ramp"]["losses"]
    initial, ramped, frozen = (torch.load(results[name]["params"])
                               for name in ("initial", "ramp", "decoupled"))
    edges = [name for name in initial if "word_embeddings" in name or "output_layer" in name]
    assert len(edges) == 2, list(initial)
    for name in initial:
        moved = not torch.equal(initial[name], frozen[name])
        assert moved == (name not in edges), name
        assert not torch.equal(initial[name], ramped[name]), name


@pytest.mark.distributed
def test_rampup_log_shows_the_growing_batch():
    from distributed import TINY_MODEL, pretrain

    run = pretrain(_without(TINY_MODEL, "--lr-warmup-iters") + [
        "--train-samples", "40", "--global-batch-size", "8",
                                 "--rampup-batch-size", "2", "2", "16"])
    assert run.returncode == 0, run.stderr[-3000:]
    consumed = [int(c) for c in re.findall(r"consumed samples: +(\d+)", run.stdout)]
    batches = [int(b) for b in re.findall(r"global batch size: +(\d+)", run.stdout)]
    assert consumed == [2, 4, 6, 10, 14, 20, 28, 36]
    assert batches == [2, 2, 2, 4, 4, 6, 8, 8]


def test_transformer_engine_default_only_where_it_runs(monkeypatch):
    """With Transformer Engine importable the default is Megatron-LM's, except where the
    split-aware local layers are needed (then local, with a note naming why)."""
    import megatron.trainer.arguments as arguments

    monkeypatch.setattr(arguments, "_te_importable", lambda: True)
    assert parse().transformer_impl == "transformer_engine"
    args = parse("--seq1f1b-splits", "2")
    assert args.transformer_impl == "local"
    assert "does not run with --seq1f1b-splits > 1 here" in args.transformer_impl_note


def _sentencepiece_model(directory):
    """A 300-piece BPE .model trained on the standard library's argparse.py (bos 1, eos 2),
    with the sentencepiece package (skips without it)."""
    sentencepiece = pytest.importorskip(
        "sentencepiece", reason="sentencepiece is not installed (pip install sentencepiece)")
    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()
    lines = directory / "lines.txt"
    lines.write_text("\n".join(line for line in text.splitlines() if line.strip()))
    sentencepiece.SentencePieceTrainer.train(
        input=str(lines), model_prefix=str(directory / "sp"), vocab_size=300,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    return str(directory / "sp.model")


@pytest.mark.distributed
def test_megatron_mixtral_example(tmp_path):
    """Megatron-LM's Mixtral example (Llama-2 tokenizer, mock data, 2 experts over EP 2
    with the all-to-all dispatcher, distributed optimizer, both overlaps) with Seq1F1B."""
    proc, output = run_script("megatron_mixtral_8x7b.sh", _sentencepiece_model(tmp_path))
    assert_trained(proc, output, printed=[2])  # Megatron-LM's --log-interval 100
    assert "load_balancing_loss:" in output and "seq1f1b-splits=2" in output
    assert "validation loss at iteration 2 on test set" in output


@pytest.mark.distributed
def test_megatron_deepseek_v3_example(gpt2_data, tmp_path):
    """Megatron-LM's DeepSeek-V3 example (MLA, MoE with a shared expert and sigmoid
    group-limited routing, forced load balancing, MTP, selective recomputation, a Hugging
    Face tokenizer) with Seq1F1B over 2 stages; with the example's default FSDP switch it
    stops naming the alternative before any work."""
    from megatron.dataprep.tokenizer import build_tokenizer

    data = gpt2_data / "data"
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    build_tokenizer("GPT2BPETokenizer", str(data / "vocab.json"),
                    str(data / "merges.txt"))._hf.save(str(tokenizer / "tokenizer.json"))
    env = dict(OUTPUT_PATH=str(tmp_path / "out"), TOKENIZER_MODEL=str(tokenizer),
               DATA_PATH=str(data / "codeparrot_content_document"), TP="1", EP="1",
               MBS="1", GBS="4", WANDB="0")
    proc, output = run_script("megatron_deepseek_v3.sh", env=dict(env, USE_MEGATRON_FSDP="0"))
    assert_trained(proc, output)
    assert "seq1f1b-splits=2" in output
    assert "seq_load_balancing_loss:" in output and "mtp_1 loss:" in output
    assert "validation loss at iteration 2" in output
    checkpoints = tmp_path / "out" / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    proc, output = run_script("megatron_deepseek_v3.sh", env=env)
    assert proc.returncode != 0
    assert "--use-megatron-fsdp is refused: FSDP is not supported with the pipeline " \
           "schedules here; use --use-distributed-optimizer" in output, output[-3000:]
    assert not ITERATION.search(output)


@pytest.mark.distributed
def test_sentencepiece_tokenizers_preprocess_and_train(tmp_path, capsys):
    """--tokenizer-type SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer
    (with the sentencepiece package): a .model trained here on the standard library, data
    preprocessed with it, and 2 iterations trained on that data (GPTSentencePieceTokenizer
    on Llama2Tokenizer's, the same pieces); vocabulary and end-of-document as Megatron-LM.
    A tokenizer type not built here stops the preprocessing with its reason."""
    from distributed import TINY_MODEL, pretrain
    from megatron.dataprep.tokenizer import build_tokenizer

    model = _sentencepiece_model(tmp_path)
    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert (llama.vocab_size, llama.eod) == (300, 2)
    assert llama.tokenize("import os")[0] == 1  # bos first, as Megatron-LM's Llama2Tokenizer
    assert plain.vocab_size == 304 and plain.eod == 302  # <CLS> <SEP> <EOD> <MASK> appended
    assert plain.detokenize(plain.tokenize("import os")) == "import os"
    # Megatron-LM's GPTSentencePieceTokenizer: nothing added, no BOS, documents end with eos
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert (gpt.vocab_size, gpt.eod) == (300, 2)
    assert gpt.tokenize("import os") == llama.tokenize("import os")[1:]

    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w") as out:
        for start in range(0, len(text), 1500):
            out.write(json.dumps({"text": text[start:start + 1500]}) + "\n")
    model_flags = _without(TINY_MODEL, "--mock-data", "--tokenizer-type", "--vocab-size")
    for kind, data in (("Llama2Tokenizer", "Llama2Tokenizer"),
                       ("SentencePieceTokenizer", "SentencePieceTokenizer"),
                       ("GPTSentencePieceTokenizer", "Llama2Tokenizer")):
        prefix = tmp_path / data
        if kind == data:
            proc = subprocess.run(
                [sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                 "--output-prefix", str(prefix), "--tokenizer-type", kind,
                 "--tokenizer-model", model, "--append-eod", "--workers", "1"],
                cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
        run = pretrain(model_flags + ["--train-iters", "2", "--global-batch-size", "2",
                                      "--data-path", f"{prefix}_text_document",
                                      "--split", "90,10,0", "--tokenizer-type", kind,
                                      "--tokenizer-model", model])
        assert run.returncode == 0, run.stderr[-3000:]
        losses = [float(m[2]) for m in ITERATION.findall(run.stdout)]
        assert len(losses) == 2 and abs(losses[0] - math.log(plain.vocab_size)) < 1.0, losses
    from megatron.dataprep.preprocess import main as preprocess_main

    capsys.readouterr()
    assert preprocess_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "tik"),
                            "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                            model]) == 2
    assert "--tokenizer-type TikTokenizer is refused: needs the tiktoken package" in \
        capsys.readouterr().err


def test_deterministic_mode_checks_and_sets_the_environment(monkeypatch):
    """As Megatron-LM: a non-deterministic NCCL_ALGO / CUBLAS_WORKSPACE_CONFIG /
    NVTE_ALLOW_NONDETERMINISTIC_ALGO is refused, unset ones get the canonical values."""
    import torch

    from megatron.trainer import determinism

    for name in determinism.DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    assert parse("--deterministic-mode").deterministic_mode
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ArgumentErrors) as error:
        parse("--deterministic-mode")
    assert "NCCL_ALGO='Tree' is not deterministic" in str(error.value)
    parse()  # without the flag the environment is not its business
    env = {"NCCL_ALGO": "Ring,CollnetDirect"}
    was = torch.are_deterministic_algorithms_enabled()
    try:
        determinism.apply(env)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    assert env == {"NCCL_ALGO": "Ring,CollnetDirect", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                   "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def test_recompute_modules_and_logging_values():
    args = parse("--recompute-activations", "--recompute-modules", "core_attn")
    assert (args.recompute_granularity, args.recompute_modules) == ("selective", ["core_attn"])
    args = parse("--recompute-activations", "--recompute-modules", "core_attn", "layernorm",
                 "mlp")
    assert args.recompute_modules == ["core_attn", "layernorm", "mlp"]
    for modules, problem in (
            (["moe_act"], "--recompute-modules moe_act is refused: megatron-core recomputes "
                          "the expert activation only inside its grouped-GEMM experts"),
            (["attn"], "--recompute-modules attn is refused: not a module Megatron-LM "
                       "recomputes; choose from core_attn, layernorm, mla_up_proj, mlp, moe, "
                       "moe_act, shared_experts"),
            (["mla_up_proj"], "--recompute-modules mla_up_proj needs --multi-latent-attention "
                              "(as in Megatron-LM)")):
        with pytest.raises(ArgumentErrors) as error:
            parse("--recompute-activations", "--recompute-modules", *modules)
        assert len(error.value.problems) == 1
        assert error.value.problems[0].startswith(problem), error.value.problems
    # without selective recomputation the modules are unused, as in Megatron-LM
    assert parse("--recompute-modules", "mla_up_proj").recompute_granularity is None
    with pytest.raises(ArgumentErrors) as error:
        parse("--tensorboard-queue-size", "0", "--log-memory-interval", "0")
    assert len(error.value.problems) == 1 and "--tensorboard-queue-size" in str(error.value)
    # on CPU the CUDA memory reports are noted, not silently dropped
    notes = parse("--log-memory-to-tensorboard", "--log-memory-interval", "5").flag_notes
    assert sum("reports the CUDA allocator's memory" in note for note in notes) == 2


def test_iteration_line_fields_of_the_logging_flags():
    from megatron.trainer.metrics import format_iteration_line

    line = format_iteration_line(3, 10, 12, 5.0, 1e-4, 4, 2.5, 0.75, 100.0, None, [0.1],
                                 num_zeros=17, params_norm=12.345678)
    assert "| grad norm: 0.75 | num zeros: 17 | params norm: 12.3457 |" in line
    plain = format_iteration_line(3, 10, 12, 5.0, 1e-4, 4, 2.5, 0.75, 100.0, None, [0.1])
    assert "num zeros" not in plain and "params norm" not in plain
