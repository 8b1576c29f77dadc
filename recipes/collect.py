"""``eagle collect``: the frozen target's hidden states over the prepared data, in verified shards.

Reads the ``target``, ``data`` (where the prepared data is) and ``collect`` sections. Under a multi-process launch
(``accelerate launch -m recipes collect ...``) every process drives its own GPU and writes every N-th shard.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from recipes.config import RunConfig


def run(cfg: RunConfig) -> dict[str, Any]:
    """Collect the features (``train.collect.collect``); returns the manifest."""
    from accelerate import PartialState

    from eagle.targets import load_target, prepack_for_cpu
    from recipes.console import setup_logging
    from train.collect import collect

    setup_logging()
    device = cfg.target.device
    if device not in ("cpu", "auto"):
        state = PartialState()
        device = str(state.device) if state.num_processes > 1 else device
    target = load_target(replace(cfg.target, dtype=cfg.collect.target_dtype or cfg.target.dtype, device=device))
    if cfg.target.cpu_prepack:
        prepack_for_cpu(target.model)  # no-op off the CPU; collection forwards ~2x faster on one
    return collect(cfg.collect, cfg.data.output_dir, target)

