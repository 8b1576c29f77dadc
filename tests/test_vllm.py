"""vLLM serving our exports (needs vLLM: `make setup-vllm`; part of `make test`).

A head trained here against the embedded SmolLM2 (tests/conftest.py ``smollm2_head``) is exported and served
by vLLM: vLLM accepts its drafts, its speculative output equals its plain output in float32, its per-position
acceptance agrees with our own loop's (parity), an export with its aux layer ids shifted by one fails parity,
and vLLM can write a prepare stage's answers.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from eagle.vllm_engine import vllm_version

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_version() is None, reason="vLLM is not installed (make setup-vllm)"),
]
PROMPTS = 20  # per set: 40 prompts x 32 new tokens (the paired parity check counts prompts)


@pytest.fixture(scope="module")
def eval_cfg(smollm2_head, tmp_path_factory):
    from eagle.evaluate import EvalConfig
    from eagle.vllm_engine import VllmConfig

    out = tmp_path_factory.mktemp("vllm-eval")
    fast_start = VllmConfig(enforce_eager=True, kv_cache_gb=1)  # no compilation: engines start in ~30 s
    return EvalConfig(draft=smollm2_head.export.output_dir, prompts=["dev-chat", "dev-code"], max_prompts=PROMPTS,
                      max_new_tokens=32, report=str(out / "report.json"), prompt_lookup=False, warmup=1,
                      vllm=fast_start)


@pytest.fixture(scope="module")
def vllm_fp32(eval_cfg):
    from eagle.vllm_eval import evaluate_vllm

    swept = replace(eval_cfg, vllm=replace(eval_cfg.vllm, batch_sizes=[4]))  # and in groups of 4 requests
    return evaluate_vllm(swept, "smollm2-135m-instruct", "float32")


@pytest.fixture(scope="module")
def hf_fp32(eval_cfg):
    """Our loop on the same prompts, drafting a chain as long as vLLM's, the head in float32 like the target."""
    from eagle.evaluate import evaluate
    from eagle.targets import load_target
    from eagle.tree import TreeConfig

    k = eval_cfg.vllm.num_speculative_tokens
    target = load_target("smollm2-135m-instruct")
    cfg = replace(eval_cfg, tree=TreeConfig("chain", depth=k, lookup_ngram=0), chain_depth=k, draft_dtype=None,
                  baseline=False, report=eval_cfg.report.replace("report.json", "hf.json"))
    return evaluate(cfg, target)


def test_vllm_serves_the_export_and_matches_plain_decoding_in_fp32(vllm_fp32):
    overall = vllm_fp32["overall"]
    assert vllm_fp32["engine"] == "vllm" and vllm_fp32["method"] == "eagle3"
    assert overall["num_prompts"] == 2 * PROMPTS
    assert overall["greedy_match_rate"] == 1.0, vllm_fp32["greedy_mismatches"]
    assert overall["per_depth_acceptance"][0] > 0.05  # vLLM accepted the head's drafts
    assert overall["acceptance_length_mean"] > 1.0
    assert vllm_fp32["engine_counts"]["drafts"] > 0  # vLLM's own engine counters saw them too
    assert vllm_fp32["batched"]["greedy_match_rate"] == 1.0
    for rec in vllm_fp32["prompts"]:
        assert rec["first_mismatch"] is None
    model = vllm_fp32["speed_model"]  # what tau a speedup needs on this machine, from the same prompts
    assert model["prompts"] == 2 * PROMPTS and model["top_tau"] == vllm_fp32["settings"]["num_speculative_tokens"] + 1
    assert set(model["tau_for"]) == {"1x", "1.5x", "2x"}
    sweep = vllm_fp32["batch_sweep"]  # tokens/s with and without the head by concurrent requests
    assert [r["batch_size"] for r in sweep["rows"]] == [1, 4]
    assert [r["requests"] for r in sweep["rows"]] == [2 * PROMPTS] * 2
    assert all(r["greedy_match_rate"] == 1.0 and r["tokens_per_second"] > 0 for r in sweep["rows"])
    assert all(r["draft_tokens_per_token"] > 0 for r in sweep["rows"])  # vLLM's per-request draft counts


