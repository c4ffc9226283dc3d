#!/bin/bash
# Megatron-LM's functional test
# tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp1_pp2_rope_embeddings_interleaved_no_fusion
# (model_config.yaml), its MODEL_ARGS as a flag list. Changed for a 2-process CPU test:
# * shapes: layers 12 -> 4, hidden 512 -> 64, heads 8 -> 4, sequence 1024 -> 128,
#   micro-batch 4 -> 1, global batch 32 -> 4, iterations 50 -> 2, --eval-iters 10 -> 1;
# * --seq1f1b-splits 2 added (the layout, TP 1 x PP 2, is the original's);
# * hardware: --transformer-impl transformer_engine -> local, --distributed-backend
#   nccl -> gloo, --bf16 dropped (CPU trains in fp32), the NCCL/cuBLAS environment left out;
# * data: the test corpus and its GPT-2 BPE files (paths from the environment);
ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --log-params-norm
    --log-num-zeros-in-grad
    --log-validation-ppl-to-tensorboard
    --log-timers-to-tensorboard
    --tensorboard-dir $TENSORBOARD_PATH
    --micro-batch-size 1
    --global-batch-size 4
    --seq-length 128
    --max-position-embeddings 128
    --train-iters 2
    --timing-log-level 0
    --lr-decay-iters 320000
    --save $CHECKPOINT_SAVE_PATH
    --load $CHECKPOINT_LOAD_PATH
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
    --distributed-backend gloo
    --lr 0.00015
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --clip-grad 1.0
    --lr-warmup-fraction .01
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 1
    --transformer-impl local
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --position-embedding-type rope
    --rotary-interleaved
    --no-rope-fusion
    --deterministic-mode
    --no-gradient-accumulation-fusion
    --attention-softmax-in-fp32
    --use-mcore-models
    --ckpt-format torch_dist
    --async-save
    --use-persistent-ckpt-worker
    --dist-ckpt-strictness log_all
    --dist-ckpt-optim-fully-reshardable
    --data-cache-path $DATA_CACHE_PATH
    --attention-backend unfused
    --log-memory-to-tensorboard
    --seq1f1b-splits 2
)
${TORCHRUN:-torchrun} --nproc_per_node 2 --nnodes 1 --master_addr localhost \
    --master_port $MASTER_PORT pretrain_gpt.py "${ARGS[@]}"
