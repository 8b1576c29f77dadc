"""speculative_generate's output distribution is exactly the target's, computed through the product code.

tests/_lossless.py re-runs the whole loop once per decision path, with every random choice scripted through
the ``generator`` seam (eagle.verify.Decisions) and every probability taken from what the product code
states, and sums the paths per output. On a 6-token float64 target every output of L = 4 tokens (the first,
from the prefill, included) is enumerated and compared with the target's own sequence probabilities: the
total variation must be rounding (1e-12), for chain, static and dynamic trees of depth 3, a grafted
prompt-lookup branch, temperatures 0.7, 0.9, 1 and 1.3, top-p and top-k, lazy and full logits. The drafters
accept part of their drafts, so paths through accepted, rejected and residual-sampled nodes all carry
probability.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
import torch
from _lossless import enumerate_outputs, target_sequence_probs, tiny_target, total_variation

import eagle.speculate
from eagle.drafter import Drafter, HeadDrafter, OracleDrafter
from eagle.heads import HeadConfig, build_head
from eagle.sampling import Sampling
from eagle.speculate import speculative_generate
from eagle.tree import DraftTree, TreeConfig
from eagle.verify import Decisions

L = 4  # output length: the prefill's token + 3, so depth-3 drafts decide the 4th token
PROMPT = torch.tensor([[1, 3, 4, 5, 3, 4]])  # "3 4" repeats: the lookup branch proposes "5 3 4"


@cache
def target() -> torch.nn.Module:
    return tiny_target(seed=0)


@cache
def draft_model() -> torch.nn.Module:
    """The target with noisy weights: its top tokens agree with the target's often, not always."""
    model = copy.deepcopy(target())
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.6 * p.std())
    return model


@cache
def random_head() -> torch.nn.Module:
    """An untrained EAGLE-1 head with O(1) weights: on 6 tokens its drafts match the target's now and then."""
    model = target()
    torch.manual_seed(2)
    head = build_head(HeadConfig.from_target(model.config, "eagle1")).to(torch.float64)
    head.attach_target(model).eval()
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 1.5 / module.in_features**0.5)
    return head


@dataclass
class Case:
    tree: TreeConfig
    drafter: str  # "oracle": OracleDrafter on draft_model(); "head": HeadDrafter(random_head())
    sampling: dict[str, Any] = field(default_factory=dict)
    lazy_logits: bool = True

    def make_drafter(self) -> Drafter:
        return OracleDrafter(draft_model()) if self.drafter == "oracle" else HeadDrafter(random_head())


STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
LOOKUP = TreeConfig("dynamic", depth=3, top_k=2, total_tokens=5, lookup_ngram=2)
CASES = {
    "chain-T1": Case(TreeConfig("chain", depth=3), "oracle", dict(temperature=1.0)),
    "static-T0.7": Case(TreeConfig("static", static_paths=STATIC), "head", dict(temperature=0.7)),
    "dynamic-T1.3-top_p": Case(
        TreeConfig("dynamic", depth=3, top_k=2, total_tokens=7), "head", dict(temperature=1.3, top_p=0.8)
    ),
    "dynamic-lookup-top_k": Case(LOOKUP, "head", dict(temperature=0.9, top_k=4)),
    "dynamic-lookup-top_k-full-logits": Case(
        LOOKUP, "head", dict(temperature=0.9, top_k=4), lazy_logits=False
    ),
}


def generator_for(case: Case, length: int = L) -> Callable[[Decisions], list[int]]:
    """``generate(decisions) -> tokens`` for :func:`enumerate_outputs`: the loop with a fresh drafter."""

    def generate(decisions: Decisions) -> list[int]:
        return speculative_generate(target(), case.make_drafter(), PROMPT, length, case.tree,
                                    sampling=Sampling(**case.sampling), generator=decisions,
                                    lazy_logits=case.lazy_logits).tokens

    return generate


@pytest.mark.parametrize("name", list(CASES))
def test_output_distribution_equals_the_targets(name, monkeypatch):
    case = CASES[name]
    grown: list[int] = []  # nodes each lookup graft added to a drafted tree
    graft = eagle.speculate.graft_chain

    def spy(tree: DraftTree, chain: list[int]) -> DraftTree:
        out = graft(tree, chain)
        grown.append(out.size - tree.size)
        return out

    monkeypatch.setattr(eagle.speculate, "graft_chain", spy)
    got = enumerate_outputs(generator_for(case), L)
    want = target_sequence_probs(target(), PROMPT, L, **case.sampling)
    assert sum(got.dist.values()) == pytest.approx(1.0, abs=1e-12)
    assert total_variation(got.dist, want) < 1e-12, name
    # the drafter is neither useless nor an oracle: drafts are accepted and rejected with real probability
    assert got.mean_accepted > 0.2 and got.mean_rejected > 0.2, (got.mean_accepted, got.mean_rejected)
    if case.tree.lookup_ngram:
        assert sum(n > 0 for n in grown) > 0  # the lookup branch proposed tokens the head had not drafted


def test_pruning_after_the_last_token_changes_nothing():
    """The enumeration stops branching once L tokens are out (tests/_lossless.py); branching on to the end of
    every tree gives the same distribution, over more paths."""
    generate = generator_for(CASES["chain-T1"], length=3)
    pruned, full = enumerate_outputs(generate, 3), enumerate_outputs(generate, 3, prune=False)
    assert total_variation(pruned.dist, full.dist) < 1e-12
    assert full.paths > pruned.paths
