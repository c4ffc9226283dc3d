"""Benchmarks: 1F1B vs Seq1F1B side by side (tools/bench.py, tools/bench_stage_gpu.py)."""
