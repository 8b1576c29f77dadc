#!/usr/bin/env bash
# The demo end to end on a CPU: SmolLM2-135M-Instruct (embedded), prepare with regeneration -> collect ->
# train -> export -> eval, everything under runs/demo/ (~22 minutes on 2 cores; no GPU, no network).
#
#   scripts/demo.sh                      # resumes: finished stages are skipped on a rerun
#   scripts/demo.sh --budget 60          # more data and steps for a better head
#   scripts/demo.sh --fresh train.lr=5e-4
#
# Arguments go to `eagle demo` (flags and key=value overrides of configs/smollm2_demo.yaml).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/_preamble.sh" "$@"  # --help, repo root, .venv on PATH
exec eagle demo --config configs/smollm2_demo.yaml "$@"
