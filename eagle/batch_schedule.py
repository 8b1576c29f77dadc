"""Where a draft head pays in a batching engine, and the per-batch-size schedule that keeps it only there.

A speculative step verifies k + 1 tokens per request. At batch 1 the target's forward is bound by reading its
weights, so the extra tokens cost little and every accepted draft is a step saved. With many concurrent
requests the forward becomes bound by compute, each extra token costs almost as much as a step, and the same head
slows the engine down. vLLM takes a schedule of drafts per step by batch size
(``num_speculative_tokens_per_batch_size``: inclusive ranges ``[first, last, k]``); this module turns a measured
sweep (tokens/s with the head and without at a few batch sizes) into one: the head on (k) from batch 1 up to the
largest measured size before the first where it was slower, off (0) above. Sizes between two measured ones are
not known, so the edge is the last size measured faster; near the edge the speedup is close to 1 and one run's
noise can move it by a size. "Off" is not free: vLLM still runs the head once a step
over the new tokens, to keep its KV cache current for when drafting resumes, so above the edge the engine stays
somewhat slower than without the head; ``eval.vllm.batch_schedule`` measures how much.
"""

from __future__ import annotations

from typing import Any

from eagle.errors import EagleError

MAX_BATCH = 1024  # the "off" range's end: vLLM clips the schedule to its own max_num_seqs and carries the last k on


def sweep_row(batch_size: int, tokens: int, seconds: float, base_tokens: int, base_seconds: float,
              matches: list[bool], draft_tokens: int | None = None) -> dict[str, Any]:
    """One measured batch size: pooled tokens/s with the head and without, their ratio, outputs equal to plain,
    and the head's drafted tokens per generated token (about k / tau where it drafts every step, near 0 where a
    schedule turned it off: the direct sign that the engine followed the schedule; None when not counted)."""
    if base_tokens <= 0:
        raise EagleError(f"the plain engine generated no tokens at batch size {batch_size}, so there is no speedup "
                         "to measure: every prompt ended at once; give prompts that need an answer")
    if seconds <= 0 or base_seconds <= 0:
        raise EagleError(f"a timed run took no time at batch size {batch_size} ({seconds} s with the head, "
                         f"{base_seconds} s without): the records are not from a timed run")
    tps, base = tokens / seconds, base_tokens / base_seconds
    return {"batch_size": batch_size, "tokens_per_second": tps, "baseline_tokens_per_second": base,
            "speedup": tps / base, "requests": len(matches),
            "greedy_match_rate": sum(matches) / len(matches) if matches else None,
            "draft_tokens_per_token": draft_tokens / tokens if draft_tokens is not None and tokens else None}


def fit_schedule(rows: list[dict[str, Any]], k: int, served_with: list[list[int]] | None = None) -> dict[str, Any]:
    """The schedule for ``rows`` (one per batch size, any order) of a head drafting ``k`` tokens a step.

    ``schedule`` is None when no switch is needed or none helps: the head was faster at every size measured
    (``pays_up_to`` the largest), or slower already at the smallest (``pays_up_to`` 0); and when the head was
    measured ``served_with`` a schedule already (then the rows check that one)."""
    rows = sorted(rows, key=lambda r: r["batch_size"])
    if not rows:
        raise ValueError("fit_schedule needs at least one measured batch size")
    pays_up_to, first_slower = 0, None
    for r in rows:
        if r["speedup"] < 1.0:
            first_slower = r["batch_size"]
            break
        pays_up_to = r["batch_size"]
    schedule = None
    if pays_up_to and first_slower is not None and not served_with:
        schedule = [[1, pays_up_to, k], [pays_up_to + 1, max(MAX_BATCH, pays_up_to + 1), 0]]
    return {"rows": rows, "num_speculative_tokens": k, "pays_up_to": pays_up_to, "first_slower": first_slower,
            "measured_up_to": rows[-1]["batch_size"], "schedule": schedule, "served_with": served_with}


def drafted_text(always_on: float | None, scheduled: float | None) -> str:
    """Drafted tokens per generated token of the head always on, and with a schedule ("-" when not counted):
    where the schedule turns the head off, the second falls to about 0."""
    if always_on is None:
        return "-"
    return f"{always_on:.2f}" + ("" if scheduled is None else f" / {scheduled:.2f}")


def describe(sweep: dict[str, Any]) -> str:
    """One or two lines: speedup per batch size, and the schedule to serve with (or why there is none)."""
    speeds = ", ".join(f"{r['batch_size']}: {r['speedup']:.2f}x" for r in sweep["rows"])
    line = f"speedup by concurrent requests ({speeds})"
    if sweep.get("served_with"):
        drafted = ", ".join(f"{r['batch_size']}: {r['draft_tokens_per_token']:.2f}" for r in sweep["rows"]
                            if r.get("draft_tokens_per_token") is not None)
        return (f"{line}, the head served with the schedule {sweep['served_with']}"
                + (f" (drafted tokens per generated token: {drafted})" if drafted else ""))
    if sweep["schedule"]:
        return (f"{line}; the head pays up to {sweep['pays_up_to']} requests at once (slower at "
                f"{sweep['first_slower']}): serve with \"num_speculative_tokens_per_batch_size\": "
                f"{sweep['schedule']} in the speculative config (above that vLLM still runs the head once a step, "
                "without drafting: eval.vllm.batch_schedule measures what that costs)")
    if sweep["pays_up_to"]:
        return f"{line}; the head pays at every batch size measured (up to {sweep['measured_up_to']})"
    return f"{line}; the head is slower already at {sweep['rows'][0]['batch_size']} request(s) at once here"
