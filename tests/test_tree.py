"""Draft tree structure and the chain / static / dynamic (EAGLE-2) builders, with a synthetic drafter."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle.errors import EagleError
from eagle.tree import (
    DraftTree,
    TreeConfig,
    build_chain,
    build_dynamic_tree,
    build_static_tree,
    build_tree,
    deepest_draft,
    deepest_node,
    graft_chain,
    lookup_continuation,
    lookup_length,
    tree_from_parents,
)

V = 11


def path_logprobs(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed pseudo-random draft distribution for each token path (root token first)."""
    seed = int(hashlib.sha256(repr(path).encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(3 * torch.randn(V, generator=g), -1)


class SyntheticDrafter:
    """An ``expand`` callback over path_logprobs that records what it was asked to expand."""

    def __init__(self):
        self.calls: list[list[tuple[int, ...]]] = []

    @staticmethod
    def path_of(node: int, tokens: list[int], parents: list[int]) -> tuple[int, ...]:
        path = []
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        return tuple(path[::-1])

    def __call__(self, nodes, k, tokens, parents):
        paths = [self.path_of(n, tokens, parents) for n in nodes]
        self.calls.append(paths)
        lp = torch.stack([path_logprobs(p) for p in paths])
        values, ids = torch.topk(lp, min(k, V), dim=-1)
        return ids, values


def score(path: tuple[int, ...]) -> float:
    """Cumulative draft log-prob of the last token of ``path`` (root excluded)."""
    return sum(float(path_logprobs(path[:i])[path[i]]) for i in range(1, len(path)))


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    return [SyntheticDrafter.path_of(i, toks, pars) for i in range(tree.size)]


def check_consistent(tree: DraftTree) -> None:
    """Masks, depths and paths agree with the parent array; parents precede children."""
    n = tree.size
    parents = tree.parents.tolist()
    assert parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, n):
        assert 0 <= parents[i] < i
        assert tree.depths[i] == tree.depths[parents[i]] + 1
    for i in range(n):
        ancestors = set()
        j = i
        while j >= 0:
            ancestors.add(j)
            j = parents[j]
        assert {j for j in range(n) if tree.attn_mask[i, j]} == ancestors
    leaves = [i for i in range(n) if i not in set(parents)]
    assert tree.paths.shape == (len(leaves), int(tree.depths.max()) + 1)
    assert sorted(int(p[p >= 0][-1]) for p in tree.paths) == leaves
    for row in tree.paths.tolist():
        nodes = [v for v in row if v >= 0]
        assert row[len(nodes) :] == [-1] * (len(row) - len(nodes))
        assert nodes[0] == 0
        assert all(parents[b] == a for a, b in zip(nodes, nodes[1:]))
    for i in range(n):  # siblings are distinct tokens
        kids = tree.children(i)
        assert len({int(tree.tokens[c]) for c in kids}) == len(kids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=0, max_size=25))
def test_tree_from_parents_is_consistent(choices):
    parents = [-1] + [c % (i + 1) for i, c in enumerate(choices)]
    tree = tree_from_parents(list(range(len(parents))), parents)
    check_consistent(tree)
    assert tree.max_depth == int(tree.depths.max())


def test_tree_from_parents_example():
    tree = tree_from_parents([7, 8, 9, 10, 11], [-1, 0, 0, 1, 1])
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.paths.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]
    assert tree.attn_mask[4].tolist() == [True, True, False, False, True]
    assert tree.children(1) == [3, 4]


def test_tree_from_parents_rejects_bad_input():
    with pytest.raises(EagleError, match="parent"):
        tree_from_parents([1, 2], [0, 0])
    with pytest.raises(EagleError, match="precede"):
        tree_from_parents([1, 2, 3], [-1, 2, 0])
    with pytest.raises(EagleError, match="as many tokens"):
        tree_from_parents([1, 2], [-1])


