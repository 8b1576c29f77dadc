"""Tiny randomly initialised targets for tests and examples (built in code: no files, no downloads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from eagle.drafter import OracleDrafter

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


class NoisyOracle(OracleDrafter):
    """The oracle, but at some nodes (a fixed pseudo-random choice) it ranks the target's second choice first:
    acceptance stops part-way and, in trees, continues through non-first children."""

    def draft(self, root_token, tree_cfg):
        model = self.model

        class Flipped(torch.nn.Module):
            def forward(self, seq):
                logits = model(seq).logits
                if hash(tuple(seq[0, -3:].tolist())) % 3 == 0:
                    top2 = logits[0, -1].topk(2).indices
                    logits[0, -1, top2[1]] = logits[0, -1, top2[0]] + 1
                return type("Out", (), {"logits": logits})

        self.model = Flipped()
        self.model.get_input_embeddings = model.get_input_embeddings
        try:
            return super().draft(root_token, tree_cfg)
        finally:
            self.model = model


# ------------------------------------------------------------------------------------ the families matrix

_WINDOW = 8  # sliding windows and attention chunks shorter than a test's prompt plus its output
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class Family:
    """A decoder family of transformers as a tiny random target with its distinctive features switched on."""

    name: str  # the family as people call it (the transformers model_type, but for llama4's text model)
    model_type: str  # transformers' model_type
    kind: str  # dense | moe | hybrid: how the matrix groups it
    features: str  # what the tiny target switches on, for the docs table
    overrides: dict = field(default_factory=dict)  # config fields over the common tiny shape


FAMILY_MATRIX: tuple[Family, ...] = (
    Family("llama", "llama", "dense", "llama3 rope scaling",
           dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=64))),
    Family("qwen2", "qwen2", "dense", "q/k/v projection biases"),
    Family("qwen3", "qwen3", "dense", "q/k norm, head_dim 64 != hidden / heads", dict(head_dim=64)),
    Family("mistral", "mistral", "dense", "sliding window on every layer", dict(sliding_window=_WINDOW)),
    Family("gemma2", "gemma2", "dense", "query_pre_attn_scalar, attention and final logit soft-capping, "
           "alternating sliding windows, tied embeddings",
           dict(head_dim=32, query_pre_attn_scalar=64, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                sliding_window=_WINDOW, tie_word_embeddings=True)),
    Family("gemma3", "gemma3_text", "dense", "query_pre_attn_scalar, local/global rope, alternating sliding "
           "windows, final logit soft-capping, tied embeddings",
           dict(head_dim=32, query_pre_attn_scalar=64, sliding_window=_WINDOW, sliding_window_pattern=2,
                final_logit_softcapping=3.0, tie_word_embeddings=True)),
    Family("phi3", "phi3", "dense", "longrope scaling, fused qkv",
           dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 16,
                                     long_factor=[2.0] * 16, original_max_position_embeddings=64))),
    Family("olmo2", "olmo2", "dense", "post-norm blocks, q/k norm over all heads"),
    Family("granite", "granite", "dense", "attention, embedding, residual multipliers, logits scaling",
           dict(attention_multiplier=0.5, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0)),
    Family("cohere2", "cohere2", "dense", "layer norm, logit scale, sliding windows with NoPE global layers",
           dict(sliding_window=_WINDOW, sliding_window_pattern=2, logit_scale=0.5)),
    Family("smollm3", "smollm3", "dense", "NoPE every second layer", dict(no_rope_layer_interval=2)),
    Family("glm4", "glm4", "dense", "partial rotary (half the head), post-norms", dict(partial_rotary_factor=0.5)),
    Family("mixtral", "mixtral", "moe", "4 experts, top-2, sliding window",
           dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=_WINDOW)),
    Family("qwen3_moe", "qwen3_moe", "moe", "4 experts, top-2, normalised top-k",
           dict(num_experts=4, norm_topk_prob=True, **_MOE)),
    Family("deepseek_v3", "deepseek_v3", "moe", "MLA (compressed q and kv), 4 routed + 1 shared expert, top-2 "
           "in grouped routing, a dense first layer",
           dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=32, v_head_dim=32,
                n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                num_key_value_heads=2, topk_method="noaux_tc", **_MOE)),
    Family("gpt_oss", "gpt_oss", "moe", "attention sinks, alternating sliding windows, yarn rope, 4 experts, "
           "top-2",
           dict(num_local_experts=4, num_experts_per_tok=2, head_dim=32, sliding_window=_WINDOW,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                                     beta_slow=1.0, original_max_position_embeddings=64, truncate=False))),
    Family("glm4_moe", "glm4_moe", "moe", "4 routed + 1 shared expert, top-2, q/k norm, partial rotary",
           dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
                use_qk_norm=True, n_group=1, topk_group=1, head_dim=32, **_MOE)),
    Family("llama4", "llama4_text", "moe", "chunked attention with NoPE global layers, 4 experts top-1 + a "
           "shared expert, attention temperature tuning",
           dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128, head_dim=32,
                no_rope_layer_interval=2, attention_chunk_size=_WINDOW)),
    Family("granitemoe", "granitemoe", "moe", "4 experts, top-2, Granite's multipliers",
           dict(num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.5, embedding_multiplier=3.0,
                residual_multiplier=0.5, logits_scaling=4.0)),
    Family("qwen3_next", "qwen3_next", "hybrid", "Gated DeltaNet layers between attention layers, 4 experts "
           "top-2 + a shared expert",
           dict(layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
                shared_expert_intermediate_size=32, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, **_MOE)),
    Family("qwen3_5", "qwen3_5_text", "hybrid", "Gated DeltaNet layers between attention layers (dense)",
           dict(layer_types=["linear_attention", "full_attention"] * 2, head_dim=32, linear_key_head_dim=32,
                linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)),
    Family("falcon_h1", "falcon_h1", "hybrid", "attention and Mamba-2 side by side in every layer, multipliers",
           dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16, head_dim=32, lm_head_multiplier=0.5)),
    Family("bamba", "bamba", "hybrid", "Mamba-2 layers between attention layers",
           dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16)),
    Family("jamba", "jamba", "hybrid", "Mamba layers between attention layers, 4 experts top-2",
           dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1,
                mamba_dt_rank=8)),
)


def family(name: str) -> Family:
    """The matrix entry of a family, by its name."""
    for entry in FAMILY_MATRIX:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown family {name!r}; choose one of {[f.name for f in FAMILY_MATRIX]}")


def family_config(name: str, vocab_size: int = 256, initializer_range: float = 0.2):
    """The tiny config of a matrix family: 4 layers of width 64, 2 query heads of 32 over one key/value head (the
    smallest head vLLM's CPU attention takes), with the family's features on. The wide random init (10x
    transformers' default) makes a wrong mask, position or state change greedy tokens visibly."""
    entry = family(name)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, initializer_range=initializer_range,
    )
    return AutoConfig.for_model(entry.model_type, **{**common, **entry.overrides})


def family_model(name: str, seed: int = 0, attention: str = "eager", **kwargs) -> torch.nn.Module:
    """A frozen, eval-mode tiny target of a matrix family (fp32, CPU)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, **kwargs), attn_implementation=attention)
    return model.eval().requires_grad_(False)


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


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """The text of each run of consecutive loss-masked tokens (special tokens kept): what a loss mask trains on,
    readable in a test's assertion."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]
