"""Run several training configurations in one launch and record what they did.

    python tests/dist_runner.py --nproc W SPEC.json OUT.json  # W ranks forked from one
    python tests/dist_runner.py SPEC.json OUT.json            # one process
    torchrun --nproc-per-node W tests/dist_runner.py SPEC.json OUT.json  # also works

The ranks of `--nproc` are forked after the imports (MASTER_ADDR/MASTER_PORT from the
environment), so a launch imports torch and megatron-core once instead of once per rank.

SPEC is a JSON list of {"name": str, "argv": [pretrain_gpt flags], "params": bool,
"after": [paths]}: a run with "after" waits until those files exist (what another launch
running at the same time writes, such as the tracker file of a checkpoint it loads).
OUT (written by the last rank) maps each name to its per-iteration losses and grad
norms (and params norms and zero-gradient counts under --log-params-norm /
--log-num-zeros-in-grad, and each iteration's MoE aux losses) and, with "params", a path to the final parameters gathered into the unsplit
(tp=1, pp=1) layout, so any two layouts can be compared tensor by tensor. It also
holds "forward_units": one entry per call of `forward_step` with a split on the last
rank ({call, microbatch, split, splits, offset, length}, and for a microbatch's last
split the document ids of its rows when there are any), so a test can see that the
split schedule ran, with which splits, on which documents; and "reports": for every
call of the pipeline schedule (training steps, then evaluation), the per-microbatch
loss reports it returned on the last rank, so a test can compare Seq1F1B's return
value with megatron-core's (the runner wraps `training.get_forward_backward_func`).
"""

