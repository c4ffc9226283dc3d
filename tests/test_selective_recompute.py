"""Selective recomputation (core attention) under Seq1F1B: exact, and it saves less than
no recomputation (issue #7, point 2).

One transformer layer of the split-aware spec, measured by tools/selective_saved_bytes.py
in its own process (it initialises megatron-core's parallel state and CPU patches).
"""

import json
import os
import subprocess
import sys

import pytest

from distributed import ROOT

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

HEADS, HIDDEN, L = 4, 32, 64
HEAD_DIM = HIDDEN // HEADS
FP32 = 4


def run_tool(tmp_path_factory, *extra):
    out = tmp_path_factory.mktemp("selective") / "saved.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "selective_saved_bytes.py"),
           "--seq-length", str(L), "--hidden-size", str(HIDDEN), "--heads", str(HEADS),
           "--json", str(out), *extra]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["splits"]: r for r in json.loads(out.read_text())["results"]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_tool(tmp_path_factory, "--splits", "1", "2", "4")


@pytest.fixture(scope="module")
def measured_without_rope(tmp_path_factory):
    """Learned positions: the query reaches the kernel as a view of the fused QKV output."""
    return run_tool(tmp_path_factory, "--splits", "1", "2", "--no-rope")


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_selective_is_exact(measured, splits):
    for mode, diff in measured[splits]["max_grad_diff_vs_none"].items():
        assert diff == 0.0, (mode, diff)


@pytest.mark.parametrize("splits", [2, 4])
def test_selective_saves_less_than_none_per_split(measured, splits):
    runs = measured[splits]["runs"]
    for none, selective in zip(runs["none"]["per_split"], runs["selective"]["per_split"]):
        assert selective["layer_bytes"] < none["layer_bytes"]
        # core attention keeps only the split's query; its K/V live in the cache
        assert selective["attention_bytes"] == selective["length"] * HIDDEN * FP32


@pytest.mark.parametrize("splits", [2, 4])
def test_selective_writes_the_cache_once_per_split(measured, splits):
    runs = measured[splits]["runs"]
    assert runs["none"]["cache_writes"] == runs["selective"]["cache_writes"] == splits
    # megatron-core's own checkpoint reruns the whole core attention: the recomputed
    # forward rewrote the split's (identical) K/V into the same slots
    assert runs["selective-mcore"]["cache_writes"] == 2 * splits


def test_megatron_core_checkpoint_duplicated_the_split_kv(measured):
    """What the kernel checkpoint fixes: megatron-core's checkpoint saved the split's key
    and value (a view of the whole fused QKV output) although the cache holds them."""
    for split in measured[2]["runs"]["selective-mcore"]["per_split"]:
        l = split["length"]
        query, key, qkv = l * HIDDEN, l * HIDDEN, 3 * l * HIDDEN
        mask_type = 4  # the int32 attn_mask_type tensor it also passes through
        assert split["attention_bytes"] == (query + key + qkv) * FP32 + mask_type


def test_unsplit_selective_unchanged(measured):
    """Without splits (1F1B) both checkpoints save the same inputs (but the 4-byte
    attn_mask_type tensor), a little less than no recomputation (the softmax statistics)."""
    runs = {mode: run["per_split"][0]["layer_bytes"] for mode, run in measured[1]["runs"].items()}
    assert runs["selective-mcore"] - runs["selective"] == 4
    assert runs["selective"] < runs["none"]


def test_selective_keeps_the_query_not_the_fused_qkv_without_rope(measured_without_rope):
    """Without RoPE the kernel's query is a view of the fused QKV output; the checkpoint
    keeps a copy of the query (``kv_cache.query_alone``), not that whole output (3x the
    query), so selective recomputation still saves less than none; exact; unsplit, where
    the key and value keep the output anyway, nothing is copied."""
    split_run = measured_without_rope[2]
    assert all(d == 0.0 for d in split_run["max_grad_diff_vs_none"].values())
    runs = split_run["runs"]
    for none, selective in zip(runs["none"]["per_split"], runs["selective"]["per_split"]):
        assert selective["attention_bytes"] == selective["length"] * HIDDEN * FP32
        assert selective["layer_bytes"] < none["layer_bytes"]
    unsplit = {mode: run["per_split"][0]["layer_bytes"]
               for mode, run in measured_without_rope[1]["runs"].items()}
    assert unsplit["selective-mcore"] - unsplit["selective"] == 4
