"""speculative_generate with real torch generators samples the target's distribution: a test with stated
power, and a control showing that it catches a planted bug.

tests/test_lossless_exact.py proves that the loop asks for the right probabilities; it cannot see the default
decision source that realises them (eagle.verify.TorchDecisions: a uniform u accepted iff u * total < weight,
and torch.multinomial), nor how the loop hands it the generator. Here the loop runs with real generators (one
per seed, many seeds) and the counts of every 2-token output are compared with the exact expected counts: the
target's own sequence probabilities (tests/_lossless.py).

The test: one two-sided z-test per output, at level ALPHA / m for m outputs (Bonferroni: the family's level
is at most ALPHA). Its power: an output of probability p >= 0.1 whose true probability is p +- SHIFT is found
by its own z-test alone with probability >= POWER; the number of draws is the smallest for which that holds
for every such output of this target (:func:`draws_needed`; the count is binomial, approximated by a normal
with the alternative's mean and variance -- thousands of expected counts per cell, where the approximation is
close: a simulation of 200,000 tests gave a level of 0.0097 and a least power of 0.9901). A flat target keeps
that number small: outputs near p = 0.1 need 0.4 times the draws an output at p = 0.5 would (the variance
p (1 - p) sets it).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import pytest
import torch
from _lossless import V, target_sequence_probs, tiny_target

from eagle.sampling import Sampling
from eagle.speculate import speculative_generate
from eagle.tree import DraftTree, TreeConfig, tree_from_parents
from eagle.verify import TorchDecisions

ALPHA = 0.01  # family-wise significance level
SHIFT = 0.01  # the shift of one output's probability the test must find...
POWER = 0.99  # ...with at least this probability, for every output of probability >= MIN_PROB
MIN_PROB = 0.1
L = 2  # the prefill's token, then one verification
PROMPT = torch.tensor([[1, 3, 4, 5]])
SAMPLING = dict(temperature=1.0, top_k=3)  # 3 x 3 outputs of ~1/9 each
SEEDS = 64


@cache
def target() -> torch.nn.Module:
    return tiny_target(seed=0, init=0.05)  # nearly flat: every output near 1/9


class TableDrafter:
    """Drafts a fixed function of the root: three children (in the top-3 or not), one grandchild. Enough for
    accepts, rejections and residual draws; the drafts' quality is not what this test is about, and the table
    costs nothing, which matters at tens of thousands of draws."""

    def prefill(self, input_ids: torch.Tensor, hidden_states: tuple, next_token: int) -> None:
        pass

    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        kids = [(root_token + k) % V for k in (2, 3, 4)]
        return tree_from_parents([root_token, *kids, (kids[0] + 1) % V], [-1, 0, 0, 0, 1])

    def accept(self, accepted: torch.Tensor, hidden_states: tuple, next_tokens: torch.Tensor) -> None:
        pass


def normal_cdf(x: float) -> float:
    return float(torch.special.ndtr(torch.tensor(x, dtype=torch.float64)))


def z_critical(m: int) -> float:
    """The two-sided critical |z| of each of m tests at family-wise level ALPHA (Bonferroni)."""
    return float(torch.special.ndtri(torch.tensor(1 - ALPHA / (2 * m), dtype=torch.float64)))


def detection_power(p: float, shift: float, n: int, z_crit: float) -> float:
    """P(|z| > z_crit) for an output expected at p whose count is Bin(n, p + shift), normal approximation."""
    q = p + shift
    sd = math.sqrt(n * q * (1 - q))
    half_width = z_crit * math.sqrt(n * p * (1 - p))
    return normal_cdf((n * shift - half_width) / sd) + normal_cdf((-n * shift - half_width) / sd)


def min_power(expected: dict[tuple[int, ...], float], n: int) -> float:
    """The test's least power against a +-SHIFT shift of any output of probability >= MIN_PROB."""
    z_crit = z_critical(len(expected))
    big = [p for p in expected.values() if p >= MIN_PROB]
    return min(detection_power(p, s, n, z_crit) for p in big for s in (SHIFT, -SHIFT))


def draws_needed(expected: dict[tuple[int, ...], float]) -> int:
    """The fewest draws for which :func:`min_power` reaches POWER (power grows with n: bisection)."""
    lo, hi = 1, 1_000_000
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if min_power(expected, mid) >= POWER else (mid + 1, hi)
    return lo


def draw_outputs(n: int) -> Counter:
    """Counts of the outputs of n speculative generations: seeds 0..SEEDS-1, n / SEEDS draws each."""
    counts: Counter = Counter()
    for seed in range(SEEDS):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n // SEEDS + (seed < n % SEEDS)):
            out = speculative_generate(
                target(), TableDrafter(), PROMPT, L, TreeConfig("chain", depth=2), sampling=Sampling(**SAMPLING),
                generator=gen,
            )
            counts[tuple(out.tokens)] += 1
    return counts


def max_abs_z(counts: Counter, expected: dict[tuple[int, ...], float]) -> float:
    """The largest |z| over the outputs; an output the target cannot produce counts as infinitely far."""
    n = sum(counts.values())
    if set(counts) - set(expected):
        return math.inf
    return max(abs(counts[k] - n * p) / math.sqrt(n * p * (1 - p)) for k, p in expected.items())


@cache
def expected_outputs() -> dict[tuple[int, ...], float]:
    return target_sequence_probs(target(), PROMPT, L, **SAMPLING)


def test_the_test_has_its_stated_power():
    expected = expected_outputs()
    assert sum(p >= MIN_PROB for p in expected.values()) >= 3  # the power statement is about real outputs
    n = draws_needed(expected)
    assert min_power(expected, n) >= POWER > min_power(expected, n - 1)
    assert n < 40_000, n  # the draws stay within the time this file may take


def test_speculative_sampling_matches_the_target():
    expected = expected_outputs()
    counts = draw_outputs(draws_needed(expected))
    assert max_abs_z(counts, expected) <= z_critical(len(expected)), (counts, expected)


def test_control_a_planted_bug_is_rejected(monkeypatch):
    """The same test on a loop whose accept test forgets to renormalise the residual (u < weight instead of
    u * total < weight): later siblings are accepted too rarely. A bug that size needs far fewer draws."""

    def unnormalised(self: TorchDecisions, weight: torch.Tensor, total: torch.Tensor) -> bool:
        u = torch.rand((), generator=self.generator, device=self.device, dtype=torch.float64)
        return bool(u < weight)

    monkeypatch.setattr(TorchDecisions, "accept", unnormalised)
    expected = expected_outputs()
    assert max_abs_z(draw_outputs(3_000), expected) > z_critical(len(expected))


@pytest.mark.parametrize("seed", [0, 1])
def test_default_decisions_keep_the_generator_stream(seed):
    """TorchDecisions makes the same calls on the generator as the loop did before the seam: the accept test
    is ``u * total < weight`` on one float64 uniform, the categorical draw ``torch.multinomial``."""
    gen, ref = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    decide = TorchDecisions(gen)
    weights = torch.tensor([0.2, 0.0, 0.5, 0.3], dtype=torch.float64)
    for _ in range(20):
        u = torch.rand((), generator=ref, dtype=torch.float64)
        assert decide.accept(weights[2], weights.sum()) == bool(u * weights.sum() < weights[2])
        assert decide.categorical(weights) == int(torch.multinomial(weights, 1, generator=ref))