@pytest.mark.parametrize("depth,top_k,total", [(5, 4, 16), (3, 3, 13), (4, 2, 40), (1, 5, 3), (6, 1, 16)])
def test_dynamic_tree_is_eagle2_selection(depth, top_k, total):
    drafter = SyntheticDrafter()
    tree = build_dynamic_tree(3, drafter, depth, top_k, total)
    check_consistent(tree)
    n_candidates = min(top_k, V) + (depth - 1) * top_k * min(top_k, V)
    assert tree.size == min(total, n_candidates + 1)
    assert tree.max_depth <= depth

    # expansions: depth calls; at each depth the top_k candidates by cumulative score are expanded
    assert len(drafter.calls) == depth
    assert drafter.calls[0] == [(3,)]
    all_candidates = set()
    for call in drafter.calls:
        for path in call:
            lp = path_logprobs(path)
            for t in torch.topk(lp, min(top_k, V)).indices.tolist():
                all_candidates.add(path + (t,))
    for d in range(1, depth):
        level = sorted((p for p in all_candidates if len(p) == d + 1), key=score, reverse=True)
        assert set(drafter.calls[d]) == set(level[:top_k])

    # the kept nodes are the best total-1 candidates; closure under parents holds
    paths = node_paths(tree)
    kept = set(paths[1:])
    dropped = all_candidates - kept
    if dropped:
        assert min(score(p) for p in kept) >= max(score(p) for p in dropped)
    assert all(p[:-1] in kept or len(p) == 2 for p in kept)
    # order: by depth, then by score within a depth
    keys = [(len(p), -score(p)) for p in paths[1:]]
    assert keys == sorted(keys)
    # stored draft log-probs are the per-edge log-probs
    for i, p in enumerate(paths[1:], start=1):
        assert tree.draft_logprobs[i].item() == pytest.approx(float(path_logprobs(p[:-1])[p[-1]]), abs=1e-5)


def test_static_tree_from_paths():
    choices = [[0], [1], [0, 0], [0, 1], [2], [1, 0], [0, 0, 0]]
    drafter = SyntheticDrafter()
    tree = build_static_tree(5, drafter, choices)
    check_consistent(tree)
    assert tree.size == len(choices) + 1
    ordered = sorted(map(tuple, choices), key=lambda p: (len(p), p))
    for i, ranks in enumerate(ordered, start=1):
        # node i is the ranks[-1]-th best child of the node for ranks[:-1]
        parent = 0 if len(ranks) == 1 else ordered.index(ranks[:-1]) + 1
        assert tree.parents[i] == parent
        parent_path = node_paths(tree)[parent]
        ranked = torch.argsort(path_logprobs(parent_path), descending=True).tolist()
        assert tree.tokens[i] == ranked[ranks[-1]]
    assert [len(c) for c in drafter.calls] == [1, 2, 1]


def test_chain():
    tree = build_chain(4, SyntheticDrafter(), 5)
    check_consistent(tree)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    path = (4,)
    for i in range(1, 6):
        path = path + (int(path_logprobs(path).argmax()),)
        assert tree.tokens[i] == path[-1]
    assert tree.paths.tolist() == [[0, 1, 2, 3, 4, 5]]


def test_build_tree_dispatch_and_an_unmeasured_budget():
    assert build_tree(1, SyntheticDrafter(), TreeConfig("chain", depth=3)).size == 4
    assert build_tree(1, SyntheticDrafter(), TreeConfig("static", static_paths=[[0], [1], [1, 0]])).size == 4
    assert build_tree(1, SyntheticDrafter(), TreeConfig("dynamic", depth=4, top_k=4, total_tokens=7)).size == 7
    # "auto" means one thing: the size eagle.autotune measures on this device before decoding
    with pytest.raises(EagleError, match="autotune"):
        build_tree(1, SyntheticDrafter(), TreeConfig("dynamic", depth=4, top_k=4, total_tokens="auto"))


