"""--dataloader-inter-document-masking (as Megatron-LM 0.19): each sample's documents come
from the dataset's packing, not from end-of-document tokens; attention stays within each
(the document attention of --reset-attention-mask) and positions restart at each.

On data whose documents end with EOD (preprocessed with --append-eod) the documents and
positions are the ones --reset-attention-mask --reset-position-ids read from the EODs
(megatron-core's own reset positions); without EODs the documents are still found, where
the EOD-based flags see one document per sample. Trained at pp 2 with Seq1F1B splits, a run
equals one process; on EOD-terminated data it equals the EOD-based flags' run."""

import numpy
import pytest
import torch

from distributed import TINY_MODEL, assert_close_series, init_run, run_configs
from megatron.dataprep.gpt_datasets import build_gpt_datasets
from megatron.dataprep.sample_documents import ids_and_positions
from megatron.dataprep.tokenizer import build_tokenizer
from megatron.seqsplit.documents import document_ids

VOCAB, SEQ = 200, 48  # TINY_MODEL's
EOD = VOCAB - 1  # the NullTokenizer's (Megatron-LM 0.18+): its last id


def write_documents(prefix, with_eod, count=80, seed=3):
    """`count` documents of 1-40 tokens, each its own entry of `prefix.bin/.idx`: random
    tokens ending with EOD, or (without) one token value per document, never the EOD,
    differing from its neighbours' (so a document edge is where the value changes)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for k in range(count):
        length = int(rng.integers(1, 41))
        if with_eod:
            tokens = rng.integers(0, EOD, size=length).astype(numpy.int32)
            tokens[-1] = EOD
        else:
            tokens = numpy.full(length, k % EOD, dtype=numpy.int32)
        builder.add_document(tokens, [length])
    builder.finalize(prefix + ".idx")
    return prefix


def samples(prefix, **flags):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    train = build_gpt_datasets([prefix], "100,0,0", SEQ, 1234, tokenizer, [40, 0, 0],
                               **flags)[0]
    return [train[i] for i in range(len(train))]


def test_ids_and_positions_of_piece_lengths():
    ids, positions = ids_and_positions([3, 1, 2])
    assert ids.tolist() == [0, 0, 0, 1, 2, 2] and ids.dtype == torch.int32
    assert positions.tolist() == [0, 1, 2, 0, 0, 1]


def test_eod_terminated_documents_are_the_eod_ones(tmp_path):
    prefix = write_documents(str(tmp_path / "eod"), with_eod=True)
    by_packing = samples(prefix, sample_documents=True)
    by_eod = samples(prefix, reset_position_ids=True, reset_attention_mask=True)
    boundaries = 0
    for mine, theirs in zip(by_packing, by_eod, strict=True):
        assert torch.equal(torch.as_tensor(mine["tokens"]), torch.as_tensor(theirs["tokens"]))
        ids = mine["document_ids"]
        assert torch.equal(ids, document_ids(torch.as_tensor(mine["tokens"]), EOD))
        # megatron-core's positions reset after each EOD
        assert torch.equal(mine["position_ids"], torch.as_tensor(theirs["position_ids"]))
        boundaries += int(ids[-1])
    assert boundaries > 40  # many documents per sample


def test_documents_without_eod_are_found(tmp_path):
    prefix = write_documents(str(tmp_path / "plain"), with_eod=False)
    for sample in samples(prefix, sample_documents=True):
        tokens, ids = torch.as_tensor(sample["tokens"]), sample["document_ids"]
        assert torch.equal(ids[1:] != ids[:-1], tokens[1:] != tokens[:-1])
        starts = torch.cat([torch.tensor([True]), ids[1:] != ids[:-1]])
        assert torch.equal(sample["position_ids"] == 0, starts)


@pytest.mark.distributed
def test_split_runs_equal_one_process_and_the_eod_flags(tmp_path):
    eod = write_documents(str(tmp_path / "eod"), with_eod=True)
    plain = write_documents(str(tmp_path / "plain"), with_eod=False)

    def model(prefix):
        return [a for a in TINY_MODEL if a != "--mock-data"] + [
            "--data-path", prefix, "--split", "100,0,0", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--train-iters", "3"]

    packing, by_eod = ["--dataloader-inter-document-masking"], [
        "--reset-attention-mask", "--reset-position-ids"]
    init, start = init_run("init", tmp_path / "init", model(eod))
    split = ["--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "2"]
    runs = run_configs(tmp_path, 1, [init] + [
        {"name": f"{data}_{name}_one", "argv": model(prefix) + start + flags}
        for data, prefix in (("eod", eod), ("plain", plain))
        for name, flags in (("packing", packing), ("by_eod", by_eod))])
    runs.update(run_configs(tmp_path, 2, [
        {"name": f"{data}_packing_split", "argv": model(prefix) + start + packing + split}
        for data, prefix in (("eod", eod), ("plain", plain))]))
    for data in ("eod", "plain"):
        one = runs[f"{data}_packing_one"]["losses"]
        assert len(one) == 3
        assert_close_series(runs[f"{data}_packing_split"]["losses"], one, 1e-5, data)
    assert_close_series(runs["eod_by_eod_one"]["losses"], runs["eod_packing_one"]["losses"],
                        1e-6, "EOD-terminated documents")
    # without EODs the EOD-based flags attend across documents and count positions on
    plain, no_eod = runs["plain_packing_one"]["losses"], runs["plain_by_eod_one"]["losses"]
    assert abs(plain[0] - no_eod[0]) > 1e-3 * no_eod[0]
