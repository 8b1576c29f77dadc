"""Verification of a draft tree against the target's distributions (pure tensor functions).

``target_logits[i]`` / ``target_probs[i]`` is the target's next-token distribution AFTER node i, i.e. the
distribution of node i's children. Both verifiers return the accepted node indices (root first, a root-to-node
path) and the next token, which becomes the root of the next tree. Both read the rows of the accepted path's nodes
only (the last one gives the next token), so the rows may be a :class:`LazyRows` that makes each on first access
instead of a full [N, V] tensor.

Why tree sampling is exactly lossless (``verify_sampling``): drafted children are the draft's top-k, a
deterministic function of the context, so each proposal is a point mass. At a node with target distribution p we
try its children x1, x2, ... in order against a residual r (initially p): accept x_j with probability
r(x_j) / sum(r); on rejection zero r(x_j) and go on; when every child is rejected, sample from r. The emitted
token y then has probability p(y): for x1 it is p(x1); for any other y it is (1 - p(x1)) * p(y) / (1 - p(x1))
restricted to y != x1, i.e. p(y), and the same argument repeats for each later sibling against the conditional
distribution. Emitting a child moves to that child, where the target's distribution is the true conditional
given the extended prefix; emitting a residual sample (never a tried child, since those were zeroed) ends the
step. Every emitted token is therefore drawn from the target's conditional given all previous tokens, whatever
the draft proposed -- the output distribution equals plain sampling from the target.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from eagle.tree import DraftTree


class Decisions(Protocol):
    """Where every random choice of sampling and verification is made (the seam tests enumerate through).

    The product code states each choice and its probabilities; a source only makes it.
    :class:`TorchDecisions` draws with a ``torch.Generator`` (what generation uses); a test can replay
    scripted choices instead and read the probabilities the product code passed, to compute an output's exact
    probability (tests/test_lossless_exact.py). ``device``: where the callers put the tensors they pass.
    """

    device: torch.device

    def accept(self, weight: torch.Tensor, total: torch.Tensor) -> bool:
        """A Bernoulli draw, True with probability ``weight / total`` (0-d float64, 0 <= weight <= total)."""

    def categorical(self, weights: torch.Tensor) -> int:
        """An index drawn with probability proportional to ``weights`` [V] (float64, unnormalised)."""


class TorchDecisions:
    """The default :class:`Decisions`: draws from ``generator`` (None: torch's global one) on its device,
    with the same calls and the same outputs per seed as before the seam existed."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self.device = generator.device if generator is not None else torch.device("cpu")

    def accept(self, weight: torch.Tensor, total: torch.Tensor) -> bool:
        """True iff ``u * total < weight`` for u uniform in [0, 1): probability ``weight / total``."""
        u = torch.rand((), generator=self.generator, device=self.device, dtype=torch.float64)
        return bool(u * total < weight)

    def categorical(self, weights: torch.Tensor) -> int:
        """``torch.multinomial`` over ``weights``."""
        return int(torch.multinomial(weights, 1, generator=self.generator))


def as_decisions(source: torch.Generator | Decisions | None) -> Decisions:
    """A generator (or None) wrapped as :class:`TorchDecisions`; a :class:`Decisions` as it is."""
    if source is None or isinstance(source, torch.Generator):
        return TorchDecisions(source)
    return source


class LazyRows:
    """Rows of an [N, V] matrix made on first access by ``compute(node) -> [V]`` and kept for later reads."""

    def __init__(self, compute: Callable[[int], torch.Tensor]):
        self._compute = compute
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, node: int) -> torch.Tensor:
        node = int(node)
        if node not in self._rows:
            self._rows[node] = self._compute(node)
        return self._rows[node]

    @property
    def computed(self) -> list[int]:
        """The nodes whose rows were made, in access order."""
        return list(self._rows)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor | LazyRows) -> tuple[torch.Tensor, int]:
    """Accept the longest path whose every drafted token equals the target's argmax at its parent.

    ``target_logits``: [N, V], or a :class:`LazyRows`; only the rows of the accepted nodes are read. Returns
    (accepted node indices incl. the root, as a long tensor on the CPU; the bonus token: the target's argmax
    after the last accepted node).
    """
    tokens = tree.tokens.tolist()
    node, accepted = 0, [0]
    while True:
        pred = int(target_logits[node].argmax(-1))
        # siblings are distinct tokens, so at most one child matches
        nxt = next((c for c in tree.children(node) if tokens[c] == pred), None)
        if nxt is None:
            return torch.tensor(accepted, dtype=torch.long), pred
        node = nxt
        accepted.append(node)


def verify_sampling(
    tree: DraftTree,
    target_probs: torch.Tensor | LazyRows,
    generator: torch.Generator | Decisions | None = None,
) -> tuple[torch.Tensor, int]:
    """Multi-candidate rejection sampling over a tree of deterministic (top-k) drafts; exactly lossless.

    ``target_probs`` [N, V] (or a :class:`LazyRows`, read at the visited nodes only): the target's warped
    distributions (see :func:`eagle.sampling.logits_to_probs`). Random choices go through ``generator``: a torch.Generator
    (its device is used for the arithmetic) or any :class:`Decisions`. Returns (accepted node indices incl. the
    root, the next token).
    """
    decide = as_decisions(generator)
    tokens = tree.tokens.tolist()
    node, accepted = 0, [0]
    while True:
        residual = target_probs[node].to(device=decide.device, dtype=torch.float64).clone()
        moved = False
        for child in tree.children(node):
            x = tokens[child]
            if decide.accept(residual[x], residual.sum()):
                node, moved = child, True
                accepted.append(child)
                break
            residual[x] = 0.0
        if not moved:
            # only reachable through rounding; fall back to the full distribution
            if not bool(residual.sum() > 0):
                residual = target_probs[node].to(device=decide.device, dtype=torch.float64)
            return torch.tensor(accepted, dtype=torch.long), decide.categorical(residual)
