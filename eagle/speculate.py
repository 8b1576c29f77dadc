"""The speculative generation loop (batch size 1) and the plain one-token-per-forward baseline.

One step: the drafter proposes a tree rooted at the last sampled token; ONE target forward scores every tree node
(the committed prefix comes from the KV cache, the tree nodes see their ancestors through a 4D mask, positions are
prefix length + depth); verification picks the accepted path and the next token; the target cache keeps the
prefix plus the accepted path; the drafter is told what was accepted.

Lazy logits: the target's lm_head over a large vocabulary is a big part of a small model's forward, and
verification reads the logits of only the nodes it visits (the accepted path). So the verification forward asks
(``logits_to_keep``) for the logits of the tree's most likely path only -- the first child at every level, since
siblings come best-first -- computed there in one matrix product, and verification runs the lm_head on
``hidden_states[-1]`` for any other node it visits, one row at a time. (Not one row per visited node throughout:
reading the weights dominates the cost of a few rows; on a 2-core CPU one row of SmolLM2's 49k x 576 lm_head costs
a third to a half of 16 rows.) This is used only where it reproduces the model's own logits, checked once per
model on a prefill (see :func:`_logit_map`); other models get every node's logits from the forward, as before.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from eagle.cache import gather_cache
from eagle.drafter import Drafter
from eagle.errors import EagleError
from eagle.tree import DraftTree, TreeConfig, deepest_node, graft_chain, lookup_continuation, lookup_length
from eagle.verify import Decisions, LazyRows, as_decisions, logits_to_probs, verify_greedy, verify_sampling

_MASKABLE_ATTENTION = ("eager", "sdpa")


@dataclass
class GenerationResult:
    """What a generate call produced and what it cost.

    ``tokens``: the new tokens (the first comes from the prefill). ``accept_lengths``: per verification forward,
    accepted drafts + 1. ``target_forwards``: verification (or decode) forwards, the prefill excluded.
    ``accepted_per_depth[d - 1]``: how many accepted drafts sat at depth d. Times in seconds.
    """

    tokens: list[int]
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


# --------------------------------------------------------------------------------------------- helpers


def _cache_kwarg(model: torch.nn.Module) -> str:
    from eagle.targets import cache_kwarg

    return cache_kwarg(model)


def _device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _layer_windows(model: torch.nn.Module) -> dict[str, int | None]:
    """Attention window per layer type of the target (None = full attention)."""
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # e.g. Mistral: every layer uses config.sliding_window (None = full attention)
        return {"all": window}
    windows: dict[str, int | None] = {}
    for kind in set(types):
        if kind == "full_attention":
            windows[kind] = None
        elif kind == "sliding_attention":
            windows[kind] = window
        else:
            raise EagleError(
                f"target layer type {kind!r} is not supported by tree verification (only full and sliding-window "
                "attention layers are); use plain decoding for this model"
            )
    return windows


def _check_target(model: torch.nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in _MASKABLE_ATTENTION:
        raise EagleError(
            f"the target uses attn_implementation={impl!r}, which cannot take a tree attention mask; load it "
            "with attn_implementation='sdpa' (or 'eager')"
        )
    _layer_windows(model)


def tree_attention_mask(
    tree: DraftTree, prefix_len: int, window: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4D mask [1, 1, N, prefix_len + N] (0 = attend, dtype min = blocked) for verifying ``tree``.

    Every node sees the whole prefix and its own ancestors. With a sliding ``window``, a query at position q
    sees only keys at positions > q - window, as in transformers' sliding-window masks (node positions are
    prefix_len + depth, the positions they would have after acceptance). Additive rather than bool because
    eager attention adds the mask to the scores.
    """
    n = tree.size
    device = tree.tokens.device
    allowed = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device)
    allowed[:, prefix_len:] = tree.attn_mask
    if window is not None:
        q_pos = prefix_len + tree.depths
        k_pos = torch.cat([torch.arange(prefix_len, device=device), q_pos])
        allowed &= k_pos[None, :] > (q_pos[:, None] - window)
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _verify_mask(model: torch.nn.Module, tree: DraftTree, prefix_len: int, dtype: torch.dtype) -> Any:
    windows = _layer_windows(model)
    masks = {kind: tree_attention_mask(tree, prefix_len, w, dtype) for kind, w in windows.items()}
    # one tensor when all layers agree; models with mixed layer types take a dict keyed by layer type
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _first_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | Decisions | None,
) -> int:
    if temperature <= 0:
        return int(logits.argmax(-1))
    probs = logits_to_probs(logits, temperature, top_p, top_k)
    decide = as_decisions(generator)
    return decide.categorical(probs.to(decide.device, torch.float64))


