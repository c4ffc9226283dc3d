#!/bin/bash
# The original Seq1F1B repository's run.sh (thunlp/Seq1F1B, 2024), as its users launch
# it: every flag kept. Changed for a 2-process CPU test: the shapes come from the
# environment as in the original (set by tests/test_megatron_launch.py), --bf16 is
# dropped (CPU trains in fp32), torchrun is $TORCHRUN, and the recompute test has the
# space the original's `[ $RECOMPUTE -eq 1]` lacks.
DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $WORLD_SIZE --rdzv_id=1 --rdzv_backend=c10d --rdzv_endpoint=${MASTER_ADDR}:${MASTER_PORT} --max_restarts=0"
if [ "$VPP_SIZE" == 1 ]; then
    VPP_STR=""
else
    VPP_STR="--num-layers-per-virtual-pipeline-stage $NUM_LAYERS_PER_VSTAGE"
fi
options=" \
    --tensor-model-parallel-size $TP_SIZE \
    --timing-log-level 2 \
    --pipe-sp-strategy ${PP_SP_STR} \
    --pipe-sp-splits ${PP_SP} \
    --pipeline-model-parallel-size $PP_SIZE \
    --num-layers ${NUM_LAYERS} \
    --hidden-size ${HIDDEN} \
    --num-attention-heads ${NUM_ATTN_HEADS} \
    --seq-length ${SEQ_LENGTH} \
    --max-position-embeddings ${SEQ_LENGTH} \
    --micro-batch-size ${MICRO_BATCH} \
    --global-batch-size ${GLOBAL_BATCH} \
    --lr 6.0e-5 \
    --min-lr 6.0e-6 \
    --lr-decay-style cosine \
    --train-iters ${TRAIN_ITER} \
    --log-interval 1 \
    --eval-iters 0 \
    --eval-interval 1000 \
    --use-flash-attn \
    --data-path $DATA_PATH/data/codeparrot_content_document \
    --vocab-file $DATA_PATH/data/vocab.json \
    --merge-file $DATA_PATH/data/merges.txt \
    --initial-loss-scale 65536 \
    --save-interval 1000 \
    --split 98,2,0 \
    --clip-grad 1.0 \
    --weight-decay 0.1 \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --init-method-std 0.006 \
    --position-embedding-type rope \
    --untie-embeddings-and-output-weights \
    --use-distributed-optimizer \
    --hidden-dropout 0 \
    --attention-dropout 0 \
    --sequence-parallel \
    --no-async-tensor-model-parallel-allreduce \
    $VPP_STR"
if [ "$PROFILE" = "true" ]; then
    options="${options} --profile --profile-step-start 3 --profile-step-end 5 --profile-ranks 0"
fi
if [ "$RECOMPUTE" -eq 1 ]; then
    options="${options} --recompute-method uniform --recompute-granularity full"
fi
run_cmd="${TORCHRUN:-torchrun} $DISTRIBUTED_ARGS pretrain_gpt.py ${options}"
echo $run_cmd
$run_cmd
