#!/bin/bash
# Qwen3-4B (dense) with Seq1F1B on 8 GPUs: the seed port's setting, PP=8 TP=1 at 16k-token
# sequences, s = 4 sequence splits, with recomputation. 36 layers do not divide into 8
# stages: as in Megatron-LM, --decoder-first/last-pipeline-num-layers give the first and
# last stages 3 layers each and the 6 middle stages 5 each (36 = 3 + 6 x 5 + 3). The first
# stage also holds the embedding and the last the output layer and the loss; tools/plan.py
# finds 3 + 3 the lowest peak memory (a middle stage decides it) with throughput within
# 0.3% of 4 + 2 and 2 + 4. The model
# flags are Megatron-LM's own Qwen3-4B settings (examples/rl/model_configs/qwen3_4b.sh):
# 36 layers, hidden 2560, FFN 9728, 32 heads of 128 channels, GQA with 8 groups, RMSNorm
# (eps 1e-6), QK layernorm, RoPE base 1e6, SwiGLU, no bias, the 151936-token vocabulary,
# embedding and output layer tied (as that recipe and the released 4B model), selective
# recomputation of core attention.
#
#   TOKENIZER_MODEL=/path/to/Qwen3-4B DATA_PATH=/data/corpus_text_document \
#       bash examples/train_qwen3_4b_seq1f1b.sh            # 8 GPUs on this node
#   PLAN=1 bash examples/train_qwen3_4b_seq1f1b.sh           # memory/bubble/TFLOP/s only
#
# PLAN=1 hands the same flags to tools/plan.py (with --world-size and --gpu $GPU,
# default h100-80g) instead of training. Everything else comes from the environment:
# GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR, MASTER_PORT, CHECKPOINT_PATH,
# TENSORBOARD_DIR, TRAIN_ITERS, GLOBAL_BATCH_SIZE (32 microbatches per iteration at DP=1),
# PP (8), FIRST_STAGE_LAYERS and LAST_STAGE_LAYERS (3 and 3; the middle stages share the
# rest evenly, so change them with PP: e.g. PP=4 FIRST_STAGE_LAYERS=9 LAST_STAGE_LAYERS=9),
# SEQ_LENGTH (16384) and CP (1, --context-parallel-size: each of CP ranks runs an equal
# part of every split, so the job takes PP x CP GPUs; e.g. SEQ_LENGTH=32768 CP=2 on 16).
#
# Supervised fine-tuning (Megatron-LM's --sft) instead of pretraining:
#
#   TOKENIZER_MODEL=/path/to/Qwen3-4B SFT_DATA=/data/chat.jsonl \
#       PRETRAINED_CHECKPOINT=checkpoints/qwen3_4b_seq1f1b bash examples/train_qwen3_4b_seq1f1b.sh
#
# SFT_DATA: JSON-lines conversations ({"messages": [{"role", "content"}, ...]} per line),
# written with the tokenizer's own chat template (SFT_PROMPT_FORMAT, default "default";
# the nemotron formats need Nemotron's special tokens), each line's conversations packed
# into one sample; PRETRAINED_CHECKPOINT: the weights to start from (--pretrained-checkpoint
# with --finetune: iteration 0, no optimizer state), while CHECKPOINT_PATH gets the
# fine-tuned ones.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
SEQ_LENGTH=${SEQ_LENGTH:-16384}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen3_4b_seq1f1b}

MODEL_ARGS=(
    --num-layers 36
    --hidden-size 2560
    --ffn-hidden-size 9728
    --num-attention-heads 32
    --kv-channels 128
    --group-query-attention
    --num-query-groups 8
    --max-position-embeddings 40960
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --qk-layernorm
    --position-embedding-type rope
    --rotary-percent 1.0
    --rotary-base 1000000
    --swiglu
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --tokenizer-model ${TOKENIZER_MODEL:-Qwen/Qwen3-4B}
    --vocab-size 151936
    --make-vocab-size-divisible-by 128
)
TRAINING_ARGS=(
    --seq-length $SEQ_LENGTH
    --micro-batch-size 1
    --global-batch-size ${GLOBAL_BATCH_SIZE:-32}
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
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size ${PP:-8}
    --context-parallel-size ${CP:-1}
    --decoder-first-pipeline-num-layers ${FIRST_STAGE_LAYERS:-3}
    --decoder-last-pipeline-num-layers ${LAST_STAGE_LAYERS:-3}
    --use-distributed-optimizer
    --seq1f1b-splits 4
    --seq1f1b-balance-method uniform_comp
)
if [ -n "${SFT_DATA:-}" ]; then
    DATA_ARGS=(
        --sft
        --tokenizer-type SFTTokenizer
        --sft-tokenizer-prompt-format ${SFT_PROMPT_FORMAT:-default}
        --data-path $SFT_DATA
        --split 98,2,0
    )
    if [ -n "${PRETRAINED_CHECKPOINT:-}" ]; then
        DATA_ARGS+=(--pretrained-checkpoint $PRETRAINED_CHECKPOINT --finetune)
    fi
else
    DATA_ARGS=(
        --tokenizer-type HuggingFaceTokenizer
        --data-path ${DATA_PATH:-data/corpus_text_document}
        --split 949,50,1
    )
fi
DATA_AND_LOGGING_ARGS=(
    "${DATA_ARGS[@]}"
    --log-interval 1
    --log-throughput
    --eval-interval 500
    --eval-iters 10
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --save-interval 500
    --tensorboard-dir ${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}
)
ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_AND_LOGGING_ARGS[@]}")

if [ -n "${PLAN:-}" ]; then
    exec ${PYTHON:-python} tools/plan.py "${ARGS[@]}" --world-size $((GPUS_PER_NODE * NNODES)) \
        --gpu ${GPU:-h100-80g} ${PLAN_ARGS:-}
fi
${TORCHRUN:-torchrun} --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES \
    --node_rank ${NODE_RANK:-0} --master_addr ${MASTER_ADDR:-localhost} \
    --master_port ${MASTER_PORT:-6000} pretrain_gpt.py "${ARGS[@]}"
