"""--phase-transition-iterations as Megatron-LM: the run saves and stops at each
transition; relaunched from that checkpoint with the next phase's data, it reads that
data from its start, in a dataset built for the phase's samples alone.

With learning rate 0 the parameters never move, so each iteration's loss is its batch's:
the resumed phase's losses are those of a fresh run of the phase's length on the
phase's data. The corpus is small (6 rows, 5 for training), so a phase of 3 iterations of
4 samples reads it over several epochs, whose order megatron-core draws from the
samples asked: a dataset built for the whole run, or read from its offset, gives other
batches."""

import os

import pytest

from distributed import (TINY_MODEL_WITHOUT_DATA, TRACKER, argument_problems,
                         assert_close_series, init_run, run_configs)
from packed_documents import write_document_corpus

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

FROZEN = TINY_MODEL_WITHOUT_DATA + [
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--split", "90,10,0",
    "--global-batch-size", "4", "--lr", "0", "--lr-warmup-iters", "0"]
PHASES = ["--train-iters", "4", "--phase-transition-iterations", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("phases")
    first, second = str(tmp / "first"), str(tmp / "second")
    write_document_corpus(first, vocab_size=200, copies=1, seed=3)
    write_document_corpus(second, vocab_size=200, copies=1, seed=4)
    on = {name: FROZEN + ["--data-path", prefix] for name, prefix in
          (("first", first), ("second", second))}
    init, start = init_run("init", tmp / "init", on["first"])
    saved = tmp / "saved"
    return run_configs(tmp, 1, [
        init,
        {"name": "phase1", "writes": str(saved / TRACKER), "argv": on["first"] + start
         + PHASES + ["--save", str(saved), "--save-interval", "1000"]},
        {"name": "phase2", "after": [str(saved / TRACKER)], "argv": on["second"] + PHASES
         + ["--load", str(saved)]},
        # the references: fresh runs of each phase's length on its data
        {"name": "fresh1", "argv": on["first"] + start + ["--train-iters", "1"]},
        {"name": "fresh2", "argv": on["second"] + start + ["--train-iters", "3"]},
    ])


def test_each_phase_reads_its_data_from_the_start(runs):
    assert runs["phase1"]["exit_reason"] == "phase" and runs["phase1"]["iteration"] == 1
    assert_close_series(runs["phase1"]["losses"], runs["fresh1"]["losses"], 1e-6, "phase 1")
    assert runs["phase2"]["exit_reason"] is None and runs["phase2"]["iteration"] == 4
    assert len(runs["phase2"]["losses"]) == 3  # iterations 2-4
    assert_close_series(runs["phase2"]["losses"], runs["fresh2"]["losses"], 1e-6, "phase 2")


def test_the_flag_is_checked():
    base = FROZEN + ["--mock-data", "--train-iters", "4"]
    for value, expected in (
            ("1,x", "give comma-separated iteration numbers"),
            ("0,2", "each transition must lie within the run, from 1 to --train-iters - 1 "
                    "(3); got [0]"),
            ("4", "got [4]")):
        problems, _ = argument_problems(base + ["--phase-transition-iterations", value])
        assert any(p.startswith(f"--phase-transition-iterations {value}: ") and expected in p
                   for p in problems), problems
    problems, _ = argument_problems(base + ["--phase-transition-iterations", "2",
                                            "--decrease-batch-size-if-needed"])
    assert any("needs a fixed global batch size" in p and
               p.endswith("drop --decrease-batch-size-if-needed") for p in problems), problems
    problems, args = argument_problems(base + ["--phase-transition-iterations", "3, 1,3"])
    assert not problems and args.phase_transitions == [1, 3]
    assert any("without --save" in note for note in args.flag_notes)


def test_phase_arithmetic():
    from types import SimpleNamespace

    from megatron.trainer import phases

    args = SimpleNamespace(phase_transitions=[2, 5], train_iters=9, global_batch_size=4,
                           train_samples_total=36)
    assert [phases.phase_start(args, i) for i in range(9)] == [0, 0, 2, 2, 2, 5, 5, 5, 5]
    for start, samples in ((0, 8), (2, 12), (5, 16)):
        args.phase_start_iteration = start
        assert phases.train_samples_to_build(args) == samples
    assert phases.samples_into_phase(args, 3, consumed_samples=12) == 4
    assert "phase 3 of 3" in phases.describe(args) and "iterations 6-9" in phases.describe(args)
    args.phase_transitions = []
    assert phases.train_samples_to_build(args) == 36
    assert phases.samples_into_phase(args, 3, consumed_samples=12) == 12


def test_a_resume_at_another_global_batch_size_is_refused(tmp_path):
    from distributed import pretrain, one_error_line

    base = FROZEN + ["--mock-data", "--train-iters", "4", "--phase-transition-iterations", "1",
                     "--save", str(tmp_path)]
    first = pretrain(base + ["--save-interval", "1000"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "exiting at iteration 1: the phase ends (--phase-transition-iterations)" in first.stdout
    assert open(os.path.join(tmp_path, TRACKER)).read().strip() == "1"
    second = pretrain(base + ["--save-interval", "1000", "--load", str(tmp_path),
                           "--global-batch-size", "8"])
    assert second.returncode != 0
    line = one_error_line(second.stderr)
    assert ("--phase-transition-iterations: --load" in line and
            "was saved with --global-batch-size 4, this run has 8" in line), second.stderr[-3000:]
