"""``tools/check_sft_data.py``: what ``--sft`` will make of conversation files, before a
job starts.

Training reads a record only when its sample comes up, so a record whose turns the
tokenizer merges across (it cannot be masked by turn) stops a run hours in, and records
longer than ``--seq-length`` are cut without the run knowing how many there are. This
reads every record of the files with the same code the trainer runs
(``ConversationFile``, ``SFTTokenizer``, ``pack_conversations``) and reports, per file:
records and blank lines, conversations, tokens per record, the share of tokens trained
on, the records cut and conversations left out at this sequence length, and every
record that cannot be tokenized (by line: the run would stop there). Exit status 1 when
any record cannot be tokenized, 2 on a usage or file error, else 0.

    python tools/check_sft_data.py --tokenizer-model /path/to/hf_tokenizer \\
        --sft-tokenizer-prompt-format default --seq-length 32768 chat.jsonl
"""

import argparse
import sys
from dataclasses import dataclass, field
from typing import List

import numpy

from megatron.dataprep.names import SFT_PROMPT_FORMATS

PROG = "check_sft_data.py"
LISTED = 10  # records that cannot be tokenized, listed by line


@dataclass
class FileSurvey:
    path: str
    records: int = 0
    blank_lines: int = 0
    conversations: int = 0
    record_tokens: List[int] = field(default_factory=list)
    trained_tokens: int = 0  # in the samples as packed (after cuts, padding excluded)
    sample_tokens: int = 0
    records_cut: int = 0
    conversations_left_out: int = 0
    failures: List[str] = field(default_factory=list)  # "line N: why"
    failed: int = 0


def survey_file(path, tokenizer, seq_length, context_parallel=1) -> FileSurvey:
    """Every record of ``path`` tokenized and packed as the trainer's SFTDataset does."""
    from megatron.dataprep.sft_dataset import (ConversationFile, pack_conversations,
                                               tokenize_record)
    from megatron.dataprep.sft_tokenizer import conversations_of

    records = ConversationFile(path, quiet=True)
    found = FileSurvey(path, records=len(records), blank_lines=records.blank_lines)
    for index in range(len(records)):
        found.conversations += len(conversations_of(records[index]))
        try:
            pieces = tokenize_record(tokenizer, records[index])
        except ValueError as error:
            found.failed += 1
            if len(found.failures) < LISTED:
                found.failures.append(f"line {records.line_of(index)}: {error}")
            continue
        found.record_tokens.append(sum(len(tokens) for tokens, _ in pieces))
        sample, cut, left_out = pack_conversations(pieces, seq_length, tokenizer.pad,
                                                   context_parallel)
        found.records_cut += cut
        found.conversations_left_out += left_out
        found.trained_tokens += int(sample["loss_mask"].sum())
        found.sample_tokens += seq_length
    return found


def report(found: FileSurvey, seq_length: int) -> List[str]:
    lines = [f"{found.path}: {found.records} records ({found.blank_lines} blank lines "
             f"skipped), {found.conversations} conversations"]
    if found.record_tokens:
        tokens = numpy.asarray(found.record_tokens)
        lines.append(
            f"  tokens per record: mean {tokens.mean():.0f}, median {numpy.median(tokens):.0f},"
            f" 99th percentile {numpy.percentile(tokens, 99):.0f}, max {tokens.max()}")
        lines.append(
            f"  at --seq-length {seq_length}: {found.records_cut} records cut on the right "
            f"({100 * found.records_cut / len(tokens):.1f}%), "
            f"{found.conversations_left_out} conversations left out after a cut; "
            f"{100 * found.trained_tokens / max(found.sample_tokens, 1):.1f}% of the samples' "
            f"tokens trained on")
    if found.failed:
        lines.append(f"  {found.failed} records cannot be tokenized in this prompt format "
                     f"(training stops at the first one it reads):")
        lines += [f"    {failure}" for failure in found.failures]
        if found.failed > len(found.failures):
            lines.append(f"    ... and {found.failed - len(found.failures)} more")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="JSON-lines conversation files")
    parser.add_argument("--tokenizer-model", required=True,
                        help="the Hugging Face tokenizer directory (as for --tokenizer-type "
                             "SFTTokenizer)")
    parser.add_argument("--sft-tokenizer-prompt-format", choices=SFT_PROMPT_FORMATS,
                        default="nemotron-h-aligned")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="pads each conversation to a multiple of 2 x CP, as training does")
    args = parser.parse_args(argv)
    from megatron.dataprep.sft_dataset import ConversationFileError
    from megatron.dataprep.sft_tokenizer import SFTTokenizer
    from megatron.dataprep.tokenizer import TokenizerError

    if args.seq_length < 1 or args.context_parallel_size < 1:
        print(f"{PROG}: error: --seq-length and --context-parallel-size must be >= 1",
              file=sys.stderr)
        return 2
    try:
        tokenizer = SFTTokenizer(args.tokenizer_model, args.sft_tokenizer_prompt_format)
        surveys = [survey_file(path, tokenizer, args.seq_length, args.context_parallel_size)
                   for path in args.files]
    except (TokenizerError, ConversationFileError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    for found in surveys:
        print("\n".join(report(found, args.seq_length)))
    return 1 if any(found.failed for found in surveys) else 0
