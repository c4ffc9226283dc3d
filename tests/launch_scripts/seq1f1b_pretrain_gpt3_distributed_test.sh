#!/bin/bash
# The original Seq1F1B repository's functional test
# tests/functional_tests/test_scripts/gpt3/pretrain_gpt3_distributed_test.sh (thunlp/Seq1F1B,
# Megatron-LM's of 2023), its arguments and flags kept. Its Seq1F1B flags come through
# its own ADDITIONAL_PARAMS argument (--pipe-sp-splits 2 --pipe-sp-strategy ...). Changed
# for a 2-process CPU test:
# * shapes: layers 12 -> 4, hidden 512 -> 64, heads 8 -> 4, sequence 1024 -> 128,
#   --eval-iters 10 -> 1; 8 -> 2 processes per node;
# * hardware: the precision flag (--fp16 / --bf16) dropped (CPU trains in fp32),
#   --distributed-backend nccl -> gloo, torchrun is $TORCHRUN on $MASTER_PORT;
# * data: the GPT-2 vocabulary and merges from $VOCAB_FILE / $MERGE_FILE instead of
#   /workspace/data/gpt3_data/; USE_CORE=1's pretrain_gpt_core.py does not exist here
#   (pretrain_gpt.py runs megatron-core models always).
set -x

DATA_PATH=$1
CHECKPOINT_PATH=$2
TENSORBOARD_DIR=$3
USE_TE=$4
TP_SIZE=$5
PP_SIZE=$6
NNODES=$7
MAX_STEPS=$8
USE_CORE=$9
VP_SIZE=${10}
MBS=${11}
GBS=${12}
ADDITIONAL_PARAMS=${13}
GPUS_PER_NODE=2
export CUDA_DEVICE_MAX_CONNECTIONS=1

TRANSFORMER_IMPL=local
if [[ $USE_TE -eq 1 ]]; then
       TRANSFORMER_IMPL=transformer_engine
fi

DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --master_port $MASTER_PORT"

${TORCHRUN:-torchrun} $DISTRIBUTED_ARGS \
       pretrain_gpt.py \
       --num-layers 4 \
       --hidden-size 64 \
       --num-attention-heads 4 \
       --log-params-norm \
       --log-num-zeros-in-grad \
       --log-validation-ppl-to-tensorboard \
       --log-timers-to-tensorboard \
       --tensorboard-dir ${TENSORBOARD_DIR} \
       --micro-batch-size ${MBS:-4} \
       --global-batch-size ${GBS:-32} \
       --seq-length 128 \
       --max-position-embeddings 128 \
       --train-iters $MAX_STEPS \
       --timing-log-level 2 \
       --lr-decay-iters 320000 \
       --save $CHECKPOINT_PATH \
       --load $CHECKPOINT_PATH \
       --data-path $DATA_PATH \
       --vocab-file $VOCAB_FILE \
       --merge-file $MERGE_FILE \
       --data-impl mmap \
       --split 949,50,1 \
       --distributed-backend gloo \
       --lr 0.00015 \
       --lr-decay-style cosine \
       --min-lr 1.0e-5 \
       --weight-decay 1e-2 \
       --clip-grad 1.0 \
       --lr-warmup-fraction .01 \
       --log-interval 1 \
       --save-interval 10000 \
       --eval-interval 1000 \
       --eval-iters 1 \
       --transformer-impl $TRANSFORMER_IMPL \
       --tensor-model-parallel-size $TP_SIZE \
       --pipeline-model-parallel-size $PP_SIZE \
       ${VP_SIZE:+--num-layers-per-virtual-pipeline-stage "$VP_SIZE"} \
       ${ADDITIONAL_PARAMS:+$ADDITIONAL_PARAMS} \
       --no-gradient-accumulation-fusion
