"""Load: ``eagle eval`` over 500 prompts and one 4,000-token generation keep memory flat and stay lossless.

Memory is the process's resident set size, read after a garbage collection at fixed points of the run (every 25
prompts; every 250 decoding steps). After a warm-up the growth must stay under a stated bound:

- 500 prompts: 16 MiB from prompt 100 to prompt 500. What legitimately grows is the per-prompt records kept for
  the report (a few hundred bytes each); keeping one logits row per prompt alive (192 KiB at this vocabulary)
  would add 75 MiB, a KV cache per prompt several MiB.
- 4,000 new tokens: the KV caches of the target and the head must grow (that is the context), by a number computed
  from the shapes; the bound is that plus 16 MiB. Keeping the verification logits of every step alive would add
  over 90 MiB.

Losslessness: at temperature 0 every speculative output equals the target's own greedy output token for token.
"""

from __future__ import annotations

import gc
import json
import random

import pytest
import torch
from rich.console import Console

from eagle.drafter import HeadDrafter
from eagle.sampling import Sampling
from eagle.speculate import plain_generate, speculative_generate
from eagle.targets import Target
from eagle.testing import tiny_model
from eagle.tree import TreeConfig

MiB = 1 << 20


def rss_bytes() -> int:
    """Resident set size of this process (psutil when installed, else /proc)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the resident set size here")


def settled_rss() -> int:
    gc.collect()
    return rss_bytes()


def _words(rng: random.Random, n: int) -> str:
    vocab = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest.mark.slow
@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_eval_over_500_prompts_keeps_memory_flat_and_output_lossless(tmp_path, monkeypatch, draft_dtype):
    """bf16 too: oneDNN keeps a compiled kernel per matrix shape, so a bf16 head prefilling prompts of 500
    lengths grew by ~0.5 MB a length until its prefill took fixed-size pieces (HeadDrafter.prefill)."""
    from eagle import evaluate as ev
    from eagle.export import export_head
    from eagle.heads import HeadConfig, build_head
    from eagle.targets import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = tiny_model("llama", vocab_size=49152, hidden_size=32, num_layers=2)
    target = Target.from_model(model, tokenizer, name="tiny-load")
    cfg = HeadConfig.from_target(
        model.config, "eagle3", target_name=target.name, target_fingerprint=target.fingerprint
    )
    draft = export_head(build_head(cfg).eval(), tmp_path / "draft", dtype="float32", target=target)
    rng = random.Random(0)
    lines = []
    for i in range(500):  # raw prompts of varied length, every fifth one a chat message
        text = _words(rng, rng.randint(1, 40))
        lines.append(
            {"id": f"p{i}", "messages": [{"role": "user", "content": text}]}
            if i % 5 == 0
            else {
                "id": f"p{i}",
                "prompt": text,
            }
        )
    prompts = tmp_path / "load.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))

    samples: dict[int, int] = {}
    real_run = ev._Methods.run  # one prompt through every method

    def measured(*args, **kwargs):
        out = real_run(*args, **kwargs)
        measured.calls += 1
        if measured.calls % 25 == 0:
            samples[measured.calls] = settled_rss()
        return out

    measured.calls = 0
    monkeypatch.setattr(ev._Methods, "run", measured)
    config = ev.EvalConfig(
        draft=str(draft),
        prompts=[str(prompts)],
        max_new_tokens=8,
        tree=TreeConfig(policy="dynamic", depth=3, top_k=2, total_tokens=6),
        prompt_lookup=False,
        warmup=0,
        report=str(tmp_path / "eval" / "report.json"),
        draft_dtype=draft_dtype,
    )
    report = ev.evaluate(config, target, console=Console(file=open("/dev/null", "w")))  # noqa: SIM115

    overall = report["overall"]
    assert overall["num_prompts"] == 500 and measured.calls == 500
    assert overall["greedy_match_rate"] == 1.0
    assert all(p["first_mismatch"] is None for p in report["prompts"])
    assert overall["new_tokens"] == sum(p["new_tokens"] for p in report["prompts"]) >= 500
    growth = max(samples.values()) - samples[100]
    print(
        f"\n500 prompts: RSS {samples[100] / MiB:.1f} MiB at prompt 100, +{growth / MiB:.2f} MiB by prompt 500"
    )
    assert growth < 16 * MiB, {k: round(v / MiB, 1) for k, v in samples.items()}


class MeasuredDrafter:
    """A drafter that records the settled RSS every ``every`` draft calls (it delegates everything)."""

    def __init__(self, inner, every: int = 250):
        self.inner, self.every, self.calls = inner, every, 0
        self.samples: list[tuple[int, int]] = []  # (draft calls, RSS)

    def prefill(self, *args, **kwargs):
        return self.inner.prefill(*args, **kwargs)

    def accept(self, *args, **kwargs):
        return self.inner.accept(*args, **kwargs)

    def draft(self, root_token, tree_cfg):
        self.calls += 1
        if self.calls % self.every == 0:
            self.samples.append((self.calls, settled_rss()))
        return self.inner.draft(root_token, tree_cfg)


@pytest.mark.slow
def test_4000_new_tokens_keep_memory_flat_and_output_lossless():
    from eagle.heads import HeadConfig, build_head

    new_tokens = 4000
    model = tiny_model("llama", vocab_size=2048, hidden_size=64, num_layers=2)
    cfg = HeadConfig.from_target(model.config, "eagle3", target_name="tiny", target_fingerprint="x")
    head = build_head(cfg).attach_target(model).eval()
    prompt = torch.randint(3, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    tree = TreeConfig(policy="chain", depth=2)

    drafter = MeasuredDrafter(HeadDrafter(head))
    with torch.no_grad():
        spec = speculative_generate(model, drafter, prompt, new_tokens, tree, sampling=Sampling(eos_token_ids=()), )
        plain = plain_generate(model, prompt, new_tokens, sampling=Sampling(eos_token_ids=()), )
    assert len(spec.tokens) == len(plain.tokens) == new_tokens
    assert spec.tokens == plain.tokens  # lossless over the whole length

    # what must grow: one K and one V row per token and layer, in the target's cache and the head's
    text = model.config
    head_dim = text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_key_value_heads * head_dim * 4 * (text.num_hidden_layers + 1)
    calls, rss = zip(*drafter.samples)
    start = len(calls) // 4  # after a quarter of the run
    tokens_after = new_tokens * (calls[-1] - calls[start]) / drafter.calls
    allowed = per_token * tokens_after + 16 * MiB
    growth = max(rss[start:]) - rss[start]
    print(
        f"\n{new_tokens} tokens in {drafter.calls} steps: RSS +{growth / MiB:.2f} MiB after step {calls[start]} "
        f"(KV caches: {per_token * tokens_after / MiB:.2f} MiB)"
    )
    assert growth < allowed, [round(r / MiB, 1) for r in rss]