import gc
import json
import os
import re
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import megatron.trainer  # noqa: E402,F401 - before megatron-core, as pretrain_gpt.py (lazy_fusions)
from megatron.core import parallel_state  # noqa: E402
from megatron.pipeline_layers import chunk_layer_counts  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.trainer import training  # noqa: E402
from megatron.trainer.initialize import destroy_groups_except  # noqa: E402
from megatron.trainer.training import pretrain  # noqa: E402

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def gather_full_parameters(args, model):
    """Every parameter in the tp=1, pp=1 layout, on the last rank (None elsewhere)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_size, pp_rank = (args.pipeline_model_parallel_size,
                        parallel_state.get_pipeline_model_parallel_rank())
    chunk_layers = (getattr(args, "chunk_layer_counts", None)  # a layout's own counts
                    or chunk_layer_counts(args.stage_layer_counts, len(model),
                                          args.account_for_embedding_in_pipeline_split,
                                          args.account_for_loss_in_pipeline_split))
    local = {}
    for chunk_index, chunk in enumerate(model):
        # chunk c of rank r is global stage c * pp + r (stages may hold unequal layer counts)
        layer_offset = sum(chunk_layers[:chunk_index * pp_size + pp_rank])
        local.update(_chunk_parameters(args, _unwrap(chunk), layer_offset, tp_group, tp_size))
    # experts over EP ranks: local expert i of EP rank r is global expert r * E / EP + i;
    # each EP rank's experts come from its expert-data-parallel and expert-TP rank 0
    experts = {name: local.pop(name) for name in list(local) if ".local_experts." in name}
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if ep > 1:
        first = parallel_state.get_expert_model_parallel_rank() * (args.num_experts // ep)
        experts = {_EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + first}.", n): t
                   for n, t in experts.items()}
    tp_first = parallel_state.get_tensor_model_parallel_rank() == 0
    keep = dict(local) if tp_first and parallel_state.get_data_parallel_rank() == 0 else {}
    if (parallel_state.get_expert_tensor_parallel_rank() == 0
            and parallel_state.get_expert_data_parallel_rank() == 0):
        keep.update(experts)
    everything = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everything, keep)
    if torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return None
    merged = {}
    for part in everything:
        for name, tensor in part.items():
            if name == "output_layer.weight" and not args.untie_embeddings_and_output_weights:
                continue  # the last stage's copy of the tied embedding
            merged[name] = tensor
    return merged


def _chunk_parameters(args, module, layer_offset, tp_group, tp_size):
    local = {}
    # MoE routers' expert bias is a buffer updated by the step (not by the optimizer)
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith("expert_bias")]
    # experts are split over the expert TP group (--expert-tensor-parallel-size: 1 keeps
    # them whole on every TP rank)
    expert_tp = (parallel_state.get_expert_tensor_parallel_group(),
                 parallel_state.get_expert_tensor_parallel_world_size())
    for name, param in list(module.named_parameters()) + biases:
        tensor = param.detach().float().cpu()
        group, size = expert_tp if ".local_experts." in name else (tp_group, tp_size)
        if size > 1 and getattr(param, "tensor_model_parallel", False):
            dim = param.partition_dim
            shards = [torch.empty_like(tensor) for _ in range(size)]
            torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
            if args.swiglu and "linear_fc1" in name:
                # each rank holds [gate_r; up_r]: regroup to [gate; up]
                halves = [s.chunk(2, dim=dim) for s in shards]
                shards = [h[0] for h in halves] + [h[1] for h in halves]
            tensor = torch.cat(shards, dim=dim)
        name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
        local[name] = tensor
    return local


def recording_forward_step(units, reports):
    """`pretrain_gpt.forward_step` that appends what each split call ran to `units`
    (with the index of the schedule call it belongs to: the number of calls that have
    returned so far, `len(reports)`)."""

    def forward_step(data_iterator, model, **kwargs):
        result = pretrain_gpt.forward_step(data_iterator, model, **kwargs)
        split = getattr(data_iterator, "split", None)
        if split is not None:
            documents = split.document_ids if split.is_last else None
            units.append({"call": len(reports), "microbatch": split.microbatch_id,
                          "split": split.split_index, "splits": split.num_splits,
                          "offset": split.offset, "length": split.length,
                          "documents": None if documents is None else documents.tolist()})
        return result

    return forward_step


def recording_schedules(reports, choose=training.get_forward_backward_func):
    """`get_forward_backward_func` whose schedules append what they return to `reports`."""

    def get_forward_backward_func(**kwargs):
        schedule = choose(**kwargs)

        def run(**schedule_kwargs):
            returned = schedule(**schedule_kwargs)
            reports.append([{key: torch.as_tensor(value).view(-1).tolist()
                             for key, value in entry.items()} for entry in returned])
            return returned

        return run

    return get_forward_backward_func


def wait_for_files(paths, timeout=1200):
    deadline = time.time() + timeout
    for path in paths:
        while not os.path.exists(path):
            if time.time() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout}s")
            time.sleep(0.2)


def main(spec_path, out_path):
    runs = json.load(open(spec_path))
    # torch and megatron-core are tens of thousands of long-lived objects: without the
    # freeze each configuration's full collection (destroy_groups_except) scans them
    # all again, a third of a small configuration's time
    gc.freeze()
    results = {}
    for run in runs:
        wait_for_files(run.get("after", ()))
        captured, units, reports = {}, [], []
        started = time.time()
        training.get_forward_backward_func = recording_schedules(reports)

        def on_finish(args, model, run=run, captured=captured):
            if run.get("params"):
                captured["params"] = gather_full_parameters(args, model)
            # each global rank's pipeline stage: how the ranks were laid out
            stages = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(
                stages, parallel_state.get_pipeline_model_parallel_rank())
            captured["pipeline_ranks"] = stages

        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          recording_forward_step(units, reports), argv=run["argv"],
                          on_finish=on_finish)
        entry = {"losses": result.losses, "validation_losses": result.validation_losses,
                 "final_validation_loss": result.final_validation_loss,
                 "validation_losses_by_set": result.validation_losses_by_set,
                 "final_validation_losses": result.final_validation_losses,
                 "test_loss": result.test_loss, "learning_rates": result.learning_rates,
                 "grad_norms": [None if g is None else float(g) for g in result.grad_norms],
                 "forward_units": units, "reports": reports,
                 "params_norms": result.params_norms, "num_zeros": result.num_zeros,
                 "moe_losses": result.moe_losses,
                 "mtp_losses": result.mtp_losses,
                 "pipeline_ranks": captured.get("pipeline_ranks"),
                 "iteration": result.iteration, "exit_reason": result.exit_reason,
                 "seconds": time.time() - started}  # this run's wall time, on this rank
        if captured.get("params") is not None:
            path = f"{out_path}.{run['name']}.pt"
            torch.save(captured["params"], path)
            entry["params"] = path
        results[run["name"]] = entry
        destroy_groups_except()  # the next configuration builds its own groups
        gc.freeze()  # what survived that full collection: the next one skips it
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        with open(out_path, "w") as handle:
            json.dump(results, handle)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# what a run imports on first use (torch.optim's step imports torch._dynamo), imported
# once before the ranks are forked rather than in each rank
FIRST_USE = ("torch._dynamo", "megatron.core.datasets.blended_megatron_dataset_builder",
             "megatron.core.datasets.gpt_dataset", "megatron.core.dist_checkpointing.serialization",
             "megatron.dataprep.gpt_datasets", "psutil", "numpy.random")


def fork_ranks(world_size, rank_main, spec_path, out_path):
    """`world_size` ranks forked from this process, which has imported torch, megatron-core
    and the trainer once (torchrun would start an agent and `world_size` interpreters that
    each import them again: about 3 s of CPU per process, a large share of the test pass).
    Like torchrun, the first rank to fail stops the others, and its exit code is ours.
    MASTER_ADDR and MASTER_PORT come from the environment."""
    import importlib
    import signal

    for name in FIRST_USE:
        importlib.import_module(name)
    # gloo connects a group's pairs when they are first used instead of all at creation:
    # megatron-core creates a dozen groups per configuration and most pairs never talk
    # (a fifth less CPU for a tp=2 x pp=2 launch; the same losses)
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    gc.freeze()  # the imports' objects: shared with the ranks, never copied by a collection
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size))
            rank_main(spec_path, out_path)
            sys.exit(0)  # a rank ends here (its exceptions end it with a traceback, code 1)
        ranks[pid] = rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            print(f"dist_runner: rank exited with {code}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    sys.exit(failed)


def command_line(rank_main):
    """`[--nproc W] SPEC OUT`: W forked ranks, or this process as the one rank torchrun or
    the environment describes."""
    if sys.argv[1] == "--nproc":
        fork_ranks(int(sys.argv[2]), rank_main, sys.argv[3], sys.argv[4])
    else:
        rank_main(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    command_line(main)
