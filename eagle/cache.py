"""The target's cache during speculative decoding: keep or drop sequence positions of its key/value layers, and
snapshot / restore the recurrent state of its linear-attention and state-space layers.

Key/value layers: ``DynamicCache`` layers that hold ``.keys/.values`` [B, H, S, D] (full-attention layers, and
sliding-window layers as long as they have not started dropping old positions). Legacy tuple caches, static,
quantized and offloaded caches cannot drop arbitrary positions cheaply or at all: they raise EagleError.
:func:`new_cache` builds what ``eagle.speculate`` decodes with: full-size key/value layers (sliding windows are
applied by its own attention masks) and, for hybrid targets, transformers' own recurrent layers.

Recurrent layers (Gated DeltaNet, Mamba: transformers' ``LinearAttentionCacheLayerMixin``) hold one state that
summarises every token seen; it cannot be cut back to an earlier position. :func:`snapshot_states` copies those
states before a verification, :func:`restore_states` puts them back, and the caller reads the accepted tokens
again (:func:`eagle.speculate.verify_chain`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from eagle.errors import EagleError

_UNSUPPORTED_HINT = (
    "speculative decoding needs a cache that can drop rejected positions: use transformers.DynamicCache() "
    "(what eagle.speculate builds itself)"
)


def new_cache(model: torch.nn.Module) -> Any:
    """An empty cache for speculative decoding on ``model``: full-size key/value layers (rejected drafts must be
    removable; sliding windows come from the attention masks) and, where the model has them, the recurrent layers
    transformers builds for its config."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
    )

    if not has_recurrent_state(model):
        return DynamicCache()
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            cache.layers[i] = DynamicLayer()
        elif isinstance(layer, DynamicSlidingWindowLayer):
            raise EagleError(
                f"cache layer {type(layer).__name__} (a recurrent state beside a sliding window) is not supported by "
                "speculative decoding; use plain decoding for this model"
            )
    return cache


def has_recurrent_state(model: torch.nn.Module) -> bool:
    """Whether the model keeps a recurrent state (linear-attention or state-space layers) in its cache."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    config = model.config.get_text_config(decoder=True)
    if getattr(config, "layer_types", None) is None:
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=model.config).layers)


def _recurrent_layers(cache: Any) -> list[Any]:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return [layer for layer in getattr(cache, "layers", []) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def snapshot_states(cache: Any) -> list[dict[str, dict]]:
    """Copies of every recurrent layer's conv and recurrent states (and whether they are set), layer by layer."""
    saved = []
    for layer in _recurrent_layers(cache):
        saved.append({
            "conv_states": {i: None if t is None else t.clone() for i, t in layer.conv_states.items()},
            "recurrent_states": {i: None if t is None else t.clone() for i, t in layer.recurrent_states.items()},
            "has_previous_state": dict(layer.has_previous_state),
        })
    return saved


def restore_states(cache: Any, saved: list[dict[str, dict]]) -> None:
    """Put back the states :func:`snapshot_states` copied (in place where the tensors still exist)."""
    layers = _recurrent_layers(cache)
    if len(layers) != len(saved):
        raise EagleError(f"a state snapshot of {len(saved)} recurrent layers cannot restore a cache with {len(layers)}")
    for layer, state in zip(layers, saved):
        for name in ("conv_states", "recurrent_states"):
            held = getattr(layer, name)
            for i, t in state[name].items():
                if t is not None and held.get(i) is not None and held[i].shape == t.shape:
                    held[i].copy_(t)
                else:
                    held[i] = t
        layer.has_previous_state = dict(state["has_previous_state"])


# model -> None when a cached multi-token forward continues its recurrent state exactly, else why not (checked once)
_CONTINUATION: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