class _Stopper:
    """Applies the stopping rules to the growing token list: EOS (kept, then stop), stop strings, length."""

    def __init__(
        self, max_new_tokens: int, eos_token_ids: Iterable[int], stop_strings: Sequence[str], tokenizer
    ):
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in eos_token_ids}
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise EagleError("stop_strings need a tokenizer to decode the output: pass tokenizer=...")
        self.tokenizer = tokenizer

    def cut(self, tokens: list[int], n_new: int) -> tuple[list[int], bool]:
        """(tokens cut after the first stop among the last n_new, whether generation is over)."""
        start = len(tokens) - n_new
        for i in range(start, len(tokens)):
            if (
                i + 1 >= self.max_new_tokens
                or tokens[i] in self.eos
                or self._hit_stop_string(tokens[: i + 1])
            ):
                return tokens[: i + 1], True
        return tokens, False

    def _hit_stop_string(self, tokens: list[int]) -> bool:
        if not self.stop_strings:
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)


def _logits_of(out: Any) -> torch.Tensor:
    return out.logits[0]


def _last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    from eagle.targets import last_logits_only

    return last_logits_only(model)


# ---------------------------------------------------------------------------------------- lazy logits

# model -> its hidden-to-logits map, or None where lazy logits do not reproduce its logits (checked once)
_LOGIT_MAPS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor] | None] = (
    weakref.WeakKeyDictionary()
)


def _postprocessing_candidates(model: torch.nn.Module) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Candidate maps from ``lm_head(h)`` to the model's logits, from the post-processing some families apply:
    Cohere multiplies by ``logit_scale``; Granite divides by ``logits_scaling`` (HyperCLOVAX multiplies by a
    field of the same name, so both are candidates); Gemma caps with ``final_logit_softcapping``."""
    cfg = model.config.get_text_config(decoder=True)
    scales = [1.0]
    if getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        scales = [float(cfg.logit_scale)]
    elif getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0):
        scales = [1.0 / float(cfg.logits_scaling), float(cfg.logits_scaling)]
    cap = getattr(cfg, "final_logit_softcapping", None)

    def make(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def post(logits: torch.Tensor) -> torch.Tensor:
            if scale != 1.0:
                logits = logits * scale
            if cap:
                logits = torch.tanh(logits / cap) * cap
            return logits

        return post

    return [make(s) for s in scales]


def _logit_map(model: torch.nn.Module, prefill_out: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A map from rows of ``hidden_states[-1]`` [n, h] to the target's logits [n, V] (its output embeddings plus
    the known post-processing), or None when lazy logits cannot be used for this model.

    Decided once per model: the map must reproduce the prefill's last-position logits (to a few units in the
    last place), which rules out models whose last hidden state is not what their lm_head reads, or whose
    logits are post-processed in a way we do not know. The forward must also take ``logits_to_keep``.
    """
    if model in _LOGIT_MAPS:
        return _LOGIT_MAPS[model]
    found = None
    lm_head = model.get_output_embeddings()
    hidden_states = getattr(prefill_out, "hidden_states", None)
    if _last_logits_only(model) and isinstance(lm_head, torch.nn.Module) and hidden_states:
        want = prefill_out.logits[0, -1].float()
        raw = lm_head(hidden_states[-1][0, -1:])[0]
        tol = 4 * torch.finfo(raw.dtype).eps * max(1.0, float(want.abs().max()))
        for post in _postprocessing_candidates(model):
            got = post(raw).float()
            if got.shape == want.shape and math.isfinite(tol) and float((got - want).abs().max()) <= tol:
                found = post
                break
    _LOGIT_MAPS[model] = None if found is None else _compose(lm_head, found)
    return _LOGIT_MAPS[model]


