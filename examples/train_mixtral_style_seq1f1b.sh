#!/bin/bash
# Mixtral-8x7B-style mixture of experts with Seq1F1B on 32 GPUs (4 nodes of 8): PP=4,
# TP=2 with sequence parallelism (megatron-core requires SP for MoE with TP), DP=4 and
# expert parallelism 4 over the data-parallel ranks, 16k-token sequences, 8 sequence
# splits (tools/plan.py, 2026-11-28: s = 4 peaks at 75.9 GB allocated on stage 0 of an
# 80 GB H100, over its usable memory with the allocator's reserve; s = 8 at 65.4 GB;
# TP=1 with EP=8 needs 103 GB). The model flags are Megatron-LM's own Mixtral 8x7B settings
# (examples/mixtral/train_mixtral_8x7b_distributed.sh): 32 layers, hidden 4096, FFN 14336
# per expert, 32 heads with 8 query groups, 8 experts with top-2 softmax routing, the
# auxiliary load-balancing loss (1e-2), the alltoall dispatcher, grouped GEMM, RMSNorm
# (eps 1e-5), RoPE base 1e6, SwiGLU, no biases, untied embeddings, the 32000-token
# vocabulary; the sequence is 16k tokens instead of that recipe's 4k (Seq1F1B's case:
# long sequences), with selective recomputation of core attention.
#
#   TOKENIZER_MODEL=/path/to/Mixtral-8x7B DATA_PATH=/data/corpus_text_document \
#       NNODES=4 NODE_RANK=... MASTER_ADDR=... bash examples/train_mixtral_style_seq1f1b.sh
#   PLAN=1 bash examples/train_mixtral_style_seq1f1b.sh    # memory/bubble/TFLOP/s only
#
# PLAN=1 hands the same flags to tools/plan.py (with --world-size and --gpu $GPU,
# default h100-80g) instead of training. Everything else comes from the environment:
# GPUS_PER_NODE (8), NNODES (4), NODE_RANK (0), MASTER_ADDR, MASTER_PORT, CHECKPOINT_PATH,
# TENSORBOARD_DIR, TRAIN_ITERS, EP (4; it must divide the data-parallel size),
# GLOBAL_BATCH_SIZE (64: 16 microbatches per pipeline and iteration at DP=4).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-4}
SEQ_LENGTH=16384
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/mixtral_style_seq1f1b}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --max-position-embeddings 32768
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --position-embedding-type rope
    --rotary-base 1000000
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model ${TOKENIZER_MODEL:-mistralai/Mixtral-8x7B-v0.1}
    --vocab-size 32000
    --make-vocab-size-divisible-by 128
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm
    --expert-model-parallel-size ${EP:-4}
)
TRAINING_ARGS=(
    --seq-length $SEQ_LENGTH
    --micro-batch-size 1
    --global-batch-size ${GLOBAL_BATCH_SIZE:-64}
    --train-iters ${TRAIN_ITERS:-1000}
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters 50
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --recompute-granularity selective
    --recompute-activations
    --recompute-modules core_attn
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 4
    --use-distributed-optimizer
    --seq1f1b-splits 8
    --seq1f1b-balance-method uniform_comp
)
DATA_AND_LOGGING_ARGS=(
    --data-path ${DATA_PATH:-data/corpus_text_document}
    --split 949,50,1
    --log-interval 1
    --log-throughput
    --eval-interval 500
    --eval-iters 10
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --save-interval 500
    --tensorboard-dir ${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
)
ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_AND_LOGGING_ARGS[@]}")

if [ -n "${PLAN:-}" ]; then
    exec ${PYTHON:-python} tools/plan.py "${ARGS[@]}" --world-size $((GPUS_PER_NODE * NNODES)) \
        --gpu ${GPU:-h100-80g} ${PLAN_ARGS:-}
fi
${TORCHRUN:-torchrun} --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES \
    --node_rank ${NODE_RANK:-0} --master_addr ${MASTER_ADDR:-localhost} \
    --master_port ${MASTER_PORT:-6000} pretrain_gpt.py "${ARGS[@]}"
