"""How tokens are chosen and when generation stops: one object that every decoding loop takes.

Temperature 0 means greedy. Above it, the target's logits are warped as Hugging Face's samplers do (temperature,
then top-k, then top-p) before sampling, in plain decoding and in speculative verification alike, which is what
keeps the speculative output distributed exactly as plain sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle.errors import EagleError


@dataclass(frozen=True)
class Sampling:
    """The settings a decoding loop needs besides the model: warping, and the stopping rules.

    ``eos_token_ids``: tokens that end generation (kept in the output). ``stop_strings``: text that ends it once
    decoded (needs ``tokenizer``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    tokenizer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_warping(self.temperature, self.top_p, self.top_k)
        if any(self.stop_strings) and self.tokenizer is None:
            raise EagleError("stop_strings need a tokenizer to decode the output: pass tokenizer=...")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The next-token distribution these settings sample from (:func:`logits_to_probs`)."""
        return logits_to_probs(logits, self.temperature, self.top_p, self.top_k)


def check_warping(temperature: float, top_p: float, top_k: int, where: str = "") -> None:
    """Raise EagleError naming the bad setting (``where``: its config section, e.g. ``"eval."``)."""
    if temperature < 0:
        raise EagleError(f"{where}temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise EagleError(f"{where}top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise EagleError(f"{where}top_k must be >= 0 (0 = off), got {top_k}")


def logits_to_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Next-token probabilities after HF's sampling warpers (temperature, then top-k, then top-p).

    ``temperature <= 0`` means greedy: a one-hot distribution at the argmax. ``top_k=0`` and ``top_p=1`` disable
    those filters; at least one token always survives, as in transformers.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    scores = logits / temperature
    if top_k and top_k > 0:
        k = min(int(top_k), scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(-1)
