#!/usr/bin/env python
"""Draw a pipeline timeline PNG from a timeline JSON file.

The file is the trace format of megatron/schedules/timeline.py (see docs/planner.md):
{"ranks": [[{"kind", "microbatch", "split", "chunk", "start", "end"}, ...], ...],
 "meta": {...}}, as written by a run with --timeline-file PATH or by
tools/plan.py --timeline-json PATH. Several files are stacked on one time axis.

    python tools/draw_timeline.py run.json -o picture/run_timeline.png
    python tools/draw_timeline.py a.json b.json -o compare.png --titles 1F1B Seq1F1B
    python tools/draw_timeline.py run.json --chrome run.chrome.json
    python tools/draw_timeline.py a.json b.json --memory a_mem.json b_mem.json -o both.png

--memory adds a panel under the timelines: stage 0's activation memory over time
(--memory-stage picks another stage), one curve per --activation-memory-file JSON,
labelled with the matching title.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.schedules.timeline import TraceFormatError, read_timeline, write_chrome_trace  # noqa: E402


def memory_curve(path, stage, label):
    """One stage's probe samples of an --activation-memory-file JSON as a panel curve."""
    with open(path) as handle:
        report = json.load(handle)["stages"][stage]
    if "sample_times" not in report:
        raise ValueError(f"{path} has no sample_times (written by an older probe)")
    return {"label": label, "times": report["sample_times"],
            "bytes": [live for _, live in report["samples"]]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tools/draw_timeline.py", description=__doc__.split("\n")[0])
    ap.add_argument("timelines", nargs="+", help="timeline JSON file(s)")
    ap.add_argument("-o", "--output", help="PNG path (default: first input with .png)")
    ap.add_argument("--titles", nargs="+", help="one title per input (default: meta.title or the file name)")
    ap.add_argument("--chrome", metavar="PATH", help="also write the first timeline as Chrome-trace JSON")
    ap.add_argument("--width", type=float, default=13.0, help="figure width in inches")
    ap.add_argument("--memory", nargs="+", metavar="JSON",
                    help="one --activation-memory-file JSON per timeline: memory panel")
    ap.add_argument("--memory-stage", type=int, default=0, help="pipeline stage of the panel")
    args = ap.parse_args(argv)
    timelines = []
    for path in args.timelines:
        try:
            timelines.append(read_timeline(path))
        except (OSError, TraceFormatError) as err:
            ap.exit(2, f"{ap.prog}: error: {path}: {err}\n")
    if args.titles and len(args.titles) != len(timelines):
        ap.exit(2, f"{ap.prog}: error: --titles needs {len(timelines)} titles\n")
    titles = args.titles or [
        tl.meta.get("title") or os.path.basename(path) for tl, path in zip(timelines, args.timelines)
    ]
    from megatron.planner.draw import draw_timelines

    memory = None
    if args.memory:
        if len(args.memory) != len(timelines):
            ap.exit(2, f"{ap.prog}: error: --memory needs {len(timelines)} files\n")
        try:
            memory = [memory_curve(path, args.memory_stage, title)
                      for path, title in zip(args.memory, titles)]
        except (OSError, ValueError, KeyError, IndexError) as err:
            ap.exit(2, f"{ap.prog}: error: --memory: {err!r}\n")
    out = args.output or os.path.splitext(args.timelines[0])[0] + ".png"
    draw_timelines(timelines, out, titles, width=args.width, memory=memory,
                   memory_title=f"stage {args.memory_stage}: live activation memory "
                                "(probe samples at unit boundaries)")
    print(f"wrote {out}")
    if args.chrome:
        write_chrome_trace(args.chrome, timelines[0])
        print(f"wrote {args.chrome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
