"""Refereeing a greedy difference: near-tie of the target's logits (numerics) or a token it does not choose (bug)."""

from __future__ import annotations

import pytest
import torch

from eagle.exactness import NEAR_TIE_RTOL, diagnose_mismatch, first_mismatch, mismatch_note, mismatch_summary
from eagle.sampling import Sampling
from eagle.speculate import plain_generate
from eagle.testing import tiny_model

PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3, vocab_size=128, hidden_size=32, num_layers=2)


@pytest.fixture(scope="module")
def greedy(model):
    return plain_generate(model, torch.tensor([PROMPT]), 10, sampling=Sampling(temperature=0.0)).tokens


def _logits_after(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    assert first_mismatch([], []) is None


def test_equal_outputs_need_no_referee(model, greedy):
    assert diagnose_mismatch(model, PROMPT, greedy, list(greedy)) is None


def test_gap_is_the_targets_logit_difference_at_the_first_difference(model, greedy):
    j = 4
    logits = _logits_after(model, PROMPT + greedy[:j])
    assert int(logits.argmax()) == greedy[j]
    runner_up = int(logits.topk(2).indices[1])
    spec = greedy[:j] + [runner_up] + greedy[j + 1 :]
    d = diagnose_mismatch(model, PROMPT, greedy, spec)
    assert d["position"] == j and d["plain_token"] == greedy[j] and d["spec_token"] == runner_up
    assert d["logit_gap"] == pytest.approx(float(logits[greedy[j]] - logits[runner_up]), abs=1e-5)
    assert d["logit_gap"] > 0 and d["top_logit"] == pytest.approx(float(logits.max()), abs=1e-5)
    assert d["tolerance"] == pytest.approx(NEAR_TIE_RTOL[torch.float32] * abs(d["top_logit"]))
    assert d["near_tie"] == (abs(d["logit_gap"]) <= d["tolerance"])


def test_a_token_the_target_ranks_last_is_not_a_near_tie(model, greedy):
    j = 2
    worst = int(_logits_after(model, PROMPT + greedy[:j]).argmin())
    spec = greedy[:j] + [worst]
    d = diagnose_mismatch(model, PROMPT, greedy, spec)
    assert d["near_tie"] is False and d["logit_gap"] > d["tolerance"] > 0
    summary = mismatch_summary([None, d, None], torch.float32)
    assert summary["mismatched"] == 1 and summary["not_near_ties"] == 1 and summary["near_ties"] == 0
    note = mismatch_note(summary)
    assert "greedy match 2/3" in note and "NOT near-ties" in note and "bug" in note


def test_an_exact_tie_in_bf16_is_a_near_tie(greedy):
    # a bf16 target whose lm_head gives a second token exactly the plain token's logit at position j
    model = tiny_model("llama", seed=3, vocab_size=128, hidden_size=32, num_layers=2)
    j = 3
    other = (greedy[j] + 1) % 128
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    model.lm_head.weight[other] = model.lm_head.weight[greedy[j]]
    model.to(torch.bfloat16)
    spec = greedy[:j] + [other]
    d = diagnose_mismatch(model, PROMPT, greedy, spec)
    assert d["logit_gap"] == 0.0 and d["near_tie"] is True
    assert d["tolerance"] == pytest.approx(NEAR_TIE_RTOL[torch.bfloat16] * abs(d["top_logit"]))
    summary = mismatch_summary([d, None], torch.bfloat16)
    assert summary == {
        "prompts": 2,
        "mismatched": 1,
        "near_ties": 1,
        "not_near_ties": 0,
        "length_only": 0,
        "largest_logit_gap": 0.0,
        "near_tie_rtol": NEAR_TIE_RTOL[torch.bfloat16],
        "dtype": "bfloat16",
    }
    note = mismatch_note(summary)
    assert "greedy match 1/2" in note and "near-tie" in note and "bfloat16" in note and "float32" in note


def test_a_length_only_difference_is_flagged(model, greedy):
    d = diagnose_mismatch(model, PROMPT, greedy, greedy[:5])
    assert d["position"] == 5 and d["spec_token"] is None and d["near_tie"] is None
    note = mismatch_note(mismatch_summary([d], torch.float32))
    assert "different length" in note and "bug" in note


def test_no_note_when_everything_matched():
    assert mismatch_note(mismatch_summary([None, None], torch.float32)) is None


# ------------------------------------------------------------------- the referee judged on real decoding runs


@pytest.mark.slow
def test_a_real_bf16_difference_is_refereed_a_near_tie(smollm2_head):
    """SmolLM2 in bf16: a tree verification rounds differently from a one-token step, and somewhere on the dev
    prompts the texts part. The referee must call that a near-tie (it is one: fp32 decoding matches everywhere,
    tests/test_smollm2_lossless.py)."""
    from eagle.drafter import HeadDrafter
    from eagle.export import load_exported_head
    from eagle.prompts import load_prompts, prompt_token_ids
    from eagle.speculate import speculative_generate
    from eagle.targets import load_target
    from eagle.tree import TreeConfig

    target = load_target("smollm2-135m-instruct", dtype="bfloat16")
    head = load_exported_head(smollm2_head.export.output_dir, target, dtype=torch.bfloat16)
    sampling = Sampling(eos_token_ids=(target.tokenizer.eos_token_id,))
    tree = TreeConfig("dynamic", depth=4, top_k=4, total_tokens=16)
    verdicts = []
    for row in load_prompts("dev-chat")[:10] + load_prompts("dev-code")[:10]:
        ids = prompt_token_ids(row, target.tokenizer)
        plain = plain_generate(target.model, torch.tensor([ids]), 64, sampling).tokens
        spec = speculative_generate(target.model, HeadDrafter(head), torch.tensor([ids]), 64, tree, sampling).tokens
        verdict = diagnose_mismatch(target.model, ids, plain, spec)
        if verdict is not None:
            verdicts.append(verdict)
        if len(verdicts) >= 2:
            break
    assert verdicts, "no bf16 difference on 20 prompts: the test would pass vacuously"
    assert all(v["near_tie"] is True for v in verdicts), verdicts


def _rows_off_by_one(monkeypatch) -> None:
    """Plant a bug: verification reads each tree node's logits from the next node's row (an index off by one),
    so the loop emits tokens the target does not rank first."""
    import eagle.speculate as S
    from eagle.verify import LazyRows

    real = S.node_logits

    def planted(out, logit_map, tree, kept):
        rows = real(out, logit_map, tree, kept)
        return LazyRows(lambda node: rows[min(int(node) + 1, tree.size - 1)])

    monkeypatch.setattr(S, "node_logits", planted)


@pytest.mark.parametrize("plant", [False, True], ids=["as-is", "logit-rows-off-by-one"])
def test_eagle_eval_calls_a_planted_bug_a_bug_in_its_report_and_exit_status(tmp_path, tiny_target_folder,
                                                                          monkeypatch, plant):
    """``eagle eval`` on a tiny target with a random head: as it is, every output matches plain decoding (exit
    0); with verification reading each node's logits one row off, the referee finds differences that are not
    near-ties, the report says so and the command exits with status 1."""
    import json

    from eagle.export import export_head
    from eagle.heads import HeadConfig, build_head
    from eagle.targets import load_target
    from recipes.cli import main

    target = load_target(str(tiny_target_folder))
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(target.config, "eagle3", draft_vocab_size=512,
                                             target_name=target.name, target_fingerprint=target.fingerprint))
    export = export_head(head, tmp_path / "export", dtype="float32", target=target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"Count from {i} to {i + 9}:"}) + "\n"
                               for i in range(4)))
    if plant:
        _rows_off_by_one(monkeypatch)
    report = tmp_path / "eval" / "report.json"
    status = main(["eval", "--target", str(tiny_target_folder), "--draft", str(export), "--prompts", str(prompts),
                   "--max-new-tokens", "12", "--out", str(report), f"run_dir={tmp_path}", "eval.warmup=0",
                   "eval.prompt_lookup=false", "eval.chain_depth=0", "eval.draft_dtype=float32",
                   "eval.tree.policy=chain", "eval.tree.depth=3", "eval.cpu_prepack=false"])
    verdict = json.loads(report.read_text())["greedy_mismatches"]
    if plant:
        assert status == 1 and verdict["not_near_ties"] >= 1, verdict
    else:
        assert status == 0 and verdict["mismatched"] == 0, verdict
