"""Draft trees: their configuration, their structure, and the three ways to grow one.

A tree is a flat list of nodes in topological order (every parent before its children). Node 0 is the root:
the last token the target sampled, whose successors are not verified yet. Every other node is a drafted token.
The builders here are model-free: they call an ``expand`` callback that, for a list of node indices, returns the
top-k child tokens (target ids) and their draft log-probabilities, so the same code grows trees for a trained
head and for the oracle drafter used in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from eagle.errors import EagleError

POLICIES = ("chain", "static", "dynamic")

# expand(node_indices, k, tokens_so_far, parents_so_far) -> (child_tokens [n, k] long, child_logprobs [n, k] float)
ExpandFn = Callable[[list[int], int, list[int], list[int]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TreeConfig:
    """How to grow a draft tree.

    ``chain``: top-1 drafts, ``depth`` of them. ``static``: the fixed shape ``static_paths`` (EAGLE-1/Medusa
    "choices": each path lists child ranks from the root, e.g. ``[[0], [1], [0, 0]]``). ``dynamic``: EAGLE-2,
    expand the ``top_k`` best nodes per depth, keep the ``total_tokens - 1`` best drafts overall (``"auto"``: the
    size that gives the most tokens/s on this device, measured by :mod:`eagle.autotune` before decoding; a tree
    is only ever built with a number).

    ``lookup_ngram`` > 0 adds a prompt-lookup branch to every tree (on top of the node budget): the tokens that
    followed the latest earlier occurrence of the context's last n-gram (n = lookup_ngram down to 1), up to the
    tree's depth (or ``lookup_tokens`` when set), merged into the drafted tree. It catches what the context
    repeats (code that restates the prompt, quoted names) and never changes the output: verification treats it
    as any other draft. ``lookup_alone`` > 0: a step whose lookup matched an n-gram at least that long verifies
    the lookup branch alone, without asking the drafter (on text that repeats itself the branch is what gets
    accepted, and a drafted tree beside it makes the step dearer than the tokens it adds).
    """

    policy: str = "dynamic"  # chain | static | dynamic (EAGLE-2)
    depth: int = 5  # draft steps (the deepest node)
    top_k: int = 4  # children tried per expanded node (dynamic)
    total_tokens: int | str = 16  # draft nodes verified per step, or auto (measured on this device)
    static_paths: list[list[int]] | None = None  # static: the tree as child-rank paths, e.g. [[0], [1], [0, 0]]
    lookup_ngram: int = 0  # graft a prompt-lookup branch matching the last N tokens (0 = off)
    lookup_tokens: int = 0  # length of the lookup branch; 0 = the tree's depth
    # when the lookup matched an n-gram at least this long, verify its branch alone: no draft that step (0 = never)
    lookup_alone: int = 0

    def validate(self) -> TreeConfig:
        """Raise EagleError on an inconsistent configuration; return self."""
        if not isinstance(self.lookup_ngram, int) or self.lookup_ngram < 0:
            raise EagleError(
                f"tree lookup_ngram must be an integer >= 0 (0 = no prompt-lookup branch), got {self.lookup_ngram!r}"
            )
        if not isinstance(self.lookup_tokens, int) or self.lookup_tokens < 0:
            raise EagleError(
                f"tree lookup_tokens must be an integer >= 0 (0 = as deep as the tree), got {self.lookup_tokens!r}"
            )
        if not isinstance(self.lookup_alone, int) or not 0 <= self.lookup_alone <= self.lookup_ngram:
            raise EagleError(
                f"tree lookup_alone must be an integer from 0 (never) to lookup_ngram ({self.lookup_ngram}): the "
                f"n-gram length from which a lookup match is verified without a draft; got {self.lookup_alone!r}"
            )
        if self.policy not in POLICIES:
            raise EagleError(f"tree policy {self.policy!r} is unknown; use one of {', '.join(POLICIES)}")
        if self.policy == "static":
            if not self.static_paths:
                raise EagleError("tree policy 'static' needs static_paths, e.g. [[0], [1], [0, 0]]")
            seen = {tuple(p) for p in self.static_paths}
            for path in self.static_paths:
                if not path or any((not isinstance(r, int)) or r < 0 for r in path):
                    raise EagleError(f"static path {path!r} must be a non-empty list of child ranks >= 0")
                if len(path) > 1 and tuple(path[:-1]) not in seen:
                    raise EagleError(
                        f"static path {path!r} has no parent path {path[:-1]!r}; add every prefix of each path"
                    )
            if len(seen) != len(self.static_paths):
                raise EagleError("static_paths contains a path twice; list each path once")
            return self
        if not isinstance(self.depth, int) or self.depth < 1:
            raise EagleError(f"tree depth must be an integer >= 1, got {self.depth!r}")
        if self.policy == "dynamic":
            if not isinstance(self.top_k, int) or self.top_k < 1:
                raise EagleError(f"tree top_k must be an integer >= 1, got {self.top_k!r}")
            total = self.total_tokens
            if total != "auto" and (not isinstance(total, int) or total < 2):
                raise EagleError(f"tree total_tokens must be 'auto' or an integer >= 2, got {total!r}")
        return self


def deepest_draft(cfg: TreeConfig) -> int:
    """The deepest draft a tree of this configuration can hold."""
    if cfg.policy == "static":
        return max(len(p) for p in cfg.static_paths or [[0]])
    return cfg.depth


def lookup_length(cfg: TreeConfig) -> int:
    """How many tokens the prompt-lookup branch may hold (0 without one)."""
    if not cfg.lookup_ngram:
        return 0
    return cfg.lookup_tokens or deepest_draft(cfg)


def deepest_node(cfg: TreeConfig) -> int:
    """The deepest node a verified tree of this configuration can hold, lookup branch included."""
    return max(deepest_draft(cfg), lookup_length(cfg))


def verify_tokens(cfg: TreeConfig) -> int:
    """Nodes (root included) a verification forward of this tree holds at most, with its lookup branch."""
    if cfg.policy == "chain":
        drafted = cfg.depth + 1
    elif cfg.policy == "static":
        drafted = len(cfg.static_paths or []) + 1
    else:
        drafted = int(cfg.total_tokens)
    return drafted + lookup_length(cfg)


def as_chain(cfg: TreeConfig) -> TreeConfig:
    """The chain a target that verifies one path gets in place of ``cfg``: as deep as the tree would go, with the
    same lookup branch (what :func:`eagle.speculate.speculative_generate` drafts under chain verification)."""
    if cfg.policy == "chain":
        return cfg
    chain = TreeConfig(policy="chain", depth=deepest_draft(cfg), lookup_ngram=cfg.lookup_ngram,
                       lookup_tokens=lookup_length(cfg))
    return chain.validate()


def lookup_continuation(history: Sequence[int], max_ngram: int, num_tokens: int) -> list[int]:
    """Prompt lookup: up to ``num_tokens`` tokens that followed the latest earlier occurrence of the last n-gram
    of ``history`` (trying n = max_ngram down to 1); [] when nothing matches."""
    return lookup_match(history, max_ngram, num_tokens)[0]


def lookup_match(history: Sequence[int], max_ngram: int, num_tokens: int) -> tuple[list[int], int]:
    """:func:`lookup_continuation` and the length of the n-gram it matched (0 when nothing matches)."""
    length = len(history)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = list(history[length - n :])
        for start in range(length - n - 1, -1, -1):
            if history[start] == tail[0] and list(history[start : start + n]) == tail:
                return list(history[start + n : start + n + num_tokens]), n
    return [], 0


def graft_chain(tree: DraftTree, chain: Sequence[int]) -> DraftTree:
    """``tree`` with the token path ``chain`` below its root: existing nodes are reused where the chain follows
    them, new nodes go after the old ones (so they are tried after the drafted siblings) with draft log-prob 0."""
    if not chain:
        return tree
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    logprobs = None if tree.draft_logprobs is None else tree.draft_logprobs.tolist()
    node, path = 0, []
    for tok in chain:
        child = next((c for c in tree.children(node) if tokens[c] == tok), None) if node < tree.size else None
        if child is None:
            tokens.append(int(tok))
            parents.append(node)
            if logprobs is not None:
                logprobs.append(0.0)
            child = len(tokens) - 1
        node = child
        path.append(node)
    grafted = replace(tree) if len(tokens) == tree.size else tree_from_parents(tokens, parents, logprobs)
    grafted.lookup_nodes = path
    return grafted


@dataclass
class DraftTree:
    """A draft tree in topological order (node 0 = root, the last sampled token).

    ``tokens`` [N] target ids; ``parents`` [N] (-1 for the root); ``depths`` [N] (root 0); ``attn_mask`` [N, N]
    bool, True where the column node is an ancestor of (or is) the row node; ``paths`` [P, max_depth + 1] node
    indices root-to-leaf padded with -1; ``draft_logprobs`` [N] optional draft log-prob of each node given its
    parent (0 for the root).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    attn_mask: torch.Tensor
    paths: torch.Tensor
    draft_logprobs: torch.Tensor | None = None
    _children: list[list[int]] | None = field(default=None, repr=False)
    lookup_nodes: list[int] = field(default_factory=list)  # the nodes the prompt-lookup branch runs through

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node."""
        return int(self.paths.shape[1]) - 1

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in node order (siblings come best-first from every builder)."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(self.size)]
            for i, p in enumerate(self.parents.tolist()):
                if p >= 0:
                    kids[p].append(i)
            self._children = kids
        return self._children[node]

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree with its tensors on ``device``."""
        lp = None if self.draft_logprobs is None else self.draft_logprobs.to(device)
        return DraftTree(
            self.tokens.to(device),
            self.parents.to(device),
            self.depths.to(device),
            self.attn_mask.to(device),
            self.paths.to(device),
            lp,
            self._children,
            self.lookup_nodes,
        )


