"""What every stage prints through: a rich console and plain logging lines."""

from __future__ import annotations

import json
import logging
from typing import Any


def setup_logging() -> None:
    """Log lines without decoration (the stages' own messages), unless the caller configured logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")


def console() -> Any:
    from rich.console import Console

    return Console()


def say_summary(stage: str, summary: dict[str, Any]) -> None:
    """One line with a stage's summary: its scalar fields as JSON."""
    flat = {k: v for k, v in summary.items() if not isinstance(v, dict | list)}
    console().print(f"[bold]{stage}[/]: {json.dumps(flat)}")
