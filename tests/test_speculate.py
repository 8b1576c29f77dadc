"""Speculative generation on tiny random targets: greedy equality with HF generate, the oracle drafter's
acceptance, cache gathering, the head drafter's bookkeeping, stopping rules."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from eagle.attention import register as register_gqa_attention
from eagle.cache import cache_length, crop_cache, gather_cache
from eagle.drafter import HeadDrafter, OracleDrafter
from eagle.errors import EagleError
from eagle.heads import HeadCache, HeadConfig, build_head
from eagle.sampling import Sampling
from eagle.speculate import GenerationResult, plain_generate, speculative_generate, tree_attention_mask
from eagle.targets import cache_kwarg
from eagle.testing import FAMILIES, NoisyOracle, tiny_config
from eagle.tree import TreeConfig, tree_from_parents

N_NEW = 24
T = 10
TREES = {
    "chain": TreeConfig("chain", depth=4),
    "static": TreeConfig(
        "static", static_paths=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    ),
    "dynamic": TreeConfig("dynamic", depth=4, top_k=3, total_tokens=12),
}


@cache
def target(name: str) -> torch.nn.Module:
    """Tiny random targets: the three families, plus sliding-window variants, an sdpa one and "+gqa" ones.

    Built like ``eagle.testing.tiny_model`` but with 10x larger random weights: with the default init, attention
    is nearly uniform and a wrong position id or mask rarely changes a greedy token, so tests could not see it.
    """
    name, _, attention = name.partition("+")  # "+gqa": eagle.attention's SDPA, as CPU targets load
    cfg = tiny_config(name.split("-")[0], vocab_size=16 if name.endswith("-v16") else 256)
    cfg.initializer_range = 0.2
    attn = register_gqa_attention() if attention == "gqa" else "eager"
    if name == "mistral-window":  # every layer slides over 6 positions, fewer than the prompt + output
        cfg.sliding_window = 6
    elif name == "qwen2-mixed":  # alternating full / sliding layers: the verify mask becomes a dict per type
        cfg.sliding_window = 6
        cfg.use_sliding_window = True
        cfg.layer_types = ["full_attention", "sliding_attention"] * 2
    elif name == "llama-sdpa":
        attn = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval().requires_grad_(False)
    if name.endswith("-v16"):  # 1 token in 16 is EOS: let generations run to their length limit
        model.generation_config.eos_token_id = None
    return model


@cache
def head(name: str, kind: str) -> torch.nn.Module:
    model = target(name)
    torch.manual_seed(1)
    if kind == "eagle3":
        draft_vocab = model.config.vocab_size * 3 // 4
        cfg = HeadConfig.from_target(
            model.config, "eagle3", draft_vocab_size=draft_vocab, aux_layers=[1, 2, 3]
        )
    else:
        cfg = HeadConfig.from_target(model.config, "eagle1")
    hd = build_head(cfg).attach_target(model).eval()
    # O(1) random weights instead of the small training init, so that a wrong mask, position or feature
    # visibly changes the drafts (the training init makes attention nearly uniform and outputs tiny)
    with torch.no_grad():
        for module in hd.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 1.5 / module.in_features**0.5)
    return hd


def prompt(seed: int = 0, length: int = T, vocab: int = 256) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@cache
def reference(name: str, seed: int = 0, n: int = N_NEW) -> list[int]:
    model = target(name)
    ids = prompt(seed, vocab=model.config.vocab_size)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1] :].tolist()


def check_result(res: GenerationResult, ref: list[int]) -> None:
    assert res.tokens == ref
    acc = res.accept_lengths
    assert res.target_forwards == len(acc)
    # the prefill gives one token, each verification accepted + 1 (the last one may be cut by a stop rule)
    assert len(res.tokens) <= 1 + sum(acc)
    assert len(res.tokens) == 1 if not acc else 1 + sum(acc[:-1]) < len(res.tokens)
    depths = range(1, len(res.accepted_per_depth) + 1)
    assert res.accepted_per_depth == [sum(1 for a in acc if a > d) for d in depths]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_generate_equals_hf_generate(family):
    res = plain_generate(target(family), prompt(), N_NEW, sampling=Sampling(eos_token_ids=eos_ids(target(family))), )
    assert res.tokens == reference(family)
    assert res.target_forwards == len(res.tokens) - 1 and set(res.accept_lengths) == {1}


@pytest.mark.parametrize("policy", list(TREES))
@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_drafter_accepts_everything(family, policy):
    model = target(family)
    res = speculative_generate(
        model, OracleDrafter(model), prompt(), N_NEW, TREES[policy], sampling=Sampling(eos_token_ids=eos_ids(model)),
    )
    check_result(res, reference(family))
    depth = 4
    assert res.accept_lengths[:-1] == [depth + 1] * (len(res.accept_lengths) - 1)
    assert len(res.accept_lengths) == -(
        -(len(res.tokens) - 1) // (depth + 1)
    )  # ceil: as few forwards as possible


def test_oracle_drafter_commits_an_accepted_lookup_branch():
    """The verified tree can hold a grafted lookup branch the oracle did not draft (new nodes after its own);
    accepting through it must commit those tokens, not index the oracle's own smaller tree."""
    from eagle.tree import graft_chain

    model = target("llama")
    ids = prompt()
    oracle = OracleDrafter(model)
    oracle.prefill(ids, (), 7)
    own = oracle.draft(7, TREES["chain"])
    chain = [t for t in range(3) if t != int(own.tokens[1])][:2]  # two tokens off the oracle's own path
    grafted = graft_chain(own, chain)
    assert grafted.size == own.size + 2
    oracle.accept(torch.tensor([0, own.size, own.size + 1]), (), torch.tensor([*chain, 9]))
    assert oracle.committed == ids[0].tolist() + [7, *chain]


