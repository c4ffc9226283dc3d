"""Train several configurations in one torchrun launch and time every iteration.

    torchrun --nproc-per-node P -m megatron.benchmarks.runner SPEC.json OUT.json

SPEC is a JSON list of runs ``{"name": str, "config": str, "kind": str, "argv": [...]}``
(``argv``: ``pretrain_gpt.py`` flags). Each run is one in-process call of
``megatron.trainer.training.pretrain`` with ``pretrain_gpt``'s providers, so every
configuration trains the same model on the same data from the same seed. OUT
(written by the last rank) lists, per run, its name, config, kind, the wall time of
every ``train_step`` on every rank and the per-iteration losses.

Timing: ``train_step`` (forward-backward of all microbatches + optimizer step) is
timed on every rank by wrapping ``megatron.trainer.training.train_step`` for the
duration of the run; on CUDA the device is synchronised before the clock is read.
Nothing else in the training loop changes.
"""

import contextlib
import gc
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.trainer import training  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed_train_steps(durations):
    """Append the wall time of every ``train_step`` call to ``durations``."""
    original = training.train_step

    def timed(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        out = original(*args, **kwargs)
        _sync()
        durations.append(time.perf_counter() - start)
        return out

    training.train_step = timed
    try:
        yield
    finally:
        training.train_step = original


def run_one(run):
    """Train one configuration; returns (per-iteration seconds on this rank, losses)."""
    durations = []
    with timed_train_steps(durations):
        result = training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                   pretrain_gpt.forward_step, argv=run["argv"])
    gc.collect()
    return durations, list(result.losses)


def main(spec_path, out_path):
    runs = json.load(open(spec_path))
    results = []
    for index, run in enumerate(runs):
        durations, losses = run_one(run)
        world = torch.distributed.get_world_size()
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, (durations, losses))
        if torch.distributed.get_rank() == world - 1:
            all_losses = next((l for _, l in reversed(gathered) if l), [])
            entry = {"name": run["name"], "config": run.get("config", run["name"]),
                     "kind": run.get("kind", "timed"),
                     "iteration_seconds": [d for d, _ in gathered], "losses": all_losses}
            results.append(entry)
            per_iter = [max(step) for step in zip(*entry["iteration_seconds"])]
            print(f"[bench] {index + 1}/{len(runs)} {run['name']}: ms/iteration "
                  f"{' '.join(f'{1000 * t:.0f}' for t in per_iter)} | final loss "
                  f"{all_losses[-1] if all_losses else float('nan'):.6f}", flush=True)
            with open(out_path + ".partial", "w") as handle:
                json.dump(results, handle)
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        os.replace(out_path + ".partial", out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1], sys.argv[2])
