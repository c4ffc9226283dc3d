"""pretrain_gpt.py with faults injected inside the launched process (torchrun runs this
file in its place), set by environment variables:

* FAULT_FSIZE_AT_SAVE=N (FAULT_FSIZE_RANK=R: that rank only): from the N-th checkpoint
  save on, RLIMIT_FSIZE of 2000 bytes. The kernel then refuses every write past 2000
  bytes of a file (EFBIG; Python ignores SIGXFSZ), the way a full disk refuses it
  (ENOSPC): a real failed write inside torch's and megatron-core's checkpoint writers,
  without root (a tiny tmpfs needs it).
* FAULT_WRITE_SLEEP_AT_SAVE=N (FAULT_WRITE_SLEEP=S seconds, default 60): --async-save's
  background writer of the N-th save waits S seconds before it writes (a slow disk), so
  a test can kill or signal the run while that write is in flight.
* FAULT_WRITE_FSIZE_AT_SAVE=N: --async-save's background writer of the N-th save (only
  it: the training process keeps writing) gets RLIMIT_FSIZE of 2000 bytes (EFBIG).
* FAULT_SIGTERM_AFTER_SAVE=N: SIGTERM to this process once the N-th save returned
  (with --async-save: while its write is in flight).
* FAULT_FREE_BYTES=B: the free space shutil.disk_usage reports (the pre-save check).
* FAULT_MEGATRON_LM_COMMON=1: saves carry Megatron-LM's common keys instead of this
  project's (a checkpoint as Megatron-LM writes it, for the load side).
* FAULT_OPTIMIZER_FORMAT=F: distributed-optimizer state saved in megatron-core's format F
  (e.g. dp_reshardable, Megatron-LM's default) instead of fully_reshardable.
* FAULT_PRE_GELU_SHAPE=1: saves carry the model shape without its GeLU record (a
  checkpoint as this project wrote it before it honoured --no-bias-gelu-fusion).
* FAULT_LOCAL_SPEC_NORM_NAMES=1: models save their norms under megatron-core's
  local-spec names (as this project did before 2026-12-07, and Megatron-LM does with
  --transformer-impl local).
* FAULT_RERUN_AS_ON_GPU=1: --rerun-mode takes a GPU job's path for a result reproduced in
  place (save the rerun, exit 16), which a CPU run refuses.
* FAULT_NODE_NAME=NAME: the node name megatron-core's rerun state machine sees (a job
  resumed "on another node", the rerun's second run).
* FAULT_NAN_SPLIT=I:S: in iteration I, the token losses of split S (Seq1F1B) of the first
  microbatch become NaN on the last pipeline stage, the other splits' stay finite;
  FAULT_NAN_SPLIT=I: every microbatch's token losses in iteration I (any schedule).
* FAULT_SLOW_STOP_LINE=S: rank 0 takes S seconds to print the line of a stop every rank
  agreed on (megatron/trainer/agreed_stop.py): a loaded node, where the other ranks
  would otherwise exit, and the launcher end rank 0, before the line is out.
"""

import collections
import os
import re
import resource
import runpy
import shutil
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import time  # noqa: E402

from megatron.trainer import async_save, checkpointing  # noqa: E402

_save = checkpointing.save_checkpoint
_saves = [0]


def _save_with_faults(*args, **kwargs):
    _saves[0] += 1
    at = int(os.environ.get("FAULT_FSIZE_AT_SAVE", "0"))
    rank = os.environ.get("FAULT_FSIZE_RANK")
    if at and _saves[0] >= at and rank in (None, os.environ.get("RANK", "0")):
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
    saved = _save(*args, **kwargs)
    if _saves[0] == int(os.environ.get("FAULT_SIGTERM_AFTER_SAVE", "0")):
        os.kill(os.getpid(), signal.SIGTERM)  # SLURM's preemption, while that save is written
    return saved


checkpointing.save_checkpoint = _save_with_faults

_writer = async_save.writer


