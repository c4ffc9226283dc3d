#!/usr/bin/env bash
# The GPU checks the issues ask for, in phases that each fit a 10-minute device call:
#
#   bash tools/gpu_checks.sh PHASE...      results and logs under $GPU_CHECKS_OUT
#                                          (default: $OUT when set, else runs/gpu_checks)
#
# Run ONE phase per device call (each is sized for 10 minutes; `tests` and `train` apart).
# Every call ends with a summary (environment, then one table row per run: exit status,
# seconds, its last result line) that can be pasted into docs as it is; it is also
# written to $OUT_DIR/summary.md.
#
#   tests    the CUDA tests, bf16: split attention with the KV cache on SDPA, flash-attn
#            (if installed) and the chunked cache (#3 point 10), packed-document attention
#            on SDPA / FlexAttention / chunked and the flash-attn varlen kernel (#7 point
#            5), and #22's: packed documents + GQA keep no lq x lk tensor on any route,
#            the document mask uncopied by layers, the chunked kernel's bf16 accuracy and
#            no host sync in it (tests/test_gpu_readiness_cuda.py); a few minutes
#   multirank  #22 acceptance 3: multi-rank tests on this GPU machine run on gloo/CPU
#            (tests/conftest.py hides the GPU from child processes), pp2 and tp2 layouts
#   train    pretrain_gpt.py on one GPU (pp = 1, 4 layers, 4096 tokens, mock data):
#            --seq1f1b-splits 1 vs 4, buffer and chunked KV cache, fp32 (losses and grad
#            norms must agree within 1e-5) and bf16 (printed side by side); plus packed
#            documents with GQA in bf16 (--reset-attention-mask, the "auto" route)
#   kv       tools/bench_kv_cache.py in bf16: buffer vs chunked cache, 16k and 32k tokens
#   stage16  tools/bench_stage_gpu.py, 7B-shaped layers (TP-8 shard), one stage of pp = 4,
#            8 microbatches, 16k tokens, s in {1, 2, 4, 8} (#6 point 3)
#   stage32  the same at 32k, and one stage of pp = 8 (16 microbatches) at 32k
#   stage64  the same at 64k (pp = 4)
#   smoke    every phase above at toy sizes on CPU: checks this script, not the GPU
#
# On the lent GPU machine (Python 3.12, PyTorch preinstalled, no network) megatron-core
# is missing: carry wheels in .whl/ (see the device tool's README: the device call names
# .whl in carry), e.g. from the repo root, both supported ends of requirements.txt's range:
#   echo /.whl/ >> .git/info/exclude
#   for v in 0.16.1 0.19.2; do python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#       -d .whl megatron-core==$v; done
# This script then installs, without network, the newest carried megatron-core inside the
# supported range (tools/offline_install.py; an installed supported one is kept) with the
# other carried wheels into /tmp/gpu_checks_site, and puts it on PYTHONPATH.
# Commit what lands under docs/results/ with the command that produced it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${GPU_CHECKS_OUT:-${OUT:-runs/gpu_checks}}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
printf '| run | exit | seconds | result |\n|---|---|---|---|\n' > "$SUMMARY"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SMOKE=0
status=0

run() {  # run NAME CMD...: log to $OUT_DIR/NAME.log, remember a failure, go on
    local name=$1; shift
    echo "### $name: $*" | tee "$OUT_DIR/$name.log"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "### $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT_DIR/$name.log"
    [ "$rc" -eq 0 ] || status=1
    # the run's last result line: pytest's tally, the trainer's [summary], or a failure
    local result
    result=$(grep -E "passed|failed|skipped|error|\[summary\]|Error" "$OUT_DIR/$name.log" \
             | grep -v '^###' | tail -n 1 | tr '|' '/' | cut -c1-160)
    echo "| $name | $rc | $((SECONDS - start)) | ${result:-} |" >> "$SUMMARY"
}

print_summary() {
    echo
    echo "## GPU checks: $*"
    echo
    sed 's/^/    /' "$OUT_DIR/environment.txt"
    echo
    cat "$SUMMARY"
    [ -f "$OUT_DIR/train_summary.txt" ] && { echo; sed 's/^/    /' "$OUT_DIR/train_summary.txt"; }
    echo
    echo "all phases: $([ $status -eq 0 ] && echo passed || echo FAILED); logs in $OUT_DIR"
}

environment() {
    {
        date -u
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
            || echo "no nvidia-smi"
        "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("megatron.core", "flash_attn", "transformer_engine"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as error:  # not installed, or a broken build
        print(name, "unavailable:", type(error).__name__)
EOF
        git log -1 --format='commit %H %s' 2>/dev/null || true
    } | tee "$OUT_DIR/environment.txt"
}

phase_tests() {
    run tests "$PY" -m pytest -q -rA -p no:cacheprovider \
        "tests/test_kv_cache_attention.py::test_split_attention_cuda_bf16" \
        "tests/test_document_attention.py::test_document_attention_cuda_bf16" \
        "tests/test_document_attention.py::test_flash_varlen_kernel_matches_sdpa_bf16" \
        tests/test_gpu_readiness_cuda.py tests/test_gpu_readiness_suite.py
}

phase_multirank() {
    run multirank "$PY" -m pytest -q -rA -p no:cacheprovider -x \
        tests/test_gpu_readiness_suite.py tests/test_attention_exchange.py \
        "tests/test_training_layouts.py::test_layout_matches_single_process[pp2]" \
        "tests/test_training_layouts.py::test_layout_matches_single_process[tp2]"
}