@pytest.mark.parametrize(
    "cfg,match",
    [
        (TreeConfig(policy="beam"), "unknown"),
        (TreeConfig(policy="static"), "static_paths"),
        (TreeConfig(policy="static", static_paths=[[0], [1, 0]]), "parent path"),
        (TreeConfig(policy="static", static_paths=[[0], [0]]), "twice"),
        (TreeConfig(policy="static", static_paths=[[-1]]), "ranks"),
        (TreeConfig(depth=0), "depth"),
        (TreeConfig(top_k=0), "top_k"),
        (TreeConfig(total_tokens=1), "total_tokens"),
        (TreeConfig(total_tokens="many"), "total_tokens"),
    ],
)
def test_tree_config_validation(cfg, match):
    with pytest.raises(EagleError, match=match):
        cfg.validate()


def test_lookup_continuation_finds_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # the 3-gram (2, 6, 7) never occurred before; the 2-gram (6, 7) did, latest at 5: continue with 9, 2, ...
    assert lookup_continuation(history, 3, 2) == [9, 2]
    assert lookup_continuation(history, 3, 10) == [9, 2, 6, 7]  # may run up to the end of the history
    assert lookup_continuation([1, 2, 3, 1, 2, 3, 1, 2], 3, 3) == [3, 1, 2]  # the longest n-gram wins
    assert lookup_continuation([4, 9, 4], 3, 2) == [9, 4]  # falls back to a 1-gram
    assert lookup_continuation([1, 2, 3], 3, 4) == [] and lookup_continuation([7], 3, 4) == []


def test_graft_chain_reuses_drafted_nodes_and_appends_the_rest():
    tree = tree_from_parents([0, 4, 5, 6], [-1, 0, 0, 1], [0.0, -0.1, -2.0, -0.3])
    assert graft_chain(tree, []) is tree
    drafted = graft_chain(tree, [4, 6])  # already drafted: the same nodes, now marked as the lookup branch's
    assert torch.equal(drafted.tokens, tree.tokens) and torch.equal(drafted.parents, tree.parents)
    assert drafted.lookup_nodes == [1, 3] and tree.lookup_nodes == []
    grafted = graft_chain(tree, [4, 6, 8, 9])
    assert grafted.tokens.tolist() == [0, 4, 5, 6, 8, 9] and grafted.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert grafted.lookup_nodes == [1, 3, 4, 5]
    assert grafted.depths.tolist() == [0, 1, 1, 2, 3, 4]
    assert grafted.draft_logprobs.tolist() == pytest.approx([0.0, -0.1, -2.0, -0.3, 0.0, 0.0])
    new_root_child = graft_chain(tree, [7, 4])  # diverges at the root: a new branch after the drafted ones
    assert new_root_child.parents.tolist() == [-1, 0, 0, 1, 0, 4]
    assert new_root_child.children(0) == [1, 2, 4] and new_root_child.lookup_nodes == [4, 5]
    assert new_root_child.to("cpu").lookup_nodes == [4, 5]
    assert deepest_draft(TreeConfig("chain", depth=3)) == 3
    assert deepest_draft(TreeConfig("static", static_paths=[[0], [0, 0], [0, 0, 1]])) == 3
    with pytest.raises(EagleError, match="lookup_ngram"):
        TreeConfig(lookup_ngram=-1).validate()


def test_lookup_branch_length_defaults_to_the_depth_and_can_exceed_it():
    chain3 = TreeConfig("chain", depth=3)
    assert lookup_length(chain3) == 0 and deepest_node(chain3) == 3  # no lookup branch
    assert lookup_length(replace(chain3, lookup_ngram=2)) == 3  # as deep as the tree
    longer = replace(chain3, lookup_ngram=2, lookup_tokens=8)
    assert lookup_length(longer) == 8 and deepest_node(longer) == 8
    assert deepest_node(replace(chain3, lookup_ngram=2, lookup_tokens=2)) == 3  # a shorter branch
    for bad in (-1, 2.5, "8"):
        with pytest.raises(EagleError, match="lookup_tokens"):
            TreeConfig(lookup_ngram=3, lookup_tokens=bad).validate()
