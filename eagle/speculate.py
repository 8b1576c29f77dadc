"""The speculative decoding loop (batch size 1) and the plain one-token-per-forward baseline.

The loop, as named steps (:func:`speculative_generate`):

1. :func:`prefill` -- one target forward over the prompt: the first token, the KV cache, the hidden states the
   drafter starts from;
2. :func:`draft` -- the drafter proposes a tree rooted at the last token (plus the prompt-lookup branch);
3. :func:`verify` -- ONE target forward scores every tree node (the committed prefix comes from the KV cache, the
   nodes see their ancestors through a 4D mask, positions are prefix length + depth); verification picks the
   accepted path and the next token; the cache keeps the prefix plus the accepted path;
4. the drafter is told what was accepted (``drafter.accept``), and the loop goes back to 2.

Verification reads the logits of the nodes it visits only (:mod:`eagle.lazy_logits`). Timing is kept by one
:class:`StepTimer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from eagle.attention import SDPA_GQA
from eagle.cache import (
    check_continuation,
    crop_cache,
    gather_cache,
    has_recurrent_state,
    new_cache,
    restore_states,
    snapshot_states,
)
from eagle.devices import model_device, model_dtype, sync
from eagle.drafter import Drafter
from eagle.errors import EagleError
from eagle.lazy_logits import logit_map, node_logits
from eagle.sampling import Sampling
from eagle.targets import cache_kwarg, last_logits_only
from eagle.tree import (
    DraftTree,
    TreeConfig,
    as_chain,
    deepest_node,
    graft_chain,
    likely_path,
    lookup_length,
    lookup_match,
    path_tree,
    tree_from_parents,
)
from eagle.verify import Decisions, LazyRows, as_decisions, verify_greedy, verify_sampling

_MASKABLE_ATTENTION = ("eager", "sdpa", SDPA_GQA)


@dataclass
class GenerationResult:
    """What a generate call produced and what it cost.

    ``tokens``: the new tokens (the first comes from the prefill). ``accept_lengths``: per verification forward,
    accepted drafts + 1. ``target_forwards``: verification (or decode) forwards, the prefill excluded.
    ``accepted_per_depth[d - 1]``: how many accepted drafts sat at depth d. ``verification``: tree or chain
    (:func:`verification_mode`); ``replay_forwards``: the extra target forwards of chain verification (a replay of
    the accepted tokens after a rejection, counted apart from ``target_forwards``). Times in seconds.
    """

    tokens: list[int]
    verification: str = "tree"
    replay_forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    target_forwards: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    prefill_time: float = 0.0

    @property
    def mean_accept_length(self) -> float:
        """tau: tokens per verification forward (0 when no verification ran)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


class StepTimer:
    """Wall-clock time per step kind, the device synchronised at each boundary (GPU kernels run asynchronously)."""

    def __init__(self, device: torch.device, result: GenerationResult):
        self.device = device
        self.result = result
        self.start = time.perf_counter()

    def add(self, what: str, since: float) -> float:
        """Add the time since ``since`` to ``result.<what>_time``; returns now (the next step's start)."""
        sync(self.device)
        now = time.perf_counter()
        setattr(self.result, f"{what}_time", getattr(self.result, f"{what}_time") + now - since)
        return now

    def finish(self) -> None:
        sync(self.device)
        self.result.total_time = time.perf_counter() - self.start


# ----------------------------------------------------------------------------------------------- checks


def _check_inputs(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise EagleError(
            f"speculative decoding runs one sequence at a time: input_ids must be [1, T], got "
            f"{tuple(input_ids.shape)}; loop over the prompts"
        )
    if input_ids.shape[1] == 0:
        raise EagleError("input_ids is empty: give at least one prompt token")
    if max_new_tokens < 1:
        raise EagleError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


# layer types that hold a recurrent state instead of keys and values (no attention mask reaches them here)
_RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "moe", "mlp")


def _layer_windows(model: torch.nn.Module) -> dict[str, tuple[str, int] | None]:
    """The attention pattern per layer type of the target: None = full attention, ("window", w) = a sliding
    window of w positions, ("chunk", c) = attention within chunks of c positions."""
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # e.g. Mistral: every layer uses config.sliding_window (None = full attention)
        return {"all": None if window is None else ("window", window)}
    windows: dict[str, tuple[str, int] | None] = {}
    for kind in set(types):
        if kind == "full_attention":
            windows[kind] = None
        elif kind == "sliding_attention":
            windows[kind] = ("window", window)
        elif kind == "chunked_attention":
            windows[kind] = ("chunk", int(cfg.attention_chunk_size))
        elif kind not in _RECURRENT_LAYER_TYPES:
            raise EagleError(
                f"target layer type {kind!r} is not supported by speculative verification (full, sliding-window, "
                "chunked attention and recurrent layers are); use plain decoding for this model"
            )
    return windows


