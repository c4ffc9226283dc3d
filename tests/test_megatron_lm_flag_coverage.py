"""Every flag of Megatron-LM's pretrain_gpt.py parser, and of the original Seq1F1B fork's,
is answered: implemented, accepted without effect (with its reason in the start-up note
and --help) or refused with a reason; never "unknown flag". Megatron-LM's flags are read
from its own parser at test time (megatron-core >= 0.17 ships megatron/training), so a
release that adds flags fails here naming them.

Measure the counts (docs/megatron_lm.md) with
``python tests/test_megatron_lm_flag_coverage.py`` in a venv with megatron-core 0.19.2."""

import argparse
import collections
import functools
import typing

import pytest

from megatron.trainer.arguments import ArgumentErrors, build_parser, parse_args
from megatron.trainer.megatron_lm_flags import DEFAULT_VALUES_ACCEPTED, NO_OP_FLAGS

GOOD = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--train-iters", "2", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "4"]

# The original Seq1F1B fork's megatron/arguments.py (thunlp/Seq1F1B, frozen): its flags
# that Megatron-LM 0.19 no longer has -> how many values each takes
SEQ1F1B_FORK_FLAGS = {
    "--DDP-impl": 1, "--data-impl": 1, "--embedding-weights-in-fp32": 0,
    "--layernorm-epsilon": 1, "--local_rank": 1, "--log-batch-size-to-tensorboard": 0,
    "--mmap-warmup": 0, "--no-async-tensor-model-parallel-allreduce": 0,
    "--no-contiguous-buffers-in-local-ddp": 0, "--no-log-learnig-rate-to-tensorboard": 0,
    "--no-query-key-layer-scaling": 0, "--no-scatter-gather-tensors-in-pipeline": 0,
    "--overlap-p2p-communication": 0, "--pipe-sp-splits": 1, "--pipe-sp-strategy": 1,
    "--pipeline-model-parallel-split-rank": 1, "--retriever-seq-length": 1,
    "--retro-add-retriever": 0, "--retro-cyclic-train-iters": 1,
    "--retro-encoder-attention-dropout": 1, "--retro-encoder-hidden-dropout": 1,
    "--retro-encoder-layers": 1, "--retro-num-neighbors": 1,
    "--retro-num-retrieved-chunks": 1, "--retro-return-doc-ids": 0, "--retro-workdir": 1,
    "--standalone-embedding-stage": 0,
}
OUR_FLAGS = {flag for action in build_parser()._actions for flag in action.option_strings
             if not action.dest.startswith("noop")}


def parse(*flags, world_size=1):
    return parse_args(GOOD + list(flags), world_size=world_size, cuda_available=False)


