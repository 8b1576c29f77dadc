"""Losslessness on the real embedded target (SmolLM2-135M-Instruct, fp32, CPU) and real dev prompts.

Verifying several tokens in one forward can round differently from one-token decoding and flip a near-tie, so
equality is checked on the real model, not only on tiny random ones.
"""

from __future__ import annotations

import pytest
import torch

from eagle.drafter import HeadDrafter, OracleDrafter
from eagle.evaluate import prompt_token_ids
from eagle.heads import HeadConfig, build_head
from eagle.speculate import speculative_generate
from eagle.targets import load_target
from eagle.tree import TreeConfig
from train.sources import load_prompts

N_NEW = 32
TREES = {
    "chain": TreeConfig("chain", depth=4),
    "static": TreeConfig("static", static_paths=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": TreeConfig("dynamic", depth=4, top_k=3, total_tokens=12),
}


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(smollm2):
    """One chat and one code prompt of the public development set, rendered with the chat template."""
    rows = load_prompts("dev-chat")[:1] + load_prompts("dev-code")[:1]
    return [torch.tensor([prompt_token_ids(r, smollm2.tokenizer)]) for r in rows]


@pytest.fixture(scope="module")
def references(smollm2, prompts):
    eos = smollm2.tokenizer.eos_token_id
    out = []
    for ids in prompts:
        gen = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                                     do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _untrained_head(target):
    torch.manual_seed(0)
    cfg = HeadConfig.from_target(target.config, kind="eagle3", draft_vocab_size=4096,
                                 target_name=target.name, target_fingerprint=target.fingerprint)
    return build_head(cfg).attach_target(target.model)


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(TREES))
def test_speculative_greedy_equals_generate_on_smollm2(smollm2, prompts, references, policy):
    eos = [smollm2.tokenizer.eos_token_id]
    for ids, ref in zip(prompts, references):
        res = speculative_generate(smollm2.model, HeadDrafter(_untrained_head(smollm2)), ids, N_NEW,
                                   TREES[policy], eos_token_ids=eos)
        assert res.tokens == ref
        oracle = speculative_generate(smollm2.model, OracleDrafter(smollm2.model), ids, N_NEW,
                                      TREES[policy], eos_token_ids=eos)
        assert oracle.tokens == ref
        # the oracle's drafts are the target's own greedy choices: every full step accepts depth + 1 tokens
        depth = max(len(p) for p in TREES[policy].static_paths) if policy == "static" else TREES[policy].depth
        assert all(a == depth + 1 for a in oracle.accept_lengths[:-1])
