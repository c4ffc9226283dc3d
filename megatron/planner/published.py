"""Predictions next to the published Seq1F1B figures, and the pictures in picture/.

The paper (arXiv 2406.03488) reports peak memory and TFLOP/s without every layout
detail; the layouts below are our assumptions (docs/planner.md says why):

* 2.7B on 8 A100 80GB: TP 1, PP 8, DP 1, micro-batch 1, 16 microbatches
  (interleaving only costs memory when m > p), 2 layers per virtual stage.
* 7B on 32 A100 80GB: TP 8 with sequence parallelism, PP 4, DP 1, micro-batch 1,
  8 microbatches (the paper's throughput runs), 4 layers per virtual stage.

No recomputation, no distributed optimizer (DP 1), flash attention, bf16.
``python tools/plan.py --compare-published`` prints the tables;
``python tools/plan.py --make-figures picture`` draws the pictures.
"""

import os
from dataclasses import replace
from typing import Dict, List, Optional

from megatron.planner.costs import Parallel
from megatron.planner.draw import (
    draw_memory,
    draw_memory_comparison,
    draw_timelines,
    memory_series,
)
from megatron.planner.gpus import GIB
from megatron.planner.predict import PlanConfig, predict
from megatron.planner.presets import get_preset
from megatron.schedules.timeline import from_simulation

LAYOUTS = {
    "2.7B": dict(gpus=8, tp=1, pp=8, dp=1, sp=False, gbs=16, layers_per_virtual=2),
    "7B": dict(gpus=32, tp=8, pp=4, dp=1, sp=True, gbs=8, layers_per_virtual=4),
}

# (model, seq, {schedule: GB or None = out of memory})
PUBLISHED_MEMORY = [
    ("2.7B", 16384, {"1f1b": 51, "interleaved-1f1b": 71, "seq1f1b": 30}),
    ("2.7B", 24576, {"1f1b": 74, "interleaved-1f1b": None, "seq1f1b": 41}),
    ("2.7B", 32768, {"1f1b": None, "interleaved-1f1b": None, "seq1f1b": 53}),
    ("7B", 32768, {"1f1b": 28, "interleaved-1f1b": 34, "seq1f1b": 19}),
    ("7B", 65536, {"1f1b": 51, "interleaved-1f1b": 63, "seq1f1b": 34}),
    ("7B", 131072, {"1f1b": None, "interleaved-1f1b": None, "seq1f1b": 70}),
]

# 7B on 32 A100s, TFLOP/s per GPU
PUBLISHED_TFLOPS = [
    ("7B", 32768, {"1f1b": 99.7, "interleaved-1f1b": 109.6, "seq1f1b": 110.6}),
    ("7B", 65536, {"1f1b": 107.5, "interleaved-1f1b": 120.0, "seq1f1b": 124.6}),
    ("7B", 131072, {"1f1b": None, "interleaved-1f1b": None, "seq1f1b": 136.7}),
]

SCHEDULE_NAMES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved", "seq1f1b": "Seq1F1B"}


def published_config(model: str, seq: int, schedule: str, splits: int = 1,
                     balance: str = "average", kv_layout: str = "buffer") -> PlanConfig:
    lay = LAYOUTS[model]
    spec = get_preset(model)
    chunks = 1
    if schedule == "interleaved-1f1b":
        chunks = spec.num_layers // lay["pp"] // lay["layers_per_virtual"]
    par = Parallel(
        tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], num_chunks=chunks, micro_batch_size=1,
        global_batch_size=lay["gbs"] * lay["dp"], sequence_parallel=lay["sp"],
    )
    return PlanConfig(
        spec, seq, par, schedule, splits if schedule == "seq1f1b" else 1,
        balance_method=balance, kv_layout=kv_layout, gpu="a100-80g",
    )


