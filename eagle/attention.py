"""Grouped-query attention that reads each key/value head in place: the attention a target gets on a CPU.

Most targets share each key/value head among several query heads (GQA: SmolLM2 9 query heads over 3, Llama 3
32 over 8). transformers' ``sdpa`` attention copies every key and value head ``num_key_value_groups`` times
whenever an attention mask is given -- padding in a batch, the tree mask in verification -- because CUDA's
fused kernels have no masked GQA. On a CPU torch's own SDPA takes ``enable_gqa`` together with a mask, so the
copy is pure cost, and in batched decoding over a long cache it is most of a step: every step copies the whole
cache (three times over for SmolLM2) into fresh memory the kernel then reads once. Regenerating answers to 64
prompts of ~300 tokens, the decoding steps take 4.5x longer with the copy than without.

:data:`SDPA_GQA` is that attention registered under its own name, through transformers' public attention and
mask interfaces: the same masks and the same kernel as ``sdpa``, without the copy. :mod:`eagle.targets` loads
CPU targets with it; on CUDA the stock ``sdpa`` stays.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from eagle.errors import EagleError

SDPA_GQA = "sdpa_gqa"


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One attention call: ``query`` [B, H, q, d], ``key`` / ``value`` [B, H_kv, kv, d] -> ([B, q, H, d], None)."""
    for name in ("softcap", "s_aux"):  # attention-logit soft-capping (Gemma 2), attention sinks (gpt-oss)
        if kwargs.get(name) is not None:
            raise EagleError(
                f"{type(module).__name__} asks attention for {name!r}, which {SDPA_GQA} cannot apply; load this model "
                "with target.attention=eager (auto does so for the families it knows)"
            )
    grouped = query.shape[1] != key.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # without a mask, the mask builder has vouched that the causal pattern is all there is: a single query, or a
    # prompt with nothing before it in the cache (a pre-allocated cache is cut to the prompt, as SDPA aligns the
    # causal triangle to the top left)
    causal = bool(causal and attention_mask is None and query.shape[2] > 1)
    if causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout,
        scale=scaling, is_causal=causal, enable_gqa=grouped,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make :data:`SDPA_GQA` a name ``from_pretrained(attn_implementation=...)`` accepts (idempotent); returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(SDPA_GQA, sdpa_gqa_forward)
    AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)
    return SDPA_GQA


def suit_device(model: torch.nn.Module, device: torch.device) -> None:
    """A model loaded on the CPU (with :data:`SDPA_GQA`) that will run on an accelerator goes back to stock SDPA,
    whose CUDA kernels are the fast ones there."""
    if device.type != "cpu" and getattr(model.config, "_attn_implementation", None) == SDPA_GQA:
        model.set_attn_implementation("sdpa")
