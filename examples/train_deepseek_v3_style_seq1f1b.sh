#!/bin/bash
# A trimmed DeepSeek-V3 (MoE + multi-latent attention) with Seq1F1B on 8 GPUs: PP=4, TP=2
# with sequence parallelism, 16k-token sequences, 4 sequence splits: the seed port's layout
# ("a trimmed DeepSeek-V3 PP=4 TP=2", 1.10x over 1F1B). DeepSeek-V3's structure and per-head sizes
# are kept as Megatron-LM's DeepSeek-V3 recipe sets them: multi-latent attention (q LoRA
# rank 1536, kv LoRA rank 512, query-key head 128 + 64 rotary, value head 128, RMSNorm on
# both latents: --qk-layernorm), 256
# routed experts with top-8 routing and one shared expert, the sigmoid router (scores
# before the top-k, in fp32: --moe-router-pre-softmax --moe-router-dtype fp32) with expert
# bias (aux-loss-free balancing, update rate 1e-3), group-limited routing (8 groups, top
# 4), routed scaling 2.5, the sequence auxiliary loss (1e-4), the first 3 layers dense,
# RMSNorm, SwiGLU, no biases, untied embeddings, the 129280-token vocabulary. Trimmed to
# fit 8 GPUs: 16 layers (3 dense + 13 MoE), hidden 2048, 16 heads, dense FFN 5632,
# expert and shared-expert FFN 256 (DeepSeek-V3: 61 layers, hidden 7168, 128 heads,
# FFN 18432, experts 2048). DeepSeek-V3's YaRN on the rotary part (base 10000, scaling
# factor 40 over 4096 original positions, mscale and mscale_all_dim 1: Megatron-LM's
# --rope-type yarn, the default with MLA). One multi-token prediction depth with loss
# weight 0.1, as DeepSeek-V3 (--mtp-num-layers 1; an MoE + MLA layer on the last stage).
# Selective recomputation of core attention, the norms and MLA's up-projections
# (--recompute-modules core_attn layernorm mla_up_proj: 1.0-1.4 GB less per stage planned).
#
#   TOKENIZER_MODEL=/path/to/DeepSeek-V3 DATA_PATH=/data/corpus_text_document \
#       bash examples/train_deepseek_v3_style_seq1f1b.sh     # 8 GPUs on this node
#   PLAN=1 bash examples/train_deepseek_v3_style_seq1f1b.sh    # memory/bubble/TFLOP/s only
#
# PLAN=1 hands the same flags to tools/plan.py (with --world-size and --gpu $GPU,
# default h100-80g) instead of training. Everything else comes from the environment:
# GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR, MASTER_PORT, CHECKPOINT_PATH,
# TENSORBOARD_DIR, TRAIN_ITERS, TP (2, with sequence parallelism; 1 without), ETP (expert
# tensor parallelism, default TP; 1 keeps experts whole as DeepSeek-V3's Megatron-LM
# recipes do, with EP over the TP ranks: planned 38.1 GB and 1.86 s an iteration instead of
# 39.6 GB and 1.79 s at TP=2), EP (expert parallelism over the DP x TP / ETP ranks: 1 at
# TP=2 on 8 GPUs, 2 at TP=1 or ETP=1),
# GLOBAL_BATCH_SIZE (16). TP=2 is the port's layout (PP=4 x TP=2, tools/plan.py: 40 GB
# allocated at the peak, 41 GB reserved, on an 80 GB H100, on the last stage, which
# also holds the MTP depth and its output head); TP=1 is PP=4 x DP=2
# with EP=2 (55 GB, 58 GB reserved). LAYOUT: Megatron-LM's --pipeline-model-parallel-layout,
# e.g. LAYOUT='Et*5|t*5|t*4|t*2mL' moves layers off the last stage, which also holds the
# MTP depth and the 129k-token output layer: tools/plan.py plans 29 GB instead of 40 GB at
# the peak and 1.35 s instead of 1.79 s an iteration on H100s (planned, not measured: no
# GPU has run this project yet). MLA under TP is exact
# (megatron/seqsplit/mla.py sums the shared rotary key's gradient over TP ranks, which
# megatron-core's local MLA spec does not: docs/megatron_lm.md#multi-latent-attention).
# SEQ_LENGTH (16384) and CP (1, --context-parallel-size: each of CP ranks runs an equal part
# of every split; MoE, MTP and YaRN run with it, the experts spread over DP x CP x TP / ETP
# ranks) for longer sequences: at 65536 tokens on 16 GPUs tools/plan.py plans 89 GB at
# the peak without CP (out of memory; DP=2) and 54 GB with CP=2 (NNODES=2 SEQ_LENGTH=65536
# CP=2), at 131072 on 32 GPUs 58 GB with CP=4 (planned, not measured).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
SEQ_LENGTH=${SEQ_LENGTH:-16384}
TP=${TP:-2}
ETP=${ETP:-$TP}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/deepseek_v3_style_seq1f1b}

MODEL_ARGS=(
    --num-layers 16
    --hidden-size 2048
    --ffn-hidden-size 5632
    --num-attention-heads 16
    --multi-latent-attention
    --q-lora-rank 1536
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --qk-layernorm
    --max-position-embeddings $SEQ_LENGTH
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 10000
    --rope-type yarn
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model ${TOKENIZER_MODEL:-deepseek-ai/DeepSeek-V3}
    --vocab-size 129280
    --make-vocab-size-divisible-by 128
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)
MOE_ARGS=(
    --num-experts 256
    --moe-router-topk 8
    --moe-ffn-hidden-size 256
    --moe-shared-expert-intermediate-size 256
    --moe-layer-freq "([0]*3+[1]*13)"
    --moe-router-score-function sigmoid
    --moe-router-pre-softmax
    --moe-router-dtype fp32
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-num-groups 8
    --moe-router-group-topk 4
    --moe-router-topk-scaling-factor 2.5
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm
    --expert-model-parallel-size ${EP:-$((GPUS_PER_NODE * NNODES / (4 * ETP)))}
    --expert-tensor-parallel-size $ETP
)
TRAINING_ARGS=(
    --seq-length $SEQ_LENGTH
    --micro-batch-size 1
    --global-batch-size ${GLOBAL_BATCH_SIZE:-16}
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
    --recompute-modules core_attn layernorm mla_up_proj
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    $([ "$TP" -gt 1 ] && echo --sequence-parallel || true)
    --pipeline-model-parallel-size 4
    --context-parallel-size ${CP:-1}
    ${LAYOUT:+--pipeline-model-parallel-layout "$LAYOUT"}
    --use-distributed-optimizer
    --seq1f1b-splits 4
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
