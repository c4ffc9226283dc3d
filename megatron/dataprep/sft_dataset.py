"""Megatron-LM's SFT data (``--sft``): JSON-lines conversation files packed into samples.

Each line of a ``--data-path`` file is ``{"messages": [{"role": ..., "content": ...}, ...]}``;
a line may hold several conversations, each starting with a system message. A sample is
one line (``ConversationFile``), its conversations tokenized in the prompt format of the
SFTTokenizer and packed one after the other (``pack_conversations``), as Megatron-LM's
SFTDataset packs them:

* positions restart at 0 with each conversation, and attention stays within it (the
  document attention of --reset-attention-mask, from ``document_ids``);
* under context parallelism each conversation is padded to a multiple of 2 x CP tokens;
* a line longer than ``--seq-length`` + 1 tokens is cut on the right, and its
  conversations after the cut are left out; a shorter one is padded at the end, the
  padding belonging to the last conversation (positions running on);
* the loss trains on the targets the prompt format keeps (the assistant turns in the
  nemotron formats), never on padding nor on any target equal to the pad token.

Samples take the lines of their split in file order, from the first again once all were
used (no shuffling, as Megatron-LM's). Every line is checked when the file is indexed,
before training: a line that is not such a record stops the run naming the file and the
line. Blank lines are skipped and counted. Conversations cut or left out by the packing
are counted per process and reported on rank 0 (``PackingReport``).
"""

import json
import os
from typing import List, Optional, Sequence

import numpy
import torch
from megatron.core.datasets.megatron_dataset import MegatronDataset

from megatron.dataprep.sample_documents import ids_and_positions
from megatron.dataprep.sft_tokenizer import IGNORE_INDEX, ROLES, conversations_of

class ConversationFileError(ValueError):
    """A conversation file cannot be read as SFT data."""


def check_record(record, where: str) -> None:
    """ConversationFileError naming ``where`` (file and line) and what is wrong, unless
    ``record`` (one decoded line) is an SFT record."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ConversationFileError(
            f"{where}: not an SFT record: each line must be a JSON object with a non-empty "
            f"'messages' list of {{\"role\": ..., \"content\": ...}}")
    previous = None
    for number, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise ConversationFileError(
                f"{where}: message {number} is {json.dumps(message)[:120]}; each message "
                f"needs a role ({', '.join(ROLES)}) and a text content")
        if role == "assistant" and not content:
            raise ConversationFileError(f"{where}: message {number} is an empty assistant turn")
        if role == "assistant" and previous not in ("user", "tool"):
            raise ConversationFileError(
                f"{where}: message {number} is an assistant turn after "
                f"{'nothing' if previous is None else 'a ' + previous + ' turn'}; an "
                f"assistant answers a user or tool turn")
        previous = role


class ConversationFile:
    """The records of one JSON-lines file, indexed by line and checked once; a record is
    read from the file when asked for (``os.pread``: safe in data-loader workers).
    Blank lines are skipped, and counted in a note on rank 0 unless ``quiet``."""

    def __init__(self, path: str, quiet: bool = False):
        if not os.path.isfile(path):
            raise ConversationFileError(
                f"--data-path: {path} does not exist (with --sft, --data-path names JSON-lines "
                f"conversation files, e.g. data/chat.jsonl)")
        self.path = path
        self.blank_lines = 0
        starts, lengths, line_numbers = [], [], []
        with open(path, "rb") as stream:
            offset, number = 0, 0
            for line in stream:
                number += 1
                text = line.strip()
                if not text:
                    self.blank_lines += 1
                else:
                    check_record(self._decode(text, number), f"{path} line {number}")
                    starts.append(offset)
                    lengths.append(len(line))
                    line_numbers.append(number)
                offset += len(line)
        if not starts:
            raise ConversationFileError(f"--data-path: {path} holds no conversation")
        if self.blank_lines and not quiet and _global_rank() == 0:
            print(f"note: --sft: {path}: {self.blank_lines} blank line(s) skipped", flush=True)
        self.starts = numpy.asarray(starts, dtype=numpy.int64)
        self.lengths = numpy.asarray(lengths, dtype=numpy.int64)
        self.line_numbers = numpy.asarray(line_numbers, dtype=numpy.int64)
        self._fd, self._pid = None, None

    def _decode(self, text: bytes, number: int):
        try:
            return json.loads(text)
        except ValueError as error:
            raise ConversationFileError(f"{self.path} line {number}: not JSON ({error})") from None

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> List[dict]:
        if self._pid != os.getpid():  # a forked data-loader worker opens its own
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        raw = os.pread(self._fd, int(self.lengths[index]), int(self.starts[index]))
        return json.loads(raw)["messages"]

    def line_of(self, index: int) -> int:
        """The 1-based line number of record ``index``."""
        return int(self.line_numbers[index])


def count_records(path: str) -> int:
    """How many conversation records (non-blank lines) a file holds, without decoding."""
    count = 0
    with open(path, "rb") as stream:
        for line in stream:
            count += bool(line.strip())
    return count


class PackingReport:
    """Conversations cut or left out by the packing, counted in this process; rank 0
    prints the first and then every tenfold count, so the log says how much was lost."""

    def __init__(self):
        self.samples = self.cut = self.left_out = 0
        self._next_report = 1

    def add(self, cut: int, left_out: int, where: str, seq_length: int):
        """One sample's counts; ``where`` names its record."""
        self.samples += 1
        self.cut += cut
        self.left_out += left_out
        if cut and self.cut >= self._next_report:
            self._next_report = self.cut * 10
            if _global_rank() == 0:
                print(f"warning: --sft: {where} is longer than --seq-length {seq_length} + 1 "
                      f"tokens and was cut on the right (as Megatron-LM does); so far on rank "
                      f"0: {self.cut} conversation(s) cut and {self.left_out} left out after a "
                      f"cut, in {self.samples} sample(s)", flush=True)