@pytest.mark.parametrize("policy", list(TREES))
@pytest.mark.parametrize("family,kind", [(f, k) for f in FAMILIES for k in ("eagle1", "eagle3")])
def test_untrained_head_keeps_greedy_output(family, kind, policy):
    model = target(family)
    drafter = HeadDrafter(head(family, kind))
    res = speculative_generate(model, drafter, prompt(), N_NEW, TREES[policy], sampling=Sampling(eos_token_ids=eos_ids(model)), )
    check_result(res, reference(family))
    drafter.catch_up()
    assert drafter.cache.length == T + sum(res.accept_lengths[:-1])  # head cache = committed length - 1


@pytest.mark.parametrize("policy", list(TREES))
def test_partial_acceptance_keeps_greedy_output(policy):
    model = target("mistral")
    res = speculative_generate(
        model, NoisyOracle(model), prompt(), N_NEW, TREES[policy], sampling=Sampling(eos_token_ids=eos_ids(model)),
    )
    check_result(res, reference("mistral"))
    assert len(set(res.accept_lengths[:-1])) > 1  # a mix of full and partial acceptance
    # an untrained head on a 16-token vocabulary guesses right now and then
    small = target("llama-v16")
    for kind in ("eagle1", "eagle3"):
        drafter = HeadDrafter(head("llama-v16", kind))
        res = speculative_generate(small, drafter, prompt(vocab=16), 40, TREES[policy])
        check_result(res, reference("llama-v16", 0, 40))
        assert max(res.accept_lengths) > 1


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-mixed", "llama-sdpa", "llama+gqa", "qwen2-mixed+gqa"])
def test_sliding_window_and_sdpa_targets(name):
    model = target(name)
    ref = reference(name)
    for drafter in (OracleDrafter(model), HeadDrafter(head(name, "eagle3"))):
        for policy in ("chain", "dynamic"):
            res = speculative_generate(
                model, drafter, prompt(), N_NEW, TREES[policy], sampling=Sampling(eos_token_ids=eos_ids(model)),
            )
            check_result(res, ref)
    assert plain_generate(model, prompt(), N_NEW, sampling=Sampling(eos_token_ids=eos_ids(model)), ).tokens == ref


# ------------------------------------------------------------------------------------------ the cache


TREE = tree_from_parents([11, 20, 21, 22, 30, 31, 40, 41], [-1, 0, 0, 0, 1, 2, 5, 5])


