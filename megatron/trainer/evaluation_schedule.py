"""When the periodic evaluations run (--eval-interval, --start-eval-at-iter) and how many
have run by an iteration: the validation set is sized by that count, and a resumed run
reads on from the samples the evaluations before it consumed."""


def evaluates_at(args, iteration: int) -> bool:
    """Whether the training loop evaluates after ``iteration`` (Megatron-LM's rule)."""
    start = args.start_eval_at_iter
    return iteration % args.eval_interval == 0 and (start is None or iteration >= start)


def evaluations_through(args, iteration: int) -> int:
    """The periodic evaluations of iterations 1..``iteration``. (Megatron-LM counts the
    one at --start-eval-at-iter itself as skipped when a resumed run derives its
    consumed validation samples, so it would read that evaluation's samples again.)"""
    start = args.start_eval_at_iter
    skipped = (start - 1) // args.eval_interval if start else 0
    return max(0, iteration // args.eval_interval - skipped)
