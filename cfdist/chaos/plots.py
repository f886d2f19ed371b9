"""Figures of :class:`~cfdist.chaos.metrics.RunMetrics` (simulated or measured), as PNG files.

Each function takes a sequence of results (one per policy or run), writes one PNG to ``path``
and returns ``path``. Matplotlib runs on the Agg backend (no display needed); figures are
closed after saving, so the functions can be called in a loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cfdist.chaos.metrics import PHASES, RunMetrics  # noqa: E402

_PHASE_COLORS = {"detect": "#d62728", "wait": "#7f7f7f", "restart": "#ff7f0e", "restore": "#1f77b4",
                 "catchup": "#2ca02c"}


def _hours(results: Sequence[RunMetrics]) -> bool:
    return max((r.wall_s for r in results), default=0.0) >= 3 * 3600


def _ticks(results: Sequence[RunMetrics]) -> list[str]:
    return [r.label.replace(" (", "\n(") for r in results]  # "auto (k=28)" on two lines


def _check(results: Sequence[RunMetrics]) -> None:
    if not results:
        raise ValueError("nothing to plot: pass at least one result")


def draw_progress(ax, results: Sequence[RunMetrics], simulated: Sequence[RunMetrics] | None = None) -> None:
    """Progress (steps) against wall time, one line per result, failures marked with x.

    ``simulated``: one simulated run per result (same order), drawn dashed in its colour.
    """
    scale, unit = (3600.0, "h") if _hours(results) else (1.0, "s")
    for i, r in enumerate(results):
        xs, ys = [t / scale for t, _ in r.progress], [s for _, s in r.progress]
        (line,) = ax.plot(xs, ys, lw=1.2, label=r.label)
        ax.plot([f.time_s / scale for f in r.failures], [f.step for f in r.failures], "x",
                color=line.get_color(), ms=4, mew=1)
        if simulated is not None:
            sim = simulated[i]
            ax.plot([t / scale for t, _ in sim.progress], [s for _, s in sim.progress], "--", lw=0.9,
                    color=line.get_color(), alpha=0.7)
    if simulated is not None:
        ax.plot([], [], "--", color="gray", lw=0.9, label="simulated")
    ax.set_xlabel(f"wall time ({unit})")
    ax.set_ylabel("training step")
    ax.set_title("progress (x = failure)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def draw_goodput(ax, results: Sequence[RunMetrics], predicted: Sequence[float] | None = None) -> None:
    """Goodput per result, as bars labelled with their value; ``predicted`` values as diamonds."""
    bars = ax.bar(_ticks(results), [r.goodput for r in results], color="#4c72b0",
                  label="measured" if predicted is not None else None)
    ax.bar_label(bars, fmt="%.2f", fontsize="small", label_type="center", color="white")
    if predicted is not None:
        ax.plot(range(len(results)), list(predicted), "D", color="#dd8452", ms=6, label="simulated")
        ax.legend(fontsize="small", loc="upper right")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("goodput (vs failure-free)")
    ax.set_title("goodput")
    ax.tick_params(axis="x", labelsize="small")


def draw_lost_work(ax, results: Sequence[RunMetrics]) -> None:
    """Lost iterations per failure: bar = mean, dots = each failure."""
    bars = ax.bar(_ticks(results), [r.lost_iters_mean for r in results], width=0.55, color="#dd8452", alpha=0.8)
    ax.bar_label(bars, fmt="%.0f", fontsize="small")
    for i, r in enumerate(results):  # beside the bar, clear of its label
        ax.plot([i + 0.36] * r.num_failures, r.lost_iters, ".", color="k", ms=3, alpha=0.5)
    ax.set_ylabel("iterations lost per failure")
    ax.set_title("lost work per failure (bar: mean, dots: each)")
    ax.tick_params(axis="x", labelsize="small")


def draw_recovery(ax, results: Sequence[RunMetrics]) -> None:
    """Mean recovery time per failure, stacked by phase (detect, wait, restart, restore, catch-up)."""
    labels = _ticks(results)
    means = [r.phase_means() for r in results]
    bottom = [0.0] * len(results)
    for p in PHASES:
        vals = [m[p] for m in means]
        if p == "wait" and not any(vals):
            continue
        ax.bar(labels, vals, bottom=bottom, color=_PHASE_COLORS[p], label=p.replace("catchup", "catch-up"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds per failure (mean)")
    ax.set_title("recovery time")
    ax.legend(fontsize="small")
    ax.tick_params(axis="x", labelsize="small")


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _one(draw, results: Sequence[RunMetrics], path: str, size: tuple[float, float]) -> str:
    _check(results)
    fig, ax = plt.subplots(figsize=size, dpi=100)
    draw(ax, results)
    return _save(fig, path)


def plot_progress(results: Sequence[RunMetrics], path: str, simulated: Sequence[RunMetrics] | None = None) -> str:
    """PNG of progress vs wall time with failures marked (``simulated`` runs dashed)."""
    return _one(lambda ax, rs: draw_progress(ax, rs, simulated), results, path, (7, 4))


def plot_goodput(results: Sequence[RunMetrics], path: str, predicted: Sequence[float] | None = None) -> str:
    """PNG of goodput per result (bars; ``predicted`` as diamonds)."""
    return _one(lambda ax, rs: draw_goodput(ax, rs, predicted), results, path, (5, 3.5))


def plot_lost_work(results: Sequence[RunMetrics], path: str) -> str:
    """PNG of lost iterations per failure."""
    return _one(draw_lost_work, results, path, (5, 3.5))


def plot_recovery(results: Sequence[RunMetrics], path: str) -> str:
    """PNG of the recovery-time breakdown (stacked bars)."""
    return _one(draw_recovery, results, path, (5, 3.5))


def plot_summary(results: Sequence[RunMetrics], path: str, *, title: str | None = None, dpi: int = 80,
                 simulated: Sequence[RunMetrics] | None = None, predicted: Sequence[float] | None = None) -> str:
    """One PNG with all four panels (progress, goodput, lost work, recovery).

    ``simulated`` (runs, same order) adds dashed progress lines; ``predicted`` (goodputs) diamonds.
    """
    _check(results)
    for name, extra in (("simulated", simulated), ("predicted", predicted)):
        if extra is not None and len(extra) != len(results):
            raise ValueError(f"{name} has {len(extra)} entries for {len(results)} results; pass one per result")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=dpi)
    draw_progress(axes[0][0], results, simulated)
    draw_goodput(axes[0][1], results, predicted)
    draw_lost_work(axes[1][0], results)
    draw_recovery(axes[1][1], results)
    if title:
        fig.suptitle(title, fontsize="medium")
    return _save(fig, path)
