"""The run config: one YAML per run, one typed section per stage.

Each section's dataclass lives beside the code that uses it (``eagle.targets.TargetConfig``,
``train.prepare.DataConfig``, ...); this module composes them into :class:`RunConfig` and loads it from
YAML plus dotted ``key=value`` overrides (see :mod:`train.configlib`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from eagle.evaluate import EvalConfig
from eagle.targets import TargetConfig
from train.collect import CollectConfig
from train.configlib import (
    deep_merge,
    fill_run_dir,
    from_dict,
    parse_overrides,
    read_yaml,
    to_dict,
    validate_all,
    write_yaml_atomic,
)
from train.prepare import DataConfig
from train.trainer import HeadSpec, TrainConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2_demo.yaml"


@dataclass
class ExportConfig:
    """``export:`` section: which checkpoint to export, in which layout, where."""

    checkpoint: str = "{run_dir}/train/final"
    layout: str = "eagle3"
    output_dir: str = "{run_dir}/export"
    dtype: str = "bfloat16"

    def validate(self) -> None:
        if self.layout not in ("eagle3", "eagle1", "speculators"):
            raise EagleError(f"export.layout must be eagle3, eagle1 or speculators, got {self.layout!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise EagleError(f"export.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")


@dataclass
class DemoConfig:
    """``demo:`` section: the end-to-end job's stage choices and time budget."""

    # wall time `eagle demo` aims at: data amount and training length scale with it, and regeneration, training
    # and evaluation stop early when their share of it is spent (so a slower machine gets a smaller head, not a
    # longer demo)
    budget_minutes: float = 30.0
    reserve_minutes: float = 2.5  # of the budget, kept free: the set-up before the demo starts, estimates' error
    collect: bool = True  # offline features (collect once, train several epochs) vs online training

    def validate(self) -> None:
        if self.budget_minutes <= 0:
            raise EagleError(f"demo.budget_minutes must be positive, got {self.budget_minutes}")
        if not 0 <= self.reserve_minutes < self.budget_minutes:
            raise EagleError(
                f"demo.reserve_minutes must be >= 0 and below demo.budget_minutes, got {self.reserve_minutes}"
            )


@dataclass
class RunConfig:
    """A whole run: where it lives and every stage's settings."""

    run_dir: str = "runs/demo"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    head: HeadSpec = field(default_factory=HeadSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config from YAML (default: ``configs/smollm2_demo.yaml``) and apply ``key=value`` overrides.

    Unknown keys are rejected by name, values are type-checked and every section validated.
    """
    base: dict[str, Any] = read_yaml(path or DEFAULT_CONFIG) if (path or DEFAULT_CONFIG.is_file()) else {}
    data = deep_merge(base, parse_overrides(list(overrides or [])))
    cfg = from_dict(RunConfig, data)
    fill_run_dir(cfg, cfg.run_dir)
    validate_all(cfg)
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (atomically) so a run can be reproduced exactly."""
    write_yaml_atomic(to_dict(cfg), path)
