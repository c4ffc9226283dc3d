#!/bin/bash
# Megatron-LM's functional test tests/functional_tests/test_cases/gpt/gpt3_15b_8t_release
# (model_config.yaml: the 15B release run), its MODEL_ARGS as a flag list. Changed for a
# 2-process CPU test:
# * shapes: layers 32 -> 4, hidden 6144 -> 64, heads 48 -> 4, query groups 8 -> 2,
#   sequence 4096 -> 128, micro-batch 4 -> 1, samples 19531250 -> 8 (2 iterations), the
#   learning-rate samples and --eval-iters 32 -> 1 to match; --step-batch-size-schedule
#   "0:384 200B:768 400B:1152" (tokens) -> "0:2 256:6 400K:8" (batches 2 then 6; the
#   last step is not reached in 8 samples);
# * layout: TP 8 x PP 1 -> TP 1 x PP 2, and --seq1f1b-splits 2 added;
# * data-loader processes: --num-workers 6 -> 1 (2 CPU cores for both ranks);
# * hardware: --transformer-impl transformer_engine -> local, --bf16 dropped (CPU trains
#   in fp32), the NCCL/TE environment variables left out;
# * data: the test corpus with its GPT-2 BPE vocabulary instead of the Nemotron blend and
#   its 256k GPTSentencePieceTokenizer model (paths from the environment);
ARGS=(
    --distributed-timeout-minutes 60
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-mcore-models
    --sequence-parallel
    --disable-bias-linear
    --micro-batch-size 1
    --step-batch-size-schedule "0:2 256:6 400K:8"
    --train-samples 8
    --manual-gc
    --transformer-impl local
    --data-cache-path $DATA_CACHE_PATH
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --data-path $DATA_PATH
    --split 99,1,0
    --no-mmap-bin-files
    --num-workers 1
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --no-rope-fusion
    --rotary-percent 0.5
    --squared-relu
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --seq-length 128
    --max-position-embeddings 128
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --clip-grad 1.0
    --weight-decay 0.1
    --lr-decay-samples 8
    --lr-warmup-samples 2
    --lr 4.5e-4
    --min-lr 4.5e-5
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --adam-beta1 0.9
    --adam-beta2 0.95
    --eval-iters 1
    --eval-interval 2000
    --save $CHECKPOINT_SAVE_PATH
    --load $CHECKPOINT_LOAD_PATH
    --save-interval 1000
    --async-save
    --use-persistent-ckpt-worker
    --save-retain-interval 5000
    --init-method-std 0.0134
    --log-timers-to-tensorboard
    --log-memory-to-tensorboard
    --log-num-zeros-in-grad
    --log-params-norm
    --log-validation-ppl-to-tensorboard
    --log-throughput
    --log-interval 100
    --tensorboard-dir $TENSORBOARD_PATH
    --wandb-project megatron-core-release-runs
    --wandb-entity adlr
    --wandb-exp-name $WANDB_EXPERIMENT
    --exit-interval 51000
    --wandb-save-dir $WANDB_SAVE_PATH
    --seq1f1b-splits 2
)
${TORCHRUN:-torchrun} --nproc_per_node 2 --nnodes 1 --master_addr localhost \
    --master_port $MASTER_PORT pretrain_gpt.py "${ARGS[@]}"