def likely_path(tree: DraftTree) -> list[int]:
    """The root and its first child at every level: the draft's best guess of the path verification accepts
    (siblings come best-first from every builder; a grafted lookup branch comes after the drafted siblings)."""
    path = [0]
    while kids := tree.children(path[-1]):
        path.append(kids[0])
    return path


def path_tree(tree: DraftTree, path: Sequence[int]) -> DraftTree:
    """The chain of ``tree``'s nodes ``path`` (root first, each node a child of the one before) as a tree."""
    nodes = [int(v) for v in path]
    if not nodes or nodes[0] != 0 or any(int(tree.parents[b]) != a for a, b in zip(nodes, nodes[1:])):
        raise EagleError(f"nodes {nodes} are not a path from the root of the tree")
    logprobs = None if tree.draft_logprobs is None else tree.draft_logprobs[nodes]
    return tree_from_parents(tree.tokens[nodes], [-1] + list(range(len(nodes) - 1)), logprobs)


def tree_from_parents(
    tokens: list[int] | torch.Tensor,
    parents: list[int] | torch.Tensor,
    draft_logprobs: list[float] | torch.Tensor | None = None,
) -> DraftTree:
    """Build a :class:`DraftTree` (depths, ancestor mask, root-to-leaf paths) from tokens and parent indices.

    ``parents[0]`` must be -1 and every other parent must come before its child.
    """
    toks = torch.as_tensor(tokens, dtype=torch.long).flatten()
    par = [int(p) for p in torch.as_tensor(parents, dtype=torch.long).flatten().tolist()]
    n = len(par)
    if n == 0 or toks.numel() != n:
        raise EagleError(
            f"a draft tree needs as many tokens as parents (got {toks.numel()} and {n}), at least 1"
        )
    if par[0] != -1:
        raise EagleError("node 0 of a draft tree is the root: its parent must be -1")
    depths = [0] * n
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    has_child = [False] * n
    for i in range(1, n):
        p = par[i]
        if not 0 <= p < i:
            raise EagleError(
                f"node {i} has parent {p}: parents must precede their children (0 <= parent < node)"
            )
        depths[i] = depths[p] + 1
        mask[i] = mask[p]
        mask[i, i] = True
        has_child[p] = True
    max_depth = max(depths)
    leaves = [i for i in range(n) if not has_child[i]]
    paths = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            paths[row, depths[node]] = node
            node = par[node]
    lp = None if draft_logprobs is None else torch.as_tensor(draft_logprobs, dtype=torch.float32).flatten()
    return DraftTree(toks, torch.tensor(par, dtype=torch.long), torch.tensor(depths), mask, paths, lp)


