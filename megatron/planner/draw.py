"""Pictures: pipeline timelines, memory over time, predicted vs published memory.

All functions write PNG files with matplotlib's Agg backend (no display needed).
A timeline is drawn from ``trace.Timeline`` (simulated or recorded): one row per
pipeline rank (rank 0 on top), one box per unit, coloured by microbatch (forward
light, backward dark and hatched), labelled ``microbatch.split`` (plus ``cN`` for
virtual chunk N) where the box is wide enough; idle time (bubbles) is the grey
background between boxes. Units paired by SlimPipe's attention redistribution
(records with ``role`` and ``peer``) get a red outline and a red line to the partner.
"""

from typing import Dict, List, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megatron.schedules.timeline import Timeline  # noqa: E402

IDLE = "#d9d9d9"
PAIR = "#d62728"


def microbatch_color(mb: int):
    cmap = plt.get_cmap("tab10" if mb < 10 else "tab20")
    return to_rgb(cmap(mb % cmap.N))


def _lighten(rgb, amount=0.55):
    return tuple(c + (1 - c) * amount for c in rgb)


def _time_unit(span: float):
    if span >= 10:
        return 1.0, "s"
    if span >= 0.01:
        return 1e3, "ms"
    if span >= 1e-5:
        return 1e6, "us"
    return 1.0, "time units"


def _draw_rows(ax, timeline: Timeline, scale: float, origin: float, label_min: float):
    p = timeline.pp_size
    for rank, events in enumerate(timeline.ranks):
        y = p - 1 - rank
        ax.barh(y, timeline.span * scale, left=0, height=0.8, color=IDLE, linewidth=0)
        for e in events:
            color = microbatch_color(e["microbatch"])
            fwd = e["kind"] == "F"
            left = (e["start"] - origin) * scale
            width = (e["end"] - e["start"]) * scale
            paired = "peer" in e
            ax.barh(
                y, width, left=left, height=0.8,
                color=_lighten(color) if fwd else color,
                edgecolor=PAIR if paired else "black", linewidth=1.2 if paired else 0.4,
                hatch=None if fwd else "///",
            )
            if paired and e.get("role") == "ask":
                x, y_peer = left + width / 2, p - 1 - e["peer"]
                ax.plot([x, x], [y, y_peer], color=PAIR, linewidth=1.0, zorder=5)
            if width >= label_min * 0.45:
                text = f"{e['microbatch']}.{e['split']}"
                if e.get("chunk"):
                    text += f"c{e['chunk']}"
                ax.text(
                    left + width / 2, y, text, ha="center", va="center",
                    fontsize=6, color="black" if fwd else "white",
                    rotation=0 if width >= label_min + (4 if e.get("chunk") else 0) * label_min / 16 else 90,
                    bbox=None if fwd else dict(facecolor=color, edgecolor="none", pad=0.2),
                )
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
    ax.set_ylim(-0.6, p - 0.4)


def draw_timelines(
    timelines: Sequence[Timeline],
    path: str,
    titles: Optional[Sequence[str]] = None,
    suptitle: Optional[str] = None,
    width: float = 13.0,
    dpi: int = 90,
    memory: Optional[Sequence[Dict]] = None,
    memory_title: str = "",
) -> str:
    """Draw one or more timelines stacked on a shared time axis; returns ``path``.

    ``memory``: optional curves for a panel under the timelines, on the same time
    axis: dicts with ``label``, ``times`` (s from the timeline's origin) and ``bytes``
    (e.g. an activation-memory probe's samples of one stage)."""
    spans = [t.span for t in timelines]
    span = max(spans) if spans else 1.0
    scale, unit = _time_unit(span)
    heights = [max(t.pp_size, 1) * 0.42 + 0.9 for t in timelines]
    if memory:
        heights.append(2.2)
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(width, sum(heights) + 0.9), sharex=True,
        gridspec_kw={"height_ratios": heights}, squeeze=False,
    )
    if memory:
        _draw_memory_panel(axes[-1, 0], memory, scale, memory_title)
    # a label ("12.3") needs about 16 pixels at font size 6
    label_min = span * scale * 16.0 / (width * dpi * 0.85)
    for i, (ax, tl) in enumerate(zip(axes[:, 0], timelines)):
        origin = min((e["start"] for r in tl.ranks for e in r), default=0.0)
        _draw_rows(ax, tl, scale, origin, label_min)
        title = titles[i] if titles else tl.meta.get("title", "")
        title = f"{title}   (bubble {tl.bubble_fraction():.1%}, span {tl.span * scale:,.1f} {unit})"
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlim(0, span * scale * 1.005)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    legend = [
        Patch(facecolor=_lighten(microbatch_color(0)), edgecolor="black", label="forward (mb.split)"),
        Patch(facecolor=microbatch_color(0), edgecolor="black", hatch="///", label="backward"),
        Patch(facecolor=IDLE, label="idle (bubble)"),
    ]
    if any("peer" in e for tl in timelines for r in tl.ranks for e in r):
        legend.append(Patch(facecolor="white", edgecolor=PAIR, linewidth=1.2,
                            label="attention redistribution pair"))
    fig.legend(handles=legend, loc="upper right", ncol=len(legend), fontsize=8, frameon=False)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _draw_memory_panel(ax, memory: Sequence[Dict], scale: float, title: str):
    cmap = plt.get_cmap("tab10")
    for i, curve in enumerate(memory):
        ax.step([t * scale for t in curve["times"]], [b / 2**20 for b in curve["bytes"]],
                where="post", color=cmap(i % cmap.N), label=curve.get("label", ""),
                linewidth=1.2)
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="upper right")


