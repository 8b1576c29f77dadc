#!/usr/bin/env bash
# The whole of one GPU session in one command (the device machine reaches no package registry: run it from a
# copy of the checkout with its .venv): a CUDA smoke test on a tiny random target, then recipe (a) (SmolLM2, one
# GPU, configs/smollm2_1gpu.yaml) in a time budget with the cuDNN-attention fix, its evaluation on the dev set,
# and a benchmark record of it all (training tokens/s, tau, speedup) in benchmarks/.
#
#   scripts/gpu_session.sh                 # a 7-minute budget for the recipe (about 9 minutes of GPU in all)
#   scripts/gpu_session.sh 5 [key=value]   # another budget; overrides go to the recipe
#   OUT=/some/dir scripts/gpu_session.sh   # also copy the run's report, metrics and plots there
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_preamble.sh" "$@"  # --help, repo root, .venv on PATH
MINUTES="${1:-7}"
shift || true
NAME="${NAME:-$(date +%F)-gpu-recipe-a-${MINUTES}min}"
RUN_DIR="${RUN_DIR:-runs/gpu-recipe-a}"
if [[ -z "${SKIP_SMOKE:-}" ]]; then
    timeout 180 python3 scripts/cuda_smoke.py
fi
bash scripts/gpu_recipe_a_short.sh "$MINUTES" run_dir="$RUN_DIR" "$@"
python3 scripts/summarize_run.py "$RUN_DIR" --name "$NAME" --out-dir "${BENCH_DIR:-benchmarks}"
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    cp "${BENCH_DIR:-benchmarks}/$NAME.json" "$RUN_DIR/eval/report.json" "$RUN_DIR/train/metrics.jsonl" "$OUT/" 2>/dev/null || true
    cp "$RUN_DIR"/eval/*.png "$RUN_DIR"/train/*.png "$OUT/" 2>/dev/null || true
fi
