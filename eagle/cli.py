"""The ``eagle`` console script: prepare, collect, train, export, eval, demo.

Every subcommand takes ``--config FILE.yaml`` plus dotted ``key=value`` overrides. User errors
(:class:`eagle.errors.EagleError`) print one clear message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from eagle.errors import CheckFailed, EagleError

STAGES = ("prepare", "collect", "train", "export", "eval", "demo")

HELP = {
    "prepare": "render chat data with the target's template (optionally regenerating answers) into token ids + loss masks",
    "collect": "run the frozen target over prepared data and write hidden-state shards",
    "train": "train a draft head (offline from shards or online); works under torchrun/accelerate/deepspeed",
    "export": "export a trained head as safetensors + config.json (eagle3 / eagle1 / speculators layouts)",
    "eval": "speculative vs plain decoding on prompt sets: acceptance length, speedup, greedy match",
    "demo": "the main job end to end on the embedded defaults: prepare, train, export, eval",
}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="run config YAML (default: configs/smollm2_demo.yaml values)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``eagle`` command."""
    parser = argparse.ArgumentParser(prog="eagle", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in STAGES:
        p = sub.add_parser(name, help=HELP[name], description=HELP[name])
        _add_config_args(p)
        if name == "eval":
            p.add_argument("--target", default=None, help="HF model id or path (default: embedded SmolLM2)")
            p.add_argument("--draft", default=None, help="exported draft directory (model.safetensors + config.json)")
            p.add_argument("--prompts", action="append", default=None,
                           help="prompts JSONL or a named set (dev-chat, dev-code); repeatable")
            p.add_argument("--max-new-tokens", type=int, default=None)
            p.add_argument("--temperature", type=float, default=None)
            p.add_argument("--out", default=None, help="report.json path (plots are written beside it)")
            p.add_argument("--engine", default=None, choices=["hf", "vllm", "both"],
                           help="hf: our tree loop (default); vllm: the export served by vLLM; both: the two and "
                           "their parity check (exit status 1 when vLLM accepts far less)")
        if name == "export":
            p.add_argument("--checkpoint", default=None, help="checkpoint dir (default: the run's final head)")
            p.add_argument("--layout", default=None, choices=["eagle3", "eagle1", "speculators"])
            p.add_argument("--out", default=None, help="output directory")
            p.add_argument("--target", default=None, help="target the head must match (default: the config's)")
        if name == "demo":
            p.add_argument("--budget", type=float, default=None, help="minutes the demo aims at (trades time for quality)")
            p.add_argument("--fresh", action="store_true", help="redo all stages instead of resuming finished ones")
    return parser


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    """Turn the convenience flags of eval/export/demo into config overrides."""
    extra: list[str] = []
    for flag, key in (
        ("target", "target.name"),
        ("draft", "eval.draft"),
        ("max_new_tokens", "eval.max_new_tokens"),
        ("temperature", "eval.temperature"),
        ("engine", "eval.engine"),
        ("checkpoint", "export.checkpoint"),
        ("layout", "export.layout"),
        ("budget", "demo.budget_minutes"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            extra.append(f"{key}={value}")
    if getattr(args, "prompts", None):
        extra.append("eval.prompts=[" + ",".join(args.prompts) + "]")
    if getattr(args, "out", None):
        extra.append(("eval.report" if args.command == "eval" else "export.output_dir") + f"={args.out}")
    return extra


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``eagle`` console script."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from train import pipeline
        from train.config import load_config

        cfg = load_config(args.config, list(args.overrides) + _flag_overrides(args))
        stage = getattr(pipeline, f"run_{args.command}")
        if args.command == "demo":
            stage(cfg, fresh=args.fresh)
        else:
            stage(cfg)
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
