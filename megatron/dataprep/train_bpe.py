"""Train a GPT-2-format byte-level BPE (`vocab.json` + `merges.txt`) with HF `tokenizers`.

The files have GPT-2's layout: the 256 byte symbols and the merges, then
`<|endoftext|>` as the last id, so `build_tokenizer("GPT2BPETokenizer", ...)` loads them
exactly as it loads GPT-2's own.
"""

import json
import os
import tempfile
from typing import Iterable, Tuple

from megatron.dataprep.names import GPT2_EOD_TOKEN


def train_gpt2_bpe(texts: Iterable[str], vocab_size: int, output_dir: str,
                   min_frequency: int = 2) -> Tuple[str, str]:
    """Returns (vocab.json path, merges.txt path). vocab_size counts <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(byte_alphabet) + 1:
        raise ValueError(f"--vocab-size: at least {len(byte_alphabet) + 1} "
                         f"(256 byte symbols + {GPT2_EOD_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the last id is kept for <|endoftext|>
        min_frequency=min_frequency,
        initial_alphabet=byte_alphabet,  # every byte encodable, whatever the corpus
        special_tokens=[],  # the trainer would put them first; GPT-2 has its eod last
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)

    with tempfile.TemporaryDirectory(dir=output_dir) as tmp:
        tokenizer.model.save(tmp)
        with open(os.path.join(tmp, "vocab.json"), encoding="utf-8") as f:
            vocab = json.load(f)
        with open(os.path.join(tmp, "merges.txt"), encoding="utf-8") as f:
            merges = f.read()
    vocab[GPT2_EOD_TOKEN] = len(vocab)

    vocab_path = os.path.join(output_dir, "vocab.json")
    merges_path = os.path.join(output_dir, "merges.txt")
    ordered = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    _write_atomic(vocab_path, json.dumps(ordered, ensure_ascii=False))
    _write_atomic(merges_path, merges)
    return vocab_path, merges_path


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
