#!/bin/bash
# Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (DeepSeek-V3: multi-latent
# attention, 3 dense layers then MoE layers with a shared expert, sigmoid group-limited
# top-k routing with expert bias and seq_aux_loss, multi-token prediction, selective
# recomputation), its flags and switches kept. Changed for a 2-process CPU test:
# * shapes: layers 61 -> 4 ([0]*3+[1]*58 -> [0]*1+[1]*3), hidden 7168 -> 64, FFN, heads,
#   kv channels, the MLA ranks and head dims, experts 256 -> 16 (the routing's groups and
#   top-k kept), sequence 4096 -> 128, samples, --eval-iters 32 -> 1, intervals 100 -> 2,
#   --num-workers 6 -> 1 (two cores);
# * precision: --bf16 dropped (CPU trains in fp32);
# * --transformer-impl transformer_engine -> local (MLA and MoE are built from the local
#   spec here);
# * sbatch/srun replaced by $TORCHRUN on this host, and --pipeline-model-parallel-size 2
#   --seq1f1b-splits 2 added.
# USE_MEGATRON_FSDP=1 (the example's default) adds its FSDP flags, which stop the run here
# naming the alternative.

export NCCL_IB_SL=1
export NCCL_IB_TIMEOUT=19
export NVTE_FWD_LAYERNORM_SM_MARGIN=16
export NVTE_BWD_LAYERNORM_SM_MARGIN=16
export NCCL_P2P_NET_CHUNKSIZE=2097152
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export PYTHONWARNINGS=ignore

OUTPUT_PATH=${OUTPUT_PATH:-"your_own_output_path"}
DATA_PATH=${DATA_PATH:-"your_own_data_path"}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-"deepseek-ai/DeepSeek-V3"}
USE_MEGATRON_FSDP=${USE_MEGATRON_FSDP:-1}
SHARDING_STRATEGY=${SHARDING_STRATEGY:-"optim_grads_params"}
PROFILE=${PROFILE:-0}
WANDB=${WANDB:-1}

TP=${TP:-1}
EP=${EP:-8}
MBS=${MBS:-4}
GBS=${GBS:-2048}
COMMENT=${COMMENT:-""}

PRETRAIN_ARGS=(
    --distributed-timeout-minutes 60
    --tensor-model-parallel-size ${TP}
    --pipeline-model-parallel-size 2
    --seq1f1b-splits 2
    --expert-model-parallel-size ${EP}
    --expert-tensor-parallel-size 1
    --context-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-mcore-models
    --sequence-parallel
    --use-flash-attn
    --disable-bias-linear
    --micro-batch-size ${MBS}
    --global-batch-size ${GBS}
    --train-samples 8
    --exit-duration-in-mins 220
    --no-check-for-nan-in-loss-and-grad
    --manual-gc
    --manual-gc-interval 10
    --recompute-granularity selective
    --recompute-modules mlp moe mla_up_proj layernorm
    --transformer-impl local
    --seq-length 128
    --data-cache-path ${OUTPUT_PATH}/cache
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path ${DATA_PATH}
    --split 99,1,0
    --no-mmap-bin-files
    --no-create-attention-mask-in-dataloader
    --num-workers 1
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 160
    --num-attention-heads 4
    --kv-channels 16
    --max-position-embeddings 128
    --position-embedding-type rope
    --rotary-base 10000
    --make-vocab-size-divisible-by 3232
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --multi-latent-attention
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --clip-grad 1.0
    --weight-decay 0.1
    --qk-layernorm
    --lr-decay-samples 8
    --lr-warmup-samples 4
    --lr-warmup-init 3.9e-7
    --lr 3.9e-6
    --min-lr 3.9e-7
    --lr-decay-style cosine
    --adam-beta1 0.9
    --adam-beta2 0.95
    --num-experts 16
    --moe-layer-freq [0]*1+[1]*3
    --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk 8
    --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend hybridep
    --moe-router-pre-softmax
    --moe-grouped-gemm
    --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 4
    --moe-router-num-groups 8
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-permute-fusion
    --moe-router-force-load-balancing
    --q-lora-rank 32
    --kv-lora-rank 16
    --qk-head-dim 16
    --qk-pos-emb-head-dim 8
    --v-head-dim 16
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
    --eval-iters 1
    --eval-interval 2
    --auto-detect-ckpt-format
    --load ${OUTPUT_PATH}/checkpoints
    --save ${OUTPUT_PATH}/checkpoints
    --save-interval 2
    --dist-ckpt-strictness log_all
    --init-method-std 0.02
    --log-timers-to-tensorboard
    --log-memory-to-tensorboard
    --log-num-zeros-in-grad
    --log-params-norm
    --log-validation-ppl-to-tensorboard
    --log-throughput
    --log-interval 1
    --logging-level 40
    --tensorboard-dir ${OUTPUT_PATH}/tensorboard
    --enable-experimental
)

if [ "${USE_MEGATRON_FSDP}" = 1 ]; then
    unset CUDA_DEVICE_MAX_CONNECTIONS
    PRETRAIN_ARGS=(
        "${PRETRAIN_ARGS[@]}"
        --use-megatron-fsdp
        --data-parallel-sharding-strategy ${SHARDING_STRATEGY}
        --no-gradient-accumulation-fusion
        --use-distributed-optimizer
        --calculate-per-token-loss
        --init-model-with-meta-device
        --ckpt-format fsdp_dtensor
        --fsdp-double-buffer
        --use-nccl-ub
        --megatron-fsdp-grad-comm-dtype bf16
        --megatron-fsdp-main-grads-dtype bf16
    )
fi

if [ "${PROFILE}" = 1 ]; then
    PRETRAIN_ARGS=(
        "${PRETRAIN_ARGS[@]}"
        --profile
        --profile-step-start 10
        --profile-step-end 12
        --profile-ranks 0
    )
fi

if [ "${WANDB}" = 1 ]; then
    PRETRAIN_ARGS=(
        "${PRETRAIN_ARGS[@]}"
        --wandb-project your_own_wandb_project
        --wandb-exp-name DeepSeek-V3-TP${TP}EP${EP}-MBS${MBS}GBS${GBS}-${COMMENT}
    )
fi

${TORCHRUN:-torchrun} --nproc_per_node 2 --master_port ${MASTER_PORT:-6000} pretrain_gpt.py \
    "${PRETRAIN_ARGS[@]}"
