"""The target's hidden states a head reads: which layers (``aux_layers``) and how they are captured.

Layer ids index HF ``output_hidden_states``: 0 = embeddings, k = output of decoder layer k-1, the last entry is
after the final norm (docs/ARCHITECTURE.md, "Conventions").
"""

from __future__ import annotations

from typing import Any

import torch

from eagle.errors import EagleError
from eagle.targets import last_logits_only


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default layer ids ``[2, L // 2, L - 3]``; tiny models get distinct ids clamped into 1..L."""
    if num_layers < 1:
        raise EagleError(f"a target needs at least one decoder layer (got num_layers={num_layers})")
    wanted = min(3, num_layers)
    ids: list[int] = []
    for i in (2, num_layers // 2, num_layers - 3):
        i = min(max(i, 1), num_layers)
        if i not in ids:
            ids.append(i)
    for i in range(1, num_layers + 1):  # too few distinct ones left: fill with the lowest unused ids
        if len(ids) >= wanted:
            break
        if i not in ids:
            ids.append(i)
    return sorted(ids)


def check_aux_layers(aux_layers: list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Validate user layer ids (HF hidden_states indices, ``0 < id <= num_layers``, distinct)."""
    ids = list(aux_layers) if isinstance(aux_layers, list | tuple) else None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EagleError(
            f"aux_layers must be a non-empty list of integers (got {aux_layers!r}); the default for this "
            f"target is {default_aux_layers(num_layers)}"
        )
    bad = [i for i in ids if not 0 < i <= num_layers]
    if bad:
        raise EagleError(
            f"aux_layers {ids} has ids outside 1..{num_layers} (the target has {num_layers} layers): {bad}; "
            f"layer ids index HF hidden_states (0 = embeddings is not allowed); default: "
            f"{default_aux_layers(num_layers)}"
        )
    if len(set(ids)) != len(ids):
        raise EagleError(f"aux_layers {ids} repeats a layer id; list each layer once")
    return ids


def capture_features(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layers: list[int] | tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once and return ``(aux_hidden [B,T,len(aux_layers)*h], last_hidden [B,T,h])``.

    ``aux_hidden`` concatenates ``hidden_states[i]`` for i in ``aux_layers``; ``last_hidden`` is
    ``hidden_states[-1]`` (after the final norm, so ``model.lm_head(last_hidden)`` is the logits). Both keep the
    model's dtype and are returned on ``input_ids``' device (also for accelerate device_map models).
    Call it under ``torch.no_grad()`` (or ``inference_mode``) when no gradient is wanted.
    """
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    ids = check_aux_layers(aux_layers, num_layers)
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
    )
    kwargs.update(last_logits_only(model))  # the features make the full logits redundant: skip them
    out = model(**kwargs)
    return select_features(model, out.hidden_states, ids, input_ids.device)


def select_features(
    model: torch.nn.Module, hidden_states: Any, aux_ids: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux_hidden, last_hidden)`` out of a forward's ``hidden_states`` (see :func:`capture_features`): one
    place for which states the features are, shared by collection and by capture during regeneration."""
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    if hidden_states is None or len(hidden_states) != num_layers + 1:
        raise EagleError(
            f"{type(model).__name__} returned {0 if hidden_states is None else len(hidden_states)} hidden states "
            f"for {num_layers} layers (expected {num_layers + 1}); this architecture is not supported"
        )
    aux = torch.cat([hidden_states[i].to(device) for i in aux_ids], dim=-1)
    return aux, hidden_states[-1].to(device)
