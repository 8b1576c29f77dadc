#!/usr/bin/env python
"""What chain verification costs on targets with a recurrent state (linear attention, Mamba), against plain decoding.

Such targets verify one path a step and, when part of it is rejected, put their recurrent state back and read the
accepted tokens again (docs/ARCHITECTURE.md, "Verification"). To see that cost apart from any head's quality, the
drafts come from a scripted drafter that knows the target's own greedy continuation and proposes it with each
drafted token wrong with probability 1 - p (a fixed pseudo-random choice per position): tau is then set by p, and
drafting costs nothing. Attention-only families (tree verification, no replay) run beside them as the reference.
Every speculative output is checked against plain greedy decoding; runs are interleaved prompt by prompt.

    python scripts/chain_verification_benchmark.py                      # the tiny targets of the families matrix
    python scripts/chain_verification_benchmark.py --families qwen3_next llama --accept 0.5 0.9 --depth 4

Prints a table and writes ``benchmarks/chain-verification.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.fileio import write_json_atomic  # noqa: E402
from eagle.sampling import Sampling  # noqa: E402
from eagle.speculate import plain_generate, speculative_generate  # noqa: E402
from eagle.testing import family_model  # noqa: E402
from eagle.tree import DraftTree, TreeConfig, tree_from_parents  # noqa: E402

FAMILIES = ("qwen3_next", "qwen3_5", "falcon_h1", "bamba", "llama", "qwen3_moe")


class ScriptedDrafter:
    """Drafts the known continuation ``reference`` (the target's greedy tokens after the prompt), each drafted
    position wrong with probability 1 - ``accept`` (the same positions on every run)."""

    def __init__(self, reference: list[int], accept: float, vocab: int, seed: int = 0):
        self.reference = reference
        gen = torch.Generator().manual_seed(seed)
        self.wrong = (torch.rand(len(reference) + 64, generator=gen) >= accept).tolist()
        self.vocab = vocab
        self.done = 0  # tokens committed after the prompt, the root included

    def prefill(self, input_ids: torch.Tensor, hidden_states: tuple, next_token: int) -> None:
        self.done = 1

    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        tokens = [int(root_token)]
        for i in range(self.done, self.done + tree_cfg.depth):
            token = self.reference[i] if i < len(self.reference) else 0
            tokens.append((token + 1) % self.vocab if self.wrong[i] else token)
        return tree_from_parents(tokens, [-1] + list(range(len(tokens) - 1)))

    def accept(self, accepted: torch.Tensor, hidden_states: tuple, next_tokens: torch.Tensor) -> None:
        self.done += int(next_tokens.numel())


def _prompts(n: int, length: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (1, length), generator=gen) for _ in range(n)]


def measure(family: str, accepts: list[float], depth: int, prompts: list[torch.Tensor], new: int) -> list[dict]:
    """One row per acceptance rate: tau, replays per verification, tokens/s of both loops, speedup."""
    model = family_model(family)
    model.generation_config.eos_token_id = None
    tree = TreeConfig(policy="chain", depth=depth)
    sums = {p: {"spec_s": 0.0, "plain_s": 0.0, "tokens": 0, "steps": 0, "accepted": 0, "replays": 0, "match": 0}
            for p in accepts}
    per_prompt: dict[float, list[float]] = {p: [] for p in accepts}
    for ids in prompts:
        plain = plain_generate(model, ids, new, Sampling())
        for p in accepts:
            drafter = ScriptedDrafter(plain.tokens, p, int(model.config.get_text_config().vocab_size))
            t0 = time.perf_counter()
            spec = speculative_generate(model, drafter, ids, new, tree, Sampling())
            spec_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = plain_generate(model, ids, new, Sampling())  # timed right beside it
            plain_s = time.perf_counter() - t0
            s = sums[p]
            s["spec_s"] += spec_s
            s["plain_s"] += plain_s
            s["tokens"] += len(spec.tokens)
            s["steps"] += spec.target_forwards
            s["accepted"] += sum(spec.accept_lengths)
            s["replays"] += spec.replay_forwards
            s["match"] += int(spec.tokens == again.tokens == plain.tokens)
            per_prompt[p].append(plain_s / spec_s)
    rows = []
    for p, s in sums.items():
        speedups = per_prompt[p]
        rows.append({
            "family": family, "verification": spec.verification, "draft_accept_rate": p, "depth": depth,
            "tau": s["accepted"] / s["steps"], "replays_per_step": s["replays"] / s["steps"],
            "spec_tokens_per_s": s["tokens"] / s["spec_s"], "plain_tokens_per_s": s["tokens"] / s["plain_s"],
            "speedup": s["plain_s"] / s["spec_s"],
            "speedup_se": statistics.stdev(speedups) / len(speedups) ** 0.5 if len(speedups) > 1 else None,
            "prompts": len(prompts), "greedy_match": s["match"] / len(prompts),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--accept", nargs="+", type=float, default=[0.5, 0.8, 0.95])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "chain-verification.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prompts = _prompts(args.prompts, 24)
    rows = []
    for family in args.families:
        rows += measure(family, args.accept, args.depth, prompts, args.max_new_tokens)
    print(f"{'family':12} {'verify':6} {'p':>5} {'tau':>5} {'replays':>8} {'spec t/s':>9} {'plain t/s':>9} "
          f"{'speedup':>8} {'match':>6}")
    for r in rows:
        print(f"{r['family']:12} {r['verification']:6} {r['draft_accept_rate']:5.2f} {r['tau']:5.2f} "
              f"{r['replays_per_step']:8.2f} {r['spec_tokens_per_s']:9.1f} {r['plain_tokens_per_s']:9.1f} "
              f"{r['speedup']:7.2f}x {r['greedy_match']:6.0%}")
    record = {"date": datetime.date.today().isoformat(), "torch_threads": 1, "depth": args.depth,
              "max_new_tokens": args.max_new_tokens, "rows": rows}
    write_json_atomic(record, args.out)
    print(f"wrote {args.out}")
    return 0 if all(r["greedy_match"] == 1.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
