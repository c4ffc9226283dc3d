"""--phase-transition-iterations, as Megatron-LM: training in phases, each with its own
data (say, a general blend, then an annealing or long-document one), each phase its own
launch.

At every listed iteration the run saves (with --save) and stops; the next launch resumes
from that checkpoint with the next phase's data flags. Its training data is read from
the start, in a dataset built for the phase's samples alone (megatron-core sizes and
shuffles a dataset by the samples asked of it), so a phase reads what a fresh run of
that length on that data would. Iterations, the learning-rate schedule and the consumed
samples count on across phases. The global batch size stays fixed: a phase's samples
are its iterations times the batch.
"""


def parse(text):
    """The transition iterations of the flag's comma-separated text, sorted, or raise
    ValueError."""
    return sorted({int(part.strip()) for part in text.split(",")})


def problems(args):
    """The flag's mistakes, each naming it (after the iteration counts are known)."""
    text = args.phase_transition_iterations
    args.phase_transitions = []
    if text is None:
        return []
    flag = f"--phase-transition-iterations {text}"
    try:
        transitions = parse(text)
    except ValueError:
        return [f"{flag}: give comma-separated iteration numbers (e.g. 1000,5000)"]
    found = []
    outside = [t for t in transitions if not 1 <= t < args.train_iters]
    if outside:
        found.append(f"{flag}: each transition must lie within the run, from 1 to "
                     f"--train-iters - 1 ({args.train_iters - 1}); got {outside}")
    for given, name in ((args.rampup_batch_size is not None, "--rampup-batch-size"),
                        (args.step_batch_schedule is not None, "--step-batch-size-schedule"),
                        (args.decrease_batch_size_if_needed, "--decrease-batch-size-if-needed")):
        if given:
            found.append(f"{flag} needs a fixed global batch size (each phase's samples are "
                         f"its iterations x the batch, as in Megatron-LM): drop {name}")
    if not found:
        args.phase_transitions = transitions
        if args.save is None:
            args.flag_notes.append(
                f"note: {flag} without --save: the run stops at iteration "
                f"{transitions[0]} and saves nothing to continue from (as in Megatron-LM)")
    return found


def phase_start(args, iteration):
    """The iteration the phase holding ``iteration + 1`` starts after (0: the first)."""
    return max([0] + [t for t in args.phase_transitions if t <= iteration])


def phase_end(args, start):
    """The last iteration of the phase starting after ``start``."""
    return min([args.train_iters] + [t for t in args.phase_transitions if t > start])


def train_samples_to_build(args):
    """The samples the training dataset is built for: the whole run's, or the phase's
    (from ``args.phase_start_iteration``, set before the datasets are built)."""
    if not getattr(args, "phase_transitions", None):
        return args.train_samples_total
    start = args.phase_start_iteration
    end_samples = min(args.train_samples_total,
                      phase_end(args, start) * args.global_batch_size)
    return end_samples - start * args.global_batch_size


def samples_into_phase(args, iteration, consumed_samples):
    """Where the training data iterator starts: the run's consumed samples, or those of
    the current phase."""
    if not getattr(args, "phase_transitions", None):
        return consumed_samples
    return (iteration - phase_start(args, iteration)) * args.global_batch_size


def describe(args):
    """Rank 0's start-up line for a phased run, or None."""
    if not getattr(args, "phase_transitions", None):
        return None
    start = args.phase_start_iteration
    bounds = [0] + args.phase_transitions + [args.train_iters]
    number = bounds.index(start) + 1
    return (f" phase {number} of {len(bounds) - 1} (--phase-transition-iterations "
            f"{','.join(map(str, args.phase_transitions))}): iterations {start + 1}-"
            f"{phase_end(args, start)}, its training data read from the start "
            f"({train_samples_to_build(args)} samples)")