@torch.no_grad()
def check_continuation(model: torch.nn.Module, prefix: int = 6, new: int = 5) -> None:
    """Raise EagleError unless the model, after a cached prefix, gives the same logits for several new tokens in
    one forward as for the same tokens fed one at a time (what plain decoding does).

    Chain verification reads several tokens in one forward on top of a cached recurrent state; an implementation
    whose multi-token path restarts that state (transformers' Jamba scans from a zero state) would verify
    against a different model. Checked once per model on a few fixed tokens, to the near-tie tolerance of its
    dtype."""
    from eagle.devices import model_device, model_dtype
    from eagle.exactness import near_tie_rtol
    from eagle.targets import cache_kwarg

    if model not in _CONTINUATION:
        device, kw = model_device(model), cache_kwarg(model)
        vocab = int(model.get_input_embeddings().weight.shape[0])
        ids = (torch.arange(prefix + new, device=device) * 7 + 3) % vocab
        positions = torch.arange(prefix + new, device=device)
        one_pass = new_cache(model)
        model(ids[None, :prefix], use_cache=True, **{kw: one_pass})
        together = model(ids[None, prefix:], position_ids=positions[None, prefix:], use_cache=True,
                         **{kw: one_pass}).logits[0].float()
        stepwise = new_cache(model)
        model(ids[None, :prefix], use_cache=True, **{kw: stepwise})
        single = torch.stack([
            model(ids[None, i : i + 1], position_ids=positions[None, i : i + 1], use_cache=True,
                  **{kw: stepwise}).logits[0, -1].float()
            for i in range(prefix, prefix + new)
        ])
        gap = float((together - single).abs().max())
        tol = near_tie_rtol(model_dtype(model)) * max(1.0, float(single.abs().max()))
        _CONTINUATION[model] = None if gap <= tol else (
            f"{type(model).__name__} gives other logits for {new} tokens read in one forward after a cached prefix "
            f"than for the same tokens read one at a time (largest gap {gap:.3g}, tolerance {tol:.3g}): its "
            "multi-token path does not continue the recurrent state, so drafts cannot be verified exactly. "
            "Use plain decoding for this model"
        )
    if _CONTINUATION[model] is not None:
        raise EagleError(_CONTINUATION[model])


def _layer_length(layer: Any) -> int:
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.numel() == 0:
        return 0
    return int(keys.shape[-2])


def _check_layer(layer: Any) -> bool:
    """Whether the layer holds keys and values to cut (recurrent-only layers hold none); EagleError where it
    holds them in a form that cannot be cut."""
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionCacheLayerMixin,
    )

    if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicLayer):
        return False
    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer):
        raise EagleError(f"cache layer type {type(layer).__name__} is not supported; {_UNSUPPORTED_HINT}")
    if isinstance(layer, DynamicSlidingWindowLayer) and layer.cumulative_length != _layer_length(layer):
        raise EagleError(
            "a sliding-window cache layer has already dropped positions older than its window, so rejected "
            f"drafts cannot be removed; {_UNSUPPORTED_HINT}"
        )
    return True


def _unchanged_prefix(keep: torch.Tensor) -> int:
    """Length of the leading run where keep[i] == i (positions that stay where they are)."""
    same = (keep == torch.arange(keep.numel(), device=keep.device)).tolist()
    return same.index(False) if False in same else len(same)


def _select(t: torch.Tensor, keep: torch.Tensor, start: int) -> torch.Tensor:
    """Positions ``keep`` of t [..., S, D], where ``keep[:start]`` is ``0..start-1``: only the tail is copied."""
    n = keep.numel()
    if start < n:
        tail = t[..., keep[start:], :]  # a copy, so the overlapping in-place write below is safe
        t[..., start:n, :] = tail
    return t[..., :n, :]


def gather_cache(cache: Any, keep: torch.Tensor) -> Any:
    """Keep only sequence positions ``keep`` (LongTensor [n], in that order) in every layer of ``cache``.

    The cache is modified in place and returned.
    """
    keep = torch.as_tensor(keep, dtype=torch.long).flatten().cpu()
    start = _unchanged_prefix(keep)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise EagleError(f"cache of type {type(cache).__name__} is not supported; {_UNSUPPORTED_HINT}")
    if getattr(cache, "offloading", False):
        raise EagleError(f"offloaded caches are not supported; {_UNSUPPORTED_HINT}")
    for layer in layers:
        length = _layer_length(layer) if _check_layer(layer) else 0
        if length == 0:
            continue
        if keep.numel() and int(keep.max()) >= length:
            raise EagleError(f"cannot keep position {int(keep.max())} of a cache holding {length} positions")
        idx = keep.to(layer.keys.device)
        layer.keys = _select(layer.keys, idx, start)
        layer.values = _select(layer.values, idx, start)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = int(layer.keys.shape[-2])
    return cache


def crop_cache(cache: Any, n: int) -> Any:
    """Keep the first ``n`` positions of every layer (same support and in-place rules as :func:`gather_cache`)."""
    if n < 0:
        raise EagleError(f"cannot crop a cache to a negative length ({n})")
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise EagleError(f"cache of type {type(cache).__name__} is not supported; {_UNSUPPORTED_HINT}")
    for layer in layers:
        if not _check_layer(layer) or _layer_length(layer) == 0:
            continue
        layer.keys = layer.keys[..., :n, :]
        layer.values = layer.values[..., :n, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = int(layer.keys.shape[-2])
    return cache


def cache_length(cache: Any) -> int:
    """Number of positions held (first layer that holds any); 0 for an empty cache."""
    for layer in getattr(cache, "layers", []):
        length = _layer_length(layer)
        if length:
            return length
    return 0
