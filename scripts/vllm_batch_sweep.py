#!/usr/bin/env python
"""Up to which batch size the exported head speeds vLLM up: throughput with and without it, per batch size.

    python scripts/vllm_batch_sweep.py --draft runs/demo/export --batch-sizes 1 2 4 8 16 --up-to 2 --name NAME

The same prompts are decoded greedily in groups of b requests submitted at once (b = each batch size), by the
target alone, with the head drafting k tokens every step, and (``--up-to B``) with the head drafting only while
at most B requests run (vLLM's ``num_speculative_tokens_per_batch_size``: k up to B, none above), the engines
taking turns group by group. Prints tokens/s and the speedups per batch size, writes ``benchmarks/<name>.json``
and a PNG. Every engine runs in this process, so the sweep needs the memory of all of them at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _engines(args: argparse.Namespace, target_dir: str) -> dict[str, Any]:
    from vllm import LLM

    from eagle.vllm_engine import speculative_config

    common = dict(model=target_dir, dtype=args.dtype, seed=0, max_model_len=2048, max_num_seqs=max(args.batch_sizes))
    spec = speculative_config(args.draft, args.k)
    engines = {"plain": LLM(**common), f"k{args.k}": LLM(**common, speculative_config=spec)}
    if args.up_to:
        schedule = [(1, args.up_to, args.k), (args.up_to + 1, max(args.batch_sizes) + 1, 0)]
        engines[f"k{args.k} up to {args.up_to}"] = LLM(
            **common, speculative_config={**spec, "num_speculative_tokens_per_batch_size": schedule})
    return engines


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle.prompts import load_prompt_sets
    from eagle.targets import load_tokenizer, resolve_target

    target_dir = resolve_target(args.target)
    sets = load_prompt_sets(args.prompts, load_tokenizer(target_dir), args.prompts_per_set)
    prompts = [TokensPrompt(prompt_token_ids=ids) for _, items in sets for _, ids in items]
    engines = _engines(args, target_dir)
    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    for llm in engines.values():  # warm-up, not timed
        llm.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    names = list(engines)
    rows = []
    for b in args.batch_sizes:
        tokens: dict[str, int] = defaultdict(int)
        seconds: dict[str, float] = defaultdict(float)
        outputs: dict[str, list[list[int]]] = defaultdict(list)
        for g, start in enumerate(range(0, len(prompts), b)):
            group = prompts[start:start + b]
            for name in names[g % len(names):] + names[: g % len(names)]:
                t0 = time.perf_counter()
                outs = engines[name].generate(group, sampling, use_tqdm=False)
                seconds[name] += time.perf_counter() - t0
                for out in outs:
                    tokens[name] += len(out.outputs[0].token_ids)
                    outputs[name].append(list(out.outputs[0].token_ids))
        tps = {name: tokens[name] / seconds[name] for name in names}
        rows.append({"batch_size": b, "tokens_per_second": tps,
                     "speedup": {name: tps[name] / tps["plain"] for name in names[1:]},
                     "identical_to_plain": {name: sum(a == p for a, p in zip(outputs[name], outputs["plain"]))
                                            for name in names[1:]},
                     "requests": len(prompts)})
        print(f"batch {b:>3}: " + ", ".join(f"{n} {tps[n]:.1f} tok/s" for n in names), flush=True)
    return {"engines": names, "rows": rows}


def _print(result: dict[str, Any]) -> str:
    names = result["engines"]
    head = f"{'batch':>5} " + " ".join(f"{n + ' tok/s':>18}" for n in names) + " " + " ".join(
        f"{n + ' speedup':>20}" for n in names[1:])
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['batch_size']:>5} " + " ".join(f"{r['tokens_per_second'][n]:18.1f}" for n in names) + " "
                     + " ".join(f"{r['speedup'][n]:19.2f}x" for n in names[1:]))
    text = "\n".join(lines)
    print(text)
    return text


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sizes = [r["batch_size"] for r in result["rows"]]
    for name in result["engines"][1:]:
        ax.plot(sizes, [r["speedup"][name] for r in result["rows"]], "o-", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="requests decoded at once", ylabel="throughput over vLLM without the head",
           title="vLLM with the exported head, by batch size")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--up-to", type=int, default=0, help="also an engine that drafts only up to this batch")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", nargs="+", default=["dev-chat", "dev-code"])
    parser.add_argument("--prompts-per-set", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-gb", type=int, default=1)
    parser.add_argument("--name", default=None, help="benchmarks/<name>.json (default: print only)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process: no worker per engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = sweep(args)
    table = _print(result)
    if args.name:
        from eagle.fileio import write_json_atomic

        out = ROOT / "benchmarks" / f"{args.name}.json"
        write_json_atomic({"kind": "vllm-batch-sweep", "command": " ".join(sys.argv), "draft": args.draft,
                           "dtype": args.dtype, "k": args.k, "max_new_tokens": args.max_new_tokens, **result,
                           "table": table}, out)
        _plot(result, ROOT / "benchmarks" / "vllm" / f"{args.name}.png")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
