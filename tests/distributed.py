"""Helpers for tests that train real configurations in real processes (gloo on CPU)."""

import json
import os
import socket
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "dist_runner.py")

# A small GPT that still has every part the schedules touch.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "48", "--max-position-embeddings", "48",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
    "--seed", "1234",
]
# TINY_MODEL without its data and tokenizer (--mock-data, NullTokenizer, --vocab-size)
TINY_MODEL_WITHOUT_DATA = TINY_MODEL[:TINY_MODEL.index("--mock-data")] + TINY_MODEL[
    TINY_MODEL.index("--vocab-size") + 2:]


def argument_problems(argv):
    """(the trainer's flag problems, args or None) of a command line."""
    from megatron.trainer.arguments import ArgumentErrors, parse_args

    try:
        args = parse_args(argv)
    except ArgumentErrors as errors:
        return errors.problems, None
    return [], args


# the second model family of the exactness suites: GQA (4 heads, 2 groups), RoPE,
# SwiGLU, RMSNorm, untied embeddings (TINY_MODEL is MHA, learned positions, LayerNorm,
# GeLU, tied)
GQA_ROPE_SWIGLU = ["--group-query-attention", "--num-query-groups", "2",
                   "--position-embedding-type", "rope", "--swiglu",
                   "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights"]


