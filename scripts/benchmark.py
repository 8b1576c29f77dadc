#!/usr/bin/env python
"""Benchmark a trained draft head on the public development set (dev-chat + dev-code).

Runs ``eagle eval`` at temperature 0 (and, with ``--temperature X``, a second sampled run), writes each result
to ``benchmarks/<name>.json`` and regenerates the results table in ``benchmarks/README.md`` from ALL
``benchmarks/*.json``. Plots land beside the full evaluation reports under ``runs/benchmarks/<name>/``.

    python scripts/benchmark.py --draft runs/demo/export
    python scripts/benchmark.py --draft runs/demo/export --device cuda --dtype bfloat16 --temperature 0.7
    python scripts/benchmark.py --table-only          # only rebuild benchmarks/README.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
START, END = "<!-- results:start -->", "<!-- results:end -->"
REGEN_START, REGEN_END = "<!-- regen:start -->", "<!-- regen:end -->"
VLLM_START, VLLM_END = "<!-- vllm:start -->", "<!-- vllm:end -->"
BATCH_START, BATCH_END = "<!-- vllm-batch:start -->", "<!-- vllm-batch:end -->"
README_HEAD = f"""# Benchmarks

Speculative decoding with trained draft heads on the public development set: `dev-chat` (40 chitchat
conversations, first user turn) and `dev-code` (HumanEval problems 40-79), see `eagle/data/`.
tau = tokens per target verification forward (accepted drafts + 1); speedup = tokens/s of speculative
decoding over plain decoding of the same target in the same run; PLD = transformers' prompt-lookup decoding;
greedy match = prompts whose speculative output equals plain greedy decoding token for token (temperature 0).
PLD always decodes greedily, so at T > 0 its speedup compares greedy lookup decoding with plain sampling.

Regenerate with `python scripts/benchmark.py --draft DIR` (one new result) or `--table-only`.

{START}
{END}
"""


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _percent(share: float | None) -> str:
    """A share as a whole percentage ("-" when not measured)."""
    return _fmt(None if share is None else 100 * share, ".0f", "%")


def _tree_text(tree: dict[str, Any]) -> str:
    lookup = ""
    if tree.get("lookup_ngram"):
        lookup = f" + lookup {tree['lookup_tokens']}" if tree.get("lookup_tokens") else " + lookup"
    if tree.get("policy") == "chain":
        return f"chain d{tree['depth']}{lookup}"
    if tree.get("policy") == "static":
        return f"static {tree.get('tree_tokens')} nodes{lookup}"
    auto = " (auto)" if tree.get("total_tokens_requested") == "auto" else ""
    return f"dynamic d{tree['depth']} k{tree['top_k']} n{tree['total_tokens']}{auto}{lookup}"


def _prompts_text(report: dict[str, Any]) -> str:
    """``40+40 x 64`` (prompts per set x new tokens), or ``-`` when the report does not say."""
    counts = [str(v["num_prompts"]) for v in report.get("prompt_sets", {}).values() if "num_prompts" in v]
    tokens = report.get("settings", {}).get("max_new_tokens")
    return f"{'+'.join(counts)} x {tokens}" if counts and tokens else "-"


def _draft_dtype_text(report: dict[str, Any]) -> str:
    """``, bfloat16 head`` when the head drafted in another dtype than the target's (``eval.draft_dtype``)."""
    draft = report.get("settings", {}).get("draft_dtype")
    return f", {draft} head" if draft and draft != report.get("dtype") else ""


