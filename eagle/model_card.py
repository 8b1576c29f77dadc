"""The model card (``README.md``) of an exported head: what it is, the exact target, its data and training, its
evaluation, and the commands that serve it.

``eagle export`` writes the card; ``eagle eval`` fills in its evaluation section (between two markers) when the
evaluated draft folder holds one of our cards. A folder whose README.md lacks :data:`MARKER` is someone else's and
is never written over.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle.batch_schedule import describe as describe_sweep
from eagle.fileio import write_text_atomic

CARD_FILE = "README.md"
MARKER = "<!-- eagle-heads model card -->"
EVAL_START = "<!-- eagle-eval:start -->"
EVAL_END = "<!-- eagle-eval:end -->"
SGLANG_ALGORITHMS = {"eagle3": "EAGLE3", "speculators": "EAGLE3", "eagle1": "EAGLE"}
VLLM_METHODS = {"eagle3": "eagle3", "eagle1": "eagle"}
SIM_TAU_NOTE = (
    "The validation sim tau comes from the validation split during training, not from decoding: at every "
    "validation position, one plus the drafts a chain would accept at temperature 0 (each TTT step's top-1 "
    "equal to the target's next token, up to the first miss). `eagle eval`'s *tau, chain* below measures a "
    "chain (of `eval.chain_depth` drafts) in the real speculative loop on its own prompts; the loop drafts only "
    "from the positions it stops at, so the two differ a little even on the same text."
)


def is_our_card(path: str | Path) -> bool:
    """True when ``path`` is a model card written by eagle-heads."""
    path = Path(path)
    try:
        return path.is_file() and MARKER in path.read_text(encoding="utf-8", errors="replace")[:2000]
    except OSError:
        return False


def _rows(pairs: list[tuple[str, Any]]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in pairs if v not in (None, "", [])]
    return "\n".join(lines)


def serving_commands(export_dir: str, layout: str, target_path: str, k: int = 3) -> str:
    """vLLM (offline API and server) and SGLang commands that serve ``target_path`` with this head."""
    spec: dict[str, Any] = {"model": export_dir, "num_speculative_tokens": k}
    if layout in VLLM_METHODS:
        spec = {"method": VLLM_METHODS[layout], **spec}
    spec_json = json.dumps(spec)
    python = (
        "from vllm import LLM, SamplingParams\n\n"
        'if __name__ == "__main__":  # vLLM starts worker processes\n'
        f"    llm = LLM(model={target_path!r}, speculative_config={spec!r})\n"
        '    print(llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0))[0].outputs[0].text)'
    )
    sglang = (
        f"python -m sglang.launch_server --model-path {target_path} --speculative-algorithm "
        f"{SGLANG_ALGORITHMS[layout]} --speculative-draft-model-path {export_dir} "
        f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    )
    return (
        f"vLLM, offline:\n\n```python\n{python}\n```\n\n"
        f"vLLM, server:\n\n```bash\nvllm serve {target_path} --speculative-config '{spec_json}'\n```\n\n"
        f"SGLang:\n\n```bash\n{sglang}\n```\n\n"
        "vLLM drafts a chain of `num_speculative_tokens` (no tree); SGLang takes trees through "
        "`--speculative-eagle-topk` > 1. The target must be the exact weights named above."
    )


def render_card(head: dict[str, Any], layout: str, dtype: str, target: dict[str, Any], export_dir: str,
                training: dict[str, Any] | None = None, eval_section: str | None = None) -> str:
    """The card's Markdown. ``head`` is the HeadConfig as a dict, ``target`` :func:`eagle.targets.provenance`,
    ``training`` what the run recorded (data counts, steps, time, validation accuracy), all optional but the
    head and target."""
    kind = "EAGLE-3" if head["kind"] == "eagle3" else "EAGLE-1/2"
    name = target.get("name") or head.get("target_name") or "its target"
    parts = [
        f"# {kind} draft head for {name}",
        MARKER,
        f"A draft head for speculative decoding of **{name}**, made with eagle-heads: one decoder layer that "
        "drafts tokens from the target's own hidden states"
        + (f" (layers {head.get('aux_layers')})" if head["kind"] == "eagle3" else "")
        + ". The target verifies every drafted token, so the output is exactly the target's.",
        "## Target",
        _rows([
            ("name", name),
            ("weights", target.get("weights")),
            ("original model", target.get("original")),
            ("path it was trained from", f"`{target.get('path')}`" if target.get("path") else None),
            ("fingerprint", f"`{target.get('fingerprint')}`" if target.get("fingerprint") else None),
            ("features computed in", target.get("dtype")),
            ("architecture", ", ".join(target.get("architectures") or [])),
        ]),
        "Serve this head with exactly these weights. A head learns the hidden states of the weights it was "
        "trained on; other weights of the same model (another quantization, or the full-precision original of "
        "a quantized target) give it slightly different features, and its acceptance drops.",
        "## Head",
        _rows([
            ("layout", f"{layout} ({dtype})"),
            ("hidden size", head.get("hidden_size")),
            ("draft vocabulary", head.get("draft_vocab_size") if head["kind"] == "eagle3" else None),
            ("target vocabulary", head.get("vocab_size")),
            ("aux layers (HF hidden_states ids)", head.get("aux_layers") if head["kind"] == "eagle3" else None),
        ]),
    ]
    if training:
        parts += ["## Training", _rows(list(training.items()))]
        if any(str(k).startswith("validation sim tau") for k in training):
            parts.append(SIM_TAU_NOTE)
    parts += [
        "## Evaluation",
        EVAL_START,
        eval_section or "Not evaluated yet: `eagle eval --draft <this folder>` fills in this section.",
        EVAL_END,
        "## Serving",
        serving_commands(export_dir, layout, str(target.get("path") or name)),
    ]
    return "\n\n".join(parts) + "\n"


def eval_markdown(report: dict[str, Any]) -> str:
    """The evaluation section from an ``eagle eval`` report (any engine)."""
    engine = report.get("engine", "hf")
    tree = report.get("tree") or {}
    lines = [
        f"`eagle eval` ({engine}) on {report.get('device')}, {report.get('dtype')}, "
        f"{report['settings']['max_new_tokens']} new tokens, T={report['settings'].get('temperature', 0)}; "
        f"tree: {tree.get('policy')} depth {tree.get('depth')}, {report.get('date', '')[:10]}.",
        "",
        "| set | prompts | tau | tau, chain | speedup | greedy match |",
        "|---|---|---|---|---|---|",
    ]
    sections = list((report.get("prompt_sets") or {}).items()) + [("overall", report["overall"])]
    for name, s in sections:
        tau = s.get("acceptance_length_mean")
        chain = s.get("chain_acceptance_length_mean")
        speed = s.get("speedup")
        match = s.get("greedy_match_rate")
        lines.append(
            f"| {name} | {s['num_prompts']} | {tau:.2f} | {'-' if chain is None else f'{chain:.2f}'} | "
            f"{'-' if speed is None else f'{speed:.2f}x'} | {'-' if match is None else f'{100 * match:.0f}%'} |"
            if tau is not None else f"| {name} | {s['num_prompts']} | - | - | - | - |"
        )
    if engine == "vllm":
        lines.append("")
        lines.append("tau here is vLLM's (a chain of `num_speculative_tokens`), speedup over vLLM without the head.")
        if report.get("batch_sweep"):
            text = describe_sweep(report["batch_sweep"])
            lines += ["", f"{text[0].upper()}{text[1:]}."]
    return "\n".join(lines)


def update_eval_section(export_dir: str | Path, report: dict[str, Any]) -> bool:
    """Write the evaluation section of our card in ``export_dir`` (False when there is no card of ours)."""
    path = Path(export_dir) / CARD_FILE
    if not is_our_card(path):
        return False
    text = path.read_text(encoding="utf-8")
    start, end = text.find(EVAL_START), text.find(EVAL_END)
    if start < 0 or end < start:
        return False
    new = text[: start + len(EVAL_START)] + "\n" + eval_markdown(report) + "\n" + text[end:]
    write_text_atomic(new, path)
    return True
