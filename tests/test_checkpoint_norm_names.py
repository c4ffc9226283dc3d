"""Checkpoint names of the norms, as Megatron-LM's default Transformer Engine spec saves
them, so that Megatron-LM's MoE and MLA checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3)
load here and ours load there; checkpoints with megatron-core's local-spec names (this
project's before 2026-12-07, Megatron-LM's --transformer-impl local) still resume.

The expected names are those public Hugging Face <-> Megatron converters use for
Megatron-LM's checkpoints (e.g. DeepSeek's q_a_layernorm is
``self_attention.linear_q_up_proj.layer_norm_weight``, a dense layer's
post_attention_layernorm ``mlp.linear_fc1.layer_norm_weight``, an MoE layer's
``pre_mlp_layernorm.weight``)."""

import json
import re
import subprocess
import sys

import pytest

from distributed import ONE_PROCESS_PRELUDE, ROOT, TINY_MODEL, _single_process_env, pretrain

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1,1]"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
       "--position-embedding-type", "rope"]

# the norm names of layer 0 (dense) and layer 1 (MoE)
EXPECTED = {
    "dense": {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.self_attention.q_layernorm.weight"},
    "moe": {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",  # layer 0, dense
        "decoder.layers.pre_mlp_layernorm.weight",
        "decoder.layers.self_attention.q_layernorm.weight"},
    "mla_moe": {
        "decoder.layers.input_layernorm.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",  # layer 0, dense
        "decoder.layers.pre_mlp_layernorm.weight",
        "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight"},
}
FLAGS = {"dense": [], "moe": MOE, "mla_moe": MLA + MOE}


@pytest.mark.distributed
def test_norms_carry_the_transformer_engine_specs_names():
    base = TINY_MODEL + ["--global-batch-size", "1", "--train-iters", "1", "--qk-layernorm",
        "--normalization", "RMSNorm", "--transformer-impl", "local"]
    code = r'''
for case, flags in json.loads(sys.argv[2]).items():
    model = model_of(json.loads(sys.argv[1]) + flags)
    keys = sorted({v.key for k, v in model.sharded_state_dict().items()
                   if "norm" in k and "final" not in k and "k_layernorm" not in k})
    print(json.dumps({case: keys}))
'''
    proc = subprocess.run([sys.executable, "-c", ONE_PROCESS_PRELUDE + code, json.dumps(base),
                           json.dumps(FLAGS)], cwd=ROOT, env=_single_process_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            found.update(json.loads(line))
    # layers of one kind share a name (a layer axis), or are numbered where kinds mix
    assert {case: {re.sub(r"layers\.\d+\.", "layers.", key) for key in keys}
            for case, keys in found.items()} == EXPECTED


def _model(*flags):
    return [a for a in TINY_MODEL if a != "--eval-iters"] + [
        "--eval-iters", "0", "--global-batch-size", "2", "--micro-batch-size", "1",
        "--qk-layernorm", "--normalization", "RMSNorm", "--use-distributed-optimizer",
        *MLA, *MOE, *flags]


def _losses(run):
    assert run.returncode == 0, run.stderr[-3000:]
    return {int(i): float(v) for i, v in
            re.findall(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", run.stdout)}


@pytest.mark.distributed
def test_a_checkpoint_with_local_spec_names_resumes(tmp_path):
    """A checkpoint of an MLA + MoE model (dense and MoE layers, query/key-value norms)
    saved under megatron-core's local-spec names, model and distributed-optimizer state,
    resumes under today's names: its iteration 2 is the uninterrupted run's."""
    ckpt = str(tmp_path / "ckpt")
    saved = pretrain(_model("--train-iters", "1", "--save", ckpt, "--save-interval", "1"),
                     env={"FAULT_LOCAL_SPEC_NORM_NAMES": "1"}, script="tests/fault_hooks.py")
    assert saved.returncode == 0, saved.stderr[-3000:]
    # (the schedule's recorded length is the 1-iteration run's)
    resumed = _losses(pretrain(_model("--train-iters", "2", "--load", ckpt,
                                      "--override-opt_param-scheduler")))
    whole = _losses(pretrain(_model("--train-iters", "2")))
    assert list(resumed) == [2] and resumed[2] == pytest.approx(whole[2], rel=1e-6)
