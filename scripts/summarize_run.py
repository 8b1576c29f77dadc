#!/usr/bin/env python
"""One benchmark record of a whole run (what a GPU session leaves behind): training throughput from
``train/metrics.jsonl``, the head's tau and speedup from ``eval/report.json``, the stage times from
``stages.json``; printed and written to ``benchmarks/<name>.json``.

    python scripts/summarize_run.py runs/smollm2-1gpu-short --name 2026-12-05-h200-recipe-a
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.fileio import write_json_atomic  # noqa: E402


def summarize(run_dir: Path) -> dict[str, Any]:
    """The numbers a session reports, from the run's own files (missing parts are None)."""
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    metrics = run_dir / "train" / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        train = [r for r in rows if r.get("event") == "train" and r.get("tokens_per_s")]
        later = train[len(train) // 2:] or train  # the first steps compile kernels
        out["train_tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in later) if later else None
        out["train_steps"] = max((r["step"] for r in train), default=None)
        evals = [r for r in rows if r.get("event") == "eval"]
        out["val_top1"] = {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("val_acc_")}
    report = run_dir / "eval" / "report.json"
    if report.is_file():
        data = json.loads(report.read_text())
        overall = data["overall"]
        out["eval"] = {
            "device": data.get("device_name") or data.get("device"), "dtype": data.get("dtype"),
            "tree": data.get("tree"), "prompts": overall["num_prompts"],
            "tau": {name: s["acceptance_length_mean"] for name, s in data["prompt_sets"].items()},
            "tau_chain": {name: s.get("chain_acceptance_length_mean") for name, s in data["prompt_sets"].items()},
            "speedup": overall["speedup"], "tokens_per_second": overall["tokens_per_second"],
            "baseline_tokens_per_second": overall["baseline_tokens_per_second"],
            "greedy_match_rate": overall["greedy_match_rate"], "greedy_mismatches": data.get("greedy_mismatches"),
        }
    stages = run_dir / "stages.json"
    if stages.is_file():
        out["stage_seconds"] = {k: v.get("seconds") for k, v in json.loads(stages.read_text()).items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--name", required=True, help="benchmarks/<name>.json")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks"))
    args = parser.parse_args()
    record = {"kind": "run-summary", "command": " ".join(sys.argv), **summarize(Path(args.run_dir))}
    print(json.dumps(record, indent=2))
    write_json_atomic(record, Path(args.out_dir) / f"{args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
