"""Pick the node budget of a dynamic draft tree (``tree.total_tokens: auto``) for this target on this device.

A bigger tree is accepted further but makes every verification forward dearer; how much dearer depends on the
device (on a CPU a forward grows quickly with its token count, on a GPU 8 to 64 tokens cost about one). So we
measure instead of guessing. This module is the one owner of what ``auto`` means; a tree is only ever built with
the number it chose:

1. the target's verification forward at each candidate size over a realistic cache (median of a few repeats,
   sizes interleaved so that machine noise hits them alike);
2. the drafter's cost per step and its acceptance, from a short greedy calibration run with the LARGEST
   candidate tree. Every smaller EAGLE-2 tree of the same depth and top-k is the ancestor-closed set of its best
   ``size - 1`` nodes by cumulative draft log-probability (the expansions do not depend on the budget), so at
   temperature 0 the accepted length a size-N tree would have had at a step is the leading part of the big
   tree's accepted path whose nodes rank among the best N - 1. (The trajectory a smaller tree takes differs
   slightly; for sampling the estimate is an approximation.)

The choice maximises expected tokens/s = E[tau(N)] / (verify(N) + draft), the draft cost taken as independent
of N (a dynamic tree runs ``depth`` head steps whatever its budget).
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from eagle.cache import crop_cache
from eagle.devices import model_device, model_dtype, sync
from eagle.drafter import Drafter
from eagle.errors import EagleError
from eagle.sampling import Sampling
from eagle.speculate import speculative_generate, tree_attention_mask
from eagle.tree import DraftTree, TreeConfig, tree_from_parents

DEFAULT_CANDIDATES = (2, 4, 8, 16, 32, 64)


@dataclass
class AutotuneResult:
    """The chosen tree size and the measurements behind it (``table``: one row per candidate size)."""

    chosen: int
    table: list[dict[str, float]]
    draft_ms: float
    plain_ms: float
    cache_len: int
    calibration_steps: int
    seconds: float
    method: str = "greedy calibration with the largest tree, pruned to each budget; measured verify cost"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form for the evaluation report."""
        return asdict(self)


# ------------------------------------------------------------------------------------ pure helpers


def max_tree_nodes(depth: int, top_k: int) -> int:
    """How many nodes an EAGLE-2 tree of this depth and top-k can hold at most (root included)."""
    return 1 + top_k + (depth - 1) * top_k * top_k


def expected_tokens_per_second(expected_tau: float, verify_ms: float, draft_ms: float) -> float:
    """Tokens per second of a step that yields ``expected_tau`` tokens and costs verify + draft milliseconds."""
    step_ms = verify_ms + draft_ms
    if step_ms <= 0:
        raise ValueError(f"a step must cost a positive time, got {step_ms} ms")
    return 1000.0 * expected_tau / step_ms


def select_total_tokens(table: Sequence[Mapping[str, float]], draft_ms: float) -> int:
    """The ``total_tokens`` of the row with the highest expected tokens/s (ties go to the smaller tree).

    Each row needs ``total_tokens``, ``expected_tau`` and ``verify_ms``.
    """
    if not table:
        raise EagleError("tree autotuning has no candidate sizes to choose from: give at least one size >= 2")
    best = max(
        table,
        key=lambda r: (
            expected_tokens_per_second(r["expected_tau"], r["verify_ms"], draft_ms),
            -r["total_tokens"],
        ),
    )
    return int(best["total_tokens"])


def node_ranks(tree: DraftTree) -> list[int]:
    """Rank of every node by EAGLE-2's final selection order (root = -1, then 0 = best draft).

    Ranked by cumulative draft log-probability, ties by depth then node index, as
    :func:`eagle.tree.build_dynamic_tree` does; a tree without draft log-probs ranks by node index.
    """
    n = tree.size
    if tree.draft_logprobs is None:
        return [i - 1 for i in range(n)]
    parents = tree.parents.tolist()
    lp = tree.draft_logprobs.tolist()
    depths = tree.depths.tolist()
    score = [0.0] * n
    for i in range(1, n):
        score[i] = score[parents[i]] + lp[i]
    order = sorted(range(1, n), key=lambda i: (-score[i], depths[i], i))
    ranks = [-1] * n
    for r, i in enumerate(order):
        ranks[i] = r
    return ranks


def pruned_accept_lengths(tree: DraftTree, accepted: Sequence[int], sizes: Sequence[int]) -> dict[int, int]:
    """Accepted length (drafts + 1) the step would have had with the tree cut to its best ``size - 1`` drafts.

    ``accepted``: node indices the target accepted in the full tree, root first.
    """
    ranks = node_ranks(tree)
    out = {}
    for size in sizes:
        kept = 0
        for node in list(accepted)[1:]:
            if ranks[node] >= size - 1:
                break
            kept += 1
        out[int(size)] = kept + 1
    return out


# ------------------------------------------------------------------------------------- measurement


