"""Keep or drop sequence positions of a transformers KV cache (after a tree verification).

Supported: ``DynamicCache`` whose layers hold ``.keys/.values`` [B, H, S, D] (full-attention layers, and
sliding-window layers as long as they have not started dropping old positions). Legacy tuple caches, static, quantized, offloaded and recurrent (linear-attention) caches cannot drop arbitrary positions
cheaply or at all: they raise EagleError. ``eagle.speculate`` always builds a full-size ``DynamicCache`` (and
applies sliding windows through its own attention masks), so it never meets those.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle.errors import EagleError

_UNSUPPORTED_HINT = (
    "speculative decoding needs a cache that can drop rejected positions: use transformers.DynamicCache() "
    "(what eagle.speculate builds itself)"
)


def _layer_length(layer: Any) -> int:
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.numel() == 0:
        return 0
    return int(keys.shape[-2])


def _check_layer(layer: Any) -> None:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise EagleError(f"cache layer type {type(layer).__name__} is not supported; {_UNSUPPORTED_HINT}")
    if isinstance(layer, DynamicSlidingWindowLayer) and layer.cumulative_length != _layer_length(layer):
        raise EagleError(
            "a sliding-window cache layer has already dropped positions older than its window, so rejected "
            f"drafts cannot be removed; {_UNSUPPORTED_HINT}"
        )


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
        _check_layer(layer)
        length = _layer_length(layer)
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
        _check_layer(layer)
        if _layer_length(layer) == 0:
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
