#!/usr/bin/env python
"""An exported head inside vLLM: speed per dtype, chain length and batch size, and parity with our loop per layout.

    python scripts/vllm_benchmark.py speed --draft runs/demo/export --dtypes bfloat16 float32 --k 2 3 4 5 6
    python scripts/vllm_benchmark.py parity --draft eagle3=runs/demo/export speculators=DIR eagle1=DIR

``speed``: one vLLM worker per dtype holds the target alone and the target with the head drafting k = ... tokens
a step (one engine per k); every prompt is decoded by each engine in turn (one request at a time), then all
prompts at once. Prints a table, writes ``benchmarks/<name>.json`` (the table's numbers and every report) and a
PNG of tokens/s and tau against k.

``parity``: for every export, vLLM (chain of ``--k``) and our HF loop (a chain of the same length, the head in
the target's dtype) on the same prompts; per-position acceptance side by side and the parity verdict
(eagle.vllm_eval.parity). Exit status 1 when any layout fails.

    python scripts/vllm_benchmark.py schedule --draft runs/demo/export --dtypes float32 --batch-sizes 1 2 4 8 16

``schedule``: tokens/s with the head and without by concurrent requests (the prompts in groups of each batch
size), the batch-size schedule that keeps the head where it pays (eagle.batch_schedule), and the head served
with that schedule over the same batch sizes. Table, ``benchmarks/<name>.json`` and a PNG of speedup by batch size.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.batch_schedule import drafted_text  # noqa: E402
from eagle.evaluate import EvalConfig  # noqa: E402
from eagle.fileio import write_json_atomic  # noqa: E402


def _cfg(args: argparse.Namespace, draft: str, report: str) -> EvalConfig:
    cfg = EvalConfig(draft=draft, prompts=list(args.prompts), max_prompts=args.prompts_per_set,
                     max_new_tokens=args.max_new_tokens, report=report, prompt_lookup=False, warmup=1)
    cfg.vllm = replace(cfg.vllm, kv_cache_gb=args.kv_cache_gb, enforce_eager=args.enforce_eager)
    return cfg


def _row(dtype: str, k: int, report: dict[str, Any]) -> dict[str, Any]:
    o, b = report["overall"], report.get("batched") or {}
    return {
        "dtype": dtype, "k": k, "tau": o["acceptance_length_mean"], "per_position": o["per_depth_acceptance"],
        "tok_s_spec": o["tokens_per_second"], "tok_s_plain": o["baseline_tokens_per_second"],
        "speedup": o["speedup"], "batched_tok_s_spec": b.get("tokens_per_second"),
        "batched_tok_s_plain": b.get("baseline_tokens_per_second"), "batched_speedup": b.get("speedup"),
        "greedy_match_rate": o["greedy_match_rate"],
        "mismatches": report.get("greedy_mismatches"),
        "sets": {name: {"tau": s["acceptance_length_mean"], "speedup": s["speedup"],
                        "per_position": s["per_depth_acceptance"]}
                 for name, s in report["prompt_sets"].items()},
    }


def _print_rows(rows: list[dict[str, Any]]) -> str:
    head = (f"{'dtype':9} {'k':>2} {'tau':>5} {'pos1':>5} {'tok/s head':>10} {'tok/s plain':>11} {'speedup':>7} "
            f"{'batched head':>12} {'batched plain':>13} {'speedup':>7} {'match':>6} {'near-ties':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mm = r["mismatches"] or {}
        lines.append(
            f"{r['dtype']:9} {r['k']:>2} {r['tau']:5.2f} {r['per_position'][0]:5.2f} {r['tok_s_spec']:10.1f} "
            f"{r['tok_s_plain']:11.1f} {r['speedup']:6.2f}x {r['batched_tok_s_spec'] or 0:12.1f} "
            f"{r['batched_tok_s_plain'] or 0:13.1f} {r['batched_speedup'] or 0:6.2f}x "
            f"{100 * (r['greedy_match_rate'] or 0):5.0f}% {mm.get('near_ties', 0):>4}/{mm.get('mismatched', 0):<4}"
        )
    text = "\n".join(lines)
    print(text)
    return text


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: r["k"])
        ks = [r["k"] for r in mine]
        ax1.plot(ks, [r["speedup"] for r in mine], "o-", label=f"{dtype}, one request")
        if all(r["batched_speedup"] for r in mine):
            ax1.plot(ks, [r["batched_speedup"] for r in mine], "s--", label=f"{dtype}, batched")
        ax2.plot(ks, [r["tau"] for r in mine], "o-", label=dtype)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set(xlabel="num_speculative_tokens (k)", ylabel="speedup over vLLM without the head",
            title="vLLM with the exported head")
    ax2.set(xlabel="num_speculative_tokens (k)", ylabel="tau (tokens per target forward)", title="acceptance")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def speed(args: argparse.Namespace) -> int:
    from eagle.vllm_eval import vllm_reports

    rows, reports = [], {}
    for dtype in args.dtypes:
        cfg = _cfg(args, args.draft, str(ROOT / "runs" / "vllm-benchmark" / "unused.json"))
        for k, report in vllm_reports(cfg, args.target, dtype, args.k).items():
            rows.append(_row(dtype, k, report))
            reports[f"{dtype}-k{k}"] = report
    table = _print_rows(rows)
    name = args.name or f"{datetime.date.today()}-vllm-speed"
    out = ROOT / "benchmarks" / f"{name}.json"
    write_json_atomic({"kind": "vllm-speed", "command": " ".join(sys.argv), "draft": args.draft,
                       "target": args.target, "rows": rows, "table": table, "reports": reports}, out)
    _plot(rows, ROOT / "benchmarks" / "vllm" / f"{name}.png")
    print(f"wrote {out}")
    return 0


def _schedule_rows(dtype: str, fixed: dict[str, Any], scheduled: dict[str, Any] | None) -> list[dict[str, Any]]:
    served = {r["batch_size"]: r for r in (scheduled or {}).get("rows", [])}
    rows = []
    for r in fixed["rows"]:
        other = served.get(r["batch_size"], {})
        rows.append({"dtype": dtype, "batch_size": r["batch_size"], "tok_s_head": r["tokens_per_second"],
                     "tok_s_plain": r["baseline_tokens_per_second"], "speedup": r["speedup"],
                     "tok_s_scheduled": other.get("tokens_per_second"),
                     "tok_s_plain_beside_scheduled": other.get("baseline_tokens_per_second"),
                     "speedup_scheduled": other.get("speedup"), "greedy_match_rate": r["greedy_match_rate"],
                     "greedy_match_rate_scheduled": other.get("greedy_match_rate"),
                     "drafts_per_token": r.get("draft_tokens_per_token"),
                     "drafts_per_token_scheduled": other.get("draft_tokens_per_token")})
    return rows


def _print_schedule(rows: list[dict[str, Any]], schedules: dict[str, Any]) -> str:
    head = (f"{'dtype':9} {'batch':>5} {'tok/s head':>10} {'tok/s plain':>11} {'speedup':>7} "
            f"{'scheduled':>9} {'speedup':>7} {'match':>6} {'drafts/token':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        sched = r["speedup_scheduled"]
        lines.append(
            f"{r['dtype']:9} {r['batch_size']:>5} {r['tok_s_head']:10.1f} {r['tok_s_plain']:11.1f} "
            f"{r['speedup']:6.2f}x {r['tok_s_scheduled'] or 0:9.1f} "
            f"{'' if sched is None else f'{sched:6.2f}x':>7} {100 * (r['greedy_match_rate'] or 0):5.0f}% "
            f"{drafted_text(r['drafts_per_token'], r['drafts_per_token_scheduled']):>12}")
    lines += [f"{dtype}: {schedule}" for dtype, schedule in schedules.items()]
    text = "\n".join(lines)
    print(text)
    return text


def _plot_schedule(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype]
        sizes = [r["batch_size"] for r in mine]
        ax.plot(sizes, [r["speedup"] for r in mine], "o-", label=f"{dtype}, head at every batch size")
        if any(r["speedup_scheduled"] for r in mine):
            ax.plot(sizes, [r["speedup_scheduled"] for r in mine], "s--", label=f"{dtype}, with the schedule")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel="tokens/s over vLLM without the head",
           title="vLLM with the exported head, by batch size")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def schedule_cmd(args: argparse.Namespace) -> int:
    """Per dtype: the sweep by concurrent requests and the schedule it recommends; then the head served with that
    schedule over the same batch sizes (each run timed against plain vLLM in its own worker)."""
    from eagle.errors import EagleError
    from eagle.vllm_eval import vllm_reports

    if len(args.k) != 1:
        raise SystemExit("schedule measures one chain length: give one --k")
    k = args.k[0]
    rows, reports, schedules, failures = [], {}, {}, {}
    name = args.name or f"{datetime.date.today()}-vllm-batch-schedule"
    out = ROOT / "benchmarks" / f"{name}.json"
    for dtype in args.dtypes:
        cfg = _cfg(args, args.draft, str(ROOT / "runs" / "vllm-benchmark" / "unused.json"))
        cfg.vllm = replace(cfg.vllm, num_speculative_tokens=k, batch_sizes=list(args.batch_sizes), batched=False)
        fixed = vllm_reports(cfg, args.target, dtype, [k])[k]
        reports[f"{dtype}-k{k}"] = fixed
        schedules[dtype] = fixed["batch_sweep"]["schedule"]
        scheduled = None
        for attempt in range(2 if schedules[dtype] else 0):  # an engine start that failed once is tried again
            try:
                served = replace(cfg, vllm=replace(cfg.vllm, batch_schedule=schedules[dtype]))
                reports[f"{dtype}-k{k}-scheduled"] = vllm_reports(served, args.target, dtype, [k])[k]
                scheduled = reports[f"{dtype}-k{k}-scheduled"]["batch_sweep"]
                break
            except EagleError as e:
                failures[f"{dtype}-scheduled-attempt{attempt + 1}"] = str(e)[:2000]
                print(f"{dtype}: the run with the schedule failed (attempt {attempt + 1}): {str(e)[:300]}")
        rows += _schedule_rows(dtype, fixed["batch_sweep"], scheduled)
        table = _print_schedule(rows, schedules)
        # written after every dtype: a later failure keeps what was measured
        write_json_atomic({"kind": "vllm-batch-schedule", "command": " ".join(sys.argv), "draft": args.draft,
                           "target": args.target, "k": k, "schedules": schedules, "rows": rows, "table": table,
                           "failures": failures, "reports": reports}, out)
    _plot_schedule(rows, ROOT / "benchmarks" / "vllm" / f"{name}.png")
    print(f"wrote {out}")
    return 0


def parity_cmd(args: argparse.Namespace) -> int:
    from eagle.evaluate import evaluate
    from eagle.targets import load_target
    from eagle.tree import TreeConfig
    from eagle.vllm_eval import evaluate_vllm, parity, parity_message

    results, failed = {}, []
    target = load_target(args.target, dtype=args.dtype)
    for spec in args.draft:
        layout, _, folder = spec.partition("=")
        cfg = _cfg(args, folder, str(ROOT / "runs" / "vllm-benchmark" / f"parity-{layout}.json"))
        cfg.vllm = replace(cfg.vllm, num_speculative_tokens=args.k[0], batched=False)
        # parity needs our loop's chain only: make it the "tree" too, so each prompt is decoded once
        chain = TreeConfig(policy="chain", depth=args.k[0])
        hf = evaluate(replace(cfg, tree=chain, chain_depth=args.k[0], draft_dtype=None, baseline=False), target)
        vllm = evaluate_vllm(replace(cfg, baseline=False), args.target, args.dtype, write=False)
        result = parity(hf, vllm)
        results[layout] = {"draft": folder, **result}
        print(f"{layout}: tau HF chain {result['hf_tau']:.3f}, vLLM {result['vllm_tau']:.3f}; per position "
              + ", ".join(f"{r['hf']:.3f}/{r['vllm']:.3f}" for r in result["positions"])
              + f" -> {'ok' if result['ok'] else 'FAILED'}")
        if not result["ok"]:
            failed.append(parity_message(result, folder))
    name = args.name or f"{datetime.date.today()}-vllm-parity"
    out = ROOT / "benchmarks" / f"{name}.json"
    write_json_atomic({"kind": "vllm-parity", "command": " ".join(sys.argv), "target": args.target,
                       "dtype": args.dtype, "k": args.k[0], "layouts": results}, out)
    print(f"wrote {out}")
    for message in failed:
        print(message, file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("speed", "parity", "schedule"):
        p = sub.add_parser(name)
        p.add_argument("--target", default="smollm2-135m-instruct")
        p.add_argument("--prompts", nargs="+", default=["dev-chat", "dev-code"])
        p.add_argument("--prompts-per-set", type=int, default=None, help="default: every prompt")
        p.add_argument("--max-new-tokens", type=int, default=96)
        p.add_argument("--kv-cache-gb", type=int, default=2)
        p.add_argument("--k", type=int, nargs="+", default=[3])
        p.add_argument("--name", default=None, help="benchmarks/<name>.json")
        p.add_argument("--enforce-eager", action="store_true", help="vLLM without compilation (faster start)")
    sub.choices["speed"].add_argument("--draft", required=True)
    sub.choices["speed"].add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    sub.choices["parity"].add_argument("--draft", nargs="+", required=True, help="LAYOUT=DIR ...")
    sub.choices["parity"].add_argument("--dtype", default="float32")
    sub.choices["schedule"].add_argument("--draft", required=True)
    sub.choices["schedule"].add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    sub.choices["schedule"].add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    return {"speed": speed, "parity": parity_cmd, "schedule": schedule_cmd}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
