"""A resumed run's learning-rate schedule against its checkpoint's, as Megatron-LM decides.

megatron-core's OptimizerParamScheduler.load_state_dict compares the checkpoint's
schedule values with the command line's: with --override-opt_param-scheduler the command
line's win, with --use-checkpoint-opt_param-scheduler the checkpoint's, and with neither
they must agree (Megatron-LM's default: its assert stops the run). The assert names
neither the flag nor the way out, so the comparison is made here first, with a one-line
refusal that names both; each flag's choice is printed as a note.
"""

# state_dict key -> what it is and the flags that set it (lengths count samples)
SCHEDULE_VALUES = (
    ("max_lr", "learning rate (--lr)"),
    ("min_lr", "minimum learning rate (--min-lr)"),
    ("lr_warmup_steps", "warm-up samples (--lr-warmup-iters/-samples/-fraction)"),
    ("lr_decay_steps", "decay samples (--lr-decay-iters/-samples, else --train-iters/-samples)"),
    ("lr_decay_style", "decay style (--lr-decay-style)"),
    ("start_wd", "start weight decay (--start-weight-decay or --weight-decay)"),
    ("end_wd", "end weight decay (--end-weight-decay or --weight-decay)"),
    ("wd_incr_steps", "weight-decay schedule samples (--train-iters/-samples)"),
    ("wd_incr_style", "weight-decay style (--weight-decay-incr-style)"),
)

# megatron-core also reads these older spellings of a few keys
_OLD_KEYS = {"max_lr": ("start_lr",), "lr_warmup_steps": ("warmup_iter", "warmup_steps"),
             "lr_decay_steps": ("end_iter", "decay_steps"), "lr_decay_style": ("decay_style",)}


def _saved(saved, key):
    for name in _OLD_KEYS.get(key, ()) + (key,):
        if name in saved:
            return saved[name]
    return None


def schedule_differences(scheduler, saved):
    """[(what, saved value, this run's value)] where the checkpoint's schedule ``saved``
    (a state_dict) differs from ``scheduler``'s; keys the checkpoint lacks are skipped,
    as megatron-core skips them."""
    found = []
    for key, what in SCHEDULE_VALUES:
        old, new = _saved(saved, key), getattr(scheduler, key)
        if old is not None and old != new:
            found.append((what, old, new))
    return found


def schedule_decision(args, path, scheduler, saved):
    """(refusal or None, note or None) for loading the schedule ``saved`` from ``path``."""
    differences = schedule_differences(scheduler, saved)
    if not differences:
        return None, None
    listed = "; ".join(f"{what} saved {old!r}, now {new!r}" for what, old, new in differences)
    if args.override_opt_param_scheduler:
        return None, (f"  learning-rate schedule of this command line replaces the "
                      f"checkpoint's (--override-opt_param-scheduler): {listed}")
    if args.use_checkpoint_opt_param_scheduler:
        return None, (f"  learning-rate schedule kept from the checkpoint "
                      f"(--use-checkpoint-opt_param-scheduler): {listed}")
    return (f"--load {path}: this run's learning-rate schedule differs from the "
            f"checkpoint's ({listed}): pass --override-opt_param-scheduler to train with this "
            f"command line's schedule, or --use-checkpoint-opt_param-scheduler to keep the "
            f"checkpoint's (as Megatron-LM)"), None
