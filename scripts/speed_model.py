#!/usr/bin/env python
"""What tau a speedup needs, from evaluation reports already written (eagle.speed_model, fitted per report).

    python scripts/speed_model.py benchmarks/2026-12-06-run74-vllm-eval-fp32.json benchmarks/*-vllm-k-sweep.json

Each file is an ``eagle eval`` report (HF loop or vLLM) or a ``scripts/vllm_benchmark.py speed`` result (one
report per dtype and k). Per report: the line ``time per token / plain = a + b / tau`` over its prompts, the tau
that 1x, 1.5x and 2x need (comparable with the report's pooled tau: the tree's for our loop's tree, the chain's in
vLLM), the speedup if the longest path were accepted every step, and the head's own tau and speedup. Prints a
table, writes ``benchmarks/<name>.json`` and a PNG of speedup against tau (the fitted curves, the heads' points).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.fileio import write_json_atomic  # noqa: E402
from eagle.speed_model import fit_speed_model, record_points, speedup_at  # noqa: E402


def _reports(path: Path) -> list[tuple[str, dict[str, Any]]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if "reports" in data:
        return [(f"{path.stem} [{key}]", report) for key, report in data["reports"].items()]
    if "prompts" in data and "overall" in data:
        return [(path.stem, data)]
    raise SystemExit(f"{path}: neither an eval report nor a vllm_benchmark.py speed result")


def _top_tau(tree: dict[str, Any]) -> int:
    """The most tokens one step of the report's tree (or chain) accepts."""
    from dataclasses import fields

    from eagle.tree import TreeConfig, deepest_node

    names = {f.name for f in fields(TreeConfig)}
    return deepest_node(TreeConfig(**{k: v for k, v in tree.items() if k in names and v is not None})) + 1


def fit_row(name: str, report: dict[str, Any]) -> dict[str, Any] | None:
    """The speed model of one report with the head's measured point (None when it cannot be fitted)."""
    model = fit_speed_model(record_points(report["prompts"]), _top_tau(report["tree"]))
    if model is None:
        return None
    o = report["overall"]
    return {"report": name, "engine": report.get("engine", "hf"), "dtype": report.get("dtype"),
            "tree": report["tree"]["policy"], "tau": o["acceptance_length_mean"], "speedup": o["speedup"],
            "plain_tokens_per_second": o["baseline_tokens_per_second"], **model}


def _print(rows: list[dict[str, Any]]) -> str:
    head = (f"{'report':58} {'engine':6} {'top tau':>7} {'plain tok/s':>11} {'tau':>5} {'speedup':>7} {'R^2':>5} "
            f"{'tau 1x':>11} {'tau 1.5x':>11} {'tau 2x':>11} {'at top tau':>10}")
    lines = [head, "-" * len(head)]

    def tau(r: dict[str, Any], goal: str) -> str:
        v, se = r["tau_for"][goal], r["tau_for_se"][goal]
        return f"{'-':>11}" if v is None or v > r["top_tau"] else f"{v:5.2f} ± {se:.2f}"

    for r in rows:
        lines.append(
            f"{r['report'][:58]:58} {r['engine']:6} {r['top_tau']:>7} {_fmt(r['plain_tokens_per_second'], '11.1f')} "
            f"{_fmt(r['tau'], '5.2f')} {_fmt(r['speedup'], '6.2f')}x {_fmt(r['r2'], '5.2f')} {tau(r, '1x')} "
            f"{tau(r, '1.5x')} {tau(r, '2x')} {_fmt(r['speedup_at_top_tau'], '9.2f')}x"
        )
    text = "\n".join(lines)
    print(text)
    return text


def _fmt(value: float | None, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0] or 0)) if value is None else format(value, spec)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors
    for i, r in enumerate(rows):
        if not r["grows_with_tau"]:
            continue
        taus = [1.0 + (r["top_tau"] - 1.0) * j / 60 for j in range(61)]
        points = [(t, s) for t in taus if (s := speedup_at(t, r["fixed_share"], r["step_cost"])) is not None]
        color = colors[i % len(colors)]
        ax.plot([t for t, _ in points], [s for _, s in points], lw=1, color=color,
                label=f"{r['report'][:48]} ({r['plain_tokens_per_second']:.0f} tok/s)")
        if r["tau"] and r["speedup"]:
            ax.plot([r["tau"]], [r["speedup"]], "o", color=color)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(2.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="acceptance length tau", ylabel="speedup over plain decoding (same engine, same hour)",
           title="Speedup against tau, fitted per report (dots: the head as measured;\n"
                 "past the prompts' own taus the curves are extrapolations)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--name", default=None, help="benchmarks/<name>.json (default: print only)")
    args = parser.parse_args()
    rows = [row for path in args.reports for name, report in _reports(path)
            if (row := fit_row(name, report)) is not None]
    if not rows:
        raise SystemExit("no report had enough prompts with a plain run beside them to fit")
    table = _print(rows)
    if args.name:
        out = ROOT / "benchmarks" / f"{args.name}.json"
        write_json_atomic({"kind": "speed-model", "command": " ".join(sys.argv), "rows": rows, "table": table}, out)
        _plot(rows, ROOT / "benchmarks" / "vllm" / f"{args.name}.png")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
