"""Exact output distributions of the speculative loop, for tests/test_lossless_exact.py and
tests/test_lossless_stats.py.

Every random choice ``speculative_generate`` makes goes through an :class:`eagle.verify.Decisions`: the first
token's draw, each accept / reject of a drafted child (with the probability the product code states), each
residual draw. :class:`ScriptedDecisions` makes those choices from a script instead of a generator and records
the probabilities the product code passed, so :func:`enumerate_outputs` can re-run the loop once per decision
path (depth first, never taking an option of probability 0) and sum the paths' probabilities per output. The
probabilities thus come from the product code, not from a copy of the rejection rule.
:func:`target_sequence_probs` gives what the output must equal: plain sampling from the target, the product
of its warped conditionals.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from eagle.sampling import logits_to_probs
from eagle.testing import tiny_config
from eagle.verify import Decisions

V = 6  # vocabulary of the tiny targets: small enough to enumerate every output of a few tokens


def tiny_target(seed: int = 0, init: float = 0.4) -> torch.nn.Module:
    """A tiny float64 llama (one layer, sdpa attention) over ``V`` tokens, weights of std ``init``.

    float64 and sdpa so that the speculative loop's tree forwards and the plain forwards of the reference
    agree to ~1e-16 (eager attention takes its softmax in float32 whatever the model's dtype, which leaves
    ~1e-7 between the two): the warped probabilities (``logits_to_probs`` makes them in float32) then come out
    bit-identical, and any difference between the two distributions is the loop's, not rounding. The default
    ``init`` (HF's is 0.02) makes the distributions peaked, so that top-p cuts tokens and a wrong position or
    mask changes the logits.
    """
    cfg = tiny_config("llama", vocab_size=V, hidden_size=16, num_layers=1)
    cfg.initializer_range = init
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to(torch.float64).eval().requires_grad_(False)


class ScriptedDecisions:
    """A :class:`eagle.verify.Decisions` that replays ``script`` (one option index per decision; an accept
    decision's options are 0 = accept, 1 = reject), then takes the first option of positive probability.

    It records each decision's option probabilities as the product code stated them. Once ``length`` tokens
    are out (every accept and every categorical draw emits one token, rejections none), the stopper cuts the
    output there, so later decisions cannot change it: those are made without branching and with weight 1
    (the sum over their options), which keeps the enumeration from multiplying paths that give the same
    output. tests/test_lossless_exact.py checks that this pruning changes no probability.
    """

    device = torch.device("cpu")

    def __init__(self, script: Sequence[int], length: int | None = None):
        self.script = list(script)
        self.length = length
        self.emitted = 0
        self.taken: list[int] = []
        self.options: list[list[float] | None] = []  # None: made after the output was complete
        self.accepted = 0  # accepted drafts among the branching decisions
        self.rejected = 0

    def _choose(self, probs: list[float]) -> int:
        i = len(self.taken)
        free = self.length is not None and self.emitted >= self.length
        if i < len(self.script):
            choice = self.script[i]
            assert probs[choice] > 0, "a replayed choice must stay possible: the loop is not deterministic"
        else:
            choice = next(j for j, p in enumerate(probs) if p > 0)
        self.taken.append(choice)
        self.options.append(None if free else probs)
        return choice

    def accept(self, weight: torch.Tensor, total: torch.Tensor) -> bool:
        p = float(weight / total)
        accepted = self._choose([p, 1.0 - p]) == 0
        if self.options[-1] is not None:
            self.accepted += accepted
            self.rejected += not accepted
        self.emitted += accepted
        return accepted

    def categorical(self, weights: torch.Tensor) -> int:
        w = weights.to(torch.float64)
        choice = self._choose((w / w.sum()).tolist())
        self.emitted += 1
        return choice

    def probability(self) -> float:
        """The probability of the path taken: the product of the chosen options' probabilities."""
        return math.prod(opts[c] for opts, c in zip(self.options, self.taken) if opts is not None)

    def siblings(self) -> list[list[int]]:
        """Scripts of the paths that leave this one at a decision it made unscripted (each path once)."""
        return [
            self.taken[:i] + [j]
            for i in range(len(self.script), len(self.taken))
            if (opts := self.options[i]) is not None
            for j, p in enumerate(opts)
            if p > 0 and j != self.taken[i]
        ]


@dataclass
class Enumeration:
    """Every output of a generation with its exact probability, and what the enumeration saw on the way."""

    dist: dict[tuple[int, ...], float]
    paths: int  # decision paths of positive probability (= runs of the loop)
    mean_accepted: float  # expected accepted drafts per generation
    mean_rejected: float  # expected rejected drafts per generation


def enumerate_outputs(
    generate: Callable[[Decisions], list[int]], length: int, prune: bool = True
) -> Enumeration:
    """Run ``generate(decisions) -> tokens`` once per decision path and sum path probabilities per output.

    ``generate`` must be deterministic given its decisions (a fresh drafter each call). Depth first: a run
    replays its script, then takes first options; each of its unscripted decisions' other options is the
    script of a later run. Outputs must have exactly ``length`` tokens. ``prune``: stop branching once they
    are out (:class:`ScriptedDecisions`).
    """
    dist: dict[tuple[int, ...], float] = defaultdict(float)
    stack: list[list[int]] = [[]]
    paths, accepted, rejected = 0, 0.0, 0.0
    while stack:
        source = ScriptedDecisions(stack.pop(), length if prune else None)
        tokens = generate(source)
        assert len(tokens) == length, tokens
        p = source.probability()
        dist[tuple(tokens)] += p
        paths += 1
        accepted += p * source.accepted
        rejected += p * source.rejected
        stack.extend(source.siblings())
    return Enumeration(dict(dist), paths, accepted, rejected)


@torch.no_grad()
def target_sequence_probs(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    length: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict[tuple[int, ...], float]:
    """Probability of every ``length``-token continuation of ``prompt`` [1, T] under plain sampling from the
    target: the product of its warped conditionals, one plain (cache-free) forward per prefix.

    Each conditional is renormalised in float64, as the samplers do (``torch.multinomial`` normalises its
    weights; the rejection rule divides by the residual's sum); the float32 ``logits_to_probs`` sum to 1 only
    to ~1e-7.
    """
    out: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == length:
            out[prefix] = prob
            return
        ids = torch.cat([prompt[0], torch.tensor(prefix, dtype=torch.long)])[None]
        probs = logits_to_probs(model(ids).logits[0, -1], temperature, top_p, top_k).to(torch.float64)
        probs = probs / probs.sum()
        for y, q in enumerate(probs.tolist()):
            if q > 0:
                extend(prefix + (y,), prob * q)

    extend((), 1.0)
    return out


def total_variation(p: dict[tuple[int, ...], float], q: dict[tuple[int, ...], float]) -> float:
    """Total variation distance between two distributions over outputs (missing keys have probability 0)."""
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))
