"""--timeline-file records every unit of the last iteration on every pipeline rank."""

import json

import pytest

from distributed import TINY_MODEL, assert_close_series, run_configs

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

FLAGS = TINY_MODEL + ["--global-batch-size", "3", "--micro-batch-size", "1",
                      "--train-iters", "2", "--pipeline-model-parallel-size", "2"]
# evaluation right after the last (recorded) iteration: its forward passes must not be
# recorded as units of the training iteration
FLAGS[FLAGS.index("--eval-iters") + 1] = "1"
FLAGS += ["--eval-interval", "2"]


def test_timeline_of_1f1b_and_seq1f1b(tmp_path):
    runs = [
        {"name": "plain", "argv": FLAGS},
        {"name": "s1", "argv": FLAGS + ["--timeline-file", str(tmp_path / "s1.json"),
                                        "--tensorboard-dir", str(tmp_path / "tb")]},
        {"name": "s3", "argv": FLAGS + ["--seq1f1b-splits", "3", "--timeline-file",
                                        str(tmp_path / "s3.json")]},
    ]
    results = run_configs(tmp_path, 2, runs)
    # observing the schedule does not change what it computes
    for name in ("s1", "s3"):
        assert_close_series(results[name]["losses"], results["plain"]["losses"], 1e-5, name)
    for name, splits in (("s1", 1), ("s3", 3)):
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert len(data["ranks"]) == 2
        for units in data["ranks"]:
            assert len(units) == 2 * 3 * splits  # one iteration: F and B of m*s units
            assert {(u["kind"], u["microbatch"], u["split"]) for u in units} == {
                (k, mb, j) for k in "FB" for mb in range(3) for j in range(splits)}
            assert all(u["end"] >= u["start"] >= 0 for u in units)
        assert (tmp_path / f"{name}.chrome.json").exists()
    # TensorBoard scalars from the last pipeline stage
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
