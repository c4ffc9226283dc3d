"""The training loop: megatron-core model, DDP, optimizer and pipeline schedules.

``pretrain`` is what ``pretrain_gpt.py`` calls. It mirrors Megatron-LM's loop:
parse and validate flags, create process groups, build the model of this pipeline
stage, wrap it in megatron-core DDP, build the optimizer and learning-rate schedule,
load a checkpoint, then run ``forward_backward_func`` + ``optimizer.step()`` per
iteration with Megatron-style logging, evaluation and checkpointing.
"""

import contextlib
import functools
import math
import os
import time
from dataclasses import dataclass, field

import torch

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron.model_shape import ModelShape
from megatron.schedules.dispatch import get_forward_backward_func
from megatron.schedules.memory_probe import ActivationMemoryProbe, write_stage_report
from megatron.trainer import (
    async_save,
    checkpointing,
    data_checks,
    determinism,
    device,
    faults,
    initialize,
    monitoring,
    norms,
    optimizers,
    phases,
    rerun,
    tensor_dumps,
    upcycling,
    validation_sets,
)
from megatron.trainer.agreed_stop import AgreedStop
from megatron.trainer.arguments import parse_args_or_exit
from megatron.trainer.data import (
    GlobalBatchSizes,
    MicrobatchIterator,
    as_list,
    skip_microbatches,
)
from megatron.trainer.evaluation_schedule import evaluates_at, evaluations_through
from megatron.trainer.metrics import (
    format_iteration_line,
    memory_label,
    model_flops_per_iteration,
    stage_peaks_gb,
)
from megatron.trainer.model import transformer_config_from_args, vocab_size_of_model
from megatron.trainer.moe_metrics import MoELossLog
from megatron.trainer.mtp_metrics import MTPLossLog
from megatron.trainer.param_gather import ParamGatherHooks


def print_rank_0(message):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def print_last_rank(message):
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print(message, flush=True)


def ddp_config_of(args):
    """megatron-core DDP's config from Megatron-LM's flags."""
    return DistributedDataParallelConfig(
        # as Megatron-LM: fp32 gradient reduction with bf16/fp16 unless --grad-reduce-in-bf16
        grad_reduce_in_fp32=(args.accumulate_allreduce_grads_in_fp32
                             or ((args.bf16 or args.fp16) and not args.grad_reduce_in_bf16)),
        # Megatron-LM's meaning: bucket reductions start from the backward hooks of the
        # iteration's last backward unit (the schedules keep no_sync on before it), and
        # the distributed optimizer's all-gather waits for the next forward (param_gather)
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        # --ddp-average-in-collective: the reduction averages (ReduceOp.AVG) instead of
        # each rank dividing its gradients by the data-parallel size first
        average_in_collective=args.ddp_average_in_collective,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # --rerun-mode validate_results: each bucket's grad norm validated before the
        # data-parallel reduction (NaN/Inf, --check-for-large-grads), as Megatron-LM
        **rerun.ddp_checks(args),
    )


def build_model(args, config, model_provider):
    """This rank's model chunks (one, or one per virtual stage), each wrapped for mixed
    precision and megatron-core DDP."""
    num_chunks = args.virtual_pipeline_model_parallel_size or 1
    ddp_config = ddp_config_of(args)
    chunks = []
    for index in range(num_chunks):
        vp_stage = index if num_chunks > 1 else None
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                             vp_stage=vp_stage)
        kwargs = {"vp_stage": vp_stage} if num_chunks > 1 else {}
        model = model_provider(args, config, pre_process=pre_process,
                               post_process=post_process, **kwargs)
        if device.on_cuda(args):  # the flags decide (gloo on a GPU machine: a CPU run)
            model.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            model = Float16Module(config, model)
        # as Megatron-LM: only the first chunk's gradient buffer is bucketed
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                        disable_bucketing=index > 0)
        # every data-parallel rank starts from rank 0's weights (with
        # --data-parallel-random-init the ranks initialised others)
        model.broadcast_params()
        chunks.append(model)
    return chunks


