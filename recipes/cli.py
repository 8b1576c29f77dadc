"""The ``eagle`` command: prepare, collect, train, export, eval, demo, and ``config show``.

Every stage takes ``--config FILE.yaml`` (a path or a shipped config's name) plus dotted ``key=value`` overrides,
and, once it succeeds, saves the config it ran with as ``<run_dir>/config.yaml``; a stage run without
``--config`` starts from that file, so one run's settings need not be repeated stage after stage. User errors (:class:`eagle.errors.EagleError`)
print one clear message and exit with status 2; a check that ran and failed (:class:`eagle.errors.CheckFailed`,
e.g. engine parity) exits with 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from eagle.errors import CheckFailed, EagleError

STAGES = ("prepare", "collect", "train", "export", "eval", "demo")

HELP = {
    "prepare": "render chat data with the target's template (optionally regenerating answers) into token ids + loss masks",
    "collect": "run the frozen target over prepared data and write hidden-state shards",
    "train": "train a draft head (offline from shards or online); works under torchrun/accelerate/deepspeed",
    "export": "export a trained head as safetensors + config.json + model card (eagle3 / eagle1 / speculators)",
    "eval": "speculative vs plain decoding on prompt sets (our loop, vLLM, or both): tau, speedup, greedy match",
    "demo": "the main job end to end on the embedded defaults: prepare, collect, train, export, eval",
}
# flag -> config key, for the stages that have the flag
FLAG_KEYS = {
    "target": "target.name", "draft": "eval.draft", "max_new_tokens": "eval.max_new_tokens",
    "temperature": "eval.temperature", "engine": "eval.engine", "checkpoint": "export.checkpoint",
    "layout": "export.layout", "budget": "demo.budget_minutes", "deepspeed": "train.deepspeed",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eagle-heads")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None,
                   help="run config: a YAML path or a shipped config's name (default: the run directory's saved "
                        "config.yaml, else smollm2_demo)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4")


def _add_stage_flags(name: str, p: argparse.ArgumentParser) -> None:
    if name == "eval":
        p.add_argument("--target", default=None, help="HF model id or path (default: the config's)")
        p.add_argument("--draft", default=None, help="exported draft directory (model.safetensors + config.json)")
        p.add_argument("--prompts", action="append", default=None,
                       help="prompts JSONL, hf:<dataset>[:split], or a named set (dev-chat, dev-code, humaneval, mt-bench, "
                            "chitchat-eval); repeatable")
        p.add_argument("--max-new-tokens", type=int, default=None)
        p.add_argument("--temperature", type=float, default=None)
        p.add_argument("--out", default=None, help="report.json path (plots are written beside it)")
        p.add_argument("--engine", default=None, choices=["hf", "vllm", "both"],
                       help="hf: our tree loop (default); vllm: the export served by vLLM; both: the two and "
                       "their parity check (exit status 1 when vLLM accepts less)")
    if name == "export":
        p.add_argument("--checkpoint", default=None, help="checkpoint dir (default: the run's final head)")
        p.add_argument("--layout", default=None, choices=["eagle3", "eagle1", "speculators"])
        p.add_argument("--out", default=None, help="output directory")
        p.add_argument("--target", default=None, help="target the head must match (default: the config's)")
    if name == "train":
        p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (same as train.deepspeed=...)")
        p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    if name == "demo":
        p.add_argument("--budget", type=float, default=None, help="minutes the demo aims at (trades time for quality)")
        p.add_argument("--fresh", action="store_true", help="redo all stages instead of resuming finished ones")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``eagle`` command."""
    parser = argparse.ArgumentParser(prog="eagle", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"eagle-heads {_version()}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    # the deepspeed launcher puts --local_rank=N before the stage name (LOCAL_RANK in the environment says the same)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in STAGES:
        p = sub.add_parser(name, help=HELP[name], description=HELP[name])
        _add_config_args(p)
        _add_stage_flags(name, p)
    config = sub.add_parser("config", help="show the resolved run config", description="show the resolved run config")
    config_sub = config.add_subparsers(dest="action", required=True)
    show = config_sub.add_parser("show", help="every key: its value, its default and what it does")
    _add_config_args(show)
    return parser


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    """The convenience flags of eval/export/train/demo as config overrides."""
    extra = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag, None) is not None]
    if getattr(args, "prompts", None):
        extra.append("eval.prompts=[" + ",".join(args.prompts) + "]")
    if getattr(args, "out", None):
        extra.append(("eval.report" if args.command == "eval" else "export.output_dir") + f"={args.out}")
    return extra


def show_config(cfg: Any) -> str:
    """``eagle config show``: one line per key, ``key: value  (default ...)  # help``."""
    from recipes.config import describe

    lines = []
    for key, value, default, text in describe(cfg):
        changed = "" if value == default else f"  (default {default!r})"
        lines.append(f"{key}: {value!r}{changed}" + (f"  # {text}" if text else ""))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    from recipes.config import SAVED_CONFIG, load_config, save_config

    overrides = list(args.overrides) + _flag_overrides(args)
    # the demo always starts from its config, never from a saved one: it scales and limits what it saves
    cfg = load_config(args.config, overrides, use_saved=args.command not in ("demo",))
    if args.command == "config":
        print(show_config(cfg))
        return
    if args.command == "demo":
        from recipes.demo import run

        run(cfg, fresh=args.fresh)
        return
    import importlib

    stage = importlib.import_module(f"recipes.{args.command}")
    stage.run(cfg)
    # saved only once the stage succeeded: a rejected config must not replace the one the run was made with
    if _is_main_process():
        save_config(cfg, Path(cfg.run_dir) / SAVED_CONFIG)


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eagle`` console script."""
    parser = build_parser()
    # overrides may also follow the flags (`eagle eval --engine vllm eval.max_prompts=2`): argparse takes one run
    # of positionals per subcommand, so later key=value words come back unknown and join the overrides
    args, rest = parser.parse_known_args(argv)
    stray = [word for word in rest if "=" not in word or word.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = list(args.overrides) + rest
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        _run(args)
    except CheckFailed as exc:
        if args.debug:
            raise
        print(f"eagle {args.command}: check failed: {exc}", file=sys.stderr)
        return 1
    except EagleError as exc:
        if args.debug:
            raise
        print(f"eagle {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eagle {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
