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
# the second model family of the exactness suites: GQA (4 heads, 2 groups), RoPE,
# SwiGLU, RMSNorm, untied embeddings (TINY_MODEL is MHA, learned positions, LayerNorm,
# GeLU, tied)
GQA_ROPE_SWIGLU = ["--group-query-attention", "--num-query-groups", "2",
                   "--position-embedding-type", "rope", "--swiglu",
                   "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights"]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_configs(tmp_path, world_size, runs, timeout=900):
    """Train each {"name", "argv", "params"} run in one launch of `world_size` processes."""
    spec = tmp_path / f"spec_{world_size}_{abs(hash(json.dumps(runs))) % 10**8}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps(runs))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    if world_size == 1:
        cmd = [sys.executable, RUNNER, str(spec), str(out)]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(world_size), "--master-port", str(_free_port()), RUNNER, str(spec), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def init_checkpoint(tmp_path, model_flags):
    """A shared iteration-0 checkpoint so every layout starts from the same weights."""
    directory = tmp_path / "init_ckpt"
    if not (directory / "latest_checkpointed_iteration.txt").exists():
        run_configs(tmp_path, 1, [{
            "name": "init",
            "argv": model_flags + ["--train-iters", "0", "--save", str(directory), "--save-interval", "1000"],
        }])
    return ["--load", str(directory), "--no-load-optim", "--no-load-rng"]


def assert_close_series(actual, expected, rtol, what):
    assert len(actual) == len(expected), f"{what}: {len(actual)} vs {len(expected)} values"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e) + 1e-12, f"{what}[{i}]: {a} vs {e} (rtol {rtol})"


def assert_params_close(path_a, path_b, rtol=1e-5, atol=1e-6):
    """Every parameter entry within `rtol` relative, or `atol` absolute for entries near
    zero. fp32 reduction-order noise leaves up to ~3e-7 absolute after 3 Adam steps
    (measured over the Seq1F1B exactness cases), which is more than 1e-5 relative for
    entries near zero (biases start at 0; Adam normalises their tiny gradients)."""
    a, b = torch.load(path_a), torch.load(path_b)
    assert sorted(a) == sorted(b), f"parameter names differ: {set(a) ^ set(b)}"
    for name in a:
        assert a[name].shape == b[name].shape, f"{name}: {a[name].shape} vs {b[name].shape}"
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


# --- runs started as real processes, for the fault tests --------------------------------

def _single_process_env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", RANK="0",
                WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def pretrain(argv, timeout=300):
    """`python pretrain_gpt.py ARGV` as one process, to the end."""
    return subprocess.run([sys.executable, "pretrain_gpt.py"] + argv, cwd=ROOT,
                          env=_single_process_env(), capture_output=True, text=True,
                          timeout=timeout)


def start_pretrain(argv, world_size=1, launcher_flags=()):
    """pretrain_gpt.py started in the background: one process, or `world_size` torchrun
    workers (`launcher_flags` go to torchrun). Stop it with `kill_tree`."""
    if world_size == 1:
        cmd, env = [sys.executable, "pretrain_gpt.py"] + argv, _single_process_env()
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(world_size), "--master-port", str(_free_port()), *launcher_flags,
               "pretrain_gpt.py"] + argv
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_tree(proc):
    """SIGKILL a run and everything it started, by pid (never by name): torchrun's workers,
    and the multiprocessing manager megatron-core's checkpoint writer leaves behind a
    killed run, holding its output pipes. Returns the run's remaining (stdout, stderr)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
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
