"""The numbers of an evaluation: per-prompt runs summed into the report's fields, and the table that shows them.

tau (``acceptance_length_*``) counts tokens per verification forward (accepted drafts + 1); the prefill forward
that makes the first token is counted apart (``prefill_forwards``). ``acceptance_length_mean`` pools all
verification steps; ``acceptance_length_median`` is the median of the per-prompt means. ``chain_*`` are the same
for a chain of drafts (what an engine without tree attention gets from the head).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle.exactness import first_mismatch
from eagle.speculate import GenerationResult
from eagle.speed_model import describe


@dataclass
class PromptRun:
    """The three methods' results on one prompt."""

    set_name: str
    prompt_id: str
    prompt_tokens: int
    spec: GenerationResult
    plain: GenerationResult | None = None
    lookup_tokens: list[int] | None = None
    lookup_time: float = 0.0
    prompt_ids: list[int] | None = None
    mismatch: dict[str, Any] | None = None  # eagle.exactness.diagnose_mismatch, greedy runs that differ
    chain: GenerationResult | None = None  # speculative decoding with a chain of eval.chain_depth drafts
    turn: int = 1  # of a multi-turn question (MT-bench): the later turns follow the target's own answers
    category: str | None = None  # the question's category, where the prompt set has them (MT-bench's 8)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: Sequence[PromptRun], temperature: float) -> dict[str, Any]:
    """Aggregate prompt runs into the report fields (see the module docstring for the definitions)."""
    steps = [n for r in runs for n in r.spec.accept_lengths]
    forwards = sum(r.spec.target_forwards for r in runs)
    depth = max((len(r.spec.accepted_per_depth) for r in runs), default=0)
    per_depth = [0] * depth
    for r in runs:
        for d, n in enumerate(r.spec.accepted_per_depth):
            per_depth[d] += n
    hist = [0] * (depth + 1)
    for n in steps:
        if n - 1 >= len(hist):
            hist.extend([0] * (n - len(hist)))
        hist[n - 1] += 1
    new_tokens = sum(len(r.spec.tokens) for r in runs)
    spec_time = sum(r.spec.total_time for r in runs)
    tps = _rate(new_tokens, spec_time)
    per_prompt_tau = [r.spec.mean_accept_length for r in runs if r.spec.accept_lengths]

    plains = [r.plain for r in runs if r.plain is not None]
    base_tps = None
    if plains and len(plains) == len(runs):
        base_tps = _rate(sum(len(p.tokens) for p in plains), sum(p.total_time for p in plains))
    greedy = temperature <= 0 and base_tps is not None
    matches = [r.spec.tokens == r.plain.tokens for r in runs] if greedy else []

    lookups = [r for r in runs if r.lookup_tokens is not None]
    pld_tps = None
    if lookups and len(lookups) == len(runs):
        pld_tps = _rate(sum(len(r.lookup_tokens) for r in lookups), sum(r.lookup_time for r in lookups))
    pld_matches = (
        [r.lookup_tokens == r.plain.tokens for r in lookups] if greedy and pld_tps is not None else []
    )

    return {
        "num_prompts": len(runs),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "prefill_forwards": len(runs),
        "acceptance_length_mean": sum(steps) / len(steps) if steps else None,
        "acceptance_length_median": statistics.median(per_prompt_tau) if per_prompt_tau else None,
        "per_depth_acceptance": [n / forwards for n in per_depth] if forwards else [0.0] * depth,
        "accept_length_histogram": hist,
        "tokens_per_second": tps,
        "baseline_tokens_per_second": base_tps,
        "speedup": _ratio(tps, base_tps),
        "greedy_match_rate": sum(matches) / len(matches) if matches else None,
        "prompt_lookup_tokens_per_second": pld_tps,
        "prompt_lookup_speedup": _ratio(pld_tps, base_tps),
        "prompt_lookup_match_rate": sum(pld_matches) / len(pld_matches) if pld_matches else None,
        "time_s": spec_time,
        "draft_time_s": sum(r.spec.draft_time for r in runs),
        "verify_time_s": sum(r.spec.verify_time for r in runs),
        "prefill_time_s": sum(r.spec.prefill_time for r in runs),
        "baseline_time_s": sum(p.total_time for p in plains) if plains else None,
        "prompt_lookup_time_s": sum(r.lookup_time for r in lookups) if lookups else None,
        **chain_summary([r.chain for r in runs], base_tps),
    }


