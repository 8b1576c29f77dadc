#!/usr/bin/env python
"""Where a verification step's time goes on a real target: the decoder body by tokens verified, and the lm_head by
rows of logits made, beside one plain decoding step; on a CPU with the layers prepacked as `eagle eval` runs them.

A large vocabulary makes the lm_head dominate: Gemma 3 270M's is 262,144 x 640, 671 MB in float32, read whole for
every call however few rows it makes. So what a step costs depends less on how many tokens it verifies than on how
many separate calls make the logits verification reads (eagle.lazy_logits).

    python scripts/verify_cost.py                          # Gemma 3 270M and SmolLM2-135M, after a 300-token cache
    python scripts/verify_cost.py --targets gemma3-270m --cache 200 --repeats 9

Prints a table per target and writes ``benchmarks/verify-cost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle.cache import crop_cache  # noqa: E402
from eagle.fileio import write_json_atomic  # noqa: E402
from eagle.targets import cache_kwarg, load_target, prepack_for_cpu  # noqa: E402

TOKENS = (1, 6, 11, 16, 22)
ROWS = (1, 6, 11, 16, 22)


def _median_ms(run, repeats: int) -> float:
    run()  # untimed: first-call allocations
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.no_grad()
def measure(name: str, cache_len: int, repeats: int) -> dict:
    """Median milliseconds of the decoder body over n new tokens after ``cache_len`` cached ones, and of the
    lm_head over r rows."""
    target = load_target(name)
    model = target.model
    prepack_for_cpu(model)
    body, lm_head, kw = model.get_decoder(), model.get_output_embeddings(), cache_kwarg(model)
    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    cache = None
    from transformers import DynamicCache

    cache = DynamicCache()
    model(torch.randint(10, vocab, (1, cache_len), generator=gen), use_cache=True, logits_to_keep=1, **{kw: cache})
    out = {"target": target.name, "vocab": vocab, "hidden": target.hidden_size, "cache_len": cache_len}
    for n in TOKENS:
        ids = torch.randint(10, vocab, (1, n), generator=gen)
        positions = torch.arange(cache_len, cache_len + n)[None]

        def step(ids=ids, positions=positions):
            body(input_ids=ids, position_ids=positions, use_cache=True, **{kw: cache})
            crop_cache(cache, cache_len)

        out[f"body_{n}_ms"] = _median_ms(step, repeats)
    hidden = torch.randn(max(ROWS), target.hidden_size, generator=gen)
    for r in ROWS:
        out[f"lm_head_{r}_ms"] = _median_ms(lambda r=r: lm_head(hidden[:r]), repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=["gemma3-270m", "smollm2-135m-instruct"])
    parser.add_argument("--cache", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "verify-cost.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(name, args.cache, args.repeats) for name in args.targets]
    for r in rows:
        print(f"{r['target']} (vocabulary {r['vocab']:,} x {r['hidden']}, {args.cache} cached tokens, "
              f"{args.threads} threads), median ms:")
        print("  decoder body by tokens: " + "  ".join(f"{n}: {r[f'body_{n}_ms']:.1f}" for n in TOKENS))
        print("  lm_head by rows:        " + "  ".join(f"{n}: {r[f'lm_head_{n}_ms']:.1f}" for n in ROWS))
    record = {"date": datetime.date.today().isoformat(), "threads": args.threads, "rows": rows}
    write_json_atomic(record, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