@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen2-mixed"])
def test_tree_forward_and_noncontiguous_gather_match_recompute(name):
    from eagle.speculate import _verify_mask  # the per-layer-type masks of this target

    model = target(name)
    ids = prompt(3)
    cache = DynamicCache()
    model(ids, **{cache_kwarg(model): cache}, use_cache=True)
    logits = model(
        TREE.tokens[None],
        attention_mask=_verify_mask(model, TREE, T, torch.float32),
        position_ids=(T + TREE.depths)[None],
        **{cache_kwarg(model): cache},
        use_cache=True,
    ).logits[0]
    # each node's logits equal a plain forward over prompt + its root-to-node path
    for i in range(TREE.size):
        path = [j for j in range(TREE.size) if TREE.attn_mask[i, j]]
        full = model(torch.cat([ids[0], TREE.tokens[path]])[None]).logits[0, -1]
        torch.testing.assert_close(logits[i], full, atol=1e-5, rtol=1e-5)
    # keep the non-contiguous path 0 -> 2 -> 5 -> 7, then decode one more token from the gathered cache
    accepted = torch.tensor([0, 2, 5, 7])
    gather_cache(cache, torch.cat([torch.arange(T), T + accepted]))
    assert cache_length(cache) == T + 4
    nxt = model(torch.tensor([[9]]), **{cache_kwarg(model): cache}, use_cache=True).logits[0, -1]
    full = model(torch.cat([ids[0], TREE.tokens[accepted], torch.tensor([9])])[None]).logits[0, -1]
    torch.testing.assert_close(nxt, full, atol=1e-5, rtol=1e-5)