def _finish(tokens: list[int], parents: list[int], logprobs: list[float], keys: list[tuple]) -> DraftTree:
    """Reorder kept nodes by ``keys`` (root first, parents always before children) and build the tree."""
    order = sorted(range(len(tokens)), key=lambda i: keys[i])
    new_index = {old: new for new, old in enumerate(order)}
    new_parents = [-1 if parents[old] < 0 else new_index[parents[old]] for old in order]
    return tree_from_parents([tokens[i] for i in order], new_parents, [logprobs[i] for i in order])


def build_chain(root_token: int, expand: ExpandFn, depth: int) -> DraftTree:
    """A chain of ``depth`` top-1 drafts."""
    tokens, parents, logprobs = [int(root_token)], [-1], [0.0]
    for _ in range(depth):
        child, lp = expand([len(tokens) - 1], 1, tokens, parents)
        parents.append(len(tokens) - 1)
        tokens.append(int(child[0, 0]))
        logprobs.append(float(lp[0, 0]))
    return tree_from_parents(tokens, parents, logprobs)


def build_static_tree(root_token: int, expand: ExpandFn, static_paths: list[list[int]]) -> DraftTree:
    """A fixed-shape tree: node ``path`` is the ``path[-1]``-th best child of node ``path[:-1]``."""
    TreeConfig(policy="static", static_paths=static_paths).validate()
    paths = sorted({tuple(p) for p in static_paths}, key=lambda p: (len(p), p))
    index = {(): 0}
    tokens, parents, logprobs = [int(root_token)], [-1], [0.0]
    for depth in range(1, len(paths[-1]) + 1):
        level = [p for p in paths if len(p) == depth]
        parent_paths = sorted({p[:-1] for p in level}, key=lambda p: index[p])
        k = max(p[-1] for p in level) + 1
        child, lp = expand([index[p] for p in parent_paths], k, tokens, parents)
        if child.shape[1] < k:
            raise EagleError(
                f"static path rank {k - 1} needs {k} candidates but the drafter offers only {child.shape[1]} "
                "(its vocabulary is smaller): use lower ranks in static_paths"
            )
        row = {pp: r for r, pp in enumerate(parent_paths)}
        for p in level:
            r = row[p[:-1]]
            index[p] = len(tokens)
            parents.append(index[p[:-1]])
            tokens.append(int(child[r, p[-1]]))
            logprobs.append(float(lp[r, p[-1]]))
    return tree_from_parents(tokens, parents, logprobs)


