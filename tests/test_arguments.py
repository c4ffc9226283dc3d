"""Users' flag mistakes: one clear line naming the flag, before any process group."""

import os
import subprocess
import sys

import pytest

from megatron.trainer.arguments import ArgumentError, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "2", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "4"]


def parse(extra, world_size=1, cuda=False, base=GOOD):
    return parse_args(base + extra, world_size=world_size, cuda_available=cuda)


def test_good_flags_parse():
    args = parse(["--pipeline-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 2 and args.num_microbatches == 2
    assert args.distributed_backend == "gloo" and args.tokenizer_type == "NullTokenizer"
    assert args.ffn_hidden_size == 256 and args.num_query_groups == 4
    # Megatron-LM's defaults: the NaN check on, no signal handler, 10-minute timeouts
    assert args.check_for_nan_in_loss_and_grad and not args.exit_signal_handler
    assert args.distributed_timeout_minutes == 10 and args.exit_duration_in_mins is None
    assert not parse(["--no-check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad


def test_no_initialization_reaches_the_config():
    from megatron.trainer.model import transformer_config_from_args

    assert transformer_config_from_args(parse([])).perform_initialization
    args = parse(["--no-initialization", "--load", "/nonexistent/ckpt"])
    assert not transformer_config_from_args(args).perform_initialization


def test_cpu_initialization_reaches_the_config_on_a_gpu(monkeypatch):
    """--use-cpu-initialization: megatron-core's CPU initialisation on a GPU too (a CPU run
    always takes it)."""
    from megatron.trainer import device
    from megatron.trainer.model import transformer_config_from_args

    assert transformer_config_from_args(parse([])).use_cpu_initialization
    monkeypatch.setattr(device, "on_cuda", lambda args=None: True)
    assert not transformer_config_from_args(parse([])).use_cpu_initialization
    assert transformer_config_from_args(
        parse(["--use-cpu-initialization"])).use_cpu_initialization


def test_sgd_as_in_megatron_lm():
    """--optimizer sgd with Megatron-LM's --sgd-momentum (default 0.9)."""
    assert parse([]).optimizer == "adam"
    args = parse(["--optimizer", "sgd"])
    assert (args.optimizer, args.sgd_momentum) == ("sgd", 0.9)
    assert parse(["--optimizer", "sgd", "--sgd-momentum", "0"]).sgd_momentum == 0.0


def test_every_attention_backend_is_a_choice():
    for name in ("auto", "sdpa", "flash", "flex"):
        assert parse(["--attention-backend", name]).attention_backend == name
    with pytest.raises(ArgumentError, match="--attention-backend"):
        parse(["--attention-backend", "xformers"])


def test_virtual_stages_from_either_flag():
    for flag, value in (("--num-layers-per-virtual-pipeline-stage", "1"),
                        ("--virtual-pipeline-model-parallel-size", "2")):
        args = parse(["--pipeline-model-parallel-size", "2", flag, value,
                      "--seq1f1b-splits", "2"], world_size=2)
        assert args.virtual_pipeline_model_parallel_size == 2
    args = parse(["--pipeline-model-parallel-size", "2"], world_size=2)
    assert args.virtual_pipeline_model_parallel_size is None


def test_aliases_from_the_original_seq1f1b_code():
    args = parse(["--pipe-sp-splits", "4", "--pipe-sp-strategy", "uniform_comp"])
    assert args.seq1f1b_splits == 4 and args.seq1f1b_balance_method == "uniform_comp"


@pytest.mark.parametrize("extra,world,flag", [
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size"),
    (["--global-batch-size", "4", "--micro-batch-size", "1"], 8, "--global-batch-size"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers"),
    (["--num-attention-heads", "6", "--hidden-size", "60", "--tensor-model-parallel-size",
      "4"], 4, "--num-attention-heads"),
    (["--num-query-groups", "3"], 1, "--num-query-groups"),
    (["--fp16"], 1, "--fp16"),
    (["--bf16"], 1, "--bf16"),
    (["--pipeline-model-parallel-size", "2"], 3, "--pipeline-model-parallel-size"),
    (["--seq1f1b-splits", "0"], 1, "--seq1f1b-splits"),
    (["--seq1f1b-splits", "65"], 1, "--seq1f1b-splits"),
    (["--seq1f1b-splits", "4", "--seq1f1b-split-alignment", "3"], 1, "--seq-length"),
    (["--seq1f1b-splits", "2", "--transformer-impl", "transformer_engine"], 1,
     "--transformer-impl"),
    (["--recompute-granularity", "full"], 1, "--recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "0"], 1, "--recompute-num-layers"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], 1,
     "--recompute-num-layers"),
    (["--num-query-groups", "0"], 1, "--num-query-groups"),
    (["--global-batch-size", "0"], 1, "--global-batch-size"),
    (["--global-batch-size", "-4"], 1, "--global-batch-size"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes"),
    (["--exit-duration-in-mins", "0"], 1, "--exit-duration-in-mins"),
    (["--exit-interval", "0"], 1, "--exit-interval"),
    (["--distributed-backend", "nccl"], 1, "--distributed-backend"),
    (["--no-such-flag"], 1, "--no-such-flag"),
    (["--micro-batch-size", "two"], 1, "--micro-batch-size"),
    (["--data-path", "/nonexistent/prefix"], 1, "--data-path"),
    (["--save", "/tmp/ckpt"], 1, "--save-interval"),
    (["--virtual-pipeline-model-parallel-size", "2"], 1, "--pipeline-model-parallel-size"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"], 2,
     "--num-layers"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "3"], 2, "--global-batch-size"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--virtual-pipeline-model-parallel-size", "2"], 2,
     "--num-layers-per-virtual-pipeline-stage"),
    (["--optimizer", "muon"], 1, "--optimizer muon is not supported here"),
    (["--no-initialization"], 1, "--no-initialization leaves the weights uninitialised"),
    (["--no-initialization", "--load", "/tmp", "--dist-ckpt-strictness", "log_all"], 1,
     "--no-initialization with --dist-ckpt-strictness log_all"),
    (["--optimizer", "sgd", "--use-distributed-optimizer"], 2,
     "--optimizer sgd does not run with --use-distributed-optimizer"),
    (["--sgd-momentum", "x"], 1, "--sgd-momentum"),
])
def test_mistakes_name_the_flag(extra, world, flag):
    with pytest.raises(ArgumentError, match=flag):
        parse(extra, world_size=world)


def test_data_mistakes_stop_before_training(tmp_path):
    """What the dataset builder would refuse after the process groups exist is refused
    while parsing: a bad --split, a split share left empty, bad blend weights, a missing
    tokenizer; Megatron-LM's prefixes-only blend form is accepted."""
    from packed_documents import write_document_corpus

    prefix = str(tmp_path / "docs")
    write_document_corpus(prefix, vocab_size=200)  # 24 sequences
    base = [f for f in GOOD if f != "--mock-data"] + ["--tokenizer-type", "NullTokenizer"]

    def parse_data(*flags):
        return parse_args(base + list(flags), world_size=1, cuda_available=False)

    parse_data("--data-path", prefix, "--split", "90,10,0")
    parse_data("--data-path", prefix)  # 969,30,1: the test share is empty, but never read
    parse_data("--data-path", prefix, prefix, "--split", "90,10,0")  # prefixes only
    parse_data("--data-path", "0.3", prefix, "0.7", prefix, "--split", "90,10,0")
    for flags, flag in (
            (["--data-path", prefix, "--split", "abc"], "--split"),
            # 99,1,0 of 24 sequences: no validation sequence (--eval-iters > 0 reads some)
            (["--data-path", prefix, "--split", "99,1,0"], "--split"),
            (["--data-path", "-1", prefix, "2", prefix, "--split", "90,10,0"], "--data-path"),
            (["--data-path", prefix + ".bin", "--split", "90,10,0"], "--data-path")):
        with pytest.raises(ArgumentError, match=flag):
            parse_data(*flags)
    with pytest.raises(ArgumentError, match="--tokenizer-model"):
        parse(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
               str(tmp_path / "missing")])


def test_data_flags():
    base = [f for f in GOOD if f not in ("--mock-data",)]
    with pytest.raises(ArgumentError, match="--data-path"):
        parse_args(base, world_size=1, cuda_available=False)
    with pytest.raises(ArgumentError, match="--vocab-file"):
        parse_args(base + ["--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer"],
                   world_size=1, cuda_available=False)


@pytest.mark.distributed
def test_bad_flag_exits_nonzero_on_every_rank_with_one_line():
    """Each rank (as torchrun starts them) exits 2; only rank 0 prints, one line."""
    flags = GOOD + ["--pipeline-model-parallel-size", "2", "--num-layers", "3"]
    procs = [subprocess.Popen([sys.executable, "pretrain_gpt.py"] + flags, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(rank),
                                       WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT="29619"))
             for rank in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2]
    assert outputs[0][1].strip() == ("error: --num-layers (3) must be divisible by "
                                     "--pipeline-model-parallel-size (2), or set "
                                     "--decoder-first-pipeline-num-layers / "
                                     "--decoder-last-pipeline-num-layers"), outputs[0][1]
    assert outputs[1][1].strip() == "" and "Traceback" not in outputs[0][1]


def test_exit_signal_takes_any_signal_a_process_can_catch():
    """As Megatron-LM (any signal.Signals), but those no handler can catch."""
    assert parse(["--exit-signal", "SIGXCPU"]).exit_signal == "SIGXCPU"
    assert parse(["--exit-signal", "usr1"]).exit_signal == "SIGUSR1"
    for uncatchable in ("SIGKILL", "SIGSTOP"):
        with pytest.raises(ArgumentError, match="--exit-signal"):
            parse(["--exit-signal", uncatchable])
