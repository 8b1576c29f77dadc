#!/usr/bin/env bash
# Recipe (a) (configs/smollm2_1gpu.yaml: SmolLM2-135M-Instruct, EAGLE-3, one GPU) shrunk to a few minutes: the
# same stages through `eagle demo` with a time budget, so regeneration, training and evaluation each stop when
# their share of it is spent. What benchmarks/TUNING.md's GPU runs used; a quick look at a GPU before the full
# recipe (scripts/launch_1gpu.sh).
#
#   scripts/gpu_recipe_a_short.sh                          # 7 minutes, run_dir runs/smollm2-1gpu-short
#   scripts/gpu_recipe_a_short.sh 15 train.lr=3e-4         # another budget (minutes); key=value overrides
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_preamble.sh" "$@"  # --help, repo root, .venv on PATH
MINUTES="${1:-7}"
shift || true
# a bounded pool of prompts (regeneration answers what its share of the budget allows); eval: 128 new tokens on
# up to 20 prompts per set so that several of each set finish inside its share
python3 -m recipes demo --config configs/smollm2_1gpu.yaml --budget "$MINUTES" \
    run_dir=runs/smollm2-1gpu-short demo.reserve_minutes=0.5 data.max_conversations=3000 \
    eval.max_prompts=20 eval.max_new_tokens=128 "$@"
