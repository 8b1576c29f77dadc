#!/usr/bin/env python
"""Which draft tree pays on this machine, and which head drafts best? Several tree shapes (and heads) side by side.

Loads the target and the heads once, then for every prompt runs plain greedy decoding and speculative decoding
with each tree shape and head, interleaved prompt by prompt (so machine noise hits every run alike). Prints a
table of tau, tokens/s and speedup over plain decoding per run, writes JSON (``--out``) and a PNG beside it, and
checks that every speculative output equals plain greedy decoding.

    python scripts/tree_sweep.py --draft runs/demo/export --trees chain:3 chain:4 dynamic:4:2:6 dynamic:5:4:12
    python scripts/tree_sweep.py --draft old=runs/a/export new=runs/b/export --trees dynamic:5:4:12+lookup:10 \
        --max-prompts 40 --max-new-tokens 96 --cpu-prepack

With several heads (``NAME=DIR``) the runs are named ``TREE@NAME`` and every run after the first is also compared
with the first prompt by prompt (tau is a property of the head and the prompts, not of the machine's speed that
day, so this is the fair way to compare heads trained on different days): on how many prompts its tau is
higher or lower, and the mean per-prompt difference with its standard error.

Tree specs: ``chain:DEPTH`` or ``dynamic:DEPTH:TOP_K:TOTAL_TOKENS``, optionally with ``+lookup`` (a prompt-lookup
branch of 3-grams down to 1-grams, ``eval.tree.lookup_ngram``) or ``+lookup:TOKENS`` (a branch of up to TOKENS
tokens, ``eval.tree.lookup_tokens``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.drafter import HeadDrafter, resolve_draft_dtype  # noqa: E402
from eagle.errors import EagleError  # noqa: E402
from eagle.evaluate import EvalConfig, eos_token_ids  # noqa: E402
from eagle.export import load_exported_head  # noqa: E402
from eagle.fileio import write_json_atomic  # noqa: E402
from eagle.prompts import load_prompt_sets  # noqa: E402
from eagle.sampling import Sampling  # noqa: E402
from eagle.speculate import plain_generate, speculative_generate  # noqa: E402
from eagle.targets import load_target, prepack_for_cpu  # noqa: E402
from eagle.tree import TreeConfig  # noqa: E402


def parse_tree(spec: str) -> TreeConfig:
    """``chain:D`` or ``dynamic:D:K:N``, optionally ``+lookup`` (a prompt-lookup branch) -> a TreeConfig."""
    spec, plus, extra = spec.partition("+")
    name, _, length = extra.partition(":")
    if plus and (name != "lookup" or not (length == "" or length.isdigit())):
        raise EagleError(f"tree spec suffix {extra!r} is unknown; use +lookup or +lookup:TOKENS")
    lookup, lookup_tokens = (3 if plus else 0), int(length or 0)
    parts = spec.split(":")
    try:
        if parts[0] == "chain" and len(parts) == 2:
            return TreeConfig(
                policy="chain", depth=int(parts[1]), lookup_ngram=lookup, lookup_tokens=lookup_tokens
            ).validate()
        if parts[0] == "dynamic" and len(parts) == 4:
            d, k, n = (int(p) for p in parts[1:])
            return TreeConfig(
                policy="dynamic", depth=d, top_k=k, total_tokens=n, lookup_ngram=lookup,
                lookup_tokens=lookup_tokens,
            ).validate()
    except ValueError:
        pass
    raise EagleError(f"tree spec {spec!r} is not chain:DEPTH or dynamic:DEPTH:TOP_K:TOTAL_TOKENS")


def sweep(
    target: Any,
    drafters: dict[str, HeadDrafter],
    prompts: list[tuple[str, str, list[int]]],
    trees: dict[str, TreeConfig],
    max_new_tokens: int,
) -> dict[str, Any]:
    """Plain and speculative decoding of every prompt with every tree and drafter; per-set totals.

    ``drafters`` maps a label (the head's dtype) to a drafter; with several, each tree runs with each of them and
    its rows are named ``TREE@LABEL``.
    """
    from tqdm import tqdm

    eos = eos_token_ids(target)
    runs = {
        (name if len(drafters) == 1 else f"{name}@{label}"): (tree, drafter)
        for name, tree in trees.items()
        for label, drafter in drafters.items()
    }
    names = ["plain", *runs]
    # per tree: set -> [tokens, seconds, forwards, accepted, greedy matches, prompts]
    totals: dict[str, dict[str, list]] = {n: {} for n in names}
    per_prompt: dict[str, list[dict[str, Any]]] = {n: [] for n in runs}
    for k, (set_name, pid, ids) in enumerate(tqdm(prompts, desc="tree sweep", unit="prompt")):
        x = torch.tensor([ids])
        order = names[k % len(names) :] + names[: k % len(names)]
        results = {}
        for name in order:
            if name == "plain":
                results[name] = plain_generate(target.model, x, max_new_tokens, sampling=Sampling(eos_token_ids=eos))
            else:
                tree, drafter = runs[name]
                results[name] = speculative_generate(
                    target.model, drafter, x, max_new_tokens, tree, sampling=Sampling(eos_token_ids=eos)
                )
        for name, res in results.items():
            if name != "plain":
                per_prompt[name].append(
                    {"set": set_name, "id": pid, "tau": res.mean_accept_length, "forwards": res.target_forwards}
                )
            for key in (set_name, "overall"):
                t = totals[name].setdefault(key, [0, 0.0, 0, 0, 0, 0])
                t[0] += len(res.tokens)
                t[1] += res.total_time - res.prefill_time  # decoding only: the prefill is the same for all
                t[2] += res.target_forwards
                t[3] += sum(res.accept_lengths)
                t[4] += int(res.tokens == results["plain"].tokens)
                t[5] += 1
    rows = []
    for name in names:
        sets = [k for k in totals[name] if k != "overall"] + ["overall"]  # the sets as met, then the total
        for set_name in sets:
            tokens, secs, forwards, accepted, match, n = totals[name][set_name]
            plain_rate = totals["plain"][set_name][0] / totals["plain"][set_name][1]
            rate = tokens / secs
            rows.append(
                {
                    "tree": name,
                    "set": set_name,
                    "tau": accepted / forwards if name != "plain" and forwards else None,
                    "tokens_per_s": rate,
                    "speedup": rate / plain_rate,
                    "greedy_match": f"{match}/{n}",
                    "ms_per_forward": 1000 * secs / forwards if forwards else None,
                }
            )
    return {"rows": rows, "per_prompt": per_prompt, "paired": paired(per_prompt)}


def paired(per_prompt: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every run after the first against the first, prompt by prompt: per-prompt tau differences (this run's
    minus the first's) as counts of higher / lower, their mean and its standard error."""
    import statistics

    names = list(per_prompt)
    out = []
    for name in names[1:]:
        diffs = [b["tau"] - a["tau"] for a, b in zip(per_prompt[names[0]], per_prompt[name], strict=True)]
        if not diffs:
            continue
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        out.append(
            {
                "run": name,
                "against": names[0],
                "prompts": len(diffs),
                "higher": sum(d > 0 for d in diffs),
                "lower": sum(d < 0 for d in diffs),
                "mean_tau_difference": statistics.fmean(diffs),
                "standard_error": se,
            }
        )
    return out


def parse_drafts(specs: list[str]) -> dict[str, Path]:
    """``DIR`` or ``NAME=DIR`` items -> {name: folder}; a lone unnamed head is named after nothing ("")."""
    if len(specs) == 1 and "=" not in specs[0]:
        return {"": Path(specs[0])}
    drafts: dict[str, Path] = {}
    for spec in specs:
        name, eq, folder = spec.partition("=")
        if not eq or not name or not folder:
            raise EagleError(f"--draft {spec!r}: with several heads, name each one as NAME=DIR")
        if name in drafts:
            raise EagleError(f"--draft: the name {name!r} is given twice; name every head differently")
        drafts[name] = Path(folder)
    return drafts


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speedup and tau per run and prompt set, as grouped bars side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = list(dict.fromkeys(r["tree"] for r in rows if r["tree"] != "plain"))
    sets = list(dict.fromkeys(r["set"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(2.4 + 2.4 * len(trees), 3.8))
    width = 0.8 / len(sets)
    for ax, key, label in ((axes[0], "speedup", "speedup over plain decoding"), (axes[1], "tau", "tau")):
        for j, s in enumerate(sets):
            vals = [next(r[key] for r in rows if r["tree"] == t and r["set"] == s) for t in trees]
            ax.bar([i + j * width for i in range(len(trees))], vals, width, label=s)
        if key == "speedup":
            ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xticks(
            [i + width * (len(sets) - 1) / 2 for i in range(len(trees))], trees, rotation=20, fontsize=7
        )
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(name: str, dtype: torch.dtype, num_dtypes: int) -> str:
    """A drafter's label: the head's name, its dtype, or both where several heads run in several dtypes."""
    dtype_name = str(dtype).removeprefix("torch.")
    if not name:
        return dtype_name
    return f"{name}/{dtype_name}" if num_dtypes > 1 else name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--draft",
        required=True,
        nargs="+",
        help="exported draft head directory; several as NAME=DIR to compare heads on the same prompts",
    )
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument(
        "--trees", nargs="+", default=["chain:2", "chain:3", "chain:4", "dynamic:4:2:6", "dynamic:5:4:12"]
    )
    ap.add_argument("--prompts", nargs="+", default=["dev-chat", "dev-code"])
    ap.add_argument("--max-prompts", type=int, default=10, help="per prompt set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--cpu-prepack", action="store_true", help="oneDNN prepacked linear layers (eval.cpu_prepack)"
    )
    ap.add_argument(
        "--draft-dtype",
        nargs="+",
        default=["auto"],
        help="dtype(s) the head drafts in (eval.draft_dtype): auto (bf16 on a CPU with bf16 units), float32, "
        "bfloat16; several run every tree with each, side by side",
    )
    ap.add_argument("--out", default=str(ROOT / "runs/benchmarks/tree_sweep.json"))
    args = ap.parse_args(argv)
    try:
        trees = {spec: parse_tree(spec) for spec in args.trees}
        target = load_target(args.target, dtype=args.dtype, device=args.device)
        drafts = parse_drafts(args.draft)
        dtypes = sorted({resolve_draft_dtype(d, target.device, target.dtype) for d in args.draft_dtype}, key=str)
        heads = {
            _label(name, d, len(dtypes)): load_exported_head(folder, target, dtype=d)
            for name, folder in drafts.items()
            for d in dtypes
        }
        if args.cpu_prepack:
            prepack_for_cpu(target.model)
            for head in heads.values():
                prepack_for_cpu(head)  # fp32 layers only: a bf16 head drafts faster unpacked
        drafters = {label: HeadDrafter(head) for label, head in heads.items()}
        cfg = EvalConfig(prompts=args.prompts, max_prompts=args.max_prompts)
        prompts = [
            (s, pid, ids) for s, items in load_prompt_sets(cfg.prompts, target.tokenizer, cfg.max_prompts) for pid, ids in items
        ]
    except EagleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with torch.no_grad():  # one untimed warm-up of every method
        sweep(target, drafters, prompts[:1], trees, 8)
        result = sweep(target, drafters, prompts, trees, args.max_new_tokens)

    from rich.console import Console
    from rich.table import Table

    title = ", ".join(f"{n}={f}" if n else str(f) for n, f in drafts.items())
    table = Table(title=f"tree sweep: {title}, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    table.add_column("tree", no_wrap=True)  # the shape is the point of the table: never cut it
    for col in ("set", "tau", "tok/s", "speedup", "ms/forward", "greedy match"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(
            r["tree"],
            r["set"],
            "-" if r["tau"] is None else f"{r['tau']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            "-" if r["ms_per_forward"] is None else f"{r['ms_per_forward']:.1f}",
            r["greedy_match"],
        )
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the whole table
    console.print(table)
    for p in result["paired"]:
        console.print(
            f"{p['run']} vs {p['against']}: tau higher on {p['higher']}, lower on {p['lower']} of {p['prompts']} "
            f"prompts; mean difference {p['mean_tau_difference']:+.3f} (standard error {p['standard_error']:.3f})",
            highlight=False,
        )
    result.update(
        draft={n or "head": str(f) for n, f in drafts.items()},
        target=args.target,
        device=args.device,
        dtype=args.dtype,
        prompts=args.prompts,
        max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        threads=torch.get_num_threads(),
        cpu_prepack=args.cpu_prepack,
        draft_dtypes=list(drafters),
    )
    out = write_json_atomic(result, args.out)
    plot(result["rows"], out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    mismatched = [
        r for r in result["rows"] if r["greedy_match"].split("/")[0] != r["greedy_match"].split("/")[1]
    ]
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
