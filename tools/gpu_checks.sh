#!/usr/bin/env bash
# The GPU checks the issues ask for, one device call per command:
#
#   bash tools/gpu_checks.sh PHASE...      one tarball of all logs and one summary under
#                                          $GPU_CHECKS_OUT (default: $OUT when set, else
#                                          runs/gpu_checks/<phases>)
#
# THE FIRST GPU RUN is one command (device call: carry [".whl"], timeout_s 540):
#
#   bash tools/gpu_checks.sh first
#
# It installs megatron-core offline from the carried .whl/, runs the CUDA tests, then the
# `train` comparison (the fp32 verdict is printed before the slow packed-documents run),
# then `kv` if time is left, all inside GPU_CHECKS_BUDGET_S (default 480 s = 8 minutes).
# Every run is bounded by `timeout` to what is left of the budget; a run that would not
# fit is skipped, with the reason in its summary row. Later device calls run one phase
# each (kv if `first` skipped it, stage16, stage32, stage64; docs/gpu_readiness.md), with
# timeout_s at most 540 and under the session's budget_left_s, and the budget 60 s less:
#
#   GPU_CHECKS_BUDGET_S=480 bash tools/gpu_checks.sh stage16      # timeout_s 540
#
# Every call leaves exactly two files in the output folder: gpu_checks_logs.tar.gz (every
# log, JSON result and the summary) and summary.md, and prints that summary to paste into
# docs: the environment, then one row per run: exit status (or "skipped"), seconds, and
# its result line (pytest's tally, the trainer's loss and speed, the kv/stage benchmarks'
# ratios, or the error / time-out).
#
#   first    install, tests, train, kv (kv only if the budget has room); 8 minutes
#   tests    the CUDA tests, bf16: split attention with the KV cache on SDPA, flash-attn
#            (if installed) and the chunked cache (#3 point 10), packed-document attention
#            on SDPA / FlexAttention / chunked and the flash-attn varlen kernel (#7 point
#            5), sliding-window attention on every CUDA route, attention sinks
#            through the chunked kernel, and #22's: packed documents + GQA keep no lq x lk tensor on any route,
#            the document mask uncopied by layers, the chunked kernel's bf16 accuracy and
#            no host sync in it (tests/test_gpu_readiness_cuda.py); a few minutes
#   multirank  #22 acceptance 3: multi-rank tests on this GPU machine run on gloo/CPU
#            (tests/conftest.py hides the GPU from child processes), pp2 and tp2 layouts
#   train    pretrain_gpt.py on one GPU (pp = 1, 4 layers, 4096 tokens, mock data):
#            --seq1f1b-splits 1 vs 4, buffer and chunked KV cache, fp32 first (losses and
#            grad norms must agree within 1e-5: the verdict), then bf16 (printed side by
#            side), then packed documents with GQA in bf16 (--reset-attention-mask, "auto")
#   kv       tools/bench_kv_cache.py in bf16: buffer vs chunked cache, 16k and 32k tokens
#            (KV_LENGTHS="32768": only that length, e.g. the one `first` skipped)
#   stage16  tools/bench_stage_gpu.py, 7B-shaped layers (TP-8 shard), one stage of pp = 4,
#            8 microbatches, 16k tokens, s in {1, 2, 4, 8} (#6 point 3)
#   stage32  the same at 32k, and one stage of pp = 8 (16 microbatches) at 32k
#   stage32pp8  only the pp = 8 run of stage32 (if stage32 skipped it for time)
#   stage64  the same at 64k (pp = 4)
#   smoke    `first` at toy sizes on CPU, plus a tiny stage: checks this script, not the
#            GPU (budget 900 s by default: the CPU is slower)
#
# On the lent GPU machine (Python 3.12, PyTorch preinstalled, no network) megatron-core
# is missing: carry wheels in .whl/ (the device call names .whl in carry), e.g. from the
# repo root, both supported ends of requirements.txt's range:
#   echo /.whl/ >> .git/info/exclude
#   for v in 0.16.1 0.19.2; do python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#       -d .whl megatron-core==$v; done
# This script then installs, without network, the newest carried megatron-core inside the
# supported range (tools/offline_install.py, pip --upgrade: it replaces an older one left
# in the target; an installed supported one is kept) with the other carried wheels into
# /tmp/gpu_checks_site, and puts it on PYTHONPATH.
# Commit what lands under docs/results/ with the command that produced it.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASES=("$@")
LABEL=$(IFS=_; echo "${PHASES[*]:-none}")
OUT_DIR=${GPU_CHECKS_OUT:-${OUT:-runs/gpu_checks/$LABEL}}
# Logs are written outside the output folder (the device returns at most 8 files from
# it); after every run they are packed into the one tarball.
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks.XXXXXX")
TARBALL="$OUT_DIR/gpu_checks_logs.tar.gz"
SUMMARY="$OUT_DIR/summary.md"
ROWS="$LOG_DIR/rows.md"
DEFAULT_BUDGET=480
[ "${PHASES[*]:-}" = smoke ] && DEFAULT_BUDGET=900
BUDGET=${GPU_CHECKS_BUDGET_S:-$DEFAULT_BUDGET}
RESERVE=15  # seconds kept for the comparisons, the summary and the tarball
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SMOKE=0
status=0
mkdir -p "$OUT_DIR"
rm -f "$TARBALL" "$SUMMARY"
printf '| run | exit | seconds | result |\n|---|---|---|---|\n' > "$ROWS"

