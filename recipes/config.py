"""The run config: one YAML per run, one typed section per stage.

The library sections live beside the code that uses them (``eagle.targets.TargetConfig``,
``train.prepare.DataConfig``, ``train.collect.CollectConfig``, ``eagle.heads.HeadConfig``,
``train.trainer.TrainConfig``, ``eagle.evaluate.EvalConfig``); the two that belong to no library (``export``,
``demo``) live here. :class:`RunConfig` composes them; :func:`load_config` reads it from YAML plus dotted
``key=value`` overrides (:mod:`recipes.configlib`).

Where the base comes from: ``--config FILE`` (a path, or the name of a config shipped with the package, e.g.
``smollm2_demo``); without it, the run directory's own ``config.yaml`` (every stage that succeeds saves the
config it ran with there, so ``target.name=...`` given to ``eagle prepare`` need not be repeated for
``eagle train``); without that, the shipped demo config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from eagle.errors import EagleError
from eagle.evaluate import EvalConfig
from eagle.heads import HeadConfig
from eagle.targets import TargetConfig
from recipes.configlib import (
    deep_merge,
    field_help,
    fill_run_dir,
    from_dict,
    parse_overrides,
    read_yaml,
    to_dict,
    validate_all,
    write_yaml_atomic,
)
from train.collect import CollectConfig
from train.prepare import DataConfig
from train.trainer import TrainConfig

DEFAULT_CONFIG = "smollm2_demo.yaml"
SAVED_CONFIG = "config.yaml"  # in the run directory


@dataclass
class ExportConfig:
    """``export:`` section: which checkpoint to export, in which layout, where."""

    checkpoint: str = "{run_dir}/train/final"  # a training checkpoint or final/ folder
    layout: str = "eagle3"  # eagle3 (vLLM, SGLang) | speculators (vLLM's own format) | eagle1 (EAGLE-1/2 heads)
    output_dir: str = "{run_dir}/export"  # where the export goes
    dtype: str = "bfloat16"  # of the exported weights: bfloat16 | float16 | float32

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

    run_dir: str = "runs/demo"  # every stage's outputs go under it ({run_dir} in the paths below)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)


def shipped_configs() -> list[str]:
    """The run configs shipped inside the package (``configs/*.yaml``)."""
    return sorted(p.name for p in resources.files("configs").iterdir() if p.name.endswith(".yaml"))


def config_path(name: str | Path) -> Path:
    """A config file: an existing path, or the name of a shipped config (with or without ``.yaml``)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    shipped = path.name if path.suffix else f"{path.name}.yaml"
    if str(name) in (shipped, path.stem) or str(name) == f"configs/{shipped}":
        candidate = resources.files("configs") / shipped
        if candidate.is_file():
            return Path(str(candidate))
    raise EagleError(
        f"config file {name} does not exist: pass --config with an existing YAML file or one of the configs "
        f"shipped with eagle-heads ({', '.join(shipped_configs())})"
    )


def _run_dir_of(base: dict[str, Any], overrides: dict[str, Any]) -> str:
    return str(overrides.get("run_dir") or base.get("run_dir") or RunConfig.run_dir)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                use_saved: bool = False) -> RunConfig:
    """Load a run config from ``path`` (else, with ``use_saved``, the run directory's saved ``config.yaml``,
    else the shipped demo config) and apply ``key=value`` overrides. Unknown keys are rejected by name, values
    are type-checked and every section validated."""
    extra = parse_overrides(list(overrides or []))
    if path is not None:
        base = read_yaml(config_path(path))
    else:
        base = read_yaml(config_path(DEFAULT_CONFIG))
        saved = Path(_run_dir_of(base, extra)) / SAVED_CONFIG
        if use_saved and saved.is_file():
            base = read_yaml(saved)
    cfg = from_dict(RunConfig, deep_merge(base, extra))
    fill_run_dir(cfg, cfg.run_dir)
    validate_all(cfg)
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config (atomically) so a run can be reproduced exactly."""
    write_yaml_atomic(to_dict(cfg), path)


def describe(cfg: RunConfig) -> list[tuple[str, Any, Any, str]]:
    """``(key, value, default, help)`` for every key of the config, sections in order."""
    rows: list[tuple[str, Any, Any, str]] = []

    def walk(obj: Any, default: Any, prefix: str) -> None:
        helps = field_help(type(obj))
        for f in dataclasses.fields(obj):
            value, base = getattr(obj, f.name), getattr(default, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, base, f"{prefix}{f.name}.")
            else:
                rows.append((prefix + f.name, to_dict(value), to_dict(base), helps.get(f.name, "")))

    walk(cfg, RunConfig(), "")
    return rows
