"""--full-validation, --multiple-validation-sets and --validation-set-names as in
Megatron-LM, with every validation sequence counted once.

Every run trains 3 iterations on corpus A and evaluates at iteration 2 and after
training. The reference reads validation set A whole in steps of one sequence (no
padding); a step of 4 sequences leaves the last step short (A has a number of sequences
that 4 does not divide), filled with loss-free padding: Seq1F1B (pp 2, 2 splits) and
dp 2 must print the reference's validation losses. With
--multiple-validation-sets over A and B, each named set prints the loss a run with that
set alone prints.
"""

import math

import pytest
import torch

from distributed import TINY_MODEL, Plan, assert_close_series, init_run
from megatron.dataprep.gpt_datasets import build_gpt_datasets
from megatron.dataprep.tokenizer import build_tokenizer
from megatron.trainer.validation_sets import PaddedToBatches
from packed_documents import write_document_corpus

pytestmark = pytest.mark.distributed  # starts processes (tests/conftest.py)

MODEL = [f for f in TINY_MODEL if f != "--mock-data"] + [
    "--micro-batch-size", "1", "--global-batch-size", "4"]
BASE = MODEL + ["--train-iters", "3", "--eval-interval", "2", "--full-validation"]
PP2_S2 = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]
STEP_OF_ONE = ["--eval-micro-batch-size", "1", "--eval-global-batch-size", "1"]


def plan(tmp, corpus):
    other = str(tmp / "corpus_b")
    write_document_corpus(other, vocab_size=200, seed=8)

    # every layout starts from one set of weights
    init, load = init_run("init", tmp / "init_ckpt", MODEL + ["--train-data-path", corpus])

    def run(name, valid, extra=()):
        return {"name": name, "argv": BASE + load + ["--train-data-path", corpus,
                                                     "--valid-data-path", *valid, *extra]}

    return Plan([init], {
        1: [run("reference", [corpus], STEP_OF_ONE),
            run("b_alone", [other])],
        2: [run("pp2_s2", [corpus], PP2_S2),
            run("dp2", [corpus]),
            run("two_sets", [corpus, other], PP2_S2 + [
                "--multiple-validation-sets", "--validation-set-names", "A", "B"])],
    })


@pytest.fixture(scope="module")
def runs(exactness_runs):
    return exactness_runs[__name__]


def _validation_set_size(corpus):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=200)
    valid = build_gpt_datasets(None, None, 48, 1234, tokenizer, [1, None, 0],
                               data_path_per_split=[[corpus], [corpus], None])[1]
    return len(valid)


def test_the_last_step_is_short(tmp_path_factory):
    """The padded runs' last step really is short: A's size is not a multiple of 4."""
    corpus = str(tmp_path_factory.getbasetemp() / "size_check")
    write_document_corpus(corpus, vocab_size=200)  # the shared corpus: the same rows
    assert _validation_set_size(corpus) % 4 != 0


@pytest.mark.parametrize("name", ["pp2_s2", "dp2"])
def test_whole_set_in_padded_steps_equals_steps_of_one(runs, name):
    reference, run = runs["reference"], runs[name]
    assert len(reference["validation_losses"]) == 1  # iteration 2; the final one apart
    assert_close_series(run["losses"], reference["losses"], 1e-5, f"{name} loss")
    assert_close_series(run["validation_losses"], reference["validation_losses"], 1e-6,
                        f"{name} validation loss")
    assert run["final_validation_loss"] == pytest.approx(reference["final_validation_loss"],
                                                         rel=1e-6)


def test_each_named_set_is_evaluated_alone(runs):
    two = runs["two_sets"]
    assert two["validation_losses"] == [] and two["final_validation_loss"] is None
    (at_2,) = two["validation_losses_by_set"]
    assert set(at_2) == {"-A", "-B"}
    assert at_2["-A"] == pytest.approx(runs["reference"]["validation_losses"][0], rel=1e-6)
    assert at_2["-B"] == pytest.approx(runs["b_alone"]["validation_losses"][0], rel=1e-6)
    assert two["final_validation_losses"]["-B"] == pytest.approx(
        runs["b_alone"]["final_validation_loss"], rel=1e-6)
    assert at_2["-A"] != pytest.approx(at_2["-B"], rel=1e-4)  # two different sets


def test_set_suffixes_as_megatron_lm():
    """'' for one set; '-NAME', or the set's index without names."""
    from types import SimpleNamespace

    from megatron.trainer.validation_sets import suffixes

    one = SimpleNamespace(multiple_validation_sets=False, validation_set_names=None)
    unnamed = SimpleNamespace(multiple_validation_sets=True, validation_set_names=None)
    named = SimpleNamespace(multiple_validation_sets=True, validation_set_names=["web", "code"])
    assert (suffixes(one, 1), suffixes(unnamed, 2), suffixes(named, 2)) == (
        [""], ["-0", "-1"], ["-web", "-code"])


def test_padding_carries_no_loss():
    data = [{"tokens": torch.tensor([i]), "loss_mask": torch.tensor([1.0])} for i in range(5)]
    padded = PaddedToBatches(data, 4)
    assert len(padded) == 8 == math.ceil(5 / 4) * 4
    assert [int(padded[i]["tokens"]) for i in range(8)] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert [float(padded[i]["loss_mask"]) for i in range(8)] == [1] * 5 + [0] * 3
    assert float(data[0]["loss_mask"]) == 1  # the dataset's own sample is untouched
    with pytest.raises(IndexError):
        padded[8]
    with pytest.raises(ValueError, match="empty"):
        PaddedToBatches([], 4)


def test_each_set_has_its_tensorboard_keys():
    """Megatron-LM's keys: 'lm loss validation-NAME' (and its ppl, vs samples)."""
    from types import SimpleNamespace

    from megatron.trainer.monitoring import Monitor

    added = []
    monitor = SimpleNamespace(
        args=SimpleNamespace(log_validation_ppl_to_tensorboard=True),
        writers=SimpleNamespace(add=lambda key, value, step, to_wandb=True:
                                added.append((key, step))))
    ppl = Monitor.log_validation(monitor, 2.0, 3, 96, "-code")
    assert ppl == pytest.approx(math.exp(2.0))
    assert added == [("lm loss validation-code", 3), ("lm loss validation-code vs samples", 96),
                     ("lm loss validation-code ppl", 3),
                     ("lm loss validation-code ppl vs samples", 96)]
