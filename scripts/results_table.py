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
MTBENCH = "2026-12-08-demo-config-head-mtbench.json"  # one head: its dev-set and MT-bench reports
MT_START, MT_END = "<!-- mtbench:start -->", "<!-- mtbench:end -->"
# (what the row shows, file, how to read it)
ROWS = [
    ("our loop, EAGLE-2 tree (12 nodes) + prompt-lookup branch, fp32", HF_DEVSET, "tree"),
    ("our loop, chain of 3 drafts, fp32", HF_DEVSET, "chain"),
    ("vLLM 0.32 (CPU build), chain of 3, fp32, one request at a time", VLLM_DEVSET, ("float32", 3)),
    ("vLLM 0.32 (CPU build), chain of 3, bf16, one request at a time", VLLM_DEVSET, ("bfloat16", 3)),
    ("vLLM 0.32 (CPU build), chain of 3, fp32, all 80 prompts at once", VLLM_DEVSET, ("float32", 3, "batched")),
    ("Gemma 3 270M (pretrained) and its 30-minute demo head, our loop, tree + lookup, fp32", GEMMA_DEVSET, "tree"),
    ("the demo's config at fixed work (982 answers, 12 epochs), our loop, tree + lookup, fp32 (tau only)", MTBENCH,
     "mtbench"),
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
    return [_fmt(sets["dev-chat"][key]), _fmt(sets["dev-code"][key]), "-",
            _fmt(overall["chain_speedup" if chain else "speedup"], ".2f", "x"), _fmt(100 * match, ".0f", "%")]


def _mtbench_row(data: dict[str, Any]) -> list[str]:
    """A head's dev-set tau (its dev report) beside its MT-bench tau (both turns), speedup and greedy match (where
    plain decoding ran on MT-bench)."""
    dev, mt = data["dev"]["prompt_sets"], data["mt_bench"]["overall"]
    return [_fmt(dev["dev-chat"]["acceptance_length_mean"]), _fmt(dev["dev-code"]["acceptance_length_mean"]),
            _fmt(mt["acceptance_length_mean"]), _fmt(mt["speedup"], ".2f", "x"),
            _fmt(None if mt["greedy_match_rate"] is None else 100 * mt["greedy_match_rate"], ".0f", "%")]


def mtbench_table() -> str:
    """MT-bench per category and per turn (benchmarks/README.md): tau, speedup where plain decoding ran, turns."""
    path = ROOT / "benchmarks" / MTBENCH
    if not path.is_file():
        return ""
    parts = json.loads(path.read_text(encoding="utf-8"))["mt_bench"]["breakdown"]["mt-bench"]
    columns = {**parts["category"], **{f"turn {t}": v for t, v in parts["turn"].items()}}
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    rows = [("tau", "acceptance_length_mean", ".2f", ""), ("speedup", "speedup", ".2f", "x"),
            ("turns", "num_prompts", "d", "")]
    for label, key, spec, suffix in rows:
        if any(v.get(key) is not None for v in columns.values()):  # speedup only where plain decoding ran
            lines.append(f"| {label} | " + " | ".join(_fmt(v.get(key), spec, suffix) for v in columns.values()) + " |")
    return "\n".join(lines)


def _vllm_row(data: dict[str, Any], dtype: str, k: int, batched: bool) -> list[str]:
    row = next(r for r in data["rows"] if r["dtype"] == dtype and r["k"] == k)
    if batched:
        b = data["reports"][f"{dtype}-k{k}"]["batched"]
        return ["-", "-", "-", _fmt(b["speedup"], ".2f", "x"), _fmt(100 * b["greedy_match_rate"], ".0f", "%")]
    mm = row["mismatches"] or {}
    match = _fmt(100 * row["greedy_match_rate"], ".0f", "%")
    if mm.get("mismatched"):
        match += f" ({mm['near_ties']} near-ties)"
    return [_fmt(row["sets"]["dev-chat"]["tau"]), _fmt(row["sets"]["dev-code"]["tau"]), "-",
            _fmt(row["speedup"], ".2f", "x"), match]


def table() -> str:
    lines = ["| engine and drafts | tau chat | tau code | tau MT-bench | speedup | output = plain decoding |",
             "|---|---|---|---|---|---|"]
    for label, name, how in ROWS:
        path = ROOT / "benchmarks" / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        if how == "mtbench":
            cells = _mtbench_row(data)
        elif isinstance(how, str):
            cells = _hf_row(data, how == "chain")
        else:
            cells = _vllm_row(data, how[0], how[1], len(how) > 2)
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
    bench = ROOT / "benchmarks" / "README.md"
    text = bench.read_text(encoding="utf-8")
    if MT_START in text and MT_END in text and mtbench_table():
        before, rest = text.split(MT_START, 1)
        bench.write_text(f"{before}{MT_START}\n{mtbench_table()}\n{MT_END}{rest.split(MT_END, 1)[1]}", encoding="utf-8")
        print(mtbench_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
