"""Is a greedy difference between speculative and plain decoding a near-tie of the target, or a bug?

At temperature 0 speculative decoding emits the target's argmax at every position, so its output equals plain
greedy decoding exactly -- in exact arithmetic. A real target computes in floating point, and a verification
forward over a tree of N tokens runs other matrix kernels (other summation orders) than a one-token decoding
step. In float32 the two paths' logits differ by ~1e-5 and the outputs match; in bfloat16 / float16 they differ
by an ulp of the logits (0.125 at a logit of 20 in bf16), so wherever the target's top two tokens are that close
(exact ties are common in bf16) the two paths can pick different tokens and the texts part from there on.

:func:`diagnose_mismatch` referees one such difference: it runs the target once over the prompt and the shared
prefix and reports the gap between the two tokens' logits at the first differing position. A gap within
``NEAR_TIE_RTOL[dtype] * |top logit|`` is a near-tie (numerics: both tokens are the target's greedy choice up to
rounding); a larger gap means speculative decoding emitted a token the target does not rank first -- a bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from eagle.devices import model_device, model_dtype

# relative logit gap under which the target's top two tokens count as tied at that precision: ~2-3 ulps of bf16
# and fp16, ~1,000 ulps of fp32 (30 layers of differently ordered fp32 sums move logits by ~1e-5 relative)
NEAR_TIE_RTOL: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length when one is a prefix of the
    other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def near_tie_rtol(dtype: torch.dtype) -> float:
    """``NEAR_TIE_RTOL`` for ``dtype`` (float32's for any other dtype)."""
    return NEAR_TIE_RTOL.get(dtype, NEAR_TIE_RTOL[torch.float32])


@torch.no_grad()
def diagnose_mismatch(
    model: torch.nn.Module, prompt: Sequence[int], plain: Sequence[int], spec: Sequence[int]
) -> dict[str, Any] | None:
    """Referee the first difference between plain (``plain``) and speculative (``spec``) greedy tokens.

    Returns None when the two agree. Otherwise a dict: ``position`` (index into the new tokens), ``plain_token``,
    ``spec_token`` (None where that output had already ended), and -- when both have a token there --
    ``logit_gap`` (the target's logit of the plain token minus that of the speculative one, from one forward over
    prompt + shared prefix), ``top_logit``, ``tolerance`` (``NEAR_TIE_RTOL[dtype] * |top_logit|``) and
    ``near_tie`` (``|logit_gap| <= tolerance``). A length-only difference (one output stopped earlier) gets
    ``near_tie`` None: there is no pair of tokens to compare.
    """
    j = first_mismatch(plain, spec)
    if j is None:
        return None
    out: dict[str, Any] = {
        "position": j,
        "plain_token": int(plain[j]) if j < len(plain) else None,
        "spec_token": int(spec[j]) if j < len(spec) else None,
        "logit_gap": None,
        "top_logit": None,
        "tolerance": None,
        "near_tie": None,
    }
    if out["plain_token"] is None or out["spec_token"] is None:
        return out
    device = model_device(model)
    ids = torch.tensor([list(prompt) + list(plain[:j])], device=device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    gap = float(logits[out["plain_token"]] - logits[out["spec_token"]])
    top = float(logits.max())
    tol = near_tie_rtol(model_dtype(model)) * abs(top)
    out.update(logit_gap=gap, top_logit=top, tolerance=tol, near_tie=abs(gap) <= tol)
    return out


def mismatch_summary(diagnoses: Sequence[dict[str, Any] | None], dtype: torch.dtype) -> dict[str, Any]:
    """Report fields over the prompts' diagnoses (None = the prompt matched)."""
    found = [d for d in diagnoses if d is not None]
    gaps = [abs(d["logit_gap"]) for d in found if d["logit_gap"] is not None]
    return {
        "prompts": len(diagnoses),
        "mismatched": len(found),
        "near_ties": sum(1 for d in found if d["near_tie"]),
        "not_near_ties": sum(1 for d in found if d["near_tie"] is False),
        "length_only": sum(1 for d in found if d["near_tie"] is None),
        "largest_logit_gap": max(gaps) if gaps else None,
        "near_tie_rtol": near_tie_rtol(dtype),
        "dtype": str(dtype).removeprefix("torch."),
    }


def mismatch_note(summary: dict[str, Any]) -> str | None:
    """One paragraph for the console after the eval table (rich markup), or None when every prompt matched."""
    n, bad = summary["mismatched"], summary["not_near_ties"]
    if not n:
        return None
    head = f"greedy match {summary['prompts'] - n}/{summary['prompts']}: "
    if bad or summary["length_only"]:
        what = []
        if bad:
            what.append(f"{bad} first difference(s) are NOT near-ties of the target's logits")
        if summary["length_only"]:
            what.append(f"{summary['length_only']} output(s) stopped at a different length")
        return (
            f"[red]{head}{' and '.join(what)} (see first_mismatch* in the report's prompts): speculative "
            "decoding emitted tokens the target does not choose. That is a bug; please report it with the "
            "report.json.[/]"
        )
    gap = summary["largest_logit_gap"]
    return (
        f"[yellow]{head}every first difference is a near-tie of the target's own logits (largest gap "
        f"{gap:.3g}, within {summary['near_tie_rtol']:g} x the top logit). In {summary['dtype']} a many-token "
        "verification forward rounds differently from a one-token decoding step, so near-ties can break either "
        "way; run the target in float32 (target.dtype=float32, --dtype float32) to check exactness.[/]"
    )