@functools.lru_cache(maxsize=None)
def megatron_lm_actions():
    """{option string: argparse action} of Megatron-LM's own pretrain_gpt.py parser."""
    if not hasattr(typing, "override"):  # megatron/training uses it; Python 3.12+
        typing.override = lambda function: function
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NO_VCS_VERSION", "1")  # else its package_info starts git on import
            from megatron.training.arguments import add_megatron_arguments
    except ImportError as error:
        pytest.skip(f"this megatron-core has no megatron/training (0.16.1 ships none; CI's "
                    f"0.19.2 pass checks it): {error}")
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {flag: action for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def values_for(action):
    """A valid value list for the action: its default where it is a plain value, else its
    first choice, else one of its type. A refused flag that accepts its default is
    classified by another value (what it answers to every value but the default)."""
    if action.nargs == 0:
        return []
    flag = action.option_strings[0]
    if flag in DEFAULT_VALUES_ACCEPTED:
        accepted = DEFAULT_VALUES_ACCEPTED[flag][0]
        other = [str(choice) for choice in action.choices or () if str(choice) not in accepted]
        return [other[0] if other else str(int(float(accepted[0])) + 2)]
    default = action.default
    if isinstance(default, (list, tuple)) and default:
        default = default[0]
    if isinstance(default, (str, int, float)) and not isinstance(default, bool):
        value = str(default)
    elif action.choices:
        value = str(list(action.choices)[0])
    else:
        value = {int: "1", float: "0.5"}.get(action.type, "1")
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def outcome(flag, values):
    """'implemented', 'no-op', 'refused', 'unknown', or 'broken: ...' for a command line of
    good flags plus this one."""
    try:
        args = parse_args(GOOD + [flag, *values], world_size=1, cuda_available=False,
                          check_files=False)
    except ArgumentErrors as error:
        problems = error.problems
        if any(p.startswith(f"unknown flag {flag}") for p in problems):
            return "unknown"
        if flag in OUR_FLAGS:  # implemented: a check refused this value (or this layout)
            return "implemented"
        if any(p.startswith(f"{flag} ") and " is refused: " in p for p in problems):
            return "refused"
        return "broken: " + "; ".join(problems)
    noted = {given for given, _ in args.no_op_flags}
    if noted - {flag}:
        return f"broken: the start-up note names {sorted(noted - {flag})} too"
    return "no-op" if flag in noted else "implemented"


def _takes(nargs):
    return {0: "none", None: "one", 1: "one", "?": "optional"}.get(nargs, "several")


def classify(actions):
    """{outcome: [flags]} of every Megatron-LM flag."""
    found = collections.defaultdict(list)
    for flag, action in sorted(actions.items()):
        found[outcome(flag, values_for(action)).split(":")[0]].append(flag)
    return found


def test_every_megatron_lm_flag_is_answered():
    found = classify(megatron_lm_actions())
    assert not found["unknown"], (f"{len(found['unknown'])} Megatron-LM flags are unknown "
                                  f"here; implement, no-op or refuse each: {found['unknown']}")
    assert not found["broken"], f"flags that broke another check: {found['broken']}"


def test_flags_take_as_many_values_as_in_megatron_lm():
    """A command line parses the same way: each flag we define (or accept as a no-op)
    consumes the values Megatron-LM's consumes (refused flags take all their values)."""
    ours = {flag: action for action in build_parser()._actions
            for flag in action.option_strings}
    differ = [f"{flag}: Megatron-LM {action.nargs!r}, here {ours[flag].nargs!r}"
              for flag, action in sorted(megatron_lm_actions().items())
              if flag in ours and _takes(action.nargs) != _takes(ours[flag].nargs)]
    assert not differ, differ


def test_no_op_reasons_are_in_help():
    help_text = " ".join(build_parser().format_help().split())
    missing = [flag for flag, (_, reason) in NO_OP_FLAGS.items()
               if " ".join(reason.split()) not in help_text]
    assert not missing, missing


def test_refused_flags_accept_the_value_this_trainer_follows():
    """Launch scripts spell defaults out (`--cuda-graph-impl none`): a refused flag given
    Megatron-LM's default is accepted with a note; every other value stays refused, the
    reason naming what is accepted."""
    actions = megatron_lm_actions()
    for flag, (accepted, note) in DEFAULT_VALUES_ACCEPTED.items():
        for spelling in ([flag, accepted[0]], [f"{flag}={accepted[0]}"]):
            assert (flag, note) in parse(*spelling).no_op_flags
        if flag not in actions:  # an older Megatron-LM (0.17) without the flag
            continue
        if actions[flag].choices:  # one of Megatron-LM's (its default, or mcore's async)
            assert set(accepted) <= {str(choice) for choice in actions[flag].choices}, flag
        else:  # else its default
            assert [float(actions[flag].default)] == [float(value) for value in accepted], flag
        assert outcome(flag, values_for(actions[flag])) == "refused", flag
    # Megatron-LM's own flags all (0.17 lacks one)
    assert DEFAULT_VALUES_ACCEPTED.keys() - actions.keys() <= {"--mlp-chunks-for-training"}
    with pytest.raises(ArgumentErrors) as error:
        parse("--cuda-graph-impl", "local", "--num-distributed-optimizer-instances", "2")
    assert any(p.startswith("--cuda-graph-impl is refused: ") and
               p.endswith("(accepted: --cuda-graph-impl none)")
               for p in error.value.problems), error.value.problems
    assert any(p.startswith("--num-distributed-optimizer-instances is refused: megatron-core's "
                            "partial distributed optimizer") for p in error.value.problems)


def test_seq1f1b_fork_flags_are_answered():
    values = {"--pipe-sp-strategy": ["average"], "--data-impl": ["mmap"],
              "--DDP-impl": ["local"]}
    answered = {flag: outcome(flag, values.get(flag, ["1"] * takes))
                for flag, takes in SEQ1F1B_FORK_FLAGS.items()}
    wrong = {flag: result for flag, result in answered.items()
             if result not in ("implemented", "no-op", "refused")}
    assert not wrong, wrong


def test_did_you_mean_proposes_only_near_misses():
    def problems(*flags):
        with pytest.raises(ArgumentErrors) as error:
            parse(*flags)
        return error.value.problems

    assert "did you mean --lr-warmup-fraction?" in problems("--lr-warmup-fractoin", "0.1")[0]
    assert "did you mean --hidden-size?" in problems("--hiden-size", "64")[0]
    # a loose match proposed --no-persist-layer-norm for --log-params-norm once
    far = problems("--log-weight-norm")[0]
    assert "did you mean" not in far and "unknown flag --log-weight-norm" in far


def test_megatron_lm_spellings_and_ignored_values():
    """What Megatron-LM ignores is noted at start-up; its other spellings mean the same."""
    args = parse("--recompute-num-layers", "2")  # no effect without a granularity
    assert args.recompute_num_layers is None and args.recompute_granularity is None
    assert ("--recompute-num-layers", "only used with --recompute-granularity full (as in "
            "Megatron-LM)") in args.no_op_flags
    args = parse("--sequence-parallel")  # dropped at TP 1, saying so as Megatron-LM does
    assert not args.sequence_parallel
    assert [note for note in args.flag_notes if "disabling sequence parallelism" in note]
    assert parse("--recompute-activations").recompute_granularity == "selective"
    assert parse("--layernorm-epsilon", "1e-6").norm_epsilon == 1e-6
    assert not parse("--disable-manual-gc-eval").manual_gc_eval
    args = parse("--num-virtual-stages-per-pipeline-rank", "2",
                 "--pipeline-model-parallel-size", "2", world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2


if __name__ == "__main__":  # the counts for docs/megatron_lm.md
    counts = classify(megatron_lm_actions())
    print(", ".join(f"{name}: {len(flags)}" for name, flags in sorted(counts.items())),
          f"(of {sum(map(len, counts.values()))}); of the refused, "
          f"{len(DEFAULT_VALUES_ACCEPTED)} accept Megatron-LM's default value")
    for name in ("unknown", "broken"):
        for flag in counts.get(name, []):
            print(name, flag)
