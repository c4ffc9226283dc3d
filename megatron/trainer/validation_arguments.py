"""Megatron-LM's --full-validation, --multiple-validation-sets and --validation-set-names:
the flags and their checks (the sets themselves: validation_sets.py)."""

from megatron.dataprep.gpt_datasets import DataPathError, blend_of


def add_validation_arguments(group):
    group.add_argument(
        "--full-validation", action="store_true",
        help="as Megatron-LM: every evaluation reads the whole validation set, each sequence "
             "once (the last step's missing samples are padding that carries no loss), "
             "instead of --eval-iters batches; the test set stays --eval-iters batches")
    group.add_argument(
        "--multiple-validation-sets", action="store_true",
        help="as Megatron-LM, with --full-validation: each prefix of --valid-data-path is a "
             "validation set of its own, evaluated and logged apart ('validation-NAME "
             "loss', TensorBoard 'lm loss validation-NAME')")
    group.add_argument(
        "--validation-set-names", nargs="+", default=None, metavar="NAME",
        help="the names of --multiple-validation-sets' sets in --valid-data-path's order "
             "(default 0, 1, ...)")


def validates(args) -> bool:
    """Whether the run reads a validation set (Megatron-LM: --eval-iters > 0, or
    --full-validation, which reads it whole whatever --eval-iters says)."""
    return args.eval_iters > 0 or args.full_validation


def validation_blend(args):
    """The list the validation data comes from: --valid-data-path's, else --data-path's
    (None where neither is known without reading a file)."""
    if args.data_path_per_split is not None:
        return args.data_path_per_split[1]
    return args.data_path


def validation_set_count(args) -> int:
    """How many validation sets: one per --valid-data-path prefix with
    --multiple-validation-sets (megatron-core's builder splits only a per-split blend of
    several prefixes), else one."""
    if not args.multiple_validation_sets or args.data_path_per_split is None:
        return 1
    blend = validation_blend(args)
    return len(blend_of(blend, "--valid-data-path")[0]) if blend else 1


def check_validation_args(args):
    """Problems of these flags (each a line naming the flag)."""
    problems = []
    if args.multiple_validation_sets and not args.full_validation:
        problems.append("--multiple-validation-sets needs --full-validation (as in "
                        "Megatron-LM, which raises NotImplementedError without it)")
    if args.validation_set_names and not args.multiple_validation_sets:
        problems.append("--validation-set-names needs --multiple-validation-sets (as "
                        "Megatron-LM asserts)")
    if not args.full_validation:
        return problems
    if args.mock_data:
        problems.append("--full-validation reads the whole validation set, and --mock-data's "
                        "is megatron-core's mock corpus (over a million sequences): give "
                        "--valid-data-path or --data-path")
        return problems
    blend = validation_blend(args)
    flag = "--valid-data-path" if args.data_path_per_split is not None else "--data-path"
    try:
        weights = blend_of(blend, flag)[1] if blend else None
    except DataPathError:
        return problems  # the data checks name it
    if weights is not None:
        problems.append(f"--full-validation reads each validation prefix whole, which a "
                        f"weighted blend ({flag} {' '.join(map(str, blend))}) cannot be "
                        f"(megatron-core asserts 'size_is_none => weights_are_none'): give "
                        f"--valid-data-path with the prefixes only, and the weighted blend "
                        f"as --train-data-path")
    names = args.validation_set_names
    if names and args.multiple_validation_sets:
        count = validation_set_count(args)
        if len(names) != count:
            problems.append(f"--validation-set-names gives {len(names)} names for {count} "
                            f"validation set(s) (one per --valid-data-path prefix)")
    return problems
