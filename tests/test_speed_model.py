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
    model = fit_speed_model(speed_points(runs), top_tau=4)
    plain_request = 0.3 + 96 * 0.025
    # r = prefill / plain request + (spec step / plain step) * (96 * plain step / plain request) / tau
    assert model["fixed_share"] == pytest.approx(0.3 / plain_request, rel=1e-6)
    assert model["step_cost"] == pytest.approx(0.04 * 96 / plain_request, rel=1e-6)
    assert model["r2"] == pytest.approx(1.0)
    assert model["prompts"] == 10 and model["tau_range"] == [pytest.approx(96 / 80), 4.0]
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
    reachable = describe(fit_speed_model(speed_points(_runs()), top_tau=4), "chain tau")
    assert "2x chain tau 3.66 ± 0.00" in reachable and "break-even chain tau 1.60 ± 0.00" in reachable
    model = fit_speed_model(speed_points(_runs(spec_step=0.05)), top_tau=4)
    assert model["tau_for"]["2x"] > 4  # slower speculative steps: even a perfect chain of 3 is too slow
    text = describe(model, "chain tau")
    assert "2x out of reach" in text and "1.5x chain tau" in text and "accepted every step (tau 4)" in text
    assert f"{model['speedup_at_top_tau']:.2f}x" in text and model["speedup_at_top_tau"] < 2


def test_a_noisy_fit_carries_its_error_and_a_falling_one_names_no_tau():
    runs = _runs()
    for i, run in enumerate(runs):  # +-3% on every other prompt's speculative time
        run.spec.total_time *= 1.03 if i % 2 else 0.97
    model = fit_speed_model(speed_points(runs), top_tau=4)
    assert 0 < model["r2"] < 1 and model["tau_for_se"]["2x"] > 0.01
    for run in runs:  # faster where tau is lower: a run where speed falls with tau
        run.spec.total_time = run.spec.mean_accept_length
    falling = fit_speed_model(speed_points(runs), top_tau=4)
    assert not falling["grows_with_tau"] and falling["tau_for"]["2x"] is None
    assert "speed does not grow with tau" in describe(falling)


def test_long_requests_weigh_more_so_the_line_gives_back_the_pooled_speedup():
    runs = _runs()
    for run in runs[::3]:  # a third of the prompts stop early: 8 tokens, mostly prefill
        for r, steps in ((run.spec, max(1, round(8 / run.spec.mean_accept_length))), (run.plain, 8)):
            r.total_time = 0.3 + steps * (0.04 if r is run.spec else 0.025)
            r.tokens = r.tokens[:8]
            r.accept_lengths = [8 // steps + (1 if j < 8 % steps else 0) for j in range(steps)]
    model = fit_speed_model(speed_points(runs), top_tau=4)
    pooled_tau = sum(len(r.spec.tokens) for r in runs) / sum(len(r.spec.accept_lengths) for r in runs)
    pooled_speedup = sum(r.plain.total_time for r in runs) / sum(r.spec.total_time for r in runs)
    assert speedup_at(pooled_tau, model["fixed_share"], model["step_cost"]) == pytest.approx(pooled_speedup, rel=0.02)


def test_report_records_give_the_same_fit_as_the_runs():
    runs = _runs()
    from_runs = fit_speed_model(speed_points(runs), top_tau=4)
    from_records = fit_speed_model(record_points([prompt_record(r) for r in runs]), top_tau=4)
    for key in ("fixed_share", "step_cost", "r2", "speedup_at_top_tau"):
        assert from_records[key] == pytest.approx(from_runs[key])
    assert from_records["tau_for"] == pytest.approx(from_runs["tau_for"])


def test_too_few_prompts_or_one_tau_fit_nothing():
    assert fit_speed_model(speed_points(_runs()[:7]), top_tau=4) is None
    same = [_run(i, 2.0, 0.3, 0.025, 0.04) for i in range(10)]
    assert fit_speed_model(speed_points(same), top_tau=4) is None
    assert describe(None) is None
    without_plain = [PromptRun("set", "x", 5, r.spec) for r in _runs()]
    assert speed_points(without_plain) == []


def test_the_script_fits_written_reports_up_to_the_deepest_path_of_their_tree():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "speed_model.py"
    spec = importlib.util.spec_from_file_location("speed_model_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script._top_tau({"policy": "chain", "depth": 3, "tree_tokens": 4}) == 4  # a vLLM report
    assert script._top_tau({"policy": "static", "depth": 5, "static_paths": [[0], [0, 0], [1]]}) == 3
    assert script._top_tau({"policy": "dynamic", "depth": 5, "top_k": 4, "total_tokens": 12, "lookup_ngram": 3,
                            "lookup_tokens": 10}) == 11  # the lookup branch is the longest path
    runs = _runs()
    report = {"tree": {"policy": "chain", "depth": 3}, "prompts": [prompt_record(r) for r in runs],
              "overall": {"acceptance_length_mean": 2.0, "speedup": 1.3, "baseline_tokens_per_second": 40.0}}
    row = script.fit_row("r", report)
    assert row["top_tau"] == 4 and row["tau_for"]["2x"] == pytest.approx(
        fit_speed_model(speed_points(runs), top_tau=4)["tau_for"]["2x"])
    assert "r " in script._print([row])
