#!/usr/bin/env python
"""What tau a speedup needs, from evaluation reports already written (eagle.speed_model, fitted per report).

    python scripts/speed_model.py benchmarks/2026-12-06-run74-vllm-eval-fp32.json benchmarks/*-vllm-k-sweep.json

Each file is an ``eagle eval`` report (HF loop or vLLM) or a ``scripts/vllm_benchmark.py speed`` result (one
report per dtype and k). Per report: the line ``time per token / plain = a + b / tau`` over its prompts, the tau
that 1x, 1.5x and 2x need, the speedup if every draft were accepted, and the head's own tau and speedup. Prints a
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
from eagle.speed_model import fit_speed_model, max_tau, record_points, speedup_at  # noqa: E402


def _reports(path: Path) -> list[tuple[str, dict[str, Any]]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if "reports" in data:
        return [(f"{path.stem} [{key}]", report) for key, report in data["reports"].items()]
    if "prompts" in data and "overall" in data:
        return [(path.stem, data)]
    raise SystemExit(f"{path}: neither an eval report nor a vllm_benchmark.py speed result")


def fit_row(name: str, report: dict[str, Any]) -> dict[str, Any] | None:
    tree = report["tree"]
    top = max_tau(tree["depth"], tree.get("lookup_ngram") or 0, tree.get("lookup_tokens") or 0)
    model = fit_speed_model(record_points(report["prompts"]), top)
    if model is None:
        return None
    o = report["overall"]
    return {"report": name, "engine": report.get("engine", "hf"), "dtype": report.get("dtype"),
            "tree": report["tree"]["policy"], "depth": report["tree"]["depth"],
            "tau": o["acceptance_length_mean"], "speedup": o["speedup"],
            "plain_tokens_per_second": o["baseline_tokens_per_second"], **model}


def _print(rows: list[dict[str, Any]]) -> str:
    head = (f"{'report':58} {'engine':6} {'k':>2} {'plain tok/s':>11} {'tau':>5} {'speedup':>7} {'R^2':>5} "
            f"{'tau 1x':>6} {'tau 1.5x':>8} {'tau 2x':>6} {'all accepted':>12}")
    lines = [head, "-" * len(head)]

    def tau(v: float | None, top: float) -> str:
        return "   -  " if v is None or v > top else f"{v:6.2f}"

    for r in rows:
        need, top = r["tau_for"], r["max_tau"]
        lines.append(
            f"{r['report'][:58]:58} {r['engine']:6} {r['depth']:>2} {r['plain_tokens_per_second']:11.1f} "
            f"{r['tau']:5.2f} {r['speedup']:6.2f}x {r['r2']:5.2f} {tau(need['1x'], top)} {tau(need['1.5x'], top):>8} "
            f"{tau(need['2x'], top)} {r['speedup_at_max_tau'] or 0:11.2f}x"
        )
    text = "\n".join(lines)
    print(text)
    return text


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        taus = [1.0 + (r["max_tau"] - 1.0) * i / 60 for i in range(61)]
        speeds = [speedup_at(t, r["fixed_share"], r["step_cost"]) for t in taus]
        line = ax.plot(taus, speeds, lw=1, label=f"{r['report'][:48]} ({r['plain_tokens_per_second']:.0f} tok/s)")[0]
        ax.plot([r["tau"]], [r["speedup"]], "o", color=line.get_color())
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(2.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="acceptance length tau", ylabel="speedup over plain decoding (same engine, same hour)",
           title="Speedup against tau, fitted per report (dots: the head as measured)")
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
