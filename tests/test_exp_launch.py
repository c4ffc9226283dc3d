"""exp.sh's GPU launch commands and the SLURM example, checked without GPUs.

The printed torchrun commands (`--dry-run`) must pass pretrain_gpt.py's own argument
checks for the world size they launch, and every node of a multi-node job must get its
own node rank, the same rendezvous address and a fresh port per run."""

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from megatron.trainer.arguments import parse_args

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(env_overrides, script="exp.sh", args=("--dry-run",), path_prefix=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MODEL", "GPUS_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "DATA_PATH", "EXTRA_ARGS")}
    env.update(env_overrides)
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return subprocess.run(["bash", str(ROOT / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _torchrun_commands(stdout):
    """[(launcher options, pretrain_gpt.py argv)] of the printed torchrun commands."""
    commands = []
    for line in stdout.splitlines():
        if not line.startswith("+ torchrun "):
            continue
        words = shlex.split(line[2:])
        script = words.index("pretrain_gpt.py")
        launcher = dict(zip(words[1:script:2], words[2:script:2]))
        commands.append((launcher, words[script + 1:]))
    return commands


@pytest.mark.parametrize("model, layout", [
    ("1.3B", dict(TP="1", PP="4", GPUS_PER_NODE="4", NNODES="1", SEQ_LEN="16384")),
    ("2.7B", dict(TP="2", PP="4", GPUS_PER_NODE="8", NNODES="1", SEQ_LEN="24576")),
    ("7B", dict(TP="8", PP="4", GPUS_PER_NODE="8", NNODES="4", SEQ_LEN="131072")),
    ("13B", dict(TP="8", PP="4", GPUS_PER_NODE="8", NNODES="8", SEQ_LEN="65536")),
    ("30B", dict(TP="8", PP="8", GPUS_PER_NODE="8", NNODES="8", SEQ_LEN="65536")),
])
def test_gpu_commands_pass_the_argument_checks(model, layout):
    env = dict(layout, MODEL=model, SPLITS="4", MICRO_BATCHES="8", NODE_RANK="0",
               MASTER_ADDR="node0", MASTER_PORT="6000")
    result = _dry_run(env)
    assert result.returncode == 0, result.stderr
    commands = _torchrun_commands(result.stdout)
    assert [argv[argv.index("--seq1f1b-splits") + 1] for _, argv in commands] == ["1", "4"]
    world = int(layout["GPUS_PER_NODE"]) * int(layout["NNODES"])
    for launcher, argv in commands:
        assert launcher["--nnodes"] == layout["NNODES"]
        assert launcher["--nproc-per-node"] == layout["GPUS_PER_NODE"]
        args = parse_args(argv, world_size=world, cuda_available=True)
        assert args.num_microbatches == 8
        assert args.bf16 and args.position_embedding_type == "rope"
        assert args.sequence_parallel == (int(layout["TP"]) > 1)
        assert args.seq_length == int(layout["SEQ_LEN"])
    assert [launcher["--master-port"] for launcher, _ in commands] == ["6000", "6001"]


def test_extra_args_and_balance_reach_both_runs():
    result = _dry_run(dict(MODEL="7B", TP="8", PP="1", GPUS_PER_NODE="8", BALANCE="average",
                           EXTRA_ARGS="--recompute-granularity selective"))
    assert result.returncode == 0, result.stderr
    for _, argv in _torchrun_commands(result.stdout):
        args = parse_args(argv, world_size=8, cuda_available=True)
        assert args.recompute_granularity == "selective"
        assert args.seq1f1b_balance_method == "average"


@pytest.mark.parametrize("env, message", [
    (dict(MODEL="8B"), "MODEL must be one of"),
    (dict(MODEL="7B", TP="8", PP="4", GPUS_PER_NODE="8", NNODES="1"), "must be a multiple of TP x PP"),
    (dict(MODEL="7B", TP="8", PP="1", GPUS_PER_NODE="8", NNODES="2", NODE_RANK="2"), "NODE_RANK"),
])
def test_gpu_launch_mistakes_stop_before_launching(env, message):
    result = _dry_run(env)
    assert result.returncode == 2
    assert message in result.stderr
    assert "torchrun" not in result.stdout


def _fake_slurm_tools(directory: Path, hosts):
    """`scontrol show hostnames` and an `srun` that runs its command once per node, in
    order, with that node's SLURM_NODEID (what SLURM does, minus the parallelism)."""
    scontrol = directory / "scontrol"
    scontrol.write_text("#!/usr/bin/env bash\n"
                        f"[[ \"$1 $2\" == 'show hostnames' ]] && printf '%s\\n' {' '.join(hosts)}\n")
    srun = directory / "srun"
    srun.write_text(
        "#!/usr/bin/env bash\n"
        "nodes=1\n"
        "while [[ $1 == -* ]]; do\n"
        "  case $1 in --nodes) nodes=$2; shift 2 ;; --ntasks-per-node) shift 2 ;; *) shift ;; esac\n"
        "done\n"
        "for ((i = 0; i < nodes; i++)); do echo \"== node $i\"; SLURM_NODEID=$i \"$@\" || exit $?; done\n")
    for tool in (scontrol, srun):
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def test_slurm_example_gives_every_node_its_rank(tmp_path):
    hosts = ["gpu-a17", "gpu-a18", "gpu-b02", "gpu-b03"]
    _fake_slurm_tools(tmp_path, hosts)
    env = dict(SLURM_JOB_NODELIST="gpu-a[17-18],gpu-b[02-03]", SLURM_JOB_NUM_NODES="4",
               SLURM_JOB_ID="123456", SLURM_GPUS_ON_NODE="8", DRY_RUN="1",
               MODEL="7B", SEQ_LEN="65536", TP="8", PP="4", SPLITS="4")
    result = _dry_run(env, script="examples/slurm_seq1f1b.sbatch", args=(),
                      path_prefix=str(tmp_path))
    assert result.returncode == 0, result.stderr
    per_node = result.stdout.split("== node ")[1:]
    assert len(per_node) == 4
    for rank, text in enumerate(per_node):
        commands = _torchrun_commands(text)
        assert len(commands) == 2
        for run, (launcher, argv) in enumerate(commands):
            assert launcher["--node-rank"] == str(rank)
            assert launcher["--nnodes"] == "4" and launcher["--nproc-per-node"] == "8"
            assert launcher["--master-addr"] == "gpu-a17"
            assert launcher["--master-port"] == str(20000 + 123456 % 20000 + run)
            parse_args(argv, world_size=32, cuda_available=True)


def test_slurm_example_refuses_to_run_outside_slurm():
    result = _dry_run(dict(DRY_RUN="1"), script="examples/slurm_seq1f1b.sbatch", args=())
    assert result.returncode != 0
    assert "sbatch" in result.stderr


def _without_data(argv):
    """The demo's argv with mock data instead of the corpus its data step would build."""
    out, words = [], iter(argv)
    for word in words:
        if word in ("--data-path", "--tokenizer-type", "--vocab-file", "--merge-file"):
            next(words)
        else:
            out.append(word)
    return out + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"]


def test_cpu_demo_commands_compare_three_schedules_in_one_table(tmp_path):
    runs = tmp_path / "runs"
    result = _dry_run({"DATA_DIR": str(tmp_path / "data"), "RUNS_DIR": str(runs)})
    assert result.returncode == 0, result.stderr
    lines = [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]
    trainings = [shlex.split(line) for line in lines if "pretrain_gpt.py" in line]
    # the demo's checkpoints are removed before the first round: every run starts at 0
    assert lines.index(f"rm -rf {runs / 'checkpoints'}") < lines.index(
        next(line for line in lines if "pretrain_gpt.py" in line))
    names, schedules, stops = [], [], []
    for round_index, words in enumerate(trainings):
        # the whole output goes to the log the table reads; the second round adds to it
        assert words[-2] == (">" if round_index < 3 else ">>")
        argv = _without_data(words[words.index("pretrain_gpt.py") + 1:-2])
        args = parse_args(argv, world_size=2, cuda_available=False)
        name = Path(words[-1]).stem
        assert args.timeline_file == str(runs / f"timeline_{name}.json")
        assert args.activation_memory_file == str(runs / f"memory_{name}.json")
        assert args.log_interval == 1  # every iteration's loss is compared
        # the long-context regime the demo shows: as many microbatches as stages (1F1B
        # idles a third of the span) and 512-token splits (smaller ones cost more than
        # they save on CPU: docs/results.md)
        assert args.global_batch_size // args.micro_batch_size == 2
        assert args.pipeline_model_parallel_size == 2 and args.seq_length == 2048
        # each round resumes the run's own checkpoint and stops with one
        assert args.save == args.load == str(runs / "checkpoints" / name)
        assert args.save_interval == args.exit_interval
        stops.append((args.exit_interval, args.train_iters))
        names.append(name)
        schedules.append((args.pipeline_schedule, args.seq1f1b_splits, args.slimpipe_slices))
    # two rounds, the schedules in turn, that together train every iteration once
    assert len(trainings) == 6 and names[3:] == names[:3] and schedules[3:] == schedules[:3]
    assert all(interval * 2 == iters for interval, iters in stops)
    names = names[:3]
    assert schedules[0][1:] == (1, None) and schedules[1][1:] == (4, None)
    assert schedules[2] == ("slimpipe", 1, 4)
    table = [shlex.split(line) for line in lines if "tools/demo_table.py" in line]
    assert table == [["python", "tools/demo_table.py", str(runs), *names]]
    (draw,) = [shlex.split(line) for line in lines if "tools/draw_timeline.py" in line]
    assert draw[draw.index("--memory") + 1:draw.index("--titles")] == [
        str(runs / f"memory_{name}.json") for name in names]
