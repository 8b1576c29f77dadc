"""The speed model: which tau a speedup needs, fitted on an evaluation's prompts (eagle.speed_model)."""

from __future__ import annotations

import pytest

from eagle.metrics import PromptRun, prompt_record
from eagle.speculate import GenerationResult
from eagle.speed_model import (
    describe,
    fit_speed_model,
    record_points,
    speed_points,
    speedup_at,
    tau_for,
)


def _run(i: int, tau: float, prefill: float, plain_step: float, spec_step: float, n: int = 96) -> PromptRun:
    """A prompt whose times follow the model: prefill once, then n tokens one plain step (or n / tau speculative
    steps) each."""
    steps = round(n / tau)
    accepted = [n // steps + (1 if j < n % steps else 0) for j in range(steps)]  # n tokens in all
    spec = GenerationResult(tokens=list(range(n)), accept_lengths=accepted, target_forwards=steps,
                            total_time=prefill + steps * spec_step)
    plain = GenerationResult(tokens=list(range(n)), accept_lengths=[1] * n, target_forwards=n,
                             total_time=prefill + n * plain_step)
    return PromptRun("set", str(i), 50, spec, plain)


def _runs(spec_step: float = 0.04, prefill: float = 0.3) -> list[PromptRun]:
    taus = [1.2, 1.5, 1.8, 2.0, 2.4, 2.7, 3.0, 3.3, 3.7, 4.0]
    return [_run(i, tau, prefill, 0.025, spec_step) for i, tau in enumerate(taus)]


def test_the_fit_recovers_the_costs_the_times_were_made_from():
    runs = _runs()
    model = fit_speed_model(speed_points(runs), max_tau=4)
    plain_request = 0.3 + 96 * 0.025
    # r = prefill / plain request + (spec step / plain step) * (96 * plain step / plain request) / tau
    assert model["fixed_share"] == pytest.approx(0.3 / plain_request, rel=1e-6)
    assert model["step_cost"] == pytest.approx(0.04 * 96 / plain_request, rel=1e-6)
    assert model["r2"] == pytest.approx(1.0)
    assert model["prompts"] == 10
    # the model's speedup at each prompt's tau is that prompt's measured speedup
    for run in runs:
        measured = (run.plain.total_time / 96) / (run.spec.total_time / 96)
        assert speedup_at(run.spec.mean_accept_length, model["fixed_share"], model["step_cost"]) == \
            pytest.approx(measured, rel=1e-6)


def test_the_tau_a_goal_needs_gives_that_goal_and_unreachable_goals_say_so():
    a, b = 0.12, 1.15
    for goal in (1.0, 1.5, 2.0):
        assert speedup_at(tau_for(goal, a, b), a, b) == pytest.approx(goal)
    assert tau_for(1 / 0.12 + 1, a, b) is None  # the per-request share alone costs more than the goal allows
    assert tau_for(2.0, a, -0.1) is None  # a fit in which speed falls with tau names no tau
    model = fit_speed_model(speed_points(_runs(spec_step=0.05)), max_tau=4)
    assert model["tau_for"]["2x"] > 4  # slower speculative steps: even a perfect chain of 3 is too slow
    text = describe(model)
    assert "2x needs out of reach" in text and "would give" in text
    assert f"{model['speedup_at_max_tau']:.2f}x" in text and model["speedup_at_max_tau"] < 2


def test_report_records_give_the_same_fit_as_the_runs():
    runs = _runs()
    from_runs = fit_speed_model(speed_points(runs), max_tau=4)
    from_records = fit_speed_model(record_points([prompt_record(r) for r in runs]), max_tau=4)
    for key in ("fixed_share", "step_cost", "r2", "speedup_at_max_tau"):
        assert from_records[key] == pytest.approx(from_runs[key])
    assert from_records["tau_for"] == pytest.approx(from_runs["tau_for"])


def test_too_few_prompts_or_one_tau_fit_nothing():
    assert fit_speed_model(speed_points(_runs()[:7]), max_tau=4) is None
    same = [_run(i, 2.0, 0.3, 0.025, 0.04) for i in range(10)]
    assert fit_speed_model(speed_points(same), max_tau=4) is None
    assert describe(None) is None
    without_plain = [PromptRun("set", "x", 5, r.spec) for r in _runs()]
    assert speed_points(without_plain) == []
