"""Tree-size autotuning: the pure selection, the pruned-acceptance model, and a measured run on a tiny target."""

from __future__ import annotations

import pytest
import torch

from eagle.autotune import (
    autotune_total_tokens,
    expected_tokens_per_second,
    max_tree_nodes,
    measure_verify_ms,
    node_ranks,
    pruned_accept_lengths,
    select_total_tokens,
)
from eagle.drafter import HeadDrafter, OracleDrafter
from eagle.errors import EagleError
from eagle.heads import HeadConfig, build_head
from eagle.testing import tiny_model
from eagle.tree import TreeConfig, build_tree, tree_from_parents


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


def _rows(taus, verify):
    return [
        {"total_tokens": n, "expected_tau": t, "verify_ms": v} for n, t, v in zip((2, 4, 8, 16), taus, verify)
    ]


def test_selection_maximises_expected_tokens_per_second():
    # CPU-like: verification grows with size, acceptance saturates -> a middle size wins
    cpu = _rows([1.2, 2.0, 2.9, 3.0], [40.0, 50.0, 70.0, 110.0])
    rates = [expected_tokens_per_second(r["expected_tau"], r["verify_ms"], 10.0) for r in cpu]
    assert rates.index(max(rates)) == 2
    assert select_total_tokens(cpu, draft_ms=10.0) == 8
    # GPU-like: flat verification cost -> the biggest tree wins
    assert select_total_tokens(_rows([1.2, 2.0, 2.9, 3.0], [20.0] * 4), draft_ms=2.0) == 16
    # equal rates -> the smaller tree
    assert select_total_tokens(_rows([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]), draft_ms=0.0) == 2
    with pytest.raises(EagleError, match="candidate"):
        select_total_tokens([], 1.0)
    assert expected_tokens_per_second(2.0, 15.0, 5.0) == pytest.approx(100.0)
    assert max_tree_nodes(depth=2, top_k=2) == 7


def test_pruned_accept_lengths_by_rank():
    # root -> A(-0.1) -> C(-0.2) -> E(-0.1); root -> B(-1.0); A -> D(-2.0)
    tree = tree_from_parents(
        [0, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 3], [0.0, -0.1, -1.0, -0.2, -2.0, -0.1]
    )
    assert node_ranks(tree) == [-1, 0, 3, 1, 4, 2]  # A, C, E, B, D
    deep = pruned_accept_lengths(tree, [0, 1, 3, 5], [2, 3, 4, 5, 6])
    assert deep == {2: 2, 3: 3, 4: 4, 5: 4, 6: 4}
    side = pruned_accept_lengths(tree, [0, 2], [2, 4, 5, 6])
    assert side == {2: 1, 4: 1, 5: 2, 6: 2}
    assert pruned_accept_lengths(tree, [0], [2, 6]) == {2: 1, 6: 1}


def test_smaller_dynamic_trees_are_the_best_ranked_nodes_of_the_largest():
    """The premise of the acceptance model: budget N keeps exactly the N - 1 best-ranked drafts of a bigger tree."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 50, generator=g)

    def expand(nodes, k, tokens, parents):
        rows = []
        for node in nodes:
            path, v = [], node
            while v >= 0:
                path.append(tokens[v])
                v = parents[v]
            rows.append(table[hash(tuple(path)) % 1000])
        logp = torch.log_softmax(torch.stack(rows), -1)
        values, ids = torch.topk(logp, k, dim=-1)
        return ids, values

    def paths(tree):
        out = set()
        for i in range(tree.size):
            p, v = [], i
            while v >= 0:
                p.append(int(tree.tokens[v]))
                v = int(tree.parents[v])
            out.add(tuple(p[::-1]))
        return out

    big = build_tree(7, expand, TreeConfig(policy="dynamic", depth=4, top_k=3, total_tokens=30))
    ranks = node_ranks(big)
    big_paths = sorted(paths(big))
    for n in (2, 5, 9, 17, 30):
        small = build_tree(7, expand, TreeConfig(policy="dynamic", depth=4, top_k=3, total_tokens=n))
        kept = {p for p in big_paths if len(p) == 1}
        for i in range(1, big.size):
            if ranks[i] < n - 1:
                p, v = [], i
                while v >= 0:
                    p.append(int(big.tokens[v]))
                    v = int(big.parents[v])
                kept.add(tuple(p[::-1]))
        assert paths(small) == kept, n


def test_measure_verify_ms_times_every_size(model):
    times = measure_verify_ms(model, [1, 4, 16], cache_len=20, repeats=2)
    assert set(times) == {1, 4, 16} and all(t > 0 for t in times.values())


def test_measure_verify_ms_computes_the_lazy_logit_rows_only(model):
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2]))
    try:
        measure_verify_ms(model, [4, 16], cache_len=20, repeats=1, logit_rows=3)
        lazy = rows[1:]  # the first call is the cache's prefill
        rows.clear()
        measure_verify_ms(model, [4, 16], cache_len=20, repeats=1)
        full = rows[1:]
    finally:
        hook.remove()
    assert lazy == [3, 3] * 2 and full == [4, 16] * 2


def test_autotune_with_oracle_matches_exact_acceptance(model):
    prompts = [torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    tree = TreeConfig(policy="dynamic", depth=2, top_k=2, total_tokens="auto")
    res = autotune_total_tokens(
        model,
        OracleDrafter(model),
        prompts,
        tree,
        candidates=[2, 3, 5, 7, 64],
        calibration_new_tokens=8,
        repeats=1,
    )
    sizes = [r["total_tokens"] for r in res.table]
    assert sizes == [2, 3, 5, 7]  # 64 cannot fit a depth-2 top-2 tree (7 nodes at most)
    # the oracle's greedy chain ranks first: a size-N tree holds min(N - 1, depth) of it, all accepted
    assert [r["expected_tau"] for r in res.table] == [2.0, 3.0, 3.0, 3.0]
    assert res.calibration_steps > 0 and res.draft_ms > 0 and res.plain_ms > 0
    assert res.chosen in sizes
    best = max(res.table, key=lambda r: (r["expected_tokens_per_second"], -r["total_tokens"]))
    assert res.chosen == best["total_tokens"]
    for r in res.table:
        expect = expected_tokens_per_second(r["expected_tau"], r["verify_ms"], res.draft_ms)
        assert r["expected_tokens_per_second"] == pytest.approx(expect)
    assert res.to_dict()["chosen"] == res.chosen


def test_autotune_with_untrained_head(model):
    cfg = HeadConfig.from_target(model.config, "eagle3")
    head = build_head(cfg).attach_target(model).eval()
    prompts = [torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(2))]
    tree = TreeConfig(policy="dynamic", depth=3, top_k=2, total_tokens="auto")
    res = autotune_total_tokens(model, HeadDrafter(head), prompts, tree, candidates=[2, 4, 8], repeats=1)
    assert res.chosen in (2, 4, 8)
    taus = [r["expected_tau"] for r in res.table]
    assert all(1.0 <= t for t in taus) and taus == sorted(taus)  # a bigger tree never accepts less
    rates = {r["total_tokens"]: r["expected_tokens_per_second"] for r in res.table}
    assert rates[res.chosen] == max(rates.values())
