#!/bin/bash
# Megatron-LM's functional test tests/functional_tests/test_cases/gpt/gpt3_mcore_reruns_resume_check_grads
# (model_config.yaml), its BASE_MODEL_ARGS with MODEL_ARGS_5 (DP 1, TP 1, CP 1, PP 2) as a
# flag list. Changed for a 2-process CPU test:
# * shapes: layers 32 -> 4, hidden 3072 -> 64, FFN 8192 -> 176, heads 32 -> 4, query
#   groups 8 -> 2, kv channels 128 -> 16, sequence 512 -> 128, iterations 1 -> 2;
# * --seq1f1b-splits 2 added (the layout is the original's);
# * hardware: --transformer-impl transformer_engine -> local, --distributed-backend
#   nccl -> gloo, --bf16 dropped (CPU trains in fp32), the NCCL/cuBLAS environment left out;
# * data: the test corpus and its GPT-2 BPE files (paths from the environment); --load
#   keeps its path under $CHECKPOINT_LOAD_PATH, where the test puts no 4B checkpoint.
# Nothing dropped: --rerun-mode validate_results runs megatron-core's rerun engine.
ARGS=(
    --rotary-base 500
    --finetune
    --seed $REPEAT
    --no-load-optim
    --recompute-num-layers 1
    --deterministic-mode
    --train-iters 2
    --eval-iters 0
    --manual-gc
    --use-mcore-models
    --distributed-backend gloo
    --sequence-parallel
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --rotary-percent 1.0
    --max-position-embeddings 4096
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 176
    --num-attention-heads 4
    --num-query-groups 2
    --seq-length 128
    --kv-channels 16
    --group-query-attention
    --normalization RMSNorm
    --swiglu
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --no-create-attention-mask-in-dataloader
    --transformer-impl local
    --disable-bias-linear
    --clip-grad 1.0
    --overlap-grad-reduce
    --overlap-param-gather
    --lr 3e-4
    --lr-warmup-samples 0
    --adam-beta1 0.0
    --adam-beta2 0.0
    --adam-eps 1e-8
    --use-distributed-optimizer
    --split 949,50,1
    --no-gradient-accumulation-fusion
    --save-interval 1
    --override-opt_param-scheduler
    --eval-interval 1000
    --ckpt-format torch_dist
    --async-save
    --use-persistent-ckpt-worker
    --dist-ckpt-strictness log_all
    --dist-ckpt-optim-fully-reshardable
    --save $CHECKPOINT_SAVE_PATH
    --load $CHECKPOINT_LOAD_PATH/model/mcore_gpt/gpt3_4b_pyt/25.03.05_bf16_rerun-enabled_v2
    --data-cache-path $DATA_CACHE_PATH
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --tensorboard-dir $TENSORBOARD_PATH
    --timing-log-level 0
    --log-interval 1
    --log-params-norm
    --log-num-zeros-in-grad
    --log-validation-ppl-to-tensorboard
    --log-timers-to-tensorboard
    --log-memory-to-tensorboard
    --rerun-mode validate_results
    --micro-batch-size 2
    --global-batch-size 2
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --pipeline-model-parallel-size 2
    --seq1f1b-splits 2
)
${TORCHRUN:-torchrun} --nproc_per_node 2 --nnodes 1 --master_addr localhost \
    --master_port $MASTER_PORT pretrain_gpt.py "${ARGS[@]}"