def table_row(name: str, report: dict[str, Any]) -> str:
    """One markdown table row for a benchmark result."""
    sets = report.get("prompt_sets", {})
    overall = report.get("overall", {})
    match = overall.get("greedy_match_rate")
    device = report.get("device_name") or report.get("device", "?")
    if report.get("settings", {}).get("cpu_prepacked_layers"):
        device += " prepacked"
    if report.get("engine") == "vllm":  # `eagle eval --engine vllm`: the head served by vLLM, not our loop
        device = f"vLLM {report.get('vllm_version', '')} {device}".replace("  ", " ")
    cells = [
        str(report.get("date", "?"))[:10],
        name,
        f"`{report.get('head', '?')}`",
        str(report.get("target", "?")),
        f"{device} {report.get('dtype', '')}{_draft_dtype_text(report)}".strip(),
        _tree_text(report.get("tree", {})),
        _prompts_text(report),
        _fmt(report.get("settings", {}).get("temperature"), "g"),
        _fmt(sets.get("dev-chat", {}).get("acceptance_length_mean")),
        _fmt(sets.get("dev-code", {}).get("acceptance_length_mean")),
        _fmt(overall.get("speedup"), ".2f", "x"),
        _fmt(overall.get("prompt_lookup_speedup"), ".2f", "x"),
        _percent(match),
    ]
    return "| " + " | ".join(cells) + " |"


