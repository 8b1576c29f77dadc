#!/usr/bin/env python
"""The README's results table, generated from benchmark files (rewrites the part of README.md between the
``<!-- results:start -->`` and ``<!-- results:end -->`` markers).

    python scripts/results_table.py

Each row names the benchmark file (under benchmarks/) and which part of it it shows; the files hold how each
measurement was made (command, settings, versions).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results:start -->", "<!-- results:end -->"
HF_DEVSET = "2026-12-05-demo-head-hf-devset.json"
VLLM_DEVSET = "2026-12-05-vllm-speed-k3-devset.json"
GEMMA_DEVSET = "2026-12-05-gemma3-270m-demo-eval.json"
# (what the row shows, file, how to read it)
ROWS = [
    ("our loop, EAGLE-2 tree (12 nodes) + prompt-lookup branch, fp32", HF_DEVSET, "tree"),
    ("our loop, chain of 3 drafts, fp32", HF_DEVSET, "chain"),
    ("vLLM 0.32 (CPU build), chain of 3, fp32, one request at a time", VLLM_DEVSET, ("float32", 3)),
    ("vLLM 0.32 (CPU build), chain of 3, bf16, one request at a time", VLLM_DEVSET, ("bfloat16", 3)),
    ("vLLM 0.32 (CPU build), chain of 3, fp32, all 80 prompts at once", VLLM_DEVSET, ("float32", 3, "batched")),
    ("Gemma 3 270M (pretrained) and its 30-minute demo head, our loop, tree + lookup, fp32", GEMMA_DEVSET, "tree"),
]


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _hf_row(report: dict[str, Any], chain: bool) -> list[str]:
    sets, overall = report["prompt_sets"], report["overall"]
    key = "chain_acceptance_length_mean" if chain else "acceptance_length_mean"
    match = overall["greedy_match_rate"]
    if chain:  # the chain's own output against plain decoding, prompt by prompt
        records = report["prompts"]
        match = sum(r.get("chain_first_mismatch") is None for r in records) / len(records)
    return [_fmt(sets["dev-chat"][key]), _fmt(sets["dev-code"][key]),
            _fmt(overall["chain_speedup" if chain else "speedup"], ".2f", "x"), _fmt(100 * match, ".0f", "%")]


def _vllm_row(data: dict[str, Any], dtype: str, k: int, batched: bool) -> list[str]:
    row = next(r for r in data["rows"] if r["dtype"] == dtype and r["k"] == k)
    if batched:
        b = data["reports"][f"{dtype}-k{k}"]["batched"]
        return ["-", "-", _fmt(b["speedup"], ".2f", "x"), _fmt(100 * b["greedy_match_rate"], ".0f", "%")]
    mm = row["mismatches"] or {}
    match = _fmt(100 * row["greedy_match_rate"], ".0f", "%")
    if mm.get("mismatched"):
        match += f" ({mm['near_ties']} near-ties)"
    return [_fmt(row["sets"]["dev-chat"]["tau"]), _fmt(row["sets"]["dev-code"]["tau"]),
            _fmt(row["speedup"], ".2f", "x"), match]


def table() -> str:
    lines = ["| engine and drafts | tau chat | tau code | speedup | output = plain decoding |", "|---|---|---|---|---|"]
    for label, name, how in ROWS:
        path = ROOT / "benchmarks" / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        cells = _hf_row(data, how == "chain") if isinstance(how, str) else _vllm_row(data, how[0], how[1], len(how) > 2)
        lines.append(f"| {label} ([data](benchmarks/{name})) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        print(f"README.md has no {START} ... {END} markers", file=sys.stderr)
        return 2
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    readme.write_text(f"{before}{START}\n{table()}\n{END}{after}", encoding="utf-8")
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
