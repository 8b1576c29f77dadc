"""Refereeing a greedy difference: near-tie of the target's logits (numerics) or a token it does not choose (bug)."""

from __future__ import annotations

import pytest
import torch

from eagle.exactness import NEAR_TIE_RTOL, diagnose_mismatch, first_mismatch, mismatch_note, mismatch_summary
from eagle.speculate import plain_generate
from eagle.testing import tiny_model

PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3, vocab_size=128, hidden_size=32, num_layers=2)


@pytest.fixture(scope="module")
def greedy(model):
    return plain_generate(model, torch.tensor([PROMPT]), 10, temperature=0.0).tokens


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
