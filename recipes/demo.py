"""``eagle demo``: the main job end to end -- prepare (with regeneration) -> collect -> train -> export -> eval --
inside a time budget, resuming finished stages.

Reads every section; owns ``demo`` (the budget). Finished stages are recorded in ``<run_dir>/stages.json`` with a
hash of the settings each depends on, so a rerun skips them. The budget is kept on any machine: regeneration,
training and evaluation each get a share of the time left as their own limit (``data.regen_max_minutes``,
``train.max_minutes``, ``eval.max_minutes``), so a slower machine gets a head trained on less, not a longer demo.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle.fileio import write_json_atomic
from recipes.collect import run as run_collect
from recipes.config import RunConfig, save_config
from recipes.configlib import to_dict
from recipes.console import console, setup_logging
from recipes.eval import run as run_eval
from recipes.export import run as run_export
from recipes.prepare import run as run_prepare
from recipes.train import run as run_train
from train.sources import parse_source_spec

RUNNERS: dict[str, Callable[[RunConfig], Any]] = {
    "prepare": run_prepare, "collect": run_collect, "train": run_train, "export": run_export, "eval": run_eval,
}
# the sections whose settings a stage's output depends on (a change reruns it and every later stage)
STAGE_SECTIONS = {
    "prepare": ("target", "data"),
    "collect": ("target", "data", "collect"),
    "train": ("target", "data", "collect", "head", "train"),
    "export": ("target", "data", "collect", "head", "train", "export"),
    "eval": ("target", "data", "collect", "head", "train", "export", "eval"),
}
# rough share of the demo's wall time per stage on a 2-core CPU: the ETA shown between stages, and how the time
# left is shared out among the stages that take a time limit. Collection only copies the features regeneration
# kept (data.capture_features); running the target over all the data instead takes about 0.12
STAGE_WEIGHT = {"prepare": 0.39, "collect": 0.01, "train": 0.40, "export": 0.01, "eval": 0.19}
COLLECT_WEIGHT_UNCAPTURED = 0.12
# the stages that stop early when their share of the budget is spent: (config section, limit key)
TIME_LIMITS = {"prepare": ("data", "regen_max_minutes"), "train": ("train", "max_minutes"),
               "eval": ("eval", "max_minutes")}
MIN_STAGE_MINUTES = 1.0  # what a time-limited stage gets even when the budget is already spent


def stage_weights(cfg: RunConfig) -> dict[str, float]:
    """:data:`STAGE_WEIGHT` for this run: collection weighs more when regeneration keeps no features (vLLM never
    keeps them)."""
    weights = dict(STAGE_WEIGHT)
    if not (cfg.data.regenerate and cfg.data.capture_features and cfg.data.regen_engine == "hf"):
        weights["collect"] = COLLECT_WEIGHT_UNCAPTURED
    return weights


def stage_hash(cfg: RunConfig, stage: str) -> str:
    """What a stage's output depends on: its sections, without how long or how resumably it runs."""
    data = {s: to_dict(getattr(cfg, s)) for s in STAGE_SECTIONS[stage]}
    if "train" in data:  # how to run, not what to produce (the demo itself changes resume)
        for key in ("progress", "resume"):
            data["train"].pop(key, None)
    for section, key in TIME_LIMITS.values():  # set from the time left, which differs on every run
        data.get(section, {}).pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def apply_budget(cfg: RunConfig, minutes: float, default_minutes: float = 30.0) -> None:
    """Scale the data amount and training length to a time budget (the defaults fit ``default_minutes``)."""
    factor = minutes / default_minutes
    if math.isclose(factor, 1.0):
        return
    # each floor keeps a short budget useful, but never raises a value the config itself set lower
    if cfg.data.max_conversations:
        cfg.data.max_conversations = _scaled(cfg.data.max_conversations, factor, floor=16)
    if factor > 1:  # a larger cap alone would only add epochs over the same prompts: draw more of each source
        cfg.data.sources = [_scaled_source(spec, factor) for spec in cfg.data.sources]
    if cfg.train.max_steps:
        cfg.train.max_steps = _scaled(cfg.train.max_steps, factor, floor=20)
    if cfg.eval.max_prompts and factor < 1:
        cfg.eval.max_prompts = _scaled(cfg.eval.max_prompts, factor, floor=4)


def _scaled(value: int, factor: float, floor: int) -> int:
    return max(min(floor, value), int(value * factor))


def _scaled_source(spec: str, factor: float) -> str:
    """``chitchat:900`` -> ``chitchat:2700`` at factor 3; other specs (files, hub data, uncounted) as they are.
    A count past what a source holds just takes all of it."""
    if spec.strip().partition(":")[0] not in ("chitchat", "stdlib-code", "sharegpt"):
        return spec  # not parsed here: a file's existence is prepare's to check
    parsed = parse_source_spec(spec)
    return f"{parsed.kind}:{int(parsed.limit * factor)}" if parsed.limit else spec