def verification_mode(model: torch.nn.Module) -> str:
    """How drafts are verified on this target: ``tree`` (one forward over the whole tree through a tree attention
    mask, the key/value cache cut back to the accepted path) or ``chain`` (targets with a recurrent state, which
    a tree cannot pass through in one forward: the drafter's first-choice path is verified, and the state is
    snapshotted before and replayed over the accepted tokens when part of the path is rejected)."""
    return "chain" if has_recurrent_state(model) else "tree"


def _check_target(model: torch.nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in _MASKABLE_ATTENTION:
        raise EagleError(
            f"the target uses attn_implementation={impl!r}, which cannot take a tree attention mask; load it "
            "with attn_implementation='sdpa' (or 'eager')"
        )
    _layer_windows(model)


def tree_attention_mask(
    tree: DraftTree, prefix_len: int, window: int | None = None, dtype: torch.dtype = torch.float32,
    chunk: int | None = None,
) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, prefix_len + N] (0 = attend, dtype min = blocked) for verifying ``tree``.

    Every node sees the whole prefix and its own ancestors. With a sliding ``window``, a query at position q
    sees only keys at positions > q - window, as in transformers' sliding-window masks; with a ``chunk``, only
    keys in its own chunk of positions (q // chunk), as in chunked attention (node positions are prefix_len +
    depth, the positions they would have after acceptance). Additive rather than bool because eager attention
    adds the mask to the scores.
    """
    n = tree.size
    device = tree.tokens.device
    allowed = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device)
    allowed[:, prefix_len:] = tree.attn_mask
    if window is not None or chunk is not None:
        q_pos = prefix_len + tree.depths
        k_pos = torch.cat([torch.arange(prefix_len, device=device), q_pos])
        if window is not None:
            allowed &= k_pos[None, :] > (q_pos[:, None] - window)
        if chunk is not None:
            allowed &= (k_pos[None, :] // chunk) == (q_pos[:, None] // chunk)
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _verify_mask(model: torch.nn.Module, tree: DraftTree, prefix_len: int, dtype: torch.dtype) -> Any:
    masks = {}
    for kind, pattern in _layer_windows(model).items():
        shape, size = pattern or ("full", None)
        masks[kind] = tree_attention_mask(tree, prefix_len, size if shape == "window" else None, dtype,
                                          size if shape == "chunk" else None)
    # one tensor when all layers agree; models with mixed layer types take a dict keyed by layer type
    return next(iter(masks.values())) if len(masks) == 1 else masks


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | Decisions | None) -> int:
    """The next token from one row of logits: the argmax, or a draw from the warped distribution."""
    if sampling.greedy:
        return int(logits.argmax(-1))
    decide = as_decisions(generator)
    return decide.categorical(sampling.probs(logits).to(decide.device, torch.float64))


class Stopper:
    """Applies the stopping rules to the growing token list: EOS (kept, then stop), stop strings, length."""

    def __init__(self, max_new_tokens: int, sampling: Sampling):
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in sampling.eos_token_ids}
        self.stop_strings = [s for s in sampling.stop_strings if s]
        self.tokenizer = sampling.tokenizer

    def cut(self, tokens: list[int], n_new: int) -> tuple[list[int], bool]:
        """(tokens cut after the first stop among the last n_new, whether generation is over)."""
        for i in range(len(tokens) - n_new, len(tokens)):
            if i + 1 >= self.max_new_tokens or tokens[i] in self.eos or self._hit_stop_string(tokens[: i + 1]):
                return tokens[: i + 1], True
        return tokens, False

    def _hit_stop_string(self, tokens: list[int]) -> bool:
        if not self.stop_strings:
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)


# ------------------------------------------------------------------------------------------------- steps


def prefill(model: torch.nn.Module, input_ids: torch.Tensor, sampling: Sampling,
            generator: torch.Generator | Decisions | None) -> tuple[int, Any, DynamicCache]:
    """One forward over the prompt: (the first new token, the model output with hidden states, the cache).

    A full-size cache even for sliding-window layers: rejected drafts must be removable, and our masks apply the
    windows (:func:`eagle.cache.new_cache`)."""
    cache = new_cache(model)
    out = model(input_ids, use_cache=True, output_hidden_states=True, **{cache_kwarg(model): cache},
                **last_logits_only(model))
    return choose(out.logits[0, -1], sampling, generator), out, cache


def draft(drafter: Drafter, tokens: list[int], tree_cfg: TreeConfig, prompt_ids: list[int],
          chain: bool = False) -> DraftTree:
    """The drafter's tree rooted at the last token, with the prompt-lookup branch grafted in (on the CPU:
    verification walks it there). ``chain``: only its first-choice path (see :func:`verification_mode`). A
    lookup match of at least ``lookup_alone`` tokens is the whole draft: the drafter is not asked."""
    lookup, matched = [], 0
    if tree_cfg.lookup_ngram:
        lookup, matched = lookup_match(prompt_ids + tokens, tree_cfg.lookup_ngram, lookup_length(tree_cfg))
    if lookup and tree_cfg.lookup_alone and matched >= tree_cfg.lookup_alone:
        return graft_chain(tree_from_parents([tokens[-1]], [-1]), lookup)
    tree = graft_chain(drafter.draft(tokens[-1], tree_cfg).to("cpu"), lookup)
    return path_tree(tree, likely_path(tree)) if chain else tree


def verify(model: torch.nn.Module, tree: DraftTree, cache: DynamicCache, prefix_len: int, sampling: Sampling,
           generator: torch.Generator | Decisions | None, lazy: Any) -> tuple[torch.Tensor, int, Any]:
    """One target forward over the tree, then verification: (accepted node indices, the next token, the output).

    The cache keeps the prefix plus the accepted path. ``lazy``: the model's logit map (:mod:`eagle.lazy_logits`)
    or None for full logits."""
    device = model_device(model)
    nodes = tree.to(device)
    # the rows verification most likely reads: the drafter's first choices, and the lookup branch (which
    # verification walks on most steps where the text repeats itself)
    kept = sorted(set(likely_path(tree)) | set(tree.lookup_nodes)) if lazy is not None else []
    out = model(
        nodes.tokens[None],
        attention_mask=_verify_mask(model, nodes, prefix_len, model_dtype(model)),
        position_ids=(prefix_len + nodes.depths)[None],
        use_cache=True,
        output_hidden_states=True,
        **{cache_kwarg(model): cache},
        **({"logits_to_keep": torch.tensor(kept, device=device)} if kept else {}),
    )
    accepted, next_token = _decide(tree, node_logits(out, lazy, tree, kept), sampling, generator)
    gather_cache(cache, torch.cat([torch.arange(prefix_len), prefix_len + accepted]))
    return accepted, next_token, out


def _decide(tree: DraftTree, logits: Any, sampling: Sampling, generator: torch.Generator | Decisions | None
            ) -> tuple[torch.Tensor, int]:
    if sampling.greedy:
        return verify_greedy(tree, logits)
    probs = LazyRows(lambda node: sampling.probs(logits[node]))  # warped one visited row at a time
    return verify_sampling(tree, probs, generator)


def verify_chain(model: torch.nn.Module, chain: DraftTree, cache: DynamicCache, prefix_len: int, unread: list[int],
                 sampling: Sampling, generator: torch.Generator | Decisions | None
                 ) -> tuple[torch.Tensor, int, tuple[torch.Tensor, ...], list[int]]:
    """Chain verification for a target with a recurrent state (:func:`verification_mode`): one forward over the
    committed tokens its cache has not read yet (``unread``, the last ``len(unread)`` of the ``prefix_len``) and
    then the chain; returns (accepted node indices, the next token, the hidden states of the chain's nodes, the
    committed tokens still unread).

    A recurrent state cannot be cut back to the accepted prefix, so it is copied before the forward. When the
    chain is accepted whole the cache has read everything. Otherwise the states go back to the copy, the
    key/value layers are cut to match, and the accepted tokens join ``unread``: the next verification reads them
    in front of its own chain, in the same forward. More unread tokens than a chain holds are read at once by
    :func:`replay`. Exact: the cache only ever holds states reached by reading the committed tokens."""
    device = model_device(model)
    nodes = chain.to(device)
    start = prefix_len - len(unread)  # the positions the cache has read
    ids = torch.cat([torch.tensor(unread, dtype=torch.long, device=device), nodes.tokens])
    saved = snapshot_states(cache)
    out = model(
        ids[None],
        position_ids=(start + torch.arange(ids.numel(), device=device))[None],
        use_cache=True,
        output_hidden_states=True,
        **{cache_kwarg(model): cache},
        **({"logits_to_keep": chain.size} if last_logits_only(model) else {}),
    )
    accepted, next_token = _decide(chain, out.logits[0, -chain.size:], sampling, generator)
    hidden = tuple(h[:, len(unread):] for h in out.hidden_states)
    if accepted.numel() == chain.size:
        return accepted, next_token, hidden, []
    restore_states(cache, saved)
    crop_cache(cache, start)
    unread = unread + chain.tokens[accepted].tolist()
    if len(unread) > chain.size:
        replay(model, cache, unread, start)
        unread = []
    return accepted, next_token, hidden, unread


def replay(model: torch.nn.Module, cache: DynamicCache, tokens: list[int], start: int) -> None:
    """Read committed ``tokens`` (positions ``start``...) into a cache that holds the ``start`` before them."""
    device = model_device(model)
    positions = start + torch.arange(len(tokens), device=device)
    model(torch.tensor([tokens], device=device), position_ids=positions[None], use_cache=True,
          **{cache_kwarg(model): cache}, **last_logits_only(model))


# ------------------------------------------------------------------------------------------------ loops


@torch.no_grad()
def speculative_generate(
    model: torch.nn.Module,
    drafter: Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    tree_cfg: TreeConfig | None = None,
    sampling: Sampling | None = None,
    generator: torch.Generator | Decisions | None = None,
    lazy_logits: bool = True,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` [1, T] with tree speculative decoding.

    At temperature 0 the output equals the target's own greedy decoding; above it, it is distributed exactly as
    sampling from the target with the same warping (see eagle.verify). Every random choice goes through
    ``generator``: a torch.Generator, or any :class:`eagle.verify.Decisions` (tests script the choices).
    ``lazy_logits``: run the target's lm_head only for the tree nodes verification visits, where the target
    allows it (:mod:`eagle.lazy_logits`); False computes every node's logits in the verification forward.
    """
    tree_cfg = (tree_cfg or TreeConfig()).validate()
    sampling = sampling or Sampling()
    _check_inputs(model, input_ids, max_new_tokens)
    _check_target(model)
    chain = verification_mode(model) == "chain"
    if chain:  # only one path is verified: draft just that one, as deep as the tree would go
        check_continuation(model)
        tree_cfg = as_chain(tree_cfg)
    stopper = Stopper(max_new_tokens, sampling)
    device = model_device(model)
    input_ids = input_ids.to(device)
    result = GenerationResult(tokens=[], accepted_per_depth=[0] * deepest_node(tree_cfg),
                              verification="chain" if chain else "tree")
    timer = StepTimer(device, result)

    first, out, cache = prefill(model, input_ids, sampling, generator)
    tokens, done = stopper.cut([first], 1)
    lazy = logit_map(model, out) if lazy_logits and not done else None
    t = timer.add("prefill", timer.start)
    if not done:
        drafter.prefill(input_ids, out.hidden_states, first)
        t = timer.add("draft", t)
    del out
    prefix_len = input_ids.shape[1]
    prompt_ids = input_ids[0].tolist() if tree_cfg.lookup_ngram else []
    unread: list[int] = []  # chain verification: committed tokens the cache has not read yet
    while not done:
        tree = draft(drafter, tokens, tree_cfg, prompt_ids, chain)
        t = timer.add("draft", t)
        if chain:
            accepted, next_token, hidden, unread = verify_chain(model, tree, cache, prefix_len, unread, sampling,
                                                                generator)
            result.replay_forwards += int(accepted.numel() < tree.size and not unread)
        else:
            accepted, next_token, out = verify(model, tree, cache, prefix_len, sampling, generator, lazy)
            hidden = out.hidden_states
            del out
        t = timer.add("verify", t)
        result.target_forwards += 1
        result.accept_lengths.append(accepted.numel())
        for d in tree.depths[accepted[1:]].tolist():
            result.accepted_per_depth[d - 1] += 1
        new = tree.tokens[accepted[1:]].tolist() + [next_token]
        tokens, done = stopper.cut(tokens + new, len(new))
        prefix_len += accepted.numel()
        if not done:
            drafter.accept(accepted, hidden, torch.tensor(new, device=device))
            t = timer.add("draft", t)
        del hidden
    result.tokens = tokens
    timer.finish()
    return result


