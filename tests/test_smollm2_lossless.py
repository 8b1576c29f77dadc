"""Losslessness on the real embedded target (SmolLM2-135M-Instruct, fp32, CPU) and real dev prompts.

Verifying several tokens in one forward can round differently from one-token decoding and flip a near-tie, so
equality is checked on the real model, not only on tiny random ones: at the two easy extremes (an untrained head
that accepts almost nothing, an oracle that accepts everything), and with the head of tests/conftest.py
``smollm2_head`` (trained for a couple of minutes), which accepts some drafts and rejects others, so that
verification stops part-way through real trees, accepts through later siblings and grafted lookup branches, and
the KV cache keeps paths that are not the first nodes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eagle.drafter import HeadDrafter, OracleDrafter
from eagle.export import load_exported_head
from eagle.heads import HeadConfig, build_head
from eagle.prompts import load_prompts, prompt_token_ids
from eagle.sampling import Sampling
from eagle.speculate import speculative_generate
from eagle.targets import load_target
from eagle.tree import TreeConfig

N_NEW = 32
N_PARTIAL = 64
TREES = {
    "chain": TreeConfig("chain", depth=4),
    "static": TreeConfig("static", static_paths=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": TreeConfig("dynamic", depth=4, top_k=3, total_tokens=12),
}


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m-instruct")


def _greedy_cases(target, rows: list[dict], n_new: int) -> list[tuple[torch.Tensor, list[int]]]:
    """(prompt ids rendered with the chat template, ``generate``'s greedy continuation) per prompt row."""
    eos = target.tokenizer.eos_token_id
    out = []
    for row in rows:
        ids = torch.tensor([prompt_token_ids(row, target.tokenizer)])
        gen = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                    do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out.append((ids, gen[0, ids.shape[1]:].tolist()))
    return out


@pytest.fixture(scope="module")
def cases(smollm2):
    """One chat and one code prompt of the public development set."""
    return _greedy_cases(smollm2, load_prompts("dev-chat")[:1] + load_prompts("dev-code")[:1], N_NEW)


@pytest.fixture(scope="module")
def partial_cases(smollm2):
    """Five chat and five code prompts, 64 new tokens."""
    return _greedy_cases(smollm2, load_prompts("dev-chat")[20:25] + load_prompts("dev-code")[20:25], N_PARTIAL)


def _untrained_head(target):
    torch.manual_seed(0)
    cfg = HeadConfig.from_target(target.config, kind="eagle3", draft_vocab_size=4096,
                                 target_name=target.name, target_fingerprint=target.fingerprint)
    return build_head(cfg).attach_target(target.model)


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(TREES))
def test_speculative_greedy_equals_generate_on_smollm2(smollm2, cases, policy):
    eos = [smollm2.tokenizer.eos_token_id]
    for i, (ids, ref) in enumerate(cases):
        res = speculative_generate(smollm2.model, HeadDrafter(_untrained_head(smollm2)), ids, N_NEW,
                                   TREES[policy], sampling=Sampling(eos_token_ids=eos))
        assert res.tokens == ref
        if i:  # the oracle recomputes every sequence without a cache (slow): one prompt shows full acceptance
            continue
        oracle = speculative_generate(smollm2.model, OracleDrafter(smollm2.model), ids, N_NEW,
                                      TREES[policy], sampling=Sampling(eos_token_ids=eos))
        assert oracle.tokens == ref
        # the oracle's drafts are the target's own greedy choices: every full step accepts depth + 1 tokens
        depth = max(len(p) for p in TREES[policy].static_paths) if policy == "static" else TREES[policy].depth
        assert all(a == depth + 1 for a in oracle.accept_lengths[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("lookup", [0, 3], ids=["no-lookup", "lookup"])
@pytest.mark.parametrize("policy", list(TREES))
def test_partial_acceptance_keeps_the_greedy_output(smollm2, smollm2_head, partial_cases, policy, lookup):
    head = load_exported_head(smollm2_head.export.output_dir, smollm2, dtype=torch.float32)
    tree = dataclasses.replace(TREES[policy], lookup_ngram=lookup, lookup_tokens=6 if lookup else 0)
    deep = rejected = 0
    for ids, reference in partial_cases:
        res = speculative_generate(smollm2.model, HeadDrafter(head), ids, N_PARTIAL, tree,
                                   sampling=Sampling(eos_token_ids=[smollm2.tokenizer.eos_token_id]))
        assert res.tokens == reference
        deep += sum(res.accepted_per_depth[1:])  # drafts accepted at depth 2 or deeper
        rejected += sum(1 for n in res.accept_lengths[:-1] if n - 1 < len(res.accepted_per_depth))
    assert deep > 0, "no draft was accepted at depth >= 2: the test would pass vacuously"
    assert rejected > 0, "every step accepted a whole path: the test would pass vacuously"
