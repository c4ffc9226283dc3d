#!/usr/bin/env python
"""Plan a pipeline-parallel training run: memory per stage, bubble, throughput.

Takes a pretrain_gpt.py command line unchanged (its data, logging and checkpoint flags
are accepted and ignored; --bf16/--fp16 set the dtype, fp32 without) plus planner flags
(--gpu, --world-size, --model, --json, ...). Examples:
    python tools/plan.py --model 7B --seq-length 32768 --tensor-model-parallel-size 8 \\
        --pipeline-model-parallel-size 4 --sequence-parallel --global-batch-size 8 --bf16 \\
        --seq1f1b-splits auto --seq1f1b-balance-method uniform_comp
    python tools/plan.py $(cat my_pretrain_flags.txt) --world-size 64 --gpu h100-80g
    python tools/plan.py --num-layers 4 --hidden-size 128 --num-attention-heads 4 \\
        --seq-length 512 --pipeline-model-parallel-size 2 --seq1f1b-splits 4 --gpu cpu --json
See docs/planner.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
