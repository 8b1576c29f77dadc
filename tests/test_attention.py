"""eagle.attention: the CPU attention that reads grouped key/value heads in place gives the numbers of
transformers' stock SDPA -- padded batches, decoding steps over a cache, tree masks, sliding windows -- without
copying the key/value heads, and CPU targets load with it.

(Greedy equality of the speculative loop on targets with this attention is in tests/test_speculate.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as stock
from transformers import AutoModelForCausalLM, DynamicCache

from eagle.attention import SDPA_GQA, register, suit_device
from eagle.targets import attention_choices, load_target
from eagle.testing import tiny_config


def _pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same tiny GQA target (4 query heads over 2 key/value heads) with stock SDPA and with ours."""
    cfg = tiny_config(family, vocab_size=128)
    cfg.initializer_range = 0.2  # attention far from uniform: a wrong key/value head changes the numbers
    if family == "mistral":
        cfg.sliding_window = 5  # shorter than the prompts: the sliding-window masks go through the same function
    assert cfg.num_attention_heads != cfg.num_key_value_heads
    torch.manual_seed(0)
    # each model its own copy of the config: from_config writes the attention choice into the config it is given
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=register())
    ours.load_state_dict(ref.state_dict())
    assert (ref.config._attn_implementation, ours.config._attn_implementation) == ("sdpa", SDPA_GQA)
    return ref.eval().requires_grad_(False), ours.eval().requires_grad_(False)


def _decode(model: torch.nn.Module, steps: int = 4, windowed_cache: bool = False) -> list[torch.Tensor]:
    """Logits of a left-padded batch of 3 prompts (lengths 9, 6, 3): the prompt forward, ``steps`` greedy decoding
    steps over the cache, then (over a cache that keeps every position, as verification's does) a 4-token block
    with its own 4D mask: a tree of two branches of two. ``windowed_cache``: the cache regeneration uses, whose
    sliding-window layers keep only their window."""
    g = torch.Generator().manual_seed(1)
    lengths, width = [9, 6, 3], 9
    ids = torch.randint(3, 128, (3, width), generator=g)
    att = torch.zeros(3, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        att[r, width - n :] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config) if windowed_cache else DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = [out.logits * att[..., None]]  # padded rows' logits are meaningless in both
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            att = torch.cat([att, att.new_ones(3, 1)], -1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=att, position_ids=pos, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
        if windowed_cache:
            return logits
        allowed = torch.cat([att.bool()[:, None, None, :].expand(3, 1, 4, -1),
                             torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]],
                                          dtype=torch.bool).expand(3, 1, 4, 4)], -1)
        block = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        tree_pos = pos + 1 + torch.tensor([0, 1, 0, 1])
        out = model(input_ids=torch.randint(3, 128, (3, 4), generator=g), attention_mask=block,
                    position_ids=tree_pos, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_same_numbers_as_stock_sdpa(family):
    ref, ours = _pair(family)
    assert ours.config._attn_implementation == SDPA_GQA
    got, want = _decode(ours), _decode(ref)
    assert len(got) == len(want) == 6
    got, want = got + _decode(ours, windowed_cache=True), want + _decode(ref, windowed_cache=True)
    for step, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"forward {s}: {m}")
    assert max(float(t.abs().max()) for t in want) > 1.0  # the comparison is between real, non-trivial logits


def test_no_copy_of_the_key_value_heads(monkeypatch):
    """Stock SDPA copies the grouped key/value heads under a mask (the control: the counter sees it); ours never."""
    calls = []
    real = stock.repeat_kv

    def counting(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        calls.append(n_rep)
        return real(hidden, n_rep)

    monkeypatch.setattr(stock, "repeat_kv", counting)
    ref, ours = _pair("llama")
    _decode(ref, steps=1)
    assert calls and all(n == 2 for n in calls)  # the counter does see the copy the stock path makes
    calls.clear()
    _decode(ours, steps=1)
    assert calls == []


def test_cpu_targets_load_with_it(tiny_target_folder):
    assert attention_choices("cpu")[0] == SDPA_GQA
    assert attention_choices("cuda") == ["sdpa", "eager"]  # CUDA keeps stock SDPA (its fused kernels)
    target = load_target(str(tiny_target_folder))
    assert target.model.config._attn_implementation == SDPA_GQA


@pytest.mark.parametrize("attention", ["eager", "sdpa", SDPA_GQA])
def test_target_attention_picks_one_implementation(tiny_target_folder, attention):
    """``target.attention`` names the implementation instead of the automatic choice."""
    from eagle.targets import TargetConfig

    target = load_target(TargetConfig(name=str(tiny_target_folder), attention=attention))
    assert target.model.config._attn_implementation == attention


def test_a_target_attention_the_model_cannot_use_is_named(tiny_target_folder):
    from eagle.errors import EagleError
    from eagle.targets import TargetConfig

    with pytest.raises(EagleError, match="target.attention=no_such_kernel .*target.attention=auto"):
        load_target(TargetConfig(name=str(tiny_target_folder), attention="no_such_kernel"))
    with pytest.raises(EagleError, match="target.attention must be auto or"):
        TargetConfig(attention="").validate()


def test_a_cpu_loaded_target_bound_for_a_gpu_gets_stock_sdpa_back():
    """A sharded target is loaded on the CPU and run on GPUs, where CUDA's fused SDPA kernels are the fast ones."""
    _, ours = _pair("llama")
    suit_device(ours, torch.device("cpu"))
    assert ours.config._attn_implementation == SDPA_GQA
    suit_device(ours, torch.device("cuda", 0))  # only the choice changes: nothing moves
    assert ours.config._attn_implementation == "sdpa"
    assert ours.model.layers[0].self_attn.config._attn_implementation == "sdpa"


def test_eval_and_collect_load_the_target_with_its_attention(tmp_path, monkeypatch):
    """The recipes hand ``target.attention`` (as given, spaces and case of ``auto`` aside) to the loader."""
    import eagle.targets
    from recipes import collect as collect_recipe
    from recipes import eval as eval_recipe
    from recipes.config import load_config

    class Loaded(Exception):
        pass

    seen = []

    def loader(cfg, *args, **kwargs):
        seen.append(eagle.targets.attention_choices("cpu", cfg.attention))
        raise Loaded

    monkeypatch.setattr(eagle.targets, "load_target", loader)
    (tmp_path / "config.json").write_text("{}")
    for attention in ("eager", " sdpa ", "Auto"):
        cfg = load_config(None, [f"target.attention={attention}", f"eval.draft={tmp_path}", "target.device=cpu"])
        for recipe in (eval_recipe, collect_recipe):
            with pytest.raises(Loaded):
                recipe.run(cfg)
    auto = eagle.targets.attention_choices("cpu")
    assert seen == [["eager"]] * 2 + [["sdpa"]] * 2 + [auto] * 2