@torch.no_grad()
def plain_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | Decisions | None = None,
) -> GenerationResult:
    """The baseline: one target forward per new token with a KV cache (same stopping rules and result type).

    At temperature 0 this equals ``model.generate(do_sample=False)``. ``generator``: as in
    :func:`speculative_generate`.
    """
    sampling = sampling or Sampling()
    _check_inputs(model, input_ids, max_new_tokens)
    stopper = Stopper(max_new_tokens, sampling)
    device = model_device(model)
    kw = cache_kwarg(model)
    result = GenerationResult(tokens=[])
    timer = StepTimer(device, result)
    cache = DynamicCache(config=model.config)
    out = model(input_ids.to(device), use_cache=True, **{kw: cache}, **last_logits_only(model))
    tokens, done = stopper.cut([choose(out.logits[0, -1], sampling, generator)], 1)
    t = timer.add("prefill", timer.start)
    while not done:
        # explicit positions: some families (Bamba) count a cached prefix wrong without them
        position = torch.tensor([[input_ids.shape[1] + len(tokens) - 1]], device=device)
        out = model(torch.tensor([[tokens[-1]]], device=device), position_ids=position, use_cache=True, **{kw: cache})
        tokens, done = stopper.cut(tokens + [choose(out.logits[0, -1], sampling, generator)], 1)
        t = timer.add("verify", t)
        result.target_forwards += 1
        result.accept_lengths.append(1)
    result.tokens = tokens
    timer.finish()
    return result