def build_dynamic_tree(
    root_token: int, expand: ExpandFn, depth: int, top_k: int, total_tokens: int
) -> DraftTree:
    """EAGLE-2 dynamic tree.

    Each expanded node proposes its ``top_k`` children; at every depth the ``top_k`` candidates with the highest
    cumulative log-probability are expanded next. At the end ALL candidates are reranked by cumulative
    log-probability and the best ``total_tokens - 1`` are kept. A child's cumulative log-prob never exceeds its
    parent's and ties are broken by depth, so a kept node's parent is always kept.
    """
    tokens, parents, logprobs, scores, depths = [int(root_token)], [-1], [0.0], [0.0], [0]
    frontier = [0]
    for d in range(1, depth + 1):
        child, lp = expand(frontier, top_k, tokens, parents)
        child_list, lp_list = child.tolist(), lp.float().tolist()
        level = []
        for r, node in enumerate(frontier):
            for c in range(child.shape[1]):
                level.append(len(tokens))
                tokens.append(int(child_list[r][c]))
                parents.append(node)
                logprobs.append(lp_list[r][c])
                scores.append(scores[node] + lp_list[r][c])
                depths.append(d)
        if d < depth:
            frontier = sorted(level, key=lambda i: (-scores[i], i))[:top_k]
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i))
    kept = [0] + sorted(ranked[: max(total_tokens - 1, 0)])
    keep_set = set(kept)
    for i in kept[1:]:
        # cannot happen (see the docstring); fail loudly rather than build a broken tree
        if parents[i] not in keep_set:
            raise RuntimeError("dynamic tree selection dropped a parent of a kept node")
    remap = {old: new for new, old in enumerate(kept)}
    return _finish(
        [tokens[i] for i in kept],
        [-1 if parents[i] < 0 else remap[parents[i]] for i in kept],
        [logprobs[i] for i in kept],
        [(depths[i], -scores[i], i) for i in kept],
    )


def build_tree(root_token: int, expand: ExpandFn, cfg: TreeConfig) -> DraftTree:
    """Grow the tree ``cfg`` asks for from ``root_token`` using ``expand``."""
    cfg.validate()
    if cfg.policy == "chain":
        return build_chain(root_token, expand, cfg.depth)
    if cfg.policy == "static":
        return build_static_tree(root_token, expand, cfg.static_paths or [])
    if cfg.total_tokens == "auto":
        raise EagleError(
            "tree total_tokens is 'auto': the size is measured on this device before decoding (eagle eval does it "
            "with eagle.autotune.autotune_total_tokens); give a number of tree tokens when drafting directly"
        )
    return build_dynamic_tree(root_token, expand, cfg.depth, cfg.top_k, int(cfg.total_tokens))