def compare_memory(split_counts=(2, 4)) -> List[Dict]:
    """One row per published memory figure (Seq1F1B once per split count)."""
    rows = []
    for model, seq, figures in PUBLISHED_MEMORY:
        for schedule, published in figures.items():
            variants = split_counts if schedule == "seq1f1b" else (1,)
            for s in variants:
                pred = predict(published_config(model, seq, schedule, s))
                concat = (
                    predict(published_config(model, seq, schedule, s, kv_layout="concat"))
                    if schedule == "seq1f1b" else pred
                )
                rows.append(
                    dict(
                        model=model, gpus=LAYOUTS[model]["gpus"], seq=seq, schedule=schedule,
                        splits=s, published=published,
                        predicted=pred.peak_memory_gb, predicted_oom=pred.oom,
                        predicted_reserved=pred.peak_reserved_gb,
                        predicted_concat=concat.peak_memory_gb, concat_oom=concat.oom,
                        stage0=pred.stages[0],
                    )
                )
    return rows


def compare_tflops(split_counts=(2, 4)) -> List[Dict]:
    rows = []
    for model, seq, figures in PUBLISHED_TFLOPS:
        for schedule, published in figures.items():
            variants = split_counts if schedule == "seq1f1b" else (1,)
            for s in variants:
                pred = predict(published_config(model, seq, schedule, s, "uniform_comp"))
                rows.append(
                    dict(model=model, seq=seq, schedule=schedule, splits=s, published=published,
                         tflops=pred.tflops_per_gpu, tflops_full=pred.tflops_per_gpu_full_attention,
                         bubble=pred.bubble_fraction, oom=pred.oom)
                )
    return rows


def _gb(value: Optional[float], oom: bool = False) -> str:
    if value is None:
        return "X"
    return f"{value:.1f}" + (" (OOM)" if oom else "")


