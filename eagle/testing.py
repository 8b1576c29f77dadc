"""Tiny randomly initialised targets for tests and examples (built in code: no files, no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

FAMILIES = ("llama", "qwen2", "mistral")


def tiny_config(family: str = "llama", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4):
    """A small HF config of the given family (llama, qwen2, mistral)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def tiny_model(family: str = "llama", seed: int = 0, **kwargs) -> torch.nn.Module:
    """A frozen, eval-mode tiny causal LM with random weights (fp32, CPU)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), attn_implementation="eager")
    model.eval().requires_grad_(False)
    return model


def save_tiny_target(folder: str | Path, family: str = "llama", seed: int = 0, **kwargs) -> Path:
    """Save a tiny random target with the embedded SmolLM2 tokenizer (a real chat template) as an HF folder.

    Pass ``vocab_size`` >= 49,152 for prompts tokenized by that tokenizer to stay in range.
    """
    from eagle.targets import load_tokenizer

    folder = Path(folder)
    tiny_model(family, seed=seed, **kwargs).save_pretrained(folder)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
    return folder


# every prompt-set summary of an evaluation report (and its "overall") carries these, with these types
REPORT_SECTION_FIELDS = {
    "acceptance_length_mean": float,
    "acceptance_length_median": float,
    "new_tokens": int,
    "target_forwards": int,
    "tokens_per_second": float,
    "baseline_tokens_per_second": float,
    "speedup": float,
    "greedy_match_rate": float,
    "num_prompts": int,
    "per_depth_acceptance": list,
    "prompt_lookup_tokens_per_second": float,
    "prompt_lookup_speedup": float,
}


def check_greedy_report_section(section: dict, num_prompts: int) -> None:
    """Assert that a summary of a greedy evaluation has every field with its type, counts ``num_prompts``
    prompts, and that speculative decoding and prompt lookup both matched plain greedy decoding on all of them."""
    for key, kind in REPORT_SECTION_FIELDS.items():
        assert isinstance(section[key], kind), (key, section[key])
    assert section["num_prompts"] == num_prompts
    assert section["greedy_match_rate"] == 1.0
    assert section["prompt_lookup_match_rate"] == 1.0
