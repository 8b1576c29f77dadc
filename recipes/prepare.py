"""``eagle prepare``: chat data -> token ids + assistant loss masks, the answers optionally written by the target.

Reads the ``target``, ``data`` and (for the features regeneration keeps) ``collect`` sections.
"""

from __future__ import annotations

from typing import Any

from recipes.config import RunConfig
from recipes.console import say_summary, setup_logging


def run(cfg: RunConfig) -> dict[str, Any]:
    """Prepare the run's data (``train.prepare.prepare``); returns its summary."""
    from train.prepare import prepare

    setup_logging()
    summary = prepare(cfg.data, cfg.target, collect=cfg.collect)
    say_summary("prepare", summary)
    return summary
