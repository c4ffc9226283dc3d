"""What the training loop reports and tidies per iteration, with Megatron-LM's flags.

One ``Monitor`` per ``train`` call owns:

* **timers** (``--timing-log-level``, ``--timing-log-option``): megatron-core's
  ``Timers``, handed to megatron-core through ``config.timers`` (schedules, p2p,
  gradient sync, optimizer) as Megatron-LM does. Level 1: ``forward-backward``,
  ``all-grads-sync``, ``optimizer`` and the optimizer's inner timers. Level 2 adds
  ``forward-compute``, ``backward-compute`` and the p2p ``forward-send`` /
  ``forward-recv`` / ... timers. megatron-core's own schedules start ``forward-backward``
  and ``forward-compute`` themselves; our executor (Seq1F1B, SlimPipe, interleaved) does
  not, so for it the Monitor times the schedule call and wraps the user's
  ``forward_step`` and loss function (``backward-compute`` and the p2p timers come from
  megatron-core's ``backward_step``, which the executor calls, and from the executor's
  message batches, timed under megatron-core's p2p timer names).
  Printed every ``--log-interval`` on the last rank, averaged per iteration.
* **writers** (``--tensorboard-dir``, ``--wandb-project``): TensorBoard and Weights &
  Biases on the last rank, as Megatron-LM, with Megatron-LM's scalar names; the
  per-iteration scalars every ``--tensorboard-log-interval`` iterations, the timers
  (``<name>-time``, the max over ranks), ``iteration-time`` and ``throughput`` with
  ``--log-timers-to-tensorboard``, validation perplexity with
  ``--log-validation-ppl-to-tensorboard``. wandb writes under ``--wandb-save-dir``,
  else ``<--save>/wandb``, else ``./wandb``.
* **profiler** (``--profile``, ``--profile-step-start/end``, ``--profile-ranks``): a
  torch.profiler trace of the iterations after ``--profile-step-start`` completed
  iterations up to and including iteration ``--profile-step-end`` (defaults 10, 12:
  iterations 11 and 12, Megatron-LM's steps), each iteration labelled ``iteration N``
  in the trace, written to ``--tensorboard-dir`` (TensorBoard's profiler plugin reads
  it there), else to ``./torch_profile``, as ``rank<R>.<time>.pt.trace.json``. On GPU
  also ``cudaProfilerStart/Stop`` around the same iterations, so
  ``nsys profile --capture-range=cudaProfilerApi`` captures them; the trace then holds
  CPU activity only, leaving CUDA's profiling interface to nsys, unless
  ``--use-pytorch-profiler`` asks for CUDA kernels in the trace too.
* **garbage collection** (``--manual-gc``, ``--manual-gc-interval``,
  ``--no-manual-gc-eval``): automatic collection off during training so every rank
  collects at the same iterations; a full collection at the start, every
  ``--manual-gc-interval`` iterations (0: never) and before evaluation, a
  generation-0 one after it. The previous state is restored at the end.
* **memory hygiene** (``--empty-unused-memory-level``): ``torch.cuda.empty_cache()``
  after forward/backward (and each evaluation step) at level >= 1, after the optimizer
  step at level 2; nothing to release on CPU.
"""

import contextlib
import functools
import gc
import logging
import math
import os

import torch
from megatron.core.timers import Timers
from megatron.core.utils import get_model_config

from megatron.schedules.executor import forward_backward_pipelining_seq1f1b
from megatron.trainer import device

# Megatron-LM's timers, by the level that shows them (timers never started are skipped)
LEVEL_1_TIMERS = (
    "forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
    "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros",
    "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
)
LEVEL_2_TIMERS = (
    "batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
    "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
)
DEFAULT_PROFILE_DIR = "torch_profile"
# --log-memory-to-tensorboard: Megatron-LM's tags and the torch.cuda.memory_stats keys
MEMORY_SCALARS = (
    ("mem-reserved-bytes", "reserved_bytes.all.current"),
    ("mem-allocated-bytes", "allocated_bytes.all.current"),
    ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
    ("mem-allocated-count", "allocation.all.current"),
)