def memory_table_markdown(rows: List[Dict]) -> str:
    out = [
        "| model, GPUs | seq | schedule | published GB | predicted allocated GB (buffer KV) | predicted reserved GB (buffer KV) | predicted allocated GB (concat KV) | stage 0: weights+grads+optim / activations / KV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = SCHEDULE_NAMES[r["schedule"]] + (f" s={r['splits']}" if r["schedule"] == "seq1f1b" else "")
        st = r["stage0"]
        static = st["weights"] + st["gradients"] + st["optimizer"]
        concat = _gb(r["predicted_concat"], r["concat_oom"]) if r["schedule"] == "seq1f1b" else "="
        out.append(
            f"| {r['model']}, {r['gpus']} | {r['seq'] // 1024}k | {name} | {_gb(r['published'])} | "
            f"{_gb(r['predicted'])} | {_gb(r['predicted_reserved'], r['predicted_oom'])} | "
            f"{concat} | "
            f"{static:.1f} / {st['activations']:.1f} / {st['kv_cache']:.1f} |"
        )
    return "\n".join(out)


def tflops_table_markdown(rows: List[Dict]) -> str:
    out = [
        "| seq | schedule | published TFLOP/s | predicted (causal FLOPs) | predicted (full-attention formula) | predicted bubble |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = SCHEDULE_NAMES[r["schedule"]] + (
            f" s={r['splits']} uniform_comp" if r["schedule"] == "seq1f1b" else "")
        pub = "OOM" if r["published"] is None else f"{r['published']:.1f}"
        oom = " (OOM)" if r["oom"] else ""
        out.append(
            f"| {r['seq'] // 1024}k | {name} | {pub} | {r['tflops']:.1f}{oom} | "
            f"{r['tflops_full']:.1f} | {r['bubble']:.1%} |"
        )
    return "\n".join(out)


def make_figures(outdir: str) -> List[str]:
    """Draw the pictures the docs and README show; returns the written paths."""
    os.makedirs(outdir, exist_ok=True)
    written = []

    # 1. 1F1B vs Seq1F1B (average and uniform_comp) on one time axis.
    lay = dict(tp=1, pp=4, dp=1, micro_batch_size=1, global_batch_size=4)
    spec = get_preset("2.7B")
    base = PlanConfig(spec, 16384, Parallel(**lay), "1f1b", 1)
    preds = [
        predict(base),
        predict(replace(base, schedule="seq1f1b", splits=4)),
        predict(replace(base, schedule="seq1f1b", splits=4, balance_method="uniform_comp")),
    ]
    titles = [
        "1F1B",
        "Seq1F1B, 4 splits, average (later splits attend longer prefixes: unequal boxes)",
        "Seq1F1B, 4 splits, uniform_comp (equal-FLOP splits)",
    ]
    titles = [
        f"{t}: peak {p.peak_memory_gb:.1f} GB, {p.tokens_per_s:,.0f} tokens/s"
        for t, p in zip(titles, preds)
    ]
    path = os.path.join(outdir, "timeline_1f1b_vs_seq1f1b.png")
    draw_timelines([from_simulation(p.sim) for p in preds], path, titles, width=16.0,
                   suptitle="2.7B, seq 16k, PP 4, 4 microbatches, A100 80GB (simulated)")
    written.append(path)

    # 2. Interleaved 1F1B next to 1F1B (virtual stages), 8 microbatches.
    lay8 = dict(lay, global_batch_size=8)
    one8 = predict(PlanConfig(spec, 16384, Parallel(**lay8), "1f1b", 1))
    inter = predict(PlanConfig(spec, 16384, Parallel(num_chunks=2, **lay8), "interleaved-1f1b", 1))
    path = os.path.join(outdir, "timeline_interleaved.png")
    draw_timelines(
        [from_simulation(one8.sim), from_simulation(inter.sim)], path,
        [f"1F1B: peak {one8.peak_memory_gb:.1f} GB, {one8.tokens_per_s:,.0f} tokens/s",
         f"interleaved 1F1B, 2 virtual stages (label mb.split cN = chunk N): peak "
         f"{inter.peak_memory_gb:.1f} GB, {inter.tokens_per_s:,.0f} tokens/s"],
        width=16.0,
        suptitle="2.7B, seq 16k, PP 4, 8 microbatches, A100 80GB (simulated)",
    )
    written.append(path)

    # 3. Memory over time per stage for a published configuration: 2.7B, 32k, 8 GPUs.
    for schedule, s in (("1f1b", 1), ("seq1f1b", 4)):
        pred = predict(published_config("2.7B", 32768, schedule, s))
        name = "1F1B" if s == 1 else f"Seq1F1B s={s}"
        path = os.path.join(outdir, f"memory_2.7B_32k_{schedule}.png")
        verdict = "OUT OF MEMORY" if pred.oom else "fits"
        draw_memory(memory_series(pred), path, pred.gpu.memory_gib, pred.gpu.usable_bytes / GIB,
                    f"2.7B, seq 32k, TP1 PP8, 16 microbatches, {name}: peak "
                    f"{pred.peak_memory_gb:.1f} GB ({verdict}; published: "
                    f"{'X' if s == 1 else '53 GB'})")
        written.append(path)
        if schedule == "seq1f1b":
            path = os.path.join(outdir, "timeline_2.7B_32k_seq1f1b.png")
            draw_timelines([from_simulation(pred.sim)], path,
                           [f"2.7B seq 32k TP1 PP8, 16 microbatches, Seq1F1B s={s}"],
                           width=16.0, dpi=72)
            written.append(path)

    # 4. Predicted vs published peak memory.
    rows = compare_memory(split_counts=(2, 4))
    bars = [
        dict(
            label=f"{r['model']} {r['seq'] // 1024}k {SCHEDULE_NAMES[r['schedule']]}"
            + (f" s={r['splits']}" if r["schedule"] == "seq1f1b" else ""),
            predicted=r["predicted"], published=r["published"],
        )
        for r in rows
    ]
    path = os.path.join(outdir, "published_memory.png")
    draw_memory_comparison(bars, path, 80.0,
                           "Peak memory per GPU: planner vs Seq1F1B paper "
                           "(2.7B: TP1 PP8; 7B: TP8 PP4 SP; layouts assumed)")
    written.append(path)
    return written
