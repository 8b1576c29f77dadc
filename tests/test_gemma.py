"""The second embedded family: Gemma 3 270M (Gemma3ForCausalLM: sliding-window and global attention layers, q/k
norms, a 262k-token vocabulary, its own turn format), driven by the same code as SmolLM2.

The cached folder is built from the PyPI GGUF on first use (~1 minute); the speculative loop is checked on a
prompt longer than Gemma's 512-token sliding window, so the verification forward's tree mask meets both kinds of
attention layer and a cache that has slid.
"""

from __future__ import annotations

import pytest
import torch

from eagle import embedded as E
from eagle.drafter import HeadDrafter
from eagle.errors import EagleError
from eagle.heads import HeadConfig, build_head
from eagle.prompts import prompt_token_ids
from eagle.sampling import Sampling
from eagle.speculate import speculative_generate
from eagle.targets import load_target
from eagle.tree import TreeConfig
from train.chat_template import end_of_turn_ids, tokenize_conversation

N_NEW = 32


def test_the_registry_knows_gemma_by_every_name():
    for name in ("embedded:gemma3-270m", "gemma3", " Gemma-3-270M ", "gemma3-270m-q4_k_m"):
        assert E.find_embedded(name) is E.GEMMA3 and E.canonical_name(name) == "gemma3-270m"
    assert E.canonical_name("embedded") == E.SMOLLM2.name  # the default target is unchanged
    assert E.find_embedded("embedded:llama-70b") is None and not E.is_embedded("google/gemma-3-270m")
    with pytest.raises(EagleError, match="the embedded targets are"):
        E.embedded_cache_dir("embedded:llama-70b")


@pytest.fixture(scope="module")
def gemma():
    return load_target("embedded:gemma3-270m")


@pytest.mark.slow
def test_the_cached_folder_is_gemma3_with_its_turn_format(gemma):
    model, tok = gemma.model, gemma.tokenizer
    assert type(model).__name__ == "Gemma3ForCausalLM" and gemma.name == "gemma3-270m"
    assert (gemma.num_layers, gemma.hidden_size, gemma.vocab_size) == (18, 640, 262144)
    assert {"sliding_attention", "full_attention"} == set(model.config.layer_types)
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn_ids(tok) == {tok.eos_token_id, end_of_turn}
    assert end_of_turn in model.generation_config.eos_token_id  # generate() stops at the end of a turn too
    ids, mask = tokenize_conversation(tok, [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello there"}])
    assert ids[0] == tok.bos_token_id  # once, from the template
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello there<end_of_turn>"
    # raw text gets BOS too (without it Gemma's output is garbage), and the dequantized weights are the model's
    prompt = tok("def fibonacci(n):\n", return_tensors="pt").input_ids
    assert prompt[0, 0] == tok.bos_token_id
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, prompt.shape[1]:]).startswith("    if n")


@pytest.mark.slow
def test_speculation_past_the_sliding_window_keeps_the_greedy_output(gemma):
    model, tok = gemma.model, gemma.tokenizer
    listing = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
    ids = torch.tensor([prompt_token_ids({"messages": [{"role": "user", "content": listing + " Go on."}]}, tok)])
    assert ids.shape[1] > model.config.sliding_window
    stops = list(end_of_turn_ids(tok))
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
                               eos_token_id=stops, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    # an untrained head accepts little; the prompt-lookup branch accepts much of the listing's repetition, so
    # verification accepts whole grafted paths, stops part-way and rejects, all past the window
    tree = TreeConfig("dynamic", depth=4, top_k=3, total_tokens=12, lookup_ngram=3, lookup_tokens=8)
    torch.manual_seed(0)
    head = build_head(HeadConfig.from_target(model.config, kind="eagle3", draft_vocab_size=4096,
                                             target_name=gemma.name, target_fingerprint=gemma.fingerprint))
    res = speculative_generate(model, HeadDrafter(head.attach_target(model)), ids, N_NEW, tree,
                               sampling=Sampling(eos_token_ids=stops))
    assert res.tokens == reference
    assert max(res.accept_lengths) > 2 and min(res.accept_lengths) == 1, res.accept_lengths  # not vacuous
