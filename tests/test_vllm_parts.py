"""The parts of the vLLM integration that need no vLLM: counts, parity arithmetic, configs, answer files."""

from __future__ import annotations

import json

import pytest

from eagle.batch_schedule import MAX_BATCH, fit_schedule, sweep_row
from eagle.batch_schedule import describe as describe_sweep
from eagle.errors import EagleError
from eagle.vllm_engine import VllmConfig, accepted_per_position, merge_parts, speculative_config
from eagle.vllm_eval import SUSPECT_FIELDS, _batch_sweep, parity, parity_message


def _reports(hf: list[int], hf_steps: int, vllm: list[int], vllm_steps: int,
             hf_taus: tuple[float, ...] = (), vllm_taus: tuple[float, ...] = ()) -> tuple[dict, dict]:
    hf_report = {"overall": {"chain_accepted_per_depth": hf, "chain_target_forwards": hf_steps,
                             "chain_acceptance_length_mean": 1 + sum(hf) / max(hf_steps, 1)},
                 "prompts": [{"set": "s", "id": str(i), "chain_acceptance_length_mean": t}
                             for i, t in enumerate(hf_taus)]}
    vllm_report = {"overall": {"target_forwards": vllm_steps, "per_depth_acceptance": [n / vllm_steps for n in vllm],
                               "acceptance_length_mean": 1 + sum(vllm) / vllm_steps},
                   "prompts": [{"set": "s", "id": str(i), "acceptance_length_mean": t}
                               for i, t in enumerate(vllm_taus)]}
    return hf_report, vllm_report


def test_accepted_per_position_from_vllms_histogram():
    # 5 steps accepted nothing, 3 accepted one draft, 2 accepted all three
    assert accepted_per_position([5, 3, 0, 2]) == [5, 2, 2]
    assert accepted_per_position([7]) == []


def test_parity_passes_within_noise_and_fails_far_below():
    same = parity(*_reports([300, 180, 100], 600, [290, 170, 104], 590))
    assert same["ok"] and [r["ok"] for r in same["positions"]] == [True, True, True]
    # vLLM above the HF loop is never a layout bug
    assert parity(*_reports([100, 50, 20], 600, [300, 200, 100], 600))["ok"]
    broken = parity(*_reports([300, 180, 100], 600, [120, 40, 10], 600))
    assert not broken["ok"] and all(not r["ok"] for r in broken["positions"])
    message = parity_message(broken, "runs/x/export")
    assert "runs/x/export" in message and "position 1" in message
    for field in SUSPECT_FIELDS:
        assert field in message


def test_parity_tolerance_is_the_binomial_standard_error():
    # p = 0.5 on 400 steps each: SE of the difference = sqrt(0.25 * 2 / 400) = 0.0354; 4 SE = 0.141
    hf = 200
    assert parity(*_reports([hf], 400, [hf - 50], 400))["ok"]  # 0.125 below: 3.5 SE
    assert not parity(*_reports([hf], 400, [hf - 62], 400))["ok"]  # 0.155 below: 4.4 SE
    assert parity(*_reports([0], 50, [0], 50))["ok"]  # nothing accepted by either: no evidence of a bug
    with pytest.raises(EagleError, match="speculative steps"):
        parity(*_reports([0], 0, [0], 10))


def test_parity_pairs_the_prompts_both_engines_decoded():
    taus = tuple(1.5 + 0.05 * i for i in range(14))
    # the same rates overall, but vLLM lower on 12 prompts and higher on none: a subtle layout bug
    lower = tuple(t - 0.04 for t in taus[:12]) + taus[12:]
    result = parity(*_reports([300], 600, [300], 600, taus, lower))
    assert result["positions"][0]["ok"] and not result["paired"]["ok"] and not result["ok"]
    assert {k: result["paired"][k] for k in ("worse", "better", "ties", "p", "ok")} == {
        "worse": 12, "better": 0, "ties": 2, "p": 0.5**12, "ok": False}
    assert "lower tau on 12 prompts, higher on 0" in parity_message(result, "d")
    # bf16-like noise: lower on some prompts, higher on others, equal on the rest
    noisy = tuple(t + (0.03 if i % 3 == 0 else -0.03 if i % 3 == 1 else 0.0) for i, t in enumerate(taus))
    assert parity(*_reports([300], 600, [300], 600, taus, noisy))["ok"]
    # in float32 a correct export ties everywhere; ties on only half the prompts fail there, not in bf16
    hf, vllm = _reports([300], 600, [300], 600, taus, taus)
    assert parity(hf, vllm)["paired"]["agreement"] == 1.0
    hf, vllm = _reports([300], 600, [300], 600, taus, noisy)
    assert parity(hf, vllm)["ok"]
    hf["dtype"] = vllm["dtype"] = "float32"
    result = parity(hf, vllm)
    assert not result["ok"] and result["paired"]["agreement_required"] == 0.9
    assert "float32 needs the same on 90%" in parity_message(result, "d")


