"""Check JSON-lines conversation files for --sft before a job: records, tokens per record,
records cut at --seq-length, and records the prompt format cannot tokenize.

    python tools/check_sft_data.py --tokenizer-model /path/to/hf_tokenizer \
        --sft-tokenizer-prompt-format default --seq-length 32768 chat.jsonl

See megatron/dataprep/sft_survey.py.
"""

import os
import sys

# Run from a checkout without installing: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.dataprep.sft_survey import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
