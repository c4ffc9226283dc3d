#!/usr/bin/env bash
# Experiments.
#
#   bash exp.sh            CPU demo, end to end on the built-in corpus (Python's standard
#                          library): corpus -> BPE tokenizer -> .bin/.idx -> pp=2 training,
#                          2 microbatches of 2048 tokens per iteration, with 1F1B,
#                          Seq1F1B (s=4) and SlimPipe (4 slices), in turns:
#                          two rounds of 5 iterations, the second resuming -> one table
#                          (tools/demo_table.py; non-zero exit if the losses differ) +
#                          timelines with stage 0's activation memory over time.
#   bash exp.sh --dry-run  print the commands instead of running them.
#
#   GPU runs in the published style (set MODEL or GPUS_PER_NODE; torchrun launches one
#   1F1B run, then one Seq1F1B run with SPLITS splits, on every node):
#     MODEL=7B SEQ_LEN=32768 TP=8 PP=4 SPLITS=4 MICRO_BATCHES=8 GPUS_PER_NODE=8 NNODES=4 \
#     NODE_RANK=0 MASTER_ADDR=host0 MASTER_PORT=6000 DATA_PATH=/data/codeparrot_content_document \
#     VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt bash exp.sh
#   MODEL: 1.3B 2.7B 7B 13B 30B (layers/hidden/heads of the paper). Optional: BALANCE
#   (uniform_comp | average), TRAIN_ITERS, EXTRA_ARGS (more pretrain_gpt.py flags, e.g.
#   "--recompute-granularity selective"). Without DATA_PATH the GPU runs use --mock-data.
#   Run i uses port MASTER_PORT + i, so a node that finishes a run early never meets the
#   previous run's rendezvous. On SLURM: examples/slurm_seq1f1b.sbatch.
set -euo pipefail
cd "$(dirname "$0")"

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; fi
run() {
  echo "+ $*"
  if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}

# what the screen shows of a run: no warnings (nor the source line Python prints under
# one) and every 5th iteration line only
screen_filter() {
  awk 'tolower($0) ~ /warn/ { source = 1; next }
       source && /^  / { source = 0; next }
       { source = 0 }
       /iteration +[0-9]*[1-46-9]\// { next }
       { print; fflush() }'
}

# run a command with its whole output in LOG (what the table reads; APPEND=1 adds to it)
# and the screen_filter's part on the screen. A failing command fails the script.
run_logged() {
  local log=$1
  shift
  local redirect=">" tee_flags=()
  if [[ ${APPEND:-0} == 1 ]]; then redirect=">>" tee_flags=(-a); fi
  echo "+ $* $redirect $log"
  if [[ $DRY_RUN == 0 ]]; then
    "$@" 2>&1 | tee "${tee_flags[@]}" "$log" | screen_filter
  fi
}

PYTHON=${PYTHON:-python}

if [[ -z "${MODEL:-}" && -z "${GPUS_PER_NODE:-}" ]]; then
  # ---------------------------------------------------------------- CPU demo
  DATA=${DATA_DIR:-data}
  RUNS=${RUNS_DIR:-runs/cpu_demo}
  run mkdir -p "$DATA" "$RUNS"
  if [[ ! -f "$DATA/stdlib_content_document.idx" ]]; then
    run $PYTHON tools/build_code_corpus.py --output "$DATA/stdlib.jsonl" --max-bytes 4000000
    run $PYTHON tools/train_tokenizer.py --input "$DATA/stdlib.jsonl" --json-key content \
      --vocab-size 8192 --output-dir "$DATA/tokenizer"
    run $PYTHON tools/preprocess_data.py --input "$DATA/stdlib.jsonl" --json-keys content \
      --output-prefix "$DATA/stdlib" --tokenizer-type GPT2BPETokenizer \
      --vocab-file "$DATA/tokenizer/vocab.json" --merge-file "$DATA/tokenizer/merges.txt" \
      --append-eod --workers 2
  fi
  # Long-context shape: few microbatches per iteration (2 on 2 stages: 1F1B idles a third
  # of the span) and 512-token splits. With 8 microbatches of 1024 tokens the bubble left
  # was mostly stage imbalance and 256-token units cost 1.16x on CPU: no gain to show
  # (docs/results.md, the CPU demo).
  MODEL_ARGS=(
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 2048
    --max-position-embeddings 2048 --position-embedding-type rope --swiglu
    --normalization RMSNorm --untie-embeddings-and-output-weights
    --attention-dropout 0 --hidden-dropout 0
    --micro-batch-size 1 --global-batch-size 2 --train-iters 10
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0 --log-interval 1 --eval-interval 10 --eval-iters 1
    --data-path "$DATA/stdlib_content_document" --split 98,2,0
    --tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/tokenizer/vocab.json"
    --merge-file "$DATA/tokenizer/merges.txt" --seed 1234
    --pipeline-model-parallel-size 2
  )
  # one thread per process, what torchrun sets anyway; set here, it skips its banner
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  # name | schedule flags. Every run trains the same model on the same data, so the
  # losses must be equal; the table tool checks it and fails the demo if they are not.
  SCHEDULES=(
    "1f1b|--seq1f1b-splits 1"
    "seq1f1b_s4|--seq1f1b-splits 4"
    "slimpipe_n4|--pipeline-schedule slimpipe --slimpipe-slices 4"
  )
  # Two rounds of 5 iterations, the schedules in turn: each run stops at iteration 5 with
  # a checkpoint (--exit-interval) and the second round resumes it to iteration 10. A host
  # whose speed drifts over the minutes of the demo so weighs on every schedule alike,
  # and every loss of iterations 1-10 is still compared. The checkpoints are the demo's
  # own: removed first, so that every `bash exp.sh` trains from iteration 0, and last.
  ROUNDS=2
  run rm -rf "$RUNS/checkpoints"
  NAMES=()
  for ENTRY in "${SCHEDULES[@]}"; do NAMES+=("${ENTRY%%|*}"); done
  for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
    for ENTRY in "${SCHEDULES[@]}"; do
      NAME=${ENTRY%%|*}
      read -r -a FLAGS <<< "${ENTRY#*|}"
      APPEND=$((ROUND > 1)) run_logged "$RUNS/$NAME.log" $PYTHON -m torch.distributed.run \
        --nproc-per-node 2 --master-port 29531 pretrain_gpt.py "${MODEL_ARGS[@]}" "${FLAGS[@]}" \
        --save "$RUNS/checkpoints/$NAME" --load "$RUNS/checkpoints/$NAME" --save-interval 5 \
        --exit-interval 5 --timeline-file "$RUNS/timeline_$NAME.json" \
        --activation-memory-file "$RUNS/memory_$NAME.json"
    done
  done
  TIMELINES=() MEMORY=()
  for NAME in "${NAMES[@]}"; do
    TIMELINES+=("$RUNS/timeline_$NAME.json") MEMORY+=("$RUNS/memory_$NAME.json")
  done
  run $PYTHON tools/draw_timeline.py "${TIMELINES[@]}" --memory "${MEMORY[@]}" \
    --titles "${NAMES[@]}" -o "$RUNS/timelines.png"
  if [[ $DRY_RUN == 0 ]]; then
    echo
    echo "== pp=2, 2 microbatches of 2048 tokens, 10 iterations in 2 rounds, CPU (gloo) =="
  fi
  run $PYTHON tools/demo_table.py "$RUNS" "${NAMES[@]}"
  run rm -rf "$RUNS/checkpoints"  # 0.5 GB that only the second round needed
  [[ $DRY_RUN == 1 ]] || echo "timelines (last training iteration) + stage-0 memory: $RUNS/timelines.png"
  exit 0