def chain_summary(chains: Sequence[GenerationResult | None], base_tps: float | None) -> dict[str, Any]:
    """The ``chain_*`` report fields: acceptance of a chain of drafts (what an engine without trees gets)."""
    if not chains or any(c is None for c in chains):
        return {"chain_acceptance_length_mean": None, "chain_per_depth_acceptance": None,
                "chain_tokens_per_second": None, "chain_speedup": None}
    steps = [n for c in chains for n in c.accept_lengths]
    forwards = sum(c.target_forwards for c in chains)
    depth = max(len(c.accepted_per_depth) for c in chains)
    per_depth = [sum(c.accepted_per_depth[d] for c in chains if d < len(c.accepted_per_depth))
                 for d in range(depth)]
    tps = _rate(sum(len(c.tokens) for c in chains), sum(c.total_time for c in chains))
    return {
        "chain_acceptance_length_mean": sum(steps) / len(steps) if steps else None,
        "chain_per_depth_acceptance": [n / forwards for n in per_depth] if forwards else [0.0] * depth,
        "chain_accepted_per_depth": per_depth,
        "chain_target_forwards": forwards,
        "chain_tokens_per_second": tps,
        "chain_speedup": _ratio(tps, base_tps),
    }


def breakdown(runs: Sequence[PromptRun], temperature: float) -> dict[str, Any]:
    """Per prompt set with categories or several turns (MT-bench): the summary of each category and each turn,
    in the order they first appear."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r.set_name for r in runs):
        mine = [r for r in runs if r.set_name == name]
        categories = list(dict.fromkeys(r.category for r in mine if r.category is not None))
        turns = sorted({r.turn for r in mine})
        if not categories and turns == [1]:
            continue
        out[name] = {
            "category": {c: summarize([r for r in mine if r.category == c], temperature) for c in categories},
            "turn": {str(t): summarize([r for r in mine if r.turn == t], temperature) for t in turns},
        }
    return out


def prompt_record(r: PromptRun) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "set": r.set_name,
        "id": r.prompt_id,
        "prompt_tokens": r.prompt_tokens,
        "new_tokens": len(r.spec.tokens),
        "target_forwards": r.spec.target_forwards,
        "acceptance_length_mean": r.spec.mean_accept_length if r.spec.accept_lengths else None,
        "time_s": r.spec.total_time,
        "turn": r.turn,
    }
    if r.category is not None:
        rec["category"] = r.category
    if r.plain is not None:
        rec["baseline_new_tokens"] = len(r.plain.tokens)
        rec["baseline_time_s"] = r.plain.total_time
        rec["first_mismatch"] = first_mismatch(r.spec.tokens, r.plain.tokens)
        if r.mismatch is not None:
            for key in ("logit_gap", "near_tie", "plain_token", "spec_token"):
                rec[f"first_mismatch_{key}"] = r.mismatch[key]
    if r.chain is not None:
        rec["chain_acceptance_length_mean"] = r.chain.mean_accept_length if r.chain.accept_lengths else None
        rec["chain_time_s"] = r.chain.total_time
        if r.plain is not None:
            rec["chain_first_mismatch"] = first_mismatch(r.chain.tokens, r.plain.tokens)
    if r.lookup_tokens is not None:
        rec["prompt_lookup_new_tokens"] = len(r.lookup_tokens)
        rec["prompt_lookup_time_s"] = r.lookup_time
    return rec


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_report_table(report: dict[str, Any], console: Any = None) -> None:
    """One row per prompt set plus overall: tau mean/median, tokens/s (spec, plain, PLD), speedups, match; then
    the tau each speedup goal needs here (eagle.speed_model), when the report has that fit."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    tree = report["tree"]
    size = f", {tree['total_tokens']} tokens" if tree["policy"] == "dynamic" else ""
    if tree.get("lookup_ngram"):
        size += f" + lookup branch of {tree['lookup_tokens']}" if tree.get("lookup_tokens") else " + lookup branch"
    if tree.get("verification") == "chain":
        size += ", one path verified a step (recurrent state)"
    table = Table(
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        collapse_padding=True,
        title=f"eagle eval: {report['target']} on {report['device']} (tree {tree['policy']}, depth {tree['depth']}"
        f"{size}, T={report['settings']['temperature']})",
    )
    table.add_column("set", no_wrap=True)
    for col in (
        "n",
        "tau\nmean",
        "tau\nmedian",
        "tau\nchain",
        "tok/s\nspec",
        "tok/s\nplain",
        "tok/s\nPLD",
        "speedup",
        "PLD\nspeedup",
        "greedy\nmatch",
    ):
        table.add_column(col, justify="right")
    rows = list(report["prompt_sets"].items()) + [("overall", report["overall"])]
    for name, s in rows:
        table.add_row(
            name,
            str(s["num_prompts"]),
            _fmt(s["acceptance_length_mean"]),
            _fmt(s["acceptance_length_median"]),
            _fmt(s.get("chain_acceptance_length_mean")),
            _fmt(s["tokens_per_second"], ".1f"),
            _fmt(s["baseline_tokens_per_second"], ".1f"),
            _fmt(s["prompt_lookup_tokens_per_second"], ".1f"),
            _fmt(s["speedup"], ".2f", "x"),
            _fmt(s["prompt_lookup_speedup"], ".2f", "x"),
            _fmt(None if s["greedy_match_rate"] is None else 100 * s["greedy_match_rate"], ".0f", "%"),
        )
    console.print(table)
    for name, parts in (report.get("breakdown") or {}).items():
        print_breakdown_table(name, parts, console)
    speed_line = describe(report.get("speed_model"), "chain tau" if tree["policy"] == "chain" else "tree tau")
    if speed_line:
        console.print(speed_line, highlight=False)


