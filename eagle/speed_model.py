"""How the speedup depends on tau, fitted on one evaluation's prompts: what tau a speedup goal needs here.

A request decoded speculatively costs ``P + (n / tau) * s``, decoded plainly ``P + n * p`` (``P`` the prefill and
the other work done once per request, ``n`` new tokens, ``s`` and ``p`` the time of a speculative and of a plain
step). Per prompt, the time per token relative to plain decoding is therefore ``r = a + b / tau``: ``a`` the share
that speculation cannot shrink, ``b`` the cost of a speculative step in units of the plain request's time per
token. A least-squares line of ``r`` against ``1 / tau`` over the prompts of one run (one engine, one machine,
one hour, prompts whose tau differs) gives ``a`` and ``b``, and from them the speedup any tau would give,
``1 / (a + b / tau)``, and the tau a goal needs, ``b / (1 / goal - a)``. A chain of k drafts accepts at most
k + 1 tokens a step, so a goal whose tau is above that is out of reach for any head on that engine and machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

GOALS = (1.0, 1.5, 2.0)  # speedups whose tau the report names (1.0: where the head breaks even)
MIN_PROMPTS = 8  # fewer prompts do not pin a line


def speed_points(runs: Sequence[Any]) -> list[tuple[float, float]]:
    """``(tau, time per token speculative / plain)`` of every prompt run (eagle.metrics.PromptRun) that has a
    plain run beside it and at least one verification step."""
    points = (_point(r.spec.mean_accept_length, len(r.spec.tokens), r.spec.total_time,
                     len(r.plain.tokens), r.plain.total_time) for r in runs if r.plain is not None)
    return [p for p in points if p is not None]


def record_points(records: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """The same from a report's ``prompts`` records (so that reports written before this model can be fitted)."""
    points = (_point(rec.get("acceptance_length_mean"), rec["new_tokens"], rec["time_s"],
                     rec["baseline_new_tokens"], rec["baseline_time_s"])
              for rec in records if rec.get("baseline_time_s") is not None)
    return [p for p in points if p is not None]


def _point(tau: float | None, tokens: int, seconds: float, plain_tokens: int,
           plain_seconds: float) -> tuple[float, float] | None:
    if not tau or not tokens or not plain_tokens or seconds <= 0 or plain_seconds <= 0:
        return None
    return tau, (seconds / tokens) / (plain_seconds / plain_tokens)


def fit_speed_model(points: Sequence[tuple[float, float]], max_tau: float | None,
                    goals: Sequence[float] = GOALS) -> dict[str, Any] | None:
    """The line ``r = a + b / tau`` through ``points`` and what follows from it (see the module docstring);
    None with fewer than MIN_PROMPTS points or when every prompt has the same tau."""
    if len(points) < MIN_PROMPTS:
        return None
    xs = [1.0 / tau for tau, _ in points]
    ys = [r for _, r in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx < 1e-12:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    residual = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    total = sum((y - my) ** 2 for y in ys)
    se_b = math.sqrt(residual / (n - 2) / sxx) if n > 2 else None
    return {
        "prompts": n,
        "fixed_share": a,
        "step_cost": b,
        "step_cost_se": se_b,
        "r2": 1.0 - residual / total if total > 0 else None,
        "max_tau": max_tau,
        "speedup_at_max_tau": speedup_at(max_tau, a, b) if max_tau else None,
        "tau_for": {f"{g:g}x": tau_for(g, a, b) for g in goals},
    }


def max_tau(depth: int, lookup_ngram: int = 0, lookup_tokens: int = 0) -> int:
    """The most tokens one verification step can accept: the tree's depth (or a longer lookup branch) + 1."""
    return max(depth, lookup_tokens if lookup_ngram else 0) + 1


def speedup_at(tau: float, a: float, b: float) -> float | None:
    """The speedup the line gives a head of acceptance length ``tau`` (None where the line is not positive)."""
    r = a + b / tau
    return 1.0 / r if r > 0 else None


def tau_for(goal: float, a: float, b: float) -> float | None:
    """The tau at which the line reaches ``goal``; None when no tau does (``a`` alone costs more than it allows,
    or the fit says speed does not grow with tau)."""
    room = 1.0 / goal - a
    if b <= 0 or room <= 0:
        return None
    return b / room


def describe(model: dict[str, Any] | None) -> str | None:
    """One line for the console: the tau a 2x (and 1.5x) speedup needs here, and the most any head gets."""
    if not model:
        return None
    need = model["tau_for"]

    def tau(goal: str) -> str:
        value, top = need.get(goal), model["max_tau"]
        if value is None or (top is not None and value > top):
            return "out of reach"
        return f"tau {value:.2f}"

    text = (f"speed against tau here (fit over {model['prompts']} prompts, R^2 {model['r2'] or 0:.2f}): "
            f"2x needs {tau('2x')}, 1.5x {tau('1.5x')}, break-even {tau('1x')}")
    if model["speedup_at_max_tau"]:
        text += f"; every draft accepted (tau {model['max_tau']:g}) would give {model['speedup_at_max_tau']:.2f}x"
    return text