def draw_timeline(timeline: Timeline, path: str, title: Optional[str] = None, **kw) -> str:
    """Draw one timeline (simulated or recorded) to a PNG; returns ``path``."""
    return draw_timelines([timeline], path, [title] if title else None, **kw)


def draw_memory(
    series: Sequence[Dict],
    path: str,
    capacity_gb: Optional[float] = None,
    usable_gb: Optional[float] = None,
    title: str = "",
    dpi: int = 90,
) -> str:
    """Memory over time per pipeline stage.

    ``series``: one dict per stage with ``times`` (s), ``totals_gb`` (static +
    dynamic memory, GB) and optionally ``label``.
    """
    fig, ax = plt.subplots(figsize=(10, 4.2))
    span = max((s["times"][-1] for s in series if s["times"]), default=1.0)
    scale, unit = _time_unit(span)
    cmap = plt.get_cmap("viridis")
    n = len(series)
    for i, s in enumerate(series):
        ax.step(
            [t * scale for t in s["times"]], s["totals_gb"], where="post",
            color=cmap(i / max(n - 1, 1)), label=s.get("label", f"stage {i}"), linewidth=1.3,
        )
    if capacity_gb is not None:
        ax.axhline(capacity_gb, color="red", linestyle="--", linewidth=1, label=f"GPU memory {capacity_gb:.0f} GB")
    if usable_gb is not None:
        ax.axhline(usable_gb, color="orange", linestyle=":", linewidth=1, label=f"usable {usable_gb:.0f} GB")
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def memory_series(prediction) -> List[Dict]:
    """``draw_memory`` input from a ``predict.Prediction`` (static + simulated dynamic)."""
    out = []
    for rank, trace in enumerate(prediction.sim.memory):
        static = sum(prediction.cost.static_memory(rank).values())
        out.append(
            {
                "times": list(trace.times),
                "totals_gb": [(static + v) / 1024**3 for v in trace.totals],
                "label": f"stage {rank}",
            }
        )
    return out


def draw_memory_comparison(rows: Sequence[Dict], path: str, capacity_gb: float = 80.0,
                           title: str = "", dpi: int = 90) -> str:
    """Grouped bars: predicted vs published peak memory.

    ``rows``: dicts with ``label``, ``predicted`` (GB) and ``published`` (GB or
    None for out of memory).
    """
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(rows) + 2), 4.2))
    xs = range(len(rows))
    pred = [r["predicted"] for r in rows]
    pub = [r["published"] if r["published"] is not None else 0 for r in rows]
    ax.bar([x - 0.2 for x in xs], pred, width=0.4, color="#4c72b0", label="predicted")
    ax.bar([x + 0.2 for x in xs], pub, width=0.4, color="#dd8452", label="published")
    for x, r in zip(xs, rows):
        if r["published"] is None:
            ax.text(x + 0.2, 1, "OOM", ha="center", va="bottom", fontsize=7, rotation=90, color="#dd8452")
    ax.axhline(capacity_gb, color="red", linestyle="--", linewidth=1, label=f"{capacity_gb:.0f} GB")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["label"] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("peak memory per GPU (GB)")
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
