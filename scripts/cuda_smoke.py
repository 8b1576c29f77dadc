"""A one-minute check of the CUDA paths on a tiny random target: every stage of recipe (a) on the GPU.

Runs ``eagle demo --config configs/smollm2_1gpu.yaml`` (target in bf16 on ``cuda``: prepare with regeneration and
feature capture, collect, offline training, export, eval with ``total_tokens: auto``) shrunk to seconds, then
online training, an fp32 eval and a temperature-0.7 eval. Exits non-zero when a stage fails or speculative decoding differs
from plain greedy decoding. Needs no weights: the tiny target is random, with SmolLM2's tokenizer.

    python scripts/cuda_smoke.py                      # the tokenizer from the embedded target
    python scripts/cuda_smoke.py --tokenizer DIR      # or from a folder holding tokenizer files
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.testing import tiny_model  # noqa: E402
from recipes.cli import main  # noqa: E402


def _shrunk(run_dir: Path, target: Path, *extra: str) -> list[str]:
    return [
        "--debug",
        "demo",
        "--config",
        str(ROOT / "configs" / "smollm2_1gpu.yaml"),
        f"run_dir={run_dir}",
        f"target.name={target}",
        "data.sources=[chitchat:24]",
        "data.max_length=192",
        "data.regen_max_new_tokens=24",
        "data.regen_batch_size=8",
        "data.capture_features=true",
        "head.draft_vocab_size=512",
        "train.epochs=2",
        "train.max_steps=30",
        "train.batch_size=4",
        "train.ttt_steps=3",
        "train.eval_every=15",
        "train.report_to=[none]",
        "train.progress=false",
        "eval.prompts=[dev-chat,dev-code]",
        "eval.max_prompts=2",
        "eval.max_new_tokens=24",
        *extra,
    ]


def main_smoke() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="folder with tokenizer files (default: embedded target)")
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check this script itself")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_smoke: no CUDA device visible to torch; nothing to check", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, " + (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"))
    root = Path(args.out or tempfile.mkdtemp(prefix="cuda-smoke-"))
    target = root / "tiny-target"
    tiny_model("llama", vocab_size=49152, hidden_size=64, num_layers=4).save_pretrained(target)
    if args.tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(target)
    else:
        from eagle.targets import load_tokenizer

        load_tokenizer("smollm2-135m-instruct").save_pretrained(target)

    run = root / "run"
    steps = {
        "demo (offline, total_tokens auto)": _shrunk(run, target, f"target.device={args.device}"),
        "train online": [
            "--debug", "train", "--config", str(run / "config.yaml"), "train.mode=online",
            f"train.output_dir={root / 'online'}", "train.max_steps=10", "train.resume=never",
        ],
        "eval fp32": [
            "--debug", "eval", "--config", str(run / "config.yaml"), "target.dtype=float32",
            f"eval.report={root / 'eval-fp32' / 'report.json'}",
        ],
        "eval t=0.7": [
            "--debug", "eval", "--config", str(run / "config.yaml"), "eval.temperature=0.7",
            f"eval.report={root / 'eval-t07' / 'report.json'}",
        ],
    }
    failed = []
    for name, argv in steps.items():
        start = time.time()
        try:
            rc = main(argv)
        except Exception:  # report every stage, not only the first failure
            traceback.print_exc()
            rc = -1
        print(f"== {name}: rc {rc} in {time.time() - start:.1f} s", flush=True)
        if rc != 0:
            failed.append(name)
    # bf16: a verification forward over many tokens may round a near-tie differently from a one-token step, so
    # only differences that are not near-ties count; fp32: every token must match
    for name, path, exact in (("bf16 greedy eval", run / "eval" / "report.json", False),
                              ("fp32 greedy eval", root / "eval-fp32" / "report.json", True)):
        if not path.is_file():
            failed.append(f"no report from the {name}")
            continue
        report = json.loads(path.read_text())
        overall, mismatches = report["overall"], report["greedy_mismatches"]
        print(f"{name}: tau {overall['acceptance_length_mean']:.2f}, greedy match {overall['greedy_match_rate']:.2f}, "
              f"prompt lookup match {overall['prompt_lookup_match_rate']:.2f}, mismatches {mismatches}")
        if (exact and overall["greedy_match_rate"] != 1.0) or mismatches.get("not_near_ties", 0) > 0:
            failed.append(f"{name}: speculative output differs from plain greedy decoding")
    print("cuda_smoke:", "FAILED " + "; ".join(failed) if failed else "all stages passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main_smoke())
