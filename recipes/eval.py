"""``eagle eval``: the exported head against plain decoding on prompt sets, in our tree loop (``hf``), served by
vLLM (``vllm``), or both with their parity check (``both``).

Reads the ``eval`` and ``target`` sections. When the evaluated folder holds our model card, its evaluation section
is filled in with the results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from recipes.config import RunConfig
from recipes.console import console, setup_logging


def run(cfg: RunConfig) -> dict[str, Any]:
    """Evaluate ``eval.draft`` on ``eval.prompts`` with ``eval.engine``; returns the report (also written)."""
    from eagle.evaluate import evaluate
    from eagle.model_card import update_eval_section
    from eagle.targets import load_target

    setup_logging()
    draft = Path(cfg.eval.draft)
    if not (draft / "config.json").is_file():
        raise EagleError(
            f"no exported draft head at {draft} (config.json missing): train and export one "
            "(`eagle train`, `eagle export`) or pass --draft <dir>"
        )
    if cfg.eval.engine == "vllm":
        from eagle.vllm_eval import evaluate_vllm

        report = evaluate_vllm(cfg.eval, cfg.target.name, cfg.target.dtype, cfg.target.trust_remote_code)
    else:
        target = load_target(cfg.target)
        if cfg.eval.engine == "both":
            from eagle.vllm_eval import evaluate_both

            report = evaluate_both(cfg.eval, target, cfg.target.name, trust_remote_code=cfg.target.trust_remote_code)
        else:
            report = evaluate(cfg.eval, target)
    if update_eval_section(draft, report):
        console().print(f"eval: the model card {draft / 'README.md'} shows this evaluation")
    return report

