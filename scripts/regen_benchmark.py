#!/usr/bin/env python
"""Regeneration throughput: our HF loop vs vLLM writing the answers of the same prompts, side by side.

    python scripts/regen_benchmark.py --conversations 256 --engines hf vllm

Runs ``eagle prepare``'s regeneration (the demo recipe's sources, answer length and batch size) once per engine
on the same prompts, in turn, each into its own folder, and reports conversations and answer tokens per second
(model loading included and apart). Engine ``hf-sdpa`` is our loop with transformers' stock SDPA attention, which
copies the grouped key/value heads at every step (``hf`` uses :mod:`eagle.attention` on a CPU). Writes
``benchmarks/<name>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.fileio import write_json_atomic  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_demo.yaml"))
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "hf-sdpa", "vllm"])
    parser.add_argument("--name", default=None)
    args = parser.parse_args()

    from eagle.targets import load_tokenizer
    from recipes.config import load_config
    from train.prepare import prepare
    from train.regenerate import read_partial

    cfg = load_config(args.config, [f"data.max_conversations={args.conversations}"])
    tokenizer = load_tokenizer(cfg.target.name)
    rows, texts = {}, {}
    with tempfile.TemporaryDirectory(prefix="regen-bench-") as tmp:
        for engine in args.engines:
            loop = engine.split("-")[0]
            data = replace(cfg.data, regen_engine=loop, output_dir=str(Path(tmp) / engine), regen_max_minutes=None,
                           capture_features=cfg.data.capture_features and loop == "hf")
            target = replace(cfg.target, attention="sdpa") if engine == "hf-sdpa" else cfg.target
            t0 = time.perf_counter()
            summary = prepare(data, target, collect=cfg.collect)
            seconds = time.perf_counter() - t0
            answers = read_partial(next(Path(data.output_dir).glob("regen-*.jsonl")))
            texts[engine] = answers
            tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in answers.values())
            rows[engine] = {"conversations": len(answers), "answer_tokens": tokens, "seconds": seconds,
                            "conversations_per_s": len(answers) / seconds, "tokens_per_s": tokens / seconds,
                            "capture_features": data.capture_features, "prepare_seconds": summary["seconds"]}
            print(f"{engine:7} {len(answers)} conversations, {tokens:,} answer tokens in {seconds:.0f} s: "
                  f"{len(answers) / seconds:.2f} conv/s, {tokens / seconds:.0f} tok/s", flush=True)
    if "hf" in texts:  # the same prompts answered the same way? (the attention change must not alter answers)
        for engine in rows:
            same = sum(texts[engine].get(key) == text for key, text in texts["hf"].items())
            rows[engine]["answers_identical_to_hf"] = same
            print(f"{engine:7} {same} of {len(texts['hf'])} answers identical to hf's")
    name = args.name or f"{datetime.date.today()}-regen-engines"
    out = ROOT / "benchmarks" / f"{name}.json"
    write_json_atomic({"kind": "regen-throughput", "command": " ".join(sys.argv), "config": args.config,
                       "settings": {"max_new_tokens": cfg.data.regen_max_new_tokens,
                                    "batch_size": cfg.data.regen_batch_size, "sources": cfg.data.sources},
                       "engines": rows}, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
