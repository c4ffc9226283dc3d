"""Tokenize JSON lines (or a saved HF dataset) into megatron-core `.bin/.idx` files.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys content \
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 2

Writes data/corpus_content_document.bin/.idx. See megatron/dataprep/preprocess.py.
"""

import os
import sys

# Run from a checkout without installing: put the repository root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.dataprep.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