left() { echo $((BUDGET - SECONDS - RESERVE)); }  # seconds a run may still take

row() { echo "| $1 | $2 | $3 | $(echo "$4" | tr '|' '/' | cut -c1-220) |" >> "$ROWS"; }

pack() {  # the summary and the tarball, as they stand: rewritten after every run
    {
        echo "## GPU checks: ${PHASES[*]:-}"
        echo
        [ -f "$LOG_DIR/environment.txt" ] && sed 's/^/    /' "$LOG_DIR/environment.txt" && echo
        cat "$ROWS"
        [ -f "$LOG_DIR/train_summary.txt" ] && echo && sed 's/^/    /' "$LOG_DIR/train_summary.txt"
        echo
        local skipped
        skipped=$(grep -c '^| [^|]* | skipped |' "$ROWS")
        echo "budget ${BUDGET} s, used ${SECONDS} s; all runs: $([ $status -eq 0 ] \
            && echo passed || echo FAILED) ($skipped skipped); logs in $(basename "$TARBALL")"
    } > "$LOG_DIR/summary.md"
    cp "$LOG_DIR/summary.md" "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
    tar -czf "$TARBALL.tmp" -C "$LOG_DIR" --exclude=rows.md . && mv "$TARBALL.tmp" "$TARBALL"
}

finish() {
    pack
    echo
    cat "$SUMMARY"
    rm -rf "$LOG_DIR"
}
trap 'status=1; row interrupted - "$SECONDS" "stopped by a signal"; finish; exit 1' INT TERM

