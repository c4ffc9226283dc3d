#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (the April 2026 version,
# before --step-batch-size-schedule, which Megatron-LM itself refuses next to
# --global-batch-size), its flags kept. Changed for a 2-process CPU test: shapes (layers,
# hidden, heads, sequence, batch, iterations, TP 8 x PP 16 -> PP 2), --fp16 dropped (CPU
# trains in fp32), and --seq1f1b-splits 2 added.
GPUS_PER_NODE=2
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes 1 --master_addr localhost --master_port $MASTER_PORT)
GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --attention-backend auto # Can use (flash/fused/unfused/local)
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --train-iters 2
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 2
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
)
DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)
${TORCHRUN:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    --seq1f1b-splits 2
