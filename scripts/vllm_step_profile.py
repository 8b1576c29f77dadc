#!/usr/bin/env python
"""Where the time of a vLLM decoding step goes, with and without the exported head (batch 1, greedy).

    python scripts/vllm_step_profile.py --draft runs/demo/export --dtype float32 --k 3 --name DATE-vllm-step-profile

Both engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the prompts decoded one at a time with
the engines taking turns. Wall time is summed over the engine's own methods (the target's forward, the logits and
sampling, the head's proposal, the rejection sampler, the scheduler), wrapped in place for this run: the names
are those of vLLM 0.32's V1 engine, and a method another version lacks is left out of the table. The parts nest
(a step holds the model runner's execute_model, which holds the forward; sample_tokens holds the sampling and the
head's proposal), as the table's indentation shows. No device is synchronised: the times are right on a CPU
only. Prints ms per engine step for each part, writes ``benchmarks/<name>.json``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUNNER = "vllm.v1.worker.gpu_model_runner"
# (nesting level, module, class, method): the parts of one engine step, each inside the last one a level up
PARTS = (
    (0, "vllm.v1.engine.core", "EngineCore", "step"),
    (1, RUNNER, "GPUModelRunner", "execute_model"),
    (2, RUNNER, "GPUModelRunner", "_prepare_inputs"),
    (2, RUNNER, "GPUModelRunner", "_model_forward"),
    (1, RUNNER, "GPUModelRunner", "sample_tokens"),
    (2, RUNNER, "GPUModelRunner", "_sample"),
    (3, "vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward"),
    (2, RUNNER, "GPUModelRunner", "propose_draft_token_ids"),
    (3, "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "propose"),
    (1, "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    (1, "vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
)


class Clock:
    """Summed wall time and calls per wrapped method, for the engine whose turn it is."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.engine: str | None = None

    def wrap(self, module: str, cls_name: str, method: str) -> bool:
        cls = getattr(importlib.import_module(module), cls_name, None)
        fn = getattr(cls, method, None) if cls is not None else None
        if fn is None:
            return False
        label = f"{cls_name}.{method}"

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.engine is not None:
                    self.seconds[self.engine][label] += time.perf_counter() - t0
                    self.calls[self.engine][label] += 1

        setattr(cls, method, timed)
        return True


def _prompts(target_dir: str, sets: list[str], per_set: int) -> list[list[int]]:
    from eagle.prompts import load_prompt_sets
    from eagle.targets import load_tokenizer

    loaded = load_prompt_sets(sets, load_tokenizer(target_dir), per_set)
    return [ids for _, items in loaded for _, ids in items]


def profile(args: argparse.Namespace) -> dict[str, Any]:
    from eagle.vllm_engine import EngineSpec, Job, VllmConfig, worker_env

    # the engines `eagle eval --engine vllm` builds, in its worker's environment (offline before anything looks
    # for the target), here in this process so that their methods can be timed
    job = Job(kind="decode", target=args.target, dtype=args.dtype, prompts=[], max_new_tokens=args.max_new_tokens,
              engines=[EngineSpec("plain"), EngineSpec(f"k{args.k}", args.draft, args.k)], stop_token_ids=[],
              max_model_len=2048, vllm=VllmConfig(kv_cache_gb=args.kv_cache_gb))
    os.environ.update(worker_env(job))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle.targets import resolve_target
    from eagle.vllm_worker import build_engine

    clock = Clock()
    wrapped = [(level, f"{c}.{m}") for level, mod, c, m in PARTS if clock.wrap(mod, c, m)]
    if not wrapped or wrapped[0][1] != "EngineCore.step":
        raise SystemExit("this vLLM has no EngineCore.step to count steps by: the profile knows vLLM 0.32's V1 engine")
    job.target = target_dir = resolve_target(args.target)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in _prompts(target_dir, args.prompts, args.prompts_per_set)]
    engines = {e.name: build_engine(job, e, len(job.engines)) for e in job.engines}
    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    for llm in engines.values():  # warm-up, not timed
        llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    tokens: dict[str, int] = defaultdict(int)
    wall: dict[str, float] = defaultdict(float)
    names = list(engines)
    for i, prompt in enumerate(prompts):
        for name in names[i % 2:] + names[: i % 2]:
            clock.engine = name
            t0 = time.perf_counter()
            out = engines[name].generate([prompt], sampling, use_tqdm=False)[0]
            wall[name] += time.perf_counter() - t0
            clock.engine = None
            tokens[name] += len(out.outputs[0].token_ids)
    rows = {}
    for name in names:
        steps = clock.calls[name]["EngineCore.step"]
        rows[name] = {"tokens": tokens[name], "seconds": wall[name], "steps": steps,
                      "tokens_per_second": tokens[name] / wall[name], "tokens_per_step": tokens[name] / steps,
                      "ms_per_step": {k: 1000 * v / steps for k, v in clock.seconds[name].items()},
                      "ms_per_step_wall": 1000 * wall[name] / steps}
    return {"wrapped": wrapped, "engines": rows}


def _print(result: dict[str, Any]) -> str:
    rows = result["engines"]
    names = list(rows)
    lines = [f"{'ms per engine step':48}" + "".join(f"{n:>10}" for n in names)]
    lines.append("-" * len(lines[0]))
    lines.append(f"{'wall (one request at a time)':48}" + "".join(f"{rows[n]['ms_per_step_wall']:10.2f}" for n in names))
    for level, label in result["wrapped"]:
        lines.append(f"{'  ' * level + label:48}" + "".join(f"{rows[n]['ms_per_step'].get(label, 0.0):10.2f}"
                                                            for n in names))
    lines.append(f"{'tokens per step':48}" + "".join(f"{rows[n]['tokens_per_step']:10.2f}" for n in names))
    lines.append(f"{'tokens/s':48}" + "".join(f"{rows[n]['tokens_per_second']:10.1f}" for n in names))
    text = "\n".join(lines)
    print(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])  # vLLM's names
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", nargs="+", default=["dev-chat", "dev-code"])
    parser.add_argument("--prompts-per-set", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--kv-cache-gb", type=int, default=1)
    parser.add_argument("--name", default=None, help="benchmarks/<name>.json (default: print only)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the clock is
    result = profile(args)
    table = _print(result)
    if args.name:
        from eagle.fileio import write_json_atomic

        out = ROOT / "benchmarks" / f"{args.name}.json"
        write_json_atomic({"kind": "vllm-step-profile", "command": " ".join(sys.argv), "draft": args.draft,
                           "dtype": args.dtype, "k": args.k, **result, "table": table}, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