def print_breakdown_table(name: str, parts: dict[str, Any], console: Any) -> None:
    """A multi-turn or categorised set the way speculative-decoding papers show it: one column per category and
    per turn, rows for tau (tree and chain) and the speedups."""
    from rich import box
    from rich.table import Table

    columns = {**parts["category"], **{f"turn {t}": s for t, s in parts["turn"].items()}}
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True,
                  title=f"{name}: by category and turn")
    table.add_column("", no_wrap=True)
    for col in columns:
        table.add_column(col.replace("_", " ").replace(" ", "\n", 1), justify="right")
    rows = (("n", "num_prompts", "d", ""), ("tau", "acceptance_length_mean", ".2f", ""),
            ("tau chain", "chain_acceptance_length_mean", ".2f", ""), ("speedup", "speedup", ".2f", "x"),
            ("PLD speedup", "prompt_lookup_speedup", ".2f", "x"))
    for label, key, spec, suffix in rows:
        if any(s.get(key) is not None for s in columns.values()):  # a method that did not run gets no row
            table.add_row(label, *(_fmt(s.get(key), spec, suffix) for s in columns.values()))
    console.print(table)


def versions() -> dict[str, Any]:
    """The library versions and the date, for a report's header."""
    import datetime
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    try:
        eagle_version = version("eagle-heads")
    except PackageNotFoundError:
        eagle_version = None
    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "eagle_version": eagle_version,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