def test_vllm_config_is_checked_by_name():
    VllmConfig().validate()
    with pytest.raises(EagleError, match="eval.vllm.num_speculative_tokens"):
        VllmConfig(num_speculative_tokens=0).validate("eval.vllm")
    with pytest.raises(EagleError, match="data.vllm.data_parallel_size"):
        VllmConfig(data_parallel_size=0).validate("data.vllm")
    with pytest.raises(EagleError, match="kv_cache_gb"):
        VllmConfig(kv_cache_gb=0.5).validate()
    with pytest.raises(EagleError, match="eval.vllm.batch_sizes"):
        VllmConfig(batch_sizes=[1, 0]).validate("eval.vllm")


def _row(b: int, speedup: float) -> dict:
    return sweep_row(b, tokens=int(100 * speedup), seconds=1.0, base_tokens=100, base_seconds=1.0, matches=[True])


def test_batch_schedule_keeps_the_head_up_to_the_last_size_measured_faster():
    sweep = fit_schedule([_row(8, 0.8), _row(1, 1.5), _row(4, 1.05), _row(2, 1.3), _row(16, 1.2)], k=3)
    # off from the first slower size on, even if a larger one measured faster again (noise, not a regime)
    assert sweep["pays_up_to"] == 4 and sweep["first_slower"] == 8
    assert sweep["schedule"] == [[1, 4, 3], [5, MAX_BATCH, 0]]
    assert "[[1, 4, 3], [5, 1024, 0]]" in describe_sweep(sweep)
    # vLLM's own rules for the schedule: starts at 1, ranges ascending and disjoint, k >= 0
    (a, b, k_on), (c, d, k_off) = sweep["schedule"]
    assert a == 1 and a <= b < c <= d and k_on == 3 and k_off == 0
    VllmConfig(batch_schedule=sweep["schedule"]).validate()
    # measured with a schedule already: the rows check that one, no new one is fitted from them
    checked = fit_schedule([_row(1, 1.5), _row(8, 0.99)], k=3, served_with=sweep["schedule"])
    assert checked["schedule"] is None and "served with the schedule [[1, 4, 3]" in describe_sweep(checked)


@pytest.mark.parametrize("schedule, problem", [
    ([[2, 4, 3]], "start at 1"), ([[1, 4, 3], [3, 8, 0]], "overlap"), ([[1, 4, -1]], "k >= 0"),
    ([[1, 4]], "[first, last, k]"), ([], "non-empty"), ([[1, 4, 3], [6, 2, 0]], "end at or after"),
    ([[1, 4, 2], [5, 9, 0]], "must draft exactly 3"), ([[1, 4, 3], [5, 9, 4]], "none more"),
])
def test_a_batch_schedule_vllm_would_refuse_is_refused_by_name(schedule, problem):
    with pytest.raises(EagleError, match="eval.vllm.batch_schedule") as err:
        VllmConfig(batch_schedule=schedule).validate("eval.vllm")
    assert problem in str(err.value)
    VllmConfig(batch_schedule=[[1, 4, 3], [9, 16, 0]]).validate()  # vLLM carries k = 3 over the gap 5-8