train_run() {  # train_run NAME PRECISION SPLITS KV_CACHE [EXTRA FLAGS...]
    local name=$1 precision=$2 splits=$3 cache=$4 size=(4 1024 16 4096 8)
    shift 4
    [ "$SMOKE" = 1 ] && size=(2 64 4 256 2)
    local flags=(--num-layers "${size[0]}" --hidden-size "${size[1]}"
                 --num-attention-heads "${size[2]}" --seq-length "${size[3]}"
                 --max-position-embeddings "${size[3]}" --position-embedding-type rope
                 --micro-batch-size 1 --global-batch-size "${size[4]}" --train-iters 3
                 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024
                 --log-interval 1 --hidden-dropout 0 --attention-dropout 0
                 --seq1f1b-splits "$splits" --seq1f1b-kv-cache "$cache")
    [ "$precision" = bf16 ] && flags+=(--bf16)
    flags+=("$@")
    run "train_$name" "$PY" -m torch.distributed.run --nproc-per-node 1 \
        --master-port $((29500 + RANDOM % 1000)) pretrain_gpt.py "${flags[@]}"
}

phase_train() {
    local precisions=(fp32 bf16)
    [ "$SMOKE" = 1 ] && precisions=(fp32)  # bf16 training needs CUDA (a clear error on CPU)
    for precision in "${precisions[@]}"; do
        train_run "${precision}_s1" "$precision" 1 buffer
        train_run "${precision}_s4_buffer" "$precision" 4 buffer
        train_run "${precision}_s4_chunked" "$precision" 4 chunked
    done
    # packed documents + GQA (#22): the "auto" route (flash varlen or compiled flex)
    [ "$SMOKE" = 1 ] || train_run bf16_s4_documents_gqa bf16 4 buffer \
        --reset-attention-mask --group-query-attention --num-query-groups 4
    "$PY" - "$OUT_DIR" "${precisions[@]}" <<'EOF' | tee "$OUT_DIR/train_summary.txt"
import re, sys, pathlib
out = pathlib.Path(sys.argv[1])
pattern = re.compile(r"lm loss: ([0-9.eE+-]+) \| grad norm: ([0-9.eE+-]+)")
worst = {}
for precision in sys.argv[2:]:
    base = pattern.findall((out / f"train_{precision}_s1.log").read_text())
    for name in ("s4_buffer", "s4_chunked"):
        other = pattern.findall((out / f"train_{precision}_{name}.log").read_text())
        if not base or len(base) != len(other):
            print(f"{precision} {name}: missing iterations ({len(base)} vs {len(other)})")
            worst[(precision, name)] = float("inf")
            continue
        rel = max(abs(float(a) - float(b)) / abs(float(a))
                  for pair in zip(base, other) for a, b in zip(*pair))
        worst[(precision, name)] = rel
        print(f"{precision} s=1 vs {name}: (loss, grad norm) per iteration "
              f"{base} vs {other}; largest relative difference {rel:.2e}")
bad = [key for key, rel in worst.items() if key[0] == "fp32" and not rel <= 1e-5]
print("fp32 within 1e-5:", "yes" if not bad else f"NO {bad}")
sys.exit(1 if bad else 0)
EOF
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

phase_kv() {
    local lengths=(16384 32768) extra=(--dtype bf16)
    [ "$SMOKE" = 1 ] && lengths=(256) extra=()
    for length in "${lengths[@]}"; do
        run "kv_cache_$length" "$PY" tools/bench_kv_cache.py --seq-length "$length" \
            --heads 32 --groups 8 --head-dim 128 --splits 2 4 8 --repeats 5 "${extra[@]}" \
            --json "$OUT_DIR/kv_cache_$length.json"
    done
}

stage() {  # stage NAME PP MICROBATCHES SEQ
    local name=$1 pp=$2 m=$3 seq=$4 model=(--model 7B --tp-shard 8 --p2p-gbps 360)
    [ "$SMOKE" = 1 ] && model=(--tiny) && seq=256
    run "stage_$name" "$PY" tools/bench_stage_gpu.py "${model[@]}" --pp "$pp" \
        --microbatches "$m" --seq-length "$seq" --splits 1 2 4 8 \
        --json "$OUT_DIR/bench_stage_gpu_$name.json"
}

phase_stage16() { stage 7B_16k_pp4 4 8 16384; }
phase_stage32() { stage 7B_32k_pp4 4 8 32768; stage 7B_32k_pp8 8 16 32768; }
phase_stage64() { stage 7B_64k_pp4 4 8 65536; }

phase_smoke() {
    SMOKE=1
    phase_train
    phase_kv
    stage tiny_pp4 4 8 256
}

[ $# -gt 0 ] || { sed -n '2,41p' "$0"; exit 2; }
SITE=$("$PY" tools/offline_install.py --wheels "${WHEELS:-.whl}" --target /tmp/gpu_checks_site) \
    || exit 2
[ -n "$SITE" ] && export PYTHONPATH="$SITE:$PYTHONPATH"
environment
for phase in "$@"; do
    if ! declare -F "phase_$phase" >/dev/null; then
        echo "unknown phase '$phase' (tests, multirank, train, kv, stage16, stage32, stage64, smoke)"
        exit 2
    fi
    "phase_$phase"
done
print_summary "$@"
exit $status
