"""Faults injected into checkpoints and --save directories, seen through real processes.

A damaged checkpoint (a truncated, missing or rewritten file) stops the load with one
line naming the file; a save killed at any moment never becomes the latest checkpoint nor
blocks the next save; checkpoints without a tracker, or of another run, are not
overwritten; a --save directory held by a live run is refused, and freed when it dies.
"""

import json
import os
import re
import shutil
import signal
import time

import pytest
from torch.distributed.checkpoint import FileSystemReader

from distributed import (TINY_MODEL, kill_tree, one_error_line, pretrain, run_configs,
                         start_pretrain, wait_for_line)

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

BASE = TINY_MODEL + ["--global-batch-size", "2"]
TRACKER = "latest_checkpointed_iteration.txt"
ITER2 = "iter_0000002"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Checkpoints of iterations 1 and 2 (tracker: 2), saved once for every case."""
    directory = tmp_path_factory.mktemp("pristine") / "ckpt"
    saved = pretrain(BASE + ["--train-iters", "2", "--save-interval", "1",
                              "--save", str(directory)])
    assert saved.returncode == 0, saved.stderr[-3000:]
    return directory


def _copy(pristine, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(pristine, target)
    (target / ".lock").unlink(missing_ok=True)
    return target


def _truncate(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _garbage_in_a_tensor(directory):
    """64 bytes of garbage in the middle of a weight's bytes inside a .distcp file."""
    storage = FileSystemReader(str(directory)).read_metadata().storage_data
    index, info = next((i, s) for i, s in storage.items()
                       if i.fqn.endswith("weight") and s.length >= 256)
    with open(directory / info.relative_path, "r+b") as handle:
        handle.seek(info.offset + info.length // 2)
        handle.write(os.urandom(64))
    return info.relative_path


def _distcp(directory):
    return sorted(p.name for p in directory.glob("*.distcp"))[0]


# case -> (how to damage iter_0000002, what the error must say about which file)
DAMAGES = {
    "distcp_truncated": (lambda d: _truncate(d / _distcp(d)),
                         r"__0_0\.distcp is truncated \(\d+ bytes, the save wrote \d+\)"),
    "common_pt_missing": (lambda d: (d / "common.pt").unlink(), r"common\.pt is missing"),
    "metadata_json_missing": (lambda d: (d / "metadata.json").unlink(),
                              r"metadata\.json is missing"),
    "metadata_json_garbage": (lambda d: (d / "metadata.json").write_text("{garbage"),
                              r"metadata\.json is (truncated|longer than saved)"),
    "garbage_in_tensor": (_garbage_in_a_tensor,
                          r"__0_\d\.distcp does not match its checksum"),
    # checkpoints without the manifest (older versions): a structural check still names it
    "old_distcp_truncated": (lambda d: ((d / "checksums.json").unlink(),
                                        _truncate(d / _distcp(d))),
                             r"__0_0\.distcp is truncated \(\d+ bytes, \.metadata needs \d+\)"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damaged_checkpoint_is_one_line_naming_the_file(pristine, tmp_path, case):
    if case == "common_pt_missing" and not (pristine / ITER2 / "common.pt").exists():
        pytest.skip("this megatron-core (0.19+) keeps the common state inside the "
                    "torch_dist files: there is no common.pt to lose")
    ckpt = _copy(pristine, tmp_path)
    damage, says = DAMAGES[case]
    damage(ckpt / ITER2)
    loaded = pretrain(BASE + ["--train-iters", "3", "--load", str(ckpt)])
    assert loaded.returncode != 0
    error = one_error_line(loaded.stderr)
    assert error.startswith(f"error: --load {ckpt}: checkpoint {ckpt / ITER2} is damaged: "), error
    assert re.search(says, error), error
    # and what to do: the earlier checkpoint is named with the file that picks it
    assert error.endswith(f"write another saved iteration (1) into {ckpt / TRACKER}")


def test_checkpoint_of_ours_without_manifest_needs_the_flag(pristine, tmp_path):
    """checksums.json deleted from a checkpoint this project wrote: refused (one line);
    --load-unverified-checkpoint loads it with a warning. The tracker is also set back to
    1 here: the load names iter_0000002, which this run's saves would replace. With
    --lr 1e4 (and --no-load-optim: a fresh optimizer) the run then meets a NaN: the stop
    does not call the unverified checkpoint the last good state."""
    ckpt = _copy(pristine, tmp_path)
    iter1 = ckpt / "iter_0000001"
    (iter1 / "checksums.json").unlink()
    (ckpt / TRACKER).write_text("1")
    refused = pretrain(BASE + ["--train-iters", "3", "--load", str(ckpt)])
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == (
        f"error: --load {ckpt}: checkpoint {iter1} is damaged: checksums.json is missing, "
        f"but this project wrote the checkpoint and writes one with every save (was it "
        f"deleted? a file may be damaged too): pass --load-unverified-checkpoint to load it "
        f"unverified; write another saved iteration (2) into {ckpt / TRACKER}")
    loaded = pretrain(BASE + ["--train-iters", "30", "--load", str(ckpt), "--save", str(ckpt),
                              "--save-interval", "1000", "--load-unverified-checkpoint",
                              "--no-load-optim", "--lr", "1e4"])
    assert f"warning: {iter1} has no checksums.json (loaded with --load-unverified-checkpoint)" \
        in loaded.stdout, loaded.stdout[-3000:] + loaded.stderr[-3000:]
    assert (f"warning: --load {ckpt}: {TRACKER} names iteration 1 but iter_0000002 are newer: "
            f"saves of this run at those iterations will replace them") in loaded.stdout
    assert f"loaded the weights of {iter1}" in loaded.stdout or \
        f"loaded checkpoint from {iter1} at iteration 1" in loaded.stdout, loaded.stdout[-3000:]
    assert loaded.returncode != 0
    error = one_error_line(loaded.stderr)
    assert error.startswith("error: non-finite values at iteration "), error
    assert error.endswith(f"The latest checkpoint, iteration 1 in --save {ckpt}, is unverified "
                          f"(no checksums.json): it may hold the bad values; an earlier one may "
                          f"be the last good state."), error
    assert "last good state is" not in error


def test_megatron_lm_checkpoint_without_manifest_loads(tmp_path):
    """A checkpoint as Megatron-LM writes it (its common keys, no checksums.json; saved
    here through tests/fault_hooks.py) loads as before, with a warning."""
    ckpt = tmp_path / "ckpt"
    saved = pretrain([*BASE, "--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"],
                     env={"FAULT_MEGATRON_LM_COMMON": "1"}, script="tests/fault_hooks.py")
    assert saved.returncode == 0, saved.stderr[-3000:]
    (ckpt / "iter_0000001" / "checksums.json").unlink()
    loaded = pretrain(BASE + ["--train-iters", "2", "--load", str(ckpt),
                              "--override-opt_param-scheduler"])  # saved with 1
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert (f"warning: {ckpt / 'iter_0000001'} has no checksums.json (saved by Megatron-LM): "
            f"its files are not verified") in loaded.stdout
    assert f"loaded checkpoint from {ckpt / 'iter_0000001'} at iteration 1" in loaded.stdout


def test_megatron_lm_dp_reshardable_optimizer_state_is_named(tmp_path):
    """A distributed-optimizer checkpoint as Megatron-LM writes it by default (its common
    keys, which do not record the flag; the state in megatron-core's dp_reshardable
    format; saved here through tests/fault_hooks.py): one line saying what it holds and
    the two ways on, not "the checkpoint lacks ... (another model?)"; --no-load-optim
    loads its weights."""
    ckpt = tmp_path / "ckpt"
    distopt = [*BASE, "--use-distributed-optimizer", "--override-opt_param-scheduler"]
    saved = pretrain([*distopt, "--train-iters", "1", "--save", str(ckpt), "--save-interval",
                      "1"], env={"FAULT_MEGATRON_LM_COMMON": "1",
                                 "FAULT_OPTIMIZER_FORMAT": "dp_reshardable"},
                     script="tests/fault_hooks.py")
    assert saved.returncode == 0, saved.stderr[-3000:]
    loaded = pretrain(distopt + ["--train-iters", "2", "--load", str(ckpt)])
    assert loaded.returncode != 0
    assert one_error_line(loaded.stderr) == (
        f"error: --load {ckpt / 'iter_0000001'} holds distributed-optimizer state in "
        f"megatron-core's dp_reshardable format (Megatron-LM's default): per data-parallel "
        f"rank flattened gradient buckets, which load only into the exact data-parallel size "
        f"and bucket layout of the run that saved them; this project reads the "
        f"fully_reshardable format. Pass --no-load-optim to load the weights only, or have "
        f"Megatron-LM save it with --dist-ckpt-optim-fully-reshardable")
    weights = pretrain(distopt + ["--train-iters", "2", "--load", str(ckpt), "--no-load-optim"])
    assert weights.returncode == 0, weights.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / 'iter_0000001'} at iteration 1" in weights.stdout


def test_tracker_not_an_ascii_decimal(pristine, tmp_path):
    """Bytes that are not UTF-8 (in a real run), or a digit that str.isdigit() takes (the
    same reader, in this process): one line naming the file and what to write, no
    traceback."""
    from megatron.trainer.checkpointing import CheckpointError, latest_iteration

    ckpt = _copy(pristine, tmp_path)
    garbage = b"\xff\xfe\x00\x80bin"
    (ckpt / TRACKER).write_bytes(garbage)
    loaded = pretrain(BASE + ["--train-iters", "3", "--load", str(ckpt)])
    assert loaded.returncode != 0
    assert one_error_line(loaded.stderr) == (
        f"error: --load {ckpt}: {TRACKER} holds {garbage!r}, not an "
        f"iteration: write the iteration to resume from (1, 2 saved) into it")
    (ckpt / TRACKER).write_text("\u00b3")
    with pytest.raises(CheckpointError) as error:
        latest_iteration(str(ckpt))
    assert str(error.value) == (f"--load {ckpt}: {TRACKER} holds '\u00b3', not an iteration: "
                                f"write the iteration to resume from (1, 2 saved) into it")


def test_tracker_naming_a_missing_iteration(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    (ckpt / TRACKER).write_text("7")
    loaded = pretrain(BASE + ["--train-iters", "8", "--load", str(ckpt)])
    assert loaded.returncode != 0
    assert one_error_line(loaded.stderr) == (f"error: --load {ckpt}: {TRACKER} names iteration 7 "
                                         f"but {ckpt / 'iter_0000007'} does not exist")


def test_save_killed_at_any_moment_is_never_the_latest(tmp_path):
    """SIGKILL a run that saves every iteration, mostly while it is saving: the tracker
    names a complete checkpoint, and the next run resumes and saves over the leftovers."""
    ckpt = tmp_path / "ckpt"
    run = start_pretrain(BASE + ["--train-iters", "100000", "--save-interval", "1",
                         "--save", str(ckpt)])
    try:
        wait_for_line(run, r"saved checkpoint at iteration 3 ")
        time.sleep(0.15)  # into a later save
    finally:
        kill_tree(run)
    latest = int((ckpt / TRACKER).read_text())
    # what a killed save leaves: an iter_N.incomplete, as an older version's partial iter_N
    leftover = ckpt / f"iter_{latest + 1:07d}"
    leftover.mkdir(exist_ok=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    resumed = pretrain(BASE + ["--train-iters", str(latest + 1), "--load", str(ckpt),
                                "--save", str(ckpt), "--save-interval", "1000",
                                "--override-opt_param-scheduler"])  # saved with 100000
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / f'iter_{latest:07d}'} at iteration {latest}" \
        in resumed.stdout
    assert f"saved checkpoint at iteration {latest + 1}" in resumed.stdout
    assert (ckpt / TRACKER).read_text() == str(latest + 1)
    assert not list(ckpt.glob("*.incomplete")) and not list(ckpt.glob("*.replaced"))
    manifest = json.loads((leftover / "checksums.json").read_text())["files"]
    # every file the save wrote (common.pt only where megatron-core writes one: <= 0.18)
    assert set(manifest) == {p.name for p in leftover.iterdir()} - {"checksums.json"}
    assert "__0_0.distcp" in manifest and ".metadata" in manifest
    assert (leftover / "__0_0.distcp").stat().st_size == manifest["__0_0.distcp"]["size"]


def test_checkpoints_without_tracker_are_not_overwritten(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    (ckpt / TRACKER).unlink()
    for argv, flag in ((["--load", str(ckpt), "--save", str(ckpt), "--save-interval", "1000"], "--save"),
                       (["--load", str(ckpt)], "--load")):
        refused = pretrain(BASE + ["--train-iters", "3"] + argv)
        assert refused.returncode != 0
        assert one_error_line(refused.stderr) == (
            f"error: {flag} {ckpt} holds iter_0000001, iter_0000002 but no {TRACKER} (a save "
            f"was interrupted or the file was deleted): write the iteration to resume from "
            f"(e.g. 2) into {ckpt / TRACKER}, or use another --save")
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001", "iter_0000002"]
    assert not (ckpt / TRACKER).exists()


def test_a_new_run_does_not_overwrite_another_runs_checkpoints(pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path)
    before = (ckpt / ITER2 / "checksums.json").read_text()
    # two ranks: rank 0 decides, both stop (torchrun ends the job), one line is printed
    refused = start_pretrain(BASE + ["--train-iters", "2", "--save", str(ckpt), "--save-interval", "1000"], world_size=2)
    out, err = refused.communicate(timeout=120)
    assert refused.returncode != 0
    assert one_error_line(err) == (
        f"error: --save {ckpt} already holds checkpoints (iter_0000001, iter_0000002) and "
        f"this run (no --load) does not resume from them, so it would overwrite them: pass "
        f"--load {ckpt} to resume, or use another --save")
    assert (ckpt / ITER2 / "checksums.json").read_text() == before


def test_save_dir_held_by_a_live_run_is_refused_until_it_dies(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = start_pretrain(BASE + ["--train-iters", "100000", "--save-interval", "100000",
                           "--save", str(ckpt)])
    try:
        wait_for_line(first, r" iteration\s+2/")  # past claim_save_dir: it holds the lock
        start = time.time()
        second = pretrain(BASE + ["--train-iters", "1", "--save", str(ckpt), "--save-interval", "1000"], timeout=120)
        assert second.returncode != 0
        assert time.time() - start < 60
        error = one_error_line(second.stderr)
        assert error.startswith(f"error: --save {ckpt} is in use by another run (host "), error
        assert f", pid {first.pid}, since " in error
        assert error.endswith(f"holding {ckpt / '.lock'}): wait for it to end, or use "
                              f"another --save"), error
    finally:
        kill_tree(first)
    assert first.returncode == -signal.SIGKILL
    third = pretrain(BASE + ["--train-iters", "1", "--save", str(ckpt), "--save-interval", "1000"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert "saved checkpoint at iteration 1" in third.stdout


def test_one_process_releases_save_dir_between_runs(tmp_path):
    """dist_runner trains configurations in turn in one process: the second resumes in
    the first one's --save (the lock was released)."""
    ckpt = tmp_path / "ckpt"
    results = run_configs(tmp_path, 1, [
        {"name": "first", "argv": BASE + ["--train-iters", "1", "--save", str(ckpt), "--save-interval", "1000"]},
        {"name": "second", "argv": BASE + ["--train-iters", "2", "--load", str(ckpt),
                                           "--save", str(ckpt), "--save-interval", "1000",
                                           "--override-opt_param-scheduler"]},
    ])
    assert len(results["second"]["losses"]) == 1
    assert (ckpt / TRACKER).read_text() == "2"


@pytest.mark.parametrize("flag, reason", [
    ("--use-distributed-optimizer",
     "was saved without --use-distributed-optimizer and this run is with it: its optimizer "
     "state does not load; match the flag, or pass --no-load-optim to load the weights only"),
    ("--optimizer sgd",
     "holds the state of --optimizer adam and this run uses --optimizer sgd: it does not "
     "load; use --optimizer adam, or pass --no-load-optim to load the weights only"),
])
def test_optimizer_state_of_another_optimizer_is_refused(pristine, tmp_path, flag, reason):
    """The plain optimizer's state does not load into the distributed optimizer (nor the
    reverse), nor Adam's into SGD: one line says so and how to load the weights only."""
    ckpt = _copy(pristine, tmp_path)
    refused = pretrain(BASE + ["--train-iters", "3", "--load", str(ckpt), *flag.split()])
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == f"error: --load {ckpt / ITER2} {reason}"


def test_no_initialization_takes_every_weight_from_the_checkpoint(pristine, tmp_path):
    """--no-initialization: the weights are the checkpoint's (the same losses as a load
    of initialised weights); a --load without a checkpoint stops with one line instead of
    training uninitialised memory."""
    ckpt = _copy(pristine, tmp_path)
    resume = BASE + ["--train-iters", "3", "--load", str(ckpt),
                     "--override-opt_param-scheduler"]
    initialised, skipped = pretrain(resume), pretrain(resume + ["--no-initialization"])
    assert initialised.returncode == 0 and skipped.returncode == 0, skipped.stderr[-3000:]
    losses = [re.findall(r"lm loss: ([0-9.]+)", run.stdout) for run in (initialised, skipped)]
    assert losses[0] == losses[1] and losses[0], losses
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = pretrain(BASE + ["--train-iters", "3", "--load", str(empty),
                                "--no-initialization"])
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == (
        f"error: --load {empty}: no checkpoint there ({TRACKER} missing), and "
        f"--no-initialization left the weights uninitialised: check the path, or drop "
        f"--no-initialization to start from random")


def _mismatch_keys(directory, gone, kept, extra):
    """Rewrite a checkpoint's torch_dist index: `gone` disappears (the model asks for a
    key the checkpoint lacks) and `extra` appears, stored as `kept` (a key the model does
    not ask for). checksums.json goes (the index changed)."""
    import dataclasses
    import pickle
    index = directory / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    del metadata.state_dict_metadata[gone]
    metadata.state_dict_metadata[extra] = metadata.state_dict_metadata[kept]
    for where, info in list(metadata.storage_data.items()):
        if where.fqn == kept:
            metadata.storage_data[dataclasses.replace(where, fqn=extra)] = info
    index.write_bytes(pickle.dumps(metadata))
    (directory / "checksums.json").unlink()


def test_dist_ckpt_strictness_decides_a_key_mismatch(pristine, tmp_path):
    """--dist-ckpt-strictness as Megatron-LM (megatron-core's load(strict=...)): by
    default a checkpoint lacking a weight the model asks for is refused with one line
    naming the key and the flag; log_all loads the rest, logs both sides of the mismatch
    and trains."""
    ckpt = _copy(pristine, tmp_path)
    gone, extra = "decoder.final_layernorm.bias", "decoder.extra_norm.weight"
    _mismatch_keys(ckpt / ITER2, gone, "decoder.final_layernorm.weight", extra)
    load = BASE + ["--train-iters", "3", "--load", str(ckpt), "--no-load-optim",
                   "--load-unverified-checkpoint"]
    refused = pretrain(load)
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == (
        f"error: --load {ckpt / ITER2}: the checkpoint lacks {gone}, which the model asks "
        f"for (another model?); to load the rest and keep such weights at their initial "
        f"values, pass --dist-ckpt-strictness log_unexpected")
    logged = pretrain(load + ["--dist-ckpt-strictness", "log_all"])
    assert logged.returncode == 0, logged.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / ITER2} at iteration 2" in logged.stdout
    assert re.search(r"iteration +3/ +3 \| .*lm loss: \d", logged.stdout), logged.stdout[-2000:]
    assert gone in logged.stderr and extra in logged.stderr, logged.stderr[-3000:]


def _manifest_holds(directory):
    """Every file of a saved checkpoint still has the size and hash its manifest says."""
    import hashlib

    files = json.loads((directory / "checksums.json").read_text())["files"]
    for name, entry in files.items():
        data = (directory / name).read_bytes()
        assert len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == \
            entry["sha256"], name
    return files


def test_failed_save_is_one_line_and_leaves_nothing_partial(tmp_path):
    """A save that the disk refuses (tests/fault_hooks.py: RLIMIT_FSIZE from the second
    save on, on pipeline rank 1 only, so the kernel refuses its writes with EFBIG as a
    full disk refuses them with ENOSPC; the free space reported as 1000 bytes): a warning
    before each save, then one line naming --save, the iteration, the space needed and
    free; the partial iter_2.incomplete is gone; iteration 1 and the tracker intact;
    every rank ends (well within --distributed-timeout-minutes)."""
    ckpt = tmp_path / "ckpt"
    run = start_pretrain(TINY_MODEL + ["--global-batch-size", "4", "--pipeline-model-parallel-size",
                                       "2", "--train-iters", "4", "--save", str(ckpt),
                                       "--save-interval", "1"],
                         world_size=2, script="tests/fault_hooks.py",
                         env={"FAULT_FSIZE_AT_SAVE": "2", "FAULT_FSIZE_RANK": "1",
                              "FAULT_FREE_BYTES": "1000"})
    start = time.time()
    try:
        out, err = run.communicate(timeout=180)
    finally:
        kill_tree(run)
    assert run.returncode != 0
    assert time.time() - start < 180
    assert re.search(rf"warning: --save {ckpt} has 1.0 KB free but the checkpoint of "
                     rf"iteration 1 needs about [\d.]+ [KM]B: the save will likely fail",
                     out), out[-3000:]
    error = one_error_line(err)
    assert re.match(rf"error: checkpoint save of iteration 2 into --save {ckpt} failed on "
                    # megatron-core 0.19's save worker reports only the class of the OSError
                    rf"rank 1: .*(\[Errno 27\] File too large|<class 'OSError'>).* \(the "
                    rf"checkpoint needs about "
                    rf"[\d.]+ [KM]B, 1.0 KB free\); removed {ckpt / 'iter_0000002'}"
                    rf"\.incomplete; the checkpoint of iteration 1 and {TRACKER} are intact: "
                    rf"free space or point --save elsewhere, then resume with --load {ckpt}$",
                    error), error
    assert "saved checkpoint at iteration 1 " in out and "iteration 2 to" not in out
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "iter_0000001", TRACKER]
    assert (ckpt / TRACKER).read_text() == "1"
    assert _manifest_holds(ckpt / "iter_0000001")


def test_a_checkpoint_from_before_the_fused_gelu_stops_a_default_resume(tmp_path):
    """A GeLU checkpoint saved before --no-bias-gelu-fusion was honoured (its model shape
    has no record of the GeLU: it trained the exact one; saved here through
    tests/fault_hooks.py) does not resume silently under Megatron-LM's default, the tanh
    GeLU: one line says what to add, and with it the run resumes from that checkpoint."""
    ckpt = tmp_path / "ckpt"
    saved = pretrain(BASE + ["--train-iters", "2", "--save-interval", "2", "--save", str(ckpt),
                             "--no-bias-gelu-fusion"],
                     env={"FAULT_PRE_GELU_SHAPE": "1"}, script="tests/fault_hooks.py")
    assert saved.returncode == 0, saved.stderr[-3000:]
    refused = pretrain(BASE + ["--train-iters", "3", "--load", str(ckpt)])
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == (
        f"error: --load {ckpt / ITER2} holds another model shape: --bias-gelu-fusion saved "
        f"False, now True (that checkpoint's MLP computes the exact GeLU: add "
        f"--no-bias-gelu-fusion, or --use-checkpoint-args, to continue it)")
    resumed = pretrain(BASE + ["--train-iters", "3", "--load", str(ckpt),
                               "--no-bias-gelu-fusion", "--use-checkpoint-opt_param-scheduler"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt / ITER2} at iteration 2" in resumed.stdout


def test_extending_the_context_with_yarn_needs_finetune(tmp_path):
    """A RoPE checkpoint resumed with YaRN stops with one line saying how to extend the
    context from it; --finetune starts YaRN training from its weights and says so."""
    ckpt = tmp_path / "ckpt"
    rope = BASE + ["--position-embedding-type", "rope"]
    saved = pretrain(rope + ["--train-iters", "2", "--save-interval", "2", "--save", str(ckpt)])
    assert saved.returncode == 0, saved.stderr[-3000:]
    yarn = BASE + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                   "--yarn-original-max-position-embeddings", "12", "--load", str(ckpt)]
    refused = pretrain(yarn + ["--train-iters", "3"])
    assert refused.returncode != 0
    assert one_error_line(refused.stderr) == (
        f"error: --load {ckpt / ITER2} holds another model shape: --position-embedding-type "
        f"saved 'rope', now 'yarn' (only RoPE's position scaling differs: to extend the "
        f"context from this checkpoint, start a run from its weights with --finetune; to "
        f"resume it, give its settings or --use-checkpoint-args)")
    extended = pretrain(yarn + ["--train-iters", "1", "--finetune"])
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert (f"  note: --load {ckpt / ITER2}: RoPE reads positions differently from that "
            f"checkpoint's run (--position-embedding-type saved 'rope', now 'yarn'): its "
            f"weights start this run (--finetune), as when extending the context"
            in extended.stdout)
    assert f"loaded the weights of {ckpt / ITER2} (--finetune)" in extended.stdout


def test_a_failed_save_advises_freeing_space_only_for_disk_errors():
    """The disk advice follows an OSError anywhere in the failure (torch wraps it, at times
    keeping only its name); an error inside the checkpoint code says the disk is not the
    cause (the distributed optimizer's pre-step AssertionError was once told to free
    space)."""
    from megatron.trainer.save_failure import advice_for, cause

    full = OSError(28, "No space left on device")
    wrapped = RuntimeError("Worker failure")
    wrapped.__cause__ = full
    named = RuntimeError("Worker failure: An error is caught while starting worker 0, "
                         "error: <class 'OSError'>")
    for error in (full, wrapped, named):
        assert advice_for(error, cause(error)[1]).startswith("free space"), error
    internal = AssertionError()
    assert advice_for(internal, cause(internal)[1]).startswith("the disk is not the cause")
