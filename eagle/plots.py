"""Evaluation plots (PNG, matplotlib's Agg canvas: no display and no pyplot global state needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eagle.fileio import save_figure_atomic

ACCEPT_HIST = "accept_hist.png"
ACCEPT_BY_DEPTH = "accept_by_depth.png"


def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    return save_figure_atomic(fig, path)


def plot_accept_hist(histograms: Mapping[str, Sequence[int]], path: str | os.PathLike) -> Path:
    """Bar chart of how often each accepted length (tokens per verification step) occurred, per prompt set.

    ``histograms[name][k]`` counts steps that produced k + 1 tokens; bars are normalised to fractions.
    """
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    names = [n for n, h in histograms.items() if sum(h) > 0]
    longest = max((len(histograms[n]) for n in names), default=1)
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        counts = list(histograms[name])
        total = sum(counts)
        xs = [k + 1 + (j - (len(names) - 1) / 2) * width for k in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width=width, label=name)
    ax.set_xticks(list(range(1, longest + 1)))
    ax.set_xlabel("tokens per verification step (accepted drafts + 1)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted length per step")
    if names:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no verification steps", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_accept_by_depth(per_depth: Mapping[str, Sequence[float]], path: str | os.PathLike) -> Path:
    """Line chart: fraction of verification steps in which a draft at depth d was accepted, per prompt set."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    longest = 1
    for name, rates in per_depth.items():
        rates = list(rates)
        if not rates:
            continue
        longest = max(longest, len(rates))
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xticks(list(range(1, longest + 1)))
    ax.set_ylim(0.0, 1.05)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("fraction of steps accepting that depth")
    ax.set_title("Acceptance by depth")
    if any(per_depth.values()):
        ax.legend()
    return _save(fig, path)


def write_eval_plots(report: Mapping[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """Both plots of an evaluation report (its per-set and overall summaries) into ``out_dir``; returns paths."""
    sections = dict(report.get("prompt_sets", {}))
    if len(sections) > 1 and "overall" in report:
        sections["overall"] = report["overall"]
    hists = {name: s.get("accept_length_histogram", []) for name, s in sections.items()}
    depths = {name: s.get("per_depth_acceptance") or [] for name, s in sections.items()}
    out = Path(out_dir)
    return {
        "accept_hist": str(plot_accept_hist(hists, out / ACCEPT_HIST)),
        "accept_by_depth": str(plot_accept_by_depth(depths, out / ACCEPT_BY_DEPTH)),
    }
