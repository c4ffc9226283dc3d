#!/usr/bin/env python
"""Plan a pipeline-parallel training run: memory per stage, bubble, throughput.

Examples:
    python tools/plan.py --model 7B --seq-length 32768 --tensor-model-parallel-size 8 \\
        --pipeline-model-parallel-size 4 --sequence-parallel --global-batch-size 8 \\
        --schedule seq1f1b --seq1f1b-splits auto --seq1f1b-balance-method uniform_comp
    python tools/plan.py --model 2.7B --seq-length 16384 --pipeline-model-parallel-size 8 \\
        --global-batch-size 16 --schedule 1f1b --json
See docs/planner.md.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