def set_logging_level(args):
    """--logging-level, else MEGATRON_LOGGING_LEVEL: the root logger's level, as
    Megatron-LM's setup_logging."""
    level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    level = args.logging_level if args.logging_level is not None else level
    if level is not None:
        logging.getLogger().setLevel(int(level))


def report_memory(name):
    """Megatron-LM's CUDA memory line (--log-memory-interval), on data-parallel rank 0."""
    from megatron.core import parallel_state

    mb = 1024.0 * 1024.0
    text = (f"{name} memory (MB) | allocated: {torch.cuda.memory_allocated() / mb:.2f}"
            f" | max allocated: {torch.cuda.max_memory_allocated() / mb:.2f}"
            f" | reserved: {torch.cuda.memory_reserved() / mb:.2f}"
            f" | max reserved: {torch.cuda.max_memory_reserved() / mb:.2f}")
    if parallel_state.get_data_parallel_rank() == 0:
        print(f"[Rank {torch.distributed.get_rank()}] {text}", flush=True)


def _is_last_rank() -> bool:
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


class Writers:
    """TensorBoard and wandb on the last rank (None elsewhere), as Megatron-LM."""

    def __init__(self, args):
        self.tensorboard = self.wandb = None
        if not _is_last_rank():
            return
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir,
                                             max_queue=args.tensorboard_queue_size)
        if args.wandb_project:
            self.wandb = _start_wandb(args)

    def add(self, name, value, step, to_wandb=True):
        """``to_wandb=False`` for scalars over samples: wandb's steps only increase."""
        if value is None:
            return
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None and to_wandb:
            self.wandb.log({name: value}, step=step)

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.flush()
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(args):
    try:
        import wandb
    except ImportError as error:  # validate_args refuses it before any work; library callers
        raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") \
            from error
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save
                                       else "wandb")
    os.makedirs(save_dir, exist_ok=True)
    config = {key: value if isinstance(value, (int, float, str, bool, type(None))) else
              str(value) for key, value in vars(args).items()}
    extra = {"entity": args.wandb_entity} if args.wandb_entity else {}
    wandb.init(dir=save_dir, project=args.wandb_project, name=args.wandb_exp_name,
               config=config, **extra)
    # the module is the writer, as in Megatron-LM: megatron-core's Timers.write logs
    # timers to wandb only when given the module (wandb.log goes to the run just started)
    return wandb


class _Profiler:
    """torch.profiler (and on GPU the CUDA profiler API) over Megatron-LM's steps."""

    def __init__(self, args):
        rank = torch.distributed.get_rank()
        # as Megatron-LM: an empty --profile-ranks means every rank
        self.enabled = args.profile and (not args.profile_ranks or rank in args.profile_ranks)
        self.start_after, self.end_at = args.profile_step_start, args.profile_step_end
        self.directory = args.tensorboard_dir or DEFAULT_PROFILE_DIR
        self.worker = f"rank{rank}"
        self.cuda_kernels = args.use_pytorch_profiler
        self.on_cuda = device.on_cuda(args)
        self.profile = None
        self.labelled = []  # the iterations in the running profile

    def before_step(self, completed):
        """Start when ``completed`` iterations are done and the next one is profiled."""
        if (not self.enabled or self.profile is not None
                or not self.start_after <= completed < self.end_at):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.on_cuda and self.cuda_kernels:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.directory, exist_ok=True)
        self.profile = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.directory,
                                                                    worker_name=self.worker))
        self.profile.start()
        if self.on_cuda:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def label(self, iteration):
        """Marks one iteration in the trace as ``iteration N``."""
        if self.profile is None:
            return contextlib.nullcontext()
        self.labelled.append(iteration)
        return torch.profiler.record_function(f"iteration {iteration}")

    def after_step(self, completed):
        if self.profile is not None and completed >= self.end_at:
            self.close()

    def close(self):
        if self.profile is None:
            return
        if self.on_cuda:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        self.profile.stop()  # writes the trace (on_trace_ready)
        steps = (f"iterations {self.labelled[0]}..{self.labelled[-1]}" if self.labelled
                 else "no iteration")
        print(f"  profile of {steps} written to {self.directory}/ ({self.worker})", flush=True)
        self.profile, self.labelled = None, []


