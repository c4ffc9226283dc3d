"""tools/plan.py reads a pretrain_gpt.py command line as it is (training's own parser
and checks), takes the dtype from --bf16/--fp16 and models the CPU kernels with --gpu cpu."""

import json

import pytest

from megatron.planner.cli import config_from_args, main, parse
from megatron.planner.predict import PlanError, predict

TRAINING = [
    "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", "1000",
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "42",
    "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
    "--sequence-parallel", "--seq1f1b-splits", "4", "--position-embedding-type", "rope",
    # data, logging and checkpoint flags: accepted, never read
    "--data-path", "/nonexistent/corpus_text_document", "--split", "949,50,1",
    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json",
    "--merge-file", "/nonexistent/merges.txt", "--save", "/nonexistent/ckpt",
    "--load", "/nonexistent/ckpt", "--save-interval", "500", "--log-interval", "10",
    "--eval-interval", "100", "--eval-iters", "10", "--tensorboard-dir", "/nonexistent/tb",
    "--exit-signal-handler",
]


def plan(argv):
    return predict(config_from_args(parse(argv)))


def test_a_training_command_line_is_planned_unchanged(capsys):
    assert main(TRAINING + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["world_size"] == 8 and out["splits"] == 4
    assert out["model"]["vocab_size"] == 50257  # the GPT-2 BPE vocabulary, file not read
    assert out["model"]["position_embedding_type"] == "rope"
    assert out["activation_dtype_bytes"] == 4  # no --bf16: fp32, as the run would train


def test_dtype_follows_the_precision_flags():
    fp32, bf16 = plan(TRAINING), plan(TRAINING + ["--bf16"])
    assert fp32.config.act_bytes == 4 and bf16.config.act_bytes == 2
    for a, b in zip(fp32.stages[:-1], bf16.stages[:-1]):
        # activations about double (fp32 statistics and 1-byte masks stay), weights too
        assert 1.8 < a["activations"] / b["activations"] <= 2.0
        assert a["weights"] == pytest.approx(2 * b["weights"], rel=1e-2)
        assert a["reserved"] >= a["total"]
    # the last stage's fp32 logits softmax is fp32 in both
    assert fp32.stages[-1]["activations"] / bf16.stages[-1]["activations"] < 1.8


def test_gpu_cpu_models_the_cpu_kernels():
    """Dropout masks in the activation dtype, and attention dropout on SDPA's math
    kernel (scores stored) on CPU; neither on a GPU."""
    gpu = plan(TRAINING + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"])
    cpu = plan(TRAINING + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                           "--gpu", "cpu"])
    no_attention_dropout = plan(TRAINING + ["--hidden-dropout", "0.1",
                                            "--attention-dropout", "0", "--gpu", "cpu"])
    assert gpu.stages[0]["activations"] < no_attention_dropout.stages[0]["activations"]
    assert no_attention_dropout.stages[0]["activations"] < cpu.stages[0]["activations"]


def test_training_checks_apply(capsys):
    """The trainer's validation runs (here: heads not divisible by TP), and an unknown
    flag is refused by name."""
    with pytest.raises(PlanError, match="--tensor-model-parallel-size"):
        plan(TRAINING + ["--tensor-model-parallel-size", "3"])
    with pytest.raises(SystemExit) as exc:
        main(TRAINING + ["--no-such-flag"])
    assert exc.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


def test_moe_models_are_refused_until_the_planner_models_experts():
    """A dense prediction of an MoE command line would mislead: refused with the reason."""
    with pytest.raises(PlanError, match="does not model mixture-of-experts"):
        plan(TRAINING + ["--num-experts", "8", "--disable-bias-linear"])


def test_vocabulary_padding_follows_the_flag():
    """--make-vocab-size-divisible-by pads the LM head's logits as training does."""
    padded = plan(TRAINING).cost.vocab
    exact = plan(TRAINING + ["--make-vocab-size-divisible-by", "1"]).cost.vocab
    assert (padded, exact) == (50432, 50258)  # 128 x TP 2 multiple; 1 x TP 2 multiple


@pytest.mark.distributed  # runs the example script (a bash process)
def test_qwen3_4b_example_is_planned_as_it_is():
    """examples/train_qwen3_4b_seq1f1b.sh with PLAN=1 hands its training flags unchanged
    to tools/plan.py: Megatron-LM's Qwen3-4B shape at 16k tokens with 4 Seq1F1B splits."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PLAN="1", PYTHON=sys.executable, PLAN_ARGS="--json")
    proc = subprocess.run(["bash", os.path.join(root, "examples", "train_qwen3_4b_seq1f1b.sh")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    model = out["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"]) == \
        (36, 2560, 32)
    assert model["vocab_size"] == 151936 and out["splits"] == 4
    assert out["parallel"]["world_size"] == 8
    # the seed port's PP=8: 36 = 3 + 6 x 5 + 3 (--decoder-first/last-pipeline-num-layers)
    assert out["parallel"]["pipeline_model_parallel_size"] == 8
    assert out["parallel"]["stage_layers"] == [3] + [5] * 6 + [3]
    # the planner prices each stage by its own layers: the embedding stage's 3 layers
    # and the vocabulary weigh less than a middle stage's 5 layers' activations
    stages = out["stages"]
    assert stages[0]["activations"] < stages[1]["activations"]
    assert stages[0]["weights"] > stages[1]["weights"] < stages[-1]["weights"]
    assert abs(out["peak_memory_gb"] - max(s["total"] for s in stages)) < 1e-3
