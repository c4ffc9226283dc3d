#!/bin/bash
# Megatron-LM's classic examples/pretrain_gpt_distributed_with_mp.sh (the "345M" model
# with tensor and pipeline parallelism), its flags kept. Changed for a 2-process CPU test:
# shapes (layers, hidden, heads, sequence, batch, iterations; TP 2 x PP 2 on 8 GPUs ->
# PP 2), --fp16 dropped (CPU trains in fp32), --distributed-backend nccl -> gloo (no
# GPUs), paths from the environment, and --seq1f1b-splits 2 added.
GPUS_PER_NODE=2
DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes 1 \
    --node_rank 0 \
    --master_addr localhost \
    --master_port $MASTER_PORT
"
GPT_ARGS="
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --num-layers 4 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 128 \
    --max-position-embeddings 128 \
    --micro-batch-size 2 \
    --global-batch-size 4 \
    --lr 0.00015 \
    --train-iters 2 \
    --lr-decay-iters 2 \
    --lr-decay-style cosine \
    --min-lr 1.0e-5 \
    --weight-decay 1e-2 \
    --lr-warmup-fraction .01 \
    --clip-grad 1.0
"
DATA_ARGS="
    --data-path $DATA_PATH \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --split 949,50,1
"
OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --eval-iters 10
"
${TORCHRUN:-torchrun} $DISTRIBUTED_ARGS pretrain_gpt.py \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend gloo \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --seq1f1b-splits 2