def test_tree_attention_mask_window():
    mask = tree_attention_mask(TREE, 4, window=3)
    allowed = (mask[0, 0] == 0).int()
    # node 7 (depth 3, position 7) sees positions > 4: nodes 2 (pos 5) and 5 (pos 6) and itself; no prefix
    assert allowed[7].tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 1]
    # the root (position 4) sees prefix positions 2, 3 and itself
    assert allowed[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def test_gather_and_crop_dynamic_caches_and_refuse_others():
    k = torch.arange(2 * 6 * 3, dtype=torch.float32).view(1, 2, 6, 3)
    with pytest.raises(EagleError, match="DynamicCache"):
        gather_cache(((k, k + 1), (k + 2, k + 3)), torch.tensor([0, 1, 3, 5]))  # a legacy tuple cache
    dyn = DynamicCache()
    dyn.update(k.clone(), k.clone() + 1, 0)
    gather_cache(dyn, torch.tensor([0, 1, 4]))
    assert torch.equal(dyn.layers[0].keys, k[:, :, [0, 1, 4]]) and dyn.get_seq_length() == 3
    crop_cache(dyn, 1)
    assert dyn.get_seq_length() == 1
    static = StaticCache(config=tiny_config("llama"), max_cache_len=16)
    with pytest.raises(EagleError, match="DynamicCache"):
        gather_cache(static, torch.tensor([0]))


# ---------------------------------------------------------------------------------- the head drafter


def scratch_output(
    hd: torch.nn.Module, feats: torch.Tensor, shifted: torch.Tensor, path: list[int]
) -> torch.Tensor:
    """The head's output after following ``path`` (drafted tokens), recomputed causally without a cache."""
    hidden, ids = hd.project(feats), shifted
    out = hd(ids, hidden, torch.arange(ids.shape[1])[None])
    for tok in path:
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        out = hd(ids, hidden, torch.arange(ids.shape[1])[None])
    return out[0, -1]


def features(model, ids: torch.Tensor, kind: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    hs = model(ids, output_hidden_states=True).hidden_states
    return hs, (torch.cat([hs[i] for i in (1, 2, 3)], -1) if kind == "eagle3" else hs[-1])


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_head_drafter_matches_recompute(kind, split):
    model, hd = target("llama"), head("llama", kind)
    ids, root = prompt(5), 17
    hs, feats = features(model, ids, kind)
    drafter = HeadDrafter(hd)
    drafter.prefill(ids, hs, root)
    shifted = torch.cat([ids[:, 1:], torch.tensor([[root]])], dim=1)
    tree = drafter.draft(root, TreeConfig("dynamic", depth=3, top_k=3, total_tokens=22))
    assert drafter.cache.length == T
    # every node's draft log-prob equals a causal recompute along its ancestors
    for i in range(1, tree.size):
        path = [j for j in range(1, tree.size) if tree.attn_mask[tree.parents[i], j]]
        out = scratch_output(hd, feats, shifted, tree.tokens[path].tolist())
        logp = torch.log_softmax(hd.logits(out[None, None])[0, 0].float(), -1)
        draft_id = int(tree.tokens[i])  # identity draft vocabulary: draft id == target id
        assert tree.draft_logprobs[i].item() == pytest.approx(logp[draft_id].item(), abs=1e-4)

    # accept a non-contiguous path with the target's features of the tree nodes, then compare with a fresh
    # drafter that prefills the whole committed sequence
    accepted = tree.paths[-1][tree.paths[-1] >= 0]
    assert accepted.numel() >= 3 and not torch.equal(accepted, torch.arange(accepted.numel()))
    cache = DynamicCache()
    model(ids, **{cache_kwarg(model): cache}, use_cache=True)
    from eagle.speculate import _verify_mask

    tree_hs = model(
        tree.tokens[None],
        attention_mask=_verify_mask(model, tree, T, torch.float32),
        position_ids=(T + tree.depths)[None],
        **{cache_kwarg(model): cache},
        output_hidden_states=True,
    ).hidden_states
    bonus = 33
    next_tokens = torch.cat([tree.tokens[accepted[1:]], torch.tensor([bonus])])
    # the same path as two accepts (two steps without a draft between them) queues both and catches up at once
    parts = [slice(0, None)] if split is None else [slice(0, split), slice(split, None)]
    for part in parts:
        drafter.accept(accepted[part], tree_hs, next_tokens[part])
    assert drafter.cache.length == T and len(drafter.queued) == len(parts)  # queued until the head next drafts
    drafter.catch_up()
    committed = torch.cat([ids[0], tree.tokens[accepted]])[None]
    fresh = HeadDrafter(hd)
    fresh.prefill(committed, features(model, committed, kind)[0], bonus)
    assert drafter.cache.length == fresh.cache.length == committed.shape[1]
    torch.testing.assert_close(drafter.last_out, fresh.last_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.cache.keys, fresh.cache.keys, atol=1e-4, rtol=1e-4)
    chain = TreeConfig("chain", depth=3)
    assert drafter.draft(bonus, chain).tokens.tolist() == fresh.draft(bonus, chain).tokens.tolist()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_head_prefill_in_padded_pieces_equals_one_causal_pass(kind):
    """HeadDrafter.prefill takes the prompt in fixed-size pieces, the last one padded: the head's cache and
    output must be those of one causal pass over the prompt, and every piece must have the same shape."""
    model, hd = target("llama"), head("llama", kind)
    ids, root = prompt(7, length=23), 17
    hs, feats = features(model, ids, kind)
    shifted = torch.cat([ids[:, 1:], torch.tensor([[root]])], dim=1)
    rows: list[int] = []
    hook = hd.midlayer.self_attn.q_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    try:
        for chunk in (4, 5, 23, 64):  # pieces of 4 (1 padded), 5 (2 padded), exactly one, one mostly padding
            drafter = HeadDrafter(hd)
            drafter.prefill_chunk = chunk
            rows.clear()
            drafter.prefill(ids, hs, root)
            assert set(rows) == {chunk} and len(rows) == -(-23 // chunk)
            assert drafter.cache.length == 23
            torch.testing.assert_close(drafter.last_out[0, 0], scratch_output(hd, feats, shifted, []))
            full = HeadCache()
            hd(shifted, hd.project(feats), torch.arange(23)[None], None, full)
            torch.testing.assert_close(drafter.cache.keys, full.keys)
            torch.testing.assert_close(drafter.cache.values, full.values)
    finally:
        hook.remove()


# ------------------------------------------------------------------------------------- stopping, errors


class DigitTokenizer:
    """Decodes token ids as space-separated numbers (enough to test stop strings)."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"<{i}>" for i in ids)


def test_stopping_rules():
    model = target("llama")
    ref = reference("llama", 0, 40)
    drafter = OracleDrafter(model)
    # EOS: an id that first occurs mid-way in the greedy output; it is kept and generation stops there
    eos = ref[13]
    cut = ref.index(eos) + 1
    res = speculative_generate(model, drafter, prompt(), 40, TREES["chain"], sampling=Sampling(eos_token_ids=[eos]))
    assert res.tokens == ref[:cut]
    # exact length truncation, also when the limit falls inside an accepted block
    for n in (1, 2, 7):
        assert (
            speculative_generate(model, OracleDrafter(model), prompt(), n, TREES["chain"]).tokens == ref[:n]
        )
    # stop strings (decoded text); the token completing the string is kept
    stop = f"<{ref[5]}> <{ref[6]}>"
    first = next(i for i in range(1, 40) if f"<{ref[i - 1]}> <{ref[i]}>" == stop)
    res = speculative_generate(
        model,
        OracleDrafter(model),
        prompt(),
        40,
        TREES["dynamic"],
        sampling=Sampling(stop_strings=[stop], tokenizer=DigitTokenizer()), )
    assert res.tokens == ref[: first + 1]
    plain = plain_generate(model, prompt(), 40, sampling=Sampling(stop_strings=[stop], tokenizer=DigitTokenizer()), )
    assert plain.tokens == res.tokens


@pytest.mark.parametrize("policy", list(TREES))
def test_prompt_lookup_branch_keeps_greedy_output_and_accepts_repeats(policy):
    # a random 16-token target falls into loops: the lookup branch must catch them, and change nothing else
    small = target("llama-v16")
    ref = reference("llama-v16", 0, 40)
    lookup = replace(TREES[policy], lookup_ngram=3)
    taus = {}
    for cfg in (TREES[policy], lookup):
        drafter = HeadDrafter(head("llama-v16", "eagle1"))
        res = speculative_generate(small, drafter, prompt(vocab=16), 40, cfg)
        check_result(res, ref)
        drafter.catch_up()
        assert drafter.cache.length == T + sum(res.accept_lengths[:-1])
        taus[cfg.lookup_ngram] = res.mean_accept_length
    assert taus[3] > taus[0] + 0.3, taus
    # sampling: a one-hot target (top_k=1) must still give the greedy output with the lookup branch
    gen = torch.Generator().manual_seed(0)
    res = speculative_generate(
        small,
        HeadDrafter(head("llama-v16", "eagle3")),
        prompt(vocab=16),
        40,
        lookup,
        sampling=Sampling(temperature=0.9, top_k=1), generator=gen,
    )
    assert res.tokens == ref


def test_lookup_branch_longer_than_the_tree_accepts_past_its_depth():
    # the random 16-token target loops: a 10-token lookup branch below a depth-2 chain accepts runs longer than
    # the chain could, and the output stays the target's greedy one
    small = target("llama-v16")
    ref = reference("llama-v16", 0, 40)
    short = TreeConfig("chain", depth=2, lookup_ngram=3)
    long = replace(short, lookup_tokens=10)
    res = {}
    for cfg in (short, long):
        drafter = HeadDrafter(head("llama-v16", "eagle1"))
        res[cfg.lookup_tokens] = out = speculative_generate(small, drafter, prompt(vocab=16), 40, cfg)
        check_result(out, ref)
        drafter.catch_up()
        assert drafter.cache.length == T + sum(out.accept_lengths[:-1])
    assert len(res[0].accepted_per_depth) == 2 and len(res[10].accepted_per_depth) == 10
    assert max(res[0].accept_lengths) <= 3 < max(res[10].accept_lengths)
    assert sum(res[10].accepted_per_depth[2:]) > 0
    assert res[10].target_forwards < res[0].target_forwards


def test_cpu_prepacked_target_and_head_keep_greedy_output():
    import copy

    from eagle.targets import prepack_for_cpu

    model = copy.deepcopy(target("llama"))
    hd = copy.deepcopy(head("llama", "eagle3"))
    ids = prompt()
    before = model(ids).logits
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    hd.attach_target(model)  # before prepacking: attach reads the target's weights
    assert prepack_for_cpu(model) == n_linear  # the tied lm_head too
    assert prepack_for_cpu(hd) > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_for_cpu(model) == 0  # nothing left to swap
    assert torch.allclose(model(ids).logits, before, atol=1e-4)
    plain = plain_generate(model, ids, N_NEW)
    res = speculative_generate(model, HeadDrafter(hd), ids, N_NEW, TREES["dynamic"])
    assert res.tokens == plain.tokens == reference("llama")
    assert prepack_for_cpu(torch.nn.Linear(2, 2).to(torch.float64)) == 0  # only fp32 layers


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_bf16_head_on_fp32_target_keeps_greedy_output(kind):
    """eval.draft_dtype: the head drafts in bf16, the fp32 target verifies; drafts are accepted and the output is
    the target's own greedy output."""
    import copy

    small = target("llama-v16")
    hd = copy.deepcopy(head("llama-v16", kind)).to(torch.bfloat16)
    assert hd.midlayer.self_attn.q_proj.weight.dtype == torch.bfloat16
    res = speculative_generate(small, HeadDrafter(hd), prompt(vocab=16), 40, TREES["dynamic"])
    check_result(res, reference("llama-v16", 0, 40))
    assert max(res.accept_lengths) > 1  # drafts were accepted, not only the bonus token


def test_sampling_path():
    model = target("qwen2")
    tree = TREES["dynamic"]

    def run(drafter, seed, **warp):
        gen = torch.Generator().manual_seed(seed)
        return speculative_generate(model, drafter, prompt(), 16, tree, sampling=Sampling(temperature=0.8, **warp),
                                    generator=gen)

    a = run(HeadDrafter(head("qwen2", "eagle1")), 7, top_p=0.9, top_k=50)
    b = run(HeadDrafter(head("qwen2", "eagle1")), 7, top_p=0.9, top_k=50)
    assert a.tokens == b.tokens and len(a.tokens) == 16
    assert a.tokens != run(HeadDrafter(head("qwen2", "eagle1")), 8, top_p=0.9, top_k=50).tokens
    # top_k=1 makes every warped distribution one-hot: sampling must reproduce greedy decoding, and the oracle's
    # drafts are then accepted with probability 1
    res = run(OracleDrafter(model), 0, top_k=1)
    assert res.tokens == reference("qwen2", 0, 16)
    assert res.accept_lengths[:-1] == [5] * (len(res.accept_lengths) - 1)
    assert run(HeadDrafter(head("qwen2", "eagle3")), 0, top_k=1).tokens == reference("qwen2", 0, 16)


def test_user_errors():
    model = target("llama")
    with pytest.raises(EagleError, match="one sequence"):
        speculative_generate(model, OracleDrafter(model), torch.ones(2, 4, dtype=torch.long), 4)
    with pytest.raises(EagleError, match="tokenizer"):
        speculative_generate(model, OracleDrafter(model), prompt(), 4, sampling=Sampling(stop_strings=["x"]))
    with pytest.raises(EagleError, match="policy"):
        speculative_generate(model, OracleDrafter(model), prompt(), 4, TreeConfig(policy="beam"))
    with pytest.raises(EagleError, match="max_new_tokens"):
        plain_generate(model, prompt(), 0)


# ------------------------------------------------------------------------------------------ lazy logits


def count_lm_head_rows(model) -> list[int]:
    """Rows fed to the target's lm_head per call, recorded by a forward hook (remove with .handle.remove())."""
    rows: list[int] = []

    def hook(module, args, output):
        rows.append(output.reshape(-1, output.shape[-1]).shape[0])

    count_lm_head_rows.handle = model.get_output_embeddings().register_forward_hook(hook)
    return rows


class Recording:
    """Wraps a drafter and records, per verification it is told of: the tree, the accepted nodes and the rows
    the target's lm_head made in between (``rows`` as filled by :func:`count_lm_head_rows`; drafting with the
    target itself happens before the mark)."""

    def __init__(self, inner, rows: list[int]):
        self.inner, self.rows, self.steps = inner, rows, []

    def prefill(self, input_ids, hidden_states, next_token):
        self.inner.prefill(input_ids, hidden_states, next_token)

    def draft(self, root_token, tree_cfg):
        self.tree = self.inner.draft(root_token, tree_cfg)
        self.mark = len(self.rows)
        return self.tree

    def accept(self, accepted, hidden_states, next_tokens):
        self.steps.append((self.tree.to("cpu"), accepted.tolist(), self.rows[self.mark :]))
        self.inner.accept(accepted, hidden_states, next_tokens)


def first_child_path(tree, node: int = 0) -> list[int]:
    path = [node]
    while tree.children(path[-1]):
        path.append(tree.children(path[-1])[0])
    return path


@pytest.mark.parametrize("name", ["llama", "qwen2-mixed", "mistral-window"])
def test_lazy_logits_equal_full_logits(name):
    from eagle.lazy_logits import _LOGIT_MAPS

    model = target(name)
    _LOGIT_MAPS.pop(model, None)
    runs = {}
    for lazy in (True, False):
        rows = count_lm_head_rows(model)
        # the noisy oracle: acceptance goes through first children and through later ones
        drafters = [Recording(NoisyOracle(model), rows), Recording(NoisyOracle(model), rows)]
        try:
            greedy = speculative_generate(
                model,
                drafters[0],
                prompt(1),
                N_NEW,
                TREES["dynamic"],
                sampling=Sampling(eos_token_ids=eos_ids(model)), lazy_logits=lazy,
            )
            sampled = speculative_generate(
                model,
                drafters[1],
                prompt(2),
                N_NEW,
                TREES["dynamic"],
                sampling=Sampling(temperature=0.9, top_p=0.95), generator=torch.Generator().manual_seed(3),
                lazy_logits=lazy,
            )
        finally:
            count_lm_head_rows.handle.remove()
        runs[lazy] = (greedy, sampled, drafters[0].steps + drafters[1].steps)
    (g_lazy, s_lazy, steps), (g_full, s_full, full_steps) = runs[True], runs[False]
    check_result(g_lazy, reference(name, 1))
    assert g_lazy.tokens == g_full.tokens and g_lazy.accept_lengths == g_full.accept_lengths
    assert s_lazy.tokens == s_full.tokens and s_lazy.accept_lengths == s_full.accept_lengths
    assert _LOGIT_MAPS[model] is not None
    # lazy: each verification forward makes the rows of the first-child path only; an accepted node off that
    # path then has its row made in one pass with its own first-child chain below it (the last accepted node
    # gives the bonus / residual sample)
    off_path = 0
    for tree, accepted, made in steps:
        have, passes = set(first_child_path(tree)), [len(first_child_path(tree))]
        for node in accepted:
            if node not in have:
                chain = first_child_path(tree, node)
                passes.append(len(chain))
                have |= set(chain)
        assert made == passes
        off_path += len(passes) - 1
    assert len(steps) >= 4 and off_path > 0  # both kinds of rows were exercised
    # full: every node of every tree, in the forward
    assert all(made == [tree.size] for tree, _, made in full_steps)


def tiny_postprocessed(kind: str) -> torch.nn.Module:
    """Tiny targets whose logits are post-processed: Gemma-2 soft-capping, Cohere logit_scale, Granite
    logits_scaling, and a Llama whose config names a soft-capping that Llama does not apply."""
    from transformers import CohereConfig, Gemma2Config, GraniteConfig

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg = {
        "gemma2": lambda: Gemma2Config(**common, final_logit_softcapping=2.0, sliding_window=6),
        "cohere": lambda: CohereConfig(**common, logit_scale=0.5),
        "granite": lambda: GraniteConfig(**common, logits_scaling=4.0),
        "llama-unapplied-cap": lambda: tiny_config("llama"),
    }[kind]()
    if kind == "llama-unapplied-cap":
        cfg.initializer_range = 0.2
        cfg.final_logit_softcapping = 2.0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite", "llama-unapplied-cap"])
def test_lazy_logits_apply_postprocessing_or_fall_back(kind):
    from eagle.lazy_logits import _LOGIT_MAPS

    model = tiny_postprocessed(kind)
    ids = prompt()
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    res = speculative_generate(model, OracleDrafter(model), ids, 16, TREES["dynamic"])
    assert res.tokens == ref[0, ids.shape[1] :].tolist()
    logit_map = _LOGIT_MAPS[model]
    if kind == "llama-unapplied-cap":
        assert logit_map is None  # the configured cap does not reproduce the model's logits: full logits
        return
    # the map reproduces the model's logits at every position, not just the checked one
    out = model(ids, output_hidden_states=True)
    lazy = logit_map(out.hidden_states[-1][0])
    torch.testing.assert_close(lazy, out.logits[0], atol=1e-5, rtol=1e-5)
    raw = model.get_output_embeddings()(out.hidden_states[-1][0])
    assert (raw - out.logits[0]).abs().max() > 1e-2  # the post-processing mattered


# ------------------------------------------------------------------------------ targets with a recurrent state

HYBRIDS = ("qwen3_next", "qwen3_5", "falcon_h1", "bamba")


@cache
def hybrid(name: str) -> torch.nn.Module:
    from eagle.testing import family_model

    model = family_model(name)
    model.generation_config.eos_token_id = None  # run to the length limit
    return model


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_partly_rejected_chain_leaves_the_state_of_the_kept_tokens(name):
    """verify_chain on 4 drafts of which the target rejects the third: the cache goes back to the prompt, the root
    and the first two drafts wait unread, and the next verification (reading them first) gives the logits of a
    cache that read exactly those tokens."""
    from eagle.cache import new_cache
    from eagle.lazy_logits import TargetLogits
    from eagle.speculate import verify_chain
    from eagle.tree import tree_from_parents

    model, ids = hybrid(name), prompt(3, length=12)
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5)[0, 12:]
    root, right = int(greedy[0]), greedy[1:].tolist()
    drafts = [right[0], right[1], (right[2] + 1) % 256, right[3]]  # the third is wrong
    cache = new_cache(model)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        chain = tree_from_parents([root, *drafts], [-1, 0, 1, 2, 3])
        accepted, next_token, hidden, unread = verify_chain(model, chain, cache, 12, [], Sampling(), None)
        assert accepted.tolist() == [0, 1, 2] and next_token == right[2]
        assert unread == [root, *drafts[:2]] and cache_length(cache) == 12 and hidden[0].shape[1] == 5
        nxt = tree_from_parents([next_token, 7], [-1, 0])
        _, _, hidden, _ = verify_chain(model, nxt, cache, 15, unread, Sampling(), None)
        got = TargetLogits(model)(hidden[-1][0])
        fresh = new_cache(model)
        want = model(torch.cat([ids, torch.tensor([[root, *drafts[:2], next_token, 7]])], 1),
                     past_key_values=fresh).logits[0, -2:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # logits of ~10: float32 sums in other orders
    assert hidden[0].shape[1] == 2  # only the chain's nodes, not the unread tokens read in front of them


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_targets_verify_chains_and_keep_greedy_output(name):
    model, ids = hybrid(name), prompt(4)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW)
    res = speculative_generate(model, NoisyOracle(model), ids, N_NEW, TREES["dynamic"])
    check_result(res, want[0, T:].tolist())
    assert res.verification == "chain"
    assert set(res.accept_lengths[:-1]) > {5}  # some chains accepted whole, others in part
    res = speculative_generate(model, OracleDrafter(model), ids, N_NEW, TREES["chain"])
    assert res.accept_lengths[:-1] == [5] * (len(res.accept_lengths) - 1) and res.replay_forwards == 0


def test_a_target_that_cannot_continue_its_state_is_refused():
    from eagle.testing import family_model

    model = family_model("jamba")
    with pytest.raises(EagleError, match="does not continue the recurrent state.*plain decoding"):
        speculative_generate(model, OracleDrafter(model), prompt(), 8, TREES["dynamic"])


def test_the_verification_forward_makes_the_rows_of_the_likely_path_and_of_the_lookup_branch():
    """One lm_head call in the forward for the drafter's first choices and the grafted lookup branch (the rows
    verification reads on most steps of repetitive text), instead of a second call when it walks that branch."""
    from eagle.lazy_logits import logit_map
    from eagle.speculate import prefill, verify
    from eagle.tree import graft_chain

    model, ids = target("llama"), prompt()
    first, out, cache = prefill(model, ids, Sampling(), None)
    lazy = logit_map(model, out)
    drafted = tree_from_parents([first, 5, 6, 7], [-1, 0, 0, 1])  # first choices: nodes 0, 1, 3
    tree = graft_chain(drafted, [9, 10, 11])  # a branch of its own: nodes 4, 5, 6
    rows = count_lm_head_rows(model)
    try:
        verify(model, tree, cache, ids.shape[1], Sampling(), None, lazy)
    finally:
        count_lm_head_rows.handle.remove()
    assert tree.lookup_nodes == [4, 5, 6] and rows[0] == 6


@pytest.mark.parametrize("alone", [0, 2])
def test_a_lookup_match_long_enough_is_verified_alone_without_asking_the_drafter(alone):
    """``lookup_alone``: a step whose prompt lookup matched at least that long an n-gram verifies the lookup
    branch alone; the output stays the target's, and the drafter drafts only on the other steps."""
    model = target("llama-v16")  # 16 tokens: the context repeats n-grams often

    class Counting(NoisyOracle):
        drafts = 0

        def draft(self, root_token, tree_cfg):
            Counting.drafts += 1
            return super().draft(root_token, tree_cfg)

    tree = replace(TREES["dynamic"], lookup_ngram=3, lookup_tokens=6, lookup_alone=alone)
    res = speculative_generate(model, Counting(model), prompt(vocab=16), 40, tree)
    check_result(res, reference("llama-v16", 0, 40))
    if alone:
        assert 0 < Counting.drafts < res.target_forwards  # some steps went without the drafter
    else:
        assert Counting.drafts == res.target_forwards


def test_lookup_alone_needs_a_lookup_branch_at_least_that_long():
    for bad in (-1, 4, 1.5):
        with pytest.raises(EagleError, match="lookup_alone"):
            TreeConfig(lookup_ngram=3, lookup_alone=bad).validate()
    with pytest.raises(EagleError, match="lookup_alone"):
        TreeConfig(lookup_alone=1).validate()  # no lookup branch at all