def build_optimizer(args, model):
    """megatron-core's optimizer and learning-rate schedule from Megatron-LM's flags
    (schedule lengths in samples, as validate_args derived them)."""
    optimizer_config = OptimizerConfig(
        optimizer=args.optimizer,
        sgd_momentum=args.sgd_momentum,
        lr=args.lr,
        min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay,
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else
                                                       torch.float32),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model)
    if args.optimizer == "sgd":
        optimizers.give_sgd_momentum_buffers(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_steps,
        # megatron-core wants warm-up < decay even for a run with no steps (--train-iters 0)
        lr_decay_steps=max(args.lr_decay_steps, args.lr_warmup_steps + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=max(args.wd_incr_steps, 1),
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=args.lr_wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        # how a resumed run treats the checkpoint's schedule (checkpointing.check_schedule
        # refuses a differing one without either flag, before megatron-core's assert)
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
    return optimizer, scheduler


def reduce_losses(losses_reduced, per_microbatch=False):
    """Sum each key's (loss sum, token count) over microbatches and data-parallel ranks
    (and the context-parallel ranks, each of which holds a part of every sequence).
    ``per_microbatch`` (--sft's validation, as Megatron-LM): the mean over microbatches
    and data-parallel ranks of each microbatch's own token average (a microbatch's
    context-parallel parts summed first)."""
    out = {}
    if not losses_reduced:
        return out
    for key in losses_reduced[0]:
        values = torch.stack([x[key].view(-1).float() for x in losses_reduced])
        if per_microbatch:
            torch.distributed.all_reduce(values, group=parallel_state.get_context_parallel_group())
            averages = values[:, 0] / values[:, 1].clamp(min=1)
            values = torch.stack([averages.sum(), averages.new_tensor(float(len(averages)))])
            torch.distributed.all_reduce(values, group=parallel_state.get_data_parallel_group())
        else:
            values = values.sum(dim=0)
            torch.distributed.all_reduce(
                values, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        out[key] = (values[0] / values[1].clamp(min=1)).item()
    return out


def _eval_microbatches(args):
    """Microbatches of an evaluation step: --eval-global-batch-size's, else the training
    step's of this iteration (which --rampup-batch-size changes)."""
    return args.eval_num_microbatches or args.num_microbatches


def _run_schedule(args, forward_backward_func, forward_step_func, data_iterator, model,
                  forward_only, evaluation=False, force_all_reduce=False):
    """One call of the pipeline schedule over the iteration's microbatches (an
    evaluation step's: --eval-micro-batch-size, --eval-global-batch-size).
    ``force_all_reduce``: every data-parallel rank gets whole reduced gradients, also
    under the distributed optimizer (megatron-core's switch, for --save-wgrads-interval)."""
    extra = {"force_all_reduce": True} if force_all_reduce else {}
    return forward_backward_func(
        **extra,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=_eval_microbatches(args) if evaluation else args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.eval_micro_batch_size if evaluation else args.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(args, forward_step_func, data_iterator, model, optimizer, scheduler,
               forward_backward_func, guard, iteration, progress, monitor=None,
               before_pass=None):
    """One iteration. Returns (losses, grad norm, step applied, exit reason or None,
    number of zero gradient elements or None: --log-num-zeros-in-grad).
    ``monitor`` (a ``monitoring.Monitor``) times it and empties the CUDA cache.
    ``before_pass`` runs before every forward/backward pass: once, or again for each pass
    the rerun machine repeats (what a pass records must then count once).
    When --rerun-mode's machine ends the run, the exit reason is its ``rerun.Decision``
    (the step not taken) and the rest is None."""
    if rerun.enabled(args) or args.check_for_spiky_loss:  # Megatron-LM's loss_func checks
        forward_step_func = rerun.validating(args, forward_step_func)
    if monitor is not None:
        forward_backward_func, forward_step_func = monitor.timed_schedule(
            forward_backward_func, forward_step_func)
    # Megatron-LM's loop: the machine reruns the forward/backward passes in place when a
    # result was rejected (with --rerun-mode disabled it runs them once)
    rerun_machine = rerun.machine()
    injected = False
    save_wgrads = tensor_dumps.due(args.save_wgrads_interval, iteration)
    for chunk in model:  # as Megatron-LM: the overlapped reductions all-reduce too
        chunk.force_all_reduce = save_wgrads
    # --save-activations-interval / --save-dgrads-interval: hooks for this pass only
    activation_hooks = tensor_dumps.start_activation_hooks(args, model, iteration)
    while rerun_machine.should_run_forward_backward(data_iterator):
        pending = rerun.injection_pending()  # results are validated inside the pass
        if before_pass is not None:
            before_pass()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        progress.step = f"iteration {iteration}'s pipeline forward/backward (p2p and grad sync)"
        losses_reduced = _run_schedule(args, forward_backward_func, forward_step_func,
                                       data_iterator, model, forward_only=False,
                                       force_all_reduce=save_wgrads)
        injected |= pending is None and rerun.injection_pending() is not None
    if rerun.enabled(args):
        progress.step = f"iteration {iteration}'s rerun decision (all_gather over all ranks)"
        stop = rerun.decision(args, iteration, device.on_cuda(args), injected)
        if stop is not None:
            return None, None, False, stop, None
    for chunk in model:
        chunk.force_all_reduce = False
    if activation_hooks is not None:
        progress.step = f"iteration {iteration}'s activation / dgrad write"
        tensor_dumps.save_activation_hooks(args, activation_hooks, iteration)
    if save_wgrads:  # as Megatron-LM: after the reduction, before the step
        progress.step = f"iteration {iteration}'s --save-wgrads-interval write"
        tensor_dumps.save_named_tensors(args, model, "main_grad", iteration)
    # before the step: a non-finite loss or gradient never reaches the parameters
    progress.step = f"iteration {iteration}'s health check (all_gather over all ranks)"
    exit_reason = guard.check(iteration, losses_reduced, model)
    if monitor is not None:
        monitor.empty_unused_memory(level=1)
    progress.step = f"iteration {iteration}'s optimizer step (grad norm all-reduce)"
    with monitor.optimizer_timer() if monitor is not None else contextlib.nullcontext():
        update_successful, grad_norm, num_zeros = optimizer.step()
    if tensor_dumps.due(args.save_params_interval, iteration):  # after the step
        progress.step = f"iteration {iteration}'s --save-params-interval write"
        tensor_dumps.save_named_tensors(args, model, "data", iteration)
    if args.clip_grad == 0:
        grad_norm = None  # no clipping, no norm: megatron-core returns a 0.0 placeholder
    guard.check_grad_norm(iteration, grad_norm)
    if args.log_num_zeros_in_grad:
        num_zeros = norms.num_zeros_across_model_parallel(
            num_zeros, next(model[0].parameters()).device)
    else:
        num_zeros = None
    if update_successful:
        # the samples of this iteration (the global batch grows under --rampup-batch-size)
        scheduler.step(increment=args.num_microbatches * args.micro_batch_size
                       * args.data_parallel_size)
    if monitor is not None:
        monitor.empty_unused_memory(level=2)
    losses = reduce_losses(losses_reduced) if parallel_state.is_pipeline_last_stage() else {}
    return losses, grad_norm, update_successful, exit_reason, num_zeros


def evaluate(args, forward_step_func, data_set, model, forward_backward_func,
             monitor=None):
    """The losses of one set (``validation_sets``: what it reads and how many steps);
    ``monitor`` collects garbage around it (--manual-gc), keeps it out of the timers and
    empties the CUDA cache after each step."""
    for chunk in model:
        chunk.eval()
    totals = []
    batch = (_eval_microbatches(args) * args.eval_micro_batch_size
             * args.data_parallel_size)
    with torch.no_grad(), (monitor.evaluation() if monitor is not None
                           else contextlib.nullcontext()), \
            data_set.read(batch) as (data_iterator, steps):
        for _ in range(steps):
            totals += _run_schedule(args, forward_backward_func, forward_step_func,
                                    data_iterator, model, forward_only=True, evaluation=True)
            if monitor is not None:
                monitor.empty_unused_memory(level=1)
    for chunk in model:
        chunk.train()
    if not parallel_state.is_pipeline_last_stage():
        return {}
    return reduce_losses(totals, per_microbatch=args.sft)


@dataclass
class TrainingResult:
    """Per-iteration lm loss and grad norm, the validation losses every --eval-interval,
    and the end-of-training evaluations (losses only on the last pipeline stage); with
    --log-params-norm / --log-num-zeros-in-grad those per iteration (every rank)."""

    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    validation_losses: list = field(default_factory=list)
    learning_rates: list = field(default_factory=list)
    iteration: int = 0  # the last iteration trained (or loaded, with --skip-train)
    consumed_samples: int = 0
    exit_reason: str = None  # why the loop stopped before --train-iters, if it did
    final_validation_loss: float = None
    # every evaluation's {set suffix: loss} ('' for the one set, '-NAME' with
    # --multiple-validation-sets), and the final evaluation's
    validation_losses_by_set: list = field(default_factory=list)
    final_validation_losses: dict = field(default_factory=dict)
    test_loss: float = None
    params_norms: list = field(default_factory=list)
    num_zeros: list = field(default_factory=list)
    # MoE models: per iteration, Megatron-LM's logged aux losses (name -> value)
    moe_losses: list = field(default_factory=list)
    mtp_losses: list = field(default_factory=list)  # per iteration, 'mtp_k loss' -> value


def pretrain(datasets_provider, model_provider, forward_step_func, extra_args_provider=None,
             argv=None, on_finish=None):
    """Train a model with Megatron-LM's flags; returns a ``TrainingResult``.

    ``on_finish(args, model)``, if given, runs after training while the parallel
    state still exists (tests use it to gather parameters). The default process
    group is kept, so one process can train several configurations in turn.
    """
    args = parse_args_or_exit(argv, extra_args_provider)
    monitoring.set_logging_level(args)
    if args.deterministic_mode:
        determinism.apply(os.environ)
    start = time.time()
    initialize.initialize_distributed(args)
    guard = faults.IterationGuard(args, start)  # SIGTERM is recorded from here on
    progress = Progress()
    try:
        with faults.stops_cleanly(args, progress, guard):
            return _pretrain(args, start, guard, progress, datasets_provider, model_provider,
                             forward_step_func, on_finish)
    finally:  # also after a deliberate stop: the process may train another configuration
        async_save.abandon()  # saves still in flight after an error or a signal
        checkpointing.release_save_dir(args)
        guard.close()


def _pretrain(args, start, guard, progress, datasets_provider, model_provider,
              forward_step_func, on_finish):
    initialize.set_seeds(args.seed, args.data_parallel_random_init)
    rerun.initialize(args)  # before the load: a checkpoint may hold a rerun to resume
    # a phase's training data is built for the phase the resumed iteration is in
    args.phase_start_iteration = (phases.phase_start(args, checkpointing.resume_iteration(args))
                                  if args.phase_transitions else 0)
    # (train, valid, tokenizer), or (train, valid, test, tokenizer) with a test set
    datasets = datasets_provider(args)
    train_ds, valid_ds, tokenizer = datasets[0], datasets[1], datasets[-1]
    test_ds = datasets[2] if len(datasets) == 4 else None
    args.padded_vocab_size = vocab_size_of_model(args, tokenizer.vocab_size)
    data_checks.check_token_ids(args, tokenizer.vocab_size, args.padded_vocab_size)
    config = transformer_config_from_args(args)
    model = build_model(args, config, model_provider)
    optimizer, scheduler = build_optimizer(args, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ([chunk.no_sync for chunk in model] if len(model) > 1
                           else model[0].no_sync)
    if args.bf16 or args.fp16:
        config.grad_scale_func = optimizer.scale_loss

    if args.moe_use_upcycling:
        upcycling.refuse_a_second_conversion(args)
    if not args.skip_train:  # --skip-train saves nothing
        checkpointing.claim_save_dir(args)
    iteration, consumed_samples = 0, 0
    # Megatron-LM's count of samples read and not trained on (--iterations-to-skip) and
    # left out of batches (--decrease-batch-size-if-needed); a checkpoint carries it on
    args.skipped_train_samples = 0
    if args.moe_use_upcycling:  # the dense checkpoint in --load becomes this MoE model
        progress.step = "upcycling"
        iteration, consumed_samples = upcycling.upcycle(
            args, model, optimizer, scheduler, build_model, model_provider,
            transformer_config_from_args)
    elif args.load is not None or args.pretrained_checkpoint is not None:
        progress.step = "checkpoint load"
        iteration, consumed_samples = checkpointing.load_checkpoint(
            args, model, optimizer, scheduler)
    rerun.start_at(iteration)
    if phases.phase_start(args, iteration) != args.phase_start_iteration:
        raise AgreedStop(f"--phase-transition-iterations: the checkpoint loaded resumes after "
                         f"iteration {iteration}, not in the phase its training data was "
                         f"built for (after iteration {args.phase_start_iteration})", code=2)
    phase = phases.describe(args)
    if phase is not None:
        print_rank_0(phase)

    recorder = timeline_recorder(args)
    probe = ActivationMemoryProbe() if args.activation_memory_file else None
    for chunk in (model if probe is not None else []):
        probe.exclude_parameters(chunk)
    observers = [o for o in (recorder, probe) if o is not None]
    forward_backward_func = get_forward_backward_func(
        seq1f1b_splits=args.seq1f1b_splits,
        balance_method=args.seq1f1b_balance_method,
        alignment=args.seq1f1b_alignment,
        model_shape=ModelShape.from_args(args),
        observers=observers,
        pp_size=args.pipeline_model_parallel_size,
        vp_size=args.virtual_pipeline_model_parallel_size,
        schedule=args.pipeline_schedule,
        slimpipe_slices=args.slimpipe_slices,
        attention_balance=args.slimpipe_attention_balance,
        exchange_cost=args.slimpipe_attention_balance_exchange_cost,
    )
    step_func = functools.partial(forward_step_func, args=args)
    train_iterator = chunk_iterators(model, lambda: MicrobatchIterator(
        train_ds, args.micro_batch_size,
        phases.samples_into_phase(args, iteration, consumed_samples),
        num_microbatches=args.num_microbatches, num_workers=args.num_workers))
    # a resumed run evaluates on the validation samples the uninterrupted run would reach
    # (Megatron-LM's consumed_valid_samples, derived from the iteration)
    consumed_valid = (evaluations_through(args, iteration) * args.eval_iters
                      * args.eval_global_batch_size)
    def eval_iterators(dataset, consumed=0):
        return chunk_iterators(model, lambda: MicrobatchIterator(
            dataset, args.eval_micro_batch_size, consumed,
            num_microbatches=_eval_microbatches(args), num_workers=args.num_workers))

    valid_sets = _validation_sets(args, valid_ds, eval_iterators, consumed_valid)
    # as Megatron-LM: the test set is read from its start, once, after training
    test_set = (validation_sets.ContinuingSet(eval_iterators(test_ds), args.eval_iters)
                if test_ds is not None and args.eval_iters > 0 else None)
    print_rank_0(f"> setup done in {time.time() - start:.1f}s: tp={args.tensor_model_parallel_size}"
                 f" pp={args.pipeline_model_parallel_size} dp={args.data_parallel_size}"
                 f" microbatches={args.num_microbatches} seq1f1b-splits={args.seq1f1b_splits}"
                 + (f" slimpipe-slices={args.slimpipe_slices}"
                    f" vp={args.virtual_pipeline_model_parallel_size or 1}"
                    if args.pipeline_schedule == "slimpipe" else ""))

    if args.slimpipe_attention_balance:
        from megatron.schedules.attention_balance import SliceCosts, balanced_slimpipe, describe

        plan = balanced_slimpipe(
            args.pipeline_model_parallel_size, args.num_microbatches,
            args.virtual_pipeline_model_parallel_size or 1, args.slimpipe_slices,
            SliceCosts.from_model(ModelShape.from_args(args), args.slimpipe_slice_length,
                                  args.slimpipe_attention_balance_exchange_cost))
        print_rank_0(f"> {describe(plan)}")
    readers = train_iterator  # closed at the end; the loop may read through a wrapper
    if rerun.enabled(args):  # as Megatron-LM: a rerun replays the iteration's microbatches
        train_iterator = rerun.wrap(train_iterator)
    try:
        result = train(args, step_func, train_iterator, valid_sets, model, optimizer,
                       scheduler, forward_backward_func, iteration, consumed_samples, guard,
                       progress, observers, test_set)
    finally:  # --num-workers: end the reader processes whichever way training ends
        for iterator in as_list(readers):
            iterator.close()
        for data_set in valid_sets + ([test_set] if test_set is not None else []):
            data_set.close()
    if recorder is not None:
        write_timeline(args, recorder)
    # the last context-parallel rank's peaks: its parts' queries see the most keys
    # (context_parallel.py), so its stage peak is the stage's (the planner's too)
    if (probe is not None
            and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank()
            == parallel_state.get_context_parallel_world_size() - 1
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        write_stage_report(args.activation_memory_file, probe,
                           parallel_state.get_pipeline_model_parallel_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
    if on_finish is not None:
        on_finish(args, model)
    initialize.destroy_model_parallel()
    return result


def _validation_sets(args, valid_ds, eval_iterators, consumed_valid):
    """What each evaluation reads: --eval-iters steps of the validation set, read on, or
    with --full-validation every set whole (validation_sets.py)."""
    if valid_ds is None:
        return []
    if not args.full_validation:
        return ([validation_sets.ContinuingSet(eval_iterators(valid_ds, consumed_valid),
                                               args.eval_iters)]
                if args.eval_iters > 0 else [])
    datasets = valid_ds if isinstance(valid_ds, list) else [valid_ds]
    sets = [validation_sets.WholeSet(suffix, dataset, eval_iterators)
            for suffix, dataset in zip(validation_sets.suffixes(args, len(datasets)),
                                       datasets)]
    for data_set in sets:
        print_rank_0(f"> full validation{data_set.suffix}: {len(data_set.dataset)} sequences "
                     f"per evaluation")
    return sets


def chunk_iterators(model, make_iterator):
    """One data iterator, or one per model chunk as megatron-core's interleaved schedule
    wants (each chunk reads the microbatches it needs from its own copy)."""
    return make_iterator() if len(model) == 1 else [make_iterator() for _ in model]


def timeline_recorder(args):
    """With --timeline-file, an observer that times every pipeline unit of this rank."""
    if not args.timeline_file:
        return None
    from megatron.schedules.timeline import TimelineRecorder

    sync = torch.cuda.synchronize if device.on_cuda(args) else None
    return TimelineRecorder(rank=parallel_state.get_pipeline_model_parallel_rank(), sync=sync)


def write_timeline(args, recorder):
    """The last iteration's units of every pipeline rank (tp/dp rank 0) to --timeline-file."""
    if (parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0
            or parallel_state.get_tensor_model_parallel_rank() != 0):
        return
    slimpipe = args.pipeline_schedule == "slimpipe"
    meta = {"schedule": ("slimpipe" if slimpipe
                         else "seq1f1b" if args.seq1f1b_splits > 1 else "1f1b"),
            "splits": args.slimpipe_slices if slimpipe else args.seq1f1b_splits,
            "microbatches": args.num_microbatches,
            "pp": args.pipeline_model_parallel_size,
            "vp": args.virtual_pipeline_model_parallel_size or 1, "seq_length": args.seq_length,
            # layers of each pipeline rank: unequal with --decoder-first/last-pipeline-num-layers
            "stage_layers": list(args.stage_layer_counts)}
    timeline = recorder.gather_and_write(
        args.timeline_file, group=parallel_state.get_pipeline_model_parallel_group(), meta=meta)
    if timeline is not None:
        print(f"  timeline of the last iteration written to {args.timeline_file}", flush=True)


_EXIT_REASONS = {
    "interval": "--exit-interval reached",
    "sigterm": "{signal} received (--exit-signal-handler)",
    "duration": "--exit-duration-in-mins reached",
    "phase": ("the phase ends (--phase-transition-iterations): relaunch from its checkpoint "
              "with the next phase's data flags"),
}


class Progress:
    """What the loop is doing now, so that a timed-out collective can say where it was."""

    step = "setup"


def train(args, step_func, train_iterator, valid_sets, model, optimizer, scheduler,
          forward_backward_func, iteration, consumed_samples, guard, progress,
          observers=(), test_set=None):
    """Train (unless --skip-train), then evaluate on the validation and test sets as
    Megatron-LM does after its training loop."""
    monitor = monitoring.Monitor(args, model, optimizer)
    try:
        monitor.start()
        if args.skip_train:
            print_rank_0("skipping training (--skip-train is on) ...")
            history = TrainingResult(iteration=iteration, consumed_samples=consumed_samples)
        else:
            history = _train_loop(args, step_func, train_iterator, valid_sets, model,
                                  optimizer, scheduler, forward_backward_func, iteration,
                                  consumed_samples, guard, progress, observers, monitor)
        if history.exit_reason is None:  # as Megatron-LM: an early exit evaluates nothing
            final_evaluation(args, step_func, valid_sets, test_set, model,
                             forward_backward_func, history, monitor, progress)
        return history
    finally:  # also after a deliberate stop: gc back on, profile and writers flushed
        monitor.close()


def final_evaluation(args, step_func, valid_sets, test_set, model,
                     forward_backward_func, history, monitor, progress):
    """The validation sets (--eval-iters batches where the periodic evaluations left
    off, or whole) and --eval-iters batches of the test set (from its start), each
    printed in Megatron-LM's box."""
    iteration = history.iteration
    for name, data_set in ([("validation", s) for s in valid_sets]
                           + ([("test", test_set)] if test_set is not None else [])):
        progress.step = (f"evaluation on the {name}{data_set.suffix} set after iteration "
                         f"{iteration}")
        loss = evaluate(args, step_func, data_set, model, forward_backward_func,
                        monitor).get("lm loss")
        if loss is None:  # not the last pipeline stage
            continue
        ppl = math.exp(min(20.0, loss))
        if name == "validation":
            history.final_validation_losses[data_set.suffix] = loss
            if not data_set.suffix:
                history.final_validation_loss = loss
            if not args.skip_train:  # as Megatron-LM: --skip-train writes no TensorBoard
                monitor.log_validation(loss, iteration, history.consumed_samples,
                                       data_set.suffix)
        else:
            history.test_loss = loss
        line = (f" validation{data_set.suffix} loss at iteration {iteration} on {name} set | "
                f"lm loss value: {loss:.6g} | lm loss PPL: {ppl:.6g} |")
        print_last_rank("-" * (len(line) + 1) + "\n" + line + "\n" + "-" * (len(line) + 1))


def _stop_for_rerun(args, decision, iteration, consumed_samples, model, optimizer, scheduler,
                    train_iterator, progress, param_gather):
    """What Megatron-LM does when the rerun machine ends the run: save if it asks (the
    state before the rejected iteration, with the rerun to resume), wait for the
    saves, then raise the stop (faults.stops_cleanly prints it and exits with its code)."""
    if decision.checkpoint and args.save:
        progress.step = f"checkpoint save at iteration {iteration} for the rerun"
        param_gather.sync()  # the parameters of the last step taken
        checkpointing.save_checkpoint(args, iteration, consumed_samples, model, optimizer,
                                      scheduler, data_iterator=train_iterator)
    if args.async_save:
        progress.step = "waiting for the asynchronous checkpoint saves"
        async_save.maybe_finalize(args, blocking=True)
    raise rerun.RerunStop(decision.code, decision.message)


def _train_loop(args, step_func, train_iterator, valid_sets, model, optimizer, scheduler,
                forward_backward_func, iteration, consumed_samples, guard, progress,
                observers, monitor):
    # per sample: under --rampup-batch-size the global batch changes between iterations
    flops_per_sample = model_flops_per_iteration(args) / args.global_batch_size
    window_samples = 0
    world = torch.distributed.get_world_size()
    history = TrainingResult()
    window_start, window_iters, window_loss, window_count = time.time(), 0, 0.0, 0
    skipped = 0
    run_start, run_start_iteration, run_start_samples = time.time(), iteration, consumed_samples
    outside = 0.0  # seconds of evaluation and checkpointing: not training throughput
    for chunk in model:
        chunk.train()
    param_gather = ParamGatherHooks(model)  # --overlap-param-gather: on after a good step
    moe_losses = MoELossLog(args, next(model[0].parameters()).device)
    mtp_losses = MTPLossLog(args)
    batch_sizes = GlobalBatchSizes(args)

    def before_pass():
        # the files and logs describe the iteration's last pass: a pass the rerun machine
        # repeats must not leave its units, memory samples or MoE losses counted twice
        for observer in observers:
            observer.reset()
        moe_losses.clear()
        mtp_losses.clear()

    while iteration < args.train_iters:
        if args.async_save:  # as Megatron-LM: publish the background saves that are done
            progress.step = f"asynchronous checkpoint finalization before iteration {iteration + 1}"
            async_save.maybe_finalize(args)
        given_batch = batch_sizes.batch_at(consumed_samples)
        args.num_microbatches = given_batch // batch_sizes.unit
        if iteration + 1 in args.iterations_to_skip:
            # as Megatron-LM: the iteration's batch is read and dropped, nothing trains,
            # the learning-rate schedule does not advance; nor is it evaluated or saved
            progress.step = f"skipping iteration {iteration + 1}"
            skip_microbatches(args, train_iterator, model, args.num_microbatches)
            iteration += 1
            batch = args.num_microbatches * args.micro_batch_size * args.data_parallel_size
            consumed_samples += batch
            args.skipped_train_samples += batch  # as Megatron-LM
            print_rank_0(f" iteration {iteration:8d}/{args.train_iters:8d} skipped "
                         f"(--iterations-to-skip): its {batch} samples were read, not trained "
                         f"on")
            continue
        monitor.before_step(iteration)
        with monitor.step_label(iteration + 1):
            losses, grad_norm, ok, exit_reason, num_zeros = train_step(
                args, step_func, train_iterator, model, optimizer, scheduler,
                forward_backward_func, guard, iteration + 1, progress, monitor,
                before_pass=before_pass)
        if isinstance(exit_reason, rerun.Decision):
            _stop_for_rerun(args, exit_reason, iteration, consumed_samples, model, optimizer,
                            scheduler, train_iterator, progress, param_gather)
        iteration += 1
        batch = args.num_microbatches * args.micro_batch_size * args.data_parallel_size
        consumed_samples += batch
        args.skipped_train_samples += given_batch - batch  # --decrease-batch-size-if-needed
        window_samples += batch
        skipped += 0 if ok else 1
        if ok:
            param_gather.step_succeeded()
        loss = losses.get("lm loss")
        history.grad_norms.append(grad_norm)
        # as Megatron-LM: after the step, every iteration (a collective over the model)
        params_norm = norms.params_l2_norm(model, args.bf16) if args.log_params_norm else None
        if args.log_params_norm:
            history.params_norms.append(params_norm)
        if args.log_num_zeros_in_grad:
            history.num_zeros.append(num_zeros)
        if loss is not None:
            history.losses.append(loss)
            window_loss += loss
            window_count += 1
        window_iters += 1
        lr = scheduler.get_lr(optimizer.param_groups[0])
        history.learning_rates.append(lr)
        monitor.log_iteration_scalars(iteration, loss, lr, grad_norm,
                                      optimizer.get_loss_scale().item(), consumed_samples,
                                      num_zeros=num_zeros, params_norm=params_norm)
        # collective on every rank, as Megatron-LM's MoE report (empty for a dense model)
        history.moe_losses.append(moe_losses.report(args.num_microbatches, monitor.writers,
                                                    iteration))
        history.mtp_losses.append(mtp_losses.report(args.num_microbatches, monitor.writers,
                                                    iteration))
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed = (time.time() - window_start) / window_iters
            peaks = stage_peaks_gb(observers)
            samples_per_iteration = window_samples / window_iters
            tokens_per_second = samples_per_iteration * args.seq_length / elapsed
            tflops = flops_per_sample * samples_per_iteration / elapsed / world / 1e12
            # the interval's, as lm loss
            moe_means = {**moe_losses.interval_means(), **mtp_losses.interval_means()}
            if parallel_state.is_pipeline_last_stage():
                mean_loss = window_loss / max(window_count, 1)
                print_last_rank(format_iteration_line(
                    iteration, args.train_iters, consumed_samples, elapsed * 1000, lr,
                    batch, mean_loss, grad_norm,
                    tokens_per_second, tflops if args.log_throughput else None,
                    peaks, memory_label(observers), num_zeros=num_zeros,
                    params_norm=params_norm, moe_losses=moe_means,
                    skipped_samples=args.skipped_train_samples))
            monitor.log_interval(iteration, window_iters, elapsed, tflops,
                                 tokens_per_second)  # collective (timers)
            window_start, window_iters, window_loss, window_count = time.time(), 0, 0.0, 0
            window_samples = 0
        paused = time.time()  # as Megatron-LM's interval timer, skip eval and saving
        if valid_sets and evaluates_at(args, iteration):
            progress.step = f"evaluation at iteration {iteration}"
            param_gather.pause()  # evaluation reads whole parameters
            losses = {}
            for data_set in valid_sets:
                valid = evaluate(args, step_func, data_set, model, forward_backward_func,
                                 monitor)
                if "lm loss" not in valid:  # not the last pipeline stage
                    continue
                loss = losses[data_set.suffix] = valid["lm loss"]
                ppl = monitor.log_validation(loss, iteration, consumed_samples,
                                             data_set.suffix)
                print_last_rank(f" validation{data_set.suffix} loss at iteration {iteration} "
                                f"| lm loss value: {loss:.6g} | lm loss PPL: {ppl:.6g} |")
            param_gather.resume()
            moe_losses.clear()  # as Megatron-LM, after an evaluation
            mtp_losses.clear()
            if losses:
                history.validation_losses_by_set.append(losses)
                if "" in losses:
                    history.validation_losses.append(losses[""])
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            progress.step = f"checkpoint save at iteration {iteration}"
            param_gather.sync()  # the saved parameters are those of the last step
            checkpointing.save_checkpoint(args, iteration, consumed_samples, model, optimizer,
                                          scheduler, data_iterator=train_iterator)
        spent = time.time() - paused
        window_start += spent
        outside += spent
        monitor.after_step(iteration)  # profile end, manual gc
        if args.exit_interval and iteration % args.exit_interval == 0:
            exit_reason = "interval"
        if iteration in args.phase_transitions and exit_reason in (None, "interval"):
            exit_reason = "phase"  # a signal's or the time limit's reason says more
        if exit_reason is not None:
            print_rank_0(f" exiting at iteration {iteration}: "
                         f"{_EXIT_REASONS[exit_reason].format(signal=args.exit_signal)}")
            history.exit_reason = exit_reason
            break
    param_gather.stop()  # the last step's parameters, whole, for the save and the caller
    history.iteration, history.consumed_samples = iteration, consumed_samples
    paused = time.time()
    if args.save and (args.train_iters == 0 or iteration % args.save_interval != 0):
        progress.step = f"checkpoint save at iteration {iteration}"
        checkpointing.save_checkpoint(args, iteration, consumed_samples, model, optimizer,
                                      scheduler)
    if args.async_save:  # the run ends once every checkpoint it wrote is published
        progress.step = "waiting for the asynchronous checkpoint saves"
        async_save.maybe_finalize(args, blocking=True)
    outside += time.time() - paused
    total = time.time() - run_start
    training_time = max(total - outside, 1e-9)
    done = iteration - run_start_iteration
    peaks = stage_peaks_gb(observers)
    if parallel_state.is_pipeline_last_stage():
        final = f"{history.losses[-1]:.6g}" if history.losses else "n/a"
        per_iter = f"{training_time / done * 1000:.1f}" if done else "n/a"
        print_last_rank(
            f"[summary] iterations: {done} (skipped {skipped}) | time: {total:.1f}s | "
            f"ms/iteration: {per_iter} | final lm loss: {final} | "
            f"tokens/s: {(consumed_samples - run_start_samples) * args.seq_length / training_time:.1f} | "
            f"{memory_label(observers)}: {' '.join(f'{p:.3f}' for p in peaks)}")
    return history
