"""Greedy and rejection-sampling tree verification; sampling must be exactly lossless."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle.sampling import logits_to_probs
from eagle.tree import DraftTree, graft_chain, tree_from_parents
from eagle.verify import LazyRows, verify_greedy, verify_sampling

V = 5


def one_hot_logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    for i, a in enumerate(argmaxes):
        logits[i, a] = 10.0
    return logits


def test_greedy_picks_the_longest_matching_path():
    #        0(root)
    #      /   |    \
    #    1:4  2:5   3:6
    #    |    / \
    #  4:7  5:8 6:9
    #         |
    #        7:1
    tree = tree_from_parents([0, 4, 5, 6, 7, 8, 9, 1], [-1, 0, 0, 0, 1, 2, 2, 5])
    # target: after root -> 5 (node 2), after node 2 -> 8 (node 5), after node 5 -> 1 (node 7), after 7 -> 3
    argmaxes = [5, 7, 8, 0, 0, 1, 0, 3]
    accepted, bonus = verify_greedy(tree, one_hot_logits(argmaxes))
    assert accepted.tolist() == [0, 2, 5, 7]
    assert bonus == 3
    # a mismatch at depth 2: stop at node 2, bonus = target's choice there
    argmaxes[2] = 9
    accepted, bonus = verify_greedy(tree, one_hot_logits(argmaxes))
    assert accepted.tolist() == [0, 2, 6]
    assert bonus == argmaxes[6]
    # nothing matches: only the root, bonus = target's argmax at the root
    accepted, bonus = verify_greedy(tree, one_hot_logits([3] + [0] * 7))
    assert accepted.tolist() == [0] and bonus == 3


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6)]
)
def test_logits_to_probs_matches_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(logits_to_probs(logits, temperature, top_p, top_k), scores.softmax(-1))


def test_logits_to_probs_greedy_is_one_hot():
    logits = torch.randn(3, 9)
    probs = logits_to_probs(logits, 0.0)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))


# ------------------------------------------------------------------------------------------ lossless


def random_probs(n: int, seed: int, sparse: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    if sparse:  # some zero-probability tokens, including drafted ones
        p[:, 0] = 0.0
        p = p / p.sum(-1, keepdim=True)
    return p


def exact_output_distribution(tree: DraftTree, probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Every possible output (accepted tokens + next token) of the tree rejection rule with its exact probability,
    by enumerating every accept / reject branch: at a node, child x is accepted with probability r(x) / sum(r)
    under the residual r (initially the target's p there); a rejection zeroes r(x); after all children are
    rejected the next token is drawn from r."""
    out: Counter = Counter()
    tokens = tree.tokens.tolist()

    def walk(node: int, prob: float, prefix: tuple[int, ...]) -> None:
        residual = probs[node].clone()
        still = 1.0  # probability that every child tried so far was rejected
        for child in tree.children(node):
            x = tokens[child]
            accept = float(residual[x] / residual.sum())
            if accept > 0:
                walk(child, prob * still * accept, prefix + (x,))
            still *= 1 - accept
            residual[x] = 0.0
        if still > 0:
            for y in range(V):
                if residual[y] > 0:
                    out[prefix + (y,)] += prob * still * float(residual[y] / residual.sum())

    walk(0, 1.0, ())
    return dict(out)


def target_distribution(tree: DraftTree, probs: torch.Tensor, seq: tuple[int, ...]) -> float:
    """Probability that plain sampling from the target emits ``seq`` (walking the tree while tokens match)."""
    tokens = tree.tokens.tolist()
    node, prob = 0, 1.0
    for y in seq:
        prob *= float(probs[node, y])
        node = next((c for c in tree.children(node) if tokens[c] == y), None)
        if node is None:
            break
    return prob


TREES = [
    # root with 3 siblings
    tree_from_parents([0, 1, 3, 4], [-1, 0, 0, 0]),
    # 2 levels, several siblings at each level
    tree_from_parents([0, 2, 0, 1, 3, 4, 0], [-1, 0, 0, 1, 1, 2, 2]),
    # deep and wide, 4 of 5 tokens drafted at the root
    tree_from_parents([0, 1, 2, 3, 4, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 1, 1, 5, 5, 2]),
    # prompt-lookup branches grafted on: one follows drafted nodes then extends them, one is a new root child
    graft_chain(tree_from_parents([0, 2, 0, 1, 3, 4, 0], [-1, 0, 0, 1, 1, 2, 2]), [2, 1, 4]),
    graft_chain(tree_from_parents([0, 1, 3, 4], [-1, 0, 0, 0]), [2, 3]),
]


