"""``eagle train``: fit the draft head, offline from feature shards or online with the target in the loop.

Reads the ``target``, ``data``, ``collect`` (where the shards are), ``head`` and ``train`` sections. The same entry
point under every launcher: ``eagle train ...``, ``accelerate launch -m recipes train ...``, ``torchrun -m
recipes train ...`` and ``deepspeed --module recipes train ...`` (which adds ``--local_rank``).
"""

from __future__ import annotations

from typing import Any

from recipes.config import RunConfig


def run(cfg: RunConfig) -> Any:
    """Train (``train.trainer.train``); returns its ``TrainResult``."""
    from recipes.console import setup_logging
    from train.trainer import train

    setup_logging()
    return train(cfg=cfg.train, head=cfg.head, target=cfg.target, data_dir=cfg.data.output_dir,
                 features_dir=cfg.collect.output_dir)

