"""Pretrain GPT on megatron-core, with Seq1F1B sequence-split pipelining.

    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \\
        --micro-batch-size 1 --global-batch-size 8 --train-iters 20 \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --seq1f1b-splits 4

Same flags as Megatron-LM's pretrain_gpt.py (see README); runs on CUDA GPUs over
NCCL and on CPUs over gloo.
"""

import warnings

if __name__ == "__main__":
    # flag mistakes first, before torch, megatron-core and the model code load (those
    # imports take seconds to a minute on every rank of a busy node)
    from megatron.trainer.arguments import check_flags_early

    check_flags_early()

# megatron-core warns, at import and when building layers, that the optional GPU
# libraries (Apex, Transformer Engine) are missing; on a CPU machine that is expected,
# and a flag mistake's one-line error should not sit under a dozen of these lines.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed",
                        category=UserWarning)

from megatron.trainer.gpt import (  # noqa: E402,F401 - the providers, as Megatron-LM's names
    datasets_provider,
    forward_step,
    get_batch,
    loss_func,
    model_provider,
)
from megatron.trainer.training import pretrain  # noqa: E402


if __name__ == "__main__":
    from megatron.trainer.initialize import destroy_default_group

    try:
        pretrain(datasets_provider, model_provider, forward_step)
    finally:
        destroy_default_group()