def read_reports(bench_dir: Path) -> list[tuple[Path, dict]]:
    """Every ``*.json`` in ``bench_dir`` that holds a JSON object, by file name."""
    reports = []
    for path in sorted(bench_dir.glob("*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(report, dict):
            reports.append((path, report))
    return reports


def render_table(reports: list[tuple[Path, dict]]) -> str:
    """The markdown results table built from the evaluation reports among ``reports`` (oldest first)."""
    rows = []
    for path, report in reports:
        if "overall" not in report:
            continue
        rows.append((str(report.get("date", "")), path.stem, table_row(path.stem, report)))
    header = (
        "| date | name | head | target | device | tree | prompts x tokens | T | tau chat | tau code | speedup "
        "| PLD speedup | greedy match |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header] + [r for _, _, r in sorted(rows)])


def _of_kind(reports: list[tuple[Path, dict]], kind: str) -> list[tuple[Path, dict]]:
    """The benchmark JSONs written by one script (their ``kind``), in the given order."""
    return [(path, report) for path, report in reports if report.get("kind") == kind]


def render_regen_table(reports: list[tuple[Path, dict]]) -> str:
    """The regeneration-throughput table (``scripts/regen_benchmark.py``'s JSONs), one row per engine and file."""
    rows = ["| file | engine | conversations | answer tokens | seconds | conv/s | answer tok/s | features kept "
            "| answers identical to hf |", "|---|---|---|---|---|---|---|---|---|"]
    for path, report in _of_kind(reports, "regen-throughput"):
        for engine, r in report["engines"].items():
            same = r.get("answers_identical_to_hf")
            rows.append(
                f"| {path.stem} | {engine} | {r['conversations']:,} | {r['answer_tokens']:,} | {r['seconds']:.0f} "
                f"| {r['conversations_per_s']:.2f} | {r['tokens_per_s']:.0f} | {'yes' if r['capture_features'] else 'no'} "
                f"| {'-' if same is None else f'{same:,}'} |"
            )
    return "\n".join(rows)


def _per_prompt_speedup(report: dict[str, Any]) -> str:
    """Mean and standard error of the prompts' own speedups: how far apart two rows must be to differ."""
    ratios = [p["baseline_time_s"] / p["time_s"] * p["new_tokens"] / p["baseline_new_tokens"]
              for p in report.get("prompts", []) if p.get("time_s") and p.get("baseline_new_tokens")]
    if len(ratios) < 2:
        return "-"
    return f"{statistics.mean(ratios):.2f} ± {statistics.stdev(ratios) / len(ratios) ** 0.5:.2f}"


def _tau_for_2x(report: dict[str, Any], k: int) -> str:
    """The chain tau (comparable with the tau column) at which that row's engine, machine and hour would give 2x,
    from eagle.speed_model fitted on the report's prompts, and the speedup at tau = k + 1."""
    from eagle.speed_model import fit_speed_model, record_points

    model = fit_speed_model(record_points(report.get("prompts", [])), k + 1)
    if model is None or not model["grows_with_tau"]:
        return "-"
    need, se = model["tau_for"]["2x"], model["tau_for_se"]["2x"]
    shown = "out of reach" if need is None or need > k + 1 else f"{need:.2f} ± {se:.2f}"
    return f"{shown} ({_fmt(model['speedup_at_top_tau'], '.2f', 'x')})"


def render_vllm_table(reports: list[tuple[Path, dict]]) -> str:
    """The exported head inside vLLM (``scripts/vllm_benchmark.py speed``'s JSONs), one row per dtype and k."""
    rows = ["| file | head | dtype | k | vLLM steps | prompts | tau | pos 1 | tok/s plain | tok/s head | speedup "
            "| per-prompt speedup | batched speedup | output = plain | tau for 2x (speedup at tau = k + 1) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, data in _of_kind(reports, "vllm-speed"):
        for row in data["rows"]:
            report = data["reports"][f"{row['dtype']}-k{row['k']}"]
            eager = report["settings"]["vllm"].get("enforce_eager")
            match = _percent(row.get("greedy_match_rate"))
            first = (row.get("per_position") or [None])[0]
            mm = row.get("mismatches") or {}
            if mm.get("mismatched"):
                others = f", {mm['not_near_ties']} not" if mm.get("not_near_ties") else ""
                match += f" ({mm['near_ties']} near-ties{others})"
            rows.append(
                f"| {path.stem} | `{data['draft']}` | {row['dtype']} | {row['k']} | {'eager' if eager else 'compiled'} "
                f"| {len(report.get('prompts', []))} | {_fmt(row.get('tau'))} | {_fmt(first)} "
                f"| {_fmt(row.get('tok_s_plain'), '.1f')} | {_fmt(row.get('tok_s_spec'), '.1f')} "
                f"| {_fmt(row.get('speedup'), '.2f', 'x')} | {_per_prompt_speedup(report)} "
                f"| {_fmt(row.get('batched_speedup'), '.2f', 'x')} | {match} "
                f"| {_tau_for_2x(report, row['k'])} |"
            )
    return "\n".join(rows)


def render_batch_table(reports: list[tuple[Path, dict]]) -> str:
    """The head in vLLM by concurrent requests (``scripts/vllm_benchmark.py schedule``'s JSONs)."""
    from eagle.batch_schedule import drafted_text

    rows = ["| file | head | dtype | k | requests at once | tok/s plain | tok/s head | speedup | schedule found "
            "| with the schedule | output = plain | drafts per token (always / with the schedule) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, data in _of_kind(reports, "vllm-batch-schedule"):
        for row in data["rows"]:
            drafts = drafted_text(row.get("drafts_per_token"), row.get("drafts_per_token_scheduled"))
            rows.append(
                f"| {path.stem} | `{data['draft']}` | {row['dtype']} | {data['k']} | {row['batch_size']} "
                f"| {_fmt(row.get('tok_s_plain'), '.1f')} | {_fmt(row.get('tok_s_head'), '.1f')} "
                f"| {_fmt(row.get('speedup'), '.2f', 'x')} | `{data['schedules'].get(row['dtype'])}` "
                f"| {_fmt(row.get('speedup_scheduled'), '.2f', 'x')} | {_percent(row.get('greedy_match_rate'))} "
                f"| {drafts} |"
            )
    return "\n".join(rows)


def _replace_between(text: str, start: str, end: str, body: str, title: str) -> str:
    if start not in text or end not in text:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{start}\n{end}\n"
    before, rest = text.split(start, 1)
    return f"{before}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def update_readme(bench_dir: Path) -> Path:
    """Rewrite the parts of ``bench_dir/README.md`` between the table markers (creating the file if needed)."""
    from eagle.fileio import write_text_atomic

    readme = bench_dir / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else README_HEAD
    reports = read_reports(bench_dir)
    text = _replace_between(text, START, END, render_table(reports), "Results")
    text = _replace_between(text, REGEN_START, REGEN_END, render_regen_table(reports),
                            "Regeneration throughput (`scripts/regen_benchmark.py`)")
    text = _replace_between(text, VLLM_START, VLLM_END, render_vllm_table(reports),
                            "The head inside vLLM (`scripts/vllm_benchmark.py speed`)")
    text = _replace_between(text, BATCH_START, BATCH_END, render_batch_table(reports),
                            "The head inside vLLM by batch size (`scripts/vllm_benchmark.py schedule`)")
    write_text_atomic(text, readme)
    return readme


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower()


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of the benchmark script."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--draft", default="runs/demo/export", help="exported draft directory (default: %(default)s)"
    )
    p.add_argument(
        "--target", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 (default: %(default)s)")
    p.add_argument("--max-prompts", type=int, default=None, help="per prompt set (default: all 40)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--temperature", type=float, default=None, help="also run sampled decoding at this temperature"
    )
    p.add_argument("--policy", default="dynamic", choices=["chain", "dynamic"])
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument(
        "--total-tokens", default="auto", type=_budget, help="dynamic tree node budget or 'auto' (default)"
    )
    p.add_argument(
        "--lookup-ngram", type=int, default=0, help="add a prompt-lookup branch to every tree (0 = off)"
    )
    p.add_argument(
        "--lookup-tokens", type=int, default=0, help="length of the lookup branch (0 = the tree's depth)"
    )
    p.add_argument(
        "--cpu-prepack",
        action="store_true",
        help="oneDNN prepacked linear layers on a CPU (eval.cpu_prepack)",
    )
    p.add_argument(
        "--draft-dtype",
        default="auto",
        help="dtype the head drafts in (eval.draft_dtype): auto (bf16 on a CPU with bf16 units), float32, bfloat16",
    )
    p.add_argument("--no-prompt-lookup", action="store_true", help="skip the prompt-lookup comparison")
    p.add_argument("--name", default=None, help="result name (default: <date>-<target>-<device>)")
    p.add_argument("--out-dir", default=str(BENCH_DIR), help="where result JSONs and README.md live")
    p.add_argument("--table-only", action="store_true", help="only regenerate README.md from the JSONs")
    return p


def run(args: argparse.Namespace) -> list[Path]:
    """Evaluate, write the result JSON(s), regenerate the table; returns the JSON paths written."""
    from eagle.embedded import EMBEDDED_TARGET
    from eagle.evaluate import EvalConfig, evaluate
    from eagle.fileio import write_json_atomic
    from eagle.targets import TargetConfig, load_target
    from eagle.tree import TreeConfig

    tree = TreeConfig(
        policy=args.policy,
        depth=args.depth,
        top_k=args.top_k,
        total_tokens=args.total_tokens,
        lookup_ngram=args.lookup_ngram,
        lookup_tokens=args.lookup_tokens,
    )
    target = load_target(
        TargetConfig(name=args.target or EMBEDDED_TARGET, dtype=args.dtype, device=args.device)
    )
    date = datetime.date.today().isoformat()
    name = _slug(args.name or f"{date}-{target.name.split('/')[-1]}-{args.device}")
    out_dir = Path(args.out_dir)
    runs = [(name, 0.0)]
    if args.temperature:
        runs.append((f"{name}-t{args.temperature:g}", args.temperature))
    written = []
    for run_name, temperature in runs:
        cfg = EvalConfig(
            draft=args.draft,
            prompts=["dev-chat", "dev-code"],
            max_prompts=args.max_prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=temperature,
            tree=tree,
            prompt_lookup=not args.no_prompt_lookup,
            cpu_prepack=args.cpu_prepack,
            draft_dtype=args.draft_dtype,
            report=str(ROOT / "runs" / "benchmarks" / run_name / "report.json"),
        )
        report = evaluate(cfg, target)
        # the sampled run reuses the size the greedy run tuned, so that both rows describe one tree
        tree = replace(tree, total_tokens=report["tree"]["total_tokens"])
        report["benchmark"] = {"name": run_name, "commit": _commit(), "argv": sys.argv[1:]}
        written.append(write_json_atomic(report, out_dir / f"{run_name}.json"))
    update_readme(out_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors print one line and exit 2."""
    from eagle.errors import EagleError

    args = build_parser().parse_args(argv)
    try:
        if args.table_only:
            print(f"updated {update_readme(Path(args.out_dir))}")
            return 0
        for path in run(args):
            print(f"wrote {path}")
        print(f"updated {Path(args.out_dir) / 'README.md'}")
    except EagleError as exc:
        print(f"benchmark: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
