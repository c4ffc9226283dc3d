"""`tests/dist_runner.py`, plus a record of when the data-parallel gradient reductions
started, for tests/test_overlap_grad_reduce.py.

    python tests/overlap_runner.py --nproc W SPEC.json OUT.json  (as tests/dist_runner.py)

Each rank writes OUT.json.rank<R>.json: for every call of `finalize_model_grads` (one
per training iteration), per model chunk, how many of its DDP bucket groups already had
their reduction in flight (started from the backward hooks, i.e. overlapped) and how
many it has. A run whose spec has "grad_sync_func": true gets Megatron-LM's
`config.grad_sync_func`. DDP buckets are made small (`OVERLAP_BUCKET_SIZE` parameters, Megatron-LM's
--ddp-bucket-size, which our flags lack) so that a chunk has several; a spec's
"bucket_size" overrides it (null: megatron-core's default). A run whose spec has
"legacy_distopt_save": true saves distributed-optimizer checkpoints as the project did
before it corrected megatron-core's fully_reshardable save of several buckets (wrong
optimizer state: tests/test_distopt_buckets.py).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_runner  # noqa: E402  (sets up sys.path and warnings as the runner does)

from megatron.trainer import checkpointing, training  # noqa: E402

BUCKET_SIZE = int(os.environ.get("OVERLAP_BUCKET_SIZE", "2000"))


def recording_finalize(records, finalize):
    """`finalize_model_grads` that first notes which reductions the hooks started."""

    def finalize_model_grads(model, *args, **kwargs):
        records[-1].append([[sum(group.grad_reduce_handle is not None
                                 for group in chunk.bucket_groups),
                             len(chunk.bucket_groups)] for chunk in model])
        return finalize(model, *args, **kwargs)

    return finalize_model_grads


def counting_pretrain(records, pretrain):
    """`pretrain` that opens a new list of records per configuration."""

    def run(*args, **kwargs):
        records.append([])
        return pretrain(*args, **kwargs)

    return run


def aligning_build_model(runs, records, build_model):
    """`build_model` that, for a run with "grad_sync_func" in its spec, sets
    `config.grad_sync_func` as Megatron-LM does under --align-grad-reduce: the schedule
    then starts each chunk's reductions itself."""

    def build(args, config, *rest, **kwargs):
        chunks = build_model(args, config, *rest, **kwargs)
        if runs[len(records) - 1].get("grad_sync_func"):
            config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        return chunks

    return build


def sized_ddp_config(runs, records, config_class):
    """DDP's config with the run's "bucket_size" (null: megatron-core's default),
    BUCKET_SIZE when its spec has none."""

    def make(**kwargs):
        kwargs["bucket_size"] = runs[len(records) - 1].get("bucket_size", BUCKET_SIZE)
        return config_class(**kwargs)

    return make


def legacy_save(runs, records, in_buffer_space):
    """checkpointing's bucket-layout correction, left out for a "legacy_distopt_save" run."""

    def choose(part):
        if runs[len(records) - 1].get("legacy_distopt_save"):
            return part.get_parameter_state_dp_zero  # megatron-core's own, as before
        return in_buffer_space(part)

    return choose


def main(spec_path, out_path):
    records = []  # per configuration, in the spec's order: per iteration, per chunk
    runs = json.load(open(spec_path))
    training.finalize_model_grads = recording_finalize(records, training.finalize_model_grads)
    training.build_model = aligning_build_model(runs, records, training.build_model)
    training.DistributedDataParallelConfig = sized_ddp_config(
        runs, records, training.DistributedDataParallelConfig)
    dist_runner.pretrain = counting_pretrain(records, dist_runner.pretrain)
    checkpointing._in_buffer_space = legacy_save(runs, records, checkpointing._in_buffer_space)
    dist_runner.main(spec_path, out_path)
    names = [run["name"] for run in runs]
    with open(f"{out_path}.rank{os.environ['RANK']}.json", "w") as handle:
        json.dump(dict(zip(names, records)), handle)


if __name__ == "__main__":
    dist_runner.command_line(main)