@pytest.mark.parametrize("tree_index", range(len(TREES)))
@pytest.mark.parametrize("seed,sparse", [(0, False), (1, False), (2, True)])
def test_tree_rejection_is_exactly_lossless(tree_index, seed, sparse):
    tree = TREES[tree_index]
    probs = random_probs(tree.size, seed, sparse)
    dist = exact_output_distribution(tree, probs)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    for seq, p in dist.items():
        assert p == pytest.approx(target_distribution(tree, probs, seq), abs=1e-12), seq
    # the first token alone is distributed as the target's distribution at the root
    first = Counter()
    for seq, p in dist.items():
        first[seq[0]] += p
    for y in range(V):
        assert first[y] == pytest.approx(float(probs[0, y]), abs=1e-12)


def chi_square_pvalue(observed: Counter, expected: dict, n: int) -> float:
    keys = [k for k in expected if expected[k] * n >= 5]  # pool rare outcomes into one cell
    rare = [k for k in expected if k not in keys]
    obs = [observed[k] for k in keys] + [sum(observed[k] for k in rare)]
    exp = [expected[k] * n for k in keys] + [sum(expected[k] for k in rare) * n]
    if exp[-1] < 5:
        obs[-2] += obs.pop()
        exp[-2] += exp.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_verify_sampling_matches_the_target_chi_square():
    tree = TREES[1]
    probs = random_probs(tree.size, 3).float()
    expected = {
        seq: target_distribution(tree, probs.double(), seq) for seq in exact_output_distribution(tree, probs)
    }
    gen = torch.Generator().manual_seed(1234)
    n = 6000
    seen: Counter = Counter()
    tokens = tree.tokens.tolist()
    for _ in range(n):
        accepted, nxt = verify_sampling(tree, probs, gen)
        path = accepted.tolist()
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert nxt not in [
            tokens[c] for c in tree.children(path[-1])
        ]  # a drafted child would have been accepted
        seen[tuple(tokens[i] for i in path[1:]) + (nxt,)] += 1
    assert set(seen) <= set(expected)
    assert chi_square_pvalue(seen, expected, n) > 1e-3
    first: Counter = Counter()
    for seq, c in seen.items():
        first[seq[:1]] += c
    assert chi_square_pvalue(first, {(y,): float(probs[0, y]) for y in range(V)}, n) > 1e-3


def test_chi_square_detects_a_wrong_rule():
    # sanity check of the test itself: accepting drafts without rejection is far from the target
    tree = TREES[1]
    probs = random_probs(tree.size, 3)
    expected = {seq: target_distribution(tree, probs, seq) for seq in exact_output_distribution(tree, probs)}
    wrong = Counter({(2, 3, 0): 3000})
    assert chi_square_pvalue(wrong, expected, 3000) < 1e-6


def test_sampling_with_one_hot_target_equals_greedy():
    tree = TREES[2]
    for seed in range(5):
        logits = torch.randn(tree.size, V, generator=torch.Generator().manual_seed(seed))
        logits[0, 1] += 5  # make the root's argmax a drafted child at least once
        greedy = verify_greedy(tree, logits)
        sampled = verify_sampling(tree, logits_to_probs(logits, 0.0), torch.Generator().manual_seed(seed))
        assert sampled[0].tolist() == greedy[0].tolist() and sampled[1] == greedy[1]


def test_lazy_rows_read_only_the_visited_nodes():
    tree = TREES[2]
    lengths = set()
    for seed in range(6):
        logits = torch.randn(tree.size, V, generator=torch.Generator().manual_seed(seed))
        logits[0, 1] += 5  # the root's argmax is drafted child 1 (node 1), whose argmax may be drafted too
        lazy = LazyRows(logits.__getitem__)
        accepted, bonus = verify_greedy(tree, lazy)
        ref_accepted, ref_bonus = verify_greedy(tree, logits)
        assert accepted.tolist() == ref_accepted.tolist() and bonus == ref_bonus
        assert lazy.computed == accepted.tolist()  # the accepted path, root first, nothing else
        lengths.add(accepted.numel())
        probs = logits_to_probs(logits, 0.8)
        lazy = LazyRows(probs.__getitem__)
        a = verify_sampling(tree, lazy, torch.Generator().manual_seed(seed))
        b = verify_sampling(tree, probs, torch.Generator().manual_seed(seed))
        assert a[0].tolist() == b[0].tolist() and a[1] == b[1]
        assert lazy.computed == a[0].tolist()
        lengths.add(a[0].numel())
    assert len(lengths) > 1  # both short and longer accepted paths were exercised
    calls = []
    rows = LazyRows(lambda node: calls.append(node) or torch.zeros(V))
    rows[3], rows[3], rows[1]
    assert calls == [3, 1] and rows.computed == [3, 1]