def _global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))  # a data-loader worker has no process group


def tokenize_record(tokenizer, messages):
    """[(tokens, targets)] of each conversation of one record's messages (ValueError
    naming the conversation, when the record holds several, and the turn)."""
    conversations = conversations_of(messages)
    pieces = []
    for number, conversation in enumerate(conversations):
        try:
            pieces.append(tokenizer.tokenize_conversation(conversation))
        except ValueError as error:
            where = f"conversation {number}, " if len(conversations) > 1 else ""
            raise ValueError(f"{where}{error}") from None
    return pieces


def pack_conversations(pieces: Sequence, seq_length: int, pad: int, context_parallel: int = 1):
    """Megatron-LM's packing of one record's tokenized conversations ``pieces`` [(tokens,
    targets)] into a sample of ``seq_length`` tokens: (sample dict, conversations cut,
    conversations left out)."""
    tokens, targets, lengths = [], [], []
    granule = 2 * context_parallel if context_parallel > 1 else 1
    cut = left_out = 0
    for number, (conversation, conversation_targets) in enumerate(pieces):
        tokens.extend(int(t) for t in conversation)
        targets.extend(int(t) for t in conversation_targets)
        length = len(conversation)
        padding = -len(tokens) % granule
        tokens.extend([pad] * padding)
        targets.extend([pad] * padding)
        lengths.append(length + padding)
        if len(tokens) >= seq_length + 1:  # cut on the right (one more token: the labels)
            tokens, targets = tokens[:seq_length] + [pad], targets[:seq_length] + [pad]
            lengths[-1] -= sum(lengths) - seq_length
            cut, left_out = 1, len(pieces) - number - 1
            break
    shortfall = seq_length + 1 - len(tokens)
    if shortfall > 0:  # padding joins the last conversation
        tokens.extend([pad] * shortfall)
        targets.extend([pad] * shortfall)
        lengths[-1] += shortfall - 1
    # shifted by one: token i predicts target i + 1
    labels = torch.tensor(targets[1:], dtype=torch.int64)
    loss_mask = ((labels != pad) & (labels != IGNORE_INDEX)).to(torch.float32)
    # a masked label is still the next token, so that every label is a vocabulary id
    labels = torch.where(labels == IGNORE_INDEX, torch.tensor(tokens[1:]), labels)
    document_ids, positions = ids_and_positions(lengths)
    sample = {"tokens": torch.tensor(tokens[:-1], dtype=torch.int64), "labels": labels,
              "loss_mask": loss_mask, "position_ids": positions, "document_ids": document_ids}
    return sample, cut, left_out


class SFTDataset(MegatronDataset):
    """Samples of the conversation files of one split, in order (Megatron-LM's
    SFTDataset); the config carries the SFTTokenizer, the sequence length and the
    context-parallel size (the padding granule)."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path, config):
        return ConversationFile(dataset_path)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.report = PackingReport()

    def __len__(self) -> int:
        # None: one pass over the split (Megatron-LM's --full-validation)
        return len(self.indices) if self.num_samples is None else self.num_samples

    def __getitem__(self, idx: Optional[int]):
        config = self.config
        record = int(self.indices[(0 if idx is None else idx) % len(self.indices)])
        where = f"{self.dataset.path} line {self.dataset.line_of(record)}"
        tokenizer = config.tokenizer
        try:
            pieces = tokenize_record(tokenizer, self.dataset[record])
        except ValueError as error:
            raise ConversationFileError(f"{where}: {error}") from None
        sample, cut, left_out = pack_conversations(
            pieces, config.sequence_length, tokenizer.pad, config.context_parallel_size or 1)
        if idx is None:  # a padding sample: nothing trains on it
            sample["loss_mask"].zero_()
        else:
            self.report.add(cut, left_out, where, config.sequence_length)
        return sample