def limit_stage(cfg: RunConfig, stage: str, stages_left: list[str], seconds_left: float) -> float | None:
    """Give a time-limited ``stage`` its share of the time left (minutes; a smaller limit the user set stays)."""
    if stage not in TIME_LIMITS:
        return None
    weights = stage_weights(cfg)
    share = weights[stage] / sum(weights[s] for s in stages_left)
    minutes = max(MIN_STAGE_MINUTES, seconds_left * share / 60)
    section, key = TIME_LIMITS[stage]
    own = getattr(getattr(cfg, section), key)
    setattr(getattr(cfg, section), key, minutes if own is None else min(own, minutes))
    return getattr(getattr(cfg, section), key)


class Demo:
    """One ``eagle demo`` run: the stage list, their stamps on disk, and the clock."""

    def __init__(self, cfg: RunConfig, fresh: bool):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.stamps_path = self.run_dir / "stages.json"
        self.stamps: dict[str, Any] = {}
        if self.stamps_path.is_file() and not fresh:
            self.stamps = json.loads(self.stamps_path.read_text(encoding="utf-8"))
        self.stages = ["prepare"] + (["collect"] if cfg.demo.collect else []) + ["train", "export", "eval"]
        self.weights = stage_weights(cfg)
        self.start = time.time()
        self.done_weight = 0.0
        self.console = console()

    def banner(self, i: int, stage: str) -> None:
        from rich.rule import Rule

        elapsed = time.time() - self.start
        total = sum(self.weights[s] for s in self.stages)
        eta = ""
        if self.done_weight > 0 and elapsed > 5:
            eta = f", ETA {(elapsed / self.done_weight * (total - self.done_weight)) / 60:.1f} min"
        self.console.print(Rule(f"[bold]stage {i}/{len(self.stages)}: {stage}[/]  (elapsed {elapsed / 60:.1f} min{eta})"))

    def run_stage(self, i: int, stage: str) -> Any:
        """Run one stage unless it is done with these settings; returns its result (None when skipped)."""
        cfg = self.cfg
        key = stage_hash(cfg, stage)
        previous = self.stamps.get(stage, {})
        if previous.get("key") == key and previous.get("status") == "done":
            self.console.print(f"{stage}: already done with these settings (see {self.stamps_path}); skipping")
            return None
        if stage == "train" and previous.get("key") != key and cfg.train.resume == "auto":
            cfg.train.resume = "never"  # checkpoints left by a run with other settings must not be continued
        for later in self.stages[i - 1 :]:  # this stage reruns, so every later stage must too
            self.stamps.pop(later, None)
        seconds_left = (cfg.demo.budget_minutes - cfg.demo.reserve_minutes) * 60 - (time.time() - self.start)
        limit = limit_stage(cfg, stage, self.stages[i - 1 :], seconds_left)
        stamp = {"key": key, "status": "running", "started": time.strftime("%F %T")}
        if limit is not None:
            self.console.print(f"{stage}: time limit {limit:.1f} min (its share of the budget left)")
            stamp["time_limit_minutes"] = round(limit, 2)
        self.stamps[stage] = stamp
        write_json_atomic(self.stamps, self.stamps_path)
        t0 = time.time()
        result = RUNNERS[stage](cfg)
        stamp.update(status="done", seconds=round(time.time() - t0, 1), finished=time.strftime("%F %T"))
        write_json_atomic(self.stamps, self.stamps_path)
        return result


def run(cfg: RunConfig, fresh: bool = False) -> dict[str, Any]:
    """Run every stage in turn, skipping those already done with the same settings; returns their results."""
    from rich.rule import Rule

    setup_logging()
    apply_budget(cfg, cfg.demo.budget_minutes)
    if not cfg.demo.collect:
        cfg.train.mode = "online"
    if fresh and cfg.train.resume == "auto":
        cfg.train.resume = "never"
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    save_config(cfg, Path(cfg.run_dir) / "config.yaml")  # before the stages set their time limits
    demo = Demo(cfg, fresh)
    results: dict[str, Any] = {}
    for i, stage in enumerate(demo.stages, 1):
        demo.banner(i, stage)
        results[stage] = demo.run_stage(i, stage)
        demo.done_weight += demo.weights[stage]
    total = time.time() - demo.start
    demo.console.print(Rule(f"[bold green]demo finished in {total / 60:.1f} min[/]"))
    demo.console.print(f"run directory: {demo.run_dir}  (config.yaml, train/, export/, eval/report.json and plots)")
    return results