@torch.no_grad()
def measure_verify_ms(
    model: torch.nn.Module,
    sizes: Sequence[int],
    cache_len: int,
    repeats: int = 3,
    seed: int = 0,
    logit_rows: int | None = None,
) -> dict[int, float]:
    """Median milliseconds of one target forward over ``size`` tree tokens after a ``cache_len`` cache.

    ``logit_rows``: how many rows of logits the forward computes, as the decoding loop's lazy logits do (the
    tree's likely path: depth + 1 rows); None computes them for every token. Ignored by models whose forward
    takes no ``logits_to_keep``. Sizes are interleaved within each repeat (after one untimed round) so that
    drift affects them alike.
    """
    from eagle.targets import cache_kwarg

    device, dtype = model_device(model), model_dtype(model)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    kw = cache_kwarg(model)
    cache = DynamicCache()
    prompt = torch.randint(3, vocab, (1, max(cache_len, 1)), generator=gen)
    model(prompt.to(device), use_cache=True, **{kw: cache})
    prefix = prompt.shape[1]
    lazy = logit_rows is not None and "logits_to_keep" in inspect.signature(type(model).forward).parameters
    times: dict[int, list[float]] = {int(s): [] for s in sizes}
    for rep in range(repeats + 1):
        for size in times:
            tokens = torch.randint(3, vocab, (size,), generator=gen)
            tree = tree_from_parents(tokens, [-1] + list(range(size - 1))).to(device)  # a chain: same cost
            mask = tree_attention_mask(tree, prefix, None, dtype)
            rows = torch.arange(min(size, logit_rows), device=device) if lazy else None
            sync(device)
            t0 = time.perf_counter()
            model(
                tree.tokens[None],
                attention_mask=mask,
                position_ids=(prefix + tree.depths)[None],
                use_cache=True,
                output_hidden_states=True,
                **{kw: cache},
                **({"logits_to_keep": rows} if rows is not None else {}),
            )
            sync(device)
            if rep > 0:
                times[size].append(1000.0 * (time.perf_counter() - t0))
            crop_cache(cache, prefix)
    return {s: statistics.median(v) for s, v in times.items()}


class _RecordingDrafter:
    """Wraps a drafter and records (tree, accepted node indices) for every verification it learns about."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.steps: list[tuple[DraftTree, list[int]]] = []
        self._tree: DraftTree | None = None

    def prefill(self, input_ids, hidden_states, next_token) -> None:
        self.inner.prefill(input_ids, hidden_states, next_token)

    def draft(self, root_token: int, tree_cfg: TreeConfig) -> DraftTree:
        self._tree = self.inner.draft(root_token, tree_cfg)
        return self._tree

    def accept(self, accepted, hidden_states, next_tokens) -> None:
        if self._tree is not None:
            self.steps.append((self._tree.to("cpu"), [int(i) for i in accepted.tolist()]))
        self.inner.accept(accepted, hidden_states, next_tokens)


def autotune_total_tokens(
    model: torch.nn.Module,
    drafter: Drafter,
    prompts: Sequence[torch.Tensor],
    tree_cfg: TreeConfig,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    cache_len: int | None = None,
    calibration_new_tokens: int = 16,
    repeats: int = 3,
    eos_token_ids: Sequence[int] = (),
) -> AutotuneResult:
    """Choose ``total_tokens`` for a dynamic tree (see the module docstring); returns the choice and its table.

    ``prompts``: a couple of prompt id tensors [1, T] for the calibration run. ``cache_len``: the cache length
    verification is timed at (default: the mean prompt length plus half the calibration length).
    Candidates larger than the tree can hold (depth, top_k) are dropped.
    """
    t_start = time.perf_counter()
    tree_cfg = replace(tree_cfg, policy="dynamic").validate()
    limit = max_tree_nodes(tree_cfg.depth, tree_cfg.top_k)
    sizes = sorted({int(s) for s in candidates if 2 <= int(s) <= limit})
    notes = []
    if not sizes:
        sizes = [min(limit, max(2, min(int(s) for s in candidates)))] if candidates else [2]
        notes.append(
            f"no candidate fits a depth-{tree_cfg.depth} top-{tree_cfg.top_k} tree; using {sizes[0]}"
        )
    if not prompts:
        raise EagleError("tree autotuning needs at least one calibration prompt")
    if cache_len is None:
        cache_len = int(sum(p.shape[-1] for p in prompts) / len(prompts)) + calibration_new_tokens // 2

    # acceptance with the largest candidate tree, greedy
    recorder = _RecordingDrafter(drafter)
    # without the lookup branch: it comes on top of the budget, and its nodes have no draft rank
    big = replace(tree_cfg, total_tokens=sizes[-1], lookup_ngram=0)
    draft_s, steps = 0.0, 0
    for ids in prompts:
        res = speculative_generate(
            model, recorder, ids, calibration_new_tokens, big, sampling=Sampling(temperature=0.0, eos_token_ids=eos_token_ids)
        )
        draft_s += res.draft_time
        steps += res.target_forwards
    draft_ms = 1000.0 * draft_s / max(steps, 1)
    taus: dict[int, list[int]] = {s: [] for s in sizes}
    for tree, accepted in recorder.steps:
        for s, n in pruned_accept_lengths(tree, accepted, sizes).items():
            taus[s].append(n)
    if not recorder.steps:
        notes.append("the calibration run made no recorded step (it stopped at once); assuming tau = 1")

    # the loop computes logits for the tree's likely path only (lazy logits): time the same forward
    verify = measure_verify_ms(model, [1, *sizes], cache_len, repeats, logit_rows=tree_cfg.depth + 1)
    table = []
    for s in sizes:
        tau = sum(taus[s]) / len(taus[s]) if taus[s] else 1.0
        table.append(
            {
                "total_tokens": s,
                "verify_ms": verify[s],
                "expected_tau": tau,
                "expected_tokens_per_second": expected_tokens_per_second(tau, verify[s], draft_ms),
            }
        )
    chosen = select_total_tokens(table, draft_ms)
    return AutotuneResult(
        chosen=chosen,
        table=table,
        draft_ms=draft_ms,
        plain_ms=verify[1],
        cache_len=int(cache_len),
        calibration_steps=len(recorder.steps),
        seconds=round(time.perf_counter() - t_start, 3),
        notes=notes,
    )