def _compose(
    lm_head: torch.nn.Module, post: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return post(lm_head(hidden))

    return logits


def _likely_path(tree: DraftTree) -> list[int]:
    """The root and its first child at every level: the draft's best guess of the path verification accepts."""
    path = [0]
    while kids := tree.children(path[-1]):
        path.append(kids[0])
    return path


def _node_logits(
    out: Any, logit_map: Callable[[torch.Tensor], torch.Tensor] | None, n: int, kept: list[int]
) -> torch.Tensor | LazyRows:
    """Every node's logits: the forward's [n, V] when it made them all, else rows made on first access, those of
    the ``kept`` nodes taken from the forward's output (``logits_to_keep=kept``)."""
    logits = out.logits[0]
    if logit_map is None or logits.shape[0] == n:
        return logits
    given = dict(zip(kept, logits)) if logits.shape[0] == len(kept) else {}
    hidden = out.hidden_states[-1][0]

    def row(node: int) -> torch.Tensor:
        if node in given:
            return given[node]
        return logit_map(hidden[node : node + 1])[0]

    return LazyRows(row)


def _warped(logits: torch.Tensor | LazyRows, temperature: float, top_p: float, top_k: int) -> LazyRows:
    """The sampling distributions of the nodes, warped one visited row at a time."""
    return LazyRows(lambda node: logits_to_probs(logits[node], temperature, top_p, top_k))


# ------------------------------------------------------------------------------------------ generation


@torch.no_grad()
def speculative_generate(
    model: torch.nn.Module,
    drafter: Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    tree_cfg: TreeConfig | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: Iterable[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Any = None,
    generator: torch.Generator | Decisions | None = None,
    lazy_logits: bool = True,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` [1, T] with tree speculative decoding.

    At temperature 0 the output equals the target's own greedy decoding; above it, it is distributed exactly as
    sampling from the target with the same temperature / top-p / top-k warping (see eagle.verify).
    Every random choice (the first token, each accept / reject, each residual sample) goes through
    ``generator``: a torch.Generator, or any :class:`eagle.verify.Decisions` (tests script the choices).
    ``lazy_logits``: run the target's lm_head only for the tree nodes verification visits, where the target
    allows it (module docstring); False computes every node's logits in the verification forward.
    """
    tree_cfg = (tree_cfg or TreeConfig()).validate()
    _check_inputs(model, input_ids, max_new_tokens)
    _check_target(model)
    stopper = _Stopper(max_new_tokens, eos_token_ids, stop_strings, tokenizer)
    device = _device(model)
    dtype = model.get_input_embeddings().weight.dtype
    kw = _cache_kwarg(model)
    input_ids = input_ids.to(device)
    result = GenerationResult(tokens=[], accepted_per_depth=[0] * deepest_node(tree_cfg))

    t_start = time.perf_counter()
    # A full-size cache even for sliding-window layers: rejected drafts must be removable, and our masks apply
    # the windows.
    cache = DynamicCache()
    out = model(
        input_ids, use_cache=True, output_hidden_states=True, **{kw: cache}, **_last_logits_only(model)
    )
    first = _first_token(_logits_of(out)[-1], temperature, top_p, top_k, generator)
    tokens, done = stopper.cut([first], 1)
    logit_map = _logit_map(model, out) if lazy_logits and not done else None
    _sync(device)
    result.prefill_time = time.perf_counter() - t_start
    if not done:
        t0 = time.perf_counter()
        drafter.prefill(input_ids, out.hidden_states, first)
        result.draft_time += time.perf_counter() - t0
    del out
    prefix_len = input_ids.shape[1]
    prompt_ids = input_ids[0].tolist() if tree_cfg.lookup_ngram else []

    while not done:
        t0 = time.perf_counter()
        tree = drafter.draft(tokens[-1], tree_cfg).to("cpu")  # verification walks it on the CPU
        if tree_cfg.lookup_ngram:
            history = prompt_ids + tokens
            tree = graft_chain(
                tree, lookup_continuation(history, tree_cfg.lookup_ngram, lookup_length(tree_cfg))
            )
        _sync(device)
        t1 = time.perf_counter()
        result.draft_time += t1 - t0

        tree_dev = tree.to(device)
        mask = _verify_mask(model, tree_dev, prefix_len, dtype)
        positions = (prefix_len + tree_dev.depths)[None]
        likely = _likely_path(tree) if logit_map is not None else []
        keep_rows = {"logits_to_keep": torch.tensor(likely, device=device)} if likely else {}
        out = model(
            tree_dev.tokens[None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{kw: cache},
            **keep_rows,
        )
        logits = _node_logits(out, logit_map, tree.size, likely)
        if temperature <= 0:
            accepted, next_token = verify_greedy(tree, logits)
        else:
            probs = _warped(logits, temperature, top_p, top_k)
            accepted, next_token = verify_sampling(tree, probs, generator)
        keep = torch.cat([torch.arange(prefix_len), prefix_len + accepted])
        gather_cache(cache, keep)
        _sync(device)
        result.verify_time += time.perf_counter() - t1
        result.target_forwards += 1
        result.accept_lengths.append(accepted.numel())
        for d in tree.depths[accepted[1:]].tolist():
            result.accepted_per_depth[d - 1] += 1

        new = tree.tokens[accepted[1:]].tolist() + [next_token]
        tokens, done = stopper.cut(tokens + new, len(new))
        prefix_len += accepted.numel()
        if not done:
            t0 = time.perf_counter()
            drafter.accept(accepted, out.hidden_states, torch.tensor(new, device=device))
            result.draft_time += time.perf_counter() - t0
        del out

    _sync(device)
    result.tokens = tokens
    result.total_time = time.perf_counter() - t_start
    return result


@torch.no_grad()
def plain_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: Iterable[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Any = None,
    generator: torch.Generator | Decisions | None = None,
) -> GenerationResult:
    """The baseline: one target forward per new token with a KV cache (same stopping rules and result type).

    At temperature 0 this equals ``model.generate(do_sample=False)``. ``generator``: as in
    :func:`speculative_generate`.
    """
    _check_inputs(model, input_ids, max_new_tokens)
    stopper = _Stopper(max_new_tokens, eos_token_ids, stop_strings, tokenizer)
    device = _device(model)
    kw = _cache_kwarg(model)
    result = GenerationResult(tokens=[])
    t_start = time.perf_counter()
    cache = DynamicCache(config=model.config)
    out = model(input_ids.to(device), use_cache=True, **{kw: cache}, **_last_logits_only(model))
    tokens, done = stopper.cut([_first_token(_logits_of(out)[-1], temperature, top_p, top_k, generator)], 1)
    _sync(device)
    result.prefill_time = time.perf_counter() - t_start
    while not done:
        t0 = time.perf_counter()
        out = model(torch.tensor([[tokens[-1]]], device=device), use_cache=True, **{kw: cache})
        nxt = _first_token(_logits_of(out)[-1], temperature, top_p, top_k, generator)
        tokens, done = stopper.cut(tokens + [nxt], 1)
        _sync(device)
        result.verify_time += time.perf_counter() - t0
        result.target_forwards += 1
        result.accept_lengths.append(1)
    result.tokens = tokens
    result.total_time = time.perf_counter() - t_start
    return result