def test_vllm_follows_the_batch_schedule_we_write(eval_cfg):
    """Our ``num_speculative_tokens_per_batch_size`` (head on at batch 1, off from 2): vLLM drafts for requests
    one at a time, (almost) none for four at once, and the output is the same either way."""
    from eagle.prompts import load_prompt_sets
    from eagle.targets import load_tokenizer, resolve_target
    from eagle.vllm_engine import EngineSpec, Job, run_job

    target = resolve_target("smollm2-135m-instruct")
    (_, chat), = load_prompt_sets(["dev-chat"], load_tokenizer(target), 4)
    prompts = [ids for _, ids in chat]
    engine = EngineSpec("scheduled", eval_cfg.draft, 3, batch_schedule=[[1, 1, 3], [2, 1024, 0]])
    job = Job(kind="decode", target=target, dtype="float32", engines=[engine], prompts=prompts, max_new_tokens=24,
              stop_token_ids=[], max_model_len=1024, vllm=eval_cfg.vllm)
    result = run_job(job, "schedule test")["engines"]["scheduled"]
    assert result["single_counts"]["drafts"] > 0  # one request at a time: the head drafts
    # four at once: it does not (but for a step or two run before the other requests reached the engine)
    assert result["batched"]["counts"]["drafts"] <= 2 < result["single_counts"]["drafts"] / 4
    assert [r["tokens"] for r in result["batched"]["requests"]] == [r["tokens"] for r in result["single"]]
    # the per-request counts the batch sweep reports (drafted tokens per token) show the same
    single = sum(r["num_draft_tokens"] for r in result["single"])
    batched = sum(r["num_draft_tokens"] for r in result["batched"]["requests"])
    assert batched <= 2 * 3 < single / 4


def test_parity_with_our_loop_and_a_broken_export_fails_it(eval_cfg, vllm_fp32, hf_fp32, tmp_path):
    from eagle.vllm_eval import SUSPECT_FIELDS, evaluate_vllm, parity, parity_message

    good = parity(hf_fp32, vllm_fp32)
    assert good["ok"], good
    assert good["positions"][0]["hf"] > 0.05
    # in float32 both engines decode the same text with the same drafts: acceptance agrees closely
    assert abs(good["hf_tau"] - good["vllm_tau"]) < 0.15, good

    broken = tmp_path / "broken-export"
    shutil.copytree(eval_cfg.draft, broken)
    config = json.loads((broken / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (broken / "config.json").write_text(json.dumps(config))
    bad_report = evaluate_vllm(replace(eval_cfg, draft=str(broken), report=str(tmp_path / "bad.json"), baseline=False),
                               "smollm2-135m-instruct", "float32")
    bad = parity(hf_fp32, bad_report)
    assert not bad["ok"], bad
    message = parity_message(bad, str(broken))
    assert SUSPECT_FIELDS[0] in message


def test_vllm_writes_the_answers_of_prepare(tmp_path, monkeypatch):
    from eagle.vllm_engine import VllmConfig
    from train.prepare import DataConfig, prepare
    from train.regenerate import read_partial

    cfg = DataConfig(sources=["chitchat:6"], max_conversations=6, regenerate=True, regen_engine="vllm",
                     regen_max_new_tokens=24, regen_batch_size=4, max_length=256, output_dir=str(tmp_path / "data"),
                     vllm=VllmConfig(enforce_eager=True, kv_cache_gb=1))
    summary = prepare(cfg, "smollm2-135m-instruct")
    assert summary["counts"]["train"] + summary["counts"]["val"] == 6
    partial = next((tmp_path / "data").glob("regen-*.jsonl"))
    answers = read_partial(partial)
    assert len(answers) == 6 and all(text.strip() for text in answers.values())
    # a second prepare with other split settings reuses the answers: vLLM is not started again
    import eagle.vllm_engine as engine

    monkeypatch.setattr(engine, "start_worker", lambda *a, **k: pytest.fail("vLLM started again"))
    again = prepare(replace(cfg, val_fraction=0.5), "smollm2-135m-instruct")
    assert again["counts"]["val"] == 3
