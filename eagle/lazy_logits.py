"""Lazy logits: the target's lm_head only for the tree nodes verification visits.

The lm_head over a large vocabulary is a big part of a small model's forward, and verification reads the logits of
only the nodes it visits (the accepted path). So the verification forward asks (``logits_to_keep``) for the logits
of the tree's most likely path -- the first child at every level, since siblings come best-first -- and of the
prompt-lookup branch, computed there in one matrix product, and verification runs the lm_head on
``hidden_states[-1]`` for any other node it visits, together with that node's first-child chain below it. (Not one row per visited node: reading the weights
dominates the cost of a few rows; on a 2-core CPU one row of SmolLM2's 49k x 576 lm_head costs a third to a half
of 16 rows.)

This is used only where it reproduces the model's own logits, checked once per model on a prefill
(:func:`logit_map`); other models get every node's logits from the forward.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from eagle.targets import last_logits_only
from eagle.tree import DraftTree
from eagle.verify import LazyRows

# model -> its hidden-to-logits map, or None where lazy logits do not reproduce its logits (checked once)
_LOGIT_MAPS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor] | None] = (
    weakref.WeakKeyDictionary()
)


def _logit_scales(config: Any) -> list[float]:
    """The factors a family's forward multiplies ``lm_head(h)`` by, most likely first: Cohere's ``logit_scale``;
    Granite divides by ``logits_scaling`` (HyperCLOVAX multiplies by a field of the same name, so both);
    Falcon-H1's ``lm_head_multiplier``."""
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return [float(config.logit_scale)]
    if getattr(config, "logits_scaling", None) not in (None, 1, 1.0):
        return [1.0 / float(config.logits_scaling), float(config.logits_scaling)]
    if getattr(config, "lm_head_multiplier", None) not in (None, 1, 1.0):
        return [float(config.lm_head_multiplier)]
    return [1.0]


def _postprocessing(scale: float, cap: float | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def post(logits: torch.Tensor) -> torch.Tensor:
        if scale != 1.0:
            logits = logits * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return post


def _postprocessing_candidates(model: torch.nn.Module) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Candidate maps from ``lm_head(h)`` to the model's logits, from the post-processing some families apply:
    a scale (:func:`_logit_scales`), then Gemma's soft-cap ``final_logit_softcapping``. Elementwise, so they
    apply as well to any subset of the vocabulary's columns."""
    cfg = model.config.get_text_config(decoder=True)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return [_postprocessing(scale, cap) for scale in _logit_scales(cfg)]


class TargetLogits(torch.nn.Module):
    """The target's logits from its last hidden state: its output embeddings, then the post-processing its
    forward applies (:func:`_postprocessing_candidates`, the most likely one). Training labels must be the
    target's own distribution: Cohere's logits are scaled by 1/16, so softmax of the raw lm_head would be another,
    far sharper distribution. ``weight`` / ``bias`` are the lm_head's (losses read rows of them), ``post`` maps
    raw logits (any subset of the vocabulary's columns) to the target's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._lm_head = (model.get_output_embeddings(),)  # borrowed, not registered: never saved or wrapped
        self.post = _postprocessing_candidates(model)[0]

    @property
    def weight(self) -> torch.Tensor:
        return self._lm_head[0].weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self._lm_head[0], "bias", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.post(self._lm_head[0](hidden))


def logit_map(model: torch.nn.Module, prefill_out: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
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
    if last_logits_only(model) and isinstance(lm_head, torch.nn.Module) and hidden_states:
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


def node_logits(
    out: Any, logit_map: Callable[[torch.Tensor], torch.Tensor] | None, tree: DraftTree, kept: list[int]
) -> torch.Tensor | LazyRows:
    """Every node's logits: the forward's [n, V] when it made them all, else rows made on first access, those of
    the ``kept`` nodes taken from the forward's output (``logits_to_keep=kept``).

    A node off the kept path is made together with its first-child chain below it: where verification goes on if
    it accepts there (the lookup branch, grafted after the drafted siblings, is such a chain). A few rows cost
    about what one does (the weights are read once), so a branch that verification walks down costs one pass over
    the lm_head instead of one per node."""
    logits = out.logits[0]
    if logit_map is None or logits.shape[0] == tree.size:
        return logits
    given = dict(zip(kept, logits)) if logits.shape[0] == len(kept) else {}
    hidden = out.hidden_states[-1][0]

    def row(node: int) -> torch.Tensor:
        if node not in given:
            chain = [node]
            while kids := tree.children(chain[-1]):
                chain.append(kids[0])
            given.update(zip(chain, logit_map(hidden[chain])))
        return given[node]

    return LazyRows(row)