result_line() {  # result_line NAME RC LIMIT: the run's one result line, from its log/JSON
    "$PY" - "$LOG_DIR" "$@" <<'EOF'
import json, pathlib, re, sys
logs, name, rc, limit = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
log = logs / f"{name}.log"
lines = [l.strip() for l in log.read_text(errors="replace").splitlines()
         if l.strip() and not l.startswith("###")] if log.exists() else []

def last(pattern):
    hits = [l for l in lines if re.search(pattern, l)]
    return hits[-1] if hits else None

def ratios(values):
    return ", ".join(f"s={s} {v:.2f}" for s, v in values)

result = None
data = logs / f"{name}.json"
try:
    if name.startswith("kv_cache_") and data.exists():
        rows = [r for r in json.loads(data.read_text())["rows"] if r["layout"] != "unsplit"]
        splits = sorted({r["splits"] for r in rows})
        parts = []
        for layout in ("buffer", "chunked"):
            mine = {r["splits"]: r for r in rows if r["layout"] == layout}
            if mine:
                parts.append(layout + " time " + "/".join(
                    f"{mine[s]['time_vs_unsplit']:.2f}" if s in mine else "-" for s in splits)
                    + " peak " + "/".join(f"{mine[s]['peak_vs_unsplit']:.2f}" if s in mine
                                          else "-" for s in splits))
        worst = max((r["max_abs_diff_vs_unsplit"] for r in rows), default=float("nan"))
        result = (f"vs unsplit at s={'/'.join(map(str, splits))}: {'; '.join(parts)}; "
                  f"max abs diff {worst:.1e}")
    elif name.startswith("stage_") and data.exists():
        report = json.loads(data.read_text())
        methods = sorted({p["balance_method"] for p in report["predictions"] if p["splits"] > 1})

        def by_split(entries, value):  # "s=2 1.03/1.05, s=4 ..." in `methods` order
            out = {}
            for e in entries:
                if e["splits"] > 1:
                    out.setdefault(e["splits"], {})[e["balance_method"]] = value(e)
            return ", ".join(f"s={s} " + "/".join(v.get(m, "-") for m in methods)
                             for s, v in sorted(out.items()))

        base = next((p for p in report["predictions"]
                     if p["splits"] == 1 and "tokens_per_s" in p), None)
        speed = by_split(report["predictions"], lambda p: f"{p['tokens_per_s'] / base['tokens_per_s']:.2f}"
                         if base and "tokens_per_s" in p else "OOM")
        runs = report["stage_runs"]
        rank = min((r["rank"] for r in runs), default=None)
        mine = [r for r in runs if r["rank"] == rank]
        one = next((r for r in mine if r["splits"] == 1 and not r["oom"]), None)
        peak = by_split(mine, lambda r: "OOM" if r["oom"] or not one else
                        f"{r['activation_peak_bytes'] / one['activation_peak_bytes']:.2f}")
        result = (f"vs 1F1B ({'/'.join(methods)}): predicted tokens/s {speed or 'n/a'}; "
                  f"rank {rank} act. peak {peak or 'n/a'}")
    elif name.startswith("train_"):
        line = last(r"\[summary\]")
        if line:
            fields = dict(re.findall(r"(final lm loss|ms/iteration|tokens/s): ([0-9.eE+-]+)", line))
            result = ", ".join(f"{k} {v}" for k, v in fields.items()) or line
    elif name in ("tests", "multirank"):
        result = last(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b")
    else:
        result = lines[-1] if lines else None
except Exception as error:  # a truncated JSON: fall back to the log
    result = None
if rc in (124, 137):
    result = f"timed out after {limit} s (the budget's bound); " + (result or "")
elif rc != 0 and name not in ("tests", "multirank"):  # pytest's tally says it
    error = last(r"Error|error:|FAILED|Traceback|Killed|OOM|out of memory")
    result = (error or result or f"exit {rc}")
print((result or "no result line: see the log").replace("|", "/")[:220])
EOF
}

# run NAME NEED CAP CMD...: run CMD into $LOG_DIR/NAME.log if NEED seconds are left,
# bounded by `timeout` to CAP seconds and to what is left; remember a failure; go on.
run() {
    local name=$1 need=$2 cap=$3
    shift 3
    local limit
    limit=$(left)
    if [ "$limit" -lt "$need" ]; then
        local why="skipped: ${limit} s of the ${BUDGET} s budget left, it needs about ${need} s"
        echo "### $name: $why" | tee "$LOG_DIR/$name.log"
        row "$name" skipped 0 "$why"
        pack
        return 0
    fi
    [ "$limit" -gt "$cap" ] && limit=$cap
    echo "### $name (at most $limit s): $*" | tee "$LOG_DIR/$name.log"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    echo "### $name: exit $rc after $took s" | tee -a "$LOG_DIR/$name.log"
    [ "$rc" -eq 0 ] || status=1
    row "$name" "$rc" "$took" "$(result_line "$name" "$rc" "$limit")"
    pack
    return "$rc"
}

install_megatron_core() {
    run install 10 180 bash -c '"$0" tools/offline_install.py --wheels "$1" --target "$2" > "$3"' \
        "$PY" "${WHEELS:-.whl}" /tmp/gpu_checks_site "$LOG_DIR/site.txt" || return 1
    local site
    site=$(tail -n 1 "$LOG_DIR/site.txt")
    [ -n "$site" ] && export PYTHONPATH="$site:$PYTHONPATH"
    return 0
}

environment() {
    {
        date -u
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
            || echo "no nvidia-smi"
        "$PY" - <<'EOF'
import warnings
warnings.simplefilter("ignore")  # megatron-core's import warnings about optional packages
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("megatron.core", "flash_attn", "transformer_engine"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as error:  # not installed, or a broken build
        print(name, "unavailable:", type(error).__name__)
EOF
        git log -1 --format='commit %H %s' 2>/dev/null | cut -c1-120 || true
    } > "$LOG_DIR/environment.txt" 2>&1
    cat "$LOG_DIR/environment.txt"
}

phase_tests() {
    # the script's own tests (test_gpu_checks_*) run on CPU, not here
    run tests 60 "${1:-540}" "$PY" -m pytest -q -rA -p no:cacheprovider -k "not test_gpu_checks" \
        "tests/test_kv_cache_attention.py::test_split_attention_cuda_bf16" \
        "tests/test_document_attention.py::test_document_attention_cuda_bf16" \
        "tests/test_document_attention.py::test_flash_varlen_kernel_matches_sdpa_bf16" \
        "tests/test_sliding_window.py::test_split_window_attention_cuda_bf16" \
        "tests/test_attention_sinks.py::test_sinks_on_cuda_bf16" \
        "tests/test_mtp_flags.py::test_split_shifts_on_cuda" \
        tests/test_gpu_readiness_cuda.py tests/test_gpu_readiness_suite.py
}

phase_multirank() {
    run multirank 120 540 "$PY" -m pytest -q -rA -p no:cacheprovider -x -k "not test_gpu_checks" \
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
    run "train_$name" 40 180 "$PY" -m torch.distributed.run --nproc-per-node 1 \
        --master-port $((29500 + RANDOM % 1000)) pretrain_gpt.py "${flags[@]}"
}

compare_train() {  # compare_train PRECISION: s=1 vs s=4 buffer/chunked, one summary row
    local precision=$1 start=$SECONDS
    "$PY" - "$LOG_DIR" "$precision" <<'EOF' | tee -a "$LOG_DIR/train_summary.txt" > "$LOG_DIR/compare_$precision.txt"
import re, sys, pathlib
logs, precision = pathlib.Path(sys.argv[1]), sys.argv[2]
pattern = re.compile(r"lm loss: ([0-9.eE+-]+) \| grad norm: ([0-9.eE+-]+)")

def read(name):
    path = logs / f"train_{precision}_{name}.log"
    return pattern.findall(path.read_text()) if path.exists() else []

skipped = [f"train_{precision}_{name}" for name in ("s1", "s4_buffer", "s4_chunked")
           if not (logs / f"train_{precision}_{name}.log").exists()
           or ": skipped: " in (logs / f"train_{precision}_{name}.log").read_text()]
if skipped:
    print(f"{precision}: not compared, {' '.join(skipped)} skipped (budget)")
    sys.exit(3)
base, worst = read("s1"), {}
for name in ("s4_buffer", "s4_chunked"):
    other = read(name)
    if not base or len(base) != len(other):
        print(f"{precision} s=1 vs {name}: missing iterations ({len(base)} vs {len(other)})")
        worst[name] = float("inf")
        continue
    rel = max(abs(float(a) - float(b)) / abs(float(a))
              for pair in zip(base, other) for a, b in zip(*pair))
    worst[name] = rel
    print(f"{precision} s=1 vs {name}: (loss, grad norm) per iteration "
          f"{base} vs {other}; largest relative difference {rel:.2e}")
largest = ", ".join(f"{name} {rel:.1e}" for name, rel in worst.items())
if precision == "fp32":
    bad = [name for name, rel in worst.items() if not rel <= 1e-5]
    print(f"fp32 within 1e-5: {'yes' if not bad else 'NO ' + ' '.join(bad)} "
          f"(largest relative difference {largest})")
    sys.exit(1 if bad else 0)
print(f"{precision} side by side (no bound): largest relative difference {largest}")
EOF
    local rc=${PIPESTATUS[0]} exit
    cat "$LOG_DIR/compare_$precision.txt"
    exit=$rc
    if [ "$rc" -eq 3 ]; then exit=skipped; elif [ "$rc" -ne 0 ]; then status=1; fi
    local what=verdict
    [ "$precision" = fp32 ] || what=side_by_side
    row "train_${precision}_$what" "$exit" $((SECONDS - start)) "$(tail -n 1 "$LOG_DIR/compare_$precision.txt")"
    pack
}

phase_train() {
    local precisions=(fp32 bf16)
    [ "$SMOKE" = 1 ] && precisions=(fp32)  # bf16 training needs CUDA (a clear error on CPU)
    for precision in "${precisions[@]}"; do
        train_run "${precision}_s1" "$precision" 1 buffer
        train_run "${precision}_s4_buffer" "$precision" 4 buffer
        train_run "${precision}_s4_chunked" "$precision" 4 chunked
        compare_train "$precision"  # the fp32 verdict comes before any bf16 run
    done
    # packed documents + GQA (#22): the "auto" route (flash varlen or compiled flex)
    [ "$SMOKE" = 1 ] || train_run bf16_s4_documents_gqa bf16 4 buffer \
        --reset-attention-mask --group-query-attention --num-query-groups 4
}

phase_kv() {  # KV_LENGTHS="32768" runs only what an earlier call skipped
    local lengths extra=(--dtype bf16)
    read -ra lengths <<< "${KV_LENGTHS:-16384 32768}"
    [ "$SMOKE" = 1 ] && lengths=(256) extra=()
    for length in "${lengths[@]}"; do
        local need=60
        [ "$length" -gt 16384 ] && need=120
        run "kv_cache_$length" "$need" 300 "$PY" tools/bench_kv_cache.py \
            --seq-length "$length" --heads 32 --groups 8 --head-dim 128 --splits 2 4 8 \
            --repeats 5 "${extra[@]}" --json "$LOG_DIR/kv_cache_$length.json"
    done
}

stage() {  # stage NAME PP MICROBATCHES SEQ
    local name=$1 pp=$2 m=$3 seq=$4 model=(--model 7B --tp-shard 8 --p2p-gbps 360)
    [ "$SMOKE" = 1 ] && model=(--tiny) && seq=256
    run "stage_$name" 120 540 "$PY" tools/bench_stage_gpu.py "${model[@]}" --pp "$pp" \
        --microbatches "$m" --seq-length "$seq" --splits 1 2 4 8 \
        --json "$LOG_DIR/stage_$name.json"
}

phase_first() {
    phase_tests 180
    phase_train
    phase_kv  # each length only if the budget still has room for it
}

phase_stage16() { stage 7B_16k_pp4 4 8 16384; }
phase_stage32() { stage 7B_32k_pp4 4 8 32768; stage 7B_32k_pp8 8 16 32768; }
phase_stage32pp8() { stage 7B_32k_pp8 8 16 32768; }  # when stage32 had no time left for it
phase_stage64() { stage 7B_64k_pp4 4 8 65536; }

phase_smoke() {
    SMOKE=1
    phase_first
    stage tiny_pp4 4 8 256
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 2; }  # the header
for phase in "$@"; do
    if ! declare -F "phase_$phase" >/dev/null; then
        echo "unknown phase '$phase' (first, tests, multirank, train, kv, stage16, stage32," \
             "stage32pp8, stage64, smoke)"
        exit 2
    fi
done
echo "### gpu_checks $*: budget $BUDGET s; logs packed into $TARBALL, summary $SUMMARY"
if install_megatron_core; then
    environment
    for phase in "$@"; do
        "phase_$phase"
    done
else
    status=1
    row "(all phases)" skipped 0 "not run: the megatron-core install failed (see install.log)"
fi
finish
exit $status