def test_sweep_groups_cover_every_prompt_and_mix_the_sets():
    from eagle.vllm_worker import sweep_groups

    for n, b in ((24, 2), (24, 8), (24, 16), (40, 4), (7, 3), (5, 5)):
        groups = sweep_groups(n, b)
        assert len(groups) == -(-n // b) and all(len(set(g)) == len(g) == b for g in groups)  # b distinct each
        assert {i for g in groups for i in g} == set(range(n))  # nobody left out
    # two sets of 12 one after another: every group of 8 holds both, half and half
    assert all(sum(i < 12 for i in g) == 4 for g in sweep_groups(24, 8))


def test_a_job_with_a_sweep_and_a_schedule_survives_json():
    from eagle.vllm_engine import EngineSpec, Job

    job = Job(kind="decode", target="t", dtype="float32", engines=[EngineSpec("k3", "d", 3, [[1, 2, 3], [3, 9, 0]])],
              prompts=[[1, 2]], max_new_tokens=4, stop_token_ids=[2], max_model_len=64,
              vllm=VllmConfig(batch_sizes=[2, 4], batch_schedule=[[1, 2, 3], [3, 9, 0]]))
    assert Job.from_json(job.to_json()) == job


def test_cpu_workers_skip_the_compile_cache_vllm_cannot_load_unless_told(monkeypatch):
    import torch

    from eagle.vllm_engine import EngineSpec, Job, worker_env

    job = Job(kind="decode", target="t", dtype="float32", engines=[EngineSpec("plain")], prompts=[],
              max_new_tokens=8, stop_token_ids=[], max_model_len=64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert worker_env(job)["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the user's choice is kept
    assert worker_env(job)["VLLM_USE_AOT_COMPILE"] == "1"
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU builds keep vLLM's default
    assert "VLLM_USE_AOT_COMPILE" not in worker_env(job)


def test_a_sweep_it_cannot_fill_or_a_schedule_for_several_ks_is_refused():
    from eagle.vllm_eval import _check_batch_settings

    with pytest.raises(EagleError, match="no size from 2 to the 6 prompts"):
        _check_batch_settings(VllmConfig(batch_sizes=[1, 8]), [3], 6)
    with pytest.raises(EagleError, match="one chain length"):
        _check_batch_settings(VllmConfig(batch_schedule=[[1, 2, 3], [3, 9, 0]]), [2, 3], 6)
    _check_batch_settings(VllmConfig(batch_sizes=[1, 4], batch_schedule=[[1, 2, 3], [3, 9, 0]]), [3], 6)
    with pytest.raises(EagleError, match="eval.baseline=true"):  # a sweep measured against nothing
        _check_batch_settings(VllmConfig(batch_sizes=[1, 4]), [3], 6, baseline=False)


def test_vllm_gets_the_dtype_by_its_own_name(tmp_path, monkeypatch):
    """target.dtype=bf16 is ours; vLLM's dtype names are bfloat16 / float32 / float16."""
    import eagle.vllm_eval as V
    from eagle.evaluate import EvalConfig

    class Started(Exception):
        pass

    jobs = []

    def run_job(job, what):
        jobs.append(job)
        raise Started

    monkeypatch.setattr(V, "run_job", run_job)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    cfg = EvalConfig(draft=str(tmp_path), max_prompts=2, max_new_tokens=8, prompt_lookup=False)
    for given, name in (("bf16", "bfloat16"), (" FP32", "float32"), ("float16", "float16")):
        with pytest.raises(Started):
            V.vllm_reports(cfg, "smollm2-135m-instruct", given, [3])
        assert jobs[-1].dtype == name


def test_batch_schedule_is_none_when_the_head_always_or_never_pays():
    always = fit_schedule([_row(1, 1.4), _row(4, 1.1)], k=2)
    assert always["schedule"] is None and always["pays_up_to"] == 4 and "every batch size" in describe_sweep(always)
    never = fit_schedule([_row(1, 0.9), _row(4, 0.7)], k=2)
    assert never["schedule"] is None and never["pays_up_to"] == 0 and "slower already" in describe_sweep(never)


def test_batch_sweep_from_worker_records():
    def runs(tokens_each: int, seconds: float, n: int) -> dict:
        return {"seconds": seconds, "requests": [{"tokens": list(range(tokens_each))} for _ in range(n)]}

    single = [{"tokens": list(range(10)), "seconds": 1.0} for _ in range(4)]
    plain_single = [{"tokens": list(range(10)), "seconds": 2.0} for _ in range(4)]
    engines = {"k3": {"single": single, "sweep": {"2": runs(10, 2.0, 4), "4": runs(10, 3.0, 4)}},
               "plain": {"single": plain_single, "sweep": {"2": runs(10, 3.0, 4), "4": runs(10, 2.0, 4)}}}
    sweep = _batch_sweep(engines, "k3", 3)
    assert [r["batch_size"] for r in sweep["rows"]] == [1, 2, 4]
    assert [round(r["speedup"], 3) for r in sweep["rows"]] == [2.0, 1.5, 0.667]
    assert sweep["rows"][0]["tokens_per_second"] == 10.0 and sweep["rows"][1]["greedy_match_rate"] == 1.0
    assert sweep["schedule"] == [[1, 2, 3], [3, MAX_BATCH, 0]]
    assert all(r["draft_tokens_per_token"] is None for r in sweep["rows"])  # records without vLLM's counts
    assert _batch_sweep({"k3": engines["k3"]}, "k3", 3) is None  # no baseline, no sweep
    # with vLLM's per-request draft counts: drafted tokens per generated token, by batch size
    for rec in single:
        rec["num_draft_tokens"] = 6
    for b, drafted in (("2", 6), ("4", 0)):
        for rec in engines["k3"]["sweep"][b]["requests"]:
            rec["num_draft_tokens"] = drafted
    served = _batch_sweep(engines, "k3", 3, served_with=[[1, 2, 3], [3, MAX_BATCH, 0]])
    assert [r["draft_tokens_per_token"] for r in served["rows"]] == [0.6, 0.6, 0.0]
    assert "drafted tokens per generated token: 1: 0.60, 2: 0.60, 4: 0.00" in describe_sweep(served)


def test_a_sweep_row_without_plain_tokens_is_refused_by_name():
    """A batch size where the plain engine wrote nothing (every prompt ended at once) has no speedup: a clear
    error that says so, not a division by zero."""
    assert sweep_row(2, 30, 1.5, 20, 1.0, [True, True])["speedup"] == 1.0
    with pytest.raises(EagleError, match="plain engine generated no tokens at batch size 2"):
        sweep_row(2, 30, 1.5, 0, 1.0, [True, True])
    with pytest.raises(EagleError, match="took no time at batch size 4"):
        sweep_row(4, 30, 0.0, 20, 1.0, [True])


def test_speculative_config_carries_a_batch_schedule(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    spec = speculative_config(tmp_path, 3, [[1, 4, 3], [5, 1024, 0]])
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 1024, 0]]
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(tmp_path, 3)


def test_speculative_config_follows_the_export_layout(tmp_path):
    for layout, config, method in (
        ("eagle3", {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}, "eagle3"),
        ("eagle1", {"architectures": ["LlamaForCausalLM"]}, "eagle"),
        ("speculators", {"speculators_model_type": "eagle3"}, None),
    ):
        folder = tmp_path / layout
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        spec = speculative_config(folder, 4)
        assert spec.get("method") == method and spec["num_speculative_tokens"] == 4
        assert spec["model"] == str(folder.resolve())
    with pytest.raises(EagleError, match="eagle export"):
        speculative_config(tmp_path / "missing", 3)


def test_answer_parts_are_merged_whole_lines_only(tmp_path):
    answers = tmp_path / "regen.jsonl"
    answers.write_text('{"id": "a", "turn": 0, "content": "x"}\n{"id": "b", "tu')  # a torn line of a killed run
    (tmp_path / "regen.jsonl.part0").write_text('{"id": "c", "turn": 0, "content": "y"}\n')
    (tmp_path / "regen.jsonl.part1").write_text('{"id": "d", "turn": 0, "content": "z"}\n{"id": "e"')
    merge_parts(answers)
    lines = answers.read_text().split("\n")
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue
    assert parsed == ["a", "c", "d"]
    assert not list(tmp_path.glob("*.part*"))


def test_a_failed_parity_check_exits_with_status_1_and_names_the_fields(monkeypatch, capsys):
    import recipes.eval
    from eagle.vllm_eval import ParityError
    from recipes import cli

    def failing(cfg):
        raise ParityError("parity failed for x: check eagle_aux_hidden_state_layer_ids")

    monkeypatch.setattr(recipes.eval, "run", failing)
    assert cli.main(["eval", "--engine", "both"]) == 1
    assert "eagle_aux_hidden_state_layer_ids" in capsys.readouterr().err


def test_the_batched_line_says_when_no_step_drafted():
    """Under a served schedule a large batch may draft in no step at all: no tau then, not a tau of 0."""
    from eagle.vllm_eval import batched_line

    batched = {"num_prompts": 24, "tokens_per_second": 300.0, "baseline_tokens_per_second": 360.0, "speedup": 0.83}
    served = {"settings": {"vllm": {"batch_schedule": [[1, 2, 3], [3, 1024, 0]]}}}
    assert batched_line({}) is None
    assert batched_line({**served, "batched": {**batched, "acceptance_length_mean": None}}).endswith("no step drafted")
    line = batched_line({**served, "batched": {**batched, "acceptance_length_mean": 1.5}})
    assert "tau 1.50 over the steps that drafted" in line
    assert batched_line({"batched": {**batched, "acceptance_length_mean": 1.8}}).endswith("(0.83x), tau 1.80")