class _ManualGC:
    """--manual-gc: Python's collector off, collections at the same iterations on all
    ranks (an automatic one on one rank stalls every rank waiting in a collective)."""

    def __init__(self, args):
        self.on = args.manual_gc
        self.interval = args.manual_gc_interval
        self.around_eval = args.manual_gc and args.manual_gc_eval
        self.was_enabled = gc.isenabled()

    def start(self):
        if self.on:
            gc.disable()
            gc.collect()

    def after_step(self, iteration):
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self):
        if self.around_eval:
            gc.collect()

    def after_eval(self):
        if self.around_eval:
            gc.collect(generation=0)  # what evaluation itself created

    def close(self):
        if self.on and self.was_enabled:
            gc.enable()


def _our_executor(forward_backward_func) -> bool:
    """Whether the schedule is our executor, which, unlike megatron-core's schedules,
    does not start the ``forward-backward`` and ``forward-compute`` timers itself."""
    return getattr(forward_backward_func, "func", None) is forward_backward_pipelining_seq1f1b


class Monitor:
    """Timers, writers, profiler, garbage collection and cache emptying of one ``train``."""

    def __init__(self, args, model, optimizer):
        self.args = args
        self.timers = Timers(args.timing_log_level, args.timing_log_option)
        self.config = get_model_config(model[0])
        self.config.timers = self.timers  # schedules, p2p and grad sync read it
        self.optimizer_config = getattr(optimizer, "config", None)
        if self.optimizer_config is not None:
            self.optimizer_config.timers = self.timers
        self.writers = Writers(args)
        self.profiler = _Profiler(args)
        self.gc = _ManualGC(args)
        self.on_cuda = device.on_cuda(args)
        names = LEVEL_1_TIMERS if args.timing_log_level >= 1 else ()
        self.timer_names = list(names + (LEVEL_2_TIMERS if args.timing_log_level >= 2 else ()))

    # --- the loop's hooks, in call order ------------------------------------------------

    def start(self):
        self.gc.start()

    def before_step(self, completed):
        self.profiler.before_step(completed)

    def step_label(self, iteration):
        return self.profiler.label(iteration)

    def after_step(self, iteration):
        self.profiler.after_step(iteration)
        self.gc.after_step(iteration)

    def close(self):
        self.profiler.close()
        self.gc.close()
        self.writers.close()
        # the model config outlives this loop (a library caller may train again)
        self.config.timers = None
        if self.optimizer_config is not None:
            self.optimizer_config.timers = None

    # --- inside train_step ----------------------------------------------------------------

    def timed_schedule(self, forward_backward_func, forward_step_func):
        """(schedule, forward_step) to call: for our executor, the schedule call is timed
        as ``forward-backward`` and every forward as ``forward-compute``, as
        megatron-core's schedules do themselves."""
        if not _our_executor(forward_backward_func):
            return forward_backward_func, forward_step_func

        @functools.wraps(forward_backward_func)
        def schedule(**kwargs):
            timer = self.timers("forward-backward", log_level=1)
            timer.start(barrier=self.config.barrier_with_L1_time)
            try:
                return forward_backward_func(**kwargs)
            finally:
                timer.stop()

        return schedule, self._timed_forward_step(forward_step_func)

    def _timed_forward_step(self, forward_step_func):
        timer = self.timers("forward-compute", log_level=2)

        def timed(func):
            @functools.wraps(func)
            def call(*args, **kwargs):
                timer.start()
                try:
                    return func(*args, **kwargs)
                finally:
                    timer.stop()
            return call

        @functools.wraps(forward_step_func)
        def forward_step(*args, **kwargs):
            output, loss_func = timed(forward_step_func)(*args, **kwargs)
            return output, timed(loss_func)  # the loss is forward compute too

        return forward_step

    @contextlib.contextmanager
    def optimizer_timer(self):
        timer = self.timers("optimizer", log_level=1)
        timer.start(barrier=self.config.barrier_with_L1_time)
        try:
            yield
        finally:
            timer.stop()

    def empty_unused_memory(self, level):
        """``torch.cuda.empty_cache()`` at ``--empty-unused-memory-level`` >= ``level``."""
        if self.on_cuda and self.args.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    # --- evaluation -----------------------------------------------------------------------

    @contextlib.contextmanager
    def evaluation(self):
        """Around ``evaluate``: garbage collection, and no timers (as Megatron-LM, an
        evaluation's p2p does not count into the training timers)."""
        self.gc.before_eval()
        self.config.timers = None
        try:
            yield
        finally:
            self.config.timers = self.timers
            self.gc.after_eval()

    def log_validation(self, loss, iteration, consumed_samples, suffix=""):
        """A validation set's loss; ``suffix``: the set's ('-NAME' with
        --multiple-validation-sets), in the keys as Megatron-LM puts it."""
        ppl = math.exp(min(20.0, loss))
        key = f"lm loss validation{suffix}"
        self.writers.add(key, loss, iteration)
        self.writers.add(f"{key} vs samples", loss, consumed_samples, to_wandb=False)
        if self.args.log_validation_ppl_to_tensorboard:
            self.writers.add(f"{key} ppl", ppl, iteration)
            self.writers.add(f"{key} ppl vs samples", ppl, consumed_samples, to_wandb=False)
        return ppl

    # --- logging --------------------------------------------------------------------------

    def log_iteration_scalars(self, iteration, loss, lr, grad_norm, loss_scale,
                              consumed_samples, num_zeros=None, params_norm=None):
        """This iteration's scalars, every --tensorboard-log-interval iterations; the
        CUDA memory report every --log-memory-interval."""
        interval = self.args.log_memory_interval
        if interval and self.on_cuda and iteration % interval == 0:
            report_memory(f"(after {iteration} iterations)")
        if iteration % self.args.tensorboard_log_interval != 0:
            return
        self.writers.add("learning-rate", lr, iteration)
        # this iteration's global batch (it grows under --rampup-batch-size)
        args = self.args
        batch = args.num_microbatches * args.micro_batch_size * args.data_parallel_size
        self.writers.add("batch-size", batch, iteration)
        self.writers.add("samples vs steps", consumed_samples, iteration)
        if getattr(args, "skipped_train_samples", 0):  # as Megatron-LM: once there are any
            self.writers.add("skipped-train-samples", args.skipped_train_samples, iteration)
        self.writers.add("lm loss", loss, iteration)
        if args.log_loss_scale_to_tensorboard:
            self.writers.add("loss-scale", loss_scale, iteration)
            self.writers.add("loss-scale vs samples", loss_scale, consumed_samples,
                             to_wandb=False)
        if args.log_world_size_to_tensorboard:
            world = torch.distributed.get_world_size()
            self.writers.add("world-size", world, iteration)
            self.writers.add("world-size vs samples", world, consumed_samples, to_wandb=False)
        self.writers.add("grad-norm", grad_norm, iteration)
        # Megatron-LM's names for --log-num-zeros-in-grad and --log-params-norm
        for name, value in (("num-zeros", num_zeros), ("params-norm", params_norm)):
            self.writers.add(name, value, iteration)
            self.writers.add(f"{name} vs samples", value, consumed_samples, to_wandb=False)
        if args.log_memory_to_tensorboard and self.on_cuda:
            stats = torch.cuda.memory_stats()
            for name, key in MEMORY_SCALARS:
                self.writers.add(name, stats.get(key, 0), iteration, to_wandb=False)

    def log_interval(self, iteration, iterations, elapsed_per_iteration, tflops,
                     tokens_per_s):
        """At each log interval, on every rank (the timers gather over all ranks): the
        interval's scalars and the timers, averaged over its ``iterations``."""
        self.writers.add("tokens-per-second", tokens_per_s, iteration)
        if self.args.log_timers_to_tensorboard:
            self.writers.add("iteration-time", elapsed_per_iteration, iteration)
            if self.args.log_throughput:
                self.writers.add("throughput", tflops, iteration)
        if not self.timer_names:
            return
        if self.args.log_timers_to_tensorboard:
            # collective: every rank writes (to None off the last rank) as often
            for writer in (self.writers.tensorboard, self.writers.wandb):
                self.timers.write(self.timer_names, writer, iteration,
                                  normalizer=iterations, reset=False)
        text = self.timers.get_all_timers_string(self.timer_names, normalizer=iterations,
                                                 reset=True)
        if text is not None and _is_last_rank():
            print(text, flush=True)
