"""How the speedup depends on tau, fitted on one evaluation's prompts: what tau a speedup goal needs here.

A request decoded speculatively costs ``P + (n / tau) * s``, decoded plainly ``P + n * p`` (``P`` the prefill and
the other work done once per request, ``n`` new tokens, ``s`` and ``p`` the time of a speculative and of a plain
step). Per prompt, the time per token relative to plain decoding is therefore ``r = a + b / tau``: ``a`` the share
that speculation cannot shrink, ``b`` the cost of a speculative step in units of the plain request's time per
token. The fit assumes one ``a`` and one ``b`` for all the prompts of a run (one engine, machine and hour), which
holds only roughly: prompts differ in length (``P``), in answer length (``n``, cut by EOS), and the speculative
prefill also runs the head. So the line is fitted by least squares of ``r`` against ``1 / tau`` with each prompt
weighted by its plain time: long requests count as much as they weigh in the report's pooled speedup, and the line
at the run's pooled tau gives back about its pooled speedup. From it: the speedup any tau would give,
``1 / (a + b / tau)``, and the tau a goal needs, ``b / (1 / goal - a)``, with its standard error. A tree or chain
accepts at most its deepest path + 1 tokens a step (``top_tau``), so a goal above that is out of reach for any head
on that engine and machine; both figures past the prompts' own taus are extrapolations of the line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

GOALS = (1.0, 1.5, 2.0)  # speedups whose tau the report names (1.0: where the head breaks even)
MIN_PROMPTS = 8  # fewer prompts do not pin a line

Point = tuple[float, float, float]  # (tau, time per token speculative / plain, weight: the plain request's seconds)


def speed_points(runs: Sequence[Any]) -> list[Point]:
    """One point per prompt run (eagle.metrics.PromptRun, which imports this module for its table) with a plain run
    beside it and at least one verification step."""
    points = (_point(r.spec.mean_accept_length, len(r.spec.tokens), r.spec.total_time,
                     len(r.plain.tokens), r.plain.total_time) for r in runs if r.plain is not None)
    return [p for p in points if p is not None]


def record_points(records: Sequence[dict[str, Any]]) -> list[Point]:
    """The same from a report's ``prompts`` records (so that reports written before this model can be fitted)."""
    points = (_point(rec.get("acceptance_length_mean"), rec["new_tokens"], rec["time_s"],
                     rec["baseline_new_tokens"], rec["baseline_time_s"])
              for rec in records if rec.get("baseline_time_s") is not None)
    return [p for p in points if p is not None]


def _point(tau: float | None, tokens: int, seconds: float, plain_tokens: int, plain_seconds: float) -> Point | None:
    if not tau or not tokens or not plain_tokens or seconds <= 0 or plain_seconds <= 0:
        return None
    return tau, (seconds / tokens) / (plain_seconds / plain_tokens), plain_seconds


def fit_speed_model(points: Sequence[Point], top_tau: float | None,
                    goals: Sequence[float] = GOALS) -> dict[str, Any] | None:
    """The weighted line ``r = a + b / tau`` through ``points`` and what follows from it (module docstring);
    None with fewer than MIN_PROMPTS points or when every prompt has the same tau."""
    if len(points) < MIN_PROMPTS:
        return None
    xs, ys, ws = [1.0 / p[0] for p in points], [p[1] for p in points], [p[2] for p in points]
    total_w = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / total_w
    my = sum(w * y for w, y in zip(ws, ys)) / total_w
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    if sxx < 1e-12 * total_w:
        return None
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx
    a = my - b * mx
    residual = sum(w * (y - a - b * x) ** 2 for w, x, y in zip(ws, xs, ys))
    total = sum(w * (y - my) ** 2 for w, y in zip(ws, ys))
    # covariance of (a, b): sigma^2 (X' W X)^-1 with sigma^2 the weighted residual variance
    sigma2 = residual / (len(points) - 2)
    cov = {"bb": sigma2 / sxx, "ab": -mx * sigma2 / sxx, "aa": sigma2 * (1.0 / total_w + mx * mx / sxx)}
    need = {f"{g:g}x": tau_for(g, a, b) for g in goals}
    se = {f"{g:g}x": _tau_se(g, a, b, cov) if need[f"{g:g}x"] is not None else None for g in goals}
    return {
        "prompts": len(points),
        "fixed_share": a,
        "step_cost": b,
        "covariance": cov,
        "r2": 1.0 - residual / total if total > 0 else None,
        "grows_with_tau": b > 0,
        "tau_range": [min(p[0] for p in points), max(p[0] for p in points)],
        "top_tau": top_tau,
        "speedup_at_top_tau": speedup_at(top_tau, a, b) if top_tau else None,
        "tau_for": need,
        "tau_for_se": se,
    }


def speedup_at(tau: float, a: float, b: float) -> float | None:
    """The speedup the line gives a head of acceptance length ``tau`` (None where the line is not positive)."""
    r = a + b / tau
    return 1.0 / r if r > 0 else None


def tau_for(goal: float, a: float, b: float) -> float | None:
    """The tau at which the line reaches ``goal``; None when no tau does (``a`` alone costs more than the goal
    allows, or the fit says speed does not grow with tau)."""
    room = 1.0 / goal - a
    if b <= 0 or room <= 0:
        return None
    return b / room


def _tau_se(goal: float, a: float, b: float, cov: dict[str, float]) -> float:
    """Standard error of ``tau_for(goal)`` from the covariance of (a, b) (first-order propagation)."""
    room = 1.0 / goal - a
    d_b, d_a = 1.0 / room, b / room**2
    return math.sqrt(max(d_b * d_b * cov["bb"] + d_a * d_a * cov["aa"] + 2 * d_a * d_b * cov["ab"], 0.0))


def describe(model: dict[str, Any] | None, drafts: str = "tau") -> str | None:
    """One line for the console: the ``drafts`` tau (say "tree tau" or "chain tau") each goal needs here, and the
    speedup if the longest path were accepted every step."""
    if not model:
        return None
    fit = f"fit over {model['prompts']} prompts, R^2 {'-' if model['r2'] is None else format(model['r2'], '.2f')}"
    if not model["grows_with_tau"]:
        return f"speed against tau here ({fit}): no line, speed does not grow with tau in this run"
    parts = []
    for goal in sorted(model["tau_for"], key=lambda g: -float(g[:-1])):
        value, se, top = model["tau_for"][goal], model["tau_for_se"][goal], model["top_tau"]
        name = "break-even" if goal == "1x" else goal
        reach = value is not None and (top is None or value <= top)
        parts.append(f"{name} {drafts} {value:.2f} ± {se:.2f}" if reach else f"{name} out of reach")
    text = f"speed against tau here ({fit}): " + ", ".join(parts)
    if model["speedup_at_top_tau"]:
        text += f"; the longest path accepted every step (tau {model['top_tau']:g}): {model['speedup_at_top_tau']:.2f}x"
    return text