def _writer_with_faults(write, *args, **kwargs):
    """In the writer process: the save it writes is known by its iteration (the files of
    iter_N.incomplete/ it writes; these tests save every iteration, so N is the save's
    number, also in a --use-persistent-ckpt-worker worker forked at the first save)."""
    iteration = int(re.search(r"iter_(\d{7})", str(args[1][0][0])).group(1))

    def faulty_write(*write_args, **write_kwargs):
        if iteration == int(os.environ.get("FAULT_WRITE_SLEEP_AT_SAVE", "0")):
            time.sleep(float(os.environ.get("FAULT_WRITE_SLEEP", "60")))
        if iteration == int(os.environ.get("FAULT_WRITE_FSIZE_AT_SAVE", "0")):
            resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
        return write(*write_args, **write_kwargs)

    return _writer(faulty_write, *args, **kwargs)


async_save.writer = _writer_with_faults

if os.environ.get("FAULT_FREE_BYTES"):
    _usage = collections.namedtuple("usage", "total used free")
    shutil.disk_usage = lambda path: _usage(10**12, 10**12, int(os.environ["FAULT_FREE_BYTES"]))

if os.environ.get("FAULT_MEGATRON_LM_COMMON"):
    _state = checkpointing._sharded_state_dict

    def _megatron_lm_state(*args, **kwargs):
        state = _state(*args, **kwargs)
        for key in ("model_shape", "layout", "distributed_optimizer", "has_optimizer",
                    "has_rng"):
            state.pop(key, None)
        state.update(checkpoint_version=3.0, args=None)
        return state

    checkpointing._sharded_state_dict = _megatron_lm_state

if os.environ.get("FAULT_OPTIMIZER_FORMAT"):
    checkpointing.DISTRIBUTED_OPTIMIZER_FORMAT = os.environ["FAULT_OPTIMIZER_FORMAT"]

if os.environ.get("FAULT_PRE_GELU_SHAPE"):
    _shape = checkpointing.model_shape

    def _pre_gelu_shape(args):
        shape = _shape(args)
        shape.pop("bias_gelu_fusion", None)
        return shape

    checkpointing.model_shape = _pre_gelu_shape

if os.environ.get("FAULT_LOCAL_SPEC_NORM_NAMES"):
    from megatron.seqsplit import model as _seqsplit_model

    def _local_spec_norm_names(multi_latent_attention, dense):
        # megatron-core's local spec: the fused QKV and fc1 names for every layer, no
        # names for MLA's
        return {} if multi_latent_attention else {
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

    _seqsplit_model.transformer_engine_norm_names = _local_spec_norm_names

if os.environ.get("FAULT_RERUN_AS_ON_GPU"):
    from megatron.trainer import rerun

    _decision = rerun.decision
    rerun.decision = lambda args, iteration, on_cuda, injected=False: _decision(
        args, iteration, True, injected)

if os.environ.get("FAULT_NODE_NAME"):
    import types

    from megatron.core import rerun_state_machine

    _uname = os.uname()
    _node = (_uname[0], os.environ["FAULT_NODE_NAME"], *_uname[2:])
    rerun_state_machine.os = types.SimpleNamespace(
        **{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    rerun_state_machine.os.uname = lambda: _node

if os.environ.get("FAULT_NAN_SPLIT"):
    from megatron.core import parallel_state

    from megatron.trainer import gpt, rerun

    _at, _, _split = os.environ["FAULT_NAN_SPLIT"].partition(":")
    _at, _split = int(_at), (int(_split) if _split else None)
    _forward_step = gpt.forward_step

    def _forward_step_with_nan(data_iterator, model, args=None):
        output, loss_func = _forward_step(data_iterator, model, args=args)
        hit = (rerun.machine().current_iteration + 1 == _at
               and parallel_state.is_pipeline_last_stage())
        if hit and _split is not None:
            split = data_iterator.split
            hit = split.microbatch_id == 0 and split.split_index == _split
        if hit:
            output = output * float("nan")  # the token losses (of the split)
        return output, loss_func

    gpt.forward_step = _forward_step_with_nan

if os.environ.get("FAULT_SLOW_STOP_LINE"):
    import builtins

    from megatron.trainer import agreed_stop

    def _slow_print(*args, **kwargs):
        time.sleep(float(os.environ["FAULT_SLOW_STOP_LINE"]))
        builtins.print(*args, **kwargs)

    agreed_stop.print = _slow_print  # the module's global shadows the builtin

sys.argv = [os.path.join(ROOT, "pretrain_gpt.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
