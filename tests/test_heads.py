"""Draft head models: shapes, caching, tree attention, target borrowing, config handling."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from eagle.errors import EagleError
from eagle.features import default_aux_layers
from eagle.heads import Eagle1Head, Eagle3Head, HeadCache, HeadConfig, build_head
from eagle.testing import FAMILIES, tiny_model

AUX = [1, 2, 3]


def make_head(kind: str, family: str = "llama", draft_vocab_size: int = 100, seed: int = 1):
    target = tiny_model(family)
    cfg = HeadConfig.from_target(target.config, kind=kind, draft_vocab_size=draft_vocab_size, aux_layers=AUX)
    torch.manual_seed(seed)
    head = build_head(cfg).attach_target(target).eval()
    return head, target


def features(head, b: int, t: int, seed: int = 2) -> torch.Tensor:
    """Random projected hidden input [b, t, h] (through fc for eagle3)."""
    g = torch.Generator().manual_seed(seed)
    cfg = head.config
    width = len(cfg.aux_layers) * cfg.target_hidden_size if cfg.kind == "eagle3" else cfg.hidden_size
    return head.project(torch.randn(b, t, width, generator=g))


def random_ids(b: int, t: int, vocab: int = 256, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_shapes_and_parameter_names(kind, family):
    head, target = make_head(kind, family)
    b, t, h = 2, 7, target.config.hidden_size
    out = head(random_ids(b, t), features(head, b, t), torch.arange(t))
    assert out.shape == (b, t, h)
    logits = head.logits(out)
    vocab = 100 if kind == "eagle3" else 256
    assert logits.shape == (b, t, vocab)
    sd = head.state_dict()
    assert isinstance(head, Eagle3Head if kind == "eagle3" else Eagle1Head)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (h, 4 * 16)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * h if kind == "eagle3" else h)
    assert sd["midlayer.mlp.down_proj.weight"].shape == (h, 2 * h)
    if kind == "eagle3":
        assert sd["fc.weight"].shape == (h, 3 * h) and "fc.bias" not in sd
        assert sd["lm_head.weight"].shape == (100, h) and sd["norm.weight"].shape == (h,)
        assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (100,)
        assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (256,) and int(sd["t2d"].sum()) == 100
        assert "midlayer.hidden_norm.weight" in sd and "midlayer.input_layernorm.weight" in sd
    else:
        assert sd["fc.weight"].shape == (h, 2 * h) and sd["fc.bias"].shape == (h,)
        assert not any(k.startswith(("lm_head", "norm", "d2t", "t2d")) for k in sd)
        # eagle1 logits are exactly the target's lm_head on the head output
        torch.testing.assert_close(logits, target.lm_head(out))


def test_init_is_small_normal_and_norms_are_one():
    head, _ = make_head("eagle3")
    w = head.midlayer.self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.003 and abs(w.mean().item()) < 0.002
    assert torch.equal(head.norm.weight, torch.ones_like(head.norm.weight))
    assert torch.equal(head.midlayer.hidden_norm.weight, torch.ones(64))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_incremental_cache_equals_full_causal(kind):
    head, _ = make_head(kind)
    b, t = 2, 9
    ids, hid = random_ids(b, t), features(head, b, t)
    with torch.no_grad():
        full = head(ids, hid, torch.arange(t))
        cache = HeadCache()
        steps = [head(ids[:, :3], hid[:, :3], torch.arange(3), cache=cache)]  # a chunk, then token by token
        for i in range(3, t):
            steps.append(head(ids[:, i : i + 1], hid[:, i : i + 1], torch.tensor([i]), cache=cache))
    assert cache.length == t and cache.keys.shape == (b, 2, t, 16)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    cache.crop(4)
    assert cache.length == 4


@pytest.mark.parametrize("batched_indices", [False, True])
def test_cache_gather_equals_recomputation(batched_indices):
    head, _ = make_head("eagle3")
    b, t = 2, 8
    ids, hid = random_ids(b, t + 1), features(head, b, t + 1)
    keep = torch.tensor([0, 1, 3, 6])
    with torch.no_grad():
        cache = HeadCache()
        head(ids[:, :t], hid[:, :t], torch.arange(t), cache=cache)
        cache.gather(keep[None].expand(b, -1) if batched_indices else keep)
        assert cache.length == 4
        new = head(ids[:, t:], hid[:, t:], torch.tensor([t]), cache=cache)
        # recompute with only the kept positions (same position ids), then the new token
        ref_cache = HeadCache()
        head(ids[:, keep], hid[:, keep], keep, cache=ref_cache)
        ref = head(ids[:, t:], hid[:, t:], torch.tensor([t]), cache=ref_cache)
    torch.testing.assert_close(new, ref, atol=1e-5, rtol=1e-5)


def test_cache_gather_per_row():
    keys = torch.arange(2 * 1 * 5 * 1, dtype=torch.float32).view(2, 1, 5, 1)
    cache = HeadCache(keys.clone(), -keys.clone())
    cache.gather(torch.tensor([[0, 4], [1, 2]]))
    assert cache.keys.flatten().tolist() == [0.0, 4.0, 6.0, 7.0]
    assert cache.values.flatten().tolist() == [-0.0, -4.0, -6.0, -7.0]


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_tree_mask_equals_naive_per_node(kind):
    head, _ = make_head(kind)
    prefix = 5
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = [-1, 0, 0, 1, 1, 2]
    n = len(parents)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    ancestors = []
    for i in range(n):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = parents[j]
        ancestors.append(chain[::-1])
    ids, hid = random_ids(1, prefix + n), features(head, 1, prefix + n)
    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        tree_mask[i, ancestors[i]] = True
    mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree_mask], dim=1)[None, None]
    pos = torch.tensor([prefix + d for d in depth])
    with torch.no_grad():
        cache = HeadCache()
        head(ids[:, :prefix], hid[:, :prefix], torch.arange(prefix), cache=cache)
        base = copy.deepcopy(cache)
        tree = head(ids[:, prefix:], hid[:, prefix:], pos, attention_mask=mask, cache=cache)
        for i in range(n):
            chain = torch.tensor(ancestors[i]) + prefix
            c = copy.deepcopy(base)
            naive = head(ids[:, chain], hid[:, chain], pos[chain - prefix], cache=c)
            torch.testing.assert_close(tree[0, i], naive[0, -1], atol=1e-5, rtol=1e-5)


def test_target_is_borrowed_not_owned():
    head, target = make_head("eagle1")
    emb, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    sd = head.state_dict()
    assert not any("embed" in k for k in sd) and not any(k.startswith("lm_head") for k in sd)
    own = {id(p) for p in head.parameters()}
    assert id(emb.weight) not in own and id(lm_head.weight) not in own
    assert not emb.weight.requires_grad
    head.to(torch.bfloat16)
    assert emb.weight.dtype == torch.float32 and lm_head.weight.dtype == torch.float32
    twin = copy.deepcopy(head)
    assert twin.embed_tokens is emb  # an EMA copy shares the target instead of copying it
    # the target gets no gradient through the head
    head.float().train()
    out = head(random_ids(1, 4), features(head, 1, 4), torch.arange(4))
    head.logits(out).sum().backward()
    assert emb.weight.grad is None and lm_head.weight.grad is None
    assert head.fc.weight.grad is not None


def test_unattached_head_raises():
    target = tiny_model("llama")
    head = build_head(
        HeadConfig.from_target(target.config, kind="eagle3", draft_vocab_size=50, aux_layers=AUX)
    )
    with pytest.raises(EagleError, match="attach_target"):
        head(random_ids(1, 3), torch.zeros(1, 3, 64), torch.arange(3))


def test_from_target_copies_rope_and_eps():
    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **rope},
    )
    cfg = HeadConfig.from_target(
        hf, kind="eagle3", draft_vocab_size=200, target_name="t", target_fingerprint="f"
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "llama3", **rope}
    assert cfg.rms_norm_eps == 1e-5 and cfg.intermediate_size == 96 and cfg.num_key_value_heads == 1
    assert cfg.head_dim == 16 and cfg.max_position_embeddings == 512 and cfg.aux_layers == default_aux_layers(6)
    assert (cfg.target_name, cfg.target_fingerprint, cfg.vocab_size) == ("t", "f", 300)
    # our RoPE matches the target's own rotary embedding (llama3 scaling applied)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head = build_head(cfg)
    pos = torch.arange(0, 500, 7)[None]
    cos, sin = head.rotary(pos, torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), pos)
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)
    plain = HeadConfig.from_target(tiny_model("qwen2").config, kind="eagle1")
    assert plain.rope_scaling is None and plain.draft_vocab_size == 256 and plain.aux_layers == []


def test_from_target_legacy_rope_attributes():
    legacy = SimpleNamespace(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=100,
        rms_norm_eps=1e-5,
        rope_theta=1234.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=128,
        hidden_act="silu",
    )
    cfg = HeadConfig.from_target(legacy, kind="eagle3", draft_vocab_size=10)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.head_dim == 8 and cfg.aux_layers == [2, 4, 5]
    head = build_head(cfg)
    expected = 1.0 / (1234.0 ** (torch.arange(0, 8, 2).float() / 8)) / 2.0
    cos, _ = head.rotary(torch.tensor([[3]]), torch.float32)
    torch.testing.assert_close(cos[0, 0, :4], torch.cos(3 * expected))


def test_config_roundtrip_and_errors():
    target = tiny_model("mistral")
    cfg = HeadConfig.from_target(target.config, kind="eagle3", draft_vocab_size=64, aux_layers=AUX)
    again = HeadConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(
        EagleError, match=r"head.draft_vocab_size=300 is larger than the target.s vocabulary \(256\): lower head.draft_vocab_size"
    ):
        HeadConfig.from_target(target.config, kind="eagle3", draft_vocab_size=300, aux_layers=AUX)
    with pytest.raises(EagleError, match="lower head.draft_vocab_size"):
        build_head(HeadConfig(**{**cfg.to_dict(), "draft_vocab_size": 257}))
    with pytest.raises(EagleError, match="unknown head config keys"):
        HeadConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(EagleError, match=r"lacks required keys \['vocab_size'\]"):
        HeadConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "vocab_size"})
    with pytest.raises(EagleError, match="head kind"):
        HeadConfig.from_target(target.config, kind="medusa")
    with pytest.raises(EagleError, match="aux layer 9"):
        HeadConfig.from_target(target.config, kind="eagle3", aux_layers=[1, 9])


def test_draft_vocab_mapping():
    head, _ = make_head("eagle3", draft_vocab_size=4)
    ids = torch.tensor([3, 10, 11, 200])
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(4), t2d)
    assert head.draft_to_target(torch.tensor([[0, 1], [2, 3]])).tolist() == [[3, 10], [11, 200]]
    with pytest.raises(EagleError, match="draft_vocab_size=4"):
        head.set_draft_vocab(torch.zeros(5, dtype=torch.long), t2d)
    eagle1, _ = make_head("eagle1")
    assert eagle1.draft_to_target(ids).tolist() == ids.tolist()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_bf16_forward(kind):
    head, target = make_head(kind)
    ids, hid = random_ids(2, 6), features(head, 2, 6)
    with torch.no_grad():
        ref = head.logits(head(ids, hid, torch.arange(6)))
        head.to(torch.bfloat16)
        out = head(ids, hid.bfloat16(), torch.arange(6))
        logits = head.logits(out)
    assert out.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert head.rotary._inv_freq[torch.device("cpu")].dtype == torch.float32  # not rounded by .to()
    torch.testing.assert_close(logits.float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    head, target = make_head("eagle3")
    ids, hid = random_ids(2, 10), features(head, 2, 10)
    with torch.no_grad():
        ref = head.logits(head(ids, hid, torch.arange(10)))
        target.cuda()
        head.to("cuda", dtype)
        out = head.logits(head(ids.cuda(), hid.cuda().to(dtype), torch.arange(10, device="cuda")))
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