def _free_port():
    """A port free now, for a launcher that binds it a second or two later: below the
    kernel's ephemeral range, which every connect() (gloo's pairs, TCPStore clients of the
    tests running beside) draws from, so none of those can take it meanwhile
    (EADDRINUSE in torchrun's rendezvous, seen once in CI)."""
    import random

    low = _ephemeral_range()[0]
    for _ in range(100 if low > 11000 else 0):
        port = random.randrange(10000, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range: any port free now
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = map(int, handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _without_master_port(env):
    """A single process picks its own free port right before it listens
    (megatron/trainer/initialize.py), instead of one chosen here seconds earlier, which
    another process (a gloo connection of a test running beside it) may take meanwhile."""
    env.pop("MASTER_PORT", None)
    return env


class Launch:
    """One launch of `world_size` processes training `runs` in turn (tests/dist_runner.py),
    started in the background; `result()` waits for it."""

    def __init__(self, tmp_path, world_size, runs, timeout=900):
        tag = abs(hash(json.dumps(runs))) % 10**8
        self.spec = tmp_path / f"spec_{world_size}_{tag}.json"
        self.out = self.spec.with_suffix(".out.json")
        self.log = self.spec.with_suffix(".log")
        self.spec.write_text(json.dumps(runs))
        self.timeout, self.world_size = timeout, world_size
        self._start()

    def _start(self):
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        if self.world_size == 1:
            self.cmd = [sys.executable, RUNNER, str(self.spec), str(self.out)]
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            _without_master_port(env)
        else:  # the ranks forked from one process that imported everything once
            self.cmd = [sys.executable, "-u", RUNNER, "--nproc", str(self.world_size),
                        str(self.spec), str(self.out)]
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        # output to a file, not a pipe: a launch may print more than a pipe holds while
        # nobody reads it (several launches run at once)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, text=True)

    def result(self, retry=True):
        try:
            returncode = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{' '.join(self.cmd)} ran past {self.timeout}s:\n"
                                 f"{self.log.read_text()[-6000:]}") from None
        if returncode != 0 and retry and "EADDRINUSE" in self.log.read_text():
            # the port was taken between its choice here and rank 0's listen
            self._start()
            return self.result(retry=False)
        if returncode != 0:
            raise AssertionError(f"{' '.join(self.cmd)} failed ({returncode}):\n"
                                 f"{self.log.read_text()[-9000:]}")
        return json.loads(self.out.read_text())

    def stop(self):
        if self.proc.poll() is None:
            kill_tree(self.proc)


def run_configs(tmp_path, world_size, runs, timeout=900):
    """Train each {"name", "argv", "params"} run in one launch of `world_size` processes.
    A run with "after": [paths] starts once those files exist (another launch writes them)."""
    return Launch(tmp_path, world_size, runs, timeout).result()


def run_lanes(tmp_path, lanes, timeout=1800):
    """Several launches at once: `lanes` is a list of lanes, each a list of
    (world_size, runs) launched in turn; the lanes run side by side. On two cores one
    launch leaves a core idle much of the time (a single process, or pipeline ranks
    waiting for each other); two lanes keep both busy. Returns every run's results; the
    first failure stops the other launches and is raised."""
    import threading

    results, failures, launches, lock = {}, [], [], threading.Lock()

    def lane(steps):
        for world_size, runs in steps:
            with lock:
                if failures:
                    return
                launch = Launch(tmp_path, world_size, runs, timeout)
                launches.append(launch)
            try:
                out = launch.result()
            except AssertionError as error:
                with lock:
                    failures.append(error)
                    for other in launches:
                        other.stop()
                return
            with lock:
                results.update(out)

    threads = [threading.Thread(target=lane, args=(steps,)) for steps in lanes if steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return results


TRACKER = "latest_checkpointed_iteration.txt"


def init_run(name, directory, model_flags):
    """A run saving an iteration-0 checkpoint, and the flags that start from it; with
    `Plan` the runs loading it wait for its tracker file (see `run_plans`)."""
    run = {"name": name, "writes": str(directory / TRACKER), "argv": model_flags + [
        "--train-iters", "0", "--save", str(directory), "--save-interval", "1000"]}
    return run, ["--load", str(directory), "--no-load-optim", "--no-load-rng"]


class Plan:
    """What one test module trains, to be run with other modules' plans (`run_plans`):
    `inits`: runs of `init_run` (one process, before any run loading them); `runs`:
    {world size: [runs]}, a run possibly with "after": [files another run writes]."""

    def __init__(self, inits=(), runs=None):
        self.inits, self.runs = list(inits), runs or {}


def run_plans(tmp_path, plans):
    """Train the runs of several modules' `Plan`s ({module name: plan}) in one launch per
    world size, two lanes side by side (`run_lanes`); returns {module name: its results}.

    Every launch imports torch and megatron-core in each of its processes (seconds of
    CPU each): sharing the launches between the exactness suites saves a few dozen of
    those. A run's name is prefixed with its module's, so names may repeat across
    modules. The single-process launch starts with every init run; the other launches
    start at once and wait for the checkpoints they load.

    Each launch keeps the dataset indices in a folder of its own (--data-cache-path: the
    same samples, an I/O setting): its rank 0 builds them once and every later run and
    rank loads them (megatron-core's mock dataset rebuilds a shuffle of its 100000
    documents otherwise, a fifth of a small run), and two launches running side by side
    never write the same index files (a packed-document corpus keeps them beside the
    corpus by default)."""
    by_world, writes = {}, []
    for module, plan in plans.items():
        for run in plan.inits:
            by_world.setdefault(1, []).append(dict(run, name=f"{module}:{run['name']}"))
            writes.append(run["writes"])
    for module, plan in plans.items():
        for world, runs in plan.runs.items():
            by_world.setdefault(world, []).extend(
                dict(run, name=f"{module}:{run['name']}",
                     after=writes + list(run.get("after", ()))) for run in runs)
    for world, runs in by_world.items():
        runs.sort(key=lambda run: bool(set(run.get("after", ())) - set(writes)))  # waiting: last
        cache = ["--data-cache-path", str(tmp_path / f"data_cache_{world}")]
        for run in runs:
            run["argv"] = run["argv"] + cache
    results = run_lanes(tmp_path, _lanes(by_world))
    split = {module: {} for module in plans}
    for name, result in results.items():
        module, _, run = name.partition(":")
        split[module][run] = result
    return split


def _lanes(by_world):
    """Two lanes of launches with about equal CPU (each process: ~5 s of imports, each
    run ~0.4 s per process), each in increasing world size: the single-process launch
    (the init runs) first. A launch never follows, in its lane, one it waits for."""
    def cost(world):
        return world * (5 + 0.4 * len(by_world[world]))

    producer = {run["writes"]: world for world, runs in by_world.items() for run in runs
                if "writes" in run}
    waits = {world: {producer[path] for run in runs for path in run.get("after", ())
                     if path in producer} - {world} for world, runs in by_world.items()}
    worlds = sorted(by_world)
    first, rest = worlds[0], worlds[1:]
    best = None
    for mask in range(2 ** len(rest)):
        lanes = [[first], []]
        for i, world in enumerate(rest):
            lanes[(mask >> i) & 1].append(world)
        if any(waits[lane[i]] & set(lane[i + 1:]) for lane in lanes for i in range(len(lane))):
            continue
        load = max(sum(cost(w) for w in lane) for lane in lanes)
        if best is None or load < best[0]:
            best = load, lanes
    return [[(world, by_world[world]) for world in lane] for lane in best[1]]


def assert_close_series(actual, expected, rtol, what):
    assert len(actual) == len(expected), f"{what}: {len(actual)} vs {len(expected)} values"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e) + 1e-12, f"{what}[{i}]: {a} vs {e} (rtol {rtol})"


def assert_params_close(path_a, path_b, rtol=1e-5, atol=1e-6, not_compared=None):
    """Every parameter entry within `rtol` relative, or `atol` absolute for entries near
    zero. fp32 reduction-order noise leaves up to ~3e-7 absolute after 3 Adam steps
    (measured over the Seq1F1B exactness cases), which is more than 1e-5 relative for
    entries near zero (biases start at 0; Adam normalises their tiny gradients).
    ``not_compared``: parameter name -> boolean mask of entries left out (entries whose
    exact gradient is zero: Adam turns their rounding noise into moves of up to lr)."""
    a, b = torch.load(path_a), torch.load(path_b)
    assert sorted(a) == sorted(b), f"parameter names differ: {set(a) ^ set(b)}"
    for name in a:
        assert a[name].shape == b[name].shape, f"{name}: {a[name].shape} vs {b[name].shape}"
        keep = ~not_compared[name] if name in (not_compared or {}) else ...
        torch.testing.assert_close(a[name][keep], b[name][keep], rtol=rtol, atol=atol,
                                   msg=name)


# --- runs started as real processes, for the fault tests --------------------------------

def _single_process_env():
    return _without_master_port(dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                                     RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"))


# One transformer layer of the trainer's spec, for tests that check a layer's math in a
# child process (`run_layer_child`).
ONE_LAYER = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
             "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--transformer-impl", "local"]

# The start of such a child: megatron-core's parallel state in one process (TP = PP = 1,
# an in-process store: no port or file to pick) and `model_of(flags)`; sys.argv[1] is the
# JSON of the base flags.
ONE_PROCESS_PRELUDE = r"""
import json, sys
import megatron.trainer  # first: megatron-core's fused functions run eagerly on CPU tensors
import torch
from megatron import cpu_support
cpu_support.apply()
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                     world_size=1)
import atexit
# the group ended before the interpreter: once in a CI run (megatron-core 0.19.2, a
# loaded host) a child aborted at exit, "terminate called without an active exception"
atexit.register(torch.distributed.destroy_process_group)
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
from megatron.trainer.arguments import parse_args
from megatron.trainer.model import gpt_model_provider, transformer_config_from_args

def model_of(argv, change_config=lambda config: None):  # the trainer's GPT, vocabulary 128
    args = parse_args(argv, world_size=1, cuda_available=False)
    args.padded_vocab_size = 128
    config = transformer_config_from_args(args)
    change_config(config)
    return gpt_model_provider(args, config)
"""


def run_layer_child(code, base):
    """Run ``ONE_PROCESS_PRELUDE + code`` with ``base`` flags; the JSON lines it printed."""
    proc = subprocess.run([sys.executable, "-c", ONE_PROCESS_PRELUDE + code, json.dumps(base)],
                          cwd=ROOT, env=_single_process_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def pretrain(argv, timeout=300, env=None, script="pretrain_gpt.py"):
    """`python pretrain_gpt.py ARGV` (or `script`) as one process, to the end: forked from
    this worker's pre-imported server (tests/forked_cli.py), a CompletedProcess."""
    import forked_cli

    return forked_cli.run([script] + argv, dict(_single_process_env(), **(env or {})),
                          timeout=timeout)


def start_pretrain(argv, world_size=1, launcher_flags=(), script="pretrain_gpt.py", env=None,
                   new_session=False):
    """pretrain_gpt.py (or `script`, e.g. tests/fault_hooks.py) started in the background:
    one process (forked from the pre-imported server, tests/forked_cli.py), or
    `world_size` torchrun workers (`launcher_flags` go to torchrun: what users launch);
    `env` adds variables; `new_session`: a process group of its own (a terminal's Ctrl-C
    reaches all of it). Stop it with `kill_tree`."""
    if world_size == 1:
        import forked_cli

        return forked_cli.start([script] + argv, dict(_single_process_env(), **(env or {})),
                                new_session=new_session)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
           str(world_size), "--master-port", str(_free_port()), *launcher_flags,
           script] + argv
    base = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(base, **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


def kill_tree(proc):
    """SIGKILL a run and everything it started, by pid (never by name): torchrun's workers,
    and the multiprocessing manager megatron-core's checkpoint writer leaves behind a
    killed run, holding its output pipes. Returns the run's remaining (stdout, stderr)."""
    import psutil
    import signal

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    try:
        if os.getpgid(proc.pid) == proc.pid:
            # a group of its own (forked runs, new_session): the kernel signals every
            # member, also one being forked right now, which the list above would miss
            # (megatron-core's checkpoint writer forks a process per file mid-save)
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for member in [proc] + children:
        try:
            member.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    proc.wait(timeout=60)
    return proc.communicate(timeout=60)


def wait_for_line(proc, pattern, timeout=120):
    """Read `proc`'s stdout until a line matches `pattern`; returns the match."""
    import re
    import time

    deadline = time.time() + timeout
    for line in proc.stdout:
        match = re.search(pattern, line)
        if match:
            return match
        assert time.time() < deadline, f"no {pattern!r} within {timeout}s"
    raise AssertionError(f"the run ended before printing {pattern!r}: "
                         f"{proc.stderr.read()[-3000:]}")


def one_error_line(stderr):
    """The single 'error:' line the user sees, with no traceback through our code."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert 'File "' + os.path.join(ROOT, "megatron") not in stderr, stderr[-3000:]
    return errors[0]