fi

# -------------------------------------------------------------------- GPU runs
MODEL=${MODEL:-7B}
case $MODEL in
  1.3B) LAYERS=24; HIDDEN=2048; HEADS=16 ;;
  2.7B) LAYERS=32; HIDDEN=2560; HEADS=32 ;;
  7B)   LAYERS=32; HIDDEN=4096; HEADS=32 ;;
  13B)  LAYERS=40; HIDDEN=5120; HEADS=40 ;;
  30B)  LAYERS=64; HIDDEN=6144; HEADS=64 ;;
  *) echo "error: MODEL must be one of 1.3B 2.7B 7B 13B 30B, got $MODEL" >&2; exit 2 ;;
esac
SEQ_LEN=${SEQ_LEN:-32768}
TP=${TP:-8}
PP=${PP:-4}
SPLITS=${SPLITS:-4}
BALANCE=${BALANCE:-uniform_comp}
MICRO_BATCHES=${MICRO_BATCHES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
TRAIN_ITERS=${TRAIN_ITERS:-20}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
WORLD=$((GPUS_PER_NODE * NNODES))
if (( WORLD % (TP * PP) != 0 )); then
  echo "error: GPUS_PER_NODE x NNODES ($WORLD) must be a multiple of TP x PP ($((TP * PP)))" >&2
  exit 2
fi
if (( NODE_RANK < 0 || NODE_RANK >= NNODES )); then
  echo "error: NODE_RANK ($NODE_RANK) must be in 0 .. NNODES - 1 ($((NNODES - 1)))" >&2
  exit 2
fi
DP=$((WORLD / (TP * PP)))
GLOBAL_BATCH=$((MICRO_BATCHES * DP))
if [[ -n "${DATA_PATH:-}" ]]; then
  DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer
             --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
# the published configuration: GPT-2 vocabulary, RoPE, untied embeddings, FFN 4h GeLU,
# bf16, flash attention when installed (--attention-backend auto), sequence parallel
# (dropped by the argument check when TP = 1)
ARGS=(
  --num-layers $LAYERS --hidden-size $HIDDEN --num-attention-heads $HEADS
  --seq-length $SEQ_LEN --max-position-embeddings $SEQ_LEN --position-embedding-type rope
  --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
  --micro-batch-size 1 --global-batch-size $GLOBAL_BATCH --train-iters $TRAIN_ITERS
  --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-style cosine --clip-grad 1.0
  --bf16 --tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP
  --sequence-parallel --use-distributed-optimizer --attention-backend auto
  --log-interval 1 --eval-iters 0 --seed 1234
  "${DATA_ARGS[@]}" "${EXTRA[@]}"
)
RUN=0
for S in 1 $SPLITS; do
  run torchrun --nproc-per-node $GPUS_PER_NODE --nnodes $NNODES --node-rank $NODE_RANK \
    --master-addr $MASTER_ADDR --master-port $((MASTER_PORT + RUN)) \
    pretrain_gpt.py "${ARGS[@]}" --seq1f1b-splits $S --seq1f1b-balance-method $BALANCE
  RUN=$((RUN + 1))
done
